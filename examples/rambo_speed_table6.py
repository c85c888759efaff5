"""RaMBO, Table 6 on this machine: forward+backward time of the Average Precision loss on
one sequence of 100k, 1M and 10M scores (100M with --with-100m), ours and the
straightforward two-argsort reference side by side with the paper's figures.

    python examples/rambo_speed_table6.py                # 100k, 1M, 10M
    python examples/rambo_speed_table6.py --with-100m    # also 100M (needs ~10 GB)
    python examples/rambo_speed_table6.py --smoke        # tiny sizes, seconds

The paper timed "plain PyTorch" on one Xeon Gold core at 2.2 GHz and on a V100; by
default this script uses one thread too (--threads to change). It times with
`pml-rank speed`'s harness (`pml_rank.harness.speed`, case RaMBOAPLoss: 10% positives,
λ = 0.5, margin 0.15) and writes a JSON file and a PNG plot to --out.
"""

import argparse
import dataclasses
import json

import torch

from pml_rank.harness import outputs, speed
from pml_rank.harness.text_table import format_text_table

# Table 6 of the paper, seconds.
PAPER_CPU = {100_000: 0.033, 1_000_000: 0.331, 10_000_000: 3.86, 100_000_000: 36.4}
PAPER_GPU = {100_000: 0.0013, 1_000_000: 0.007, 10_000_000: 0.061, 100_000_000: 0.62}
CASE = "RaMBOAPLoss (Table 6)"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--with-100m", action="store_true", help="also time 100M scores (slow, ~10 GB)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one repeat: checks the script runs")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the paper: one core)")
    parser.add_argument(
        "--reference-max",
        type=int,
        default=10_000_000,
        help="skip the reference above this length (it needs ~6x our memory)",
    )
    parser.add_argument("--out", default="pml-rank-results")
    return parser.parse_args(argv)


def seconds(value):
    if value is None:
        return "-"
    return f"{value * 1000:.1f} ms" if value < 1 else f"{value:.2f} s"


def table(result):
    header = ["length", "ours", "reference", "ours / reference", "paper CPU", "paper GPU", "ours / paper CPU"]
    rows = []
    for row in result["rows"]:
        ours, ref = row["seconds"]["ours"], row["seconds"].get("reference")
        paper = PAPER_CPU.get(row["size"])
        rows.append(
            [
                f"{row['size']:,}",
                seconds(ours),
                seconds(ref),
                f"{ours / ref:.3f}" if ref else "-",
                seconds(paper),
                seconds(PAPER_GPU.get(row["size"])),
                f"{ours / paper:.2f}" if paper else "-",
            ]
        )
    return format_text_table(header, rows, align="r" * len(header))


def plot(result, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [row["size"] for row in result["rows"]]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(sizes, [row["seconds"]["ours"] for row in result["rows"]], "o-", label="ours (this CPU)")
    with_ref = [row for row in result["rows"] if "reference" in row["seconds"]]
    ax.plot(
        [r["size"] for r in with_ref],
        [r["seconds"]["reference"] for r in with_ref],
        "s-",
        label="two-argsort reference (this CPU)",
    )
    for paper, label in ((PAPER_CPU, "paper, 1 CPU core"), (PAPER_GPU, "paper, V100")):
        ax.plot(list(paper), list(paper.values()), "--", marker=".", label=label)
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="sequence length",
        ylabel="forward+backward seconds",
        title=f"RaMBO AP loss (Table 6), {result['threads']} thread(s)",
    )
    ax.legend()
    fig.tight_layout()
    outputs.save_figure(fig, path, dpi=120)
    plt.close(fig)


def main(argv=None):
    args = parse_args(argv)
    out = outputs.prepare_output_dir(args.out)  # before any work
    torch.set_num_threads(args.threads)
    if args.smoke:
        sizes, repeats = (1_000, 10_000), 1
    else:
        sizes = (100_000, 1_000_000, 10_000_000) + ((100_000_000,) if args.with_100m else ())
        repeats = args.repeats
    speed.CASES[CASE] = dataclasses.replace(speed.CASES["RaMBOAPLoss"], reference_max_size=args.reference_max)
    result = speed.measure(CASE, sizes=sizes, repeats=repeats)
    print(
        f"RaMBO Table 6: AP loss forward+backward, median of {repeats}, {result['threads']} thread(s), "
        f"torch {result['torch']}"
    )
    print(table(result))
    result["paper_cpu_seconds"], result["paper_gpu_seconds"] = PAPER_CPU, PAPER_GPU
    outputs.write_text(out / "rambo_table6.json", json.dumps(result, indent=2))
    plot(result, out / "rambo_table6.png")
    print(f"written: {out / 'rambo_table6.json'}, {out / 'rambo_table6.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
