"""The `pml-rank speed` harness (its numbers are reported, never asserted)."""

import json
import statistics

import pytest
import torch

from pml_rank import cli
from pml_rank.harness import speed


def test_peak_memory_sees_the_similarity_matrix():
    x = torch.randn(512, 8, requires_grad=True)
    peak = speed.peak_memory(lambda e: (e @ e.T).sum(), (x,), torch.device("cpu"))
    matrix_bytes = 512 * 512 * 4
    assert matrix_bytes <= peak < 4 * matrix_bytes


def test_peak_memory_of_a_cheap_function_is_small():
    x = torch.randn(512, 8, requires_grad=True)
    peak = speed.peak_memory(lambda e: e.sum(), (x,), torch.device("cpu"))
    assert peak < 512 * 8 * 4 * 3


def test_speed_command_times_a_registered_loss_and_writes_json(tmp_path, capsys):
    code = cli.main(
        ["speed", "BinomialDevianceLoss", "--sizes", "16", "32", "--dim", "8", "--repeats", "2", "--out", str(tmp_path)]
    )
    assert code == 0
    out = capsys.readouterr().out
    assert "time/floor" in out and "memory/floor" in out
    result = json.loads((tmp_path / "speed-BinomialDevianceLoss.json").read_text())
    assert [row["size"] for row in result["rows"]] == [16, 32]
    for row in result["rows"]:
        assert set(row["seconds"]) == {"ours", "floor"}
        # The median of the per-round ratios, not the ratio of the medians.
        assert row["ratios"]["time_vs_floor"] == pytest.approx(statistics.median(row["round_ratios"]["time_vs_floor"]))


def test_speed_case_with_all_contenders_reports_every_ratio(monkeypatch):
    def factory(scale):
        return lambda: lambda e, labels: (e * scale).pow(2).sum()

    case = speed.SpeedCase(ours=factory(1.0), pml=factory(2.0), reference=factory(3.0), reference_max_size=16)
    monkeypatch.setitem(speed.CASES, "Toy", case)
    result = speed.measure("Toy", sizes=(8, 32), dim=4, repeats=2, progress=False)
    small, large = result["rows"]
    assert set(small["seconds"]) == {"ours", "pml", "reference", "floor"}
    assert set(large["seconds"]) == {"ours", "pml", "floor"}  # reference skipped above 16
    assert {"time_vs_pml", "time_vs_reference", "time_vs_floor"} <= set(small["ratios"])


def test_unknown_loss_is_a_clear_error(capsys):
    assert cli.main(["speed", "NoSuchLoss"]) == 2
    assert "unknown loss NoSuchLoss" in capsys.readouterr().err


class _TemporaryInsideFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        temporary = torch.ones(1 << 20)  # 4 MB, freed before the op returns
        return x * temporary[:1].sum()

    @staticmethod
    def backward(ctx, grad):
        return grad


def test_peak_memory_sees_temporaries_freed_inside_a_custom_function():
    x = torch.randn(8, requires_grad=True)
    peak = speed.peak_memory(lambda e: _TemporaryInsideFunction.apply(e).sum(), (x,), torch.device("cpu"))
    assert peak >= 4 * 2**20


def test_ratios_are_per_round_and_pooled_over_runs():
    # Two runs of three rounds; ours takes twice the floor's time except in one noisy
    # round, which a ratio of medians would blur and per-round ratios keep apart.
    runs = [{"ours": [2.0, 4.0, 2.2], "floor": [1.0, 2.0, 1.0]}, {"ours": [9.0, 2.0, 2.0], "floor": [1.0, 1.0, 1.0]}]
    stats, run_medians, raw = speed._aggregate(runs, [("time_vs_floor", "ours", "floor")])
    assert raw["time_vs_floor"] == pytest.approx([2.0, 2.0, 2.2, 9.0, 2.0, 2.0])
    assert stats["time_vs_floor"] == pytest.approx({"median": 2.0, "min": 2.0, "max": 9.0})
    assert run_medians["time_vs_floor"] == pytest.approx([2.0, 2.0])


def test_measure_repeats_the_whole_measurement(monkeypatch):
    built = []

    def factory():
        built.append(1)
        return lambda e, labels: e.pow(2).sum()

    monkeypatch.setitem(speed.CASES, "Toy", speed.SpeedCase(ours=factory, prime=2))
    result = speed.measure("Toy", sizes=(8,), dim=4, repeats=3, runs=2, progress=False)
    row = result["rows"][0]
    assert result["runs"] == 2
    assert len(row["round_ratios"]["time_vs_floor"]) == 6
    assert len(row["run_medians"]["time_vs_floor"]) == 2
    low, high = row["spread"]["time_vs_floor"]
    assert low <= row["ratios"]["time_vs_floor"] <= high
    assert len(built) == 3  # a fresh loss per run, and one for the memory measurement


def test_underflow_case_times_the_loss_on_normal_and_scaled_inputs(monkeypatch):
    seen = []

    def factory():
        def loss(e, labels):
            seen.append(float(e.detach().abs().max()))
            return e.pow(2).sum()

        return loss

    monkeypatch.setitem(speed.CASES, "Toy", speed.SpeedCase(ours=factory, underflow_scale=1000.0))
    result = speed.measure_underflow("Toy", size=8, dim=4, repeats=2, warmup=0, progress=False)
    assert set(result["seconds"]) == {"normal", "underflow"}
    assert result["ratio"] == pytest.approx(statistics.median(result["round_ratios"]))
    assert result["spread"] == [min(result["round_ratios"]), max(result["round_ratios"])]
    # Rounds alternate normal, underflow: the second input is the first scaled by 1000.
    assert seen[1] == pytest.approx(1000 * seen[0])
    assert result["largest_abs_input"] == pytest.approx(seen[1])


def test_amp_runs_both_the_measurement_and_the_underflow_case_under_autocast(monkeypatch):
    autocast_on = []

    def factory():
        def loss(e, labels):
            autocast_on.append(torch.is_autocast_enabled("cpu"))
            return e.pow(2).sum()

        return loss

    monkeypatch.setitem(speed.CASES, "Toy", speed.SpeedCase(ours=factory, underflow_scale=1000.0))
    result = speed.measure_underflow("Toy", size=8, dim=4, repeats=1, warmup=0, progress=False, amp=True)
    assert result["autocast"] == "bfloat16" and autocast_on and all(autocast_on)
    autocast_on.clear()
    assert speed.measure("Toy", sizes=(8,), dim=4, repeats=1, warmup=0, progress=False, amp=True)["autocast"]
    assert autocast_on and all(autocast_on)


def test_every_case_has_underflow_inputs_and_auc_a_steeper_sigmoid():
    from pml_rank.losses import AUCLoss

    for name, case in speed.CASES.items():
        loss, inputs = case.underflow()
        values, _ = inputs(16, 8, torch.Generator().manual_seed(0), torch.device("cpu"))
        normal, _ = case.inputs(16, 8, torch.Generator().manual_seed(0), torch.device("cpu"))
        assert values.abs().max() >= 30 * normal.abs().max() * (1 - 1e-6), name
    assert speed.CASES["AUCLoss"].underflow()[0]().slope == pytest.approx(10 * AUCLoss().slope)


def test_report_names_the_command_date_and_machine(tmp_path, capsys):
    stem = tmp_path / "results" / "speed"
    code = cli.main(
        [
            "speed",
            "BinomialDevianceLoss",
            "--sizes",
            "16",
            "--dim",
            "8",
            "--repeats",
            "2",
            "--runs",
            "2",
            "--underflow",
            "--out",
            str(tmp_path),
            "--report",
            str(stem),
        ]
    )
    assert code == 0
    out = capsys.readouterr().out
    assert "No slow path" in out and "underflow/normal" in out
    report = json.loads(stem.with_suffix(".json").read_text())
    assert report["command"] == (
        "pml-rank speed BinomialDevianceLoss --sizes 16 --dim 8 --repeats 2 --runs 2 "
        f"--underflow --out {tmp_path} --report {stem}"
    )
    assert report["date"] and report["machine"]["cpu_count"] and report["machine"]["torch"] == torch.__version__
    assert [r["loss"] for r in report["results"]] == ["BinomialDevianceLoss"]
    assert len(report["results"][0]["rows"][0]["round_ratios"]["time_vs_floor"]) == 4
    assert [r["loss"] for r in report["underflow"]] == ["BinomialDevianceLoss"]
    table = stem.with_suffix(".md").read_text()
    assert report["command"] in table and report["date"] in table
    assert "| BinomialDevianceLoss | 16 | time / floor |" in table
    assert "underflow / normal" in table


def test_named_extra_cases_are_accepted():
    # The default-memory RaMBO cases are no registered names but cases of their own.
    for name in ("RaMBORecallLoss-memory3", "RaMBOAPLoss-memory3"):
        assert speed.CASES[name].prime >= 3


@pytest.mark.parametrize("name", ["RaMBORecallLoss", "RaMBOAPLoss-batch"])
def test_rambos_references_compute_the_timed_loss(name):
    """A time / reference ratio compares like with like: the authors' way computes the value
    the registered loss computes, with its default λ and margin."""
    case = speed.CASES[name]
    embeddings, labels = case.inputs(32, 8, torch.Generator().manual_seed(0), torch.device("cpu"))
    ours = case.ours()(embeddings, labels)
    assert ours > 0 and torch.allclose(ours, case.reference()(embeddings, labels), rtol=1e-5)
