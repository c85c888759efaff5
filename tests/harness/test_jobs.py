"""The bench's jobs in an Optuna storage (`jobs.JobStore`): parallel workers give the serial
results, a finished job is kept and never trained again, a bench of another budget or
other parameters is refused before any work, every job is in the store once, and the
outputs rebuilt from the store are the same files; --params, through the console script
where it matters."""

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from pml_rank.harness import bench, checks, jobs, recipes, report, runner
from pml_rank.harness.budget import resolve
from pml_rank.harness.storage import close_storage, default_url, open_storage

PML_RANK = Path(sys.executable).parent / "pml-rank"
TINY = ["--classes", "24", "--epochs", "1", "--iterations", "2", "--batch-size", "16"]
# The in-process benches: 2 fold models of 1 epoch x 2 iterations on 16 classes.
SMALL = dict(num_classes=16, batch_size=8, epochs=1, iterations_per_epoch=2, num_folds=2)


def url_in(folder):
    folder.mkdir(parents=True, exist_ok=True)
    return default_url(folder, bench.STORE_FILE)


def complete_jobs(url):
    """``[(job key, trial number, outcome)]`` of the complete trials of the bench at `url`
    ([] before the bench has created its study)."""
    import optuna
    from optuna.trial import TrialState

    storage = open_storage(url)
    try:
        trials = [
            t
            for bench_study in jobs.bench_studies(storage)
            for t in optuna.load_study(study_name=bench_study.study_name, storage=storage).get_trials(
                deepcopy=False, states=(TrialState.COMPLETE,)
            )
        ]
        return [
            (t.user_attrs["job"]["key"], t.number, t.user_attrs["outcome"]) for t in trials if "job" in t.user_attrs
        ]
    finally:
        close_storage(storage)


@pytest.fixture
def count_runs(monkeypatch):
    """Counts `runner.run`'s calls (the jobs this process trains); ``count_runs.fail_after
    = n`` makes the call after the n-th raise KeyboardInterrupt, as Ctrl-C would."""

    class Counting:
        calls = []
        fail_after = None

    real_run = runner.run

    def run(budget, row, params, seed, *args, **kwargs):
        if Counting.fail_after is not None and len(Counting.calls) >= Counting.fail_after:
            raise KeyboardInterrupt
        Counting.calls.append((row, seed))
        return real_run(budget, row, params, seed, *args, **kwargs)

    monkeypatch.setattr(runner, "run", run)
    return Counting


def small_bench(rows, url, glyph_cache, seeds=2, params=None, workers=1, **budget):
    row_recipes, resolved = recipes.rows(rows), resolve("glyphs", **{**SMALL, **budget})
    runner.check_rows(resolved, row_recipes)
    return bench.run_bench(
        row_recipes,
        resolved,
        url,
        runner.Machine(cache_dir=glyph_cache),
        seeds=seeds,
        params=params,
        workers=workers,
        progress=False,
    )


@pytest.mark.slow
def test_parallel_jobs_give_exactly_the_serial_results(glyph_cache, tmp_path):
    kwargs = dict(seeds=2, params={"RaMBORecallLoss": {"lambda_val": 4.0, "memory_size": 0}})
    rows = ["pml:TripletMarginLoss", "RaMBORecallLoss"]
    serial = small_bench(rows, url_in(tmp_path / "serial"), glyph_cache, workers=1, **kwargs)
    parallel = small_bench(rows, url_in(tmp_path / "parallel"), glyph_cache, workers=2, **kwargs)
    assert serial.rows == parallel.rows
    for row in serial.rows:
        assert serial.runs[row] == parallel.runs[row], row
        assert serial.histories[row] == parallel.histories[row], row
    assert parallel.params["RaMBORecallLoss"] == {"lambda_val": 4.0, "memory_size": 0}
    assert parallel.sources["RaMBORecallLoss"] == "tuned" and parallel.sources["pml:TripletMarginLoss"] == "defaults"


@pytest.mark.slow
def test_a_finished_bench_reruns_without_training_and_rebuilds_the_same_outputs(glyph_cache, tmp_path, count_runs):
    url = url_in(tmp_path / "store")
    first = small_bench(["pml:TripletMarginLoss"], url, glyph_cache)
    # raw input once, then the untrained row and the triplet row for each seed
    expected = [(runner.RAW_INPUT, 0), (runner.UNTRAINED, 0), (runner.UNTRAINED, 1)]
    expected += [("pml:TripletMarginLoss", 0), ("pml:TripletMarginLoss", 1)]
    assert sorted(count_runs.calls) == sorted(expected) and first.resumed == 0
    count_runs.calls.clear()

    again = small_bench(["pml:TripletMarginLoss"], url, glyph_cache)
    assert count_runs.calls == [] and again.resumed == len(expected)
    paths = {name: report.write_all(result, tmp_path / name) for name, result in (("a", first), ("b", again))}
    for a, b in zip(paths["a"], paths["b"]):
        assert a.name == b.name and a.read_bytes() == b.read_bytes(), a.name
    assert report.format_table(first) == report.format_table(again)
    keys = Counter(key for key, _, _ in complete_jobs(url))
    assert len(keys) == len(expected) and set(keys.values()) == {1}  # each job in the store once


@pytest.mark.slow
def test_an_interrupted_bench_keeps_its_finished_jobs_and_trains_only_the_rest(glyph_cache, tmp_path, count_runs):
    url = url_in(tmp_path / "store")
    count_runs.fail_after = 3  # Ctrl-C in the fourth job
    with pytest.raises(KeyboardInterrupt):
        small_bench(["pml:TripletMarginLoss"], url, glyph_cache)
    kept = {key: outcome for key, _, outcome in complete_jobs(url)}
    assert len(kept) == 3
    done_first = list(count_runs.calls)

    count_runs.calls.clear()
    count_runs.fail_after = None
    resumed = small_bench(["pml:TripletMarginLoss"], url, glyph_cache)
    assert resumed.resumed == 3 and len(count_runs.calls) == 2
    assert not set(done_first) & set(count_runs.calls)  # no finished job trained again
    stored = complete_jobs(url)
    keys = Counter(key for key, _, _ in stored)
    assert len(keys) == 5 and set(keys.values()) == {1}
    for key, _, outcome in stored:
        if key in kept:
            assert outcome == kept[key]
    for row, seed in done_first:  # the kept outcomes are the ones reported, not recomputed
        if row != runner.RAW_INPUT:
            (outcome,) = [o for k, _, o in stored if k == jobs.Job(row, seed, {}).key]
            assert resumed.runs[row][seed] == outcome["run"]


@pytest.mark.slow
def test_a_store_of_another_budget_is_refused_naming_the_difference(glyph_cache, tmp_path, count_runs):
    url = url_in(tmp_path / "store")
    budget = resolve("glyphs", **SMALL)
    jobs.JobStore(url, budget).close()
    jobs.JobStore(url, dict(budget)).close()  # the same budget: accepted
    for key, value in (("lr_schedule", "constant"), ("num_classes", "all"), ("dataset", "cub200"), ("epochs", 2)):
        with pytest.raises(jobs.MismatchError, match=f"{key} {budget[key]!r} there, {value!r} now"):
            jobs.JobStore(url, {**budget, key: value})
    count_runs.fail_after = 0  # any training fails the test
    with pytest.raises(jobs.MismatchError, match="epochs 1 there, 2 now"):
        small_bench(["pml:TripletMarginLoss"], url, glyph_cache, epochs=2)
    assert complete_jobs(url) == []


@pytest.mark.slow
def test_other_parameters_for_a_row_are_refused_naming_the_row(glyph_cache, tmp_path, count_runs):
    url = url_in(tmp_path / "store")
    rows = ["pml:TripletMarginLoss", "pml:ContrastiveLoss"]
    store = jobs.JobStore(url, resolve("glyphs", **SMALL))
    try:
        store.record_row_params({"pml:TripletMarginLoss": {"margin": 0.1}, "pml:ContrastiveLoss": {}})
        store.record_row_params({"pml:TripletMarginLoss": {"margin": 0.1}})  # the same: accepted
        store.record_row_params({"AUCLoss": {}})  # a row the bench did not have: added
        with pytest.raises(jobs.MismatchError) as error:
            store.record_row_params(
                {"pml:TripletMarginLoss": {"margin": 0.2}, "pml:ContrastiveLoss": {}, "AUCLoss": {}}
            )
    finally:
        store.close()
    assert "pml:TripletMarginLoss" in str(error.value) and "0.2" in str(error.value)
    assert "ContrastiveLoss" not in str(error.value) and "AUCLoss" not in str(error.value)
    count_runs.fail_after = 0  # refused before any work
    with pytest.raises(jobs.MismatchError, match="pml:TripletMarginLoss"):
        small_bench(rows, url, glyph_cache, params={"pml:TripletMarginLoss": {"margin": 0.3}})


@pytest.mark.slow
def test_a_mismatch_is_refused_before_the_data_set_is_loaded(glyph_cache, tmp_path, monkeypatch):
    url = url_in(tmp_path / "store")
    budget = resolve("glyphs", **SMALL)
    store = jobs.JobStore(url, budget)
    store.record_row_params({"pml:TripletMarginLoss": {"margin": 0.1}})
    store.close()

    def no_data(*args, **kwargs):
        raise AssertionError("the data set was loaded")

    monkeypatch.setattr(checks, "dataset_of", no_data)  # where `runner.check` loads it
    with pytest.raises(jobs.MismatchError, match="epochs 1 there, 2 now"):
        small_bench(["pml:TripletMarginLoss"], url, glyph_cache, epochs=2)
    with pytest.raises(jobs.MismatchError, match="pml:TripletMarginLoss"):
        small_bench(["pml:TripletMarginLoss"], url, glyph_cache, params={"pml:TripletMarginLoss": {"margin": 0.3}})
    # The read-only check makes nothing where there is no bench yet.
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    jobs.check_stored_bench(default_url(fresh, bench.STORE_FILE), budget, {})
    assert list(fresh.iterdir()) == []


# A test-only `sitecustomize` for the bench process of the test below (read at its start).
PAUSE_AT_THE_SECOND_TRIPLET_JOB = """
import time

from pml_rank.harness import jobs

_work = jobs.JobStore.work


def _work_that_pauses(self, run, on_job=None, poll=2.0):
    started = []

    def pausing(job):
        if job.row == "pml:TripletMarginLoss":
            started.append(job)
            while len(started) == 2:  # until Ctrl-C
                time.sleep(0.05)
        if on_job is not None:
            on_job(job)

    return _work(self, run, pausing, poll)


jobs.JobStore.work = _work_that_pauses
"""


@pytest.mark.slow
def test_interrupted_bench_resumes_and_refuses_another_configuration(
    tmp_path, glyph_cache, start_interruptible, run_cli, monkeypatch
):
    # The script's process stops at its second triplet job until interrupted: Ctrl-C then comes after
    # exactly one stored triplet run, on a loaded machine as on a quiet one (its jobs take a third of a
    # second; polling the store could miss them all).
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(PAUSE_AT_THE_SECOND_TRIPLET_JOB)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(hooks), os.environ.get("PYTHONPATH")])))
    out = tmp_path / "out"
    url = default_url(out, bench.STORE_FILE)
    args = [
        str(PML_RANK),
        "bench",
        "pml:TripletMarginLoss",
        "--seeds",
        "3",
        "--workers",
        "1",
        "--untuned",
        *TINY,
        "--cache-dir",
        str(glyph_cache),
        "--out",
        str(out),
    ]

    def triplet_jobs():
        if not (out / bench.STORE_FILE).exists():
            return []
        return [(key, outcome) for key, _, outcome in complete_jobs(url) if key.startswith("pml:TripletMarginLoss|")]

    process = start_interruptible(args)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not triplet_jobs():
        time.sleep(0.2)
    os.killpg(process.pid, signal.SIGINT)
    stdout, stderr = process.communicate(timeout=60)
    kept = triplet_jobs()
    assert process.returncode == 130 and "resumes" in stderr, stdout + stderr
    assert len(kept) == 1

    # The rerun and the refusal through `cli.main` in this process: the script's part is done.
    status, printed, err = run_cli(args[1:])
    assert status == 0, printed + err
    # the raw input, the untrained row's 3 seeds and the kept runs
    assert f"resumed: {4 + len(kept)} finished job(s)" in printed
    payload = json.loads((out / "bench.json").read_text())
    (triplet,) = [row for row in payload["rows"] if row["row"] == "pml:TripletMarginLoss"]
    assert len(triplet["runs"]) == 3
    for key, outcome in kept:  # the stored runs are the ones reported, not recomputed
        assert triplet["runs"][int(key.rsplit("|", 1)[1])] == outcome["run"]
    keys = Counter(key for key, _, _ in complete_jobs(url))
    assert len(keys) == 7 and set(keys.values()) == {1}

    status, _, err = run_cli([*args[1:], "--epochs", "2"])
    assert status == 2 and "another budget" in err and "epochs 1 there, 2 now" in err
    assert (out / "bench.json").read_text() == json.dumps(payload, indent=1)  # nothing overwritten


@pytest.mark.slow
def test_bench_trains_with_the_tuned_parameters_and_records_them(tmp_path, glyph_cache):
    tuned = tmp_path / "tuned.json"
    params = {"lambda_val": 4.0, "margin": 0.05, "memory_size": 0, "weighting": "loglog"}
    tuned.write_text(json.dumps({"RaMBORecallLoss": {"params": params, "value": 0.5, "trials": 20, "study": "s"}}))
    out = tmp_path / "out"
    result = subprocess.run(
        [
            str(PML_RANK),
            "bench",
            "--params",
            str(tuned),
            "RaMBORecallLoss",
            "pml:TripletMarginLoss",
            "--seeds",
            "1",
            "--workers",
            "1",
            *TINY,
            "--cache-dir",
            str(glyph_cache),
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "tuned (tuned.json): lambda_val=4" in result.stdout
    rows = {row["row"]: row for row in json.loads((out / "bench.json").read_text())["rows"]}
    assert rows["RaMBORecallLoss"]["params"] == params
    assert rows["RaMBORecallLoss"]["params_source"] == "tuned (tuned.json)"
    assert rows["pml:TripletMarginLoss"]["params_source"] == "defaults"
    assert "params_source" in (out / "bench.csv").read_text().splitlines()[0]


@pytest.mark.slow
def test_processes_opening_a_new_storage_at_the_same_moment_all_open_it(tmp_path):
    # Each process imports first, then opens the storage once every process has arrived: they
    # race to create its tables, as several `pml-rank bench` commands started together do.
    url = default_url(tmp_path, "new.db")  # new.db0 to new.db3
    arrived = tmp_path / "arrived"
    arrived.mkdir()
    script = (  # the storage without torch: the processes start faster
        "import os, sys, time\n"
        "from pml_rank.harness import storage\n"
        "url, arrived, me, count = sys.argv[1:]\n"
        "for k in range(4):  # four new storages, each opened by every process at one moment\n"
        "    open(os.path.join(arrived, f'{k}-{me}'), 'w').close()\n"
        "    while sum(name.startswith(f'{k}-') for name in os.listdir(arrived)) < int(count):\n"
        "        time.sleep(0.001)\n"
        "    storage.close_storage(storage.open_storage(url + str(k)))\n"
    )
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", script, url, str(arrived), str(me), "6"],
            stderr=subprocess.PIPE,
            text=True,
        )
        for me in range(6)
    ]
    errors = [p.communicate(timeout=120)[1] for p in processes]
    assert [p.returncode for p in processes] == [0] * 6, "\n".join(errors)


@pytest.mark.filterwarnings("ignore:Heartbeat of storage is supposed to be used with Study.optimize")
def test_status_counts_a_running_job_as_running_until_it_completes(tmp_path):
    store = jobs.JobStore(url_in(tmp_path), resolve("glyphs", **SMALL))
    try:
        every = [jobs.Job("pml:TripletMarginLoss", seed, {}) for seed in range(3)]
        store.enqueue_missing(every)
        assert store.status(every) == {"pml:TripletMarginLoss": {"done": 0, "running": 0, "waiting": 3}}
        trial = store.study.ask()  # a process claims the first waiting job
        assert trial.user_attrs["job"]["key"] == every[0].key
        assert store.status(every) == {"pml:TripletMarginLoss": {"done": 0, "running": 1, "waiting": 2}}
        assert store.status() == store.status(every)
        store.study.tell(trial, 0.5)
        assert store.status(every) == {"pml:TripletMarginLoss": {"done": 1, "running": 0, "waiting": 2}}
    finally:
        store.close()
