"""Peak memory and time of retrieval accuracy at Stanford Online Products' scale.

SOP's test set is 60,502 images in 11,316 classes. This measures P@1, R-Precision and
MAP@R (queries against the rest of the set) on N synthetic 128-d L2-normalised
embeddings in C classes (default 60,000 in 11,000: labels drawn uniformly, so class sizes
vary and some classes are singletons; points around their class's random centre), each
method in a fresh process: peak resident memory (``ru_maxrss`` of the child, from
``os.wait4``), that process's memory before the evaluation (Python, torch, faiss and the
data), and the evaluation's wall time.

    python examples/eval_memory.py [--n 60000] [--classes 11000] [--dim 128]
        [--methods knn ours pml] [--device cpu]

Methods: ``pml`` is PML's `AccuracyCalculator(k="max_bin_count")`, ``ours`` is
`pml_rank.harness.evaluation.accuracy`, ``knn`` is the k-nearest-neighbour search both
start from (PML's `FaissKNN`, k = the largest class), the floor. The last column is the
largest difference between a method's values and PML's. PML's run peaks near 7 GB at the default
size: leave it out (``--methods knn ours``) on a smaller machine.
"""

import argparse
import json
import os
import subprocess
import sys
import time

METRICS = ("precision_at_1", "r_precision", "mean_average_precision_at_r")


def synthetic_embeddings(n, classes, dim, seed=0):
    import numpy as np

    rng = np.random.default_rng(seed)
    labels = rng.integers(0, classes, n)
    centres = rng.standard_normal((classes, dim)).astype(np.float32)
    embeddings = centres[labels] + rng.standard_normal((n, dim)).astype(np.float32)
    embeddings /= np.linalg.norm(embeddings, axis=1, keepdims=True)
    return embeddings, labels


def evaluate(method, n, classes, dim, device):
    """In the child: ``{"values": {metric: value}, "seconds": ..., "before_kib": ...}``."""
    import resource

    import numpy as np
    import torch
    from pytorch_metric_learning.utils.accuracy_calculator import AccuracyCalculator
    from pytorch_metric_learning.utils.inference import FaissKNN

    from pml_rank.harness.evaluation import accuracy

    embeddings, labels = synthetic_embeddings(n, classes, dim)
    before_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.perf_counter()
    if method == "ours":
        values = accuracy(embeddings, labels, device=device)
    elif method == "pml":
        calculator = AccuracyCalculator(include=METRICS, k="max_bin_count", device=torch.device(device))
        values = calculator.get_accuracy(embeddings, labels)
    else:
        query = torch.from_numpy(embeddings).to(device)
        FaissKNN()(query, int(np.bincount(labels).max()) - 1, query, ref_includes_query=True)
        values = {}
    seconds = time.perf_counter() - started
    return {"values": {m: float(v) for m, v in values.items()}, "seconds": seconds, "before_kib": before_kib}


def run_child(method, args):
    """``(result, peak_kib)`` of `method` run in a child process."""
    command = [sys.executable, __file__, "--child", method, "--n", str(args.n), "--classes", str(args.classes)]
    command += ["--dim", str(args.dim), "--device", args.device]
    child = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    output = child.stdout.read()
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode != 0:
        raise SystemExit(f"eval_memory: the {method} run exited with {child.returncode}")
    return json.loads(output.splitlines()[-1]), usage.ru_maxrss


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=60_000)
    parser.add_argument("--classes", type=int, default=11_000)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--methods", nargs="+", choices=("knn", "ours", "pml"), default=["knn", "ours", "pml"])
    parser.add_argument("--device", default="cpu", help="torch device of the evaluation (default cpu)")
    parser.add_argument("--child", choices=("knn", "ours", "pml"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(evaluate(args.child, args.n, args.classes, args.dim, args.device)))
        return

    print(f"{args.n} embeddings of {args.dim} dimensions in {args.classes} classes, device {args.device}\n")
    header = ["method", "peak memory (GiB)", "before evaluating (GiB)", "time (s)", "P@1", "RP", "MAP@R"]
    header.append("largest difference from PML")
    print("| " + " | ".join(header) + " |\n" + "| --- " * len(header) + "|")
    results = {method: run_child(method, args) for method in args.methods}
    pml = results["pml"][0]["values"] if "pml" in results else None
    for method, (result, peak_kib) in results.items():
        values = result["values"]
        row = [method, f"{peak_kib / 2**20:.2f}", f"{result['before_kib'] / 2**20:.2f}", f"{result['seconds']:.1f}"]
        row += [f"{values[m]:.6f}" if values else "–" for m in METRICS]
        row.append(f"{max(abs(values[m] - pml[m]) for m in METRICS):.1g}" if values and pml else "–")
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
