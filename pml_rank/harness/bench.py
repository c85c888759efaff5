"""`pml-rank bench`: rows (pml-rank's losses, any plugin's, PML's baselines) x seeds under the
Reality Check protocol, each (row, seed) an experiment of `runner`, as jobs in a shared
storage (`jobs.JobStore`): any number of processes, here (``--workers``) or on other
machines, run one bench; a rerun resumes; the outputs (`report`) are rebuilt from the
storage.

Two rows need no training: "raw input" (retrieval on the L2-normalised pixels, glyphs only)
and "untrained" (the four fold networks at their initialisation: random for the small CNN,
ImageNet for a pretrained trunk, the Reality Check's "Pretrained" row).
"""

import dataclasses
import functools
import json
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from . import runner
from .budget import SHIPPED_PARAMS, TRAINING_KEYS, budget_warnings
from .jobs import STORE_FILE as STORE_FILE  # the storage's file in --out, re-exported
from .jobs import Job, JobStore, check_stored_bench
from .report import BenchResult
from .runner import RAW_INPUT, Machine
from .storage import check_url
from .storage_rules import DEFAULT_HEARTBEAT, DEFAULT_RETRY
from .workers import run_processes


class ParamsError(ValueError):
    """A --params file that cannot be used; the message names it."""


def load_params(path):
    """``(params, defaults_won)`` from a tuned file (`pml-rank tune`'s tuned.json):
    ``{row: parameters}`` and the rows whose search found nothing better than the paper's
    defaults (its first trial)."""
    try:
        payload = json.loads(Path(path).read_text())
    except (OSError, ValueError) as error:
        raise ParamsError(f"--params {path}: cannot read it ({error})") from None
    entries = {
        row: entry
        for row, entry in payload.items()
        if not row.startswith("_") and isinstance(entry, dict) and "params" in entry
    }
    return {row: dict(e["params"]) for row, e in entries.items()}, {
        row for row, e in entries.items() if e.get("defaults_won")
    }


def tuned_budget_differences(path, budget):
    """How the budget the file's parameters were tuned with differs from `budget` (a list of
    ``"epochs 8 there, 4 here"`` strings; empty when they match or the file does not say)."""
    payload = json.loads(Path(path).read_text())
    differences = set()
    for entry in payload.values():
        tuned = entry.get("budget") if isinstance(entry, dict) else None
        for key, value in (tuned or {}).items():
            if key in TRAINING_KEYS and key in budget and budget[key] != value:
                differences.add(f"{key} {value!r} there, {budget[key]!r} here")
    return sorted(differences)


def choose_params(params_file=None, untuned=False, budget=None):
    """``(params, source, defaults_won, note)`` for a bench: --params FILE, the file shipped
    for the default glyph budget (on the glyphs), or none (--untuned, other data). `note`
    says when the file was tuned with another budget. Raises
    `ParamsError` for a file that cannot be read."""
    if untuned:
        return {}, None, set(), None
    path = Path(params_file) if params_file else SHIPPED_PARAMS
    if params_file and not path.is_file():
        raise ParamsError(f"--params {path}: no such file")
    if not params_file and (budget is None or budget["dataset"] != "glyphs"):
        return {}, None, set(), None  # the shipped parameters were tuned on the glyphs
    params, won = load_params(path)
    differences = tuned_budget_differences(path, budget) if budget is not None else []
    note = (
        f"the parameters in {path} were tuned with another budget ({'; '.join(differences)})" if differences else None
    )
    return params, f"tuned ({path.name})", won, note


def bench_jobs(budget, rows, seeds, params):
    """Every job of a bench: the rows that need no training first (raw input: one seed)."""
    jobs = []
    for row in [*runner.rows_without_training(budget), *rows]:
        for seed in [0] if row == RAW_INPUT else range(seeds):
            jobs.append(Job(row, seed, dict(params.get(row, {}))))
    return jobs


def _work(url, budget, machine, threads, heartbeat, retry):
    torch.set_num_threads(threads)
    store = JobStore(url, budget, heartbeat, retry)
    try:
        store.work(functools.partial(runner.run, machine=machine))
    finally:
        store.close()


def run_bench(
    row_recipes,
    budget,
    url,
    machine=Machine(),
    seeds=3,
    params=None,
    params_source=None,
    defaults_won=(),
    workers=1,
    devices=None,
    threads=1,
    heartbeat=DEFAULT_HEARTBEAT,
    retry=DEFAULT_RETRY,
    progress=True,
):
    """Runs (or resumes, or joins) the bench of the rows `row_recipes` (``{row: Recipe}``, checked
    against `budget` by `runner.check_rows`) at `budget` on the storage `url` and returns its
    `BenchResult` once every job is done. `workers` local processes (each on
    ``devices[i % len(devices)]`` when given) claim the jobs; with 1 this process works
    itself. A storage call failing on a transient error is retried for up to `retry` seconds.
    Raises `jobs.MismatchError` when the storage holds another bench, and the errors of
    `runner.check` before any work; `storage.StorageUnavailable` when the storage stayed
    unreachable (finished jobs are kept)."""
    params = params or {}
    row_params = {row: dict(params.get(row, {})) for row in row_recipes}
    # Before the data load: an unreachable storage, a stored bench of another budget or other
    # parameters. Bad data are refused before a storage file is made.
    check_url(url)
    check_stored_bench(url, budget, row_params, retry)
    runner.check(budget, row_recipes, machine)
    for line in budget_warnings(budget):  # after every refusal, before any training
        print(f"pml-rank bench: warning: {line}", file=sys.stderr)
    all_jobs = bench_jobs(budget, list(row_recipes), seeds, row_params)
    store = JobStore(url, budget, heartbeat, retry)
    try:
        store.record_row_params(row_params)
        already = len(store.outcomes())
        store.enqueue_missing(all_jobs)
        bar = tqdm(total=len(all_jobs), desc="pml-rank bench", unit="job", disable=not progress, dynamic_ncols=True)
        last = [0.0]

        def show(force=False):
            if not force and time.monotonic() - last[0] < 2.0:
                return
            last[0] = time.monotonic()
            status = store.status(all_jobs)
            bar.n = sum(s["done"] for s in status.values())
            bar.set_postfix_str(f"{sum(s['running'] for s in status.values())} running")
            bar.refresh()

        try:
            if workers <= 1:
                torch.set_num_threads(threads)
                here = machine if not devices else dataclasses.replace(machine, device=devices[0])
                run = functools.partial(runner.run, machine=here, on_iteration=lambda trainer: show())
                store.work(run, on_job=lambda job: show(force=True))
            else:
                machines = [
                    dataclasses.replace(machine, device=devices[i % len(devices)]) if devices else machine
                    for i in range(workers)
                ]
                failed = run_processes(_work, [(url, budget, m, threads, heartbeat, retry) for m in machines], show)
                if failed:
                    raise RuntimeError(f"pml-rank bench: {len(failed)} worker(s) failed (exit codes {failed})")
            show(force=True)
        finally:
            bar.close()
        found = store.outcomes()
    finally:
        store.close()
    return _result(budget, seeds, row_recipes, all_jobs, found, row_params, params_source, defaults_won, already)


def _result(budget, seeds, row_recipes, all_jobs, found, row_params, params_source, defaults_won, resumed):
    missing = [job for job in all_jobs if job.key not in found]
    if missing:
        raise RuntimeError(f"pml-rank bench: {len(missing)} job(s) did not finish, e.g. {missing[0].row}")
    rows = [*runner.rows_without_training(budget), *row_recipes]
    runs, histories, seconds = {}, {}, {}
    for row in rows:
        outcomes = [found[job.key] for job in all_jobs if job.row == row]
        runs[row] = [o["run"] for o in outcomes]
        histories[row] = [o["histories"] for o in outcomes] if row != RAW_INPUT else []
        seconds[row] = sum(o["seconds"] for o in outcomes)
    sources = {row: "" for row in rows}
    for row in row_recipes:
        if row_params[row]:
            sources[row] = "defaults won the search" if row in defaults_won else (params_source or "tuned")
        else:
            sources[row] = "defaults"
    batches = {row: row_recipes[row].batches if row in row_recipes else "" for row in rows}
    recorded = {**{k: budget[k] for k in (*TRAINING_KEYS, "preset")}, "seeds": seeds}
    return BenchResult(
        recorded, rows, runs, histories, seconds, batches, row_params, sources, min(resumed, len(all_jobs))
    )
