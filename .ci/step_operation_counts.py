"""What a glyph bench training step launches on a GPU, counted on the CPU: for each bench row,
the aten operations of a training iteration (PML's `forward_and_backward`: the batch, the
trunk's forward, the loss, the backward pass and the optimizers' steps) under the
accelerator's work policy, with the fused Triton kernels run in Triton's interpreter and
counted once a launch (as `.ci/operation_counts.py` counts a loss call), and the waits for
the GPU among them, with Adam's step taken each way: foreach (torch's default on a GPU) and
fused (the bench's on a GPU). The optimizers' reads of their CPU-side step counters wait for
nothing on a GPU and are left out of the waits. Writes PATH.json and PATH.md.

    TRITON_INTERPRET=1 python .ci/step_operation_counts.py PATH [ROW ...]
"""

import argparse
import collections
import contextlib
import importlib.util
import json
import os
import sys
import tempfile
import traceback
from pathlib import Path

import torch

from pml_rank import _device_policy, cli
from pml_rank.harness.evaluation import training
from pml_rank.losses import fused_ranks

spec = importlib.util.spec_from_file_location("operation_counts", Path(__file__).with_name("operation_counts.py"))
operation_counts = importlib.util.module_from_spec(spec)
spec.loader.exec_module(operation_counts)

WAYS = ("foreach", "fused")


class StepCounted(operation_counts.Counted):
    """`Counted`, less the waits of an optimizer reading its CPU-side step counter."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        waits = self.waits
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if self.waits > waits and any("torch/optim/" in frame.filename for frame in traceback.extract_stack()):
            self.waits = waits
        return out


@contextlib.contextmanager
def counting_steps(way, totals):
    """Inside: every `MetricLossOnly` iteration counted into ``totals[row]`` (iterations,
    operations, waits), Adam taking its `way` step."""
    adam_init, step = torch.optim.Adam.__init__, training.MetricLossOnly.forward_and_backward

    def init(self, *args, **kwargs):
        adam_init(self, *args, **dict(kwargs, foreach=way == "foreach", fused=way == "fused"))

    def counted_step(trainer):
        counted = operation_counts.counted_run(lambda: step(trainer), StepCounted())
        loss = type(trainer.loss_funcs["metric_loss"])
        row = ("pml:" if loss.__module__.startswith("pytorch_metric_learning") else "") + loss.__name__
        total = totals[row]
        total[0] += 1
        total[1] += sum(counted.names.values())
        total[2] += counted.waits

    torch.optim.Adam.__init__, training.MetricLossOnly.forward_and_backward = init, counted_step
    try:
        yield
    finally:
        torch.optim.Adam.__init__, training.MetricLossOnly.forward_and_backward = adam_init, step


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("report")
    parser.add_argument("rows", nargs="*", help="bench rows (default: the default bench's)")
    args = parser.parse_args()
    if not fused_ranks.interpreted():
        print("run with TRITON_INTERPRET=1: the fused kernels otherwise take the CPU's torch path", file=sys.stderr)
        return 2
    _device_policy.sized_for = lambda device: "memory"
    results = {}
    for way in WAYS:
        totals = collections.defaultdict(lambda: [0, 0, 0])
        with tempfile.TemporaryDirectory() as out, counting_steps(way, totals), contextlib.redirect_stdout(sys.stderr):
            argv = ["bench", *args.rows, "--seeds", "1", "--epochs", "1", "--iterations", "5", "--workers", "1"]
            cli.main([*argv, "--out", out])
        for row, (iterations, operations, waits) in totals.items():
            results.setdefault(row, {})[way] = {
                "operations": round(operations / iterations, 1),
                "waits": round(waits / iterations, 1),
            }
    report = Path(args.report)
    report.parent.mkdir(parents=True, exist_ok=True)
    report.with_suffix(".json").write_text(json.dumps({"torch": torch.__version__, "rows": results}, indent=1))
    lines = [
        "# Operations per glyph bench training step under the accelerator's policy, counted on the CPU "
        f"(torch {torch.__version__})",
        "",
        f"Command: `TRITON_INTERPRET=1 python .ci/step_operation_counts.py {os.fspath(report)}`",
        "",
        "| loss | foreach Adam: operations (waits) | fused Adam: operations (waits) |",
        "| --- | ---: | ---: |",
    ]
    for row, ways in sorted(results.items()):
        cells = [f"{ways[w]['operations']} ({ways[w]['waits']})" if w in ways else "" for w in WAYS]
        lines.append(f"| {row} | " + " | ".join(cells) + " |")
    report.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
