"""`pml-rank tune`: the Reality Check hyperparameter search with Optuna.

The objective is the protocol's own: for one set of loss parameters, train one model per
cross-validation fold on the training half of the classes (`evaluation.test_set_and_folds`)
and take the mean over the folds of each fold model's best-epoch validation MAP@R. The test
classes are never loaded into a model while tuning.

Search spaces come from the plugins' ``pml_rank_search_spaces()`` hook (pml-rank's own
losses, third-party ones) and from `PML_SEARCH_SPACES` for PML's baselines (ranges of the
Reality Check's Bayesian optimisation, read from powerful-benchmarker's plots and configs).

One Optuna study per (loss, data set, budget), named by `study_name`, so a changed budget
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
import functools
import hashlib
import json
import multiprocessing
import os
import socket
import sys
import time
import warnings
from pathlib import Path

from ..plugins import registry
from .bench import DATASETS, class_count, load_dataset, recipes
from .budget import TRAINING_KEYS, with_defaults
from .evaluation import lr_scheduler_factory, test_set_and_folds, train_fold_model
from .outputs import write_bytes, write_text
from .text_table import format_text_table

TUNED_FILE = "tuned.json"
PRUNER_STARTUP_TRIALS = 6
SAMPLER_STARTUP_TRIALS = 8
DEFAULT_HEARTBEAT = 20.0
OBJECTIVE_METRIC = "mean_average_precision_at_r"


# ----------------------------------------------------------------------------- spaces


def _contrastive_space(trial):
    # Reality Check: pos_margin and neg_margin both searched on [-0.2, 2] (its best CUB
    # pos_margin sits on the lower bound).
    return {
        "pos_margin": trial.suggest_float("pos_margin", -0.2, 2.0),
        "neg_margin": trial.suggest_float("neg_margin", -0.2, 2.0),
    }


def _triplet_space(trial):
    return {"margin": trial.suggest_float("margin", -0.2, 2.0)}


def _pml_fastap_space(trial):
    # Reality Check: num_bins on [2, 250] (best 16-86); a batch of 32 needs fewer.
    return {"num_bins": trial.suggest_int("num_bins", 2, 100, log=True)}


def _nothing_to_tune(trial):
    return {}


# PML's baselines (the bench's ``pml:<Name>`` rows). PML's NPairsLoss has no
# hyperparameter besides its distance: nothing to search, one trial measures it.
PML_SEARCH_SPACES = {
    "pml:ContrastiveLoss": _contrastive_space,
    "pml:TripletMarginLoss": _triplet_space,
    "pml:FastAPLoss": _pml_fastap_space,
    "pml:NPairsLoss": _nothing_to_tune,
}


def search_spaces():
    """``{bench row name: space(trial) -> constructor keywords}``: the plugins' spaces and
    `PML_SEARCH_SPACES`."""

    return {**registry.search_spaces(), **PML_SEARCH_SPACES}


class _FirstChoiceTrial:
    """Stands in for an Optuna trial to find out whether a space suggests anything."""

    def __init__(self):
        self.suggested = []

    def _take(self, name, value):
        self.suggested.append(name)
        return value

    def suggest_float(self, name, low, high, **_):
        return self._take(name, low)

    def suggest_int(self, name, low, high, **_):
        return self._take(name, low)

    def suggest_categorical(self, name, choices):
        return self._take(name, choices[0])


def is_empty(space):
    probe = _FirstChoiceTrial()
    space(probe)
    return not probe.suggested


# ----------------------------------------------------------------------------- studies

BUDGET_KEYS = (*TRAINING_KEYS, "seed")


def budget_config(seed=0, **given):
    """The budget that defines a study: `given` keywords among `TRAINING_KEYS` (the bench's
    `DEFAULTS` for those missing or None) and the sampler's `seed`."""
    unknown = sorted(set(given) - set(TRAINING_KEYS))
    if unknown:
        raise TypeError(f"budget_config() got unexpected keyword arguments {', '.join(unknown)}")
    config = with_defaults(**{key: given.get(key) for key in TRAINING_KEYS})
    config.update(seed=seed)
    return config


def study_name(loss, config):
    """``<loss> <data set> e<epochs>x<iterations> b<batch> d<dim> lr<lr>-<schedule> f<folds>
    c<classes> s<seed>``: one study per loss, data set and budget."""
    c = config
    classes = "-all" if class_count(c["num_classes"]) is None else c["num_classes"]
    return (
        f"{loss} {c['dataset']} e{c['epochs']}x{c['iterations_per_epoch']} b{c['batch_size']} "
        f"d{c['embedding_size']} lr{c['lr']:g}-{c['lr_schedule']} f{c['num_folds']} c{classes} s{c['seed']}"
    )


def default_storage(out):
    return f"sqlite:///{Path(out).resolve() / 'tune.db'}"


def redact(url):
    """The storage URL without its password."""
    try:
        from sqlalchemy.engine import make_url

        return make_url(url).render_as_string(hide_password=True)
    except Exception:
        return "<storage URL>"


class StorageError(RuntimeError):
    """The Optuna storage cannot be opened (bad URL, missing driver, no server)."""


def make_storage(url, heartbeat=DEFAULT_HEARTBEAT):
    import optuna
    from optuna.storages import RDBStorage

    try:  # Optuna >= 4.9 renamed the callback and its keyword
        from optuna.storages import RetryHeartbeatStaleTrialCallback as Retry

        retry_keyword = "heartbeat_stale_trial_callback"
    except ImportError:
        from optuna.storages import RetryFailedTrialCallback as Retry

        retry_keyword = "failed_trial_callback"

    engine_kwargs = {}
    if url.startswith("sqlite"):
        # Several processes on one file: wait for the lock rather than fail at once.
        engine_kwargs = {"connect_args": {"timeout": 120}}
    else:
        engine_kwargs = {"pool_pre_ping": True}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return RDBStorage(
            url,
            engine_kwargs=engine_kwargs,
            heartbeat_interval=max(1, int(heartbeat)),
            grace_period=max(2, int(2 * heartbeat)),
            **{retry_keyword: Retry(max_retry=3)},
        )


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


def open_study(loss, config, storage, prune=True):
    import optuna

    name = study_name(loss, config)
    study = optuna.create_study(
        study_name=name, storage=storage, direction="maximize", load_if_exists=True, pruner=_pruner(prune)
    )
    if "budget" not in study.user_attrs:
        study.set_user_attr("budget", config)
        study.set_user_attr("loss", loss)
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


def target_trials(loss, trials):
    """Trials a study should hold: `trials`, or 1 when the space has nothing to search."""
    return 1 if is_empty(search_spaces()[loss]) else trials


# ----------------------------------------------------------------------------- objective


def cross_validation_score(
    data,
    recipe,
    make_trunk,
    *,
    seed=0,
    epochs,
    batch_size,
    iterations_per_epoch,
    lr,
    lr_schedule,
    num_folds=4,
    device="cpu",
    on_fold=None,
    on_iteration=None,
):
    """The protocol's tuning objective: mean over the folds of each fold model's best-epoch
    validation MAP@R, on the training half of the classes only. ``on_fold(k, running_mean)``
    is called after each fold (it may raise to stop, e.g. `optuna.TrialPruned`). Returns
    ``(mean, fold values, fold histories)``."""
    folds, _ = test_set_and_folds(data, num_folds)  # the test half is never touched
    values, histories = [], []
    for k, (train_set, val_set) in enumerate(folds):
        result = train_fold_model(
            recipe,
            make_trunk,
            train_set,
            val_set,
            seed * 1000 + k,
            epochs=epochs,
            batch_size=batch_size,
            iterations_per_epoch=iterations_per_epoch,
            lr=lr,
            make_lr_scheduler=lr_scheduler_factory(lr_schedule, epochs),
            device=device,
            on_iteration=on_iteration,
        )
        values.append(max(entry[OBJECTIVE_METRIC] for entry in result.history))
        histories.append(result.history)
        if on_fold is not None:
            on_fold(k, sum(values) / len(values))
    return sum(values) / len(values), values, histories


def with_params(recipe, params):
    """`recipe` whose loss is built with the keyword arguments `params`."""
    return dataclasses.replace(recipe, make_loss=functools.partial(recipe.make_loss, **params))


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


def _objective(loss, recipe, space, data, make_trunk, config, device, target=None):
    import optuna

    def objective(trial):
        trial.set_user_attr("worker", f"{socket.gethostname()}:{os.getpid()}")
        if target is not None:
            _check_surplus(trial, target)
        params = space(trial)
        trial.set_user_attr("params", params)

        def on_fold(k, running_mean):
            trial.report(running_mean, k)
            if k + 1 < config["num_folds"] and trial.should_prune():
                raise optuna.TrialPruned(f"running mean {running_mean:.4f} after fold {k}")

        value, folds, _ = cross_validation_score(
            data,
            with_params(recipe, params),
            make_trunk,
            seed=config["seed"],
            epochs=config["epochs"],
            batch_size=config["batch_size"],
            iterations_per_epoch=config["iterations_per_epoch"],
            lr=config["lr"],
            lr_schedule=config["lr_schedule"],
            num_folds=config["num_folds"],
            device=device,
            on_fold=on_fold,
        )
        trial.set_user_attr("folds", folds)
        return value

    return objective


# ----------------------------------------------------------------------------- workers


@dataclasses.dataclass
class TuneJob:
    losses: list
    trials: int
    config: dict
    storage: str
    cache_dir: str = None
    threads: int = 1
    device: str = "cpu"
    heartbeat: float = DEFAULT_HEARTBEAT
    prune: bool = True
    poll: float = 1.0


class _NoInterruptRecords:
    """Drops Optuna's report of a trial failed by Ctrl-C (a traceback for a clean stop)."""

    @staticmethod
    def filter(record):
        message = record.getMessage()
        return "KeyboardInterrupt" not in message and "SurplusTrial" not in message


def _quiet_optuna():
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    import logging

    for handler in logging.getLogger("optuna").handlers:  # child loggers' records pass these
        if not any(isinstance(f, _NoInterruptRecords) for f in handler.filters):
            handler.addFilter(_NoInterruptRecords())
    warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)


def run_worker(job, ready=None):
    """One worker: for each loss in turn, runs trials until its study holds `job.trials`
    finished ones (counting those other workers are running). Returns the number of
    trials this worker finished."""
    import optuna
    import torch

    _quiet_optuna()
    torch.set_num_threads(job.threads)
    storage = make_storage(job.storage, job.heartbeat)
    data = load_dataset(job.config["dataset"], job.cache_dir, job.config["num_classes"])
    make_trunk = DATASETS[job.config["dataset"]][1](job.config["embedding_size"])
    spaces = search_spaces()
    if ready is not None:  # the local workers start trials together, none runs ahead while another still loads
        try:
            ready.wait(timeout=300)
        except Exception:  # a sibling died or is very slow: go on alone
            pass
    done = 0
    for loss in job.losses:
        recipe = recipes([loss])[loss]
        target = target_trials(loss, job.trials)
        study = open_study(loss, job.config, storage, job.prune)
        objective = _objective(loss, recipe, spaces[loss], data, make_trunk, job.config, job.device, target)
        while True:
            optuna.storages.fail_stale_trials(study)  # a dead worker's trial: failed, queued again
            finished, running, waiting = counts(study)
            if finished >= target:
                break
            if finished + running >= target:
                time.sleep(job.poll)  # the rest are running; wait in case one of them dies
                continue
            asked = len(study.get_trials(deepcopy=False))
            runner = optuna.load_study(
                study_name=study.study_name,
                storage=storage,
                sampler=_sampler(job.config["seed"], asked),
                pruner=_pruner(job.prune),
            )
            try:
                runner.optimize(objective, n_trials=1, catch=())
            except SurplusTrial:
                continue
            done += 1
    return done


def _worker_main(job, ready=None):
    try:
        run_worker(job, ready)
    except KeyboardInterrupt:
        sys.exit(130)


# ----------------------------------------------------------------------------- command


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
    """Merges `entries` into ``out/tuned.json`` (other losses' entries are kept)."""
    path = Path(out) / TUNED_FILE
    existing = json.loads(path.read_text()) if path.exists() else {}
    existing.update(entries)
    return write_json_atomic(path, existing)


def write_png(study, path):
    """Optimisation history beside the slice plot of every parameter (Optuna's matplotlib plots)."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    import optuna.visualization.matplotlib as ovm
    from PIL import Image

    _quiet_optuna()
    warnings.filterwarnings("ignore", module="optuna")
    warnings.filterwarnings("ignore", message=".*tight_layout")
    warnings.filterwarnings("ignore", message=".*identical low and high xlims")
    images = []
    plots = [ovm.plot_optimization_history]
    if study.best_trial.params:
        plots.append(ovm.plot_slice)
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
    """The best parameters per loss as a text table."""

    rows = []
    for loss, e in entries.items():
        params = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in e["params"].items())
        rows.append((loss, f"{100 * e['value']:.2f}", e["trials"], params or "(nothing to tune)"))
    return format_text_table(("loss", "val MAP@R", "trials", "best parameters"), rows, align="lrrl")


def tune(
    losses,
    trials,
    config,
    storage,
    out,
    workers=1,
    cache_dir=None,
    threads=1,
    device="cpu",
    heartbeat=DEFAULT_HEARTBEAT,
    prune=True,
    command=None,
    progress=True,
):
    """Runs `workers` processes until every loss's study holds `trials` finished trials,
    writes ``out/tuned.json`` and a PNG per loss; returns a `TuneResult`. Ctrl-C stops the
    workers (their running trials are lost, finished ones kept) and still writes the outputs."""
    from tqdm import tqdm

    _quiet_optuna()
    started = time.perf_counter()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    job = TuneJob(list(losses), trials, config, storage, cache_dir, threads, device, heartbeat, prune)
    try:
        rdb = make_storage(storage, heartbeat)
        studies = {loss: open_study(loss, config, rdb, prune) for loss in losses}  # created once, before the workers
    except Exception as error:  # SQLAlchemy's: unknown dialect, missing driver, refused connection
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise StorageError(f"cannot open {redact(storage)}: {reason}") from error
    targets = {loss: target_trials(loss, trials) for loss in losses}

    def finished():
        return {loss: min(counts(study)[0], targets[loss]) for loss, study in studies.items()}

    context = multiprocessing.get_context("spawn")
    ready = context.Barrier(workers)
    processes = [context.Process(target=_worker_main, args=(job, ready), daemon=False) for _ in range(workers)]
    interrupted = False
    bar = tqdm(
        total=sum(targets.values()), desc="pml-rank tune", unit="trial", disable=not progress, dynamic_ncols=True
    )
    try:
        for p in processes:
            p.start()
        while any(p.is_alive() for p in processes):
            state = finished()
            bar.n = sum(state.values())
            current = next((loss for loss in losses if state[loss] < targets[loss]), losses[-1])
            bar.set_postfix_str(f"{current} {state[current]}/{targets[current]}")
            bar.refresh()
            time.sleep(1.0)
        bar.n = sum(finished().values())
        bar.refresh()
    except KeyboardInterrupt:
        interrupted = True
        for p in processes:
            p.join(timeout=30)
    finally:
        for p in processes:
            if p.is_alive():
                p.terminate()
                p.join()
        bar.close()
    failed = [p.exitcode for p in processes if p.exitcode not in (0, 130, -2)]
    seconds = time.perf_counter() - started
    entries = {}
    for loss, study in studies.items():
        entry = summarize_study(study, command=command, seconds=seconds, storage=storage)
        if entry is not None:
            entries[loss] = entry
            write_png(study, out / f"tune-{_file_name(loss)}.png")
    if entries:
        write_tuned(out, entries)
    if failed and not interrupted:
        raise RuntimeError(f"pml-rank tune: {len(failed)} worker(s) failed (exit codes {failed})")
    return TuneResult(entries, seconds, interrupted)


def _file_name(loss):
    return loss.replace(":", "-")


def storage_digest(url):
    return hashlib.sha256(redact(url).encode()).hexdigest()[:8]
