"""Every pml-rank loss at its edges: empty batches, ref_emb without ref_labels, embeddings
that are not 2-D, PML's DoNothingReducer; AUCLoss's self pairs; FastAPLoss's distance
statistics."""

import pytest
import torch
from pytorch_metric_learning import losses as pml_losses
from pytorch_metric_learning.reducers import DoNothingReducer

import pml_rank
from pml_rank.losses import AUCLoss, FastAPLoss

NAMES = sorted(c.name for c in pml_rank.registry.components() if c.kind == "losses" and c.distribution == "pml-rank")


def make(name, **kwargs):
    return pml_rank.registry.losses()[name](**kwargs)


def seeded_batch(size=16, dim=8, classes=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(size, dim, generator=gen), torch.randint(0, classes, (size,), generator=gen)


@pytest.mark.parametrize("name", NAMES)
def test_empty_batch_gives_pmls_zero_loss(name):
    embeddings = torch.zeros(0, 8, requires_grad=True)
    loss = make(name)(embeddings, torch.zeros(0, dtype=torch.long))
    assert torch.is_tensor(loss) and loss.item() == 0
    loss.backward()
    assert embeddings.grad.shape == (0, 8)


@pytest.mark.parametrize("name", NAMES)
def test_empty_reference_set_gives_zero_loss(name):
    embeddings, labels = seeded_batch()
    loss = make(name)(embeddings, labels, ref_emb=torch.zeros(0, 8), ref_labels=torch.zeros(0, dtype=torch.long))
    assert loss.item() == 0


@pytest.mark.parametrize("name", NAMES)
def test_ref_emb_without_ref_labels_is_a_clear_error(name):
    embeddings, labels = seeded_batch()
    with pytest.raises(ValueError, match=f"{name}: ref_emb was given without ref_labels"):
        make(name)(embeddings, labels, ref_emb=seeded_batch(seed=1)[0])


@pytest.mark.parametrize("shape", [(16,), (16, 2, 4)])
@pytest.mark.parametrize("name", NAMES)
def test_embeddings_must_be_2d(name, shape):
    with pytest.raises(ValueError, match="embeddings must be a 2D tensor"):
        make(name)(torch.randn(shape), torch.arange(16) % 4)


@pytest.mark.parametrize("name", NAMES)
def test_do_nothing_reducer_returns_the_loss_dict(name):
    embeddings, labels = seeded_batch()
    loss_func = make(name, reducer=DoNothingReducer())
    losses = loss_func(embeddings, labels)
    assert isinstance(losses, dict) and set(losses) == set(loss_func.sub_loss_names())  # "loss", or ROADMAP's three
    assert all(torch.is_tensor(sub_loss["losses"]) for sub_loss in losses.values())


def test_auc_leaves_out_self_pairs_when_ref_labels_is_labels():
    """Labels with singletons: a self pair would give those anchors a positive."""
    embeddings, _ = seeded_batch(12)
    labels = torch.tensor([0, 0, 1, 1, 2, 2, 3, 4, 5, 6, 7, 8])
    loss = AUCLoss()
    in_batch = loss(embeddings, labels)
    anchors = loss.num_anchors
    as_reference = loss(embeddings, labels, ref_emb=embeddings.detach().clone(), ref_labels=labels)
    assert loss.num_anchors == anchors == 6
    assert as_reference.item() == pytest.approx(in_batch.item(), abs=1e-6)
    # Other labels (equal values, another tensor): the samples themselves are references.
    loss(embeddings, labels, ref_emb=embeddings.detach().clone(), ref_labels=labels.clone())
    assert loss.num_anchors == 12


def test_fastap_records_its_distance_statistics_as_pmls_does():
    embeddings, labels = seeded_batch()
    embeddings = embeddings * 3
    ours, theirs = FastAPLoss(collect_stats=True), pml_losses.FastAPLoss(collect_stats=True)
    ours.distance.collect_stats = theirs.distance.collect_stats = True
    ours(embeddings, labels)
    theirs(embeddings, labels)
    names = ["initial_avg_query_norm", "initial_avg_ref_norm", "final_avg_query_norm", "final_avg_ref_norm"]
    for name in names:
        assert getattr(ours.distance, name) == pytest.approx(getattr(theirs.distance, name), rel=1e-6)
    assert ours.distance.initial_avg_query_norm > 1.5
