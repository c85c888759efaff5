"""PML's trainer, tester and hooks as the evaluation code drives them, and `pml-rank bench`
end to end on the embedded glyphs at a reduced budget."""

import dataclasses
import json
from collections import Counter

import numpy as np
import pytest
import torch

from pml_rank.cli import main
from pml_rank.harness import bench, recipes, report, runner, tune
from pml_rank.harness.budget import TRAINING_KEYS, BudgetError, class_count, minimum_classes, resolve
from pml_rank.harness.data import SmallCNN, load_glyphs
from pml_rank.harness.evaluation import (
    METRICS,
    Recipe,
    TrainingConfig,
    run_protocol,
    test_set_and_folds,
    train_model,
)
from pml_rank.harness.storage import default_url
from pml_rank.plugins import registry

# As `pml-rank bench` runs: the tiny CNN loses time to thread contention on a busy machine.
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def small_glyphs(glyph_cache):
    return load_glyphs(cache_dir=glyph_cache, num_classes=16)


def run_glyph_bench(rows, folder, glyph_cache, seeds=1, threads=1, **budget):
    """`bench.run_bench` in this process on the glyphs, its jobs in a SQLite file in `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    row_recipes, resolved = recipes.rows(rows), resolve("glyphs", **budget)
    runner.check_rows(resolved, row_recipes)
    return bench.run_bench(
        row_recipes,
        resolved,
        default_url(folder, bench.STORE_FILE),
        runner.Machine(cache_dir=glyph_cache),
        seeds=seeds,
        threads=threads,
        progress=False,
    )


def glyph_config(**budget):
    """The glyph budget with `budget`'s changes, as the trainer takes it."""
    return TrainingConfig.from_budget(resolve("glyphs", **budget))


def triplet_loss():
    from pytorch_metric_learning.losses import TripletMarginLoss

    return TripletMarginLoss()


def test_train_model_logs_with_record_keeper_and_keeps_the_best_epoch(small_glyphs, tmp_path):
    folds, _ = test_set_and_folds(small_glyphs, num_folds=2)
    train_set, val_set = folds[0]
    torch.manual_seed(0)
    config = dataclasses.replace(glyph_config(epochs=3, iterations_per_epoch=4, batch_size=16), log_freq=1)
    result = train_model(triplet_loss(), train_set, config, trunk=SmallCNN(), val_set=val_set, folder=tmp_path, seed=0)
    assert [entry["epoch"] for entry in result.history] == [1, 2, 3]
    for entry in result.history:
        assert set(METRICS) <= set(entry) and all(0 <= entry[m] <= 1 for m in METRICS)
    best = max(result.history, key=lambda e: e["mean_average_precision_at_r"])["epoch"]
    assert result.best_epoch == best
    # The hooks saved the best model; the returned trunk holds exactly those weights.
    saved = torch.load(tmp_path / "models" / f"trunk_best{best}.pth", map_location="cpu")
    for name, tensor in result.trunk.state_dict().items():
        assert torch.equal(tensor, saved[name])
    # record-keeper wrote the loss histories and the validation accuracies.
    written = {p.name for p in (tmp_path / "records").rglob("*") if p.is_file()}
    assert any("loss_histories" in name for name in written)
    assert any("VAL" in name for name in written)


def test_zero_epochs_leaves_the_network_untrained(small_glyphs):
    trunk = SmallCNN()
    before = {k: v.clone() for k, v in trunk.state_dict().items()}
    result = train_model(triplet_loss(), small_glyphs, dataclasses.replace(glyph_config(), epochs=0), trunk=trunk)
    assert result.history == [] and not result.trunk.training
    assert all(torch.equal(before[k], v) for k, v in result.trunk.state_dict().items())


def test_run_protocol_trains_one_model_per_fold(small_glyphs):
    seen = []

    def make_sampler(train_set, batch_size, model, **kwargs):
        seen.append(set(train_set.labels.tolist()))
        return recipes.m_per_class(4)(train_set, batch_size)

    result = run_protocol(
        small_glyphs,
        Recipe(make_loss=triplet_loss, make_sampler=make_sampler),
        SmallCNN,
        glyph_config(epochs=1, iterations_per_epoch=2, batch_size=16),
    )
    # The first 8 classes train and validate (two per partition), the other 8 are tested.
    assert seen == [set(range(8)) - {2 * k, 2 * k + 1} for k in range(4)]
    assert len(result.per_model) == 4 and len(result.histories) == 4
    for kind in (result.concatenated, result.separated):
        assert set(kind) == set(METRICS)


def test_recipes_cover_every_registered_loss_and_the_pml_baselines():
    available = recipes.rows(recipes.available())
    assert set(registry.losses()) <= set(available)
    # The default bench: every registered loss but the ablations (benched on request).
    default = recipes.default_rows()
    assert "SupAPLoss" in registry.losses() and "SupAPLoss" not in default and "ROADMAPLoss" in default
    assert set(registry.losses()) - set(recipes.ABLATIONS) <= set(default)
    assert {"pml:ContrastiveLoss", "pml:TripletMarginLoss", "pml:FastAPLoss", "pml:NPairsLoss"} <= set(available)
    for name, recipe in available.items():
        if name in registry.losses():
            assert recipe.make_loss is registry.losses()[name]
    if "AUCLoss" in available:
        assert type(available["AUCLoss"].make_miner()).__name__ == "BatchHardMiner"
    with pytest.raises(KeyError, match="NoSuchLoss"):
        recipes.rows(["NoSuchLoss"])


def test_bench_command_end_to_end(glyph_cache, tmp_path, capsys):
    out = tmp_path / "out"
    code = main(
        [
            "bench",
            "pml:TripletMarginLoss",
            "--classes",
            "24",
            "--seeds",
            "2",
            "--epochs",
            "2",
            "--iterations",
            "2",
            "--batch-size",
            "16",
            "--cache-dir",
            str(glyph_cache),
            "--out",
            str(out),
        ]
    )
    assert code == 0
    printed = capsys.readouterr().out
    assert "MAP@R" in printed and "pml:TripletMarginLoss" in printed and "±" in printed
    lines = (out / "bench.csv").read_text().splitlines()
    assert lines[0].startswith("row,") and "concatenated_mean_average_precision_at_r_ci95" in lines[0]
    assert [line.split(",")[0] for line in lines[1:]] == [runner.RAW_INPUT, runner.UNTRAINED, "pml:TripletMarginLoss"]
    payload = json.loads((out / "bench.json").read_text())
    assert payload["config"]["seeds"] == 2
    triplet = payload["rows"][2]
    assert len(triplet["runs"]) == 2 and len(triplet["histories"]) == 2
    values = [run["concatenated"]["precision_at_1"] for run in triplet["runs"]]
    assert triplet["summary"]["concatenated"]["precision_at_1"]["mean"] == pytest.approx(np.mean(values))
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
@pytest.mark.slow
def test_every_registered_loss_trains_a_bench_under_cpu_autocast(glyph_cache, tmp_path):
    # --amp trains under bfloat16 autocast on the CPU: RaMBO's rows crashed there.
    rows = pml_rank_losses()
    budget = dict(num_classes=24, batch_size=16, epochs=1, iterations_per_epoch=2, amp=True)
    result = run_glyph_bench(rows, tmp_path, glyph_cache, **budget)
    summary = result.summary()
    assert all(summary[name]["concatenated"]["mean_average_precision_at_r"][0] > 0 for name in rows)


def test_bench_rejects_unknown_losses(capsys):
    assert main(["bench", "NoSuchLoss"]) == 2
    assert "NoSuchLoss" in capsys.readouterr().err


def pml_rank_losses():
    """pml-rank's own registered losses (not third-party plugins')."""
    return [c.name for c in registry.components() if c.kind == "losses" and c.distribution == "pml-rank"]


@pytest.mark.slow
def test_every_pml_rank_loss_beats_raw_input_and_the_untrained_network(glyph_cache, tmp_path):
    # pml-rank's own losses, whichever are registered, and PML's triplet loss as a check that
    # the reduced budget is enough to learn something at all.
    rows = pml_rank_losses() + ["pml:TripletMarginLoss"]
    result = run_glyph_bench(
        rows, tmp_path, glyph_cache, epochs=3, iterations_per_epoch=20, num_folds=2, num_classes=120
    )
    summary = result.summary()
    map_at_r = "mean_average_precision_at_r"
    raw = summary[runner.RAW_INPUT]["separated"][map_at_r][0]
    untrained = {kind: summary[runner.UNTRAINED][kind][map_at_r][0] for kind in ("concatenated", "separated")}
    failures = []
    for name in rows:
        for kind in ("concatenated", "separated"):
            ours = summary[name][kind][map_at_r][0]
            if not ours > max(raw, untrained[kind]):
                failures.append(f"{name} {kind} MAP@R {ours:.3f} <= raw {raw:.3f} / untrained {untrained[kind]:.3f}")
    assert not failures, "\n" + report.format_table(result) + "\n" + "\n".join(failures)


def made_up_result(seeds, rows=("AUCLoss", "pml:TripletMarginLoss"), epochs=3):
    """A `BenchResult` with random accuracies and histories (no training): for the writers."""
    rng = np.random.default_rng(seeds)

    def accuracies():
        return {kind: {m: float(rng.uniform(0.2, 0.6)) for m in METRICS} for kind in ("concatenated", "separated")}

    def history():
        return [
            [
                {"epoch": e, "loss": float(rng.uniform(0.5, 1)), **{m: float(rng.uniform(0.2, 0.6)) for m in METRICS}}
                for e in range(1, epochs + 1)
            ]
            for _ in range(2)
        ]

    names = [runner.RAW_INPUT, runner.UNTRAINED, *rows]
    runs = {
        name: [accuracies()] if name == runner.RAW_INPUT else [accuracies() for _ in range(seeds)] for name in names
    }
    histories = {name: [] if name == runner.RAW_INPUT else [history() for _ in range(seeds)] for name in names}
    budget = dict(resolve("glyphs"), seeds=seeds, epochs=epochs, num_classes=None)
    return report.BenchResult(budget, names, runs, histories, {n: 1.0 for n in names}, {n: "" for n in names})


def _error_bars(ax):
    from matplotlib.container import ErrorbarContainer

    return [c for c in ax.containers if isinstance(c, ErrorbarContainer)]


def test_png_with_one_seed_says_no_ci_and_draws_no_error_bar():
    import matplotlib.pyplot as plt

    fig = report.bench_figure(made_up_result(seeds=1))
    bars = fig.axes[0]
    assert "no CI" in bars.get_title() and "±" not in bars.get_title()
    assert not _error_bars(bars)
    plt.close(fig)
    fig = report.bench_figure(made_up_result(seeds=3))
    (concatenated, separated) = _error_bars(fig.axes[0])
    # Every row but the raw input (one deterministic run) has an interval.
    assert len(concatenated.lines[2][0].get_segments()) == 3
    plt.close(fig)


def test_png_curves_have_integer_epochs_distinct_colours_and_the_legend_off_the_data():
    import matplotlib.pyplot as plt

    rows = tuple(f"Loss{i}" for i in range(12)) + ("pml:TripletMarginLoss",)
    fig = report.bench_figure(made_up_result(seeds=2, rows=rows, epochs=3))
    fig.canvas.draw()
    _, val, loss = fig.axes
    for ax in (val, loss):
        ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
        assert ticks and all(float(t).is_integer() for t in ticks)
    colors = [tuple(line.get_color()) for line in val.get_lines() if line.get_label() in rows]
    assert len(colors) == len(rows) == len(set(colors))
    legend = loss.get_legend()
    assert legend is not None and val.get_legend() is None
    assert {t.get_text() for t in legend.get_texts()} >= set(rows)
    renderer = fig.canvas.get_renderer()
    # The legend lies right of both curve panels, so it hides no curve.
    assert legend.get_window_extent(renderer).x0 >= loss.get_window_extent(renderer).x1
    plt.close(fig)


def test_json_records_the_configuration(tmp_path):
    result = made_up_result(seeds=1)
    path = report.write_json(result, tmp_path / "bench.json")
    assert json.loads(path.read_text())["config"] == result.budget


@pytest.mark.slow
def test_run_bench_records_its_budget_and_trains_with_the_threads_it_is_given(glyph_cache, tmp_path, monkeypatch):
    threads_seen = []
    real_run = runner.run

    def counting_threads(*args, **kwargs):
        threads_seen.append(torch.get_num_threads())
        return real_run(*args, **kwargs)

    monkeypatch.setattr(runner, "run", counting_threads)
    result = run_glyph_bench(
        ["pml:TripletMarginLoss"],
        tmp_path,
        glyph_cache,
        threads=2,
        epochs=1,
        iterations_per_epoch=1,
        num_folds=2,
        num_classes=16,
        batch_size=8,
    )
    assert threads_seen == [2, 2, 2]  # raw input, untrained, the triplet row
    budget = resolve("glyphs", epochs=1, iterations_per_epoch=1, num_folds=2, num_classes=16, batch_size=8)
    assert result.budget == {**{k: budget[k] for k in (*TRAINING_KEYS, "preset")}, "seeds": 1}


def test_a_failed_write_keeps_the_old_results_and_leaves_no_temporary_file(tmp_path, monkeypatch):
    import errno

    from matplotlib.figure import Figure

    old = report.write_all(made_up_result(seeds=2), tmp_path)
    before = {p.name: p.read_bytes() for p in old}

    def disk_full(self, fname, **kwargs):
        fname.write(b"\x89PNG half")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Figure, "savefig", disk_full)
    with pytest.raises(OSError, match="No space"):
        report.write_png(made_up_result(seeds=3), tmp_path / "bench.png")

    def sync_on_a_full_disk(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(report.outputs.os, "fsync", sync_on_a_full_disk)
    for write in (report.write_json, report.write_csv):
        with pytest.raises(OSError, match="No space"):
            write(made_up_result(seeds=3), tmp_path / f"bench.{write.__name__[6:]}")
    assert {p.name: p.read_bytes() for p in old} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench.csv", "bench.json", "bench.png"]


def test_check_budget_refuses_batches_the_rows_cannot_make():
    row_recipes = recipes.rows(["AUCLoss", "NPairsMCLoss"])
    recipes.check_budget(row_recipes, 32, num_classes=minimum_classes(2, 32))
    with pytest.raises(recipes.BudgetError, match="--batch-size") as error:
        recipes.check_budget(row_recipes, 6)
    assert error.value.option == "--batch-size"
    with pytest.raises(recipes.BudgetError, match="--classes"):
        recipes.check_budget(row_recipes, 32, num_classes=minimum_classes(2, 32) - 1)
    recipes.check_budget(recipes.rows(["NPairsMCLoss"]), 6, num_classes=minimum_classes(2, 6))


class StartedWork(Exception):
    """Raised where a command would start its jobs or trials, every check done."""


@pytest.mark.parametrize("command,start", [("bench", (bench, "bench_jobs")), ("tune", (tune, "tune"))])
def test_a_command_builds_its_rows_and_checks_the_budget_once(command, start, glyph_cache, tmp_path, monkeypatch):
    calls = Counter()

    def counted(name):
        real = getattr(recipes, name)

        def call(*args, **kwargs):
            calls[name] += 1
            return real(*args, **kwargs)

        return call

    for name in ("rows", "check_budget"):
        monkeypatch.setattr(recipes, name, counted(name))

    def started(*args, **kwargs):
        raise StartedWork

    monkeypatch.setattr(*start, started)
    argv = ["pml:TripletMarginLoss", "--classes", "24", "--batch-size", "16", "--cache-dir", str(glyph_cache)]
    with pytest.raises(StartedWork):
        main([command, *argv, "--out", str(tmp_path / "out")])
    assert calls == {"rows": 1, "check_budget": 1}


@pytest.mark.slow
def test_run_bench_refuses_more_classes_than_the_data_has_before_training(glyph_cache, tmp_path, monkeypatch):
    def no_training(*args, **kwargs):
        raise AssertionError("trained before refusing")

    monkeypatch.setattr(runner, "run", no_training)
    with pytest.raises(recipes.BudgetError, match="--classes"):
        run_glyph_bench(["pml:TripletMarginLoss"], tmp_path, glyph_cache, num_classes=10**6)


def test_cosine_schedule_anneals_the_learning_rate_to_zero_over_the_epochs():
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    scheduler = glyph_config(epochs=4, lr_schedule="cosine").make_lr_scheduler(optimizer)
    rates = []
    for _ in range(4):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert rates == pytest.approx([1.0, (1 + np.cos(np.pi / 4)) / 2, 0.5, (1 + np.cos(3 * np.pi / 4)) / 2])
    assert glyph_config(lr_schedule="constant").make_lr_scheduler(optimizer) is None
    with pytest.raises(ValueError, match="linear"):
        dataclasses.replace(glyph_config(), lr_schedule="linear").make_lr_scheduler(optimizer)


@pytest.mark.slow
def test_the_bench_trains_with_the_schedule_it_records(glyph_cache, tmp_path):
    def run(schedule):
        return run_glyph_bench(
            ["pml:TripletMarginLoss"],
            tmp_path / schedule,
            glyph_cache,
            epochs=2,
            iterations_per_epoch=3,
            num_classes=24,
            lr_schedule=schedule,
        )

    cosine, constant = run("cosine"), run("constant")
    assert cosine.budget["lr_schedule"] == "cosine" and constant.budget["lr_schedule"] == "constant"
    cosine_losses = [[e["loss"] for e in fold] for fold in cosine.histories["pml:TripletMarginLoss"][0]]
    constant_losses = [[e["loss"] for e in fold] for fold in constant.histories["pml:TripletMarginLoss"][0]]
    # The same seeds: the first epoch trains at the same rate, the second at half of it.
    assert [f[0] for f in cosine_losses] == [f[0] for f in constant_losses]
    assert [f[1] for f in cosine_losses] != [f[1] for f in constant_losses]


def test_all_classes_is_a_budget_of_its_own():
    assert class_count("all") is None and class_count(64) == 64
    recipes.check_budget(recipes.rows(["NPairsMCLoss"]), 32, "all")  # known only once loaded: no error
    with pytest.raises(recipes.BudgetError, match="--classes"):
        recipes.check_budget(recipes.rows(["NPairsMCLoss"]), 32, 24)


def test_a_budget_records_the_momentum_its_optimizer_applies():
    assert resolve("cub200", "reality-check")["momentum"] == 0.9  # RMSprop's
    assert resolve("cub200", "reality-check", optimizer="sgd")["momentum"] == 0.9
    assert resolve("cub200", "reality-check", optimizer="adam")["momentum"] == 0.0  # Adam applies none
    assert resolve("glyphs", momentum=0.0)["momentum"] == 0.0
    with pytest.raises(BudgetError, match="--momentum"):
        resolve("glyphs", momentum=0.9)
