"""README.md as a user meets it, on GitHub or on the package index: every Python block (its
own and examples/README.md's) runs as copied into a file of an empty folder, and every link
works away from the checkout."""

import os
import re
import subprocess
import sys
from importlib.metadata import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
EXAMPLES_README = (ROOT / "examples" / "README.md").read_text(encoding="utf-8")
# pyproject.toml's [project.urls], as the installed distribution declares them.
PROJECT_URLS = dict(entry.split(", ", 1) for entry in metadata("pml-rank").get_all("Project-URL"))


def python_blocks(markdown=README):
    """``(heading above it, code)`` for every ```python block of `markdown`."""
    blocks, heading = [], "top"
    for match in re.finditer(r"^(#+ [^\n]*)$|^```python\n(.*?)^```$", markdown, flags=re.MULTILINE | re.DOTALL):
        if match.group(1):
            heading = match.group(1).lstrip("# ")
        else:
            blocks.append((heading, match.group(2)))
    return blocks


def test_the_readme_has_python_blocks_and_the_first_trains_and_evaluates():
    assert len(python_blocks()) >= 5
    _, first = python_blocks()[0]
    assert "trainers.MetricLossOnly" in first and "testers.GlobalEmbeddingSpaceTester" in first


@pytest.mark.slow  # a Python process per block
@pytest.mark.parametrize(
    "code",
    [
        pytest.param(code, id=f"{name}-{i}-{heading}")
        for name, markdown in (("README", README), ("examples", EXAMPLES_README))
        for i, (heading, code) in enumerate(python_blocks(markdown))
    ],
)
def test_a_python_block_runs_as_copied_from_an_empty_folder(code, tmp_path):
    script = tmp_path / "block.py"
    script.write_text(code, encoding="utf-8")
    # This checkout's pml_rank, as the rest of the suite imports it (pytest's pythonpath).
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, script.name], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900
    )
    assert result.returncode == 0, f"the block exits {result.returncode}:\n{code}\n{result.stderr[-3000:]}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["block.py"], "a block leaves files behind"


def test_links_work_away_from_the_checkout():
    """The package index shows the README without the repository: links are absolute or
    within the page, and those into the repository use the URL pyproject.toml names."""
    repository = PROJECT_URLS["Source"]
    targets = re.findall(r"\]\(([^)\s]+)\)", README)
    assert targets
    for target in targets:
        assert target.startswith(("https://", "#")), f"README links to {target!r}, dead on the package index"
    mentions = re.findall(r"https://github\.com/[\w.-]+/pml-rank\b", README)
    assert mentions and set(mentions) == {repository}
    assert all(url.startswith(repository) for url in PROJECT_URLS.values())


def _anchors(markdown):
    """The anchors GitHub gives the headings of `markdown`: lower case, punctuation
    dropped, spaces as hyphens."""
    headings = re.findall(r"^#+ (.*)$", markdown, flags=re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") for heading in headings}


def test_links_into_the_repository_and_the_page_name_what_exists():
    repository = PROJECT_URLS["Source"]
    for target in re.findall(r"\]\(([^)\s]+)\)", README):
        if target.startswith("#"):
            path, anchor = "README.md", target[1:]
        elif target.startswith(f"{repository}/blob/main/") or target.startswith(f"{repository}/tree/main/"):
            path, _, anchor = target.split("/main/", 1)[1].partition("#")
        else:
            continue
        assert (ROOT / path).exists(), f"README links to {target}: no {path} in the repository"
        if anchor:
            assert anchor in _anchors((ROOT / path).read_text(encoding="utf-8")), f"README links to {target}"
