"""The numeric kernels made fast stay exact: values and gradients against the
straightforward references and PML on seeded data, large-norm inputs and steep
sigmoids included (where exponent arguments leave float range), no denormal in the
gradients they produce, and counted ranks equal to sorted ones in tied and untied
sequences side by side."""

import math

import pytest
import torch
from pytorch_metric_learning import losses as pml_losses
from pytorch_metric_learning.distances import CosineSimilarity, DotProductSimilarity
from pytorch_metric_learning.utils import loss_and_miner_utils as lmu

from pml_rank import _device_policy, ranking
from pml_rank.harness.references import auc as auc_reference
from pml_rank.harness.references import npairs as npairs_reference
from pml_rank.losses import AUCLoss, NPairsMCLoss, NPairsOVOLoss, PNPLoss, query_panels
from pml_rank.losses.auc import relaxed_roc_area, thresholds
from pml_rank.losses.base import label_pairs_and_counts, pair_masks
from pml_rank.losses.npairs import EXP_FLOOR
from pml_rank.losses.pnp import MeanPenalty
from pml_rank.losses.recall_at_k import PAPER_K_VALUES, recall_formula
from pml_rank.losses.roadmap import supap
from pml_rank.losses.smooth_ap import smooth_ap


def value_and_grad(loss_fn, embeddings, *args):
    embeddings = embeddings.detach().clone().requires_grad_()
    loss = loss_fn(embeddings, *args)
    loss.backward()
    return loss.detach(), embeddings.grad


def large_norm_pairs(seed, pairs=12, dim=8, scale=6.0, dtype=torch.float64):
    """Two samples per class, inner products of a few hundred: most exp arguments of the
    N-pair losses lie below -87 (float32 underflow) and below EXP_FLOOR, none above 700
    (so that the float64 reference does not overflow)."""
    generator = torch.Generator().manual_seed(seed)
    embeddings = torch.randn(2 * pairs, dim, generator=generator, dtype=dtype) * scale
    return embeddings, torch.arange(2 * pairs) // 2


def denormals(tensor):
    return int(((tensor != 0) & (tensor.abs() < torch.finfo(tensor.dtype).tiny)).sum())


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("mode, loss_class", [("mc", NPairsMCLoss), ("ovo", NPairsOVOLoss)])
def test_npairs_large_norms_equal_reference_in_float64(seed, mode, loss_class):
    embeddings, labels = large_norm_pairs(seed)
    f = embeddings[::2] @ embeddings[1::2].T
    margins = f - f.diagonal().unsqueeze(1)
    assert margins.min() < -200 and margins.max() < 700  # far past the clamp, still finite for the reference
    ours = value_and_grad(loss_class(), embeddings, labels)
    expected = value_and_grad(lambda e, lab: npairs_reference.npairs_loss(e, lab, mode, 0.002), embeddings, labels)
    torch.testing.assert_close(ours, expected)


@pytest.mark.parametrize("mode, loss_class", [("mc", NPairsMCLoss), ("ovo", NPairsOVOLoss)])
def test_npairs_large_norms_in_float32_match_float64(mode, loss_class):
    embeddings, labels = large_norm_pairs(5)
    ours = value_and_grad(loss_class(), embeddings.float(), labels)
    expected = value_and_grad(lambda e, lab: npairs_reference.npairs_loss(e, lab, mode, 0.002), embeddings, labels)
    torch.testing.assert_close(ours[0].double(), expected[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours[1].double(), expected[1], rtol=1e-4, atol=1e-5)


def test_npairs_mc_equals_pml_at_the_speed_harness_underflow_scale():
    # The harness's no-slow-path inputs: dim 512, 30 times the usual norm. PML's
    # NPairsLoss (cross entropy, log-sum-exp) is exact there, if slow on some CPUs.
    generator = torch.Generator().manual_seed(0)
    embeddings = torch.randn(64, 512, generator=generator) * 30
    labels = torch.arange(64) // 2
    distance = DotProductSimilarity(normalize_embeddings=False)
    ours = value_and_grad(NPairsMCLoss(l2_reg_weight=0), embeddings, labels)
    pml = value_and_grad(pml_losses.NPairsLoss(distance=distance), embeddings, labels)
    torch.testing.assert_close(ours, pml)


@pytest.mark.parametrize("loss_class", [NPairsMCLoss, NPairsOVOLoss])
def test_npairs_similarity_gradient_has_no_denormals(loss_class):
    generator = torch.Generator().manual_seed(1)
    # Rows spread over thousands: every exp/sigmoid argument class, in float32.
    similarities = (torch.randn(256, 256, generator=generator) * 3000).requires_grad_()
    losses = loss_class().per_anchor_losses(similarities)
    losses.sum().backward()
    assert torch.isfinite(losses).all() and torch.isfinite(similarities.grad).all()
    assert denormals(similarities.grad) == 0 and denormals(losses) == 0
    # Exact: per row, the log-sum-exp (mc) or the sum of softplus terms (ovo) in float64.
    margins = similarities.detach().double() - similarities.detach().double().diagonal().unsqueeze(1)
    if loss_class is NPairsMCLoss:
        expected = torch.logsumexp(margins, dim=1)
    else:
        expected = torch.nn.functional.softplus(margins.fill_diagonal_(-math.inf)).sum(1)
    torch.testing.assert_close(losses.detach().double(), expected, rtol=1e-6, atol=1e-3)


def test_npairs_terms_below_the_floor_are_below_float_precision():
    # What leaving out exp(EXP_FLOOR) per term costs a row of a million: nothing float64 resolves.
    assert 1e6 * math.exp(EXP_FLOOR) < torch.finfo(torch.float64).eps


def reference_area(positive, negative, grid, slope):
    """The rates without any clamping, in float64."""
    tpr = torch.sigmoid(slope * (positive.unsqueeze(-1) - grid)).mean(-2)
    fpr = torch.sigmoid(slope * (negative.unsqueeze(-1) - grid)).mean(-2)
    return ((tpr[..., :-1] + tpr[..., 1:]) * (fpr[..., :-1] - fpr[..., 1:])).sum(-1) / 2


@pytest.mark.parametrize("slope_factor", [1, 10, 100])
@pytest.mark.parametrize("shape", [(300,), (3, 50)])
def test_relaxed_area_with_steep_sigmoids_equals_the_unclamped_formula(slope_factor, shape):
    generator = torch.Generator().manual_seed(slope_factor)
    positive = (torch.rand(shape, generator=generator, dtype=torch.float64) * 1.2 - 0.3).requires_grad_()
    negative = (torch.rand(shape, generator=generator, dtype=torch.float64) * 1.2 - 0.9).requires_grad_()
    slope = AUCLoss().slope * slope_factor
    grid = thresholds(0.005, dtype=torch.float64)
    assert (slope * (positive.detach().unsqueeze(-1) - grid)).abs().max() > 87  # out of float32 exp range
    ours = relaxed_roc_area(positive, negative, grid, slope)
    expected = reference_area(positive, negative, grid, slope)
    torch.testing.assert_close(ours, expected)
    grads = torch.autograd.grad(ours.sum(), (positive, negative))
    expected_grads = torch.autograd.grad(expected.sum(), (positive, negative))
    torch.testing.assert_close(grads, expected_grads)


def test_relaxed_area_gradient_in_float32_has_no_denormals():
    generator = torch.Generator().manual_seed(0)
    positive = (torch.rand(2048, generator=generator) * 0.6).requires_grad_()
    negative = (torch.rand(2048, generator=generator) * 0.6 - 0.3).requires_grad_()
    area = relaxed_roc_area(positive, negative, thresholds(0.005), 10 * AUCLoss().slope)
    area.backward()
    assert denormals(positive.grad) == 0 and denormals(negative.grad) == 0
    expected = reference_area(
        positive.detach().double(),
        negative.detach().double(),
        thresholds(0.005, dtype=torch.float64),
        10 * AUCLoss().slope,
    )
    torch.testing.assert_close(area.detach().double(), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("seed", range(3))
def test_auc_loss_with_its_steep_default_sigmoid_equals_algorithm_1(seed):
    # slope · (score − threshold) reaches ±680: far out of float32's exp range, still in
    # float64's, where the reference's 1 / (1 + exp(−x)) has finite gradients (steeper
    # slopes: the relaxed-area tests above, against torch.sigmoid).
    generator = torch.Generator().manual_seed(seed)
    embeddings = torch.randn(24, 6, generator=generator, dtype=torch.float64) * 30  # large norms, cosine anyway
    labels = torch.randint(5, (24,), generator=generator)
    loss = AUCLoss()
    ours = value_and_grad(loss, embeddings, labels)
    expected = value_and_grad(
        lambda e, lab: auc_reference.auc_bh_loss(e, lab, loss.step, loss.slope), embeddings, labels
    )
    torch.testing.assert_close(ours, expected)


def test_auc_loss_with_ref_emb_equals_algorithm_1_after_the_single_gather():
    generator = torch.Generator().manual_seed(3)
    embeddings = torch.randn(16, 5, generator=generator, dtype=torch.float64)
    refs = torch.randn(20, 5, generator=generator, dtype=torch.float64).requires_grad_()
    labels, ref_labels = torch.randint(4, (16,), generator=generator), torch.randint(4, (20,), generator=generator)
    loss = AUCLoss()
    ours = value_and_grad(lambda e, lab: loss(e, lab, ref_emb=refs, ref_labels=ref_labels), embeddings, labels)
    ref_grad = refs.grad.clone()
    refs.grad = None
    expected = value_and_grad(
        lambda e, lab: auc_reference.auc_bh_loss(e, lab, loss.step, loss.slope, ref_emb=refs, ref_labels=ref_labels),
        embeddings,
        labels,
    )
    torch.testing.assert_close(ours, expected)
    torch.testing.assert_close(ref_grad, refs.grad)


def sorted_ranks(scores, positives, lambda_val, incoming):
    x = scores.clone().requires_grad_()
    ranks, order = ranking.blackbox_rank(x, lambda_val, None, return_order=True)
    index, among = ranking.ranks_among_positives(positives, order)
    (ranks[index] * incoming[index]).sum().backward()
    return dense(ranks[index].detach(), index, scores), dense(among, index, scores), x.grad


def dense(values, index, like):
    return torch.zeros(like.shape, dtype=values.dtype).index_put(tuple(index), values)


def test_counted_ranks_redo_exactly_the_sequences_tied_before_the_perturbation(monkeypatch, either_policy):
    """Distinct float32 scores (multiples of 1/64, so perturbed values are exact); then a
    tie before the perturbation in sequence 1, perturbed positives meeting a negative
    (sequences 2 and 4: moving up and down), another perturbed positive (3) or one that
    stays (5). The counted path equals the sorted one everywhere; only sequence 1 needs
    the exact pass (ties with perturbed values are counted in forward order directly)."""
    rows, n, lambda_val = 8, 40, 1.0
    generator = torch.Generator().manual_seed(0)
    scores = torch.randperm(rows * n, generator=generator).view(rows, n).float() / 64
    positives = torch.zeros(rows, n, dtype=torch.bool)
    positives[:, [3, 17, 30]] = True
    incoming = torch.zeros(rows, n)
    incoming[positives] = torch.tensor([1.0, -2.0, 2.0]).repeat(rows)
    scores[1, 5] = scores[1, 17]  # tie with a positive before
    scores[2, 9] = scores[2, 3] + lambda_val * 1.0  # meets positive 3 after its step of +1
    scores[3, 30] = scores[3, 17] - 4.0  # positives 17 (-2) and 30 (+2) meet after
    scores[4, 11] = scores[4, 17] - 2.0  # positive 17 moves down onto a negative below it
    incoming[5, 3] = 0.0  # positive 3 stays; positive 30 (+2) moves onto it from below
    scores[5, 30] = scores[5, 3] - 2.0
    redone = []
    exact = ranking._crossings
    monkeypatch.setattr(ranking, "_crossings", lambda s, *rest: redone.append(len(s)) or exact(s, *rest))
    x = scores.clone().requires_grad_()
    ranks, among, *index = ranking._CountedRanks.apply(x, positives, lambda_val, None)
    (ranks * incoming[tuple(index)]).sum().backward()
    counted = dense(ranks.detach(), index, scores), dense(among, index, scores), x.grad
    for got, expected in zip(counted, sorted_ranks(scores, positives, lambda_val, incoming)):
        assert torch.equal(got, expected)
    assert redone == [1]  # sequence 1 alone


@pytest.mark.parametrize("seed", range(3))
def test_counted_ranks_equal_sorted_ones_on_float32_cosine_similarities(seed, either_policy):
    # Batch-sized rows of float32 cosines: a few exact ties per batch are to be expected.
    generator = torch.Generator().manual_seed(seed)
    embeddings = torch.nn.functional.normalize(torch.randn(256, 16, generator=generator), dim=1)
    scores = embeddings @ embeddings.T
    labels = torch.arange(256) // 4
    positives = labels[:, None] == labels[None, :]
    incoming = torch.randn(256, 256, generator=generator)
    x = scores.clone().requires_grad_()
    ranks, among, *index = ranking._CountedRanks.apply(x, positives, 0.2, None)
    (ranks * incoming[tuple(index)]).sum().backward()
    counted = dense(ranks.detach(), index, scores), dense(among, index, scores), x.grad
    for got, expected in zip(counted, sorted_ranks(scores, positives, 0.2, incoming)):
        assert torch.equal(got, expected)


def test_fastap_antipodal_pairs_put_their_weight_on_the_last_centre():
    # Distance exactly 4 (cos = -1): the position is the last centre itself; the kernel
    # takes the frac of the position and moves those pairs to the last bin.
    from pml_rank.harness.references.fastap import fast_ap_loss
    from pml_rank.losses import FastAPLoss

    x = torch.randn(8, 5, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    embeddings, labels = torch.cat([x, -x]), torch.arange(16) % 3
    ours = value_and_grad(FastAPLoss(), embeddings, labels)
    expected = value_and_grad(fast_ap_loss, embeddings, labels)
    torch.testing.assert_close(ours, expected)


@pytest.mark.parametrize("n", [1, 5, 256, 300, 600])
def test_symmetrize_in_place_equals_matrix_plus_transpose(n):
    from pml_rank.losses.base import symmetrize_

    matrix = torch.randn(n, n, generator=torch.Generator().manual_seed(n))
    assert torch.equal(symmetrize_(matrix.clone()), matrix + matrix.T)


def fastap_inputs(case, dtype):
    generator = torch.Generator().manual_seed(7)
    embeddings = torch.randn(50, 6, generator=generator, dtype=dtype)
    labels = torch.randint(0, 6, (50,), generator=generator)
    if case == "antipodal":  # distances exactly 4 in the last rows: the last-centre fix, chunk by chunk
        embeddings[40:] = -embeddings[:10]
    kwargs = {}
    if case == "mined":
        a1, p, a2, n = lmu.get_all_pairs_indices(labels)
        kwargs["indices_tuple"] = (a1[::2], p[::2], a2[::3], n[::3])
    if case == "ref_emb":
        kwargs["ref_emb"] = torch.randn(30, 6, generator=generator, dtype=dtype).requires_grad_()
        kwargs["ref_labels"] = torch.randint(0, 6, (30,), generator=generator)
    return embeddings, labels, kwargs


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("case", ["batch", "antipodal", "mined", "ref_emb"])
def test_fastap_histograms_scattered_a_few_rows_at_a_time_are_the_same(case, dtype, monkeypatch):
    """The forward pass scatters its histograms one chunk of rows at a time. Chunks of
    3 rows (16 full chunks and a partial one) give exactly the one-chunk value and
    gradients, which equal the reference's."""
    from pml_rank.harness.references.fastap import fast_ap_loss
    from pml_rank.losses import FastAPLoss, fastap

    embeddings, labels, kwargs = fastap_inputs(case, dtype)

    def run():
        x = embeddings.clone().requires_grad_()
        loss = FastAPLoss()(x, labels, **kwargs)
        refs = kwargs.get("ref_emb")
        grads = torch.autograd.grad(loss, [x] + ([refs] if refs is not None else []))
        return (loss.detach(), *grads)

    one_chunk = run()
    monkeypatch.setattr(fastap, "CACHE_CHUNK_ENTRIES", 3 * 50)  # 3 rows of the 50 references a chunk
    assert len(fastap._row_chunks(50, 50, torch.device("cpu"))) == 17
    for got, expected in zip(run(), one_chunk, strict=True):
        assert torch.equal(got, expected)
    if dtype == torch.float64 and case != "mined":  # the reference takes labels, not pairs
        x = embeddings.clone().requires_grad_()
        refs = {k: v for k, v in kwargs.items() if k.startswith("ref")}
        expected = fast_ap_loss(x, labels, **refs)
        torch.testing.assert_close(one_chunk[0], expected.detach(), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(one_chunk[1], torch.autograd.grad(expected, x)[0], rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("n", [1, 2, 5, 300])
def test_similarities_without_self_have_autograds_gradient(n, normalize):
    # 300 rows: more than one block of symmetrize_, and a row of zeros and one shorter
    # than the normalisation's eps (its norm clamped: a gradient of g / eps), which
    # finite differences cannot check.
    from pml_rank.losses.base import normalized
    from pml_rank.losses.rambo import _SimilaritiesWithoutSelf, without_self

    def similarities(x):
        return _SimilaritiesWithoutSelf.apply(normalized(CosineSimilarity(), x) if normalize else x)

    generator = torch.Generator().manual_seed(n)
    embeddings = torch.randn(n, 4, generator=generator, dtype=torch.float64)
    if n == 300:
        embeddings[1] = 0
        embeddings[3] *= 1e-14
    incoming = torch.randn(n, n - 1, generator=generator, dtype=torch.float64)
    ours = value_and_grad(lambda x: (similarities(x) * incoming).sum(), embeddings)

    def expected_similarities(x):
        queries = torch.nn.functional.normalize(x) if normalize else x
        return without_self(queries @ queries.T)

    expected = value_and_grad(lambda x: (expected_similarities(x) * incoming).sum(), embeddings)
    torch.testing.assert_close(ours, expected, rtol=1e-12, atol=1e-12)
    if n <= 5:
        x = embeddings.clone().requires_grad_()
        assert torch.autograd.gradcheck(similarities, x)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(
    "distance", [None, DotProductSimilarity(), DotProductSimilarity(normalize_embeddings=False)], ids=str
)
def test_rambo_inner_products_equal_pmls_distance_and_autograd(distance, dtype, monkeypatch):
    """RaMBO computes a batch's inner products (cosine by default) with its own backward
    pass; PML's distance object and autograd give the same loss, gradient and stats."""
    from pml_rank.losses import RaMBORecallLoss, rambo

    generator = torch.Generator().manual_seed(11)
    embeddings = torch.randn(64, 8, generator=generator, dtype=dtype)
    labels = torch.arange(64) // 4
    kwargs = {} if distance is None else {"distance": distance}

    def run():
        loss = RaMBORecallLoss(memory_size=0, lambda_val=1.0, **kwargs)
        loss.distance.collect_stats = True
        value, grad = value_and_grad(lambda e: loss(e, labels), embeddings)
        return value, grad, loss.distance.initial_avg_query_norm

    ours = run()
    monkeypatch.setattr(rambo, "is_inner_product", lambda distance: False)
    expected = run()
    assert ours[1].abs().sum() > 0
    if dtype == torch.float64:
        torch.testing.assert_close(ours, expected, rtol=1e-12, atol=1e-12)
    else:
        torch.testing.assert_close(ours, expected)


@pytest.mark.parametrize(
    "dtype, length, expected",
    [
        (torch.float16, 100, torch.float32),
        (torch.float32, 2**24 - 1, torch.float32),
        (torch.float32, 2**24, torch.float64),  # float32 counts stop being exact
        (torch.float64, 100, torch.float64),
    ],
)
def test_counts_are_summed_in_a_type_where_they_are_exact(dtype, length, expected):
    scores = torch.zeros(1, 1, dtype=dtype).expand(3, length)  # no memory for the long rows
    assert ranking._count_dtype(scores) == expected


def test_float16_comparisons_count_past_2048_exactly(either_policy):
    """Under an accelerator's policy the comparisons are float16, whose integers end at
    2048; they are summed into float32, so longer sequences still count exactly."""
    generator = torch.Generator().manual_seed(5)
    scores = torch.randperm(3 * 5000, generator=generator).view(3, 5000).float()
    values = scores[:, [7, 2500, 4999]]
    greater = ranking._counts(scores, values)[0]
    assert ranking._comparison_dtype(scores) == (torch.float16 if either_policy == "memory" else torch.float32)
    assert torch.equal(greater, (scores[:, None, :] > values[:, :, None]).sum(-1, dtype=torch.int32))
    assert greater.max() > 2048


def test_counted_ranks_over_many_chunks_equal_sorted_ones(monkeypatch, either_policy):
    """The comparisons run a chunk of sequences at a time: chunks of 3 sequences (and a
    partial last one) give the sorting path's ranks and gradient exactly."""
    compared, parts = ranking._compared, []

    def three_rows_at_a_time(scores, thresholds):
        for part, above in compared(scores, thresholds, budget=3 * thresholds.shape[1] * scores.shape[-1]):
            parts.append(part)
            yield part, above

    monkeypatch.setattr(ranking, "_compared", three_rows_at_a_time)
    generator = torch.Generator().manual_seed(4)
    embeddings = torch.nn.functional.normalize(torch.randn(40, 8, generator=generator), dim=1)
    scores = embeddings @ embeddings.T
    scores[7, 20] = scores[7, 5]  # a negative tied with a positive, in the third chunk
    positives = (torch.arange(40) // 4)[:, None] == (torch.arange(40) // 4)[None, :]
    incoming = torch.randn(40, 40, generator=generator)
    x = scores.clone().requires_grad_()
    ranks, among, *index = ranking._CountedRanks.apply(x, positives, 0.3, None)
    (ranks * incoming[tuple(index)]).sum().backward()
    counted = dense(ranks.detach(), index, scores), dense(among, index, scores), x.grad
    for got, expected in zip(counted, sorted_ranks(scores, positives, 0.3, incoming)):
        assert torch.equal(got, expected)
    assert len(parts) == 2 * 14  # forward and backward passes, 14 chunks each


@pytest.mark.parametrize("density", [0.0, 0.02, 0.3, 1.0])
@pytest.mark.parametrize("shape", [(9, 24), (5, 13), (64, 64)])
def test_mask_helpers_equal_torchs_reductions_on_any_layout(shape, density):
    """Word-at-a-time `true_entries`, byte-sum `row_counts` and byte-minimum
    `is_all_true` against `nonzero`, `sum` and `all`, on whole masks and on views (row
    and column offsets, transposed) that the word scan cannot read and must hand back."""
    whole = torch.rand(shape, generator=torch.Generator().manual_seed(1)) < density
    for mask in (whole, whole[1:], whole[:, 8:], whole[:, :-1], whole.T):
        for ours, expected in zip(query_panels.true_entries(mask), mask.nonzero(as_tuple=True)):
            assert torch.equal(ours, expected)
        assert torch.equal(query_panels.row_counts(mask), mask.sum(1, dtype=torch.int32))
        assert query_panels.is_all_true(mask) == bool(mask.all())


@pytest.mark.parametrize("with_self", [False, True], ids=["", "with self"])
@pytest.mark.parametrize("policy", ["cache", "memory"])
@pytest.mark.parametrize("batch", [True, False], ids=["references are the batch", "separate references"])
def test_label_pairs_equal_the_positive_mask_entries(batch, policy, with_self, monkeypatch):
    """`label_pairs` (the CPU's sorted labels without a mask; an accelerator's mask) and each
    query's count of them against the entries of `pair_masks`'s positive mask, row-major,
    (i, i) included `with_self`: shuffled and unequal classes, singletons, negative labels,
    labels of two integer types, and empty batches."""
    monkeypatch.setattr(_device_policy, "sized_for", lambda device: policy)
    generator = torch.Generator().manual_seed(3)
    for trial in range(60):
        size = trial % 23
        labels = torch.randint(-3, 6, (size,), generator=generator)
        ref_labels = labels if batch else torch.randint(-3, 6, (trial % 17,), generator=generator).int()
        positive, _ = pair_masks(labels, ref_labels)
        if with_self and batch:
            positive.fill_diagonal_(True)
        queries, references, per_query, _ = label_pairs_and_counts(labels, ref_labels, with_self=with_self)
        for ours, expected in zip((queries, references), positive.nonzero(as_tuple=True), strict=True):
            assert torch.equal(ours, expected)
        assert torch.equal(per_query, positive.sum(1))


@pytest.mark.parametrize("queries", [slice(2, 6), torch.tensor([0, 3, 4, 6])], ids=["slice", "indices"])
def test_left_out_pairs_are_filled_alike_from_a_mask_or_indices(queries):
    """`left_out_filled_` writes −inf at the same entries of a panel's rows whether the
    left-out pairs come as a boolean mask or as their sorted indices, and leaves the
    other entries as they were."""
    generator = torch.Generator().manual_seed(5)
    scores = torch.randn(7, 9, generator=generator)
    left_out = torch.rand(7, 9, generator=generator) < 0.2
    expected = scores[queries].masked_fill(left_out[queries], -torch.inf)
    assert torch.equal(query_panels.left_out_filled_(scores[queries].clone(), queries, left_out), expected)
    indices = left_out.nonzero(as_tuple=True)
    (in_panel,) = query_panels.left_out_by_panel(indices, [(queries, scores[queries])], len(scores))
    assert torch.equal(query_panels.left_out_filled_(scores[queries].clone(), queries, in_panel), expected)
    assert torch.equal(query_panels.left_out_filled_(scores[queries].clone(), queries, None), scores[queries])


def formula_inputs(formula_name, dtype, seed=0, queries=6, positives=5):
    """Seeded [r, c] sums and scaled own scores of a panel, in the range each formula
    sees (ranks among a few dozen references; margins on both sides of every k; own
    scores a few units apart, so that no sigmoid saturates), and the formula."""
    generator = torch.Generator().manual_seed(seed)
    sums = torch.rand(queries, positives, generator=generator, dtype=dtype) * 20
    own = torch.randn(queries, positives, generator=generator, dtype=dtype) * 3
    if formula_name == "smooth_ap":
        return smooth_ap, sums, own
    if formula_name == "supap":
        return supap, sums, own
    if formula_name.startswith("pnp-"):
        return MeanPenalty(formula_name.removeprefix("pnp-"), alpha=4.0, b=2.0), sums, own
    k = torch.tensor(PAPER_K_VALUES, dtype=dtype).expand(queries + 2, -1)
    normalizer = torch.minimum(k, torch.tensor(float(positives), dtype=dtype))
    return recall_formula(k, normalizer, 1.0), sums, own


@pytest.mark.parametrize("dtype, rtol", [(torch.float64, 1e-12), (torch.float32, 1e-6)])
@pytest.mark.parametrize("queries", [slice(1, 7), torch.tensor([0, 2, 3, 5, 6, 7])], ids=["slice", "indices"])
@pytest.mark.parametrize("formula_name", ["smooth_ap", "recall", "supap", *(f"pnp-{v}" for v in PNPLoss.VARIANTS)])
def test_hand_written_formula_derivatives_equal_autograds(formula_name, queries, dtype, rtol):
    for seed in range(3):
        formula, sums, own = formula_inputs(formula_name, dtype, seed)
        value, grad_sums, grad_own = formula.gradients(sums.clone(), own.clone(), queries)
        # The same formula without its derivative takes autograd's path.
        expected = query_panels.formula_and_gradients(lambda *args: formula(*args), sums.clone(), own.clone(), queries)
        assert torch.equal(value, expected[0])
        assert torch.equal(value, formula(sums, own, queries))
        for got, want in zip((grad_sums, grad_own), expected[1:]):
            assert (got is None) == (want is None)
            if want is not None:
                assert want.abs().amax() > 0
                torch.testing.assert_close(got, want, rtol=rtol, atol=rtol * float(want.abs().amax()))
