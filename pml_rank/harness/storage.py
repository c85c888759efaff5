"""The Optuna storage that holds `pml-rank tune`'s studies and `pml-rank bench`'s jobs: any
SQLAlchemy URL Optuna's `RDBStorage` takes (a SQLite file by default, PostgreSQL for
several machines). Running trials send heartbeats; a trial whose process died (SIGKILL,
power loss) is failed once its heartbeat is older than the grace period and queued again
with the same parameters (Optuna's retry callback). Imports Optuna lazily."""

import time
import warnings
from pathlib import Path

DEFAULT_HEARTBEAT = 20.0
# Processes opening a new storage at the same moment race to create its tables (Optuna
# looks for them, then creates them): the loser finds them made when it tries again.
CREATION_RACE = ("already exists", "duplicate key", "unique constraint")
CREATION_ATTEMPTS = 5


class StorageError(RuntimeError):
    """The storage cannot be opened (bad URL, missing driver, no server); the message names
    it with its password hidden."""


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


def open_storage(url, heartbeat=DEFAULT_HEARTBEAT, max_retry=3):
    """An `optuna.storages.RDBStorage` on `url` with heartbeats every `heartbeat` seconds and
    a grace period of twice that; a stale trial is retried up to `max_retry` times (None:
    always). Raises `StorageError` when the storage cannot be opened."""
    import optuna
    from optuna.storages import RDBStorage

    try:  # Optuna >= 4.9 renamed the callback and its keyword
        from optuna.storages import RetryHeartbeatStaleTrialCallback as Retry

        retry_keyword = "heartbeat_stale_trial_callback"
    except ImportError:
        from optuna.storages import RetryFailedTrialCallback as Retry

        retry_keyword = "failed_trial_callback"
    sqlite = url.startswith("sqlite")
    if sqlite:
        # Several processes on one file: wait for the lock rather than fail at once, and let
        # SQLAlchemy (not the driver) begin the transactions (`_serialize_sqlite`).
        engine_kwargs = {"connect_args": {"timeout": 120, "isolation_level": None}}
    else:
        engine_kwargs = {"pool_pre_ping": True}
    for attempt in range(CREATION_ATTEMPTS):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                storage = RDBStorage(
                    url,
                    engine_kwargs=engine_kwargs,
                    heartbeat_interval=max(1, int(heartbeat)),
                    grace_period=max(2, int(2 * heartbeat)),
                    **{retry_keyword: Retry(max_retry=max_retry)},
                )
            if sqlite:
                _serialize_sqlite(storage.engine)
            return storage
        except Exception as error:  # SQLAlchemy's: unknown dialect, missing driver, refused connection
            raced = any(words in str(error).lower() for words in CREATION_RACE)
            if raced and attempt + 1 < CREATION_ATTEMPTS:
                time.sleep(0.2 * (attempt + 1))
                continue
            raise _refusal(url, error) from error


def _serialize_sqlite(engine):
    """Every transaction on the SQLite file starts with ``BEGIN IMMEDIATE``, taking the write
    lock before its first read. Optuna claims a waiting trial by reading its state and then
    writing RUNNING, under ``SELECT ... FOR UPDATE``, which SQLite ignores: without this two
    processes can both read WAITING and run the same trial (SQLAlchemy's recipe for
    SQLite's serializable transactions)."""
    from sqlalchemy import event

    event.listen(engine, "begin", lambda connection: connection.exec_driver_sql("BEGIN IMMEDIATE"))


def close_storage(storage):
    """Releases the storage's connections (its SQLAlchemy engine's pool)."""
    engine = getattr(storage, "engine", None)
    if engine is not None:
        engine.dispose()


def record_heartbeat_now(trial):
    """Records `trial`'s first heartbeat before its work starts. Optuna's heartbeat thread may
    not have run yet, and Optuna never fails a RUNNING trial that has no heartbeat: a process
    killed before that first beat would leave its trial RUNNING for ever, and every other
    process waiting for it."""
    storage = trial.study._storage
    if getattr(storage, "get_heartbeat_interval", lambda: None)() is not None:
        storage.record_heartbeat(trial._trial_id)
