"""The Optuna storage that holds `pml-rank tune`'s studies and `pml-rank bench`'s jobs: any
SQLAlchemy URL Optuna's `RDBStorage` takes (a SQLite file by default, PostgreSQL for
several machines), opened by `open_storage` as a `RetryingRDBStorage`.

Running trials send heartbeats; a trial whose process died (SIGKILL, power loss) is failed
by the stale-trial rule (`storage_rules.Heartbeat`, `StaleTrials`) and queued again with the
same parameters (Optuna's retry callback). Every call that fails on a transient error is
retried as `storage_rules.RetryPolicy` says (``--storage-retry``), then gives up with
`StorageUnavailable`, one line naming the cause. A storage that cannot be opened at all is
refused at once (`StorageError`).

Optuna's storages are wrapped as Optuna wraps them (`optuna.storages._CachedStorage`), which
takes some of its private names: `OPTUNA_PRIVATE_NAMES` lists each with the reason, and a
test names any that an Optuna upgrade removes."""

import abc
import sys
import threading
import time
import warnings
from pathlib import Path

import optuna
import sqlalchemy.orm
from optuna.storages import BaseStorage, RDBStorage, _CachedStorage

# Optuna 4.9 named the stale-trial callback and its keyword so (pyproject asks for >= 4.9:
# before it, `get_failed_trial_callback` is abstract and no storage of this class can be made).
from optuna.storages import RetryHeartbeatStaleTrialCallback as RetryCallback
from optuna.storages._heartbeat import BaseHeartbeat
from optuna.storages._rdb import models
from optuna.trial import TrialState
from sqlalchemy import create_engine, event, inspect
from sqlalchemy.engine import make_url

from .storage_rules import Heartbeat, RetryPolicy, StaleTrials

RETRY_CALLBACK_KEYWORD = "heartbeat_stale_trial_callback"

# Optuna's private names this module relies on, each for one reason. Read from `optuna` (or
# from ``trial``, a trial Optuna asked for); `test_storage` checks every one exists.
OPTUNA_PRIVATE_NAMES = {
    "optuna.storages._CachedStorage": "Optuna's cache in front of an RDB storage (optuna.get_storage "
    "wraps every one in it); the retrying storage wraps it the same way",
    "optuna.storages._heartbeat.BaseHeartbeat": "Optuna records heartbeats and fails stale trials only "
    "for storages of this class",
    "optuna.storages._heartbeat.BaseHeartbeat._get_stale_trial_ids": "what optuna.storages.fail_stale_trials "
    "asks a storage: the stale-trial rule answers it",
    "optuna.storages._rdb.models.TrialModel.heartbeats": "the RUNNING trials that never sent a heartbeat, "
    "which Optuna never fails",
    "trial.study._storage": "the storage of a trial, to record its first heartbeat before its work starts",
    "trial._trial_id": "that trial's id in the storage",
}
# Processes opening a new storage at the same moment race to create its tables (Optuna
# looks for them, then creates them): the loser finds them made when it tries again.
CREATION_RACE = ("already exists", "duplicate key", "unique constraint")
CREATION_ATTEMPTS = 5


class StorageError(RuntimeError):
    """The storage cannot be opened (bad URL, missing driver, no server); the message names
    it with its password hidden."""


class StorageUnavailable(RuntimeError):
    """The opened storage stayed unreachable for longer than its retry allowance; the message
    is one line naming it (password hidden) and the cause."""


def default_url(out, file_name):
    return f"sqlite:///{Path(out).resolve() / file_name}"


def redact(url):
    """The storage URL without its password."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:
        return "<storage URL>"


def _refusal(url, error):
    reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return StorageError(f"cannot open {redact(url)}: {reason}")


def check_url(url):
    """Refuses (`StorageError`) a URL SQLAlchemy cannot parse, whose driver is missing or
    whose server does not answer, without creating anything (a SQLite file is not made)."""
    try:
        parsed = make_url(url)
        parsed.get_dialect()
        if parsed.get_backend_name() != "sqlite":
            engine = create_engine(parsed)
            try:
                engine.connect().close()
            finally:
                engine.dispose()
    except Exception as error:
        raise _refusal(url, error) from error


def unavailable_in(error):
    """The `StorageUnavailable` that `error` is or was raised while handling (Optuna may raise
    another error on its way out), or None."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, StorageUnavailable):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


class RetryingRDBStorage(BaseStorage, BaseHeartbeat):
    """Optuna's cached RDB storage on `url` whose every call is retried while it fails on a
    transient error (`retry`, a `RetryPolicy`), with heartbeats and the stale-trial rule of
    `heartbeat` (a `Heartbeat`). Says in one line when the storage stops answering and when it
    answers again; once it gave up, every later call raises `StorageUnavailable` at once. A
    heartbeat that fails is skipped (the next is due an interval later). Shared by the
    threads of a process (the heartbeat's too). `open` makes the Optuna storage."""

    def __init__(self, url, heartbeat=Heartbeat(), retry=RetryPolicy()):
        self.url, self.heartbeat, self.retry = url, heartbeat, retry
        self.rdb = self._cached = None
        self.last_failure = -float("inf")  # time.monotonic() of the latest failed call
        self.stale_trials = StaleTrials(heartbeat)
        self._lock = threading.Lock()
        self._down_since = self._gave_up = None

    def open(self, read_only=False):
        """Makes Optuna's `RDBStorage` (with its tables and a study, unless `read_only`)."""
        sqlite = self.url.startswith("sqlite")
        if sqlite:
            # Several processes on one file: wait for the lock rather than fail at once, and let
            # SQLAlchemy (not the driver) begin the transactions (`_serialize_sqlite`).
            engine_kwargs = {"connect_args": {"timeout": 120, "isolation_level": None}}
        else:  # a connection the server closed (a restart) is replaced before use
            engine_kwargs = {"pool_pre_ping": True}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            self.rdb = self.call(
                RDBStorage,
                self.url,
                engine_kwargs=engine_kwargs,
                skip_table_creation=read_only,
                heartbeat_interval=self.heartbeat.seconds,
                grace_period=self.heartbeat.grace,
                **{RETRY_CALLBACK_KEYWORD: RetryCallback(max_retry=self.heartbeat.requeues)},
            )
        if sqlite:
            _serialize_sqlite(self.rdb.engine)
        self._cached = _CachedStorage(self.rdb)

    def call(self, function, *args, **kwargs):
        """``function(*args, **kwargs)``, called again while it fails on a transient error, as
        the retry policy says; raises `StorageUnavailable` once its time is up."""
        deadline, failures = None, 0
        while True:
            if self._gave_up is not None:
                raise StorageUnavailable(self._gave_up)
            try:
                result = function(*args, **kwargs)
            except Exception as error:
                reason = self.retry.transient_reason(error)
                if reason is None:
                    raise
                self._failed(reason)
                now, failures = time.monotonic(), failures + 1
                deadline = deadline or now + self.retry.seconds
                if now >= deadline:
                    self._gave_up = (
                        f"storage {redact(self.url)} unreachable for {self.retry.seconds:g} s (--storage-retry): "
                        f"{reason}"
                    )
                    raise StorageUnavailable(self._gave_up) from None
                time.sleep(min(self.retry.pause(failures), deadline - now))
                continue
            self._answered()
            return result

    def _failed(self, reason):
        with self._lock:
            self.last_failure = time.monotonic()
            if self._down_since is None:
                self._down_since = self.last_failure
                print(
                    f"pml-rank: storage {redact(self.url)} unreachable ({reason}); retrying for up to "
                    f"{self.retry.seconds:g} s (--storage-retry)",
                    file=sys.stderr,
                    flush=True,
                )

    def _answered(self):
        with self._lock:
            if self._down_since is not None:
                print(
                    f"pml-rank: storage {redact(self.url)} reachable again after "
                    f"{time.monotonic() - self._down_since:.0f} s",
                    file=sys.stderr,
                    flush=True,
                )
                self._down_since = None

    # BaseHeartbeat: the heartbeat and the stale-trial rule.

    def record_heartbeat(self, trial_id):
        try:
            self._cached.record_heartbeat(trial_id)
        except Exception as error:
            reason = self.retry.transient_reason(error)
            if reason is None:
                raise
            self._failed(reason)
            return
        self._answered()

    def _get_stale_trial_ids(self, study_id):
        def stale_now():
            """Optuna's stale trials, and the RUNNING ones without any heartbeat (every trial
            records one as its work starts: `record_heartbeat_now`)."""
            return self.call(self._cached._get_stale_trial_ids, study_id) + self.call(
                self._running_without_heartbeat, study_id
            )

        return self.stale_trials.to_fail(stale_now, self.last_failure)

    def _running_without_heartbeat(self, study_id):
        """The study's RUNNING trials without a heartbeat, which Optuna never fails: left by a
        process that died between creating its trial and its first heartbeat."""
        with sqlalchemy.orm.Session(self.rdb.engine) as session:
            trials = (
                session.query(models.TrialModel)
                .options(sqlalchemy.orm.selectinload(models.TrialModel.heartbeats))
                .filter(models.TrialModel.state == TrialState.RUNNING, models.TrialModel.study_id == study_id)
                .all()
            )
            return [trial.trial_id for trial in trials if not trial.heartbeats]


def _retried(name):
    """The method `name` of the cached storage, through `RetryingRDBStorage.call`."""

    def method(self, *args, **kwargs):
        return self.call(getattr(self._cached, name), *args, **kwargs)

    method.__name__ = method.__qualname__ = name
    return method


# Every other public method of Optuna's storage and heartbeat interfaces, retried (read from
# Optuna's classes, so that a method Optuna adds is retried too; the deprecated alias of the
# stale-trial callback's getter is left to BaseHeartbeat).
for _name in [*vars(BaseStorage), *vars(BaseHeartbeat)]:
    if not _name.startswith("_") and _name not in vars(RetryingRDBStorage) and _name != "get_failed_trial_callback":
        setattr(RetryingRDBStorage, _name, _retried(_name))
del _name
abc.update_abstractmethods(RetryingRDBStorage)


def open_storage(url, heartbeat=Heartbeat(), retry=RetryPolicy(), read_only=False):
    """A `RetryingRDBStorage` on `url` with `heartbeat` (a `Heartbeat`) and `retry` (a
    `RetryPolicy`), which also governs its opening (`check_url` refuses a storage that does
    not answer at once). `read_only`: makes no SQLite file, table or study, and returns None
    when `url` holds no Optuna storage. Raises `StorageError` when the storage cannot be
    opened."""
    storage = RetryingRDBStorage(url, heartbeat, retry)
    for attempt in range(CREATION_ATTEMPTS):
        try:
            if read_only and not storage.call(_holds_optuna_tables, url):
                return None
            storage.open(read_only)
            return storage
        except StorageUnavailable:
            raise
        except Exception as error:  # SQLAlchemy's: unknown dialect, missing driver, refused connection
            raced = any(words in str(error).lower() for words in CREATION_RACE)
            if raced and attempt + 1 < CREATION_ATTEMPTS:
                time.sleep(0.2 * (attempt + 1))
                continue
            raise _refusal(url, error) from error


def _holds_optuna_tables(url):
    """Whether `url` holds Optuna's tables, asked without making anything (no SQLite file)."""
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite" and not (parsed.database and Path(parsed.database).is_file()):
        return False
    engine = create_engine(parsed)
    try:
        return inspect(engine).has_table("studies")
    finally:
        engine.dispose()


def _serialize_sqlite(engine):
    """Every transaction on the SQLite file starts with ``BEGIN IMMEDIATE``, taking the write
    lock before its first read. Optuna claims a waiting trial by reading its state and then
    writing RUNNING, under ``SELECT ... FOR UPDATE``, which SQLite ignores: without this two
    processes can both read WAITING and run the same trial (SQLAlchemy's recipe for
    SQLite's serializable transactions)."""
    event.listen(engine, "begin", lambda connection: connection.exec_driver_sql("BEGIN IMMEDIATE"))


def close_storage(storage):
    """Releases the connections of a storage `open_storage` gave (its SQLAlchemy engine's pool)."""
    if storage is not None:
        storage.rdb.engine.dispose()


def record_heartbeat_now(trial):
    """Records `trial`'s first heartbeat before its work starts. Optuna's heartbeat thread may
    not have run yet, and Optuna never fails a RUNNING trial that has no heartbeat: a process
    killed before that first beat would leave its trial RUNNING for ever, and every other
    process waiting for it."""
    storage = trial.study._storage
    if getattr(storage, "get_heartbeat_interval", lambda: None)() is not None:
        storage.record_heartbeat(trial._trial_id)
