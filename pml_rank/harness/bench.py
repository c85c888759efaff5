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
import json
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from ..plugins import registry
from ..samplers import HardNegativeClassSampler
from . import outputs
from .budget import DATASET_NAMES, DEFAULTS, fold_training_classes, minimum_classes
from .components import PML_PREFIX, component_class
from .data import SmallCNN, load_glyphs
from .evaluation import METRICS, SHORT_NAMES, Recipe, raw_input_accuracy, run_protocol, summarize
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
    sampler = HardNegativeClassSampler(train_set.labels, classes_per_batch=batch_size // 2,
                            batches_per_epoch=iterations_per_epoch, seed=seed)
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
    "NPairsMCLoss": dict(make_sampler=hard_negative_classes, batches="N classes x 2, hard negative classes",
                         per_class=2),
    "NPairsOVOLoss": dict(make_sampler=hard_negative_classes, batches="N classes x 2, hard negative classes",
                          per_class=2),
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
    """Raises `BudgetError` when `batch_size` or `num_classes` (None: not known yet)
    cannot make the batches of the rows `contenders` (``{name: Recipe}``): the batch size
    must be a multiple of each row's samples per class and hold two classes or more, and
    every fold model must train on at least as many classes as a batch holds."""
    num_folds = num_folds or DEFAULTS["num_folds"]
    groups = _rows_by_per_class(contenders)
    if any(batch_size % m or batch_size < 2 * m for m in groups):
        needs = [f"{'even' if m == 2 else f'a multiple of {m}'} and at least {2 * m} for {_group_name(m)} "
                 f"({', '.join(names)})" for m, names in groups.items()]
        raise BudgetError("--batch-size", f"{batch_size} does not fit the chosen rows: it must be "
                                          f"{'; '.join(needs)}")
    if num_classes is None:
        return
    minimum = {m: minimum_classes(m, batch_size, num_folds) for m in groups}
    if groups and num_classes < max(minimum.values()):
        needs = [f"{minimum[m]} for {_group_name(m)} ({', '.join(names)}), {batch_size // m} classes per batch"
                 for m, names in groups.items()]
        raise BudgetError("--classes", f"{num_classes} classes are too few at batch size {batch_size}: half of "
                                       f"the classes are for training and each of the {num_folds} fold models "
                                       f"trains on {fold_training_classes(num_classes, num_folds)} of them; "
                                       f"the minimum is {'; '.join(needs)}")


@dataclasses.dataclass
class BenchResult:
    """Rows in order; ``runs[row]`` holds one ``{"concatenated", "separated"}`` dict per
    seed, ``histories[row]`` the fold histories of every seed, ``seconds[row]`` the
    training and evaluation time of the row."""

    config: dict
    rows: list
    runs: dict
    histories: dict
    seconds: dict
    batches: dict
    total_seconds: float = 0.0

    def summary(self):
        return {row: summarize(self.runs[row]) for row in self.rows}


def run_bench(losses=None, dataset="glyphs", epochs=None, iterations_per_epoch=None, batch_size=None,
              seeds=None, embedding_size=None, lr=None, num_folds=None, device=None, cache_dir=None,
              num_classes=None, threads=None, progress=True):
    """Runs every contender (`recipes(losses)`) plus the raw input and untrained rows
    with the same budget; returns a `BenchResult`. Arguments left at None take
    `DEFAULTS`. `seeds` is the number of repeated runs (seeds 0, 1, ...). `threads` sets
    torch's CPU threads (None: leave torch's setting); the configuration records the
    number used. Raises `BudgetError` before any training when the batch size or the
    number of classes cannot make the rows' batches."""
    given = dict(dataset=dataset, epochs=epochs, iterations_per_epoch=iterations_per_epoch,
                 batch_size=batch_size, seeds=seeds, embedding_size=embedding_size, lr=lr,
                 num_folds=num_folds, device=device)
    config = {k: DEFAULTS[k] if v is None else v for k, v in given.items()}
    config["num_classes"] = num_classes
    if config["dataset"] not in DATASETS:
        raise KeyError(f"unknown data set {config['dataset']}; available: {', '.join(DATASETS)}")
    contenders = recipes(losses)
    check_budget(contenders, config["batch_size"], num_classes, config["num_folds"])
    if threads is not None:
        torch.set_num_threads(threads)
    config["threads"] = torch.get_num_threads()
    started = time.perf_counter()
    load, trunk_for = DATASETS[config["dataset"]]
    try:
        data = load(cache_dir, num_classes)
    except ValueError as error:
        if num_classes is None:
            raise
        raise BudgetError("--classes", str(error)) from None
    check_budget(contenders, config["batch_size"], len(np.unique(data.labels)), config["num_folds"])
    make_trunk = trunk_for(config["embedding_size"])
    seed_list = list(range(config["seeds"]))
    shared = dict(num_folds=config["num_folds"], batch_size=config["batch_size"],
                  iterations_per_epoch=config["iterations_per_epoch"], lr=config["lr"],
                  device=config["device"])

    rows = [RAW_INPUT, UNTRAINED, *contenders]
    runs, histories, seconds = {}, {}, {}
    batches = {RAW_INPUT: "", UNTRAINED: "", **{n: r.batches for n, r in contenders.items()}}

    t = time.perf_counter()
    raw = raw_input_accuracy(data)
    runs[RAW_INPUT] = [{"concatenated": raw, "separated": raw}]
    histories[RAW_INPUT], seconds[RAW_INPUT] = [], time.perf_counter() - t

    total = len(contenders) * len(seed_list) * config["num_folds"] * config["epochs"] * config["iterations_per_epoch"]
    bar = tqdm(total=total, desc="pml-rank bench", unit="it", disable=not progress, dynamic_ncols=True,
               mininterval=1.0)
    # The untrained row: the same protocol with zero epochs (no loss is ever called).
    untrained = Recipe(make_loss=lambda: None, name=UNTRAINED)
    for name, recipe, epochs_here in [(UNTRAINED, untrained, 0),
                                      *[(n, r, config["epochs"]) for n, r in contenders.items()]]:
        t = time.perf_counter()
        runs[name], histories[name] = [], []
        for seed in seed_list:
            bar.set_postfix_str(f"{name} seed {seed}")
            result = run_protocol(data, recipe, make_trunk, seed=seed, epochs=epochs_here,
                                  on_iteration=lambda trainer: bar.update(1), **shared)
            runs[name].append({"concatenated": result.concatenated, "separated": result.separated})
            histories[name].append(result.histories)
        seconds[name] = time.perf_counter() - t
    bar.close()
    return BenchResult(config, rows, runs, histories, seconds, batches, time.perf_counter() - started)


def _cell(mean, half_width):
    if np.isnan(half_width):
        return f"{100 * mean:.2f}"
    return f"{100 * mean:.2f} ± {100 * half_width:.2f}"


def format_table(result):
    """The accuracy table as text, in percent: mean ± 95% CI half width over seeds."""
    summary = result.summary()
    header = ["", *[f"concat {SHORT_NAMES[m]}" for m in METRICS], *[f"sep {SHORT_NAMES[m]}" for m in METRICS],
              "seconds"]
    lines = [header]
    for row in result.rows:
        s = summary[row]
        lines.append([row, *[_cell(*s["concatenated"][m]) for m in METRICS],
                      *[_cell(*s["separated"][m]) for m in METRICS], f"{result.seconds[row]:.0f}"])
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    text = ["  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(line, widths)))
            for line in lines]
    c = result.config
    title = (f"Reality Check protocol on {c['dataset']}: {c['num_folds']}-fold CV over the first half of the "
             f"classes, test on the second half; {c['seeds']} seed(s), {c['epochs']} epochs x "
             f"{c['iterations_per_epoch']} iterations, batch {c['batch_size']}, embeddings "
             f"{c['embedding_size']} (concatenated: {c['num_folds'] * c['embedding_size']}). "
             f"Percent, mean ± 95% CI; {result.total_seconds:.0f} s in all.")
    return "\n".join([title, *text])


def write_csv(result, path):
    """One line per row: mean and CI half width (fractions in [0, 1]) of every metric."""
    summary = result.summary()
    columns = ["row", "batches", "seeds", "seconds"]
    for kind in ("concatenated", "separated"):
        for m in METRICS:
            columns += [f"{kind}_{m}", f"{kind}_{m}_ci95"]
    lines = [",".join(columns)]
    for row in result.rows:
        cells = [row, result.batches[row], str(len(result.runs[row])), f"{result.seconds[row]:.1f}"]
        for kind in ("concatenated", "separated"):
            for m in METRICS:
                mean, ci = summary[row][kind][m]
                cells += [f"{mean:.6f}", "" if np.isnan(ci) else f"{ci:.6f}"]
        lines.append(",".join(f'"{c}"' if "," in c else c for c in cells))
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
        "config": result.config, "total_seconds": result.total_seconds,
        "rows": [{"row": row, "batches": result.batches[row], "seconds": result.seconds[row],
                  "summary": {kind: {m: pair(summary[row][kind][m]) for m in METRICS}
                              for kind in ("concatenated", "separated")},
                  "runs": result.runs[row], "histories": result.histories[row]}
                 for row in result.rows],
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
        label = (f"{kind} ({c['num_folds']}x{c['embedding_size']}-dim)" if kind == "concatenated"
                 else f"{kind} ({c['embedding_size']}-dim, mean)")
        bars.barh(y + offset, means, height=0.4, color=color, label=label)
        has_ci = ~np.isnan(cis)
        no_ci += [r for r, ok in zip(result.rows, has_ci) if not ok and r not in no_ci]
        if has_ci.any():  # no error bar at all where there is no interval (one run): never a ±0
            any_ci = True
            bars.errorbar(means[has_ci], (y + offset)[has_ci], xerr=cis[has_ci], fmt="none", ecolor="black",
                          capsize=3, linewidth=1)
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
        val.axhline(100 * summary[row]["separated"][metric][0], color="gray", linestyle=style,
                    label=f"{row} (test classes)")
    val.set(xlabel="epoch", ylabel="validation MAP@R (%)", title="validation fold (held-out training classes)")
    loss.set(xlabel="epoch", ylabel="training loss / first epoch's", title="training loss, relative")
    for ax in (val, loss):
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    # One legend for both curve panels, right of them, off the data.
    loss.legend(*val.get_legend_handles_labels(), loc="upper left", bbox_to_anchor=(1.02, 1), fontsize=8,
                borderaxespad=0)
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
    return [write_csv(result, folder / "bench.csv"), write_json(result, folder / "bench.json"),
            write_png(result, folder / "bench.png")]
