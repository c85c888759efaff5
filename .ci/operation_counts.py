"""What a GPU's kernel count looks like, counted on the CPU: for each loss of `pml-rank
speed`, the aten operations of one forward + backward call of its case (dim 64, 4 per
class) under the accelerator's work policy (`pml_rank._device_policy`, forced), with the
fused Triton kernels run in Triton's interpreter (each launch counted as one operation),
and how many of them make the host wait for a GPU. Views, which launch nothing, are left
out. An operation is about one kernel on a GPU; a few launch several (nonzero, bincount,
sort), which `.ci/gpu_profile.py` counts on the GPU itself. Writes PATH.json and PATH.md.

    TRITON_INTERPRET=1 python .ci/operation_counts.py PATH [--sizes 256 1024] [LOSS ...]
"""

import argparse
import collections
import contextlib
import json
import os
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pml_rank import _device_policy, _triton
from pml_rank.harness import speed
from pml_rank.losses import fused_ranks
from pml_rank.plugins import registry

# Operations that launch no kernel: views, fresh uninitialised tensors, metadata.
LAUNCH_NOTHING = {
    "aten::" + name
    for name in (
        "view _unsafe_view expand t transpose unsqueeze squeeze slice select as_strided permute detach alias "
        "reshape _reshape_alias unbind split narrow diagonal lift_fresh empty empty_like new_empty "
        "empty_strided new_empty_strided size sym_size is_same_size"
    ).split()
}
# Operations after which the host waits for a GPU: a number read back, or an output whose
# size depends on the values; and every `tolist` (`counted_call`).
WAITING = {"aten::_local_scalar_dense", "aten::nonzero", "aten::bincount", "aten::masked_select", "aten::unique_dim"}


class Counted(TorchDispatchMode):
    """Operations dispatched inside the context that launch something, by name, and the
    waits among them; none inside `pause`, where a fused kernel's interpreter runs."""

    def __init__(self):
        super().__init__()
        self.names, self.waits, self.paused = collections.Counter(), 0, False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if not self.paused and name not in LAUNCH_NOTHING:
            self.names[name] += 1
            self.waits += name in WAITING
        return func(*args, **(kwargs or {}))

    @contextlib.contextmanager
    def pause(self, device):
        """`_triton.on_device`'s stand-in around a launch: the kernel counts once."""
        self.paused = True
        try:
            yield
        finally:
            self.paused = False
        self.names["triton kernel"] += 1


def counted_call(fn, inputs):
    """The operations of one forward and backward call of `fn` on `inputs` (`speed`'s)."""
    return counted_run(lambda: speed._run(fn, inputs))


def counted_run(run, counted=None):
    """`counted` (a fresh `Counted` by default) after ``run()``: its operations, each fused
    kernel's launch once and every `tolist` a wait."""
    counted = Counted() if counted is None else counted
    on_device, tolist = _triton.on_device, torch.Tensor.tolist

    def read_back(tensor):
        """`tolist`, a read-back that dispatches nothing on the CPU (on a GPU, a copy that waits)."""
        if not counted.paused:
            counted.names["tolist"] += 1
            counted.waits += 1
        return tolist(tensor)

    # fused_ranks launches through the name it imported, fused_counts through `_triton`'s.
    fused_ranks.on_device = _triton.on_device = counted.pause
    torch.Tensor.tolist = read_back
    try:
        with counted:
            run()
    finally:
        fused_ranks.on_device = _triton.on_device = on_device
        torch.Tensor.tolist = tolist
    return counted


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("report")
    parser.add_argument("losses", nargs="*")
    parser.add_argument("--sizes", type=int, nargs="+", default=[256, 1024])
    args = parser.parse_intermixed_args()
    if not fused_ranks.interpreted():
        print("run with TRITON_INTERPRET=1: the fused kernels otherwise take the CPU's torch path", file=sys.stderr)
        return 2
    _device_policy.sized_for = lambda device: "memory"
    torch.set_num_threads(1)
    # Every case of `pml-rank speed` on a batch (RaMBO's with their default memory too).
    device, names, rows = torch.device("cpu"), args.losses or sorted(set(registry.losses()) | set(speed.CASES)), []
    for name in ["floor", *names]:
        case = speed.case_for("SmoothAPLoss" if name == "floor" else name)
        factory = case.floor if name == "floor" else case.ours
        if factory is None or case.size_name != "batch":
            continue
        row = {"loss": name}
        for size in args.sizes:
            inputs = case.inputs(size, 64, torch.Generator().manual_seed(0), device)
            fn = speed._prepare(factory, device, 1, inputs)
            counted = counted_call(fn, inputs)
            row[str(size)] = {"operations": sum(counted.names.values()), "waits": counted.waits}
        row["top"] = counted.names.most_common(6)
        rows.append(row)
        print(json.dumps(row), flush=True)
    report = Path(args.report)
    report.parent.mkdir(parents=True, exist_ok=True)
    report.with_suffix(".json").write_text(json.dumps({"torch": torch.__version__, "rows": rows}, indent=1))
    sizes = " | ".join(f"batch {s}: operations (waits)" for s in args.sizes)
    lines = [
        f"# Operations per loss call under the accelerator's policy, counted on the CPU (torch {torch.__version__})",
        "",
        f"Command: `TRITON_INTERPRET=1 python .ci/operation_counts.py {os.fspath(report)}`",
        "",
        f"| loss | {sizes} | most frequent |",
        "| --- | " + "--- | " * len(args.sizes) + "--- |",
    ]
    for r in rows:
        counts = " | ".join(f"{r[str(s)]['operations']} ({r[str(s)]['waits']})" for s in args.sizes)
        top = ", ".join(f"{k.removeprefix('aten::')} {n}" for k, n in r["top"])
        lines.append(f"| {r['loss']} | {counts} | {top} |")
    report.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
