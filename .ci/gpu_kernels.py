"""Times the relaxed-rank losses on a CUDA GPU under other launch settings of the fused sums
kernel (`losses.fused_ranks`: pairs per program, references per step, warps), to choose them
by measurement: a forward + backward call of `pml-rank speed`'s case (dim 512, 4 per class),
CUDA events, the median of ROUNDS calls after two warm-ups, and the largest relative
difference of the loss from the shipped settings' (the settings change only the order of a
float32 sum). Writes PATH.json and PATH.md.

    python .ci/gpu_kernels.py PATH [--sizes 2048 8192] [--losses SmoothAPLoss ROADMAPLoss]
"""

import argparse
import itertools
import json
import statistics
import sys
from pathlib import Path

import torch

from pml_rank.harness import speed
from pml_rank.losses import fused_ranks

ROUNDS = 10
SETTINGS = {"PAIRS_PER_BLOCK": (16, 32), "REFERENCES_PER_STEP": (128, 256), "SUMS_WARPS": (4, 8, 16)}


def call(fn, inputs):
    """One forward + backward call of `pml-rank speed`'s case; the loss, detached."""
    for tensor in inputs:
        tensor.grad = None
    loss = fn(*inputs)
    loss.backward()
    return loss.detach()


def timed_call(fn, inputs):
    """(median milliseconds of a forward + backward call, the loss's value)."""
    for _ in range(2):
        call(fn, inputs)
    times = []
    for _ in range(ROUNDS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        value = call(fn, inputs)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times), float(value)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("report")
    parser.add_argument("--sizes", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--losses", nargs="+", default=["SmoothAPLoss", "ROADMAPLoss"])
    args = parser.parse_args()
    device = torch.device("cuda")
    shipped = {name: getattr(fused_ranks, name) for name in SETTINGS}
    cases = {}
    for loss, size in itertools.product(args.losses, args.sizes):
        case = speed.case_for(loss)
        inputs = case.inputs(size, 512, torch.Generator().manual_seed(0), device)
        cases[loss, size] = (speed._prepare(case.ours, device, 1, inputs), inputs)
    rows, reference = [], {}
    # The shipped settings first: every other row's loss is compared with theirs.
    combinations = sorted(itertools.product(*SETTINGS.values()), key=lambda c: c != tuple(shipped.values()))
    for values in combinations:
        settings = dict(zip(SETTINGS, values))
        for name, value in settings.items():
            setattr(fused_ranks, name, value)
        row = {"settings": settings}
        for (loss, size), (fn, inputs) in cases.items():
            ms, value = timed_call(fn, inputs)
            reference.setdefault((loss, size), value)
            difference = abs(value - reference[loss, size]) / max(abs(reference[loss, size]), 1e-30)
            row[f"{loss} {size}"] = {"ms": round(ms, 3), "relative difference": difference}
        rows.append(row)
        print(json.dumps(row), flush=True)
    for name, value in shipped.items():
        setattr(fused_ranks, name, value)
    report = Path(args.report)
    report.parent.mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.get_device_name(0)
    report.with_suffix(".json").write_text(json.dumps({"gpu": gpu, "torch": torch.__version__, "rows": rows}, indent=1))
    columns = [f"{loss} {size}" for loss, size in cases]
    lines = [
        f"# Relaxed-rank loss calls by the sums kernel's launch settings, {gpu} (torch {torch.__version__})",
        "",
        f"Milliseconds a forward + backward call, median of {ROUNDS}; the first row is the shipped settings.",
        "",
        "| " + " | ".join([*SETTINGS, *columns]) + " |",
        "| " + " | ".join(["---:"] * (len(SETTINGS) + len(columns))) + " |",
    ]
    for row in rows:
        cells = [str(v) for v in row["settings"].values()] + [str(row[c]["ms"]) for c in columns]
        lines.append("| " + " | ".join(cells) + " |")
    worst = max(row[c]["relative difference"] for row in rows for c in columns)
    lines += ["", f"Largest relative difference of a loss from the shipped settings': {worst:.1e}."]
    report.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
