"""What the shared job storage costs `pml-rank bench`: every storage operation of the default
bench (43 jobs: 13 rows x 3 seeds, the untrained row x 3 and the raw input: opening,
enqueuing, claiming through Optuna, heartbeats, storing each outcome, rebuilding the table)
with the training replaced by a stand-in that returns at once with an outcome of the real
size. Run by 1 process, then split over 2 processes on one SQLite file; compare with the
default bench's wall time. Every round starts from an empty bench: a fresh SQLite file, or
on --storage URL (which must hold no bench) the round's bench is deleted after it.

    python examples/bench_store_overhead.py [--storage URL] [--rounds 3]
"""

import argparse
import multiprocessing
import statistics
import sys
import tempfile
import time
from pathlib import Path

import optuna

from pml_rank.harness import bench, jobs, recipes
from pml_rank.harness.budget import resolve
from pml_rank.harness.evaluation import METRICS


def fake_outcome(budget):
    metrics = {m: 0.5 for m in METRICS}
    epoch = {"epoch": 1, "loss": 0.1, **metrics}
    histories = [[dict(epoch, epoch=e + 1) for e in range(budget["epochs"])] for _ in range(budget["num_folds"])]
    return {"run": {"concatenated": metrics, "separated": metrics}, "histories": histories,
            "best_epochs": [budget["epochs"]] * budget["num_folds"], "seconds": 0.0}  # fmt: skip


def work(url, budget):
    store = jobs.JobStore(url, budget)
    try:
        store.work(lambda budget, row, params, seed: fake_outcome(budget), poll=0.05)
    finally:
        store.close()


def one_round(url, processes):
    budget = resolve("glyphs")
    params, _, _, _ = bench.choose_params(None, False, budget)
    rows = recipes.default_rows()
    all_jobs = bench.bench_jobs(budget, rows, 3, params)
    started = time.perf_counter()
    store = jobs.JobStore(url, budget)
    store.record_row_params({row: dict(params.get(row, {})) for row in rows})
    store.enqueue_missing(all_jobs)
    if processes == 1:
        work(url, budget)
    else:
        context = multiprocessing.get_context("spawn")
        workers = [context.Process(target=work, args=(url, budget)) for _ in range(processes)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    found = store.outcomes()
    seconds = time.perf_counter() - started
    optuna.delete_study(study_name=store.study.study_name, storage=store.storage)  # the next round starts empty
    store.close()
    assert len(found) == len(all_jobs), (len(found), len(all_jobs))
    return seconds, len(all_jobs)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--storage", help="a database URL; each round needs an empty one (default: fresh SQLite files)")
    args = parser.parse_args(argv)
    if args.storage and jobs.stored_status(args.storage):
        parser.error(f"--storage {args.storage}: it holds a bench; each round needs one without")
    for processes in (1, 2):
        seconds = []
        for _ in range(args.rounds):
            with tempfile.TemporaryDirectory() as folder:
                url = args.storage or f"sqlite:///{Path(folder) / 'bench.db'}"
                elapsed, count = one_round(url, processes)
                seconds.append(elapsed)
        print(f"{processes} process(es), {count} jobs: storage time median {statistics.median(seconds):.2f} s "
              f"(min {min(seconds):.2f}, max {max(seconds):.2f}) over {args.rounds} rounds")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
