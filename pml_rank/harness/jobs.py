"""`pml-rank bench`'s jobs in an Optuna storage (`storage.py`), shared by any number of
processes on any number of machines.

A bench is one study, named by the digest of its budget (`study_name`), holding one trial per
(row, seed) job, enqueued with the job in its user attributes. The name is claimed when the
study is made, atomically (the database refuses a second study of that name), so processes
with different budgets never share a study, and so never a job, even when they start at the
same moment. A process claims a job by asking the study for a trial: Optuna hands each
waiting trial to exactly one process (a row lock on PostgreSQL, a write transaction on
SQLite). While the job runs, its trial sends heartbeats; when its process dies, the trial is
failed once the heartbeat is stale and queued again by Optuna's retry callback, so another
process (or a rerun) takes the job up. A process paused past its heartbeat (SIGSTOP, a
suspended machine) finds on resuming that its job was handed to another: it says so in one
line and drops its result. A finished job's outcome (accuracies, fold histories, seconds) is
a user attribute of its complete trial. The bench's budget and each row's parameters are
study attributes: a process with another budget (while the storage holds a bench) or other
parameters for a row is refused before any work.

Two processes starting at the same moment may both enqueue a missing job. The lower trial
number of a job wins: a process that claims a trial while a lower-numbered trial of the
same job is waiting, running or complete gives its trial up (it ends failed, marked
``superseded``), so each job runs to completion once.
"""

import dataclasses
import os
import socket
import sys

from .budget import MAP_AT_R, TRAINING_KEYS, digest, training_key
from .storage import close_storage, open_storage, record_heartbeat_now
from .storage_rules import DEFAULT_HEARTBEAT, DEFAULT_RETRY, Heartbeat, RetryPolicy
from .workers import WAIT, claim_trials, fail_stale_trials

STORE_FILE = "bench.db"
STUDY_PREFIX = "pml-rank bench "


def study_name(budget):
    """The name of the study holding the bench of `budget`: ``pml-rank bench <digest of its
    training key>``."""
    return STUDY_PREFIX + digest(training_key(budget))


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


class _Discarded(Exception):
    """This process's trial was failed as stale and its job handed to another process."""


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


def bench_studies(storage):
    """The benches `storage` holds (Optuna's `FrozenStudy`s), oldest first."""
    return [s for s in storage.get_all_studies() if s.study_name.startswith(STUDY_PREFIX)]


def _check_no_other_bench(storage, budget):
    """Raises `MismatchError` when `storage` holds benches and none of `budget`."""
    benches = bench_studies(storage)
    if benches and study_name(budget) not in {s.study_name for s in benches}:
        check_budget_matches(benches[0].user_attrs, budget)
        raise MismatchError(  # its budget is not recorded yet: it is being made at this moment
            f"the storage holds a bench of another budget ({benches[0].study_name}); it is never overwritten: "
            "choose another --out or --storage"
        )


def check_stored_bench(url, budget, row_params, retry=DEFAULT_RETRY):
    """Refuses (`MismatchError`) a bench the storage at `url` holds with another budget or
    other parameters, reading only (it makes no SQLite file, table or study), so it runs
    before the data set is loaded."""
    import optuna

    _quiet_optuna()
    storage = open_storage(url, retry=RetryPolicy(retry), read_only=True)
    if storage is None:
        return
    try:
        _check_no_other_bench(storage, budget)
        try:
            attrs = optuna.load_study(study_name=study_name(budget), storage=storage).user_attrs
        except KeyError:  # no bench there yet
            return
    finally:
        close_storage(storage)
    check_params_match(attrs, row_params)


def stored_status(url, retry=DEFAULT_RETRY):
    """``[(study name, {row: {"done", "running", "waiting"}})]`` of every bench the storage at
    `url` holds (normally one), reading only: [] when it holds none (it makes no SQLite
    file, table or study)."""
    import optuna

    _quiet_optuna()
    storage = open_storage(url, retry=RetryPolicy(retry), read_only=True)
    if storage is None:
        return []
    try:
        return [
            (s.study_name, _status(optuna.load_study(study_name=s.study_name, storage=storage)))
            for s in bench_studies(storage)
        ]
    finally:
        close_storage(storage)


def _job_trials(study, states=None):
    return [t for t in study.get_trials(deepcopy=False, states=states) if "job" in t.user_attrs]


def _status(study, jobs=None):
    """``{row: {"done", "running", "waiting"}}`` over the jobs (default: every job the
    study holds), each job counted once, in its most advanced state."""
    from optuna.trial import TrialState

    rank = {TrialState.COMPLETE: 3, TrialState.RUNNING: 2, TrialState.WAITING: 1}
    state_of, row_of = {}, {}
    for trial in _job_trials(study):
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


class JobStore:
    """The bench's jobs in the storage at `url` (see the module's docstring)."""

    def __init__(self, url, budget, heartbeat=DEFAULT_HEARTBEAT, retry=DEFAULT_RETRY):
        """Joins the bench of `budget` in the storage at `url`, or makes it; raises
        `MismatchError` when the storage holds a bench of another budget. A storage call
        failing on a transient error is retried for up to `retry` seconds."""
        import optuna

        _quiet_optuna()
        self.url, self.budget = url, budget
        self.storage = open_storage(url, Heartbeat(heartbeat, requeues=None), RetryPolicy(retry))
        try:
            _check_no_other_bench(self.storage, budget)
            self.study = optuna.create_study(study_name=study_name(budget), storage=self.storage, load_if_exists=True)
            if "budget" not in self.study.user_attrs:
                self.study.set_user_attr("budget", training_key(budget))
        except BaseException:
            self.close()
            raise

    def close(self):
        close_storage(self.storage)

    def record_row_params(self, row_params):
        """Records each row's parameters; raises `MismatchError` naming every row the storage
        holds with other parameters."""
        check_params_match(self.study.user_attrs, row_params)
        stored = self.study.user_attrs.get("params", {})
        if any(row not in stored for row in row_params):
            self.study.set_user_attr("params", {**stored, **row_params})

    def _trials(self, states=None):
        return _job_trials(self.study, states)

    def enqueue_missing(self, jobs):
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
        bench holds), each job counted once, in its most advanced state."""
        return _status(self.study, jobs)

    def _superseded(self, trial_number, key):
        from optuna.trial import TrialState

        live = (TrialState.WAITING, TrialState.RUNNING, TrialState.COMPLETE)
        return any(
            t.user_attrs["job"]["key"] == key and (t.state == TrialState.COMPLETE or t.number < trial_number)
            for t in self._trials(live)
            if t.number != trial_number
        )

    def work(self, run, on_job=None, poll=2.0):
        """Claims and runs jobs until none is waiting or running (waiting for other processes'
        running jobs, in case one dies and its job comes back); returns how many this process
        finished. ``run(budget, row, params, seed)`` returns a job's outcome at the store's
        budget: `runner.run` with this machine's arguments bound (`bench.run_bench`).
        ``on_job(job)`` is called when a job starts."""
        import optuna
        from optuna.trial import TrialState

        finished = []

        def run_job(trial):
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
            outcome = run(self.budget, record["row"], record["params"], record["seed"])
            trial.set_user_attr("outcome", outcome)
            finished.append(record["key"])
            return float(outcome["run"]["concatenated"][MAP_AT_R])

        def objective(trial):
            try:
                return run_job(trial)
            except optuna.exceptions.UpdateFinishedTrialError:
                # Paused past its heartbeat (SIGSTOP, a suspended machine): the trial was failed
                # as stale and its job queued again for another process.
                job = trial.user_attrs.get("job", {})
                print(
                    f"pml-rank bench: job {job.get('row')} seed {job.get('seed')} (trial {trial.number}) was "
                    "retried by another process; this result is discarded",
                    file=sys.stderr,
                    flush=True,
                )
                raise _Discarded() from None

        waited = False

        def next_trial():
            nonlocal waited
            if waited:  # a dead process's job: failed, queued again
                fail_stale_trials(self.study)
            states = [t.state for t in self._trials((TrialState.WAITING, TrialState.RUNNING))]
            if TrialState.WAITING in states:
                waited = False
                return self.study, objective  # Optuna fails stale trials itself before each trial it starts
            waited = TrialState.RUNNING in states
            return WAIT if waited else None

        # Telling the outcome of a trial failed as stale (`_Discarded`, said above) raises
        # ValueError or UpdateFinishedTrialError: its retry holds the job.
        skip = (ValueError, optuna.exceptions.UpdateFinishedTrialError)
        claim_trials(next_trial, poll, catch=(_Superseded, _NoJob, _Discarded), skip=skip)
        return len(finished)


class _QuietRecords:
    """Drops Optuna's reports of the trials this module gives up on purpose."""

    @staticmethod
    def filter(record):
        message = record.getMessage()
        quiet = ("_Superseded", "_NoJob", "_Discarded", "KeyboardInterrupt", "SurplusTrial", "failed with value None")
        # Optuna's note before its fallback query; the storage says when it is unreachable.
        quiet += ("Caught an error from sqlalchemy",)
        return not any(word in message for word in quiet)


def _quiet_optuna():
    import logging

    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    for handler in logging.getLogger("optuna").handlers:
        if not any(isinstance(f, _QuietRecords) for f in handler.filters):
            handler.addFilter(_QuietRecords())
