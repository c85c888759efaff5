"""`pml-rank bench`'s jobs in an Optuna storage (`storage.py`), shared by any number of
processes on any number of machines.

One bench per storage: the study ``pml-rank bench`` holds one trial per (row, seed) job,
enqueued with the job in its user attributes. A process claims a job by asking the study
for a trial: Optuna hands each waiting trial to exactly one process (a row lock on
PostgreSQL, a write transaction on SQLite). While the job runs, its trial sends heartbeats;
when its process dies, the trial is failed once the heartbeat is stale and queued again by
Optuna's retry callback, so another process (or a rerun) takes the job up. A finished
job's outcome (accuracies, fold histories, seconds) is a user attribute of its complete
trial. The bench's budget and each row's parameters are study attributes: a process with
another budget or other parameters for a row is refused before any work.

Two processes starting at the same moment may both enqueue a missing job. The lower trial
number of a job wins: a process that claims a trial while a lower-numbered trial of the
same job is waiting, running or complete gives its trial up (it ends failed, marked
``superseded``), so each job runs to completion once.
"""

import dataclasses
import os
import socket
import time
import warnings
from pathlib import Path

from . import runner
from .budget import TRAINING_KEYS, training_key
from .runner import digest
from .storage import close_storage, open_storage, record_heartbeat_now
from .workers import InterruptsBetweenTrials

STUDY_NAME = "pml-rank bench"
METRIC = "mean_average_precision_at_r"


@dataclasses.dataclass(frozen=True)
class Job:
    row: str
    seed: int
    params: dict = dataclasses.field(default_factory=dict, hash=False)

    @property
    def key(self):
        return f"{self.row}|{digest(self.params)}|{self.seed}"

    def record(self):
        return {"row": self.row, "seed": self.seed, "params": self.params, "key": self.key}


class MismatchError(RuntimeError):
    """The storage holds a bench of another budget, or other parameters for a row."""


class _Superseded(Exception):
    """A lower-numbered trial of the same job exists: this one gives up."""


class _NoJob(Exception):
    """The study handed out a fresh trial: no job was waiting any more."""


def check_budget_matches(study_attrs, budget):
    """Raises `MismatchError` naming every budget key the stored bench (its study's user
    attributes) holds with another value."""
    theirs, mine = study_attrs.get("budget"), training_key(budget)
    if theirs is not None and theirs != mine:
        diff = ", ".join(
            f"{k} {theirs.get(k)!r} there, {mine[k]!r} now" for k in TRAINING_KEYS if theirs.get(k) != mine[k]
        )
        raise MismatchError(
            f"the storage holds a bench of another budget ({diff}); it is never overwritten: "
            "choose another --out or --storage, or delete it to start afresh"
        )


def check_params_match(study_attrs, row_params):
    """Raises `MismatchError` naming every row the stored bench holds with other parameters."""
    stored = study_attrs.get("params", {})
    differ = [f"{row}: {stored[row]} there, {p} now" for row, p in row_params.items() if stored.get(row, p) != p]
    if differ:
        raise MismatchError(
            f"the storage holds this bench with other parameters ({'; '.join(differ)}): another --params "
            "file or --untuned; choose another --out or --storage to keep both"
        )


def check_stored_bench(url, budget, row_params):
    """Refuses (`MismatchError`) a bench the storage at `url` holds with another budget or
    other parameters, reading only (it makes no SQLite file and no study), so it runs before
    the data set is loaded."""
    import optuna
    from sqlalchemy.engine import make_url

    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite" and not (parsed.database and Path(parsed.database).is_file()):
        return
    _quiet_optuna()
    storage = open_storage(url, max_retry=None)
    try:
        attrs = optuna.load_study(study_name=STUDY_NAME, storage=storage).user_attrs
    except KeyError:  # no bench there yet
        return
    finally:
        close_storage(storage)
    check_budget_matches(attrs, budget)
    check_params_match(attrs, row_params)


class JobStore:
    """The bench's jobs in the storage at `url` (see the module's docstring)."""

    def __init__(self, url, budget=None, heartbeat=20.0):
        """`budget` None: only to read the storage's bench (`status`, `outcomes`)."""
        import optuna

        _quiet_optuna()
        self.url, self.budget = url, budget
        self.storage = open_storage(url, heartbeat, max_retry=None)
        self.study = optuna.create_study(study_name=STUDY_NAME, storage=self.storage, load_if_exists=True)
        if budget is None:
            return
        check_budget_matches(self.study.user_attrs, budget)
        if "budget" not in self.study.user_attrs:
            self.study.set_user_attr("budget", training_key(budget))

    def close(self):
        close_storage(self.storage)

    def claim_rows(self, row_params):
        """Records each row's parameters; raises `MismatchError` naming every row the storage
        holds with other parameters."""
        check_params_match(self.study.user_attrs, row_params)
        stored = self.study.user_attrs.get("params", {})
        if any(row not in stored for row in row_params):
            self.study.set_user_attr("params", {**stored, **row_params})

    def _trials(self, states=None):
        return [t for t in self.study.get_trials(deepcopy=False, states=states) if "job" in t.user_attrs]

    def ensure(self, jobs):
        """Enqueues every job that has no waiting, running or complete trial; returns how many."""
        from optuna.trial import TrialState

        live = {
            t.user_attrs["job"]["key"]
            for t in self._trials((TrialState.WAITING, TrialState.RUNNING, TrialState.COMPLETE))
        }
        missing = [job for job in jobs if job.key not in live]
        for job in missing:
            self.study.enqueue_trial({}, user_attrs={"job": job.record()})
        return len(missing)

    def outcomes(self):
        """``{job key: outcome}`` of every finished job (the lowest trial number of a job)."""
        from optuna.trial import TrialState

        found = {}
        for trial in sorted(self._trials((TrialState.COMPLETE,)), key=lambda t: t.number):
            found.setdefault(trial.user_attrs["job"]["key"], trial.user_attrs["outcome"])
        return found

    def status(self, jobs=None):
        """``{row: {"done", "running", "waiting"}}`` over the jobs (default: every job the
        storage holds), each job counted once, in its most advanced state."""
        from optuna.trial import TrialState

        rank = {TrialState.COMPLETE: 3, TrialState.RUNNING: 2, TrialState.WAITING: 1}
        state_of, row_of = {}, {}
        for trial in self._trials():
            key = trial.user_attrs["job"]["key"]
            row_of[key] = trial.user_attrs["job"]["row"]
            state_of[key] = max(state_of.get(key, 0), rank.get(trial.state, 0))
        if jobs is not None:
            row_of = {job.key: job.row for job in jobs}
        table = {}
        for key, row in row_of.items():
            counts = table.setdefault(row, {"done": 0, "running": 0, "waiting": 0})
            name = {3: "done", 2: "running"}.get(state_of.get(key, 0), "waiting")
            counts[name] += 1
        return table

    def _superseded(self, trial_number, key):
        from optuna.trial import TrialState

        live = (TrialState.WAITING, TrialState.RUNNING, TrialState.COMPLETE)
        return any(
            t.user_attrs["job"]["key"] == key and (t.state == TrialState.COMPLETE or t.number < trial_number)
            for t in self._trials(live)
            if t.number != trial_number
        )

    def work(self, place, on_iteration=None, on_job=None, poll=2.0):
        """Claims and runs jobs until none is waiting or running (waiting for other processes'
        running jobs, in case one dies and its job comes back); returns how many this process
        finished. ``on_job(job)`` is called when a job starts."""
        import optuna
        from optuna.trial import TrialState

        finished = []

        def objective(trial):
            record_heartbeat_now(trial)
            record = trial.user_attrs.get("job")
            if record is None:
                raise _NoJob()
            if self._superseded(trial.number, record["key"]):
                trial.set_user_attr("superseded", True)
                raise _Superseded()
            trial.set_user_attr("worker", f"{socket.gethostname()}:{os.getpid()}")
            if on_job is not None:
                on_job(Job(record["row"], record["seed"], record["params"]))
            outcome = runner.run(
                self.budget, record["row"], record["params"], record["seed"], place, on_iteration=on_iteration
            )
            trial.set_user_attr("outcome", outcome)
            finished.append(record["key"])
            return float(outcome["run"]["concatenated"][METRIC])

        with InterruptsBetweenTrials() as interrupts:
            while True:
                interrupts.check()
                states = [t.state for t in self._trials((TrialState.WAITING, TrialState.RUNNING))]
                if TrialState.WAITING not in states:
                    if TrialState.RUNNING not in states:
                        return len(finished)
                    time.sleep(poll)
                    with warnings.catch_warnings():  # a dead process's job: failed, queued again
                        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                        optuna.storages.fail_stale_trials(self.study)
                    continue
                # Optuna fails stale trials itself before each trial it starts.
                try:
                    self.study.optimize(interrupts.objective(objective), n_trials=1, catch=(_Superseded, _NoJob))
                except (ValueError, optuna.exceptions.UpdateFinishedTrialError):
                    # The trial was failed as stale while this process still ran it (a heartbeat
                    # missed under heavy load): its retry holds the job, this outcome is dropped.
                    continue


class _QuietRecords:
    """Drops Optuna's reports of the trials this module gives up on purpose."""

    @staticmethod
    def filter(record):
        message = record.getMessage()
        quiet = ("_Superseded", "_NoJob", "KeyboardInterrupt", "SurplusTrial", "failed with value None")
        return not any(word in message for word in quiet)


def _quiet_optuna():
    import logging

    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    for handler in logging.getLogger("optuna").handlers:
        if not any(isinstance(f, _QuietRecords) for f in handler.filters):
            handler.addFilter(_QuietRecords())
