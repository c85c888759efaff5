"""N-pair-mc and N-pair-ovo (Sohn, NIPS 2016) against PML's NPairsLoss and the reference."""

import pytest
import torch
from pytorch_metric_learning import losses as pml_losses
from pytorch_metric_learning.distances import CosineSimilarity, DotProductSimilarity, LpDistance
from pytorch_metric_learning.regularizers import LpRegularizer
from pytorch_metric_learning.utils import distributed as pml_dist
from pytorch_metric_learning.utils import loss_and_miner_utils as lmu

import pml_rank
from pml_rank.harness.references import npairs as reference
from pml_rank.losses import NPairsMCLoss, NPairsOVOLoss
from pml_rank.losses.npairs import first_two_of_each_class

UNNORMALIZED = DotProductSimilarity(normalize_embeddings=False)


def random_batch(seed, size=30, dim=6, num_classes=8):
    """Float64 embeddings and labels with uneven class sizes, singletons included."""
    generator = torch.Generator().manual_seed(seed)
    embeddings = torch.randn(size, dim, generator=generator, dtype=torch.float64)
    labels = torch.randint(num_classes, (size,), generator=generator) * 3 - 5  # not 0..K-1
    return embeddings.requires_grad_(), labels


def value_and_grad(loss_fn, embeddings, *args, **kwargs):
    embeddings.grad = None
    loss = loss_fn(embeddings, *args, **kwargs)
    loss.backward()
    return loss.detach(), embeddings.grad.clone()


def assert_same(first, second):
    (value1, grad1), (value2, grad2) = first, second
    torch.testing.assert_close(value1, value2)
    torch.testing.assert_close(grad1, grad2)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("normalized", [False, True])
def test_mc_without_penalty_equals_pml_npairs_loss(seed, normalized):
    embeddings, labels = random_batch(seed)
    distance = DotProductSimilarity(normalize_embeddings=normalized)
    ours = NPairsMCLoss(l2_reg_weight=0, distance=distance)
    pml = pml_losses.NPairsLoss(distance=distance)
    assert_same(value_and_grad(ours, embeddings, labels), value_and_grad(pml, embeddings, labels))
    assert ours.num_pairs == pml.num_pairs > 0


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("l2_reg_weight", [0, 0.002, 0.5])
@pytest.mark.parametrize("mode, loss_class", [("mc", NPairsMCLoss), ("ovo", NPairsOVOLoss)])
def test_equals_reference_with_and_without_penalty(seed, l2_reg_weight, mode, loss_class):
    embeddings, labels = random_batch(seed)
    assert_same(
        value_and_grad(loss_class(l2_reg_weight=l2_reg_weight), embeddings, labels),
        value_and_grad(lambda e, l: reference.npairs_loss(e, l, mode, l2_reg_weight), embeddings, labels),
    )


@pytest.mark.parametrize("mode, loss_class", [("mc", NPairsMCLoss), ("ovo", NPairsOVOLoss)])
def test_normalized_similarity_equals_reference(mode, loss_class):
    embeddings, labels = random_batch(7)
    assert_same(
        value_and_grad(loss_class(distance=DotProductSimilarity()), embeddings, labels),
        value_and_grad(lambda e, l: reference.npairs_loss(e, l, mode, 0.002, normalize=True), embeddings, labels),
    )


def test_default_is_pml_npairs_loss_with_its_own_l2_regularizer():
    """What `pml-rank speed` compares against: the same function built from PML parts."""
    embeddings, labels = random_batch(3)
    pml = pml_losses.NPairsLoss(
        distance=UNNORMALIZED, embedding_regularizer=LpRegularizer(power=2), embedding_reg_weight=0.002
    )
    assert_same(value_and_grad(NPairsMCLoss(), embeddings, labels), value_and_grad(pml, embeddings, labels))


def test_cosine_similarity_and_a_distance_are_accepted():
    embeddings, labels = random_batch(4)
    assert_same(
        value_and_grad(NPairsMCLoss(l2_reg_weight=0, distance=CosineSimilarity()), embeddings, labels),
        value_and_grad(pml_losses.NPairsLoss(distance=CosineSimilarity()), embeddings, labels),
    )
    # A distance (not inverted) is negated into a similarity, as PML does.
    assert_same(
        value_and_grad(NPairsMCLoss(l2_reg_weight=0, distance=LpDistance()), embeddings, labels),
        value_and_grad(pml_losses.NPairsLoss(distance=LpDistance()), embeddings, labels),
    )


@pytest.mark.parametrize("seed", range(20))
def test_pairs_are_the_ones_pml_forms(seed):
    generator = torch.Generator().manual_seed(seed)
    size = int(torch.randint(1, 40, (1,), generator=generator))
    labels = torch.randint(-3, 12, (size,), generator=generator)
    ours = first_two_of_each_class(labels)
    pml = lmu.convert_to_pos_pairs_with_unique_labels(None, labels)
    assert torch.equal(ours[0], pml[0]) and torch.equal(ours[1], pml[1])


def test_indices_tuple_selects_the_pairs_like_pml():
    embeddings, labels = random_batch(5)
    a1, p, a2, n = lmu.get_all_pairs_indices(labels)
    keep = torch.arange(len(a1)) % 3 == 1  # a subset, so the first pair per label changes
    pairs = (a1[keep], p[keep], a2, n)
    ours = value_and_grad(NPairsMCLoss(l2_reg_weight=0), embeddings, labels, pairs)
    pml = value_and_grad(pml_losses.NPairsLoss(distance=UNNORMALIZED), embeddings, labels, pairs)
    assert_same(ours, pml)
    all_pairs_value, _ = value_and_grad(NPairsMCLoss(l2_reg_weight=0), embeddings, labels)
    assert not torch.isclose(ours[0], all_pairs_value)


@pytest.mark.parametrize("mode, loss_class", [("mc", NPairsMCLoss), ("ovo", NPairsOVOLoss)])
def test_ref_emb_provides_the_positives(mode, loss_class):
    """Queries with one sample per class against a reference set with one per class: the
    same as a single batch holding both, where queries come first (the anchors)."""
    generator = torch.Generator().manual_seed(6)
    queries = torch.randn(7, 5, generator=generator, dtype=torch.float64, requires_grad=True)
    query_labels = torch.randperm(7, generator=generator)
    ref = torch.randn(9, 5, generator=generator, dtype=torch.float64)
    ref_labels = torch.randperm(9, generator=generator)  # classes 7 and 8 have no query
    loss = loss_class(l2_reg_weight=0)(queries, query_labels, ref_emb=ref, ref_labels=ref_labels)
    combined = reference.npairs_loss(torch.cat([queries, ref]), torch.cat([query_labels, ref_labels]), mode)
    torch.testing.assert_close(loss, combined)
    torch.testing.assert_close(torch.autograd.grad(loss, queries)[0], torch.autograd.grad(combined, queries)[0])


@pytest.mark.parametrize("loss_class", [NPairsMCLoss, NPairsOVOLoss])
def test_no_positive_pair_gives_zero_losses(loss_class):
    embeddings = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    labels = torch.arange(6)
    loss_fn = loss_class(l2_reg_weight=0)
    loss = loss_fn(embeddings, labels)
    loss.backward()
    assert loss.item() == 0 and loss_fn.num_pairs == 0
    assert torch.count_nonzero(embeddings.grad) == 0
    # With the penalty on, only the penalty remains.
    penalized = loss_class()(embeddings, labels)
    torch.testing.assert_close(penalized, reference.npairs_loss(embeddings, labels, l2_reg_weight=0.002))
    assert penalized > 0


def test_a_single_pair_has_no_negatives_and_zero_loss():
    embeddings = torch.randn(3, 4, dtype=torch.float64)
    labels = torch.tensor([1, 2, 1])
    for loss_class in (NPairsMCLoss, NPairsOVOLoss):
        assert loss_class(l2_reg_weight=0)(embeddings, labels).item() == 0


@pytest.mark.parametrize("loss_class", [NPairsMCLoss, NPairsOVOLoss])
def test_non_finite_embeddings_are_an_error_naming_the_loss(loss_class):
    embeddings = torch.randn(4, 3)
    embeddings[1, 2] = float("nan")
    with pytest.raises(ValueError, match=f"{loss_class.__name__}: embeddings contains 1 NaN/Inf"):
        loss_class()(embeddings, torch.tensor([0, 0, 1, 1]))


def test_bad_parameters_are_errors():
    with pytest.raises(ValueError, match="NPairsMCLoss: l2_reg_weight must be a finite number >= 0, got -1"):
        NPairsMCLoss(l2_reg_weight=-1)
    with pytest.raises(ValueError, match="NPairsOVOLoss: l2_reg_weight must be a finite number >= 0, got inf"):
        NPairsOVOLoss(l2_reg_weight=float("inf"))
    with pytest.raises(ValueError, match="pass l2_reg_weight=0 to use your own embedding_regularizer"):
        NPairsMCLoss(embedding_regularizer=LpRegularizer())
    own = NPairsMCLoss(l2_reg_weight=0, embedding_regularizer=LpRegularizer())
    assert isinstance(own.embedding_regularizer, LpRegularizer)


def test_penalty_is_a_separate_sub_loss_and_weight_zero_switches_it_off():
    assert NPairsMCLoss().sub_loss_names() == ["loss", "embedding_reg_loss"]
    assert NPairsMCLoss(l2_reg_weight=0).sub_loss_names() == ["loss"]
    assert NPairsMCLoss().l2_reg_weight == 0.002 and "l2_reg_weight" in NPairsMCLoss()._record_these


def test_efficient_distributed_call_uses_gathered_positives():
    """What DistributedLossWrapper(efficient=True) passes on rank 0 of two: the local
    batch as anchors, everything gathered as ref_emb, all pairs without self-pairs.
    When the other rank holds other classes, this is the loss of the local batch."""
    generator = torch.Generator().manual_seed(8)
    local = torch.randn(8, 5, generator=generator, dtype=torch.float64, requires_grad=True)
    local_labels = torch.tensor([3, 1, 3, 0, 1, 2, 0, 2])
    other = torch.randn(8, 5, generator=generator, dtype=torch.float64)
    all_emb, all_labels = torch.cat([local, other]), torch.cat([local_labels, local_labels + 10])
    indices_tuple = pml_dist.get_indices_tuple(local_labels, all_labels)
    for mode, loss_class in (("mc", NPairsMCLoss), ("ovo", NPairsOVOLoss)):
        loss = loss_class()(local, local_labels, indices_tuple, all_emb, all_labels)
        expected = reference.npairs_loss(local, local_labels, mode, 0.002)
        torch.testing.assert_close(loss, expected)
        torch.testing.assert_close(torch.autograd.grad(loss, local)[0], torch.autograd.grad(expected, local)[0])


@pytest.mark.parametrize("efficient", [False, True])
def test_works_inside_distributed_loss_wrapper(tmp_path, efficient):
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        embeddings, labels = random_batch(9)
        wrapped = pml_dist.DistributedLossWrapper(NPairsMCLoss(), efficient=efficient)
        assert_same(value_and_grad(wrapped, embeddings, labels), value_and_grad(NPairsMCLoss(), embeddings, labels))
    finally:
        torch.distributed.destroy_process_group()


def test_losses_are_registered():
    assert pml_rank.registry.losses()["NPairsMCLoss"] is NPairsMCLoss
    assert pml_rank.registry.losses()["NPairsOVOLoss"] is NPairsOVOLoss
