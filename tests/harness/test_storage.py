"""The shared storage survives what databases do: a PostgreSQL server stopped (``pg_ctl stop
-m fast``) and started again mid-bench, a worker paused (SIGSTOP) past its heartbeat,
`--status` on a storage that holds no bench, and two processes of different budgets
starting on one storage at the same moment."""

import gc
import importlib
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import sqlalchemy.exc
import sqlalchemy.orm
from tiny_bench import ARGUMENTS, ROW, write_locked

optuna = pytest.importorskip("optuna")

from pml_rank.harness import jobs, storage_rules  # noqa: E402
from pml_rank.harness import storage as storage_module  # noqa: E402
from pml_rank.harness.budget import MAP_AT_R, resolve  # noqa: E402

PML_RANK = Path(sys.executable).parent / "pml-rank"
DEADLINE = 600  # seconds: generous, the machine may be loaded


def bench_argv(out, url, cache, *extra):
    """The arguments of `pml-rank` for the tiny bench on the storage `url`."""
    return ["bench", *ARGUMENTS, "--storage", url, "--out", str(out), "--cache-dir", str(cache), *extra]


def bench_command(out, url, cache, *extra):
    """`bench_argv` through the installed script."""
    return [str(PML_RANK), *bench_argv(out, url, cache, *extra)]


class JobReader:
    """The job trials of the benches at a storage URL ([] before a bench has made its tables, or
    while the storage does not answer), read through one storage opened once and closed by
    `close`: a read costs milliseconds where a new connection can take seconds on a loaded
    machine. Makes nothing."""

    def __init__(self, url):
        self.url, self.storage = url, None

    def __call__(self):
        if self.storage is None:
            if self.url.startswith("sqlite:///") and not Path(self.url[len("sqlite:///") :]).is_file():
                return []
            try:
                self.storage = optuna.storages.RDBStorage(self.url, skip_table_creation=True)
            except Exception:  # the bench is still making its tables
                pass
            if self.storage is None:
                # The half-made storage's connection, closed now rather than in a later test
                # (collected here, once the exception's traceback no longer holds it).
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", ResourceWarning)
                    gc.collect()
                return []
        try:
            names = [s.study_name for s in self.storage.get_all_studies() if s.study_name.startswith("pml-rank bench")]
            return [
                t
                for name in names
                for t in optuna.load_study(study_name=name, storage=self.storage).get_trials(deepcopy=False)
                if "job" in t.user_attrs
            ]
        except Exception:
            return []

    def close(self):
        if self.storage is not None:
            self.storage.engine.dispose()
            self.storage = None


def job_trials(url):
    """The job trials at `url`, read once (`JobReader`)."""
    reader = JobReader(url)
    try:
        return reader()
    finally:
        reader.close()


def training_job(trials, pid=None):
    """The RUNNING trial of a training job among `trials` (of process `pid` if given), or None."""
    running = [
        t
        for t in trials
        if t.state.name == "RUNNING"
        and t.user_attrs["job"]["row"] == ROW
        and (pid is None or t.user_attrs.get("worker", "").endswith(f":{pid}"))
    ]
    return running[0] if running else None


def table(out):
    """bench.json without the seconds a job took (which differ from run to run)."""
    payload = json.loads((out / "bench.json").read_text())
    payload.pop("total_seconds")
    for row in payload["rows"]:
        row.pop("seconds")
    return payload


def stop_mid_job(bench, url, server, freeze_when, also=lambda trials: True):
    """Stops `server` (`pg_ctl stop -m fast`) while `bench` runs a training job (and `also` holds
    of the job trials): the bench's processes are frozen (SIGSTOP) from the moment the test sees
    that job until the server has stopped, so the outage begins mid-job however fast the bench runs."""
    reader = JobReader(url)

    def training():
        trials = reader()
        return training_job(trials) is not None and also(trials)

    try:
        freeze_when(bench, training, "a training job runs")
    finally:
        reader.close()  # before the server stops: the test holds no connection through the outage
    try:
        server.stop("fast")
    finally:
        os.killpg(bench.pid, signal.SIGCONT)


@pytest.mark.slow  # a PostgreSQL server and bench processes
def test_a_bench_outlives_a_postgresql_restart(tmp_path, glyph_cache, serial_bench, postgres_server, freeze_when):
    # Heartbeats every 2 s, stale after 4 s: the 10 s outage stops them for longer than that,
    # and no job may be failed as stale for it.
    url = postgres_server.new_database("outage")
    bench = subprocess.Popen(
        bench_command(tmp_path, url, glyph_cache, "--workers", "2", "--heartbeat", "2"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        stop_mid_job(bench, url, postgres_server, freeze_when)
        time.sleep(10)  # the outage
        assert postgres_server.start().returncode == 0
        stdout, stderr = bench.communicate(timeout=DEADLINE)
    finally:
        if bench.poll() is None:
            os.killpg(bench.pid, signal.SIGKILL)
    assert bench.returncode == 0, stdout + stderr
    assert "Traceback" not in stderr and "unreachable" in stderr and "reachable again" in stderr, stderr
    assert table(tmp_path) == table(serial_bench)
    every = job_trials(url)
    assert sorted(t.state.name for t in every) == ["COMPLETE"] * 5  # none failed as stale, none run twice


@pytest.mark.slow  # a PostgreSQL server and bench processes
def test_a_bench_gives_up_after_its_retry_time_in_one_line_and_keeps_its_finished_jobs(
    tmp_path, glyph_cache, serial_bench, postgres_server, freeze_when, run_cli
):
    url = postgres_server.new_database("gives_up")
    bench = subprocess.Popen(
        bench_command(tmp_path, url, glyph_cache, "--workers", "2", "--storage-retry", "5", "--heartbeat", "2"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        stop_mid_job(
            bench,
            url,
            postgres_server,
            freeze_when,
            also=lambda trials: any(t.state.name == "COMPLETE" for t in trials),
        )
        stdout, stderr = bench.communicate(timeout=DEADLINE)
    finally:
        if bench.poll() is None:
            os.killpg(bench.pid, signal.SIGKILL)
    assert bench.returncode == 1, stdout + stderr
    assert "Traceback" not in stderr, stderr
    (gave_up,) = [line for line in stderr.splitlines() if "unreachable for" in line]
    assert "unreachable for 5 s (--storage-retry)" in gave_up and "finished jobs are kept" in gave_up
    assert "secret-password" not in stdout + stderr
    assert postgres_server.start().returncode == 0
    kept = [t for t in job_trials(url) if t.state.name == "COMPLETE"]
    assert kept
    # Through `cli.main` in this process: its own start of Python and torch is not the point. Short
    # heartbeats: the jobs the first bench left RUNNING are retried once seen stale for 4 s.
    status, printed, err = run_cli(bench_argv(tmp_path, url, glyph_cache, "--workers", "1", "--heartbeat", "2"))
    assert status == 0, printed + err
    assert f"resumed: {len(kept)} finished job(s)" in printed
    assert table(tmp_path) == table(serial_bench)


@pytest.mark.slow  # bench processes
def test_a_paused_worker_whose_job_was_retried_drops_its_result_in_one_line(
    tmp_path, glyph_cache, serial_bench, freeze_when, run_cli
):
    path = tmp_path / "shared.db"
    url = f"sqlite:///{path}"
    paused = subprocess.Popen(
        bench_command(tmp_path / "a", url, glyph_cache, "--workers", "1", "--heartbeat", "1"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    reader = JobReader(url)
    try:

        def training_outside_a_transaction():  # the other process will need the write lock
            held = training_job(reader(), paused.pid)
            return held if held is not None and not write_locked(path) else None

        held = freeze_when(paused, training_outside_a_transaction, "the first process trains")
        reader.close()
        # The other process is this one, through `cli.main`: a start of Python and torch fewer.
        status, printed, err = run_cli(
            bench_argv(tmp_path / "b", url, glyph_cache, "--workers", "1", "--heartbeat", "1")
        )
        assert status == 0, printed + err
        os.killpg(paused.pid, signal.SIGCONT)
        stdout, stderr = paused.communicate(timeout=DEADLINE)
    finally:
        reader.close()
        if paused.poll() is None:
            os.killpg(paused.pid, signal.SIGKILL)
            os.killpg(paused.pid, signal.SIGCONT)
    assert paused.returncode == 0, stdout + stderr
    job = held.user_attrs["job"]
    line = (
        f"pml-rank bench: job {job['row']} seed {job['seed']} (trial {held.number}) was retried by another "
        "process; this result is discarded"
    )
    assert stderr.count("retried by another process") == 1 and line in stderr, stderr
    assert "Traceback" not in stderr and "UpdateFinishedTrialError" not in stderr, stderr
    assert table(tmp_path / "a") == table(tmp_path / "b") == table(serial_bench)
    attempts = sorted(t.state.name for t in job_trials(url) if t.user_attrs["job"]["key"] == job["key"])
    assert attempts == ["COMPLETE", "FAIL"]


def status(out, *storage):
    command = [str(PML_RANK), "bench", "--status", *storage, "--out", str(out)]
    return subprocess.run(command, capture_output=True, text=True, timeout=DEADLINE)


@pytest.mark.slow  # a PostgreSQL server and a pml-rank process
def test_status_on_an_empty_postgresql_database_creates_nothing(tmp_path, postgres_url):
    from sqlalchemy import create_engine, inspect, text

    admin = create_engine(postgres_url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as connection:
            connection.execute(text("CREATE DATABASE status_empty"))
    finally:
        admin.dispose()
    url = postgres_url.rsplit("/", 1)[0] + "/status_empty"
    result = status(tmp_path / "out", "--storage", url)
    assert result.returncode == 1 and "no bench in this storage" in result.stderr, result.stdout + result.stderr
    assert "Traceback" not in result.stderr and "secret-password" not in result.stderr
    engine = create_engine(url)
    try:
        assert inspect(engine).get_table_names() == []
    finally:
        engine.dispose()
    assert not (tmp_path / "out").exists()


@pytest.mark.slow  # pml-rank processes
def test_status_on_a_sqlite_file_that_does_not_exist_creates_nothing(tmp_path):
    result = status(tmp_path / "out", "--storage", f"sqlite:///{tmp_path / 'typo.db'}")
    assert result.returncode == 1 and "no bench in this storage" in result.stderr, result.stdout + result.stderr
    assert list(tmp_path.iterdir()) == []
    result = status(tmp_path / "out")  # the storage in --out, a folder that does not exist
    assert result.returncode == 1 and "no bench in this storage" in result.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow  # a Python process
def test_status_imports_no_torch(tmp_path):
    """--status only reads the storage: torch (seconds to import) is not loaded."""
    url = f"sqlite:///{tmp_path / 'bench.db'}"
    budget = resolve("glyphs", num_classes=24, epochs=1, iterations_per_epoch=1, batch_size=16)
    store = jobs.JobStore(url, budget)
    store.enqueue_missing([jobs.Job(ROW, 0), jobs.Job(ROW, 1)])
    store.close()
    probe = (
        "import sys\n"
        "from pml_rank import cli\n"
        "code = cli.main(['bench', '--status', '--storage', sys.argv[1]])\n"
        "print('torch' in sys.modules)\n"
        "sys.exit(code)\n"
    )
    result = subprocess.run([sys.executable, "-c", probe, url], capture_output=True, text=True, timeout=DEADLINE)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert lines[-1] == "False"
    assert lines[2].split() == [ROW, "0", "0", "2"] and lines[3].split() == ["all", "0", "0", "2"]


def _race(url, epochs, barrier, results, rounds):
    """One of two racing processes: for each round's new storage, waits at the barrier, joins
    or makes the bench of its budget (`epochs`) and works its jobs with a stand-in training
    that records the epochs it ran with. The worst timing is forced: neither records its
    budget before both have read the storage (or one was refused)."""
    import optuna

    from pml_rank.harness import jobs

    def run(budget, row, params, seed):
        return {"run": {"concatenated": {MAP_AT_R: 0.5}}, "seconds": 0.0, "epochs": budget["epochs"]}

    record = optuna.study.Study.set_user_attr

    def set_user_attr(study, key, value):
        if key == "budget":
            barrier.wait()
        record(study, key, value)

    optuna.study.Study.set_user_attr = set_user_attr
    budget = resolve("glyphs", num_classes=24, epochs=epochs, iterations_per_epoch=1, batch_size=16)
    for k in range(rounds):
        barrier.wait()
        try:
            store = jobs.JobStore(f"{url}{k}", budget)
        except jobs.MismatchError:
            barrier.wait()  # where the other process records its budget
            results.put((k, epochs, "refused"))
            continue
        try:
            store.enqueue_missing([jobs.Job(ROW, seed) for seed in range(4)])
            store.work(run, poll=0.05)
            results.put((k, epochs, sorted(o["epochs"] for o in store.outcomes().values())))
        finally:
            store.close()


@pytest.mark.slow  # two processes
def test_two_budgets_starting_at_the_same_moment_never_share_a_job(tmp_path):
    rounds = 3
    url = f"sqlite:///{tmp_path / 'race.db'}"  # race.db0 to race.db2
    context = multiprocessing.get_context("spawn")
    barrier, results = context.Barrier(2), context.Queue()
    processes = [context.Process(target=_race, args=(url, epochs, barrier, results, rounds)) for epochs in (1, 2)]
    for process in processes:
        process.start()
    found = [results.get(timeout=DEADLINE) for _ in range(2 * rounds)]
    for process in processes:
        process.join(timeout=DEADLINE)
    assert [p.exitcode for p in processes] == [0, 0]
    for k, epochs, outcome in found:
        # Refused (the other's bench was there first), or its own four jobs, trained with its own budget.
        assert outcome == "refused" or outcome == [epochs] * 4, (k, epochs, outcome)
    for k in range(rounds):
        assert [o for r, _, o in found if r == k].count("refused") <= 1


class Clock:
    """A simulated `time` for the storage's modules: `sleep` moves `monotonic` on at once."""

    def __init__(self, now=1000.0, end=100_000.0):
        self.now, self.end, self.slept = now, end, []

    def monotonic(self):
        return self.now

    def sleep(self, seconds):
        assert self.now + seconds < self.end, f"still retrying {self.now - 1000:.0f} simulated seconds on"
        self.slept.append(seconds)
        self.now += seconds


def failing(*codes, then="answered"):
    """A storage call that fails once on each SQLite error `codes` (``SQLITE_LOCKED``, ...), then
    returns `then`; ``calls`` counts its calls."""
    import sqlite3

    from sqlalchemy import exc

    def call():
        call.calls += 1
        if call.calls <= len(codes):
            driver_error = sqlite3.OperationalError(f"{codes[call.calls - 1]} from the test")
            driver_error.sqlite_errorname = codes[call.calls - 1]
            raise exc.OperationalError("SELECT 1", {}, driver_error)
        return then

    call.calls = 0
    return call


def test_sqlites_busy_and_locked_are_retried_other_errors_raised_at_once(monkeypatch, capsys):
    monkeypatch.setattr(storage_module, "time", Clock())
    storage = storage_module.RetryingRDBStorage("sqlite:///unused.db")
    call = failing("SQLITE_BUSY", "SQLITE_LOCKED", "SQLITE_LOCKED_SHAREDCACHE")
    assert storage.call(call) == "answered" and call.calls == 4
    assert "unreachable (SQLITE_BUSY from the test)" in capsys.readouterr().err
    constraint = failing("SQLITE_CONSTRAINT_UNIQUE")
    with pytest.raises(sqlalchemy.exc.OperationalError):
        storage.call(constraint)
    assert constraint.calls == 1


def test_a_call_is_retried_with_backoff_until_its_first_failures_deadline_then_never_again(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(storage_module, "time", clock)
    storage = storage_module.RetryingRDBStorage("sqlite:///unused.db", retry=storage_rules.RetryPolicy(seconds=10))
    always = failing(*["SQLITE_BUSY"] * 100)
    with pytest.raises(storage_module.StorageUnavailable, match=r"unreachable for 10 s \(--storage-retry\)"):
        storage.call(always)
    assert clock.slept == [0.5, 1, 2, 4, 2.5] and clock.now == 1010  # 10 s after the first failure
    with pytest.raises(storage_module.StorageUnavailable):  # given up: no call reaches the database
        storage.call(always)
    assert always.calls == 6


def test_a_trial_is_failed_as_stale_only_once_seen_stale_for_a_grace_period(monkeypatch):
    """After an outage this process did not see end (it slept through it in a backoff pause, or
    started after it), every live trial's heartbeat is old for an interval: a trial seen stale
    once is not failed; one still stale a grace period later is."""
    clock = Clock()
    monkeypatch.setattr(storage_rules, "time", clock)
    rule = storage_rules.StaleTrials(storage_rules.Heartbeat(interval=1))  # grace 2 s
    stale_now = {7, 8}

    def to_fail(last_failure=-float("inf")):
        return rule.to_fail(lambda: sorted(stale_now), last_failure)

    assert to_fail() == []  # first seen stale: not failed
    clock.now += 1.0
    stale_now.discard(8)  # its process sent a heartbeat: alive
    assert to_fail() == []
    clock.now += 1.0
    stale_now.add(8)  # stale again: its grace period starts over
    assert to_fail() == [7]
    clock.now += 2.0
    assert to_fail() == [7, 8]
    assert to_fail(last_failure=clock.now - 1.0) == []  # the storage failed a second ago: nothing is stale


def test_optuna_still_has_every_private_name_the_storage_relies_on():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        trial = optuna.create_study().ask()
    sqlalchemy.orm.configure_mappers()  # the relationships' back references, as a first query sets them
    missing = []
    for name, reason in storage_module.OPTUNA_PRIVATE_NAMES.items():
        root, *path = name.split(".")
        found = {"optuna": optuna, "trial": trial}[root]
        for i, part in enumerate(path):
            try:
                found = getattr(found, part)
            except AttributeError:
                try:  # a module Optuna does not import by itself
                    found = importlib.import_module(".".join([root, *path[: i + 1]]))
                except ImportError:
                    missing.append(f"Optuna {optuna.__version__} has no {name} ({reason})")
                    break
    assert not missing, "\n".join(missing)


@pytest.mark.filterwarnings("ignore:Heartbeat of storage", "ignore::optuna.exceptions.ExperimentalWarning")
def test_a_running_trial_that_never_sent_a_heartbeat_is_failed_once_seen_so_for_a_grace_period(tmp_path, monkeypatch):
    """A process that died between creating its trial and its first heartbeat (killed, or its
    storage lost) leaves a RUNNING trial Optuna never fails: the bench waited for it for ever."""
    clock = Clock()
    monkeypatch.setattr(storage_rules, "time", clock)
    storage = storage_module.open_storage(f"sqlite:///{tmp_path / 's.db'}", storage_rules.Heartbeat(1))  # grace 2 s
    try:
        study = optuna.create_study(storage=storage, study_name="no heartbeat")
        orphan = study.ask()  # RUNNING, no heartbeat
        optuna.storages.fail_stale_trials(study)
        assert study.trials[0].state.name == "RUNNING"  # seen once: not failed yet
        clock.now += 2.0
        optuna.storages.fail_stale_trials(study)
        assert study.trials[0].state.name == "FAIL" and study.trials[0].number == orphan.number
    finally:
        storage_module.close_storage(storage)
