"""A script's output: our numbers beside the paper's (`format_result`), and the JSON and
PNG it writes (`write_result`), which record the budget the runner trained each run with."""

import collections
import json
from pathlib import Path

from .. import outputs
from ..backbones import BACKBONES
from ..budget import REALITY_CHECK_PROTOCOL
from ..text_table import format_text_table
from .running import row_of, selected_runs


def _cell(value):
    if value is None:
        return "—"
    if isinstance(value, tuple):
        mean, ci = value
        return f"{mean:.2f} ± {ci:.2f}" if ci == ci else f"{mean:.2f}"  # nan CI with one run
    return f"{value:.2f}"


def _paper_cell_text(value):
    if value is None:
        return "—"
    if isinstance(value, tuple):
        return f"{value[0]} ± {value[1]}"
    return str(value)


def _kinds(variant):
    """The embeddings measured: the Reality Check's concatenated and separated ones, or the
    standard protocol's one model (None)."""
    return ("concatenated", "separated") if variant.setup.protocol == REALITY_CHECK_PROTOCOL else (None,)


def _table_rows(script, variant, result, args):
    table, kinds = variant.table, _kinds(variant)
    ours_by_paper_row = {
        r.paper_row: r.label for r in selected_runs(script, variant, args) if r.paper_row and r.label in result
    }

    def ours_for(label, index, kind):
        if label is None:
            return None
        values = result[label][kind] if kind else result[label]
        return values.get(table.metrics[index])

    rows = []
    for paper_row, numbers in table.rows.items():
        label = ours_by_paper_row.get(paper_row)
        cells = [paper_row + (f"  [ours: {label}]" if label else "")]
        for k, kind in enumerate(kinds):
            paper_numbers = numbers[k * len(table.metrics) : (k + 1) * len(table.metrics)]
            for i, paper_value in enumerate(paper_numbers):
                cells += [_cell(ours_for(label, i, kind)), _paper_cell_text(paper_value)]
        rows.append(cells)
    for label in result:
        if label in ours_by_paper_row.values():
            continue
        cells = [f"{label}  [ours only]"]
        for kind in kinds:
            for i in range(len(table.metrics)):
                cells += [_cell(ours_for(label, i, kind)), "—"]
        rows.append(cells)
    return rows


def _describe(budget):
    """One line of what a budget trains."""
    per_class = budget["samples_per_class"] or "each row's own"
    images = f"{budget['image_size']}-px crops, " if budget["image_size"] else ""
    return (
        f"{budget['protocol']} protocol, {budget['trunk']} + {budget['embedding_size']}-d embedding, {images}"
        f"batch {budget['batch_size']} (samples per class: {per_class}), {budget['optimizer']} lr {budget['lr']:g}, "
        f"{budget['epochs']} epochs x {budget['iterations_per_epoch']} iterations, {budget['seeds']} run(s)"
    )


def _most_common(budgets):
    """The budget most runs train with."""
    keys = {label: json.dumps(budget, sort_keys=True, default=str) for label, budget in budgets.items()}
    most = collections.Counter(keys.values()).most_common(1)[0][0]
    return next(budgets[label] for label, key in keys.items() if key == most)


def format_result(script, variant, result, args, budgets):
    """Our numbers beside the paper's: every paper row (ours filled in where we ran it)
    and every row of ours without a paper counterpart, under what trained them (`budgets`,
    ``{run label: budget}``)."""
    header = ["row"]
    for kind in _kinds(variant):
        for metric in variant.table.metrics:
            prefix = f"{kind[:6]}. " if kind else ""
            header += [f"{prefix}{metric} ours", f"{prefix}{metric} paper"]
    lines = [
        f"{script.title}",
        f"{variant.table.source}; in %. Paper numbers are the authors' (cited), "
        "'ours' is this run" + (" (--smoke: meaningless numbers)" if args.smoke else "") + ".",
    ]
    common = _most_common(budgets)
    lines.append(f"Ours: {_describe(common)}")
    for label, budget in budgets.items():
        changed = [f"{key} {value}" for key, value in budget.items() if value != common[key]]
        if changed:
            lines.append(f"Ours, {label}: {', '.join(changed)}")
    trunk = BACKBONES.get(common["trunk"])
    notes = [note for note in (trunk.note if trunk else "", variant.setup.notes) if note]
    lines += [f"Note: {n}" for n in notes]
    lines.append(format_text_table(header, _table_rows(script, variant, result, args)))
    return "\n".join(lines)


def write_result(script, variant, result, args, budgets):
    """Writes ``reproduce-<script>-<dataset>[-smoke].json`` (ours, the paper's rows, and
    what each of ours trained with: the runner's row, parameters and budget) and a PNG
    beside it; returns the JSON path."""
    path = Path(args.out) / f"reproduce-{script.name}-{variant.dataset}{'-smoke' if args.smoke else ''}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    runs = {run.label: run for run in selected_runs(script, variant, args)}
    payload = {
        "script": script.name,
        "dataset": variant.dataset,
        "paper": variant.table.source,
        "metrics": list(variant.table.metrics),
        "paper_rows": variant.table.rows,
        "ours": result,
        "trained_with": {
            label: {"row": row_of(runs[label]), "params": runs[label].params, "budget": budget}
            for label, budget in budgets.items()
        },
        "smoke": args.smoke,
        "seed": args.seed,
    }
    outputs.write_text(path, json.dumps(payload, indent=2, default=str))
    plot_result(script, variant, result, args, path.with_suffix(".png"))
    return path


def plot_result(script, variant, result, args, path):
    """Bar chart, one panel per metric: each of our rows beside the paper's number for
    the row it reproduces (Reality Check: concatenated embeddings, with the 95% CI)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = variant.table
    reality_check = variant.setup.protocol == REALITY_CHECK_PROTOCOL
    paper_row_of = {r.label: r.paper_row for r in selected_runs(script, variant, args)}
    labels = list(result)
    fig, axes = plt.subplots(
        1, len(table.metrics), figsize=(3 + 2.2 * len(table.metrics), 0.5 * len(labels) + 2), squeeze=False, sharey=True
    )
    for i, (metric, ax) in enumerate(zip(table.metrics, axes[0])):
        ours = [result[label]["concatenated" if reality_check else metric] for label in labels]
        ours = [v[metric] if reality_check else v for v in ours]
        paper = [table.rows.get(paper_row_of.get(label), ())[i : i + 1] for label in labels]
        paper = [p[0] if p and p[0] is not None and not isinstance(p[0], str) else None for p in paper]
        positions = range(len(labels))

        def bars(values, offset, name, color, ax=ax, positions=positions):
            means = [(v[0] if isinstance(v, tuple) else v) if v is not None else 0 for v in values]
            errors = [v[1] if isinstance(v, tuple) and v[1] == v[1] else 0 for v in values]
            ax.barh([p + offset for p in positions], means, height=0.38, xerr=errors, label=name, color=color)

        bars(ours, -0.2, "ours", "tab:blue")
        bars(paper, 0.2, "paper", "tab:gray")
        ax.set_title(metric + (" (concatenated)" if reality_check else ""))
        ax.set_xlim(0, 100)
        ax.set_yticks(list(positions), labels, fontsize=8)
    axes[0][0].invert_yaxis()
    axes[0][-1].legend(loc="lower right", fontsize=8)
    fig.suptitle(f"{table.source}" + ("  [--smoke: meaningless numbers]" if args.smoke else ""), fontsize=9)
    fig.tight_layout()
    try:
        outputs.save_figure(fig, path, dpi=110)
    finally:
        plt.close(fig)
