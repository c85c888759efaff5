import pytest
import torch
from pytorch_metric_learning.distances import CosineSimilarity

from pml_rank.losses.base import RankLossBase, check_embeddings


class _Toy(RankLossBase):
    def compute_loss(self, embeddings, labels, indices_tuple, ref_emb, ref_labels):
        return {"loss": {"losses": embeddings.sum(), "indices": None, "reduction_type": "already_reduced"}}


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_embeddings_are_rejected_naming_loss_and_position(value):
    embeddings = torch.zeros(4, 3)
    embeddings[2, 1] = value
    with pytest.raises(ValueError, match=rf"_Toy: embeddings contains 1 NaN/Inf value\(s\), first at index \(2, 1\): {value}"):
        _Toy()(embeddings, torch.arange(4))


def test_non_finite_ref_emb_is_rejected():
    ref = torch.zeros(3, 3)
    ref[0, 0] = float("nan")
    with pytest.raises(ValueError, match="_Toy: ref_emb"):
        _Toy()(torch.zeros(2, 3), torch.arange(2), ref_emb=ref, ref_labels=torch.arange(3))


def test_integer_embeddings_are_a_type_error():
    with pytest.raises(TypeError, match="Named: embeddings must be a floating-point tensor, got torch.int64"):
        check_embeddings("Named", embeddings=torch.zeros(2, 2, dtype=torch.long))


def test_finite_input_passes_through():
    assert _Toy()(torch.ones(2, 3), torch.arange(2)).item() == 6
