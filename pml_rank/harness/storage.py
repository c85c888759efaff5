"""The Optuna storage that holds `pml-rank tune`'s studies and `pml-rank bench`'s jobs: any
SQLAlchemy URL Optuna's `RDBStorage` takes (a SQLite file by default, PostgreSQL for
several machines). Running trials send heartbeats; a trial whose process died (SIGKILL,
power loss) is failed once its heartbeat has stayed older than the grace period for a grace
period, and queued again with the same parameters (Optuna's retry callback).

The storage survives what databases do: once opened, every call that fails on a transient
error (a refused, closed or shut-down connection, a locked SQLite file, a serialization
failure) is retried with backoff for up to `DEFAULT_RETRY` seconds (``--storage-retry``),
then gives up with `StorageUnavailable`, one line naming the cause. A storage that cannot
be opened at all is refused at once (`StorageError`). Imports Optuna lazily."""

import abc
import functools
import sys
import threading
import time
import warnings
from pathlib import Path

DEFAULT_HEARTBEAT = 20.0
# Seconds a storage call failing on a transient error is retried for: a PostgreSQL restart
# or failover takes seconds to a minute.
DEFAULT_RETRY = 120.0
# SQLSTATEs a retry can outlast: connection exceptions (class 08), the server shutting
# down or starting (57P01-57P03), serialization failures and deadlocks (40001, 40P01),
# too many connections (53300).
TRANSIENT_SQLSTATES = ("08", "57P01", "57P02", "57P03", "40001", "40P01", "53300")
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
        from sqlalchemy.engine import make_url

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
        from sqlalchemy import create_engine
        from sqlalchemy.engine import make_url

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


def transient_reason(error):
    """The first line of the database's message when `error` (or an error it was raised from)
    is one a retry can outlast (see the module's docstring), else None."""
    from sqlalchemy import exc

    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, exc.DBAPIError):
            driver_error = error.orig
            sqlstate = getattr(driver_error, "sqlstate", None) or getattr(driver_error, "pgcode", None)
            sqlite_name = getattr(driver_error, "sqlite_errorname", None)
            if (
                error.connection_invalidated
                or (sqlstate and sqlstate.startswith(TRANSIENT_SQLSTATES))
                or (sqlite_name and sqlite_name.startswith(("SQLITE_BUSY", "SQLITE_LOCKED")))
                # A client-side connection failure (refused, closed): no SQLSTATE.
                or (sqlstate is None and sqlite_name is None and isinstance(error, exc.OperationalError))
            ):
                lines = str(driver_error).strip().splitlines()
                return lines[0] if lines else type(driver_error).__name__
        error = error.__cause__ or error.__context__
    return None


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


class _Outage:
    """Retries calls to the storage at `url` that fail on a transient error, with backoff,
    for up to `retry` seconds each, then raises `StorageUnavailable` (and at once for every
    later call). Says in one line when the storage stops answering and when it answers
    again. Shared by the threads of a process (the heartbeat's too)."""

    FIRST_PAUSE, LONGEST_PAUSE = 0.5, 10.0

    def __init__(self, url, retry):
        self.url, self.retry = url, retry
        self.last_failure = -float("inf")  # time.monotonic() of the latest failed call
        self._lock = threading.Lock()
        self._down_since = None
        self._gave_up = None

    def failed(self, reason):
        with self._lock:
            self.last_failure = time.monotonic()
            if self._down_since is None:
                self._down_since = self.last_failure
                print(
                    f"pml-rank: storage {redact(self.url)} unreachable ({reason}); retrying for up to "
                    f"{self.retry:g} s (--storage-retry)",
                    file=sys.stderr,
                    flush=True,
                )

    def answered(self):
        with self._lock:
            if self._down_since is not None:
                print(
                    f"pml-rank: storage {redact(self.url)} reachable again after "
                    f"{time.monotonic() - self._down_since:.0f} s",
                    file=sys.stderr,
                    flush=True,
                )
                self._down_since = None

    def call(self, function, *args, **kwargs):
        deadline, pause = None, self.FIRST_PAUSE
        while True:
            if self._gave_up is not None:
                raise StorageUnavailable(self._gave_up)
            try:
                result = function(*args, **kwargs)
            except Exception as error:
                reason = transient_reason(error)
                if reason is None:
                    raise
                self.failed(reason)
                now = time.monotonic()
                deadline = deadline or now + self.retry
                if now >= deadline:
                    self._gave_up = (
                        f"storage {redact(self.url)} unreachable for {self.retry:g} s (--storage-retry): {reason}"
                    )
                    raise StorageUnavailable(self._gave_up) from None
                time.sleep(min(pause, deadline - now))
                pause = min(2 * pause, self.LONGEST_PAUSE)
                continue
            self.answered()
            return result


@functools.cache
def _retrying_storage_class():
    """`RetryingStorage`, defined on first use so that importing this module needs no Optuna."""
    import sqlalchemy.orm
    from optuna.storages import BaseStorage, _CachedStorage
    from optuna.storages._heartbeat import BaseHeartbeat
    from optuna.storages._rdb import models
    from optuna.trial import TrialState

    class RetryingStorage(BaseStorage, BaseHeartbeat):
        """Optuna's cached RDB storage `rdb` whose every call goes through `outage` (retried
        while it fails on a transient error). A heartbeat that fails is skipped (the next is
        due an interval later). A trial is failed as stale only once this process has seen it
        stale for a whole grace period, and never until a grace period has passed since this
        process last saw the storage fail: after an outage the heartbeats of the live
        processes resume within an interval, and this process may have slept through the
        outage's end in a backoff pause, or started after it. A RUNNING trial without any
        heartbeat counts as stale too (every trial records one as its work starts)."""

        def __init__(self, rdb, outage):
            self.rdb, self.outage = rdb, outage
            self._cached = _CachedStorage(rdb)
            self._stale_since = {}  # trial id -> time.monotonic() when this process first saw it stale

        def record_heartbeat(self, trial_id):
            try:
                self._cached.record_heartbeat(trial_id)
            except Exception as error:
                reason = transient_reason(error)
                if reason is None:
                    raise
                self.outage.failed(reason)
                return
            self.outage.answered()

        def _get_stale_trial_ids(self, study_id):
            grace = self.rdb.grace_period or 2 * self.rdb.heartbeat_interval
            if time.monotonic() - self.outage.last_failure < grace:
                return []
            stale = self.outage.call(self._cached._get_stale_trial_ids, study_id)
            stale += self.outage.call(self._running_without_heartbeat, study_id)
            now = time.monotonic()
            self._stale_since = {trial: self._stale_since.get(trial, now) for trial in stale}
            return [trial for trial, since in self._stale_since.items() if now - since >= grace]

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

    def delegate(name):
        def method(self, *args, **kwargs):
            return self.outage.call(getattr(self._cached, name), *args, **kwargs)

        method.__name__ = name
        return method

    for name in [*vars(BaseStorage), *vars(BaseHeartbeat)]:
        if not name.startswith("_") and name not in vars(RetryingStorage) and name != "get_failed_trial_callback":
            setattr(RetryingStorage, name, delegate(name))
    abc.update_abstractmethods(RetryingStorage)
    return RetryingStorage


def open_storage(url, heartbeat=DEFAULT_HEARTBEAT, max_retry=3, retry=DEFAULT_RETRY, read_only=False):
    """An Optuna storage on `url` with heartbeats every `heartbeat` seconds and a grace period
    of twice that; a stale trial is retried up to `max_retry` times (None: always). Opening
    it and every call on it that fail on a transient error are retried for up to `retry`
    seconds (`check_url` refuses a storage that does not answer at once). `read_only`:
    makes no SQLite file, table or study, and returns None when `url` holds no Optuna
    storage. Raises `StorageError` when the storage cannot be opened."""
    import optuna
    from optuna.storages import RDBStorage

    try:  # Optuna >= 4.9 renamed the callback and its keyword
        from optuna.storages import RetryHeartbeatStaleTrialCallback as Retry

        retry_keyword = "heartbeat_stale_trial_callback"
    except ImportError:
        from optuna.storages import RetryFailedTrialCallback as Retry

        retry_keyword = "failed_trial_callback"
    outage = _Outage(url, retry)
    if read_only:
        try:
            if not outage.call(_holds_optuna_tables, url):
                return None
        except StorageUnavailable:
            raise
        except Exception as error:
            raise _refusal(url, error) from error
    sqlite = url.startswith("sqlite")
    if sqlite:
        # Several processes on one file: wait for the lock rather than fail at once, and let
        # SQLAlchemy (not the driver) begin the transactions (`_serialize_sqlite`).
        engine_kwargs = {"connect_args": {"timeout": 120, "isolation_level": None}}
    else:  # a connection the server closed (a restart) is replaced before use
        engine_kwargs = {"pool_pre_ping": True}

    def opened():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            return RDBStorage(
                url,
                engine_kwargs=engine_kwargs,
                skip_table_creation=read_only,
                heartbeat_interval=max(1, int(heartbeat)),
                grace_period=max(2, int(2 * heartbeat)),
                **{retry_keyword: Retry(max_retry=max_retry)},
            )

    for attempt in range(CREATION_ATTEMPTS):
        try:
            rdb = outage.call(opened)
        except StorageUnavailable:
            raise
        except Exception as error:  # SQLAlchemy's: unknown dialect, missing driver, refused connection
            raced = any(words in str(error).lower() for words in CREATION_RACE)
            if raced and attempt + 1 < CREATION_ATTEMPTS:
                time.sleep(0.2 * (attempt + 1))
                continue
            raise _refusal(url, error) from error
        if sqlite:
            _serialize_sqlite(rdb.engine)
        return _retrying_storage_class()(rdb, outage)


def _holds_optuna_tables(url):
    """Whether `url` holds Optuna's tables, asked without making anything (no SQLite file)."""
    from sqlalchemy import create_engine, inspect
    from sqlalchemy.engine import make_url

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
    from sqlalchemy import event

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
