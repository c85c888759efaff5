"""The example scripts that reproduce the papers' tables and their machinery
(`pml_rank.harness.reproduce`)."""

import dataclasses
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from pytorch_metric_learning.utils.accuracy_calculator import AccuracyCalculator

from pml_rank.harness import backbones, reproduce, runner
from pml_rank.harness.budget import BudgetError, resolve
from pml_rank.harness.data import SmallCNN, tiny_layouts
from pml_rank.harness.data.real import DATASETS
from pml_rank.harness.evaluation import TrainingConfig, accuracy, protocol
from pml_rank.harness.evaluation.training import _optimized
from pml_rank.harness.reproduce.running import SMOKE

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SCRIPTS = {p.stem: p for p in sorted(EXAMPLES.glob("*.py")) if "SCRIPT = Script(" in p.read_text()}


def load(name):
    spec = importlib.util.spec_from_file_location(f"example_{name}", SCRIPTS[name])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.SCRIPT


def test_every_reproduced_table_has_a_script():
    assert {"auc_cub200", "rambo_retrieval", "rambo_ablation", "npair_table2", "fastap_sop", "reality_check"} <= set(
        SCRIPTS
    )
    datasets = {name: set(load(name).variants) for name in SCRIPTS}
    assert datasets["auc_cub200"] == {"cub200", "cub200-cropped"}
    assert datasets["reality_check"] == {"cub200", "cars196", "sop"}
    assert {"cub200", "cars196"} <= datasets["npair_table2"]
    assert {"cub200", "inshop", "sop"} == datasets["rambo_ablation"]
    assert "sop" in datasets["fastap_sop"]


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_every_run_names_a_paper_row_that_exists(name):
    for variant in load(name).variants.values():
        for run in variant.runs:
            if run.paper_row is not None:
                assert run.paper_row in variant.table.rows, (variant.dataset, run.label)
        for row, numbers in variant.table.rows.items():
            cells = len(variant.table.metrics) * (2 if variant.setup.protocol == "reality-check" else 1)
            assert len(numbers) == cells, (variant.dataset, row)


def _check_output(script, variant, out_dir, stdout, expect_rows):
    path = out_dir / f"reproduce-{script.name}-{variant.dataset}-smoke.json"
    result = json.loads(path.read_text())
    assert set(result["ours"]) == expect_rows
    for values in result["ours"].values():
        flat = (
            [v for kind in values.values() for v in kind.values()]
            if "concatenated" in values
            else list(values.values())
        )
        for value in flat:
            value = value[0] if isinstance(value, list) else value
            assert 0 <= value <= 100
    # the paper's numbers are printed beside ours, as the paper writes them
    first_row, numbers = next(iter(variant.table.rows.items()))
    assert first_row in stdout
    first = numbers[0][0] if isinstance(numbers[0], tuple) else numbers[0]
    assert str(first) in stdout


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_smoke_run_of_every_script(name, tmp_path, capsys):
    """Each script as a user runs it with --smoke: its own losses, miners and samplers."""
    script = load(name)
    assert script.main(["--smoke", "--out", str(tmp_path)]) == 0
    variant = next(iter(script.variants.values()))
    rows = {r.label for r in variant.runs if not script.smoke_rows or r.label in script.smoke_rows}
    _check_output(script, variant, tmp_path, capsys.readouterr().out, rows)


def test_smoke_reads_a_query_gallery_data_set(tmp_path, capsys):
    script = load("rambo_ablation")
    code = script.main(["--smoke", "--dataset", "inshop", "--only", "margin=0", "--out", str(tmp_path)])
    assert code == 0
    assert "In-shop" in capsys.readouterr().out


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_missing_data_gives_the_download_instructions_not_a_traceback(name, tmp_path, capsys):
    script = load(name)
    for dataset in script.variants:
        code = script.main(
            ["--dataset", dataset, "--data-root", str(tmp_path), "--random-init", "--out", str(tmp_path)]
        )
        err = capsys.readouterr().err
        assert code == 2
        layout = DATASETS[dataset].layout
        assert os.path.join(str(tmp_path), layout.folder) in err
        assert "never downloads" in err and "Traceback" not in err


def test_missing_weights_say_which_file_goes_where(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path / "hub"))
    script = load("rambo_retrieval")
    code = script.main(["--data-root", str(tmp_path), "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2
    assert os.path.join(str(tmp_path), "hub", "checkpoints", "resnet50-0676ba61.pth") in err
    assert "--random-init" in err and "Traceback" not in err


def test_a_loss_that_is_not_registered_is_named_before_any_work(tmp_path, capsys):
    script = load("auc_cub200")
    variant = next(iter(script.variants.values()))
    missing = reproduce.Run("missing", loss="NoSuchLoss")
    script = dataclasses.replace(script, variants={variant.dataset: dataclasses.replace(variant, runs=(missing,))})
    code = script.main(["--smoke", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2
    assert "unknown loss NoSuchLoss; available:" in err and "Traceback" not in err
    assert not list(tmp_path.iterdir())


# `python <script> --help` for each script given, in turn, in one process (one start of Python and
# torch, not one per script): each runs as `__main__` with its own folder first on sys.path.
# Prints ``{script: [exit status, stdout, stderr]}`` as JSON.
HELP_OF_EACH = """
import contextlib, io, json, os, runpy, sys
done = {}
for script in sys.argv[1:]:
    sys.argv, sys.path[0] = [script, "--help"], os.path.dirname(script)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_path(script, run_name="__main__")
            status = 0
        except SystemExit as end:
            status = 0 if end.code is None else end.code
    done[script] = [status, out.getvalue(), err.getvalue()]
print(json.dumps(done))
"""


@pytest.fixture(scope="module")
def script_helps():
    """``{script path: [exit status, stdout, stderr]}`` of every script's ``--help`` (`HELP_OF_EACH`)."""
    scripts = [str(SCRIPTS[name]) for name in sorted(SCRIPTS)]
    done = subprocess.run([sys.executable, "-c", HELP_OF_EACH, *scripts], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_every_script_runs_from_the_command_line(name, script_helps):
    """As the README says to run them: `python examples/<name>.py --help` from a clone."""
    status, stdout, stderr = script_helps[str(SCRIPTS[name])]
    assert status == 0, stderr
    assert "--data-root" in stdout and "--smoke" in stdout


def setup_training(name, dataset="cub200"):
    """The `TrainingConfig` the runner builds from a script's setup."""
    setup = load(name).variants[dataset].setup
    return TrainingConfig.from_budget(resolve(dataset, "reality-check", **setup.budget, iterations_per_epoch=1))


def test_the_learning_rate_drop_is_a_pml_lr_scheduler():
    config = setup_training("auc_cub200")
    after_epoch, factor = load("auc_cub200").variants["cub200"].setup.budget["lr_drop"]
    assert config.lr_drop == (after_epoch, factor)
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    scheduler = config.make_lr_scheduler(optimizer)
    rates = []
    for _ in range(after_epoch + 2):  # PML's trainer steps it at the end of every epoch
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert rates[after_epoch - 1] == 1.0 and rates[after_epoch] == pytest.approx(factor)


# --------------------------------------------------------------------------- machinery


def test_paper_rows_keep_the_papers_numbers_as_written():
    rows = reproduce.paper_rows("""
    Contrastive | 68.13 ± 0.31 | 90.0
    FastAP-Matlab (?) | 90.9? | -
    No margin | x | 63.2
    """)
    assert rows["Contrastive"][0] == (68.13, 0.31) and str(rows["Contrastive"][1]) == "90.0"
    assert rows["FastAP-Matlab (?)"][0] == 90.9 and rows["FastAP-Matlab (?)"][1] is None
    assert "diverged" in rows["No margin"][0]


def test_recall_at_k_by_hand():
    # 1-d embeddings: query 0's neighbours by distance are 1 (other class), then 2 (same class).
    query = torch.tensor([[0.0], [1.0], [3.0], [10.0], [11.0]])
    labels = torch.tensor([0, 1, 0, 1, 2])
    # per query, nearest others: 0 -> 1 (x), 2 (v); 1 -> 0 (x), 2 (x), 3 (v); 2 -> 1 (x), 0 (v);
    # 3 -> 4 (x), 2 (x), 1 (v); 4 has no other item of its class and is left out.
    r = accuracy(query, labels, metrics=("R@1", "R@2", "R@4"))
    assert r["R@1"] == 0
    assert r["R@2"] == pytest.approx(2 / 4)
    assert r["R@4"] == 1


def test_recall_against_a_gallery_by_hand():
    query, query_labels = torch.tensor([[0.0], [5.0]]), torch.tensor([7, 8])
    gallery, gallery_labels = torch.tensor([[0.1], [4.0], [5.2]]), torch.tensor([8, 7, 8])
    r = accuracy(query, query_labels, gallery, gallery_labels, metrics=("R@1", "R@2"))
    assert r == {"R@1": 0.5, "R@2": 1.0}  # query 7 finds its item 2nd, query 8 first


def test_recall_at_1_is_pmls_precision_at_1():
    torch.manual_seed(0)
    embeddings, labels = torch.randn(200, 8), torch.randint(0, 20, (200,))
    ours = accuracy(embeddings, labels, metrics=("R@1", "MAP@R", "R@10"))
    pml = AccuracyCalculator(include=("precision_at_1", "mean_average_precision_at_r"), k="max_bin_count")
    theirs = pml.get_accuracy(embeddings, labels)
    assert ours["R@1"] == pytest.approx(theirs["precision_at_1"])
    assert ours["MAP@R"] == pytest.approx(theirs["mean_average_precision_at_r"])
    assert ours["R@1"] <= ours["R@10"]


class _Images(torch.utils.data.Dataset):
    """16 random 3x16x16 images of 4 classes."""

    def __init__(self):
        generator = torch.Generator().manual_seed(0)
        self.images = torch.randn(16, 3, 16, 16, generator=generator)
        self.labels = [i % 4 for i in range(16)]

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return self.images[i], self.labels[i]


def tiny_training(**changes):
    """A tiny budget for the trainer: batches of 8, 2 iterations per epoch."""
    budget = resolve("glyphs", batch_size=8, iterations_per_epoch=2, lr_schedule="constant", embedding_size=4)
    return dataclasses.replace(TrainingConfig.from_budget(budget), **changes)


@pytest.mark.parametrize("freeze", [False, True])
def test_frozen_batchnorm_is_pmls_trainer_option(freeze):
    from pytorch_metric_learning.losses import ContrastiveLoss

    from pml_rank.harness.evaluation import train_model

    torch.manual_seed(0)
    trunk = SmallCNN(embedding_size=4, in_channels=3)
    batchnorm = next(m for m in trunk.modules() if isinstance(m, torch.nn.BatchNorm2d))
    before = batchnorm.running_mean.clone()
    config = tiny_training(epochs=1, freeze_batchnorm=freeze)
    train_model(ContrastiveLoss(), _Images(), config, trunk=trunk)
    assert torch.equal(batchnorm.running_mean, before) == freeze


def test_pmls_trainer_steps_the_learning_rate_scheduler_every_epoch(monkeypatch):
    from pytorch_metric_learning.losses import ContrastiveLoss

    from pml_rank.harness.evaluation import train_model

    seen = []

    def make_lr_scheduler(optimizer):
        scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, [2], gamma=0.3)
        step = scheduler.step
        scheduler.step = lambda *a: (seen.append(optimizer.param_groups[0]["lr"]), step(*a))
        return scheduler

    config = tiny_training(epochs=3, lr=1.0)
    monkeypatch.setattr(type(config), "make_lr_scheduler", lambda self, optimizer: make_lr_scheduler(optimizer))
    train_model(ContrastiveLoss(), _Images(), config, trunk=SmallCNN(embedding_size=4, in_channels=3))
    assert seen == [1.0, 1.0, pytest.approx(0.3)]


def test_only_the_training_folds_get_the_training_transform():
    from PIL import Image

    from pml_rank.harness.evaluation import test_set_and_folds

    class Items:
        labels = np.repeat(np.arange(16), 2)

        def __len__(self):
            return len(self.labels)

        def __getitem__(self, i):
            return Image.new("L", (2, 2)), int(self.labels[i])

    folds, test_set = test_set_and_folds(Items(), 4, transforms=(lambda x: "train", lambda x: "eval"))
    for train_set, val_set in folds:
        assert {train_set[i][0] for i in range(len(train_set))} == {"train"}
        assert {val_set[i][0] for i in range(len(val_set))} == {"eval"}
    assert {test_set[i][0] for i in range(len(test_set))} == {"eval"} and set(test_set.labels) == set(range(8, 16))


def test_embedding_layer_gets_its_learning_rate_factor():
    config = setup_training("rambo_retrieval")  # Adam 5e-6, x10 on the embedding layer, weight decay 4e-4
    trunk, embedder = torch.nn.Linear(3, 3), torch.nn.Linear(3, 2)
    _, optimizers, _ = _optimized(config, trunk, embedder, torch.nn.Identity(), None, None)
    assert optimizers["trunk_optimizer"].param_groups[0]["lr"] == pytest.approx(5e-6)
    embedder_optimizer = optimizers["embedder_optimizer"]
    assert embedder_optimizer.param_groups[0]["lr"] == pytest.approx(5e-5)
    assert embedder_optimizer.param_groups[0]["weight_decay"] == 4e-4


# --------------------------------------------------------------------------- backbones


def test_backbones_output_their_pooled_features():
    name = "resnet50"  # GoogLeNet: see the weights test below
    trunk = backbones.build_trunk(name, pretrained=False).eval()
    with torch.no_grad():
        features = trunk(torch.randn(2, 3, 32, 32))
    assert features.shape == (2, backbones.BACKBONES[name].features)


def test_pretrained_weights_are_read_from_the_local_torch_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path))
    with pytest.raises(backbones.WeightsNotFoundError, match="googlenet-1378be20.pth"):
        backbones.build_trunk("bn-inception")
    # What torchvision's file holds: the ImageNet model with its auxiliary classifiers.
    import torchvision

    torch.manual_seed(1)
    source = torchvision.models.googlenet(weights=None, aux_logits=True, init_weights=True)
    (tmp_path / "checkpoints").mkdir()
    torch.save(source.state_dict(), backbones.BACKBONES["googlenet"].weights_file())
    trunk = backbones.build_trunk("googlenet")
    torch.testing.assert_close(trunk.conv1.conv.weight, source.conv1.conv.weight)
    assert trunk.transform_input and isinstance(trunk.fc, torch.nn.Identity)
    with torch.no_grad():
        assert trunk.eval()(torch.randn(2, 3, 32, 32)).shape == (2, backbones.BACKBONES["googlenet"].features)
    # The same network without the file, for trained weights loaded afterwards (runner.load_models).
    os.remove(backbones.BACKBONES["googlenet"].weights_file())
    rebuilt = backbones.build_trunk("googlenet", load_weights=False)
    assert rebuilt.transform_input
    rebuilt.load_state_dict(trunk.state_dict())
    images = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(rebuilt.eval()(images), trunk(images))


def test_tiny_layouts_only_build_what_is_asked(tmp_path):
    tiny_layouts.make_all(tmp_path, only=["cub200-cropped"])
    assert sorted(os.listdir(tmp_path)) == ["CUB_200_2011"]
    assert math.isclose(len(os.listdir(tmp_path / "CUB_200_2011" / "images")), len(tiny_layouts.CUB_CLASSES))


def test_trained_weights_are_saved_before_evaluation(tmp_path, monkeypatch):
    script = load("auc_cub200")

    def evaluation_fails(*args, **kwargs):
        raise RuntimeError("evaluation failed")

    monkeypatch.setattr(protocol, "compute_embeddings", evaluation_fails)
    with pytest.raises(RuntimeError, match="evaluation failed"):
        script.main(["--smoke", "--out", str(tmp_path)])
    # The runner's folder for the run, not yet complete: PML's file names, the last epoch.
    (saved,) = (tmp_path / "models-auc_cub200-cub200-smoke" / "AUCLoss").rglob("trunk_1.pth")
    assert ".partial-" in saved.parent.parent.parent.name
    assert torch.load(saved, weights_only=True)
    assert not list(tmp_path.rglob("*.tmp"))


def test_reality_check_keeps_each_folds_models(tmp_path, capsys):
    script = load("reality_check")
    assert script.main(["--smoke", "--out", str(tmp_path)]) == 0
    folders = [p for p in (tmp_path / "models-reality_check-cub200-smoke").iterdir() if p.is_dir()]
    assert folders and all(list(folder.rglob("*.pth")) for folder in folders)


def test_an_unreadable_image_stops_the_script_before_training(tmp_path, capsys):
    data_root = tiny_layouts.make_all(tmp_path / "data", size=SMOKE["image_size"], only=["cub200"])
    images = sorted((Path(data_root) / "CUB_200_2011" / "images").rglob("*.jpg"))
    images[0].write_bytes(images[0].read_bytes()[:100])
    script = load("auc_cub200")
    assert script.main(["--smoke", "--data-root", str(data_root), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert str(images[0]) in err and "Traceback" not in err
    assert not list((tmp_path / "out").iterdir())


@pytest.mark.slow
@pytest.mark.parametrize("name", ["reality_check", "npair_table2"])
def test_smoke_records_what_its_models_trained_with(name, tmp_path, capsys):
    """One truth: every setting the script's JSON records for a row equals what the row's
    models (the Reality Check's fold models, the standard protocol's one model) say in their
    experiment.json they trained with, through the script's `main` with --smoke."""
    script = load(name)
    assert script.main(["--smoke", "--out", str(tmp_path)]) == 0, capsys.readouterr().err
    variant = next(iter(script.variants.values()))
    written = json.loads((tmp_path / f"reproduce-{name}-{variant.dataset}-smoke.json").read_text())
    assert "setup" not in written and "budget" not in written  # the script's declarations are not what trained
    trained_with = {label: e for label, e in written["trained_with"].items() if e["row"] != runner.UNTRAINED}
    experiments = [
        (path.parent, json.loads(path.read_text()))
        for path in (tmp_path / f"models-{name}-{variant.dataset}-smoke").rglob("experiment.json")
    ]
    assert len(experiments) == len(trained_with) > 0
    for label, entry in trained_with.items():
        [(folder, record)] = [e for e in experiments if e[1]["row"] == entry["row"]]
        assert record["budget"] == entry["budget"] and record["params"] == entry["params"], label
        assert record["budget"]["protocol"] == variant.setup.protocol
        models = sorted(p.name for p in folder.iterdir() if p.is_dir())
        expected = ["model"] if variant.setup.protocol == "standard" else [f"fold{k}" for k in range(4)]
        assert models == expected, label
    for label, run in ((r.label, r) for r in variant.runs if r.label in trained_with):
        for key, value in run.budget.items():  # a run's own setting reached its models
            assert trained_with[label]["budget"][key] == value, (label, key)


def test_a_setting_the_runner_cannot_honour_is_refused(tmp_path, capsys):
    reality_check = load("reality_check").variants["cub200"].setup.budget
    with pytest.raises(BudgetError, match="--lr-drop"):
        resolve("cub200", "reality-check", **{**reality_check, "lr_schedule": "cosine", "lr_drop": (10, 0.1)})
    standard = load("auc_cub200").variants["cub200"].setup.budget
    with pytest.raises(BudgetError, match="--patience"):
        resolve("cub200", "reality-check", **{**standard, "patience": 5})
    with pytest.raises(BudgetError, match="--embedder-lr-factor"):
        resolve("cub200", "reality-check", **{**standard, "trunk": "small-cnn"})
    with pytest.raises(TypeError, match="unknown budget keys backbone"):
        reproduce.Setup(budget={"backbone": "resnet50"})
    # Through the script: one line, before any work.
    script = load("auc_cub200")
    variant = script.variants["cub200"]
    stopping = dataclasses.replace(variant.runs[0], budget={"patience": 3})
    script = dataclasses.replace(script, variants={"cub200": dataclasses.replace(variant, runs=(stopping,))})
    assert script.main(["--smoke", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "argument --patience: 3: the standard protocol" in err and len(err.strip().splitlines()) == 1
    assert not list(tmp_path.iterdir())


def test_a_scripts_image_size_is_a_crop_of_the_papers_256_resize():
    args = load("auc_cub200").parser().parse_args(["--image-size", "224"])
    assert reproduce.running.command_line_changes({}, args)["resize"] == 256  # 224 of 256
