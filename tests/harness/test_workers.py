"""Processes sharing one storage. `pml-rank bench` through the console script: several processes on
one SQLite file or one PostgreSQL server share the jobs of one bench, a process killed with
SIGKILL mid-job loses only that job, a rerun does no work, every job is in the storage once,
and the outputs equal a serial run's. Ctrl-C in a claim loop
(`workers.InterruptsBetweenTrials`): raised inside the objective, held back while Optuna creates or
records a trial, so no trial is left RUNNING."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_bench import ARGUMENTS, BUDGET, ROW, write_locked

optuna = pytest.importorskip("optuna")

from pml_rank.harness import jobs  # noqa: E402
from pml_rank.harness.budget import MAP_AT_R  # noqa: E402
from pml_rank.harness.storage import close_storage, open_storage  # noqa: E402
from pml_rank.harness.workers import WAIT, InterruptsBetweenTrials, claim_trials, run_processes  # noqa: E402

PML_RANK = Path(sys.executable).parent / "pml-rank"


def bench_argv(out, url, cache, *extra):
    """The arguments of `pml-rank` for the tiny bench on the storage `url`, one worker."""
    return ["bench", *ARGUMENTS, "--workers", "1", "--heartbeat", "1", "--storage", url, "--out", str(out),
            "--cache-dir", str(cache), *extra]  # fmt: skip


def bench_command(out, url, cache, *extra):
    """`bench_argv` through the installed script."""
    return [str(PML_RANK), *bench_argv(out, url, cache, *extra)]


def run(command, timeout=600):
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def trials(storage):
    """The bench's job trials in `storage` (an open storage)."""
    study = optuna.load_study(study_name=jobs.study_name(BUDGET), storage=storage)
    return [t for t in study.get_trials(deepcopy=False) if "job" in t.user_attrs]


def without_timings(folder):
    """bench.json and bench.csv without the seconds a job took (which differ from run to run)."""
    payload = json.loads((folder / "bench.json").read_text())
    payload.pop("total_seconds")
    for row in payload["rows"]:
        row.pop("seconds")
    csv = [
        ",".join(line.split(",")[:5] + line.split(",")[6:]) for line in (folder / "bench.csv").read_text().splitlines()
    ]
    return payload, csv


def running_training_job(storage, pid):
    """The key of the training job process `pid` is running according to `storage`, or None."""
    try:
        running = [t for t in trials(storage) if t.state.name == "RUNNING" and "worker" in t.user_attrs]
    except KeyError:  # no study yet
        return None
    mine = [t for t in running if t.user_attrs["worker"].endswith(f":{pid}")]
    return mine[0].user_attrs["job"]["key"] if mine and mine[0].user_attrs["job"]["row"] == ROW else None


def freeze_mid_job(process, url, freeze_when):
    """Freezes `process` (SIGSTOP) while it runs a training job (`freeze_when`), on SQLite outside
    a write transaction; returns that job's key."""
    path = url[len("sqlite:///") :] if url.startswith("sqlite:///") else None
    storage = open_storage(url)  # one connection: a read costs milliseconds, a job about a second

    def training_outside_a_transaction():
        # The lock first: frozen holding it, the process would keep out this test's reads too
        # (they waited for the storage's whole retry time, then failed, on a loaded machine).
        if path is not None and write_locked(path):
            return None
        return running_training_job(storage, process.pid)

    try:
        return freeze_when(process, training_outside_a_transaction, "a training job runs")
    finally:
        close_storage(storage)


def kill_mid_job_then_finish(tmp_path, url, cache, freeze_when):
    """Starts a bench process on `url`, freezes it mid-job, starts a second one, kills the first
    with SIGKILL, lets the second finish, then reruns; returns (second's output, rerun's output,
    killed job)."""
    first = subprocess.Popen(
        bench_command(tmp_path / "a", url, cache), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,
    )  # fmt: skip
    try:
        killed = freeze_mid_job(first, url, freeze_when)
        second = subprocess.Popen(
            bench_command(tmp_path / "b", url, cache), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    out, err = second.communicate(timeout=900)
    assert second.returncode == 0, out + err
    # A process of its own: its PNG must be the second's, bit for bit (`check_shared_run`).
    rerun = run(bench_command(tmp_path / "c", url, cache))
    return out, rerun.stdout, killed


def check_shared_run(tmp_path, url, serial_bench):
    storage = open_storage(url)
    try:
        every = trials(storage)
    finally:
        close_storage(storage)  # not left to the garbage collector (a ResourceWarning in a later test)
    complete = [t for t in every if t.state.name == "COMPLETE"]
    keys = [t.user_attrs["job"]["key"] for t in complete]
    assert len(keys) == len(set(keys)) == 1 + 2 + 2  # raw input, untrained x 2, the row x 2 seeds: once each
    assert not [t for t in every if t.state.name in ("RUNNING", "WAITING")]
    for folder in ("b", "c"):
        assert without_timings(tmp_path / folder) == without_timings(serial_bench)
    # Rebuilt from the same storage, the PNG is the same file, bit for bit.
    assert (tmp_path / "b" / "bench.png").read_bytes() == (tmp_path / "c" / "bench.png").read_bytes()
    return every


@pytest.mark.slow
def test_two_processes_on_sqlite_one_killed_mid_job(tmp_path, glyph_cache, serial_bench, freeze_when):
    url = f"sqlite:///{tmp_path / 'shared.db'}"
    _, rerun, killed = kill_mid_job_then_finish(tmp_path, url, glyph_cache, freeze_when)
    every = check_shared_run(tmp_path, url, serial_bench)
    assert "resumed: 5 finished job(s)" in rerun
    # The killed job failed when its heartbeat went stale and ran again, to completion, once.
    attempts = [t for t in every if t.user_attrs["job"]["key"] == killed]
    assert sorted(t.state.name for t in attempts) == ["COMPLETE", "FAIL"]


@pytest.mark.slow
def test_two_processes_on_postgresql_one_killed_mid_job(tmp_path, glyph_cache, serial_bench, postgres_url, freeze_when):
    url = postgres_url.rsplit("/", 1)[0] + "/" + "postgres"
    from sqlalchemy import create_engine, text

    engine = create_engine(url, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as connection:
            connection.execute(text("CREATE DATABASE bench_jobs"))
    finally:
        engine.dispose()
    url = url.rsplit("/", 1)[0] + "/bench_jobs"
    out, rerun, _ = kill_mid_job_then_finish(tmp_path, url, glyph_cache, freeze_when)
    check_shared_run(tmp_path, url, serial_bench)
    assert "secret-password" not in out + rerun


@pytest.mark.slow
def test_status_shows_every_row_and_a_mismatch_is_refused_naming_the_key(tmp_path, glyph_cache, serial_bench, run_cli):
    url = f"sqlite:///{serial_bench / 'bench.db'}"
    status = run([str(PML_RANK), "bench", *ARGUMENTS, "--status", "--storage", url, "--out", str(tmp_path)])
    lines = {line.split()[0]: line.split()[1:] for line in status.stdout.splitlines()[2:]}
    assert lines["pml:TripletMarginLoss"] == ["2", "0", "0"] and lines["all"] == ["5", "0", "0"]
    # The refusals through `cli.main` in this process (the script's own are in test_cli.py).
    status, _, err = run_cli(bench_argv(tmp_path, url, glyph_cache, "--epochs", "3"))
    assert status == 2 and "epochs 2 there, 3 now" in err and "Traceback" not in err
    # The parameters of a row are part of the bench too.
    params = tmp_path / "tuned.json"
    params.write_text(json.dumps({"pml:TripletMarginLoss": {"params": {"margin": 0.2}}}))
    status, _, err = run_cli(
        [c for c in bench_argv(tmp_path, url, glyph_cache) if c != "--untuned"] + ["--params", params]
    )
    assert status == 2 and "pml:TripletMarginLoss: {} there, {'margin': 0.2} now" in err


@pytest.mark.parametrize("url", ["nosuchdialect://x/y", "postgresql+psycopg://user:secret@127.0.0.1:1/db"])
def test_a_storage_that_cannot_be_opened_is_refused(url, tmp_path, glyph_cache, run_cli):
    # Through `cli.main` in this process: the script's refusals are tested in test_cli.py.
    status, printed, err = run_cli(
        ["bench", *ARGUMENTS, "--storage", url, "--out", tmp_path, "--cache-dir", glyph_cache]
    )
    assert status == 2
    assert "argument --storage: cannot open" in err and "Traceback" not in err
    assert "secret" not in printed + err
    assert not (tmp_path / "bench.json").exists()


def test_racing_duplicates_of_a_job_run_once(tmp_path):
    """Two processes that enqueue the same job at once: the lower trial number runs it, the
    other trial gives up, and the job's outcome is stored once."""
    url = f"sqlite:///{tmp_path / 'dup.db'}"
    store = jobs.JobStore(url, BUDGET)
    job = jobs.Job("pml:TripletMarginLoss", 0, {})
    for _ in range(2):  # what two racing processes could leave behind
        store.study.enqueue_trial({}, user_attrs={"job": job.record()})
    calls = []

    def run(*args):
        calls.append(args)
        return {"run": {"concatenated": {MAP_AT_R: 0.5}}, "seconds": 1}

    try:
        assert store.work(run, poll=0.1) == 1
        assert len(calls) == 1 and list(store.outcomes()) == [job.key]
        states = sorted((t.number, t.state.name, bool(t.user_attrs.get("superseded"))) for t in trials(store.storage))
        assert states == [(0, "COMPLETE", False), (1, "FAIL", True)]
        assert store.enqueue_missing([job]) == 0  # done: never enqueued again
    finally:
        store.close()


def _claim_all(url, queue):
    import warnings

    from pml_rank.harness.storage import close_storage, open_storage

    warnings.simplefilter("ignore")
    storage = open_storage(url)
    study = optuna.load_study(study_name="claims", storage=storage)
    mine = []
    while any(t.state.name == "WAITING" for t in study.get_trials(deepcopy=False)):
        trial = study.ask()
        if "n" in trial.user_attrs:
            mine.append(trial.user_attrs["n"])
        study.tell(trial, 0.0)
    close_storage(storage)
    queue.put(mine)


@pytest.mark.slow
def test_two_processes_never_claim_the_same_waiting_trial_on_sqlite(tmp_path):
    """SQLite ignores SELECT ... FOR UPDATE: the storage begins its transactions with BEGIN
    IMMEDIATE, so Optuna's read-then-write claim of a waiting trial holds across processes."""
    import multiprocessing

    from pml_rank.harness.storage import close_storage, open_storage

    url = f"sqlite:///{tmp_path / 'claims.db'}"
    storage = open_storage(url)
    study = optuna.create_study(study_name="claims", storage=storage)
    for n in range(60):
        study.enqueue_trial({}, user_attrs={"n": n})
    close_storage(storage)
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    workers = [context.Process(target=_claim_all, args=(url, queue)) for _ in range(2)]
    for w in workers:
        w.start()
    claimed = queue.get(timeout=300) + queue.get(timeout=300)
    for w in workers:
        w.join()
    assert sorted(claimed) == list(range(60))  # each once


# ----------------------------------------------------------------------------- Ctrl-C


def interrupt_this_process():
    os.kill(os.getpid(), signal.SIGINT)  # handled in the main thread before os.kill returns


def test_an_interrupt_inside_the_objective_fails_its_trial_and_stops_the_loop():
    study = optuna.create_study()

    def objective(trial):
        interrupt_this_process()
        return 1.0

    with InterruptsBetweenTrials() as interrupts, pytest.raises(KeyboardInterrupt):
        study.optimize(interrupts.objective(objective), n_trials=1, catch=())
    assert [t.state.name for t in study.trials] == ["FAIL"]


def test_an_interrupt_while_a_trial_is_created_waits_until_it_is_recorded(monkeypatch):
    study = optuna.create_study()
    ask = study.ask

    def ask_interrupted(*args, **kwargs):
        trial = ask(*args, **kwargs)  # the trial is RUNNING in the storage now
        interrupt_this_process()
        return trial

    monkeypatch.setattr(study, "ask", ask_interrupted)
    with InterruptsBetweenTrials() as interrupts:
        # The objective does not run: Optuna records the trial as failed, nothing is left RUNNING.
        with pytest.raises(KeyboardInterrupt):
            study.optimize(interrupts.objective(lambda trial: 1.0), n_trials=1, catch=())
        assert [t.state.name for t in study.trials] == ["FAIL"]
        with pytest.raises(KeyboardInterrupt):
            interrupts.check()  # the loop stops at its next check too


def test_an_interrupt_while_a_result_is_recorded_waits_until_it_is_recorded(monkeypatch):
    study = optuna.create_study()
    record = study._storage.set_trial_state_values

    def record_interrupted(*args, **kwargs):
        interrupt_this_process()
        return record(*args, **kwargs)

    monkeypatch.setattr(study._storage, "set_trial_state_values", record_interrupted)
    with InterruptsBetweenTrials() as interrupts:
        study.optimize(interrupts.objective(lambda trial: 1.0), n_trials=1, catch=())
        assert [t.state.name for t in study.trials] == ["COMPLETE"]
        with pytest.raises(KeyboardInterrupt):
            interrupts.check()


def test_the_previous_handler_comes_back():
    before = signal.getsignal(signal.SIGINT)
    with InterruptsBetweenTrials():
        assert signal.getsignal(signal.SIGINT) is not before
    assert signal.getsignal(signal.SIGINT) is before


class _Caught(Exception):
    """Ends a trial failed; the claim loop goes on and counts it."""


class _Passed(Exception):
    """Passes a trial over; the claim loop goes on without counting it."""


def test_the_claim_loop_runs_one_trial_at_a_time_until_nothing_is_left():
    study = optuna.create_study()
    plan = iter(["complete", WAIT, "passed", "caught", WAIT, "complete"])
    current = None

    def objective(trial):
        if current == "passed":
            raise _Passed()
        if current == "caught":
            raise _Caught()
        return 1.0

    def next_trial():
        nonlocal current
        current = next(plan, None)
        return current if current in (None, WAIT) else (study, objective)

    assert claim_trials(next_trial, poll=0.0, catch=(_Caught,), skip=(_Passed,)) == 3
    assert [t.state.name for t in study.trials] == ["COMPLETE", "FAIL", "FAIL", "COMPLETE"]
    assert next(plan, "the plan is used up") == "the plan is used up"


def _ends(how):
    """A worker's target: ends by Ctrl-C (KeyboardInterrupt), by SIGINT with Python's handler
    gone (the signal kills it), or by failing."""
    if how == "failing":
        sys.exit(3)
    if how == "killed by SIGINT":
        signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGINT)
    signal.pause()


@pytest.mark.slow  # three processes
def test_a_worker_ended_by_ctrl_c_is_not_a_failed_worker():
    ways = [("Ctrl-C",), ("killed by SIGINT",), ("failing",)]
    assert run_processes(_ends, ways, progress=lambda: None, poll=0.01) == [3]
