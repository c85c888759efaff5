"""Where a loss call's time goes on a device: for each loss and batch size, the forward +
backward call of `pml-rank speed`'s case (its inputs, float32 or --amp) under the torch
profiler: device kernels launched, host waits for the device, the call's synchronised wall
time (median of --repeats) against the similarity floor's, and the operators that take the
most device time; then the host's side (cProfile): the time a call takes when calls are
queued back to back without a synchronisation, and the functions that take the most of the
host's own time. Where a call is bound by its launches (batch 2048 on an H200), the host's
side is the call's time. Writes DIR/profile.{json,md}.

    python .ci/gpu_profile.py DIR [--device cuda] [--sizes 2048 8192] [--amp] [LOSS ...]
"""

import argparse
import cProfile
import json
import pstats
import re
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from pml_rank.harness import speed
from pml_rank.plugins import registry

# Host-side calls that make the host wait for the device (a read-back: .item(), nonzero's
# size, .tolist(); the device-to-device cudaMemcpyAsync of a copy does not wait).
WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def wall_seconds(fn, inputs, device, repeats):
    """Median synchronised seconds of `repeats` calls (`speed`'s timing), after one more."""
    return statistics.median([speed._timed(fn, inputs, device) for _ in range(repeats + 1)][1:])


def profiled(fn, inputs, device):
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        speed._run(fn, inputs)
        torch.cuda.synchronize(device) if device.type == "cuda" else None
    events = prof.events()
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    launches = sum(1 for e in events if e.name in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC"))
    waits = sum(1 for e in events if e.name in WAITS)
    operators = [e for e in events if e.name.startswith("aten::") and e.cpu_parent is None]
    totals = {}
    for e in prof.key_averages():
        if e.key.startswith(("aten::", "_")):
            totals[e.key] = (getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0), e.count)
    top = sorted(totals.items(), key=lambda kv: -kv[1][0])[:8]
    return {
        "kernels": len(kernels),
        "launches": launches,
        "host_waits": waits,
        "top_level_operators": len(operators),
        "kernel_ms": sum(e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total for e in kernels)
        / 1e3,
        "top": [[key, round(us / 1e3, 3), count] for key, (us, count) in top],
    }


def _builtin(name):
    """cProfile's name of a C function, shorter: "TensorBase.sum", "torch.matmul"."""
    method = re.fullmatch(r"<method '(\w+)' of '[\w.]*?(\w+)' objects>", name)
    if method:
        return f"{method[2]}.{method[1]}"
    return re.sub(r"^<built-in method (.*)>$", r"\1", name)


def host_side(fn, inputs, device, calls=20, functions=5):
    """The host's ms a call, `calls` calls queued back to back (the waits inside a call
    included), and the `functions` functions with the most own time a call under cProfile
    (inflated by the profiler alike for all): ``[[file:function, ms, calls a call], ...]``."""
    synchronize = torch.cuda.synchronize if device.type == "cuda" else lambda device: None
    synchronize(device)
    start = time.perf_counter()
    for _ in range(calls):
        speed._run(fn, inputs)
    host_ms = (time.perf_counter() - start) / calls * 1e3
    synchronize(device)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        speed._run(fn, inputs)
    synchronize(device)
    profiler.disable()
    own = {
        (Path(file).name if file != "~" else "", name): (stat[2], stat[1])
        for (file, _, name), stat in pstats.Stats(profiler).stats.items()
    }
    top = sorted(own.items(), key=lambda item: -item[1][0])[:functions]
    return {
        "host_ms": host_ms,
        "top_host": [
            [f"{file}:{name}" if file else _builtin(name), round(seconds / calls * 1e3, 3), round(count / calls, 1)]
            for (file, name), (seconds, count) in top
        ],
    }


def markdown(rows, device_name, amp):
    """The report's table: a row per loss and batch size, every listed host function (with its
    calls a call, where the rows have them)."""
    floors = {r["size"]: r["seconds"] for r in rows if r["loss"] == "floor" and "seconds" in r}
    lines = [
        f"# Loss calls profiled on {device_name} (torch {torch.__version__}{', autocast' if amp else ''})",
        "",
        "| loss | batch | ms | / floor | kernels | host waits | kernel ms | top device operators (ms, calls) |"
        " host ms | top host functions (own ms a call, profiled) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['loss']} | {r['size']} | {r['error']} | | | | | | | |")
            continue
        top = "; ".join(f"{k} {ms} ({n})" for k, ms, n in r["top"][:5])
        host = "; ".join(f"{name} {ms}" + (f" ({calls[0]})" if calls else "") for name, ms, *calls in r["top_host"])
        lines.append(
            f"| {r['loss']} | {r['size']} | {r['seconds'] * 1e3:.2f} | {r['seconds'] / floors[r['size']]:.2f} |"
            f" {r['kernels']} | {r['host_waits']} | {r['kernel_ms']:.2f} | {top} | {r['host_ms']:.2f} | {host} |"
        )
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out")
    parser.add_argument("losses", nargs="*")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--sizes", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--amp", action="store_true")
    parser.add_argument("--host-functions", type=int, default=5, help="host functions listed per row (default 5)")
    args = parser.parse_intermixed_args()
    device = torch.device(args.device)
    names = args.losses or sorted(set(registry.losses()) | set(speed.CASES))  # `pml-rank speed`'s cases
    rows = []
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for size in args.sizes:
        for name in ["floor", *names]:
            case = speed.case_for("SmoothAPLoss" if name == "floor" else name)
            factory = case.floor if name == "floor" else case.ours
            if factory is None or case.size_name != "batch":
                continue
            try:
                inputs = case.inputs(size, speed.DEFAULT_DIM, torch.Generator().manual_seed(0), device)
                fn = speed._prepare(factory, device, case.prime, inputs, args.amp)
                speed._run(fn, inputs)
                row = {"loss": name, "size": size, "seconds": wall_seconds(fn, inputs, device, args.repeats)}
                row.update(profiled(fn, inputs, device))
                row.update(host_side(fn, inputs, device, functions=args.host_functions))
            except Exception as error:  # one loss's failure must not hide the others' figures
                row = {"loss": name, "size": size, "error": f"{type(error).__name__}: {error}"[:300]}
            rows.append(row)
            print(json.dumps(row), flush=True)
            (out / "profile.json").write_text(json.dumps({"device": str(device), "amp": args.amp, "rows": rows}))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    table = markdown(rows, name, args.amp)
    (out / "profile.md").write_text(table)
    print(table, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
