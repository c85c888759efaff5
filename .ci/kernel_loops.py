"""What a GPU would execute in each loop of pml-rank's Triton kernels, read on the CPU: every
distinct kernel launch of one forward + backward call of each loss (`pml-rank speed`'s case,
batch 64, dim 32, the accelerator's work policy, recorded in Triton's interpreter) compiled
for an H100/H200 (sm_90) by Triton's own compiler, with the PTX instructions of each loop's
body (a loop's step over references: the instructions a thread issues for its entries of the
tile), its divisions and exponentials, its cross-thread shuffles and barriers, and ptxas's
registers and spills. A kernel's time on a GPU is not read here; what its loops issue per
step is, and falls or rises with it. Writes PATH.json and PATH.md.

    python .ci/kernel_loops.py PATH [LOSS ...]

The launches are recorded by this script itself in a child process under TRITON_INTERPRET=1
(Triton's compiler takes the kernels as this process defines them, without it).
"""

import argparse
import collections
import contextlib
import io
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import triton_launches  # noqa: E402 (tests/: the interpreted run's launch recorder)

from pml_rank import _device_policy, _triton  # noqa: E402
from pml_rank.harness import speed  # noqa: E402
from pml_rank.plugins import registry  # noqa: E402

CAPABILITY = 90
INSTRUCTION = re.compile(r"^\s+(?:@!?%p\d+ )?([a-z][\w.]*)", re.M)


def loops(ptx):
    """Each loop of `ptx` (a backward branch to a label): its label's line and its body's
    instructions by name."""
    lines = ptx.splitlines()
    labels = {m[1]: i for i, line in enumerate(lines) if (m := re.match(r"^(\$L__\w+):", line.strip()))}
    found = []
    for i, line in enumerate(lines):
        branch = re.search(r"bra(?:\.uni)?\s+(\$L__\w+);", line)
        if branch and labels.get(branch[1], i) < i:
            body = "\n".join(lines[labels[branch[1]] : i + 1])
            found.append(collections.Counter(INSTRUCTION.findall(body)))
    return found


def compiled(record):
    """(PTX, ptxas's log) of one recorded launch compiled for sm_`CAPABILITY`."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = getattr(importlib.import_module(record["module"]), record["kernel"])
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        binary = triton.compile(
            ASTSource(kernel, record["signature"], record["constants"]),
            target=GPUTarget("cuda", CAPABILITY, 32),
            options={"num_warps": record["num_warps"]},
        )
    return binary.asm["ptx"], log.getvalue()


def recorded_launches(name):
    """The distinct launches of one forward + backward call of `name`'s speed case."""
    case = speed.case_for(name)
    inputs = case.inputs(64, 32, torch.Generator().manual_seed(0), torch.device("cpu"))
    fn = speed._prepare(case.ours, torch.device("cpu"), 0, inputs)
    from triton.runtime import interpreter

    launches, run = {}, interpreter.InterpretedFunction.run
    interpreter.InterpretedFunction.run = triton_launches.recording(launches)
    try:
        speed._run(fn, inputs)
    finally:
        interpreter.InterpretedFunction.run = run
    return list(launches.values())


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("report")
    parser.add_argument("losses", nargs="*")
    parser.add_argument("--record", help=argparse.SUPPRESS)  # the child's: launches to this file
    args = parser.parse_args()
    names = args.losses or sorted(n for n in registry.losses() if speed.case_for(n).size_name == "batch")
    if args.record:
        _device_policy.sized_for = lambda device: "memory"
        records = {name: recorded_launches(name) for name in names}
        Path(args.record).write_text(json.dumps(records))
        return 0
    if _triton.interpreted():
        print("run without TRITON_INTERPRET: the kernels are compiled here", file=sys.stderr)
        return 2
    recorded = Path(tempfile.mkdtemp()) / "launches.json"
    command = [sys.executable, __file__, args.report, *names, "--record", str(recorded)]
    subprocess.run(command, env={**os.environ, "TRITON_INTERPRET": "1"}, check=True)
    records = json.loads(recorded.read_text())
    import triton

    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp()  # ptxas logs only what it compiles
    triton.knobs.nvidia.dump_ptxas_log = True
    rows, seen = [], set()
    for name in names:
        for record in records[name]:
            key = json.dumps([record["kernel"], record["signature"], record["constants"], record["num_warps"]])
            if key in seen:
                continue
            seen.add(key)
            ptx, log = compiled(record)
            row = {
                "loss": name,
                "kernel": record["kernel"],
                "constants": record["constants"],
                "warps": record["num_warps"],
                "registers": int(re.findall(r"Used (\d+) registers", log)[-1]),
                "spilled_bytes": sum(map(int, re.findall(r"(\d+) bytes spill stores", log))),
                "loops": [
                    {
                        "instructions": sum(body.values()),
                        "divisions": sum(n for op, n in body.items() if op.startswith(("div", "rcp"))),
                        "exponentials": sum(n for op, n in body.items() if op.startswith("ex2")),
                        "shuffles": sum(n for op, n in body.items() if op.startswith("shfl")),
                        "barriers": sum(n for op, n in body.items() if op.startswith("bar")),
                    }
                    for body in loops(ptx)
                ],
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    report = Path(args.report)
    report.parent.mkdir(parents=True, exist_ok=True)
    report.with_suffix(".json").write_text(
        json.dumps({"torch": torch.__version__, "triton": triton.__version__, "rows": rows}, indent=1)
    )
    lines = [
        f"# PTX of the Triton kernels' loops, compiled for sm_{CAPABILITY} on the CPU (Triton {triton.__version__})",
        "",
        f"Command: `python .ci/kernel_loops.py {os.fspath(report)}`. A loss's row lists the"
        " launches that no loss above it made; per loop: instructions (divisions, exponentials, shuffles, barriers).",
        "",
        "| loss | kernel | constants | warps | registers | spilled bytes | loops |",
        "| --- | --- | --- | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        constants = ", ".join(f"{k}={v}" for k, v in r["constants"].items())
        body = "; ".join(
            f"{b['instructions']} ({b['divisions']}, {b['exponentials']}, {b['shuffles']}, {b['barriers']})"
            for b in r["loops"]
        )
        lines.append(
            f"| {r['loss']} | {r['kernel']} | {constants} | {r['warps']} | {r['registers']} |"
            f" {r['spilled_bytes']} | {body or 'none'} |"
        )
    report.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
