"""RaMBO's score memory, measured: why `memory_variant="rows"` is the default.

Time: RaMBORecallLoss at batch 2048 (dim 512, forward+backward, CPU) with no memory, the
"rows" memory (the authors' `BatchMemoryRecallLoss`) and the "extend" memory (the paper's
text), 3 batches each and full before the timed rounds, with the cosine-similarity floor
of `pml-rank speed`. Rounds interleave the contenders; each cell is the median over
rounds with the min-max.

Accuracy (--accuracy): `pml-rank bench RaMBORecallLoss` at the default glyph budget, once
per variant (the papers' defaults otherwise), each in its own folder under --out; any
other option is passed on to the bench.

    python examples/rambo_memory_variants.py --threads 1
    python examples/rambo_memory_variants.py --accuracy --out rambo-memory --workers 1
"""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

from pml_rank.harness.speed import labelled_batch, round_ratios, similarity_floor, summary
from pml_rank.losses import RaMBORecallLoss

VARIANTS = {
    "no-memory": dict(memory_size=0),
    "rows": dict(memory_size=3, memory_variant="rows"),  # the default
    "extend": dict(memory_size=3, memory_variant="extend"),
}


def time_variants(batch_size, dim, rounds, seed=0):
    """{label: [seconds per round]} for every variant and the floor."""
    embeddings, labels = labelled_batch(per_class=4)(batch_size, dim, torch.Generator().manual_seed(seed), "cpu")
    contenders = {"floor": similarity_floor()}
    for label, kwargs in VARIANTS.items():
        contenders[label] = RaMBORecallLoss(**kwargs)
    for fn in contenders.values():  # warm-up; fills each memory (3 batches)
        for _ in range(3):
            _step(fn, embeddings, labels)
    times = {label: [] for label in contenders}
    for _ in range(rounds):
        for label, fn in contenders.items():
            start = time.perf_counter()
            _step(fn, embeddings, labels)
            times[label].append(time.perf_counter() - start)
    return times


def _step(fn, embeddings, labels):
    embeddings.grad = None
    fn(embeddings, labels).backward()


def format_times(times):
    ratios = round_ratios(times, [(label, label, "floor") for label in VARIANTS])
    lines = ["| RaMBORecallLoss | ms | time / floor |", "| --- | --- | --- |"]
    for label in ["floor", *VARIANTS]:
        ms = summary([t * 1e3 for t in times[label]])
        cell = f"{ms['median']:.0f} ({ms['min']:.0f}-{ms['max']:.0f})"
        ratio = summary(ratios[label]) if label in ratios else None
        ratio_cell = f"{ratio['median']:.2f} ({ratio['min']:.2f}-{ratio['max']:.2f})" if ratio else "1"
        lines.append(f"| {label} | {cell} | {ratio_cell} |")
    return "\n".join(lines)


def bench_variants(out, extra):
    """Runs `pml-rank bench RaMBORecallLoss` once per memory variant; the bench prints its table."""
    for label, kwargs in VARIANTS.items():
        folder = out / label
        folder.mkdir(parents=True, exist_ok=True)
        params = folder / "params.json"
        params.write_text(json.dumps({"RaMBORecallLoss": {"params": kwargs}}))
        print(f"\n## {label}: {kwargs}", flush=True)
        command = [sys.executable, "-m", "pml_rank.cli", "bench", "RaMBORecallLoss", "--params", str(params)]
        subprocess.run([*command, "--out", str(folder), *extra], check=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-size", type=int, default=2048)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds (default 7)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    parser.add_argument("--accuracy", action="store_true", help="also run the glyph bench once per variant")
    parser.add_argument("--out", type=Path, default=Path("rambo-memory-variants"), help="folder for --accuracy")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes and a 1-seed, 1-epoch bench")
    args, bench_options = parser.parse_known_args(argv)
    torch.set_num_threads(args.threads)
    batch_size, dim, rounds = (64, 8, 2) if args.smoke else (args.batch_size, args.dim, args.rounds)
    times = time_variants(batch_size, dim, rounds)
    print(f"batch {batch_size}, dim {dim}, {args.threads} thread(s), {rounds} rounds, {time.strftime('%Y-%m-%d')}")
    print(format_times(times))
    if args.accuracy:
        smoke = ["--seeds", "1", "--epochs", "1", "--iterations", "2", "--classes", "44"] if args.smoke else []
        bench_variants(args.out, smoke + bench_options)
    elif bench_options:
        parser.error(f"unrecognized arguments: {' '.join(bench_options)} (bench options need --accuracy)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
