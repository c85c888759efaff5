"""`pml-rank tune`: the Reality Check hyperparameter search with Optuna.

The objective is the protocol's own: for one set of loss parameters, train one model per
cross-validation fold on the training half of the classes (`evaluation.test_set_and_folds`)
and take the mean over the folds of each fold model's best-epoch validation MAP@R. The test
classes are never loaded into a model while tuning.

Search spaces come from the plugins' ``pml_rank_search_spaces()`` hook (pml-rank's own
losses, third-party ones) and from `baselines.BASELINES` for PML's baselines (ranges of the
Reality Check's Bayesian optimisation, from powerful-benchmarker's configs). The first trial
of every study is the loss's paper defaults (`paper_defaults`), so tuning never returns
parameters that measured worse than the defaults; tuned.json says when the defaults won.

One Optuna study per (row, data set, budget), named by `study_name`, so a changed budget
never mixes with old trials. `--trials N` is the number of finished (complete or pruned)
trials each study should hold: workers stop starting trials when the finished and running
ones reach N, and a rerun resumes. Workers are separate processes on one storage (SQLite
by default, any SQLAlchemy URL, e.g. PostgreSQL shared by several machines). Each running
trial sends heartbeats; a trial whose worker died (SIGKILL, power loss) is marked failed
once its heartbeat is older than the grace period and is retried with the same
parameters (`RetryHeartbeatStaleTrialCallback`).

Pruning: after each fold the running mean of the fold values is reported; Optuna's
`MedianPruner` stops a trial whose running mean is below the median of earlier trials at
the same fold (after `PRUNER_STARTUP_TRIALS` trials, from the second fold on). A pruned
trial counts as finished; `--no-prune` turns this off.
"""

import dataclasses
import inspect
import json
import os
import socket
import time
import warnings
from pathlib import Path

from . import recipes, runner
from .baselines import RecordingTrial
from .budget import AUTO_PRESET, MAP_AT_R, digest, resolve, training_key
from .jobs import _quiet_optuna
from .outputs import write_bytes, write_text
from .storage import StorageError, check_url, close_storage, open_storage, record_heartbeat_now, redact
from .storage_rules import DEFAULT_HEARTBEAT, DEFAULT_RETRY, Heartbeat, RetryPolicy
from .text_table import format_text_table
from .workers import WAIT, claim_trials, fail_stale_trials, run_processes

TUNED_FILE = "tuned.json"
PRUNER_STARTUP_TRIALS = 6
SAMPLER_STARTUP_TRIALS = 8


# ----------------------------------------------------------------------------- spaces


def search_spaces():
    """``{row name: space(trial) -> params}``: the plugins' spaces and PML's baselines'."""
    return recipes.search_spaces()


def is_empty(space):
    """Whether `space` suggests nothing: a row with nothing to tune."""
    probe = RecordingTrial()
    space(probe)
    return not probe.suggested


# ----------------------------------------------------------------------------- studies


def study_budget(seed=0, dataset="glyphs", preset=AUTO_PRESET, **given):
    """The budget that defines a study: `budget.resolve`'s for `dataset`, `preset` and the
    `given` values, and the sampler's and fold models' `seed`."""
    budget = resolve(dataset, preset, **given)
    budget.update(seed=seed)
    return budget


def study_name(row, budget):
    """``<row> <data set> <preset> <digest of the budget> s<seed>``: one study per row,
    data set and budget (every key of `budget.TRAINING_KEYS`)."""
    key = digest(training_key(budget))
    return f"{row} {budget['dataset']} {budget['preset']} {key[:10]} s{budget['seed']}"


def _sampler(seed, trials_so_far):
    import optuna

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        # Seeded by the study's seed and the number of trials already asked, so that a
        # serial run is reproducible and parallel workers do not propose the same values.
        return optuna.samplers.TPESampler(
            seed=seed * 1_000_003 + trials_so_far,
            n_startup_trials=SAMPLER_STARTUP_TRIALS,
            multivariate=True,
            group=True,
            constant_liar=True,
        )


def _pruner(prune):
    import optuna

    if not prune:
        return optuna.pruners.NopPruner()
    return optuna.pruners.MedianPruner(n_startup_trials=PRUNER_STARTUP_TRIALS, n_warmup_steps=1)


def open_study(row, budget, storage, prune=True):
    import optuna

    name = study_name(row, budget)
    study = optuna.create_study(
        study_name=name, storage=storage, direction="maximize", load_if_exists=True, pruner=_pruner(prune)
    )
    if "budget" not in study.user_attrs:
        study.set_user_attr("budget", budget)
        study.set_user_attr("loss", row)
        defaults = paper_defaults(row, search_spaces()[row])
        if defaults:  # the paper's defaults are the first trial
            study.enqueue_trial(defaults, user_attrs={"paper_defaults": True})
    return study


def counts(study):
    """``(finished, running, waiting)``: complete or pruned trials, running ones, queued retries."""
    from optuna.trial import TrialState

    trials = study.get_trials(
        deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING, TrialState.WAITING)
    )
    finished = sum(t.state in (TrialState.COMPLETE, TrialState.PRUNED) for t in trials)
    running = sum(t.state == TrialState.RUNNING for t in trials)
    return finished, running, sum(t.state == TrialState.WAITING for t in trials)


def target_trials(row, trials):
    """Trials a study should hold: `trials`, or 1 when the space has nothing to search."""
    return 1 if is_empty(search_spaces()[row]) else trials


# ----------------------------------------------------------------------------- objective


def paper_defaults(row, space):
    """The values the paper's defaults give the parameters `space` suggests (by name): the
    baseline's stated defaults, else the attributes of the loss built without arguments
    (AUCLoss resolves its slope from its table), else its constructor's defaults. What the
    first trial of a study tries, so a search never ends below the defaults it measured.
    The space is asked with those values, so parameters it suggests only for some values
    (RaMBO's memory variant, with a memory) are found."""
    known = recipes.default_params(row)
    recipe = recipes.rows([row])[row]
    cls = getattr(recipe.make_loss, "func", recipe.make_loss)
    if inspect.isclass(cls):
        signature = {
            k: p.default
            for k, p in inspect.signature(cls).parameters.items()
            if p.default is not inspect.Parameter.empty
        }
        built = None
        if not recipe.loss_needs:
            try:
                built = cls()
            except Exception:
                built = None
        for name in signature:
            value = getattr(built, name, None) if built is not None else None
            value = value.item() if hasattr(value, "item") else value
            if name not in known and (value if value is not None else signature[name]) is not None:
                known[name] = value if value is not None else signature[name]
    values = {}
    while True:  # until the suggested names stop changing
        probe = RecordingTrial(known)
        space(probe)
        found = {name: known[name] for name in probe.suggested if name in known}
        if found == values:
            return values
        values = found


class SurplusTrial(Exception):
    """Two workers started a trial at once when one more was missing: the later one gives up
    (it ends FAIL, is not counted and not retried), so a study never overshoots N."""


def _check_surplus(trial, target):
    from optuna.trial import TrialState

    study_trials = trial.study.get_trials(
        deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING)
    )
    finished = sum(t.state != TrialState.RUNNING for t in study_trials)
    running = sorted(t.number for t in study_trials if t.state == TrialState.RUNNING)
    # A live `Trial` has no system_attrs in Optuna 5: read them from its frozen record.
    retried = any("failed_trial" in t.system_attrs for t in study_trials if t.number == trial.number)
    if trial.number in running[max(target - finished, 0) :] and not retried:
        raise SurplusTrial(f"trial {trial.number}: the study already has {target} finished or running trials")


def _objective(row, space, budget, machine, target=None):
    import optuna

    def objective(trial):
        record_heartbeat_now(trial)
        trial.set_user_attr("worker", f"{socket.gethostname()}:{os.getpid()}")
        if target is not None:
            _check_surplus(trial, target)
        params = space(trial)
        trial.set_user_attr("params", params)

        def on_fold(k, best_validation):
            running_mean = sum(v[MAP_AT_R] for v in best_validation) / len(best_validation)
            trial.report(running_mean, k)
            if k + 1 < budget["num_folds"] and trial.should_prune():
                raise optuna.TrialPruned(f"running mean {running_mean:.4f} after fold {k}")

        outcome = runner.run(budget, row, params, budget["seed"], machine, validation_only=True, on_fold=on_fold)
        folds = [v[MAP_AT_R] for v in outcome["validation"]]
        trial.set_user_attr("folds", folds)
        return sum(folds) / len(folds)

    return objective


# ----------------------------------------------------------------------------- workers


@dataclasses.dataclass
class TuneJob:
    rows: list
    trials: int
    budget: dict
    storage: str
    machine: runner.Machine = runner.Machine()
    threads: int = 1
    heartbeat: float = DEFAULT_HEARTBEAT
    prune: bool = True
    poll: float = 1.0
    retry: float = DEFAULT_RETRY


def run_worker(job):
    """One worker: for each row in turn, runs trials until its study holds `job.trials`
    finished ones (counting those other workers are running). Returns the number of
    trials this worker finished."""
    import optuna
    import torch

    _quiet_optuna()
    torch.set_num_threads(job.threads)
    storage = open_storage(job.storage, Heartbeat(job.heartbeat), RetryPolicy(job.retry))
    spaces = search_spaces()
    remaining = list(job.rows)
    opened = {}  # row: (study, target, objective), once the row's turn has come

    def next_trial():
        while remaining:
            row = remaining[0]
            if row not in opened:
                target = target_trials(row, job.trials)
                objective = _objective(row, spaces[row], job.budget, job.machine, target)
                opened[row] = open_study(row, job.budget, storage, job.prune), target, objective
            study, target, objective = opened[row]
            fail_stale_trials(study)  # a dead worker's trial: failed, queued again
            finished, running, waiting = counts(study)
            if finished >= target:
                remaining.pop(0)
                continue
            if finished + running >= target and not waiting:
                return WAIT  # the rest are running; wait in case one of them dies
            asked = len(study.get_trials(deepcopy=False))
            seeded_study = optuna.load_study(
                study_name=study.study_name,
                storage=storage,
                sampler=_sampler(job.budget["seed"], asked),
                pruner=_pruner(job.prune),
            )
            return seeded_study, objective
        return None

    try:
        return claim_trials(next_trial, job.poll, skip=(SurplusTrial,))
    finally:
        close_storage(storage)


@dataclasses.dataclass
class TuneResult:
    entries: dict
    seconds: float
    interrupted: bool = False


def summarize_study(study, command=None, seconds=None, storage=None):
    """The tuned.json entry of a study, or None before its first complete trial."""
    from optuna.trial import TrialState

    finished = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED))
    complete = [t for t in finished if t.state == TrialState.COMPLETE]
    if not complete:
        return None
    best = max(complete, key=lambda t: t.value)
    entry = {
        "params": best.user_attrs.get("params", best.params),
        "value": best.value,
        "trials": len(finished),
        "study": study.study_name,
        "best_trial": best.number,
        "complete": len(complete),
        "pruned": len(finished) - len(complete),
        "budget": study.user_attrs.get("budget"),
        "defaults_won": bool(best.user_attrs.get("paper_defaults")),
    }
    starts = [t.datetime_start for t in finished if t.datetime_start is not None]
    ends = [t.datetime_complete for t in finished if t.datetime_complete is not None]
    if starts and ends:
        # From the first trial's start to the last one's end, whatever runs it took.
        entry["study_wall_seconds"] = round((max(ends) - min(starts)).total_seconds(), 1)
        entry["trial_seconds"] = round(
            sum(
                (t.datetime_complete - t.datetime_start).total_seconds()
                for t in finished
                if t.datetime_complete and t.datetime_start
            ),
            1,
        )
    if storage is not None:
        entry["storage"] = redact(storage)
    if command is not None:
        entry["command"] = command
    if seconds is not None:
        entry["wall_seconds"] = round(seconds, 1)
    return entry


def write_json_atomic(path, payload):

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    return write_text(path, json.dumps(payload, indent=1) + "\n")


def write_tuned(out, entries):
    """Merges `entries` into ``out/tuned.json`` (other rows' entries are kept)."""
    path = Path(out) / TUNED_FILE
    existing = json.loads(path.read_text()) if path.exists() else {}
    existing.update(entries)
    return write_json_atomic(path, existing)


def write_png(study, path):
    """Optimisation history beside the slice plot of every parameter (Optuna's matplotlib
    plots). Leaves matplotlib's settings and the warning filters as it found them (Optuna's
    plots switch matplotlib to its ggplot style for the whole process)."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    import optuna
    import optuna.visualization.matplotlib as ovm
    from PIL import Image

    _quiet_optuna()
    images = []
    plots = [ovm.plot_optimization_history]
    if study.best_trial.params:
        plots.append(ovm.plot_slice)
    with warnings.catch_warnings(), matplotlib.rc_context():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        warnings.filterwarnings("ignore", module="optuna")
        warnings.filterwarnings("ignore", message=".*tight_layout")
        warnings.filterwarnings("ignore", message=".*identical low and high xlims")
        for plot in plots:
            axes = plot(study)
            figure = np.asarray(axes).flat[0].figure
            figure.suptitle(study.study_name, fontsize=9)
            figure.tight_layout()
            buffer = io.BytesIO()
            figure.savefig(buffer, dpi=90)
            plt.close(figure)
            buffer.seek(0)
            images.append(Image.open(buffer).convert("RGB"))
    width = sum(i.width for i in images)
    canvas = Image.new("RGB", (width, max(i.height for i in images)), "white")
    x = 0
    for image in images:
        canvas.paste(image, (x, 0))
        x += image.width

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    canvas.save(buffer, format="PNG")
    return write_bytes(path, buffer.getvalue())


def format_table(entries):
    """The best parameters per row as a text table."""
    lines = []
    for row, e in entries.items():
        params = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in e["params"].items())
        lines.append((row, f"{100 * e['value']:.2f}", e["trials"], params or "(nothing to tune)"))
    return format_text_table(("loss", "val MAP@R", "trials", "best parameters"), lines, align="lrrl")


def tune(
    rows,
    trials,
    budget,
    storage,
    out,
    workers=1,
    machine=runner.Machine(),
    devices=None,
    threads=1,
    heartbeat=DEFAULT_HEARTBEAT,
    prune=True,
    command=None,
    progress=True,
    retry=DEFAULT_RETRY,
):
    """Runs `workers` processes until every row's study holds `trials` finished trials,
    writes ``out/tuned.json`` and a PNG per row; returns a `TuneResult`. Worker i runs on
    ``devices[i % len(devices)]`` when `devices` are given. Ctrl-C stops the
    workers (their running trials are lost, finished ones kept) and still writes the outputs.
    A storage call failing on a transient error is retried for up to `retry` seconds. Raises
    `StorageError` when the storage cannot be opened, before any work, and
    `StorageUnavailable` when it stayed unreachable (finished trials are kept)."""
    from tqdm import tqdm

    _quiet_optuna()
    started = time.perf_counter()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    job = TuneJob(list(rows), trials, budget, storage, machine, threads, heartbeat, prune, retry=retry)
    check_url(storage)
    rdb = open_storage(storage, Heartbeat(heartbeat), RetryPolicy(retry))
    try:
        studies = {row: open_study(row, budget, rdb, prune) for row in rows}  # created once, before the workers
    except Exception as error:
        close_storage(rdb)
        raise StorageError(f"cannot open {redact(storage)}: {error}") from error
    targets = {row: target_trials(row, trials) for row in rows}

    def finished():
        return {row: min(counts(study)[0], targets[row]) for row, study in studies.items()}

    interrupted = False
    bar = tqdm(
        total=sum(targets.values()), desc="pml-rank tune", unit="trial", disable=not progress, dynamic_ncols=True
    )

    def show():
        state = finished()
        bar.n = sum(state.values())
        current = next((row for row in rows if state[row] < targets[row]), rows[-1])
        bar.set_postfix_str(f"{current} {state[current]}/{targets[current]}")
        bar.refresh()

    failed = []
    try:
        jobs = [
            (dataclasses.replace(job, machine=dataclasses.replace(machine, device=devices[i % len(devices)])),)
            if devices
            else (job,)
            for i in range(workers)
        ]
        failed = run_processes(run_worker, jobs, show)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        bar.close()
    seconds = time.perf_counter() - started
    entries = {}
    try:
        for row, study in studies.items():
            entry = summarize_study(study, command=command, seconds=seconds, storage=storage)
            if entry is not None:
                entries[row] = entry
                write_png(study, out / f"tune-{_file_name(row)}.png")
    finally:
        close_storage(rdb)
    if entries:
        write_tuned(out, entries)
    if failed and not interrupted:
        raise RuntimeError(f"pml-rank tune: {len(failed)} worker(s) failed (exit codes {failed})")
    return TuneResult(entries, seconds, interrupted)


def _file_name(row):
    return row.replace(":", "-")
