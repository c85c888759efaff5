"""The bench's parallel jobs, its store of finished runs (resume, refusal of another
configuration) and --params, through the console script where it matters."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pml_rank.harness import bench

PML_RANK = Path(sys.executable).parent / "pml-rank"
TINY = ["--classes", "24", "--epochs", "1", "--iterations", "2"]


def test_parallel_jobs_give_exactly_the_serial_results(glyph_cache):
    kwargs = dict(
        epochs=1,
        iterations_per_epoch=3,
        seeds=2,
        num_classes=24,
        cache_dir=glyph_cache,
        progress=False,
        params={"RaMBORecallLoss": {"lambda_val": 4.0, "memory_size": 0}},
    )
    serial = bench.run_bench(["pml:TripletMarginLoss", "RaMBORecallLoss"], workers=1, **kwargs)
    parallel = bench.run_bench(["pml:TripletMarginLoss", "RaMBORecallLoss"], workers=2, **kwargs)
    assert serial.rows == parallel.rows
    for row in serial.rows:
        assert serial.runs[row] == parallel.runs[row], row
        assert serial.histories[row] == parallel.histories[row], row
    assert parallel.params["RaMBORecallLoss"] == {"lambda_val": 4.0, "memory_size": 0}
    assert parallel.sources["RaMBORecallLoss"] == "tuned" and parallel.sources["pml:TripletMarginLoss"] == "defaults"


def store_rows(out):
    path = out / bench.STORE_FILE
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_interrupted_bench_resumes_and_refuses_another_configuration(tmp_path, glyph_cache, start_interruptible):
    out = tmp_path / "out"
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
    process = start_interruptible(args)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not any(r["row"] == "pml:TripletMarginLoss" for r in store_rows(out)):
        time.sleep(0.05)
    os.killpg(process.pid, signal.SIGINT)
    stdout, stderr = process.communicate(timeout=60)
    kept = [r for r in store_rows(out) if r["row"] == "pml:TripletMarginLoss"]
    assert process.returncode == 130 and "resumes" in stderr, stdout + stderr
    assert 1 <= len(kept) < 3

    result = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"resumed: {3 + len(kept)}" in result.stdout  # the untrained row's 3 seeds and the kept runs
    payload = json.loads((out / "bench.json").read_text())
    (triplet,) = [row for row in payload["rows"] if row["row"] == "pml:TripletMarginLoss"]
    assert len(triplet["runs"]) == 3
    for record in kept:  # the stored runs are the ones reported, not recomputed
        assert triplet["runs"][record["seed"]] == record["run"]
    assert len([r for r in store_rows(out) if r["row"] == "pml:TripletMarginLoss"]) == 3

    changed = subprocess.run(
        [*args[:-2], "--out", str(out), "--epochs", "2"], capture_output=True, text=True, timeout=300
    )
    assert changed.returncode == 2 and "another configuration" in changed.stderr
    assert "epochs 1 there, 2 now" in changed.stderr
    assert (out / "bench.json").read_text() == json.dumps(payload, indent=1)  # nothing overwritten


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


def test_a_line_cut_short_by_a_crash_costs_only_its_own_run(tmp_path):
    config = {key: 1 for key in bench.STORE_KEYS}
    path = tmp_path / bench.STORE_FILE
    first = bench.RunStore(path, config)
    first.add("AUCLoss", {}, 0, {"value": 0.5})
    with open(path, "a") as file:  # kill -9 in the middle of the next record
        file.write('{"config_key": "')
    resumed = bench.RunStore(path, config)
    assert resumed.get("AUCLoss", {}, 0)["value"] == 0.5
    resumed.add("AUCLoss", {}, 1, {"value": 0.7})
    again = bench.RunStore(path, config)
    assert again.get("AUCLoss", {}, 0)["value"] == 0.5 and again.get("AUCLoss", {}, 1)["value"] == 0.7


def test_a_store_of_another_schedule_or_class_count_is_refused(tmp_path):
    path = tmp_path / bench.STORE_FILE
    config = dict(bench.DEFAULTS)
    bench.RunStore(path, config).add("AUCLoss", {}, 0, {"run": {}, "histories": [], "seconds": 0.0})
    assert bench.RunStore(path, dict(config)).get("AUCLoss", {}, 0) is not None
    for changed in (dict(lr_schedule="constant"), dict(num_classes="all")):
        with pytest.raises(bench.StoreMismatchError, match=next(iter(changed))):
            bench.RunStore(path, {**config, **changed})
