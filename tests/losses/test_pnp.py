"""PNPLoss against PML's PNPLoss (which equals the authors' criteria/PNP.py on their
layouts) and against the straightforward reference written from the paper's formula
(pml_rank.harness.references.pnp), in float64, values and gradients; and what PML's
cannot do: ref_emb, pairs, per-query losses, large batches."""

import math

import pytest
import torch
from loss_checks import LAYOUTS, assert_same_loss_and_gradients, grads, seeded
from pytorch_metric_learning import losses as pml_losses
from pytorch_metric_learning import miners
from pytorch_metric_learning.reducers import DoNothingReducer
from pytorch_metric_learning.utils import loss_and_miner_utils as lmu

from pml_rank.harness.references import pnp as reference
from pml_rank.harness.speed import peak_memory
from pml_rank.losses import CrossBatchMemory, PNPLoss

VARIANTS = [
    {"variant": "O"},
    {"variant": "Ds"},
    {"variant": "Dq", "alpha": 1},
    {"variant": "Dq", "alpha": 4},
    {"variant": "Iu"},
    {"variant": "Ib", "b": 2},
]


@pytest.mark.parametrize("kwargs", VARIANTS, ids=str)
@pytest.mark.parametrize(
    "layout", [name for name in LAYOUTS if name != "one class"]
)  # no negative: test_nothing_to_learn
def test_equals_pmls_and_the_paper(layout, kwargs):
    labels = torch.tensor(LAYOUTS[layout])
    embeddings = seeded(len(labels), seed=len(labels))
    ours = PNPLoss(**kwargs)(embeddings, labels)
    assert_same_loss_and_gradients(ours, pml_losses.PNPLoss(**kwargs)(embeddings, labels), (embeddings,))
    assert_same_loss_and_gradients(ours, reference.pnp_loss(embeddings, labels, **kwargs), (embeddings,))


def test_per_query_losses_go_to_the_reducer():
    labels = torch.tensor(LAYOUTS["singletons among pairs"])
    embeddings = seeded(len(labels), seed=1)
    loss_func = PNPLoss(reducer=DoNothingReducer())
    per_query = loss_func(embeddings, labels)["loss"]
    expected = reference.pnp_losses(embeddings, labels)
    assert per_query["indices"].tolist() == sorted(expected) and loss_func.num_queries == len(expected) == 7
    torch.testing.assert_close(per_query["losses"], torch.stack(list(expected.values())), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kwargs", [VARIANTS[0], VARIANTS[3]], ids=str)
def test_ref_emb_every_reference_counts(kwargs):
    embeddings, ref_emb = seeded(10, seed=1), seeded(14, seed=2)
    labels = torch.tensor([0, 0, 1, 2, 3, 3, 4, 5, 6, 9])
    ref_labels = torch.tensor([0, 1, 1, 2, 2, 2, 3, 4, 4, 5, 5, 7, 8, 8])
    expected = reference.pnp_loss(embeddings, labels, ref_emb=ref_emb, ref_labels=ref_labels, **kwargs)
    ours = PNPLoss(**kwargs)(embeddings, labels, ref_emb=ref_emb, ref_labels=ref_labels)
    assert_same_loss_and_gradients(ours, expected, (embeddings, ref_emb))


def test_batch_as_references_with_pairs_equals_the_batch():
    labels = torch.tensor([0, 0, 0, 1, 1, 2, 3, 3, 3, 3])
    embeddings = seeded(10)
    whole = PNPLoss()(embeddings, labels)
    pairs = lmu.get_all_pairs_indices(labels, labels)
    as_references = PNPLoss()(embeddings, labels, pairs, embeddings.detach().clone(), labels.clone())
    torch.testing.assert_close(as_references, whole, rtol=1e-12, atol=1e-12)


def test_indices_tuple_restricts_each_ranking_to_its_pairs():
    labels = torch.randint(0, 4, (20,), generator=torch.Generator().manual_seed(4))
    embeddings = seeded(20, seed=4)
    pairs = miners.MultiSimilarityMiner(epsilon=0.3)(embeddings, labels)
    allowed = set(zip(pairs[0].tolist(), pairs[1].tolist())) | set(zip(pairs[2].tolist(), pairs[3].tolist()))
    assert 0 < len(allowed) < 20 * 19
    expected = reference.pnp_loss(embeddings, labels, allowed_pairs=allowed)
    assert_same_loss_and_gradients(PNPLoss()(embeddings, labels, pairs), expected, (embeddings,))


def test_runs_in_cross_batch_memory_where_pmls_cannot():
    labels = torch.arange(16) // 4
    memory = CrossBatchMemory(PNPLoss(), embedding_size=8, memory_size=32)
    for seed in range(3):
        embeddings = seeded(16, seed=seed)
        loss = memory(embeddings, labels)
        assert torch.isfinite(loss) and grads(loss, (embeddings,))[0].abs().max() > 0
    with pytest.raises(Exception, match="CrossBatchMemory not supported for PNPLoss"):
        pml_losses.CrossBatchMemory(pml_losses.PNPLoss(), embedding_size=8, memory_size=32)
    with pytest.raises(ValueError, match="the registered PNPLoss is pml_rank.losses.pnp.PNPLoss"):
        CrossBatchMemory(pml_losses.PNPLoss(), embedding_size=8, memory_size=32)


@pytest.mark.parametrize("kwargs", VARIANTS, ids=str)
def test_gradcheck(kwargs):
    labels = torch.tensor([0, 0, 1, 1, 1, 2, 3, 3])
    embeddings = seeded(8, dim=4, seed=5)
    loss_func = PNPLoss(anneal=0.1, **kwargs)
    assert torch.autograd.gradcheck(lambda e: loss_func(e, labels), (embeddings,))


def test_nothing_to_learn():
    embeddings = seeded(6)
    assert PNPLoss()(embeddings, torch.arange(6)).item() == 0
    loss = PNPLoss()(embeddings, torch.zeros(6, dtype=torch.long))
    assert loss.item() == 0  # no negative above any positive
    loss.backward()
    assert not embeddings.grad.any()


def test_half_precision_is_computed_in_float32():
    labels = torch.arange(16) // 4
    half = torch.randn(16, 8, generator=torch.Generator().manual_seed(0)).half().requires_grad_()
    loss = PNPLoss()(half, labels)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, PNPLoss()(half.detach().float(), labels))
    loss.backward()
    assert half.grad.dtype == torch.float16 and torch.isfinite(half.grad).all()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"variant": "PNP-D_q"}, "PNPLoss: variant must be one of O, Ds, Dq, Iu, Ib, got 'PNP-D_q'"),
        ({"anneal": 0}, "PNPLoss: anneal must be a finite number > 0, got 0"),
        ({"alpha": math.inf}, "PNPLoss: alpha must be a finite number > 0, got inf"),
        ({"b": -2}, "PNPLoss: b must be a finite number > 0, got -2"),
    ],
)
def test_parameters_out_of_range_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PNPLoss(**kwargs)


@pytest.mark.parametrize("per_class", [4, 64])
def test_peak_memory_is_a_few_similarity_matrices_whatever_the_class_size(per_class):
    size = 256  # PML's B x B x B float32 tensors: 64 MB each
    embeddings = torch.randn(size, 32, generator=torch.Generator().manual_seed(0)).requires_grad_()
    labels = torch.arange(size) // per_class
    peak = peak_memory(PNPLoss(), (embeddings, labels), torch.device("cpu"))
    matrix = size * size * 4
    assert peak < 12 * matrix, f"{peak / matrix:.1f} similarity matrices"
