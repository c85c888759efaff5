"""examples/bench_throughput.py, run as its main on a short fold model of the glyphs."""

import json
import runpy
from pathlib import Path

import pytest

from pml_rank.harness.data import glyphs

SCRIPT = Path(__file__).parents[2] / "examples" / "bench_throughput.py"


@pytest.mark.slow  # trains fold models
def test_the_throughput_script_prints_the_ratio_and_where_a_fold_model_spends_its_time(
    glyph_cache, monkeypatch, capsys, tmp_path
):
    monkeypatch.setattr(glyphs, "DEFAULT_CACHE_DIR", glyph_cache)
    main = runpy.run_path(str(SCRIPT))["main"]
    # 10 steps: their cumulative time several times a validation's, so that the trainer's step stays
    # among the 12 most costly functions on a loaded machine too (with 2 they were even, and it fell out).
    main(
        ["--epochs", "1", "--iterations", "10", "--repeats", "2", "--profile", "12", "--phases"]
        + ["--trace", "2", "--trace-dir", str(tmp_path)]
    )
    printed = capsys.readouterr().out
    ratio = next(line for line in printed.splitlines() if line.startswith("throughput ratio bench / raw step: "))
    median, spread = ratio.removeprefix("throughput ratio bench / raw step: ").split(" ", 1)
    low, high = map(float, spread.strip("()").split("-"))
    assert 0 < low <= float(median) <= high
    loader = next(line for line in printed.splitlines() if line.startswith("a training batch prepared by one "))
    milliseconds, steps = loader.split(": ", 1)[1].split(" ms, ")
    assert float(milliseconds.split()[0]) > 0 and float(steps.removesuffix(" raw steps")) > 0
    assert "its 12 functions of most cumulative time" in printed
    # The profiled fold model: the whole training call, and the trainer's steps inside it.
    profiled = printed.split("most cumulative time:", 1)[1]
    assert "training.py" in profiled and "(train_model)" in profiled and "(forward_and_backward)" in profiled
    assert "due to restriction <12>" in profiled
    # One more fold model by phase: its 10 iterations, each phase's time per iteration.
    phases = next(line for line in printed.splitlines() if line.startswith("one more fold model by phase"))
    assert "ms per iteration (10): " in phases
    timed = dict(item.rsplit(" ", 1) for item in phases.split(": ", 1)[1].split("; ")[0].split(", "))
    assert set(timed) == {"batch", "step", "epoch end", "other"}
    assert all(float(ms) >= 0 for ms in timed.values()) and float(timed["step"]) > 0 and float(timed["batch"]) > 0
    # Two raw steps and two of one more fold model's iterations under torch.profiler.
    for name in ("raw steps", "fold model"):
        line = next(line for line in printed.splitlines() if line.startswith(f"{name} under torch.profiler: "))
        summary = json.loads(line.split(": ", 1)[1])
        assert summary["iterations"] == 2 and summary["ms"] > 0 and summary["device busy ms"] == 0  # the CPU's
        assert summary["host ms"] and all(ms >= 0 for ms in summary["host ms"].values())
        assert (tmp_path / f"{name.replace(' ', '-')}.json.gz").stat().st_size > 0


@pytest.mark.parametrize("given_trace", [False, True])
def test_a_trace_folder_that_cannot_serve_fails_at_once_in_one_line(given_trace, tmp_path, capsys):
    main = runpy.run_path(str(SCRIPT))["main"]
    (tmp_path / "file").write_text("")
    argv, message = ["--trace-dir", str(tmp_path)], "--trace-dir: given without --trace"
    if given_trace:  # a folder inside a file cannot be made: said before the rounds, not after them
        argv, message = ["--trace", "2", "--trace-dir", str(tmp_path / "file" / "sub")], "--trace-dir: cannot make"
    with pytest.raises(SystemExit) as exited:
        main(argv)
    error = capsys.readouterr().err.strip().splitlines()
    assert exited.value.code == 2 and f": error: {message}" in error[-1]  # argparse's line, after its usage
