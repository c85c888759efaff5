"""The package's layout rules that no linter checks."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "pml_rank"
# The command line imports the harness inside its commands so that --help answers without
# torch; a package's __init__ may load its parts on first use.
LAZY_IMPORTS_ALLOWED = ("cli.py", "__init__.py")


def _imports_own_module(node):
    if isinstance(node, ast.ImportFrom):
        return node.level > 0 or (node.module or "").split(".")[0] == "pml_rank"
    return isinstance(node, ast.Import) and any(alias.name.split(".")[0] == "pml_rank" for alias in node.names)


def function_level_own_imports(source):
    """The line numbers of the imports of pml-rank's own modules inside a function of `source`."""
    lines = set()
    for function in ast.walk(ast.parse(source)):
        if isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
            lines |= {node.lineno for node in ast.walk(function) if _imports_own_module(node)}
    return sorted(lines)


def test_only_cli_and_init_files_import_the_package_inside_functions():
    paths = [path for path in sorted(PACKAGE.rglob("*.py")) if path.name not in LAZY_IMPORTS_ALLOWED]
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{line}"
        for path in paths
        for line in function_level_own_imports(path.read_text())
    ]
    assert len(paths) > 20 and found == []


def test_the_rule_sees_own_imports_in_functions_only():
    source = "\n".join(
        [
            "from . import runner",  # 1: at the top, allowed
            "import pml_rank",  # 2
            "def f():",  # 3
            "    import numpy",  # 4: not ours
            "    from .data import SmallCNN",  # 5
            "    class Inner:",  # 6
            "        def g(self):",  # 7
            "            import pml_rank.harness",  # 8
            "            from pml_rank import losses",  # 9
            '    """from . import docstrings"""',  # 10: not code
        ]
    )
    assert function_level_own_imports(source) == [5, 8, 9]


LONGEST_FUNCTION = 100  # lines: a longer one does several things


def long_functions(source):
    """``(name, lines)`` of every function of `source` longer than `LONGEST_FUNCTION` lines."""
    return [
        (node.name, node.end_lineno - node.lineno + 1)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno - node.lineno + 1 > LONGEST_FUNCTION
    ]


def test_no_function_of_the_package_is_over_100_lines():
    found = [
        f"{path.relative_to(PACKAGE.parent)}: {name}, {lines} lines"
        for path in sorted(PACKAGE.rglob("*.py"))
        for name, lines in long_functions(path.read_text())
    ]
    assert found == []


def test_the_length_rule_counts_a_function_from_its_def_to_its_last_line():
    body = "\n".join(f"    x{i} = {i}" for i in range(LONGEST_FUNCTION - 1))
    assert long_functions(f"def f():\n{body}\n") == []
    assert long_functions(f"def f():\n{body}\n    return 0\n") == [("f", LONGEST_FUNCTION + 1)]


def imported_modules(source, package):
    """The absolute names of what `source`, a module of `package` ("pml_rank.losses"), imports."""
    names = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            module = ".".join(filter(None, [base, node.module]))
            names += [module, *(f"{module}.{alias.name}" for alias in node.names)]
    return names


def test_the_library_never_imports_the_harness():
    """The library (every module but the harness and the command line) stands under the harness:
    `pip install pml-rank` users import none of it."""
    library = [p for p in sorted(PACKAGE.rglob("*.py")) if "harness" not in p.parts and p.name != "cli.py"]
    found = [
        f"{path.relative_to(PACKAGE.parent)} imports {name}"
        for path in library
        for name in imported_modules(path.read_text(), ".".join(path.relative_to(PACKAGE.parent).parent.parts))
        if name.startswith("pml_rank.harness")
    ]
    assert len(library) > 10 and found == []


def test_imported_modules_resolves_relative_imports():
    assert "pml_rank.harness.baselines.pnp_space" in imported_modules(
        "from ..harness.baselines import pnp_space", "pml_rank.losses"
    )
    assert "pml_rank.harness" in imported_modules("from . import harness", "pml_rank")
    assert imported_modules("import pml_rank.harness.tune", "pml_rank") == ["pml_rank.harness.tune"]
