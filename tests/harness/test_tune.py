"""`pml-rank tune` end to end through the console script, on tiny budgets: SQLite (resume to N,
two workers on one file), a PostgreSQL server the test starts itself, a worker killed with
SIGKILL mid-trial, Ctrl-C, and the plugins' search spaces."""

import gc
import json
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

optuna = pytest.importorskip("optuna")
from tiny_bench import write_locked  # noqa: E402

from pml_rank.harness import tune  # noqa: E402
from pml_rank.harness.budget import TRAINING_KEYS  # noqa: E402
from pml_rank.harness.storage import close_storage, default_url, open_storage  # noqa: E402

PML_RANK = Path(sys.executable).parent / "pml-rank"
# A connection the tests leave open (an Optuna storage never closed) fails the test that left it.
pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("error::ResourceWarning"),
    pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning"),
]
TINY = ["--classes", "24", "--epochs", "1", "--iterations", "2", "--batch-size", "16"]


@pytest.fixture(autouse=True)
def collect_garbage():
    """Collects after each test, so that a connection left open warns in the test that opened it."""
    yield
    gc.collect()


def run_tune(*args, cache, check=True, timeout=300):
    result = subprocess.run(
        [str(PML_RANK), "tune", *args, *TINY, "--cache-dir", str(cache)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if check:
        assert result.returncode == 0, result.stdout + result.stderr
    return result


def tune_here(run_cli, *args, cache):
    """`run_tune` through `cli.main` in this process (`run_cli`): the command's workers are still
    processes of their own, one start of Python, torch and Optuna fewer."""
    status, printed, err = run_cli(["tune", *args, *TINY, "--cache-dir", cache])
    assert status == 0, printed + err


def trials_of(url, loss):
    """The trials of `loss`'s study at the TINY budget; the storage's connections are closed
    before returning (KeyError while the study does not exist)."""
    budget = tune.study_budget(epochs=1, iterations_per_epoch=2, num_classes=24, batch_size=16)
    storage = open_storage(url)
    try:
        study = optuna.load_study(study_name=tune.study_name(loss, budget), storage=storage)
        return study.get_trials(deepcopy=False)
    finally:
        close_storage(storage)


def states(trials):
    return [t.state.name for t in trials]


def finished(trials):
    return [t for t in trials if t.state.name in ("COMPLETE", "PRUNED")]


def test_tune_on_sqlite_resumes_to_n_with_two_workers_on_one_file(tmp_path, glyph_cache, run_cli):
    url = f"sqlite:///{tmp_path / 't.db'}"
    result = run_tune(
        "RaMBORecallLoss",
        "--trials",
        "3",
        "--workers",
        "2",
        "--storage",
        url,
        "--out",
        str(tmp_path),
        cache=glyph_cache,
    )
    assert "RaMBORecallLoss" in result.stdout and "lambda_val" in result.stdout
    tuned = json.loads((tmp_path / "tuned.json").read_text())
    entry = tuned["RaMBORecallLoss"]
    assert entry["trials"] == 3 and set(entry) >= {"params", "value", "trials", "study"}
    assert {"lambda_val", "margin", "memory_size", "weighting"} <= set(entry["params"])
    trials = trials_of(url, "RaMBORecallLoss")
    assert len(finished(trials)) == 3 and "RUNNING" not in states(trials)
    assert len({t.user_attrs["worker"] for t in trials}) == 2  # both workers ran trials on the one file
    assert (tmp_path / "tune-RaMBORecallLoss.png").read_bytes()[:4] == b"\x89PNG"
    assert max(t.value for t in trials if t.value is not None) == pytest.approx(entry["value"])

    tune_here(run_cli, "RaMBORecallLoss", "--trials", "4", "--workers", "1", "--storage", url, "--out", tmp_path,
              cache=glyph_cache)  # fmt: skip
    trials = trials_of(url, "RaMBORecallLoss")
    assert len(finished(trials)) == 4 and "RUNNING" not in states(trials)
    assert json.loads((tmp_path / "tuned.json").read_text())["RaMBORecallLoss"]["trials"] == 4
    # A different budget is a different study: the old trials are not mixed in.
    budget = tune.study_budget(epochs=2, iterations_per_epoch=2, num_classes=24, batch_size=16)
    assert tune.study_name("RaMBORecallLoss", budget) != entry["study"]


def a_trial_finished_and_another_drew_its_parameters(url):
    """A trial has finished and another is running with its parameters drawn (a trial killed
    before it draws them would be retried with fresh ones)."""
    # The lock first: frozen holding it, the process would keep this read out too (pml-rank's
    # storage waits 120 s for a lock, and retries).
    if write_locked(url.removeprefix("sqlite:///")):
        return False
    try:
        trials = trials_of(url, "pml:TripletMarginLoss")
    except KeyError:  # the study does not exist yet
        return False
    return len(finished(trials)) >= 1 and any(t.state.name == "RUNNING" and t.params for t in trials)


def test_sigkilled_worker_loses_only_its_trial_and_the_rerun_completes(tmp_path, glyph_cache, freeze_when, run_cli):
    url = f"sqlite:///{tmp_path / 't.db'}"
    args = [
        str(PML_RANK),
        "tune",
        "pml:TripletMarginLoss",
        "--trials",
        "50",  # more than it can finish before the test acts, however fast the machine
        "--workers",
        "1",
        "--heartbeat",
        "1",
        "--no-prune",
        "--storage",
        url,
        "--out",
        str(tmp_path),
        *TINY,
        "--cache-dir",
        str(glyph_cache),
    ]
    process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        freeze_when(
            process, lambda: a_trial_finished_and_another_drew_its_parameters(url), "a trial drew its parameters"
        )
    finally:
        os.killpg(process.pid, signal.SIGKILL)  # the command and its worker, mid-trial
        process.wait()
    trials = trials_of(url, "pml:TripletMarginLoss")
    assert "RUNNING" in states(trials)
    target = len(finished(trials)) + 1

    tune_here(run_cli, "pml:TripletMarginLoss", "--trials", target, "--workers", "1", "--heartbeat", "1", "--no-prune",
              "--storage", url, "--out", tmp_path, cache=glyph_cache)  # fmt: skip
    trials = trials_of(url, "pml:TripletMarginLoss")
    assert len(finished(trials)) == target and "RUNNING" not in states(trials)
    failed = [t for t in trials if t.state.name == "FAIL"]
    assert len(failed) == 1
    retried = [t for t in trials if t.system_attrs.get("failed_trial") == failed[0].number]
    assert len(retried) == 1 and retried[0].params == failed[0].params  # the lost trial, run again


def test_ctrl_c_stops_cleanly_and_keeps_finished_trials_of_the_example_plugins_space(
    tmp_path, glyph_cache, start_interruptible
):
    """Tunes the example plugin's loss in the default storage (SQLite in --out) until Ctrl-C."""
    loss = "BinomialDevianceLoss"
    args = [str(PML_RANK), "tune", loss, "--trials", "50", "--workers", "1", "--no-prune", "--out", str(tmp_path),
            *TINY, "--cache-dir", str(glyph_cache)]  # fmt: skip
    url = default_url(tmp_path, "tune.db")
    process = start_interruptible(args)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        try:
            if (tmp_path / "tune.db").exists() and finished(trials_of(url, loss)):
                break
        except KeyError:
            pass
        time.sleep(0.1)
    os.killpg(process.pid, signal.SIGINT)  # Ctrl-C reaches the whole process group
    out, err = process.communicate(timeout=120)
    assert process.returncode == 130, out + err
    assert "interrupted" in err and "Traceback" not in err
    entry = json.loads((tmp_path / "tuned.json").read_text())[loss]
    assert entry["trials"] >= 1 and set(entry["params"]) == {"alpha", "beta", "cost"}
    assert "RUNNING" not in states(trials_of(url, loss))


# ----------------------------------------------------------------------------- PostgreSQL


def test_two_workers_share_one_study_on_postgresql(tmp_path, glyph_cache, postgres_url):
    result = run_tune(
        "RaMBORecallLoss",
        "--trials",
        "3",
        "--workers",
        "2",
        "--storage",
        postgres_url,
        "--out",
        str(tmp_path),
        cache=glyph_cache,
    )
    trials = trials_of(postgres_url, "RaMBORecallLoss")
    assert len(finished(trials)) == 3 and "RUNNING" not in states(trials)
    assert len({t.user_attrs["worker"] for t in trials}) == 2
    text = (tmp_path / "tuned.json").read_text()
    assert json.loads(text)["RaMBORecallLoss"]["trials"] == 3
    assert "secret-password" not in text and "secret-password" not in result.stdout + result.stderr


@pytest.mark.parametrize(
    "url, through",
    [("nosuchdialect://x/y", "cli.main"), ("postgresql+psycopg://user:secret@127.0.0.1:1/db", "pml-rank")],
)
def test_a_storage_that_cannot_be_opened_is_refused_before_any_trial(url, through, tmp_path, glyph_cache, run_cli):
    """One through the console script, one through its `cli.main` in this process (a start of
    Python, torch and Optuna takes seconds)."""
    args = ["AUCLoss", "--storage", url, "--out", str(tmp_path)]
    if through == "pml-rank":
        result = run_tune(*args, cache=glyph_cache, check=False)
        status, printed, err = result.returncode, result.stdout, result.stderr
    else:
        status, printed, err = run_cli(["tune", *args, *TINY, "--cache-dir", glyph_cache])
    assert status == 2
    assert "argument --storage: cannot open" in err and "Traceback" not in err
    assert "secret" not in printed + err
    assert not (tmp_path / "tuned.json").exists()


def test_every_budget_key_makes_a_study_of_its_own():
    base = tune.study_budget()
    assert base["num_classes"] == 64 and base["lr_schedule"] == "cosine" and base["preset"] == "glyphs"
    others = dict(
        dataset="cub200",
        trunk="resnet50",
        random_init=False,
        freeze_batchnorm=True,
        embedding_size=8,
        epochs=3,
        iterations_per_epoch=7,
        batch_size=16,
        optimizer="rmsprop",
        lr=1e-4,
        weight_decay=1e-4,
        momentum=0.9,
        lr_schedule="constant",
        patience=2,
        num_folds=3,
        num_classes="all",
        image_size=64,
        resize=72,
        augmentation="crop-flip",
        amp=True,
        protocol="standard",
        samples_per_class=8,
        class_mining=False,
        embedder_lr_factor=10.0,
        lr_drop=(2, 0.5),
    )
    assert set(others) == set(TRAINING_KEYS)  # a key added to the budget must be added here
    assert all(base[key] != value for key, value in others.items())
    names = {tune.study_name("AUCLoss", base)}
    names |= {tune.study_name("AUCLoss", {**base, key: value}) for key, value in others.items()}
    names |= {tune.study_name("AUCLoss", {**base, "seed": 1}), tune.study_name("AUCLoss", {**base, "preset": "x"})}
    assert len(names) == 1 + len(others) + 2
    # Where a process runs is not part of its study: several machines share one.
    assert tune.study_name("AUCLoss", {**base, "device": "cuda:1", "threads": 4}) == tune.study_name("AUCLoss", base)
    # --preset reality-check on the glyphs is one budget, whichever options spell it.
    spelled = tune.study_budget(preset="reality-check", epochs=2)
    assert tune.study_name("AUCLoss", spelled) == tune.study_name(
        "AUCLoss", tune.study_budget(preset="reality-check", epochs=2, lr=1e-6, optimizer="rmsprop")
    )


def test_the_tune_plot_leaves_matplotlib_and_the_warning_filters_as_it_found_them(tmp_path):
    """Optuna's plots switch matplotlib to its ggplot style for the whole process: a bench
    plotted after a tune in the same process came out in that style."""
    import matplotlib

    matplotlib.use("Agg")  # what write_png selects; the test compares everything else
    study = optuna.create_study(study_name="plotted")
    for x in (0.1, 0.5, 0.9):
        study.add_trial(
            optuna.trial.create_trial(
                params={"x": x}, distributions={"x": optuna.distributions.FloatDistribution(0, 1)}, value=x
            )
        )
    settings, filters = dict(matplotlib.rcParams), list(warnings.filters)
    tune.write_png(study, tmp_path / "tune.png")
    assert (tmp_path / "tune.png").read_bytes().startswith(b"\x89PNG")
    changed = {key for key, value in matplotlib.rcParams.items() if settings[key] != value}
    assert not changed, changed
    assert warnings.filters == filters
