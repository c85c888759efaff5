"""`pml-rank bench`'s outputs, rebuilt from its jobs' outcomes alone: the text table, CSV,
JSON and PNG. Whichever process writes them, from the same store they are the same files."""

import dataclasses
import json
from pathlib import Path

import numpy as np

from . import outputs
from .budget import MAP_AT_R, STANDARD_PROTOCOL
from .components import PML_PREFIX
from .evaluation import METRICS, SHORT_NAMES, summarize
from .runner import RAW_INPUT, UNTRAINED
from .text_table import format_text_table


@dataclasses.dataclass
class BenchResult:
    """A bench's `budget` (its training keys, its preset and its seeds: the JSON's
    ``"config"``) and its rows in order; ``runs[row]`` holds one ``{"concatenated",
    "separated"}`` dict per seed, ``histories[row]`` the fold histories of every seed,
    ``seconds[row]`` the training and evaluation time of the row (summed over seeds,
    whichever process ran them), ``params[row]`` the loss's parameters and
    ``sources[row]`` where they came from ("defaults", the tuned file, "defaults won the
    search")."""

    budget: dict
    rows: list
    runs: dict
    histories: dict
    seconds: dict
    batches: dict
    params: dict = dataclasses.field(default_factory=dict)
    sources: dict = dataclasses.field(default_factory=dict)
    resumed: int = 0

    @property
    def total_seconds(self):
        return sum(self.seconds.values())

    def summary(self):
        return {row: summarize(self.runs[row]) for row in self.rows}


def _cell(mean, half_width):
    if np.isnan(half_width):
        return f"{100 * mean:.2f}"
    return f"{100 * mean:.2f} ± {100 * half_width:.2f}"


def _protocol_words(c):
    """What the bench's protocol trains and tests, for the table's title (`c`: its budget;
    a bench from before the ``protocol`` key is a Reality Check one)."""
    if c.get("protocol") == STANDARD_PROTOCOL:
        return (
            f"Standard protocol on {c['dataset']} (preset {c['preset']}): one model trained on the training split "
            "for every epoch, tested on the test split (concatenated and separated: the same model)"
        )
    return (
        f"Reality Check protocol on {c['dataset']} (preset {c['preset']}): {c['num_folds']}-fold CV over the "
        f"first half of the classes ({c['num_classes']}), test on the second half"
    )


def _concatenated_size(c):
    return "" if c.get("protocol") == STANDARD_PROTOCOL else f" (concatenated: {c['num_folds'] * c['embedding_size']})"


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
    lines = []
    behind = rows_not_above_untrained(summary)
    for row in result.rows:
        s = summary[row]
        lines.append(
            [
                f"{row} {NOT_ABOVE_UNTRAINED}" if row in behind else row,
                *[_cell(*s["concatenated"][m]) for m in METRICS],
                *[_cell(*s["separated"][m]) for m in METRICS],
                f"{result.seconds[row]:.0f}",
                describe_params(result, row),
            ]
        )
    table = format_text_table(header, lines, align="l" + "r" * (len(header) - 2) + "l")
    c = result.budget
    images = ""
    if c.get("image_size"):
        images = f", {c['image_size']} px crops of a {c['resize']} px resize ({c['augmentation']})"
    patience = f", early stopping after {c['patience']} epochs without progress" if c["patience"] else ""
    title = (
        f"{_protocol_words(c)}; {c['seeds']} seed(s); "
        f"{c['trunk']}{' (random init)' if c['random_init'] and c['trunk'] != 'small-cnn' else ''}"
        f"{', frozen BatchNorm' if c['freeze_batchnorm'] else ''}, {c['epochs']} epochs x "
        f"{c['iterations_per_epoch']} iterations{patience}, batch {c['batch_size']}, "
        f"{c['optimizer']} lr {c['lr']:g} ({c['lr_schedule']}), embeddings {c['embedding_size']}"
        f"{_concatenated_size(c)}{', mixed precision' if c['amp'] else ''}"
        f"{images}. "
        f"Percent, mean ± 95% CI; {result.total_seconds:.0f} s of training and evaluation in all."
    )
    note = (
        [f"{NOT_ABOVE_UNTRAINED} not above {UNTRAINED} (concatenated MAP@R): it learned nothing here"] if behind else []
    )
    return "\n".join([title, table, *note])


# Marks a trained row whose concatenated MAP@R is not above the untrained networks'.
NOT_ABOVE_UNTRAINED = "(!)"


def rows_not_above_untrained(summary):
    """The trained rows of a `BenchResult.summary()` whose mean concatenated MAP@R is at or
    below the untrained networks' (none without an untrained row)."""
    if UNTRAINED not in summary:
        return set()
    floor = summary[UNTRAINED]["concatenated"][MAP_AT_R][0]
    return {
        row
        for row, s in summary.items()
        if row not in (RAW_INPUT, UNTRAINED) and s["concatenated"][MAP_AT_R][0] <= floor
    }


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
        "config": result.budget,
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
    metric = MAP_AT_R
    c = result.budget
    fig, (bars, val, loss) = plt.subplots(1, 3, figsize=(19, 5.5), gridspec_kw={"width_ratios": [1.4, 1, 1]})
    y = np.arange(len(result.rows))
    any_ci, no_ci = False, []
    for offset, kind, color in ((-0.2, "concatenated", "tab:blue"), (0.2, "separated", "tab:orange")):
        means = np.array([100 * summary[r][kind][metric][0] for r in result.rows])
        cis = np.array([100 * summary[r][kind][metric][1] for r in result.rows])
        label = (
            f"{kind} ({c.get('num_folds') or 1}x{c['embedding_size']}-dim)"
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
        if row not in summary:
            continue
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
