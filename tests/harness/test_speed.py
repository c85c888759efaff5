"""The `pml-rank speed` harness (its numbers are reported, never asserted)."""

import json

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
    code = cli.main(["speed", "BinomialDevianceLoss", "--sizes", "16", "32", "--dim", "8",
                     "--repeats", "2", "--out", str(tmp_path)])
    assert code == 0
    out = capsys.readouterr().out
    assert "time/floor" in out and "memory/floor" in out
    result = json.loads((tmp_path / "speed-BinomialDevianceLoss.json").read_text())
    assert [row["size"] for row in result["rows"]] == [16, 32]
    for row in result["rows"]:
        assert set(row["seconds"]) == {"ours", "floor"}
        assert row["ratios"]["time_vs_floor"] == pytest.approx(
            row["seconds"]["ours"] / row["seconds"]["floor"])


def test_speed_case_with_all_contenders_reports_every_ratio(monkeypatch):
    def factory(scale):
        return lambda: (lambda e, labels: (e * scale).pow(2).sum())

    case = speed.SpeedCase(ours=factory(1.0), pml=factory(2.0), reference=factory(3.0),
                           reference_max_size=16)
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
