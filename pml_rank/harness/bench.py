"""`pml-rank bench`: every registered loss and PML's baselines under the Reality Check
protocol (`pml_rank.harness.evaluation`) on the embedded glyph data set, with the same trunk,
optimizer, batch size and training budget for all.

Each contender is a `Recipe`. Registered losses get their paper's miner and sampler from
`PAPER_RECIPES` (looked up by name, ignored for names not registered); any other
registered loss, a third party's included, trains with PML's `MPerClassSampler` and no
miner, like the Reality Check paper's embedding losses. Two rows need no training:
"raw input" (retrieval on the L2-normalised pixels) and "untrained" (the four fold
networks at their random initialisation).
"""

import dataclasses
import functools
import hashlib
import json
import os
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from ..plugins import registry
from ..samplers import HardNegativeClassSampler
from . import outputs
from .budget import (
    ALL_CLASSES,
    DATASET_NAMES,
    DEFAULTS,
    TRAINING_KEYS,
    fold_training_classes,
    minimum_classes,
    with_defaults,
)
from .components import PML_PREFIX, component_class
from .data import SmallCNN, load_glyphs
from .evaluation import METRICS, SHORT_NAMES, Recipe, lr_scheduler_factory, raw_input_accuracy, run_protocol, summarize
from .evaluation.training import default_sampler

RAW_INPUT = "raw input"
UNTRAINED = "untrained"


def m_per_class(m):
    """Sampler factory: PML's `MPerClassSampler`, `m` samples of each class per batch."""

    def make(train_set, batch_size, **_):
        return default_sampler(train_set.labels, batch_size, m_per_class=m)

    return make


def hard_negative_classes(train_set, batch_size, model, device, iterations_per_epoch, seed, **_):
    """N-pair batches (N classes x 2) by hard negative class mining with the network being
    trained (`pml_rank.samplers.HardNegativeClassSampler`)."""
    sampler = HardNegativeClassSampler(
        train_set.labels, classes_per_batch=batch_size // 2, batches_per_epoch=iterations_per_epoch, seed=seed
    )
    sampler.attach(model, train_set, device=device)
    return sampler


def batch_hard_miner():
    from pytorch_metric_learning import miners

    return miners.BatchHardMiner()


# The paper's miner and sampler for pml-rank's own losses. Losses not named here train
# with 4 samples per class and no miner.
PAPER_RECIPES = {
    "AUCLoss": dict(make_miner=batch_hard_miner, batches="m=4 per class, BatchHardMiner", per_class=4),
    "FastAPLoss": dict(batches="m=4 per class", per_class=4),
    "NPairsMCLoss": dict(
        make_sampler=hard_negative_classes, batches="N classes x 2, hard negative classes", per_class=2
    ),
    "NPairsOVOLoss": dict(
        make_sampler=hard_negative_classes, batches="N classes x 2, hard negative classes", per_class=2
    ),
    "RaMBOAPLoss": dict(batches="m=4 per class, score memory", per_class=4),
    "RaMBORecallLoss": dict(batches="m=4 per class, score memory", per_class=4),
}
DEFAULT_RECIPE = dict(batches="m=4 per class", per_class=4)

# PML's own losses with their defaults, the baselines of the Reality Check paper.
PML_BASELINES = {
    "ContrastiveLoss": dict(batches="m=4 per class", per_class=4),
    "TripletMarginLoss": dict(batches="m=4 per class", per_class=4),
    "FastAPLoss": dict(batches="m=4 per class", per_class=4),
    "NPairsLoss": dict(make_sampler=m_per_class(2), batches="N classes x 2", per_class=2),
}


def recipes(names=None):
    """``{row name: Recipe}`` for the registered losses (by their registry name) and
    PML's baselines (``pml:<name>``); `names` selects and orders a subset."""
    available = {}
    for name, cls in sorted(registry.losses().items()):
        extra = PAPER_RECIPES.get(name, DEFAULT_RECIPE)
        available[name] = Recipe(make_loss=cls, name=name, **extra)
    for name, extra in PML_BASELINES.items():
        name = PML_PREFIX + name
        available[name] = Recipe(make_loss=component_class("losses", name), name=name, **extra)
    if names is None:
        return available
    unknown = [n for n in names if n not in available]
    if unknown:
        raise KeyError(f"unknown loss {', '.join(unknown)}; available: {', '.join(available)}")
    return {n: available[n] for n in names}


def _glyphs(cache_dir=None, num_classes=None):
    return load_glyphs(cache_dir=cache_dir, num_classes=num_classes)


def class_count(num_classes):
    """`num_classes` as the data loaders take it: None for every class (`ALL_CLASSES`)."""
    return None if num_classes in (None, ALL_CLASSES) else num_classes


def _small_cnn(embedding_size):
    return lambda: SmallCNN(embedding_size=embedding_size)


# Data sets the bench can run on: name -> (loader(cache_dir, num_classes), trunk factory
# maker(embedding_size)). The glyphs need no download.
DATASETS = {"glyphs": (_glyphs, _small_cnn)}
assert tuple(DATASETS) == DATASET_NAMES, "budget.DATASET_NAMES lists the data sets for the command line"


class BudgetError(ValueError):
    """A budget the chosen rows cannot train with. ``option`` is the command-line option
    at fault (``"--batch-size"``, ``"--classes"``); the message names it."""

    def __init__(self, option, message):
        super().__init__(f"argument {option}: {message}")
        self.option = option


def _rows_by_per_class(contenders):
    groups = {}
    for name, recipe in contenders.items():
        if recipe.per_class:
            groups.setdefault(recipe.per_class, []).append(name)
    return dict(sorted(groups.items(), reverse=True))


def _group_name(per_class):
    return "the N-pair rows" if per_class == 2 else f"the m={per_class} rows"


def check_budget(contenders, batch_size, num_classes=None, num_folds=None):
    """Raises `BudgetError` when `batch_size` or `num_classes` (None or "all": not known yet)
    cannot make the batches of the rows `contenders` (``{name: Recipe}``): the batch size
    must be a multiple of each row's samples per class and hold two classes or more, and
    every fold model must train on at least as many classes as a batch holds."""
    num_folds = num_folds or DEFAULTS["num_folds"]
    num_classes = class_count(num_classes)
    groups = _rows_by_per_class(contenders)
    if any(batch_size % m or batch_size < 2 * m for m in groups):
        needs = [
            f"{'even' if m == 2 else f'a multiple of {m}'} and at least {2 * m} for {_group_name(m)} "
            f"({', '.join(names)})"
            for m, names in groups.items()
        ]
        raise BudgetError("--batch-size", f"{batch_size} does not fit the chosen rows: it must be {'; '.join(needs)}")
    if num_classes is None:
        return
    minimum = {m: minimum_classes(m, batch_size, num_folds) for m in groups}
    if groups and num_classes < max(minimum.values()):
        needs = [
            f"{minimum[m]} for {_group_name(m)} ({', '.join(names)}), {batch_size // m} classes per batch"
            for m, names in groups.items()
        ]
        raise BudgetError(
            "--classes",
            f"{num_classes} classes are too few at batch size {batch_size}: half of "
            f"the classes are for training and each of the {num_folds} fold models "
            f"trains on {fold_training_classes(num_classes, num_folds)} of them; "
            f"the minimum is {'; '.join(needs)}",
        )


@dataclasses.dataclass
class BenchResult:
    """Rows in order; ``runs[row]`` holds one ``{"concatenated", "separated"}`` dict per
    seed, ``histories[row]`` the fold histories of every seed, ``seconds[row]`` the
    training and evaluation time of the row (summed over seeds, whichever process ran
    them), ``params[row]`` the loss's constructor keywords and ``sources[row]`` where they
    came from ("defaults" or the tuned file)."""

    config: dict
    rows: list
    runs: dict
    histories: dict
    seconds: dict
    batches: dict
    total_seconds: float = 0.0
    params: dict = dataclasses.field(default_factory=dict)
    sources: dict = dataclasses.field(default_factory=dict)
    resumed: int = 0

    def summary(self):
        return {row: summarize(self.runs[row]) for row in self.rows}


class StoreMismatchError(RuntimeError):
    """The store in the output folder holds runs of a different configuration."""


STORE_FILE = "bench-runs.jsonl"
# What defines comparable runs; the seeds and the rows may grow from one run to the next.
STORE_KEYS = (*TRAINING_KEYS, "device")


def _digest(value):
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]


class RunStore:
    """Finished (row, seed) runs, one JSON line each, appended (and flushed) as soon as a run
    finishes, so an interrupted or crashed bench keeps what finished. Each line carries the
    configuration's key; a store holding another configuration is refused, never mixed or
    overwritten. A row's runs are keyed by its loss parameters too: after new tuned
    parameters the row trains again, and the old runs stay in the file."""

    def __init__(self, path, config):
        self.path = Path(path)
        self.budget = {k: config.get(k) for k in STORE_KEYS}
        self.key = _digest(self.budget)
        self.runs = {}
        text = self.path.read_text() if self.path.exists() else ""
        # A crash can cut the last line short: the next record must start on a line of its own.
        self._cut_short = bool(text) and not text.endswith("\n")
        if text:
            for line in text.splitlines():
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut short by a crash: that run simply runs again
                if record.get("config_key") != self.key:
                    theirs = record.get("budget", {})
                    diff = ", ".join(
                        f"{k} {theirs.get(k)!r} there, {self.budget[k]!r} now"
                        for k in STORE_KEYS
                        if theirs.get(k) != self.budget[k]
                    )
                    raise StoreMismatchError(
                        f"{self.path} holds bench runs of another configuration ({diff or 'different key'}); "
                        "it is never overwritten: choose another --out, or delete that file to start afresh"
                    )
                self.runs[(record["row"], record["params_key"], record["seed"])] = record

    def get(self, row, params, seed):
        return self.runs.get((row, _digest(params), seed))

    def add(self, row, params, seed, outcome):
        record = {
            "config_key": self.key,
            "budget": self.budget,
            "row": row,
            "params_key": _digest(params),
            "params": params,
            "seed": seed,
            **outcome,
        }
        self.runs[(row, record["params_key"], seed)] = record
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as file:
            file.write(("\n" if self._cut_short else "") + json.dumps(record) + "\n")
            self._cut_short = False
            file.flush()
            os.fsync(file.fileno())
        return record


def tuned_budget_differences(path, config):
    """How the budget the file's parameters were tuned with differs from `config` (a list of
    ``"epochs 8 there, 4 here"`` strings; empty when they match or the file does not say)."""
    payload = json.loads(Path(path).read_text())
    differences = set()
    for entry in payload.values():
        budget = entry.get("budget") if isinstance(entry, dict) else None
        for key, value in (budget or {}).items():
            if key in config and key != "seeds" and config[key] != value:
                differences.add(f"{key} {value!r} there, {config[key]!r} here")
    return sorted(differences)


def load_params(path):
    """``{row: constructor keywords}`` from a tuned file (`pml-rank tune`'s tuned.json)."""
    payload = json.loads(Path(path).read_text())
    return {
        row: dict(entry["params"])
        for row, entry in payload.items()
        if not row.startswith("_") and isinstance(entry, dict) and "params" in entry
    }


# What a worker process needs besides the job: its data set is loaded once per process.
_WORKER = {}


def _init_worker(counter, threads):
    torch.set_num_threads(threads)
    _WORKER["counter"] = counter


def load_dataset(dataset, cache_dir, num_classes):
    """The data set a bench or tune process trains on (`num_classes` a count or "all"),
    loaded once per process."""
    key = (dataset, cache_dir, num_classes)
    if key not in _WORKER:
        _WORKER[key] = DATASETS[dataset][0](cache_dir, class_count(num_classes))
    return _WORKER[key]


def run_job(job):
    """One (row, seed) of the bench: the protocol with the row's recipe and parameters.
    Runs in a worker process or in the caller's; the result depends only on `job`."""
    config, row, params, seed, cache_dir = job["config"], job["row"], job["params"], job["seed"], job["cache_dir"]
    data = load_dataset(config["dataset"], cache_dir, config["num_classes"])
    make_trunk = DATASETS[config["dataset"]][1](config["embedding_size"])
    if row == UNTRAINED:  # the same protocol with zero epochs (no loss is ever called)
        recipe, epochs = Recipe(make_loss=lambda: None, name=UNTRAINED), 0
    else:
        recipe, epochs = recipes([row])[row], config["epochs"]
        recipe = dataclasses.replace(recipe, make_loss=functools.partial(recipe.make_loss, **params))
    counter, progress = _WORKER.get("counter"), _WORKER.get("progress")

    def on_iteration(trainer):
        if progress is not None:  # in the caller's process: its bar directly
            progress()
        elif counter is not None:
            with counter.get_lock():
                counter.value += 1

    started = time.perf_counter()
    result = run_protocol(
        data,
        recipe,
        make_trunk,
        seed=seed,
        epochs=epochs,
        num_folds=config["num_folds"],
        batch_size=config["batch_size"],
        iterations_per_epoch=config["iterations_per_epoch"],
        lr=config["lr"],
        make_lr_scheduler=lr_scheduler_factory(config["lr_schedule"], epochs),
        device=config["device"],
        on_iteration=on_iteration,
    )
    return {
        "run": {"concatenated": result.concatenated, "separated": result.separated},
        "histories": result.histories,
        "seconds": time.perf_counter() - started,
    }


def run_bench(
    losses=None,
    dataset="glyphs",
    epochs=None,
    iterations_per_epoch=None,
    batch_size=None,
    seeds=None,
    embedding_size=None,
    lr=None,
    lr_schedule=None,
    num_folds=None,
    device=None,
    cache_dir=None,
    num_classes=None,
    threads=None,
    progress=True,
    params=None,
    params_source=None,
    workers=1,
    store=None,
):
    """Runs every contender (`recipes(losses)`) plus the raw input and untrained rows
    with the same budget; returns a `BenchResult`. Arguments left at None take
    `DEFAULTS`. `seeds` is the number of repeated runs (seeds 0, 1, ...). `threads` sets
    torch's CPU threads (None: leave torch's setting), in every worker too; the
    configuration records the number used. Raises `BudgetError` before any training when
    the batch size or the number of classes cannot make the rows' batches.

    `params` maps rows to constructor keywords (tuned parameters, see `load_params`);
    rows not in it train with the loss's defaults. `workers` processes run the (row, seed)
    jobs in parallel, each job seeded by itself alone, so the results equal a serial run's.
    `store` (a path) keeps every finished (row, seed) at once (`RunStore`) and skips the
    ones it already holds."""
    import multiprocessing
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

    config = with_defaults(
        dataset=dataset,
        epochs=epochs,
        iterations_per_epoch=iterations_per_epoch,
        batch_size=batch_size,
        seeds=seeds,
        embedding_size=embedding_size,
        lr=lr,
        lr_schedule=lr_schedule,
        num_folds=num_folds,
        device=device,
        num_classes=num_classes,
    )
    num_classes = config["num_classes"]
    if config["dataset"] not in DATASETS:
        raise KeyError(f"unknown data set {config['dataset']}; available: {', '.join(DATASETS)}")
    contenders = recipes(losses)
    check_budget(contenders, config["batch_size"], num_classes, config["num_folds"])
    if threads is not None:
        torch.set_num_threads(threads)
    config["threads"] = torch.get_num_threads()
    params = params or {}
    run_store = RunStore(store, config) if store is not None else None
    started = time.perf_counter()
    try:
        data = load_dataset(config["dataset"], cache_dir, num_classes)
    except ValueError as error:
        if class_count(num_classes) is None:
            raise
        raise BudgetError("--classes", str(error)) from None
    check_budget(contenders, config["batch_size"], len(np.unique(data.labels)), config["num_folds"])
    seed_list = list(range(config["seeds"]))

    rows = [RAW_INPUT, UNTRAINED, *contenders]
    row_params = {row: dict(params.get(row, {})) for row in rows}
    sources = {row: (params_source or "tuned") if row in params else "defaults" for row in contenders}
    sources.update({RAW_INPUT: "", UNTRAINED: ""})
    batches = {RAW_INPUT: "", UNTRAINED: "", **{n: r.batches for n, r in contenders.items()}}

    t = time.perf_counter()
    raw = raw_input_accuracy(data)
    outcomes = {
        (RAW_INPUT, 0): {
            "run": {"concatenated": raw, "separated": raw},
            "histories": [],
            "seconds": time.perf_counter() - t,
        }
    }
    jobs, resumed = [], 0
    for row in rows[1:]:
        for seed in seed_list:
            stored = run_store.get(row, row_params[row], seed) if run_store is not None else None
            if stored is not None:
                outcomes[(row, seed)] = stored
                resumed += 1
            else:
                jobs.append(dict(config=config, row=row, params=row_params[row], seed=seed, cache_dir=cache_dir))

    per_job = config["num_folds"] * config["epochs"] * config["iterations_per_epoch"]
    total = sum(per_job for job in jobs if job["row"] != UNTRAINED)
    bar = tqdm(total=total, desc="pml-rank bench", unit="it", disable=not progress, dynamic_ncols=True, mininterval=1.0)
    context = multiprocessing.get_context("spawn")
    counter = context.Value("q", 0)

    def finish(job, outcome):
        if run_store is not None:
            run_store.add(job["row"], job["params"], job["seed"], outcome)
        outcomes[(job["row"], job["seed"])] = outcome

    try:
        if workers <= 1:
            _init_worker(counter, config["threads"])
            _WORKER["progress"] = lambda: bar.update(1)
            for job in jobs:
                bar.set_postfix_str(f"{job['row']} seed {job['seed']}")
                finish(job, run_job(job))
        elif jobs:
            with ProcessPoolExecutor(
                workers, mp_context=context, initializer=_init_worker, initargs=(counter, config["threads"])
            ) as pool:
                pending = {pool.submit(run_job, job): job for job in jobs}
                while pending:
                    done, _ = wait(pending, timeout=1.0, return_when=FIRST_COMPLETED)
                    for future in done:
                        finish(pending.pop(future), future.result())
                    bar.n = counter.value
                    bar.set_postfix_str(f"{len(jobs) - len(pending)}/{len(jobs)} runs")
                    bar.refresh()
    finally:
        _WORKER.pop("counter", None)
        _WORKER.pop("progress", None)
        bar.close()

    runs, histories, seconds = {}, {}, {}
    for row in rows:
        found = [outcomes[(row, s)] for s in ([0] if row == RAW_INPUT else seed_list)]
        runs[row] = [o["run"] for o in found]
        histories[row] = [o["histories"] for o in found] if row != RAW_INPUT else []
        seconds[row] = sum(o["seconds"] for o in found)
    return BenchResult(
        config, rows, runs, histories, seconds, batches, time.perf_counter() - started, row_params, sources, resumed
    )


def _cell(mean, half_width):
    if np.isnan(half_width):
        return f"{100 * mean:.2f}"
    return f"{100 * mean:.2f} ± {100 * half_width:.2f}"


def format_table(result):
    """The accuracy table as text, in percent: mean ± 95% CI half width over seeds."""
    summary = result.summary()
    header = [
        "",
        *[f"concat {SHORT_NAMES[m]}" for m in METRICS],
        *[f"sep {SHORT_NAMES[m]}" for m in METRICS],
        "seconds",
        "parameters",
    ]
    lines = [header]
    for row in result.rows:
        s = summary[row]
        lines.append(
            [
                row,
                *[_cell(*s["concatenated"][m]) for m in METRICS],
                *[_cell(*s["separated"][m]) for m in METRICS],
                f"{result.seconds[row]:.0f}",
                describe_params(result, row),
            ]
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    last = len(header) - 1
    text = [
        "  ".join(
            cell.ljust(w) if i in (0, last) else cell.rjust(w) for i, (cell, w) in enumerate(zip(line, widths))
        ).rstrip()
        for line in lines
    ]
    c = result.config
    title = (
        f"Reality Check protocol on {c['dataset']}: {c['num_folds']}-fold CV over the first half of the "
        f"classes, test on the second half; {c['seeds']} seed(s), {c['epochs']} epochs x "
        f"{c['iterations_per_epoch']} iterations, batch {c['batch_size']}, embeddings "
        f"{c['embedding_size']} (concatenated: {c['num_folds'] * c['embedding_size']}). "
        f"Percent, mean ± 95% CI; {result.total_seconds:.0f} s in all."
    )
    return "\n".join([title, *text])


def describe_params(result, row):
    """The parameters a row trained with, for tables: ``tuned: a=1, b=2`` or ``defaults``."""
    source = result.sources.get(row, "")
    if not source:
        return ""
    values = ", ".join(
        f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in result.params.get(row, {}).items()
    )
    return f"{source}: {values}" if values else source


def write_csv(result, path):
    """One line per row: mean and CI half width (fractions in [0, 1]) of every metric."""
    summary = result.summary()
    columns = ["row", "batches", "params_source", "params", "seeds", "seconds"]
    for kind in ("concatenated", "separated"):
        for m in METRICS:
            columns += [f"{kind}_{m}", f"{kind}_{m}_ci95"]
    lines = [",".join(columns)]
    for row in result.rows:
        params = json.dumps(result.params.get(row, {}), sort_keys=True) if result.sources.get(row) else ""
        cells = [
            row,
            result.batches[row],
            result.sources.get(row, ""),
            params,
            str(len(result.runs[row])),
            f"{result.seconds[row]:.1f}",
        ]
        for kind in ("concatenated", "separated"):
            for m in METRICS:
                mean, ci = summary[row][kind][m]
                cells += [f"{mean:.6f}", "" if np.isnan(ci) else f"{ci:.6f}"]
        lines.append(",".join('"' + c.replace('"', '""') + '"' if "," in c or '"' in c else c for c in cells))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return outputs.write_text(path, "\n".join(lines) + "\n")


def write_json(result, path):
    """Configuration, summary, every seed's accuracies and every fold's history."""
    summary = result.summary()

    def pair(value):
        mean, ci = value
        return {"mean": mean, "ci95": None if np.isnan(ci) else ci}

    payload = {
        "config": result.config,
        "total_seconds": result.total_seconds,
        "rows": [
            {
                "row": row,
                "batches": result.batches[row],
                "seconds": result.seconds[row],
                "params_source": result.sources.get(row, ""),
                "params": result.params.get(row, {}),
                "summary": {
                    kind: {m: pair(summary[row][kind][m]) for m in METRICS} for kind in ("concatenated", "separated")
                },
                "runs": result.runs[row],
                "histories": result.histories[row],
            }
            for row in result.rows
        ],
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return outputs.write_text(path, json.dumps(payload, indent=1))


def _mean_curve(histories, key):
    """Mean over seeds and folds of `key` per epoch (folds that stopped early end sooner)."""
    by_epoch = {}
    for seed_histories in histories:
        for fold in seed_histories:
            for entry in fold:
                if key in entry:
                    by_epoch.setdefault(entry["epoch"], []).append(entry[key])
    epochs = sorted(by_epoch)
    return epochs, [float(np.mean(by_epoch[e])) for e in epochs]


def _row_colors(count):
    """`count` distinct colours: tab20's ten strong shades, then its ten light ones, then
    evenly spaced hues when more rows than that are drawn."""
    import matplotlib

    tab20 = matplotlib.colormaps["tab20"].colors
    palette = list(tab20[0::2]) + list(tab20[1::2])
    if count <= len(palette):
        return palette[:count]
    return [matplotlib.colormaps["hsv"](i / count) for i in range(count)]


def bench_figure(result):
    """The bench's figure (a matplotlib `Figure`): bar chart of MAP@R (concatenated and
    separated; 95% CI where there are two seeds or more, "no CI" said otherwise) beside
    the training curves, validation MAP@R and training loss per epoch (mean over folds
    and seeds, integer epochs), one distinct colour per row and the legend outside the
    axes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    summary = result.summary()
    metric = "mean_average_precision_at_r"
    c = result.config
    fig, (bars, val, loss) = plt.subplots(1, 3, figsize=(19, 5.5), gridspec_kw={"width_ratios": [1.4, 1, 1]})
    y = np.arange(len(result.rows))
    any_ci, no_ci = False, []
    for offset, kind, color in ((-0.2, "concatenated", "tab:blue"), (0.2, "separated", "tab:orange")):
        means = np.array([100 * summary[r][kind][metric][0] for r in result.rows])
        cis = np.array([100 * summary[r][kind][metric][1] for r in result.rows])
        label = (
            f"{kind} ({c['num_folds']}x{c['embedding_size']}-dim)"
            if kind == "concatenated"
            else f"{kind} ({c['embedding_size']}-dim, mean)"
        )
        bars.barh(y + offset, means, height=0.4, color=color, label=label)
        has_ci = ~np.isnan(cis)
        no_ci += [r for r, ok in zip(result.rows, has_ci) if not ok and r not in no_ci]
        if has_ci.any():  # no error bar at all where there is no interval (one run): never a ±0
            any_ci = True
            bars.errorbar(
                means[has_ci],
                (y + offset)[has_ci],
                xerr=cis[has_ci],
                fmt="none",
                ecolor="black",
                capsize=3,
                linewidth=1,
            )
    bars.set_yticks(y, result.rows)
    bars.invert_yaxis()
    bars.set_xlabel("MAP@R on held-out classes (%)")
    seeds = c["seeds"]
    if any_ci:
        title = f"{c['dataset']}: mean ± 95% CI over {seeds} seeds"
        if no_ci:
            title += f"\n(no CI for {', '.join(no_ci)}: one run)"
    else:
        title = f"{c['dataset']}: {seeds} seed{'s' if seeds != 1 else ''}, no CI (needs two seeds or more)"
    bars.set_title(title)
    bars.legend(loc="upper left", bbox_to_anchor=(0, -0.1), fontsize=8, ncol=2, frameon=False)
    bars.grid(axis="x", alpha=0.3)
    trained = [r for r in result.rows if r not in (RAW_INPUT, UNTRAINED)]
    for row, color in zip(trained, _row_colors(len(trained))):
        # PML's baselines dashed: the two families stay apart at a glance.
        style = dict(color=color, marker="o", label=row, linestyle="--" if row.startswith(PML_PREFIX) else "-")
        epochs, values = _mean_curve(result.histories[row], metric)
        val.plot(epochs, [100 * v for v in values], **style)
        epochs, values = _mean_curve(result.histories[row], "loss")
        if values and values[0] != 0:
            loss.plot(epochs, [v / values[0] for v in values], **style)
    for row, style in ((RAW_INPUT, ":"), (UNTRAINED, "-.")):
        val.axhline(
            100 * summary[row]["separated"][metric][0], color="gray", linestyle=style, label=f"{row} (test classes)"
        )
    val.set(xlabel="epoch", ylabel="validation MAP@R (%)", title="validation fold (held-out training classes)")
    loss.set(xlabel="epoch", ylabel="training loss / first epoch's", title="training loss, relative")
    for ax in (val, loss):
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    # One legend for both curve panels, right of them, off the data.
    loss.legend(
        *val.get_legend_handles_labels(), loc="upper left", bbox_to_anchor=(1.02, 1), fontsize=8, borderaxespad=0
    )
    fig.tight_layout()
    return fig


def write_png(result, path):
    """Writes `bench_figure` to `path` (atomically); returns the path."""
    fig = bench_figure(result)
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        outputs.save_figure(fig, path, dpi=110, bbox_inches="tight")
    finally:
        plt.close(fig)
    return path


def write_all(result, folder):
    """Writes ``bench.csv``, ``bench.json`` and ``bench.png`` into `folder`; returns the paths."""
    folder = Path(folder)
    return [
        write_csv(result, folder / "bench.csv"),
        write_json(result, folder / "bench.json"),
        write_png(result, folder / "bench.png"),
    ]
