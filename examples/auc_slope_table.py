"""Derive the sigmoid slope table of AUCLoss (AUC-BH) and plot how close the relaxation gets.

The paper takes the slope for each threshold step Δs from a table that is not in our
notes, so we derive one. For each Δs on a grid and each slope on a log grid, we compare
the relaxed ROC area (`pml_rank.losses.auc.relaxed_roc_area`, thresholds -1 to 1) with
the exact area (the fraction of (positive, negative) pairs with HPS > HNS) over random
batches whose batch-hard similarities look like those met in training, from untrained
(classes overlap, HNS mostly above HPS) to well separated.

The error falls as the slope grows, then flattens (for coarse steps it rises again
once the sigmoids become steps between thresholds). A flat optimum is no reason to take
the steepest slope: the steeper the sigmoid, the fewer pairs get a gradient. So for
each Δs we keep the *smallest* slope whose mean absolute error is within `TOLERANCE`
of the best on the grid.

    python examples/auc_slope_table.py                # rewrites pml_rank/losses/auc_slopes.json + PNG
    python examples/auc_slope_table.py --smoke --out /tmp/slopes.json   # seconds, for tests
"""

import argparse
import inspect
import json
import math
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from pml_rank.harness import outputs
from pml_rank.losses.auc import SLOPE_TABLE, AUCLoss, exact_roc_area, relaxed_roc_area, thresholds

STEPS = (0.002, 0.005, 0.01, 0.02, 0.05, 0.1)
SLOPES = tuple(float(s) for s in np.geomspace(5, 5000, 37))
# Mean |relaxed - exact| this close to the best counts as equally close: far below
# anything that matters for an area, and above the grid's and the sampling's noise.
TOLERANCE = 0.0005
BATCH_SIZE = 128
# Regimes of the exact area, for the summary.
REGIMES = {
    "untrained (area < 0.05)": (0.0, 0.05),
    "overlapping": (0.05, 0.95),
    "separated (area > 0.95)": (0.95, 1.0001),
}


def random_batch(generator, finder=AUCLoss(step=0.01, slope=1.0)):
    """HPS and HNS (float64, one per anchor) of one random labelled batch of 128 embeddings.

    Class centres share a common direction of random strength (trained embeddings have
    positive similarities between classes); samples scatter around their centre with
    noise of random size (large: untrained, classes overlap; small: tight clusters).
    """

    def uniform(low, high):
        return low + (high - low) * torch.rand((), generator=generator).item()

    dim = (32, 64, 128, 512)[int(torch.randint(4, (), generator=generator))]
    per_class = (2, 4, 8)[int(torch.randint(3, (), generator=generator))]
    classes = BATCH_SIZE // per_class
    shared = torch.randn(dim, generator=generator) / math.sqrt(dim) * uniform(0.0, 1.5)
    centres = torch.nn.functional.normalize(torch.randn(classes, dim, generator=generator), dim=1)
    centres = torch.nn.functional.normalize(centres + shared, dim=1)
    noise = math.exp(uniform(math.log(0.2), math.log(3.0)))
    labels = torch.arange(classes).repeat_interleave(per_class)
    embeddings = centres[labels] + noise * torch.randn(len(labels), dim, generator=generator) / math.sqrt(dim)
    embeddings = embeddings.double()
    anchors, positives, negatives = finder.hardest_triplets(embeddings, labels, None, embeddings, labels)
    normalized = torch.nn.functional.normalize(embeddings, dim=1)
    hps = (normalized[anchors] * normalized[positives]).sum(1)
    hns = (normalized[anchors] * normalized[negatives]).sum(1)
    return hps, hns


def random_batches(count, seed, progress=True):
    """``(hps, hns, exact)``: (count, 128) similarity tensors and the exact areas."""
    generator = torch.Generator().manual_seed(seed)
    pairs = [random_batch(generator) for _ in tqdm(range(count), desc="random batches", disable=not progress)]
    hps = torch.stack([p for p, _ in pairs])
    hns = torch.stack([n for _, n in pairs])
    return hps, hns, exact_roc_area(hps, hns)


def relaxed_areas(hps, hns, step, slope, chunk=64):
    """Relaxed area of every batch, float32 and in chunks to bound memory."""
    grid = thresholds(step)
    return torch.cat(
        [
            relaxed_roc_area(hps[i : i + chunk].float(), hns[i : i + chunk].float(), grid, slope).double()
            for i in range(0, len(hps), chunk)
        ]
    )


def derive_table(hps, hns, exact, steps=STEPS, slopes=SLOPES, progress=True):
    """For each step: mean |error| per slope, and the chosen slope."""
    table = []
    bar = tqdm(total=len(steps) * len(slopes), desc="steps x slopes", disable=not progress)
    for step in steps:
        mean_abs_error = []
        for slope in slopes:
            mean_abs_error.append((relaxed_areas(hps, hns, step, slope) - exact).abs().mean().item())
            bar.update()
        mean_abs_error = np.array(mean_abs_error)
        chosen = int(np.argmax(mean_abs_error <= mean_abs_error.min() + TOLERANCE))
        table.append(
            {"step": step, "slope": round(slopes[chosen], 1), "chosen": chosen, "mean_abs_error": mean_abs_error}
        )
    bar.close()
    return table


def summarize(hps, hns, exact, step, slope):
    """Error statistics of one (step, slope) per regime of the exact area."""
    error = relaxed_areas(hps, hns, step, slope) - exact
    summary = {}
    for name, (low, high) in REGIMES.items():
        selected = error[(exact >= low) & (exact < high)]
        if len(selected):
            summary[name] = {
                "batches": len(selected),
                "mean_abs_error": round(selected.abs().mean().item(), 5),
                "max_abs_error": round(selected.abs().max().item(), 5),
            }
    return summary


def plot(table, slopes, hps, hns, exact, default_step, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (curves, scatter) = plt.subplots(1, 2, figsize=(12, 5))
    for row in table:
        (line,) = curves.loglog(slopes, row["mean_abs_error"], label=f"Δs = {row['step']}")
        curves.plot(row["slope"], row["mean_abs_error"][row["chosen"]], "o", color=line.get_color())
    curves.set_xlabel("sigmoid slope")
    curves.set_ylabel("mean |relaxed area - exact area|")
    curves.set_title("relaxation error; dots: the tabulated slope")
    curves.legend(fontsize=8)
    slope = next(row["slope"] for row in table if row["step"] == default_step)
    relaxed = relaxed_areas(hps, hns, default_step, slope)
    scatter.plot([0, 1], [0, 1], color="grey", linewidth=0.8)
    scatter.scatter(exact.numpy(), relaxed.numpy(), s=6)
    scatter.set_xlabel("exact area (fraction of pairs with HPS > HNS)")
    scatter.set_ylabel("relaxed area")
    scatter.set_title(f"Δs = {default_step}, slope = {slope}: {len(exact)} random batches")
    fig.tight_layout()
    outputs.save_figure(fig, path, dpi=120)
    plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, default=250, help="random batches of 128")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=SLOPE_TABLE, help="the JSON table to write")
    parser.add_argument(
        "--plot",
        type=Path,
        default=None,
        help="PNG (default: next to --out; next to this script for the shipped table)",
    )
    parser.add_argument("--smoke", action="store_true", help="a few batches and steps, to check the script runs")
    args = parser.parse_args(argv)
    default_step = inspect.signature(AUCLoss).parameters["step"].default
    steps, slopes, batches = STEPS, SLOPES, args.batches
    if args.smoke:
        steps, slopes, batches = (default_step, 0.1), SLOPES[::4], 8
    plot_path = (
        args.plot or (Path(__file__).parent if args.out == SLOPE_TABLE else args.out.parent) / "auc_slope_table.png"
    )

    hps, hns, exact = random_batches(batches, args.seed)
    table = derive_table(hps, hns, exact, steps, slopes)
    # Judge the chosen slopes on fresh batches, not on those they were chosen with.
    fresh = random_batches(batches, args.seed + 1)
    result = {
        "description": "AUCLoss sigmoid slope per threshold step; written by examples/auc_slope_table.py",
        "method": f"smallest slope whose mean |relaxed - exact ROC area| over {batches} random batches of "
        f"{BATCH_SIZE} is within {TOLERANCE} of the best of {len(slopes)} log-spaced slopes "
        f"{slopes[0]:g}..{slopes[-1]:g}; thresholds -1..1; seed {args.seed}",
        "steps": [row["step"] for row in table],
        "slopes": [row["slope"] for row in table],
        "error_on_fresh_batches": {str(row["step"]): summarize(*fresh, row["step"], row["slope"]) for row in table},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    outputs.write_text(args.out, json.dumps(result, indent=1) + "\n")
    if default_step in steps:
        plot_path.parent.mkdir(parents=True, exist_ok=True)
        plot(table, slopes, *fresh, default_step, plot_path)
        print(f"wrote {args.out} and {plot_path}")
    for row in table:
        fresh_error = result["error_on_fresh_batches"][str(row["step"])]
        print(f"step {row['step']:<6} slope {row['slope']:<8} fresh batches: {fresh_error}")
    return result


if __name__ == "__main__":
    main()
