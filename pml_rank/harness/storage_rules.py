"""The rules the shared storage (`storage.py`) keeps through what databases and processes do,
as small objects that import no Optuna (the command line shows their defaults):

- `RetryPolicy`: which errors a storage call is retried on, for how long, with what backoff;
- `Heartbeat`: how often a running trial records a heartbeat, and `StaleTrials`, the rule
  that decides when a silent trial's process is taken for dead and its trial failed.
"""

import dataclasses
import time

# Seconds between a running trial's heartbeats.
DEFAULT_HEARTBEAT = 20.0
# Seconds a storage call failing on a transient error is retried for: a PostgreSQL restart
# or failover takes seconds to a minute.
DEFAULT_RETRY = 120.0


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
    """Which errors a storage call is retried on, for how long, with what backoff.

    A call that fails on a transient error (`transient_reason`) is called again after a
    pause of `first_pause` seconds, doubled after each failure up to `longest_pause`, until
    `seconds` have passed since its first failure (a deadline set then, which later failures
    do not move); then the storage gives up. Transient: a connection that is refused, closed
    or invalidated (no SQLSTATE), the SQLSTATEs of `sqlstates` (prefixes) and SQLite's
    `sqlite_errors` (its file busy or its table locked by another connection)."""

    seconds: float = DEFAULT_RETRY
    first_pause: float = 0.5
    longest_pause: float = 10.0
    # Connection exceptions (class 08), the server shutting down or starting (57P01-57P03),
    # serialization failures and deadlocks (40001, 40P01), too many connections (53300).
    sqlstates: tuple = ("08", "57P01", "57P02", "57P03", "40001", "40P01", "53300")
    sqlite_errors: tuple = ("SQLITE_BUSY", "SQLITE_LOCKED")

    def transient_reason(self, error):
        """The first line of the database's message when `error` (or an error it was raised
        from) is one a retry can outlast, else None."""
        from sqlalchemy import exc

        seen = set()
        while error is not None and id(error) not in seen:
            seen.add(id(error))
            if isinstance(error, exc.DBAPIError) and self._transient(error):
                lines = str(error.orig).strip().splitlines()
                return lines[0] if lines else type(error.orig).__name__
            error = error.__cause__ or error.__context__
        return None

    def _transient(self, error):
        from sqlalchemy import exc

        sqlstate = getattr(error.orig, "sqlstate", None) or getattr(error.orig, "pgcode", None)
        sqlite_name = getattr(error.orig, "sqlite_errorname", None)
        return (
            error.connection_invalidated
            or (sqlstate is not None and sqlstate.startswith(self.sqlstates))
            or (sqlite_name is not None and sqlite_name.startswith(self.sqlite_errors))
            # A client-side connection failure (refused, closed): no SQLSTATE.
            or (sqlstate is None and sqlite_name is None and isinstance(error, exc.OperationalError))
        )

    def pause(self, failures):
        """Seconds to wait after the call's `failures`-th failure in a row (1, 2, ...)."""
        return min(self.first_pause * 2 ** (failures - 1), self.longest_pause)


@dataclasses.dataclass(frozen=True)
class Heartbeat:
    """A running trial records a heartbeat every `interval` seconds (Optuna takes whole
    seconds: `seconds`); a trial whose heartbeat is older than `grace` seconds (twice the
    interval) is stale, failed as its process's death by `StaleTrials`' rule, and queued
    again with the same parameters up to `requeues` times (None: always)."""

    interval: float = DEFAULT_HEARTBEAT
    requeues: int | None = 3

    @property
    def seconds(self):
        return max(1, int(self.interval))

    @property
    def grace(self):
        return max(2, int(2 * self.interval))


class StaleTrials:
    """The stale-trial rule of one process: a trial is failed as stale only once this process
    has seen it stale for a whole grace period, and never until a grace period has passed
    since this process last saw the storage fail. After an outage the heartbeats of the live
    processes resume within an interval, and this process may have slept through the
    outage's end in a backoff pause, or started after it."""

    def __init__(self, heartbeat):
        self.grace = heartbeat.grace
        self._since = {}  # trial id -> time.monotonic() when this process first saw it stale

    def to_fail(self, find_stale, last_failure):
        """The ids of the trials to fail as stale: of those ``find_stale()`` returns (stale
        now), asked only when the storage's last failure this process saw (its
        time.monotonic(), `last_failure`) is a grace period old."""
        if time.monotonic() - last_failure < self.grace:
            return []
        stale = find_stale()
        now = time.monotonic()
        self._since = {trial: self._since.get(trial, now) for trial in stale}
        return [trial for trial, since in self._since.items() if now - since >= self.grace]
