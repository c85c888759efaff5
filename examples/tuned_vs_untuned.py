"""Tuned beside untuned: concatenated MAP@R of two `pml-rank bench` runs (the same budget and
seeds, one with the shipped tuned parameters, one with --untuned), each as mean ± 95% CI over
the seeds, and the difference with its own 95% CI (Welch's t interval). A difference whose
interval excludes 0 is marked "yes".

    pml-rank bench --out results/tuned
    pml-rank bench --untuned --out results/untuned
    python examples/tuned_vs_untuned.py results/untuned/bench.json results/tuned/bench.json
"""

import argparse
import json
import math

import numpy as np
from scipy import stats

METRIC = "mean_average_precision_at_r"


def per_seed(payload, kind="concatenated"):
    return {row["row"]: [run[kind][METRIC] for run in row["runs"]] for row in payload["rows"]}


def mean_ci(values):
    values = np.asarray(values, dtype=float)
    if len(values) < 2:
        return float(values.mean()), float("nan")
    half = stats.t.ppf(0.975, len(values) - 1) * values.std(ddof=1) / math.sqrt(len(values))
    return float(values.mean()), float(half)


def welch(a, b):
    """Mean of b - a and the half width of its 95% interval (Welch-Satterthwaite)."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    va, vb = a.var(ddof=1) / len(a), b.var(ddof=1) / len(b)
    se = math.sqrt(va + vb)
    if se == 0:
        return float(b.mean() - a.mean()), 0.0
    dof = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    return float(b.mean() - a.mean()), float(stats.t.ppf(0.975, dof) * se)


def table(untuned, tuned, kind="concatenated"):
    a, b = per_seed(untuned, kind), per_seed(tuned, kind)
    params = {row["row"]: row.get("params", {}) for row in tuned["rows"]}
    lines = [
        f"| row | untuned MAP@R ({kind}) | tuned MAP@R | tuned − untuned | exceeds 95% CI | tuned parameters |",
        "|---|---:|---:|---:|:---:|---|",
    ]
    for row in b:
        if row not in a or row in ("raw input", "untrained"):
            continue
        (ma, ca), (mb, cb) = mean_ci(a[row]), mean_ci(b[row])
        diff, half = welch(a[row], b[row])
        significant = "yes" if abs(diff) > half else "no"
        shown = ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in params[row].items())
        lines.append(
            f"| {row} | {100 * ma:.2f} ± {100 * ca:.2f} | {100 * mb:.2f} ± {100 * cb:.2f} | "
            f"{100 * diff:+.2f} ± {100 * half:.2f} | {significant} | {shown or 'defaults'} |"
        )
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("untuned", help="bench.json of the --untuned run")
    parser.add_argument("tuned", help="bench.json of the tuned run")
    parser.add_argument("--kind", default="concatenated", choices=["concatenated", "separated"])
    args = parser.parse_args(argv)
    with open(args.untuned) as a, open(args.tuned) as b:
        print(table(json.load(a), json.load(b), args.kind))


if __name__ == "__main__":
    main()
