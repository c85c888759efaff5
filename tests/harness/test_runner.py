"""The experiment runner on every kind of data set: a folder of images (the glyphs written
to disk give the glyphs' table), the papers' layouts under the Reality Check preset (bench
and tune end to end on the tiny generated copies), trunks' weights from the torch cache,
and the data problems refused before any training."""

import dataclasses
import itertools
import json
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from pml_rank.cli import main
from pml_rank.harness import backbones, recipes, runner
from pml_rank.harness.budget import BudgetError, resolve
from pml_rank.harness.data import load_glyphs, tiny_layouts
from pml_rank.harness.datasets import ImageFolder, image_transforms
from pml_rank.harness.evaluation import accuracy, compute_embeddings

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

GLYPH_BUDGET = ["--classes", "24", "--epochs", "1", "--iterations", "3", "--batch-size", "16", "--seeds", "2"]


def write_glyph_folder(root, num_classes=24):
    """The first glyph classes as PNG files, one folder per class, in the data set's order."""
    glyphs = load_glyphs(num_classes=num_classes)
    for index, (image, label) in enumerate(zip(glyphs.images, glyphs.labels)):
        folder = root / f"class-{label:03d}"
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(image).save(folder / f"{index:05d}.png")
    return root


def bench_rows(out):
    return {row["row"]: row["runs"] for row in json.loads((out / "bench.json").read_text())["rows"]}


def test_a_folder_of_the_glyphs_gives_the_glyphs_table(tmp_path, glyph_cache, monkeypatch):
    monkeypatch.setenv("PML_RANK_CACHE", str(glyph_cache))
    folder = write_glyph_folder(tmp_path / "glyphs")
    rows = ["AUCLoss", "NPairsMCLoss"]
    common = [*rows, *GLYPH_BUDGET, "--untuned", "--workers", "1", "--cache-dir", str(glyph_cache)]
    assert main(["bench", *common, "--out", str(tmp_path / "a")]) == 0
    assert (
        main(["bench", *common, "--dataset", f"folder:{folder}", "--preset", "glyphs", "--out", str(tmp_path / "b")])
        == 0
    )
    a, b = bench_rows(tmp_path / "a"), bench_rows(tmp_path / "b")
    assert list(a) == list(b) == ["raw input", "untrained", *rows]
    assert a == b  # every seed's accuracies, exactly


def test_a_grayscale_folder_stays_single_channel(tmp_path):
    folder = write_glyph_folder(tmp_path / "glyphs", num_classes=3)
    data = ImageFolder(folder)
    assert data.channels == 1 and data.classes == ["class-000", "class-001", "class-002"]
    assert list(data.labels) == sorted(data.labels)
    image, label = data[0]
    assert image.mode == "L" and label == 0


@pytest.mark.parametrize(
    "problem, expected",
    [("single", "has 1 image(s); every class needs 2 or more"), ("broken", "cannot read image"), ("empty", "is empty")],
)
def test_folder_problems_are_refused_before_any_training(tmp_path, problem, expected, capsys):
    folder = write_glyph_folder(tmp_path / "glyphs", num_classes=10)
    target = sorted((folder / "class-004").iterdir())
    if problem == "single":
        for path in target[1:]:
            path.unlink()
        named = folder / "class-004"
    else:
        target[0].write_bytes(b"" if problem == "empty" else b"\x89PNG\r\n\x1a\n broken")
        named = target[0]
    status = main(
        [
            "bench",
            "pml:TripletMarginLoss",
            "--dataset",
            f"folder:{folder}",
            "--trunk",
            "small-cnn",
            "--out",
            str(tmp_path / "o"),
        ]
    )
    err = capsys.readouterr().err
    assert status == 2 and expected in err and str(named) in err and "Traceback" not in err
    assert not (tmp_path / "o" / "bench.db").exists()


@pytest.mark.parametrize("dataset", ["cub200", "cars196", "sop", "inshop"])
def test_the_reality_check_preset_runs_bench_end_to_end_on_each_layout(dataset, tmp_path, capsys):
    root = tiny_layouts.make_all(tmp_path / "data", size=24, only=[dataset])
    tiny = ["--trunk", "small-cnn", "--image-size", "16", "--epochs", "1", "--iterations", "1", "--batch-size", "8"]
    args = ["bench", "pml:TripletMarginLoss", "--dataset", dataset, "--data-root", str(root), "--preset",
            "reality-check", *tiny, "--seeds", "1", "--workers", "1", "--out", str(tmp_path / "out")]  # fmt: skip
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert f"on {dataset} (preset reality-check)" in printed and "rmsprop lr 1e-06" in printed
    config = json.loads((tmp_path / "out" / "bench.json").read_text())["config"]
    # The preset's values, but where a flag overrode them.
    assert config["optimizer"] == "rmsprop" and config["lr"] == 1e-6 and config["momentum"] == 0.9
    assert (
        config["freeze_batchnorm"]
        and config["embedding_size"] == 128
        and config["augmentation"] == "random-resized-crop"
    )
    assert config["patience"] == (39 if dataset == "sop" else 9) and config["num_classes"] == "all"
    assert config["trunk"] == "small-cnn" and config["image_size"] == 16 and config["epochs"] == 1
    rows = bench_rows(tmp_path / "out")
    assert list(rows) == ["untrained", "pml:TripletMarginLoss"]  # no raw-pixel row for photographs


def test_the_reality_check_preset_runs_tune_end_to_end(tmp_path, capsys):
    root = tiny_layouts.make_all(tmp_path / "data", size=24, only=["cub200"])
    args = ["tune", "pml:TripletMarginLoss", "--dataset", "cub200", "--data-root", str(root), "--preset",
            "reality-check", "--trunk", "small-cnn", "--image-size", "16", "--epochs", "1", "--iterations", "1",
            "--batch-size", "8", "--trials", "2", "--workers", "1", "--out", str(tmp_path / "out")]  # fmt: skip
    assert main(args) == 0
    entry = json.loads((tmp_path / "out" / "tuned.json").read_text())["pml:TripletMarginLoss"]
    assert entry["trials"] == 2 and entry["budget"]["preset"] == "reality-check"
    assert entry["budget"]["dataset"] == "cub200" and "--data-root" in entry["command"]


@pytest.mark.parametrize("dataset", ["cub200", "inshop"])
def test_the_standard_protocol_runs_bench_end_to_end_and_its_model_gives_the_table(dataset, tmp_path, capsys):
    """`--protocol standard`: one model per seed trained on the data set's training split,
    measured on its test split (in-shop: its queries among its gallery); the model the bench
    kept, on the test split loaded back, gives the bench's numbers."""
    root = tiny_layouts.make_all(tmp_path / "data", size=24, only=[dataset])
    tiny = ["--trunk", "small-cnn", "--image-size", "16", "--epochs", "2", "--iterations", "1", "--batch-size", "8"]
    args = ["bench", "pml:TripletMarginLoss", "--dataset", dataset, "--data-root", str(root), "--protocol",
            "standard", *tiny, "--seeds", "1", "--workers", "1", "--save-models",
            "--out", str(tmp_path / "out")]  # fmt: skip
    assert main(args) == 0
    assert f"Standard protocol on {dataset} (preset reality-check)" in capsys.readouterr().out
    config = json.loads((tmp_path / "out" / "bench.json").read_text())["config"]
    assert config["protocol"] == "standard" and config["num_folds"] is None and config["patience"] is None
    rows = bench_rows(tmp_path / "out")
    assert list(rows) == ["untrained", "pml:TripletMarginLoss"]
    [measured] = rows["pml:TripletMarginLoss"]
    assert measured["concatenated"] == measured["separated"]  # one model
    [folder] = (tmp_path / "out" / "models" / "pml_TripletMarginLoss").glob("*/seed0")
    [(trunk, embedder)] = runner.load_models(folder)
    budget = json.loads((folder / "experiment.json").read_text())["budget"]
    splits = runner.standard_splits(budget, runner.Machine(data_root=str(root)), image_transforms(budget, 3))
    test_set = runner.load_test_set(folder, data_root=str(root))
    reference_set = runner.load_reference_set(folder, data_root=str(root))
    assert list(test_set.labels) == list(splits.query.labels)
    assert (dataset == "inshop") == (reference_set is not None)  # in-shop's queries among its gallery
    if reference_set is not None:
        assert list(reference_set.labels) == list(splits.reference.labels)
    query, query_labels = compute_embeddings(trunk, test_set, embedder, normalize=True)
    reference = reference_labels = None
    if reference_set is not None:
        reference, reference_labels = compute_embeddings(trunk, reference_set, embedder, normalize=True)
    scores = accuracy(query, query_labels, reference, reference_labels)
    for metric, value in measured["concatenated"].items():
        assert scores[metric] == pytest.approx(value, abs=1e-6), metric


def _first_batch_counts(recipe, labels, batch_size):
    """Items of each class in the first batch the recipe's sampler draws."""
    sampler = recipe.make_sampler(types.SimpleNamespace(labels=labels), batch_size=batch_size)
    first = list(itertools.islice(iter(sampler), batch_size))
    return set(np.unique(labels[first], return_counts=True)[1])


def test_the_budgets_batches_reach_each_rows_sampler():
    """--samples-per-class and --class-mining change the sampler a row trains with, its
    miner kept; without them each row keeps its own."""
    labels = np.repeat(np.arange(16), 10)
    changed = resolve("cub200", "reality-check", samples_per_class=8, class_mining=False)
    for row in ("AUCLoss", "pml:TripletMarginLoss"):
        recipe = runner.recipe_of(changed, row, {})
        assert recipe.per_class == 8 and _first_batch_counts(recipe, labels, 32) == {8}, row
    assert runner.recipe_of(changed, "AUCLoss").make_miner is not None
    random_pairs = runner.recipe_of(changed, "NPairsMCLoss")
    assert random_pairs.per_class == 2 and _first_batch_counts(random_pairs, labels, 32) == {2}
    own = resolve("cub200", "reality-check")
    assert runner.recipe_of(own, "pml:TripletMarginLoss", {}).per_class == 4
    assert runner.recipe_of(own, "NPairsMCLoss").make_sampler is recipes.hard_negative_classes
    with pytest.raises(BudgetError, match="--batch-size"):  # the checks see the budget's batches
        three = resolve("cub200", "reality-check", samples_per_class=3)
        runner.check_rows(three, runner.recipes_for(three, ["AUCLoss"]))


def test_a_trunk_reads_its_weights_from_the_torch_cache_and_a_missing_file_is_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path / "hub"))
    root = tiny_layouts.make_all(tmp_path / "data", size=24, only=["cub200"])
    args = ["bench", "pml:TripletMarginLoss", "--dataset", "cub200", "--data-root", str(root), "--trunk", "resnet50",
            "--out", str(tmp_path / "out")]  # fmt: skip
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "resnet50-0676ba61.pth" in err and "--random-init" in err and "Traceback" not in err
    import torchvision

    torch.manual_seed(3)
    saved = torchvision.models.resnet50(weights=None).state_dict()
    (tmp_path / "hub" / "checkpoints").mkdir(parents=True)
    torch.save(saved, backbones.BACKBONES["resnet50"].weights_file())
    budget = resolve("cub200", trunk="resnet50")
    make_trunk, make_embedder = runner.model_factories(budget, channels=3)
    trunk = make_trunk()
    torch.testing.assert_close(trunk.conv1.weight, saved["conv1.weight"])
    assert make_embedder().in_features == 2048 and make_embedder().out_features == 128


def test_mixed_precision_trains_a_fold_model(glyph_cache):
    budget = resolve("glyphs", num_classes=24, epochs=1, iterations_per_epoch=2, batch_size=16, amp=True)
    outcome = runner.run(budget, "pml:TripletMarginLoss", {}, 0, runner.Machine(cache_dir=str(glyph_cache)))
    assert np.isfinite([fold[0]["loss"] for fold in outcome["histories"]]).all()


@pytest.mark.cuda
def test_one_fold_model_trains_on_cuda(glyph_cache):
    budget = resolve("glyphs", num_classes=24, epochs=1, iterations_per_epoch=2, batch_size=16)
    machine = runner.Machine(cache_dir=str(glyph_cache), device="cuda")
    outcome = runner.run(budget, "AUCLoss", {}, 0, machine)
    assert 0 < outcome["run"]["concatenated"]["mean_average_precision_at_r"] <= 1


def test_the_raw_input_row_searches_where_the_experiment_runs(glyph_cache, monkeypatch):
    """The raw input row's neighbours are searched on the machine's device, not on whatever GPU
    torch sees: on a GPU machine, a bench on its CPU cores (--device cpu, the default) measures
    the row with faiss on the CPU, as a CPU machine does. Here torch is told it sees a GPU, where
    a search would fail."""
    budget = resolve("glyphs", num_classes=24)
    machine = runner.Machine(cache_dir=str(glyph_cache))
    on_a_cpu_machine = runner.run(budget, runner.RAW_INPUT, {}, 0, machine)["run"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert runner.run(budget, runner.RAW_INPUT, {}, 0, machine)["run"] == on_a_cpu_machine


def test_class_weight_losses_get_each_folds_classes_as_0_to_n(glyph_cache):
    """A fold trains on the partitions it does not validate on: its classes are not 0 .. n - 1.
    The loss gets one weight per training class, and sees labels mapped to 0 .. n - 1 in order."""
    from pml_rank.harness import recipes
    from pml_rank.harness.evaluation import TrainingConfig, run_protocol, test_set_and_folds

    recipe = recipes.rows(["pml:NormalizedSoftmaxLoss"])["pml:NormalizedSoftmaxLoss"]
    made = []

    def make_loss(**needs):
        loss = recipe.make_loss(**needs)
        seen = []
        forward = loss.forward
        loss.forward = lambda embeddings, labels, *args, **kwargs: (
            seen.append(labels.tolist()) or forward(embeddings, labels, *args, **kwargs)
        )
        made.append((needs["num_classes"], loss, seen))
        return loss

    data = load_glyphs(cache_dir=glyph_cache, num_classes=16)
    folds, _ = test_set_and_folds(data, 4)
    run_protocol(
        data,
        dataclasses.replace(recipe, make_loss=make_loss),
        lambda: runner.model_factories(resolve("glyphs", embedding_size=8), 1)[0](),
        TrainingConfig.from_budget(resolve("glyphs", epochs=1, batch_size=8, iterations_per_epoch=2, embedding_size=8)),
        validation_only=True,
    )
    classes = [sorted(set(np.asarray(train_set.labels).tolist())) for train_set, _ in folds]
    assert classes[0] == [2, 3, 4, 5, 6, 7]  # 8 training classes, the first fold validates on 0 and 1
    for fold_classes, (num_classes, loss, seen) in zip(classes, made, strict=True):
        assert num_classes == len(fold_classes) == 6 and loss.W.shape == (8, 6)
        assert seen and all(0 <= label < 6 for labels in seen for label in labels)


def test_saved_models_are_the_ones_the_bench_measured(tmp_path, glyph_cache):
    """`--save-models` keeps each trained (row, seed)'s fold models: loaded back with
    `runner.load_models`, they give exactly the bench's test accuracies."""
    from pml_rank.harness.evaluation import compute_embeddings, concatenated_and_separated, test_set_and_folds

    out = tmp_path / "out"
    rows = ["pml:TripletMarginLoss", "AUCLoss"]
    command = ["bench", *rows, *GLYPH_BUDGET, "--untuned", "--workers", "1", "--cache-dir", str(glyph_cache)]
    assert main([*command, "--epochs", "3", "--save-models", "--out", str(out)]) == 0  # best epoch: any of 3
    saved = sorted(path.relative_to(out / "models") for path in (out / "models").glob("*/*/seed*"))
    expected = [(row, seed) for row in ("AUCLoss", "pml_TripletMarginLoss") for seed in ("seed0", "seed1")]
    assert [(p.parts[0], p.parts[2]) for p in saved] == expected
    assert not list((out / "models").rglob("*.partial-*"))  # only complete experiments, no rows without training
    measured = bench_rows(out)
    for path in saved:
        folder = out / "models" / path
        record = json.loads((folder / "experiment.json").read_text())
        budget = record["budget"]
        _, test_set = test_set_and_folds(runner.dataset_of(budget, runner.Machine(cache_dir=str(glyph_cache))))
        models = runner.load_models(folder)
        assert len(models) == budget["num_folds"] == 4
        embeddings = [compute_embeddings(trunk, test_set, embedder)[0] for trunk, embedder in models]
        scores = concatenated_and_separated(embeddings, np.asarray(test_set.labels))
        run = measured[record["row"]][record["seed"]]
        for kind in ("concatenated", "separated"):
            for metric, value in run[kind].items():
                assert scores[kind][metric] == pytest.approx(value, abs=1e-6), (path, kind, metric)


def test_a_dead_processs_partial_models_are_removed_a_live_ones_kept(tmp_path):
    import socket
    import subprocess

    final = tmp_path / "AUCLoss" / "setup" / "seed0"
    final.parent.mkdir(parents=True)
    finished = subprocess.Popen(["true"])
    finished.wait()  # reaped: its process id runs nothing now
    host = socket.gethostname()
    dead = final.parent / f"seed0.partial-{host}-{finished.pid}"
    dead.mkdir()
    live = final.parent / f"seed0.partial-{host}-{os.getppid()}"
    live.mkdir()
    mine = runner._start_partial_folder(final)
    assert mine.is_dir() and mine.name == f"seed0.partial-{host}-{os.getpid()}"
    assert live.is_dir() and not dead.exists()


def write_colour_folder(root, num_classes=16, per_class=4, size=24):
    """Colour photographs stand-ins: a colour per class plus noise, JPEG files."""
    rng = np.random.default_rng(0)
    for label in range(num_classes):
        (root / f"class{label:02d}").mkdir(parents=True)
        base = rng.integers(0, 256, 3)
        for index in range(per_class):
            pixels = np.clip(base + rng.integers(-60, 61, (size, size, 3)), 0, 255).astype(np.uint8)
            Image.fromarray(pixels).save(root / f"class{label:02d}" / f"{index}.jpg")
    return root


def _readme_block(containing):
    readme = (Path(__file__).parents[2] / "examples" / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, flags=re.S)
    return next(block for block in blocks if containing in block)


def test_saved_models_on_a_folder_reproduce_the_table_with_the_bench_test_set(tmp_path, monkeypatch):
    """`runner.load_test_set` gives the test set as the bench evaluated it (the folder's
    test classes through the evaluation transform): with `load_models`, the bench's test
    accuracies exactly; examples/README.md's example (Saved models), run as written, prints the table row."""
    from pml_rank.harness.evaluation import METRICS, compute_embeddings, concatenated_and_separated

    folder = write_colour_folder(tmp_path / "photos")
    cache = tmp_path / "cache"
    tiny = ["--trunk", "small-cnn", "--image-size", "16", "--epochs", "2", "--iterations", "2", "--batch-size", "8"]
    args = ["bench", "AUCLoss", "--dataset", f"folder:{folder}", *tiny, "--seeds", "2", "--workers", "1", "--untuned",
            "--save-models", "--cache-dir", str(cache), "--out", str(tmp_path / "out")]  # fmt: skip
    assert main(args) == 0
    measured = bench_rows(tmp_path / "out")["AUCLoss"]
    saved = sorted((tmp_path / "out" / "models" / "AUCLoss").glob("*/seed*"))
    assert [path.name for path in saved] == ["seed0", "seed1"]
    for seed, path in enumerate(saved):
        test_set = runner.load_test_set(path, cache_dir=cache)
        assert runner.load_reference_set(path, cache_dir=cache) is None  # queries among the test set itself
        image, _ = test_set[0]
        assert isinstance(image, torch.Tensor) and image.shape == (3, 16, 16)
        embeddings = [compute_embeddings(trunk, test_set, embedder)[0] for trunk, embedder in runner.load_models(path)]
        scores = concatenated_and_separated(embeddings, test_set.labels)
        for kind in ("concatenated", "separated"):
            for metric, value in measured[seed][kind].items():
                assert scores[kind][metric] == pytest.approx(value, abs=1e-6), (seed, kind, metric)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PML_RANK_CACHE", str(cache))
    done = subprocess.run(
        [sys.executable, "-c", _readme_block("load_test_set")], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr
    row, *printed = done.stdout.split()
    means = [np.mean([run[kind][m] for run in measured]) for kind in ("concatenated", "separated") for m in METRICS]
    assert row == "AUCLoss" and len(printed) == len(means) == 6
    for shown, mean in zip(printed, means):  # the table's two decimals, rounded from equal values
        assert float(shown) == pytest.approx(100 * mean, abs=0.0051)


@pytest.mark.parametrize("dataset", ["cub200", "cars196", "sop", "inshop"])
def test_a_papers_data_set_without_data_root_says_what_goes_where(dataset, tmp_path, capsys):
    from pml_rank.harness.data import real

    layout = real.DATASETS[dataset].layout
    args = ["bench", "AUCLoss", "--dataset", dataset, "--trunk", "small-cnn", "--out", str(tmp_path / "out")]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert f"--data-root: <data-root>/{layout.folder}/ holds" in err and layout.download in err
    assert all(name in err for name in layout.required)
    section = re.search(r'section "([^"]+)" of (\S+\.md)', err)
    headings = (Path(__file__).parents[2] / section[2]).read_text().splitlines()
    assert f"## {section[1]}" in headings  # the section it points to exists
    assert not (tmp_path / "out" / "bench.db").exists()
