"""Two `pml-rank bench` runs side by side: MAP@R of each row as mean ± 95% CI over the seeds,
and the difference B − A with its own 95% CI (Welch's t interval). A difference whose
interval excludes 0 is marked "yes". The second run's parameters are listed.

Tuned against untuned (the same budget and seeds):

    pml-rank bench --out results/tuned
    pml-rank bench --untuned --out results/untuned
    python examples/compare_bench.py results/untuned/bench.json results/tuned/bench.json

The default budget against twice as many epochs (is it converged?):

    pml-rank bench --epochs 20 --out results/tuned-20-epochs
    python examples/compare_bench.py results/tuned/bench.json results/tuned-20-epochs/bench.json \
        --labels "10 epochs" "20 epochs"
"""

import argparse
import json
import math

import numpy as np
from scipy import stats

from pml_rank.harness.evaluation import mean_and_ci

METRIC = "mean_average_precision_at_r"


def per_seed(payload, kind="concatenated"):
    return {row["row"]: [run[kind][METRIC] for run in row["runs"]] for row in payload["rows"]}


def welch(a, b):
    """Mean of b - a and the half width of its 95% interval (Welch-Satterthwaite)."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if min(len(a), len(b)) < 2:  # one run gives no interval
        return float(b.mean() - a.mean()), float("nan")
    va, vb = a.var(ddof=1) / len(a), b.var(ddof=1) / len(b)
    se = math.sqrt(va + vb)
    if se == 0:
        return float(b.mean() - a.mean()), 0.0
    dof = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    return float(b.mean() - a.mean()), float(stats.t.ppf(0.975, dof) * se)


def table(first, second, kind="concatenated", labels=("untuned", "tuned")):
    a, b = per_seed(first, kind), per_seed(second, kind)
    params = {row["row"]: row.get("params", {}) for row in second["rows"]}
    la, lb = labels
    lines = [
        f"| row | {la} MAP@R ({kind}) | {lb} MAP@R | {lb} − {la} | exceeds 95% CI | {lb} parameters |",
        "|---|---:|---:|---:|:---:|---|",
    ]
    for row in b:
        if row not in a or row in ("raw input", "untrained"):
            continue
        (ma, ca), (mb, cb) = mean_and_ci(a[row]), mean_and_ci(b[row])
        diff, half = welch(a[row], b[row])
        significant = "–" if math.isnan(half) else "yes" if abs(diff) > half else "no"
        shown = ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in params[row].items())
        lines.append(
            f"| {row} | {100 * ma:.2f} ± {100 * ca:.2f} | {100 * mb:.2f} ± {100 * cb:.2f} | "
            f"{100 * diff:+.2f} ± {100 * half:.2f} | {significant} | {shown or 'defaults'} |"
        )
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("first", help="bench.json of run A (e.g. the --untuned run)")
    parser.add_argument("second", help="bench.json of run B (e.g. the tuned run)")
    parser.add_argument("--kind", default="concatenated", choices=["concatenated", "separated"])
    parser.add_argument("--labels", nargs=2, default=("untuned", "tuned"), metavar=("A", "B"))
    args = parser.parse_args(argv)
    with open(args.first) as a, open(args.second) as b:
        print(table(json.load(a), json.load(b), args.kind, tuple(args.labels)))


if __name__ == "__main__":
    main()
