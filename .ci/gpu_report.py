"""Writes REPORT_DIR/gpu-check.json and .md from what `bash .ci/gpu` left in REPORT_DIR/logs
(`--environment`: the machine's facts first, into logs/environment.json)."""

import csv
import importlib.metadata
import json
import os
import re
import subprocess
import sys
from pathlib import Path

# The throughput steps of `.ci/gpu` whose lines the report keeps (ResNet-50's and the glyph bench's small CNN's).
THROUGHPUTS = {
    "throughput": "ResNet-50",
    "throughput-60": "ResNet-50, 60 iterations an epoch,",
    "throughput-60-loaders4": "ResNet-50, 60 iterations an epoch, 4 loader processes,",
    "throughput-60-loaders6": "ResNet-50, 60 iterations an epoch, 6 loader processes,",
    "throughput-glyphs": "Glyph bench (small CNN)",
}


def triton_version():
    try:
        return importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return None


def environment():
    import torch

    try:
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
        ).stdout.strip()
    except FileNotFoundError:
        smi = None
    return {
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "nvidia-smi": smi,
        "torch": torch.__version__,
        "triton": triton_version(),
        "cuda": torch.version.cuda,
        "python": sys.version.split()[0],
        "cpu_count": os.cpu_count(),
    }


def read(path):
    return path.read_text(errors="replace").replace("\r", "\n") if path.exists() else ""


def speed_table(path):
    """{loss: {size: time/floor}} (and memory/floor) of a speed report."""
    if not path.exists():
        return None
    table = {}
    for result in json.loads(path.read_text())["results"]:
        for row in result["rows"]:
            ratios = row["ratios"]
            table.setdefault(result["loss"], {})[str(row["size"])] = {
                "time/floor": round(ratios.get("time_vs_floor", float("nan")), 3),
                "spread": [round(v, 3) for v in row["spread"].get("time_vs_floor", [])],
                "memory/floor": round(ratios.get("memory_vs_floor", float("nan")), 3),
                "ms": round(1000 * row["seconds"]["ours"], 3),
                "floor ms": round(1000 * row["seconds"].get("floor", float("nan")), 3),
            }
    return table


def build(report):
    logs = report / "logs"
    out = {"environment": json.loads(read(logs / "environment.json") or "{}")}
    out["steps"] = list(csv.DictReader((logs / "steps.csv").open())) if (logs / "steps.csv").exists() else []
    summary = [line for line in read(logs / "tests.log").splitlines() if re.search(r"\d+ (passed|failed)", line)]
    out["cuda tests"] = summary[-1].strip("= ") if summary else None
    out["speed float32"] = speed_table(report / "speed-cuda.json")
    out["speed autocast float16"] = speed_table(report / "speed-cuda-amp.json")
    knn = read(logs / "knn.log")
    out["knn"] = json.loads(knn[knn.index("{") :]) if "{" in knn and knn.rstrip().endswith("}") else None
    for name in THROUGHPUTS:
        out[name] = [
            line
            for line in read(logs / f"{name}.log").splitlines()
            if re.match(r"(raw step|bench|throughput|resnet|small-cnn|one more fold model by phase)", line)
        ]
    steps = read(logs / "glyph-steps.log")
    out["glyph steps"] = next(
        (json.loads(line)["rows"] for line in reversed(steps.splitlines()) if line.startswith('{"device"')), None
    )
    out["profile"] = read(report / "profile" / "profile.md")
    out["profile under autocast"] = read(report / "profile-amp" / "profile.md")
    out["kernel settings"] = read(report / "kernels.md")
    sweep = {}
    for step in out["steps"]:
        if step["step"].startswith("sweep-") and step["rc"] == "0":
            sweep[step["step"].removeprefix("sweep-")] = float(step["seconds"])
    out["sweep seconds by processes per GPU"] = sweep
    for name in ("bench-amp", "bench", "bench-cpu"):  # the last lines: the table's end, or how far it got
        lines = [line.strip() for line in read(logs / f"{name}.log").splitlines() if line.strip()]
        out[f"{name} log"] = lines[-4:]
    bench = report / "bench" / "bench.json"
    if bench.exists():
        data = json.loads(bench.read_text())
        out["glyph bench"] = {
            "total_seconds": data.get("total_seconds"),
            "rows": len(data["rows"]),
            "log": read(logs / "bench.log").splitlines()[-3:],
        }
    out["bench-cpu against the committed table"] = committed_rows_reproduced(report / "bench-cpu" / "bench.csv")
    return out


def committed_rows_reproduced(path, committed=Path("examples/results/bench-tuned/bench.csv")):
    """How many rows of the bench table `path` equal the committed one's in every column but the
    seconds, and how many have every metric within the wider of the two 95% intervals (rows of
    one run, without an interval, only when equal), of how many; None without both tables. The
    data themselves can differ by machine (glyphs rendered by another Pillow and FreeType)."""
    if not (path.exists() and committed.exists()):
        return None
    with path.open() as ran, committed.open() as kept:
        rows = {r["row"]: r for r in csv.DictReader(ran)}
        expected = list(csv.DictReader(kept))

    def within(ran, kept, metric):
        width = max(float(ran[f"{metric}_ci95"] or 0), float(kept[f"{metric}_ci95"] or 0))
        return abs(float(ran[metric]) - float(kept[metric])) <= width

    metrics = [k[: -len("_ci95")] for k in expected[0] if k.endswith("_ci95")] if expected else []
    same = sum(
        r["row"] in rows and all(rows[r["row"]].get(k) == v for k, v in r.items() if k != "seconds") for r in expected
    )
    close = sum(r["row"] in rows and all(within(rows[r["row"]], r, m) for m in metrics) for r in expected)
    return {"equal rows": same, "rows within intervals": close, "committed rows": len(expected), "rows run": len(rows)}


def markdown(out):
    env = out["environment"]
    lines = [
        f"# GPU check: {env.get('gpu')}",
        "",
        f"torch {env.get('torch')} (Triton {env.get('triton')}), CUDA {env.get('cuda')}, "
        f"Python {env.get('python')}, {env.get('cpu_count')} CPUs; "
        f"nvidia-smi: {env.get('nvidia-smi')}. Command: `bash .ci/gpu`.",
        "",
        "| step | limit s | exit | seconds |",
        "| --- | ---: | ---: | ---: |",
    ]
    lines += [f"| {s['step']} | {s['limit']} | {s['rc']} | {s['seconds']} |" for s in out["steps"]]
    lines += ["", f"cuda tests: {out['cuda tests']}", ""]
    for key in ("speed float32", "speed autocast float16"):
        if out.get(key):
            lines += [
                f"## {key}: time / floor (min-max), memory / floor, ms",
                "",
                "| loss | size | time/floor | memory/floor | ms | floor ms |",
                "| --- | ---: | --- | ---: | ---: | ---: |",
            ]
            for loss, sizes in out[key].items():
                for size, r in sizes.items():
                    spread = "-".join(f"{v:.2f}" for v in r["spread"])
                    cells = [loss, size, f"{r['time/floor']:.2f} ({spread})", f"{r['memory/floor']:.2f}"]
                    lines.append("| " + " | ".join([*cells, str(r["ms"]), str(r["floor ms"])]) + " |")
            lines.append("")
    if out.get("profile"):
        lines += ["## Where a call's time goes (.ci/gpu_profile.py)", "", *out["profile"].splitlines()[2:], ""]
    if out.get("profile under autocast"):
        lines += ["## Under float16 autocast (--amp)", "", *out["profile under autocast"].splitlines()[2:], ""]
    if out.get("kernel settings"):
        lines += ["## " + out["kernel settings"].lstrip("# "), ""]
    if out.get("knn"):
        k = out["knn"]
        lines += [
            "## k-NN at SOP scale (60,000 x 128)",
            "",
            f"torch on the GPU: {k['torch on the GPU']['seconds']} s; faiss-cpu ({k['cpu_threads']} CPUs): "
            f"{k['faiss-cpu']['seconds']} s; largest metric difference {k['largest difference']:.2e}",
            "",
        ]
    for name, title in THROUGHPUTS.items():
        if out.get(name):
            lines += [
                f"## {title} throughput (examples/bench_throughput.py; its profile in logs/{name}.log)",
                "",
                *[f"    {t}" for t in out[name]],
                "",
            ]
    if out.get("glyph steps"):
        lines += [
            "## The glyph training step driven each way (.ci/gpu_glyph_steps.py)",
            "",
            "| loss | optimizer | graphed trunk | amp | ms a step (min-max) | kernels | waits "
            "| steps/s: 1 process, 4 |",
            "| --- | --- | --- | --- | --- | ---: | ---: | --- |",
        ]
        for r in out["glyph steps"]:
            if "error" in r:
                timing, kernels, waits, shared = r["error"][:80], "", "", ""
            else:
                timing = f"{r['ms per step']} ({r['spread'][0]}-{r['spread'][1]})"
                kernels, waits = r["kernels"], r["waits"]
                shared = ", ".join(str(v) for k, v in r.items() if k.startswith("steps/s"))
            cells = [r["loss"], r["optimizer"], r["graphed"], r["amp"], timing, kernels, waits, shared]
            lines.append("| " + " | ".join(str(c) for c in cells) + " |")
        lines.append("")
    if out.get("sweep seconds by processes per GPU"):
        lines += [
            "## Glyph bench subset (4 rows x 2 seeds, reference rows, 2 epochs) by processes per GPU: wall seconds"
            " (cpu: on the CPU cores alone, one process per core)",
            "",
            " | ".join(f"{p}: {s}" for p, s in out["sweep seconds by processes per GPU"].items()),
            "",
        ]
    benches = (
        ("bench-amp", "Every bench row under float16 autocast"),
        ("bench", "Default glyph bench"),
        ("bench-cpu", "Default glyph bench on the CPU cores (no --device)"),
    )
    for name, title in benches:
        if out.get(f"{name} log"):
            lines += [f"## {title}: the log's last lines", "", *[f"    {t[:160]}" for t in out[f"{name} log"]], ""]
    if out.get("bench-cpu against the committed table"):
        found = out["bench-cpu against the committed table"]
        lines += [
            f"On the CPU cores: {found['equal rows']} of the {found['committed rows']} committed rows equal to the"
            f" last digit, {found.get('rows within intervals')} with every metric within the wider of the two 95%"
            f" intervals ({found['rows run']} rows run).",
            "",
        ]
    if out.get("glyph bench"):
        lines += [
            "## Default glyph bench on CUDA",
            "",
            f"{out['glyph bench']['rows']} rows in {out['glyph bench']['total_seconds']} s",
            "",
        ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    report = Path(sys.argv[1])
    (report / "logs").mkdir(parents=True, exist_ok=True)
    if "--environment" in sys.argv:
        (report / "logs" / "environment.json").write_text(json.dumps(environment(), indent=2))
    else:
        out = build(report)
        (report / "gpu-check.json").write_text(json.dumps(out, indent=2))
        (report / "gpu-check.md").write_text(markdown(out))
