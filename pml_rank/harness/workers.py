"""Worker processes for `pml-rank bench` and `pml-rank tune` and the claim loop they run
(`claim_trials`: a bench's jobs, tune's trials) on a shared storage, so a worker on this
machine and one on another are alike. The calling process only shows progress."""

import multiprocessing
import os
import signal
import sys
import threading
import time
import warnings

from .arguments import LOADER_WORKERS_PER_GPU_PROCESS, PROCESSES_PER_GPU
from .storage import StorageUnavailable, unavailable_in


def default_processes(devices, trunk, cores=None):
    """Local worker processes when --workers is not given: one per core on the CPU (each
    on one thread); on GPUs, `PROCESSES_PER_GPU` for `trunk` (1 for the ImageNet trunks)
    on each of `devices`, at most one per core."""
    cores = cores or os.cpu_count() or 1
    gpus = [d for d in devices if not d.startswith("cpu")]
    if not gpus:
        return len(devices) if len(devices) > 1 else cores
    per_gpu = PROCESSES_PER_GPU.get(trunk, 1)
    return max(len(devices), min(cores, per_gpu * len(gpus) + len(devices) - len(gpus)))


def default_loader_workers(device, in_memory, processes, cores=None):
    """Data-loading processes per worker when --loader-workers is not given: none on the
    CPU (decoding would take the cores the steps use) or for data held in memory (the
    glyphs); on a GPU, `LOADER_WORKERS_PER_GPU_PROCESS`, within the cores left to each
    worker."""
    cores = cores or os.cpu_count() or 1
    if device.startswith("cpu") or in_memory:
        return 0
    return max(0, min(LOADER_WORKERS_PER_GPU_PROCESS, cores // processes - 1))


def _main(target, args, gave_up):
    try:
        target(*args)
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as error:
        unavailable = unavailable_in(error)
        if unavailable is None:
            raise
        gave_up.put(str(unavailable))  # the calling process says it, once
        sys.exit(1)


def run_processes(target, args_per_worker, progress, poll=1.0):
    """Starts one spawned process per ``args`` in `args_per_worker`, each calling
    ``target(*args)``, and calls ``progress()`` every `poll` seconds until all have ended.
    Ctrl-C lets them end (what finished is in the storage) and re-raises. Raises
    `StorageUnavailable` when a worker gave up on the storage. Returns the exit codes of
    the workers that failed otherwise."""
    context = multiprocessing.get_context("spawn")
    gave_up = context.SimpleQueue()
    processes = [context.Process(target=_main, args=(target, args, gave_up), daemon=False) for args in args_per_worker]
    try:
        for process in processes:
            process.start()
        while any(p.is_alive() for p in processes):
            progress()
            time.sleep(poll)
        progress()
    except KeyboardInterrupt:
        for process in processes:
            process.join(timeout=30)
        raise
    finally:
        for process in processes:
            if process.is_alive():
                process.terminate()
                process.join()
    if not gave_up.empty():
        raise StorageUnavailable(gave_up.get())
    return [p.exitcode for p in processes if p.exitcode not in (0, 130, -2)]


class InterruptsBetweenTrials:
    """Ctrl-C in a claim loop, so that no trial is left RUNNING: raised inside the objective
    (whose trial Optuna then records as failed), held back while Optuna creates or records a
    trial (an interrupt there would leave it RUNNING until its heartbeat goes stale) and raised
    by `check()` once the trial is recorded. Only the main thread receives signals; elsewhere
    this does nothing."""

    def __init__(self):
        self.requested = False
        self._inside = False
        self._previous = None

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc_info):
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)

    def _handle(self, signum, frame):
        self.requested = True
        if self._inside:
            raise KeyboardInterrupt

    def objective(self, objective):
        """`objective`, interruptible while it runs."""

        def run(trial):
            self.check()
            self._inside = True
            try:
                return objective(trial)
            finally:
                self._inside = False

        return run

    def check(self):
        """Raises the KeyboardInterrupt held back since the last trial, if any."""
        if self.requested:
            raise KeyboardInterrupt


# `next_trial()`'s answer while the trials left are running in other processes: the loop waits
# and asks again, in case one of those processes dies and its trial is queued again.
WAIT = "wait"


def claim_trials(next_trial, poll, catch=(), skip=()):
    """The claim loop of every worker, a bench's (`jobs.JobStore.work`) and tune's
    (`tune.run_worker`): runs one trial at a time until ``next_trial()`` returns None.
    ``next_trial()`` returns ``(study, objective)`` for one trial of `objective` in `study`,
    or `WAIT` (the loop sleeps `poll` seconds). `catch` goes to Optuna's `Study.optimize`
    (such a trial ends failed and counts); an exception of `skip` that `optimize` raises
    passes the trial over. Ctrl-C ends the loop between trials (`InterruptsBetweenTrials`).
    Returns the number of trials run, skipped ones aside."""
    done = 0
    with InterruptsBetweenTrials() as interrupts:
        while True:
            interrupts.check()
            chosen = next_trial()
            if chosen is None:
                return done
            if chosen is WAIT:
                time.sleep(poll)
                continue
            study, objective = chosen
            try:
                study.optimize(interrupts.objective(objective), n_trials=1, catch=catch)
            except skip:
                continue
            done += 1


def fail_stale_trials(study):
    """Fails the trials of `study` whose heartbeat is stale (their process died): Optuna's
    retry callback queues each again."""
    import optuna

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        optuna.storages.fail_stale_trials(study)
