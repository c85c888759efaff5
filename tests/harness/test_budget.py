"""Image size, presets and flags mean what they say on the command line: the resize follows the
image size, a preset that cannot read a folder is refused before any work, a flag the glyphs
cannot apply is refused rather than recorded, a budget that cannot learn is warned about and
its rows marked, a refused batch size is answered with one that fits. A refused folder through
the installed `pml-rank` script; the benches and the flag refusals through `cli.main`, its
function, in this process (a start of Python and torch per command is not needed)."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from pml_rank.harness import budget, recipes

PML_RANK = Path(sys.executable).with_name("pml-rank")
TINY = ["--trunk", "small-cnn", "--epochs", "1", "--iterations", "1", "--batch-size", "8", "--seeds", "1",
        "--workers", "1"]  # fmt: skip


def image_folder(root, num_classes=8, per_class=4, sizes=((20, 20),)):
    """`num_classes` folders of `per_class` random colour PNGs, their sizes taken in turn from `sizes`."""
    rng = np.random.default_rng(0)
    for c in range(num_classes):
        (root / f"class-{c:02d}").mkdir(parents=True)
        for i in range(per_class):
            width, height = sizes[(c * per_class + i) % len(sizes)]
            pixels = rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / f"class-{c:02d}" / f"{i}.png")
    return root


def pml_rank(*args, cwd):
    done = subprocess.run([str(PML_RANK), *map(str, args)], capture_output=True, text=True, cwd=cwd, timeout=900)
    return done.returncode, done.stdout, done.stderr


def assert_refused_before_any_work(status, stderr, out, *names):
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert status == 2 and len(lines) == 1 and "Traceback" not in stderr, stderr
    assert all(name in lines[0] for name in names), lines[0]
    assert not (out / "bench.db").exists()


def test_the_resize_is_the_reality_checks_256_of_227_unless_given():
    assert budget.resolve("cub200", image_size=227)["resize"] == 256
    assert budget.resolve("cub200", image_size=16)["resize"] == 18
    assert budget.resolve("cub200", image_size=16, resize=24)["resize"] == 24
    with pytest.raises(budget.BudgetError, match="--resize"):
        budget.resolve("cub200", image_size=16, resize=12)


@pytest.mark.slow  # benches
def test_the_resize_follows_the_image_size_unless_given_and_the_header_shows_both(tmp_path, run_cli):
    folder = image_folder(tmp_path / "images")
    for given, resize in (([], round(16 * 256 / 227)), (["--resize", "24"], 24)):
        out = tmp_path / f"out{len(given)}"
        status, printed, err = run_cli(
            ["bench", "pml:TripletMarginLoss", "--dataset", f"folder:{folder}", *TINY, "--image-size", "16",
             *given, "--out", out])  # fmt: skip
        assert status == 0, err
        config = json.loads((out / "bench.json").read_text())["config"]
        assert config["image_size"] == 16 and config["resize"] == resize
        assert f"16 px crops of a {resize} px resize" in printed


@pytest.mark.slow  # a pml-rank process
def test_the_glyphs_preset_on_images_of_several_sizes_is_refused_in_one_line_then_runs_with_a_size(tmp_path, run_cli):
    folder = image_folder(tmp_path / "images", sizes=((20, 20), (24, 18)))
    common = ["bench", "pml:TripletMarginLoss", "--dataset", f"folder:{folder}", "--preset", "glyphs", *TINY,
              "--classes", "8"]  # fmt: skip
    status, _, err = pml_rank(*common, "--out", tmp_path / "a", cwd=tmp_path)
    assert_refused_before_any_work(status, err, tmp_path / "a", "--image-size", "20x20", "24x18")
    status, _, err = run_cli([*common, "--image-size", "16", "--out", tmp_path / "b"])
    assert status == 0, err


@pytest.mark.parametrize("flag, value", [("--image-size", "64"), ("--augmentation", "crop-flip"), ("--resize", "40")])
def test_an_image_flag_on_the_glyphs_is_refused_not_recorded(tmp_path, flag, value, run_cli):
    status, _, err = run_cli(["bench", "pml:TripletMarginLoss", *TINY, flag, value, "--out", tmp_path / "o"])
    assert_refused_before_any_work(status, err, tmp_path / "o", flag, value, "glyphs")


@pytest.mark.slow  # benches
def test_random_init_at_the_reality_check_rate_is_warned_and_a_row_that_learned_nothing_is_marked(tmp_path, run_cli):
    folder = image_folder(tmp_path / "images")
    common = ["bench", "pml:TripletMarginLoss", "--dataset", f"folder:{folder}", *TINY, "--image-size", "16",
              "--random-init"]  # fmt: skip
    status, printed, err = run_cli([*common, "--out", tmp_path / "a"])
    assert status == 0, err
    warning = next(line for line in err.splitlines() if "warning" in line)
    assert "random weights" in warning and "--lr" in warning
    # At lr 1e-30 no weight moves: the trained row equals the untrained one and is marked.
    status, printed, err = run_cli([*common, "--lr", "1e-30", "--out", tmp_path / "b"])
    assert status == 0, err
    row = next(line for line in printed.splitlines() if line.startswith("pml:TripletMarginLoss"))
    assert row.startswith("pml:TripletMarginLoss (!)") and "(!) not above untrained" in printed


@pytest.mark.slow  # a pml-rank process
def test_too_few_classes_for_the_batch_suggests_a_batch_size_that_fits(tmp_path):
    folder = image_folder(tmp_path / "images", num_classes=12, per_class=2)
    rows = ["pml:TripletMarginLoss", "NPairsMCLoss"]
    status, _, err = pml_rank("bench", *rows, "--dataset", f"folder:{folder}", "--trunk", "small-cnn",
                              "--lr", "0.01", "--image-size", "16", "--out", tmp_path / "o", cwd=tmp_path)  # fmt: skip
    per_class = [recipe.per_class for recipe in recipes.rows(rows).values()]
    fitting = recipes.largest_batch_size(per_class, 12)
    assert fitting < budget.REALITY_CHECK["batch_size"]
    assert_refused_before_any_work(status, err, tmp_path / "o", "--classes", f"--batch-size {fitting} fits 12 classes")
    assert all(budget.minimum_classes(m, fitting) <= 12 for m in per_class)
    assert any(budget.minimum_classes(m, fitting + 4) > 12 for m in per_class)  # the next multiple of 4 does not fit
