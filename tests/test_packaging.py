"""The distributions a user installs: built offline from this checkout's files, without a
warning; the wheel carries the package, its run-time data and the license, and no tests
or results; the sdist ships no tests (they need the checkout); the metadata passes
`twine check --strict`; one version everywhere."""

import os
import subprocess
import sys
import tarfile
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

import pml_rank

pytestmark = pytest.mark.slow  # builds the distributions

ROOT = Path(__file__).resolve().parents[1]

# The files the library and the bench read at run time.
RUNTIME_DATA = ["pml_rank/losses/auc_slopes.json", "pml_rank/harness/tuned_glyphs.json"]


def _checkout_files():
    """The checkout's files as a clean clone would have them, uncommitted edits included."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    return [name for name in listed.split("\0") if name and (ROOT / name).is_file()]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """``(build output, wheel path, sdist path)``, built from a copy of the checkout."""
    source = tmp_path_factory.mktemp("checkout")
    for name in _checkout_files():
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        (source / name).write_bytes((ROOT / name).read_bytes())
    out = tmp_path_factory.mktemp("dist")
    # No isolation: the test environment already has setuptools, and the test runs offline.
    # PYTHONDONTWRITEBYTECODE (set on some machines) makes setuptools warn that it skips
    # byte-compiling, a warning about the environment, not the project.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    result = subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--sdist", "--wheel", "--outdir", str(out), str(source)],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-5000:]
    (wheel,) = out.glob("*.whl")
    (sdist,) = out.glob("*.tar.gz")
    return output, wheel, sdist


def _wheel_metadata(wheel):
    with zipfile.ZipFile(wheel) as archive:
        (name,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        return Parser().parsestr(archive.read(name).decode())


def test_the_build_prints_no_warning(built):
    output, _, _ = built
    lines = [line for line in output.splitlines() if "warn" in line.lower() or "deprecat" in line.lower()]
    assert not lines, "\n".join(lines)


def test_the_wheel_carries_the_package_its_data_and_the_license_and_nothing_else(built):
    _, wheel, _ = built
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
    package = {name for name in _checkout_files() if name.startswith("pml_rank/") and name.endswith(".py")}
    assert package <= names
    assert set(RUNTIME_DATA) <= names
    (dist_info,) = {name.split("/")[0] for name in names if ".dist-info/" in name}
    assert f"{dist_info}/licenses/LICENSE" in names
    outside = {name for name in names if not name.startswith(("pml_rank/", f"{dist_info}/"))}
    assert not outside, f"the wheel carries files outside the package: {sorted(outside)}"
    # Inside the package: its modules and the run-time data, no results, databases or figures.
    others = {name for name in names if name.startswith("pml_rank/")} - package - set(RUNTIME_DATA)
    assert not others, f"the wheel carries {sorted(others)}"


def test_the_sdist_ships_no_tests_but_the_license_and_the_changelog(built):
    _, _, sdist = built
    with tarfile.open(sdist) as archive:
        names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    assert {"LICENSE", "CHANGELOG.md", "README.md", "pyproject.toml", *RUNTIME_DATA} <= names
    assert not [name for name in names if name.startswith(("tests/", "plugins/", "examples/"))]


def test_the_metadata_passes_twine_check_strict(built):
    _, wheel, sdist = built
    result = subprocess.run(
        [sys.executable, "-m", "twine", "check", "--strict", str(wheel), str(sdist)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_license_is_an_spdx_expression_with_its_file(built):
    _, wheel, _ = built
    metadata = _wheel_metadata(wheel)
    assert metadata["License-Expression"] == "MIT"
    assert metadata.get_all("License-File") == ["LICENSE"]
    assert "MIT License" in (ROOT / "LICENSE").read_text()
    assert not [c for c in metadata.get_all("Classifier") if c.startswith("License ::")]


def test_one_version_everywhere(built):
    _, wheel, _ = built
    version = _wheel_metadata(wheel)["Version"]
    assert pml_rank.__version__ == version
    cli = Path(sys.executable).parent / "pml-rank"
    result = subprocess.run([cli, "--version"], capture_output=True, text=True, check=True)
    assert result.stdout.split() == ["pml-rank", version]
    assert f"## [{version}]" in (ROOT / "CHANGELOG.md").read_text()
