"""pml_rank.ranking: blackbox ranking (RaMBO Algorithm 1), the AP / mAP / APC losses, and
the scale of the incoming gradient, against the straightforward reference."""

import math

import pytest
import torch

from pml_rank import ranking
from pml_rank.harness.references import rambo as reference


def seeded(*shape, seed=0, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def targets_like(scores, rate=0.2, seed=1):
    return torch.rand(scores.shape, generator=torch.Generator().manual_seed(seed)) < rate


def grad_of(fn, x):
    x = x.detach().clone().requires_grad_()
    value = fn(x)
    (grad,) = torch.autograd.grad(value, x)
    return value.detach(), grad


def tie_broken_ranks(scores):
    """Eq. 2 with ties broken by position, written as loops."""
    flat = scores.reshape(-1, scores.shape[-1]).tolist()
    ranks = [
        [1 + sum(y > row[i] or (y == row[i] and j < i) for j, y in enumerate(row)) for i in range(len(row))]
        for row in flat
    ]
    return torch.tensor(ranks).view(scores.shape)


@pytest.mark.parametrize("shape", [(7,), (3, 50), (2, 3, 20)])
def test_ranks_are_the_references_normalised_by_length(shape):
    scores = seeded(*shape)
    ranks = ranking.blackbox_rank(scores, 1.0)
    assert torch.allclose(ranks * shape[-1], reference.rank(scores).double(), rtol=0, atol=1e-9)
    assert ranks.min() == 1 / shape[-1] and ranks.max() == 1


def test_ties_are_ranked_by_position():
    scores = torch.randint(0, 4, (5, 12), generator=torch.Generator().manual_seed(3)).double()
    ranks = ranking.blackbox_rank(scores, 1.0) * 12
    assert torch.equal(ranks.round().long(), tie_broken_ranks(scores))


@pytest.mark.parametrize("lambda_val", [0.1, 1.0, 20.0])
@pytest.mark.parametrize("shape", [(40,), (4, 30)])
def test_gradient_is_algorithm_1_of_the_reference(lambda_val, shape):
    scores, weights = seeded(*shape), seeded(*shape, seed=5)
    _, ours = grad_of(lambda y: (ranking.blackbox_rank(y, lambda_val) * weights).sum(), scores)
    _, ref = grad_of(lambda y: (reference.BlackboxRanker.apply(y, lambda_val) * weights).sum(), scores)
    assert torch.allclose(ours, ref, atol=1e-12)
    assert ours.abs().sum() > 0


def test_perturbed_ties_keep_forward_order():
    gen = torch.Generator().manual_seed(4)
    scores = torch.randint(0, 5, (6, 15), generator=gen).double()
    incoming = torch.randint(-2, 3, (6, 15), generator=gen).double()
    lambda_val = 1.0
    _, grad = grad_of(lambda y: (ranking.blackbox_rank(y, lambda_val) * incoming).sum(), scores)
    forward = tie_broken_ranks(scores)
    perturbed = scores + lambda_val * incoming
    # Perturbed order: higher perturbed value first, ties by forward rank.
    expected = torch.empty_like(forward)
    for row in range(6):
        keys = sorted(range(15), key=lambda i: (-perturbed[row, i].item(), forward[row, i].item()))
        for position, i in enumerate(keys):
            expected[row, i] = position + 1
    assert torch.allclose(grad, -(forward - expected).double() / 15 / lambda_val)


def test_ranks_among_positives_count_positives_in_sorted_order():
    scores = seeded(5, 40)
    positives = targets_like(scores, 0.3)
    _, order = ranking.blackbox_rank(scores, 1.0, return_order=True)
    index, among = ranking.ranks_among_positives(positives, order)
    expected = reference.rank_among_positives(scores, positives)
    assert torch.equal(among, expected[index])
    assert positives[index].all() and len(among) == positives.sum()


@pytest.mark.parametrize("margin", [0.0, 0.3])
@pytest.mark.parametrize("lambda_val", [0.5, 4.0])
@pytest.mark.parametrize("shape", [(300,), (6, 80)])
def test_ap_loss_equals_reference(shape, lambda_val, margin):
    scores = seeded(*shape)
    targets = targets_like(scores)
    ours = grad_of(lambda y: ranking.average_precision_loss(y, targets, lambda_val, margin), scores)
    ref = grad_of(lambda y: reference.average_precision_loss(y, targets, lambda_val, margin), scores)
    assert torch.allclose(ours[0], ref[0], atol=1e-12)
    assert torch.allclose(ours[1], ref[1], atol=1e-12)
    assert ours[1].abs().sum() > 0


def test_ap_without_margin_is_one_minus_average_precision():
    scores = seeded(60)
    targets = targets_like(scores, 0.3)
    positives = [i for i in range(60) if targets[i]]
    precisions = [sum(scores[j] >= scores[i] for j in positives) / sum(scores >= scores[i]) for i in positives]
    expected = 1 - sum(precisions) / len(precisions)
    assert ranking.average_precision_loss(scores, targets, margin=0).item() == pytest.approx(float(expected))


@pytest.mark.parametrize("apc_weight", [0.0, 1 / 3, 1.0])
def test_map_loss_equals_reference(apc_weight):
    scores = seeded(32, 6)
    targets = targets_like(scores, 0.25)
    targets[:, 2] = False  # a class absent from the batch is left out of the mean
    ours = grad_of(lambda y: ranking.map_loss(y, targets, 0.5, 0.15, apc_weight), scores)
    ref = grad_of(lambda y: reference.map_loss(y, targets, 0.5, 0.15, apc_weight), scores)
    assert torch.allclose(ours[0], ref[0], atol=1e-12)
    assert torch.allclose(ours[1], ref[1], atol=1e-12)


def test_map_loss_defaults_are_the_papers_detection_values():
    scores = seeded(16, 4)
    targets = targets_like(scores, 0.3)
    assert ranking.map_loss(scores, targets).item() == pytest.approx(
        reference.map_loss(scores, targets, 0.5, 0.15, 1 / 3).item()
    )


def test_apc_loss_ranks_all_scores_as_one_sequence():
    scores = seeded(10, 5)
    targets = targets_like(scores, 0.3)
    assert ranking.apc_loss(scores, targets).item() == pytest.approx(
        ranking.average_precision_loss(scores.reshape(-1), targets.reshape(-1)).item()
    )
    assert ranking.map_loss(scores, targets, apc_weight=1.0).item() == pytest.approx(
        ranking.apc_loss(scores, targets).item()
    )


def test_no_positive_gives_zero_loss_and_zero_gradient():
    loss, grad = grad_of(lambda y: ranking.average_precision_loss(y, torch.zeros(20, dtype=torch.bool)), seeded(20))
    assert loss.item() == 0 and torch.equal(grad, torch.zeros(20, dtype=torch.float64))


# Scale of the incoming gradient.


@pytest.mark.parametrize("k", [0.5, 3.0])
def test_algorithm_1_turns_a_loss_factor_into_a_lambda_factor(k):
    """The reference: ∇(k·L) with λ equals k·∇L with k·λ, and differs from k·∇L with λ."""
    embeddings, labels = seeded(24, 6), torch.arange(24) // 4
    _, scaled = grad_of(lambda e: k * reference.recall_loss(e, labels, 0.2, 0.02), embeddings)
    _, moved_lambda = grad_of(lambda e: reference.recall_loss(e, labels, 0.2 * k, 0.02), embeddings)
    _, same_lambda = grad_of(lambda e: reference.recall_loss(e, labels, 0.2, 0.02), embeddings)
    assert torch.allclose(scaled, k * moved_lambda, atol=1e-12)
    assert not torch.allclose(scaled, k * same_lambda, atol=1e-6)


@pytest.mark.parametrize("k", [0.5, 3.0, 64.0])
def test_our_losses_keep_lambda_whatever_multiplies_them(k):
    scores = seeded(5, 60)
    targets = targets_like(scores)
    for loss in (ranking.average_precision_loss, ranking.map_loss):
        _, plain = grad_of(lambda y: loss(y, targets, 0.5), scores)
        _, scaled = grad_of(lambda y: k * loss(y, targets, 0.5), scores)
        assert torch.allclose(scaled, k * plain, atol=1e-12)


def test_a_zero_loss_weight_gives_a_zero_gradient():
    _, grad = grad_of(lambda y: 0 * ranking.average_precision_loss(y, targets_like(y)), seeded(50))
    assert torch.equal(grad, torch.zeros(50, dtype=torch.float64))


def test_blackbox_rank_without_loss_scale_is_plain_algorithm_1():
    scores, weights = seeded(50), seeded(50, seed=2)
    _, ours = grad_of(lambda y: 3 * (ranking.blackbox_rank(y, 0.5) * weights).sum(), scores)
    _, ref = grad_of(lambda y: 3 * (reference.BlackboxRanker.apply(y, 0.5) * weights).sum(), scores)
    assert torch.allclose(ours, ref, atol=1e-12)


# Bad input.


@pytest.mark.parametrize("lambda_val", [0, -1.0, float("inf"), float("nan")])
def test_bad_lambda_is_rejected(lambda_val):
    with pytest.raises(ValueError, match="blackbox_rank: lambda_val must be a finite number > 0"):
        ranking.blackbox_rank(seeded(5), lambda_val)


def test_integer_scores_are_rejected():
    with pytest.raises(TypeError, match="blackbox_rank: scores must be a floating-point tensor"):
        ranking.blackbox_rank(torch.arange(5), 1.0)


def test_non_finite_scores_are_rejected_naming_the_loss():
    scores = seeded(10)
    scores[3] = float("nan")
    with pytest.raises(
        ValueError, match=r"average_precision_loss: scores contains 1 NaN/Inf value\(s\), first at index \(3,\)"
    ):
        ranking.average_precision_loss(scores, targets_like(scores))


def test_bad_targets_are_rejected():
    scores = seeded(4, 3)
    # The shapes as given ([batch, classes]), not transposed as the ranking of each class reads them.
    with pytest.raises(ValueError, match=r"map_loss: targets must have the shape of scores \(4, 3\), got \(4, 2\)"):
        ranking.map_loss(scores, torch.zeros(4, 2))
    with pytest.raises(ValueError, match="average_precision_loss: targets must be 0/1 or boolean"):
        ranking.average_precision_loss(scores, torch.full((4, 3), 0.5))


def test_map_loss_wants_a_batch_of_class_scores():
    with pytest.raises(ValueError, match=r"map_loss: scores must have shape \[batch, classes\], got \(5,\)"):
        ranking.map_loss(seeded(5), torch.zeros(5))
    with pytest.raises(ValueError, match="map_loss: apc_weight must be in"):
        ranking.map_loss(seeded(5, 2), torch.zeros(5, 2), apc_weight=1.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    "shape, keyed", [((3000,), False), ((4, 750), False), ((9000,), True), ((1, 9000), True), ((4, 2250), True)]
)
def test_descending_order_is_a_stable_descending_sort(dtype, shape, keyed):
    """Many scores on a CPU are sorted by integer keys, a few as floats; ties, signed zeros
    and infinities must come out as a stable float sort puts them."""
    assert (math.prod(shape) >= ranking._KEYS_FROM) == keyed  # both ways tested
    x = torch.randint(-3, 4, shape, generator=torch.Generator().manual_seed(8)).to(dtype)
    flat = x.view(-1)
    flat[::7], flat[::11], flat[::13] = -0.0, 1e-30, -1e-30
    flat[::17], flat[::19] = float("inf"), -float("inf")
    assert torch.equal(ranking.descending_order(x), torch.sort(x, dim=-1, descending=True, stable=True).indices)


def sorted_blackbox_ranks_of_positives(scores, positives, lambda_val):
    """`blackbox_ranks_of_positives` through the sorting path."""
    ranks, order = ranking.blackbox_rank(scores, lambda_val, return_order=True)
    index, among = ranking.ranks_among_positives(positives, order)
    return index, ranks[index], among


@pytest.mark.parametrize("seed", range(4))
def test_counting_and_sorting_give_the_same_ranks_and_gradients_even_with_ties(seed, either_policy):
    """Few positives per sequence are ranked by counting crossings; the result must be
    the sorting path's exactly, ties included (integer scores and steps)."""
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randint(0, 4, (6, 25), generator=gen).double()
    positives = torch.rand(6, 25, generator=gen) < 0.15
    incoming = torch.randint(-2, 3, (int(positives.sum()),), generator=gen).double()
    results = []
    for path in (ranking._CountedRanks.apply, None):
        x = scores.clone().requires_grad_()
        if path is None:
            index, ranks, among = sorted_blackbox_ranks_of_positives(x, positives, 1.0)
        else:
            ranks, among, *index = path(x, positives, 1.0, None)
        # The same incoming gradient per positive, whatever order each path lists them in.
        per_element = torch.zeros(6, 25, dtype=torch.float64)
        per_element[positives] = incoming
        (ranks * per_element[tuple(index)]).sum().backward()
        dense_ranks = torch.zeros(6, 25, dtype=torch.float64).index_put(tuple(index), ranks.detach())
        dense_among = torch.zeros(6, 25, dtype=torch.long).index_put(tuple(index), among)
        results.append((dense_ranks, dense_among, x.grad))
    for counted, sorted_ in zip(*results):
        assert torch.equal(counted, sorted_)


def test_blackbox_ranks_of_positives_counts_when_positives_are_few():
    scores = seeded(8, 64)
    positives = torch.zeros(8, 64, dtype=torch.bool)
    positives[:, [5, 40]] = True
    positives[2, 7] = True  # at most log2(64) / 2 = 3 per sequence: the counting path
    index, ranks, among = ranking.blackbox_ranks_of_positives(scores, positives, 0.5)
    expected_index, expected_ranks, expected_among = sorted_blackbox_ranks_of_positives(scores, positives, 0.5)
    order = torch.argsort(index[0] * 64 + index[1])
    expected_order = torch.argsort(expected_index[0] * 64 + expected_index[1])
    assert torch.equal(ranks[order], expected_ranks[expected_order])
    assert torch.equal(among[order], expected_among[expected_order])


def test_a_loss_scaled_in_place_keeps_lambda():
    """PML trainers multiply the loss by its weight in place."""
    scores, targets = seeded(80), targets_like(seeded(80))
    _, plain = grad_of(lambda y: ranking.average_precision_loss(y, targets), scores)

    def scaled_in_place(y):
        loss = ranking.average_precision_loss(y, targets)
        loss *= 3
        return loss

    _, scaled = grad_of(scaled_in_place, scores)
    assert torch.allclose(scaled, 3 * plain, atol=1e-12)
