"""SupAPLoss and ROADMAPLoss against the straightforward references written from the
paper's formulas (pml_rank.harness.references.roadmap), in float64, values and
gradients, on every layout; the calibration part against PML's ContrastiveLoss, which
the authors' CalibrationLoss is."""

import math

import pytest
import torch
from aten_counts import OperationNames
from loss_checks import LAYOUTS, assert_same_loss_and_gradients, grads, seeded
from pytorch_metric_learning import losses as pml_losses
from pytorch_metric_learning import miners
from pytorch_metric_learning.distances import CosineSimilarity, LpDistance
from pytorch_metric_learning.reducers import AvgNonZeroReducer, DoNothingReducer, MeanReducer, MultipleReducers
from pytorch_metric_learning.regularizers import LpRegularizer
from pytorch_metric_learning.utils import loss_and_miner_utils as lmu

from pml_rank import _device_policy
from pml_rank.harness.references import roadmap as reference
from pml_rank.harness.speed import peak_memory
from pml_rank.losses import ROADMAPLoss, SmoothAPLoss, SupAPLoss

# The paper's H⁻ (continuous), the authors' configuration files' offset, their first
# code's ρx + 1.44 (offset 1.44 + ρδ), their iNaturalist setting, no sigmoid above 0.
SETTINGS = [{}, {"offset": 1.44}, {"offset": 6.44}, {"offset": 1.0, "start": 0.0}, {"delta": 0.0, "offset": 1.0}]


@pytest.mark.parametrize("settings", SETTINGS, ids=str)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_supap_equals_the_paper_per_query(layout, settings):
    labels = torch.tensor(LAYOUTS[layout])
    # Spread embeddings: many negatives above positives, beyond δ (the linear part).
    embeddings = seeded(len(labels), seed=len(labels), scale=3.0)
    loss_func = SupAPLoss(reducer=DoNothingReducer(), **settings)
    per_query = loss_func(embeddings, labels)["loss"]
    expected = reference.supap_losses(embeddings, labels, **settings)
    if not expected:
        assert per_query["losses"] == 0
        return
    assert per_query["indices"].tolist() == sorted(expected) and loss_func.num_queries == len(expected)
    torch.testing.assert_close(per_query["losses"], torch.stack(list(expected.values())), rtol=1e-12, atol=1e-12)
    if layout == "one class":  # no negative: AP = 1 and no gradient
        assert not per_query["losses"].any()
        return
    mean = sum(expected.values()) / len(expected)
    assert_same_loss_and_gradients(SupAPLoss(**settings)(embeddings, labels), mean, (embeddings,))


@pytest.mark.parametrize("lambda_", [0.0, 0.5, 0.8, 1.0])
@pytest.mark.parametrize("layout", ["4 x 4", "unequal classes", "singletons among pairs", "shuffled random"])
def test_roadmap_equals_the_paper(layout, lambda_):
    labels = torch.tensor(LAYOUTS[layout])
    embeddings = seeded(len(labels), seed=2, scale=3.0)
    ours = ROADMAPLoss(lambda_=lambda_)(embeddings, labels)
    assert_same_loss_and_gradients(ours, reference.roadmap_loss(embeddings, labels, lambda_=lambda_), (embeddings,))


def test_the_parts_are_supap_and_pmls_contrastive_loss():
    """λ = 0 is SupAP; λ = 1 is the calibration, which the authors' CalibrationLoss takes
    from PML's ContrastiveLoss (α = 0.9, β = 0.6, dot products of unit vectors)."""
    labels = torch.tensor(LAYOUTS["unequal classes"])
    embeddings = seeded(len(labels), seed=5)
    calibration = pml_losses.ContrastiveLoss(pos_margin=0.9, neg_margin=0.6, distance=CosineSimilarity())
    for lambda_, part in ((0.0, SupAPLoss()(embeddings, labels)), (1.0, calibration(embeddings, labels))):
        assert_same_loss_and_gradients(ROADMAPLoss(lambda_=lambda_)(embeddings, labels), part, (embeddings,))
    halves = 0.5 * (SupAPLoss()(embeddings, labels) + calibration(embeddings, labels))
    torch.testing.assert_close(ROADMAPLoss()(embeddings, labels), halves, rtol=1e-12, atol=1e-12)


def test_the_bound_keeps_a_gradient_where_smooth_aps_sigmoid_vanishes():
    """A negative far above a positive (x = 0.6 ≫ τ): σ'(x/τ) ≈ 1e-24, H⁻'(x) = ρ. (Smooth-AP's
    gradient left is the query's own column, 0.2 above the negative.)"""
    embeddings = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.8, 0.6]], dtype=torch.float64, requires_grad=True)
    labels = torch.tensor([0, 0, 1])  # query 0: positive 1 at cosine 0, negative 2 at 0.8
    smooth = grads(SmoothAPLoss()(embeddings, labels), (embeddings,))[0]
    bounded = grads(SupAPLoss()(embeddings, labels), (embeddings,))[0]
    assert bounded.abs().max() > 1e-2 and bounded.abs().max() > 1e5 * smooth.abs().max()


@pytest.mark.parametrize("loss_class", [SupAPLoss, ROADMAPLoss])
def test_ref_emb_every_reference_counts(loss_class):
    embeddings, ref_emb = seeded(10, seed=1, scale=3.0), seeded(14, seed=2, scale=3.0)
    labels = torch.tensor([0, 0, 1, 2, 3, 3, 4, 5, 6, 9])
    ref_labels = torch.tensor([0, 1, 1, 2, 2, 2, 3, 4, 4, 5, 5, 7, 8, 8])
    pairs = dict(ref_emb=ref_emb, ref_labels=ref_labels)
    if loss_class is SupAPLoss:
        expected = reference.supap_losses(embeddings, labels, **pairs)
        assert len(expected) == 8  # queries 6 and 9 have no positive reference
        expected = sum(expected.values()) / len(expected)
    else:
        expected = reference.roadmap_loss(embeddings, labels, **pairs)
    ours = loss_class()(embeddings, labels, ref_emb=ref_emb, ref_labels=ref_labels)
    assert_same_loss_and_gradients(ours, expected, (embeddings, ref_emb))


@pytest.mark.parametrize("loss_class", [SupAPLoss, ROADMAPLoss])
def test_batch_as_references_with_pairs_equals_the_batch(loss_class):
    """What PML's DistributedLossWrapper(efficient=True) and CrossBatchMemory pass."""
    labels = torch.tensor([0, 0, 0, 1, 1, 2, 3, 3, 3, 3])
    embeddings = seeded(10, scale=3.0)
    whole = loss_class()(embeddings, labels)
    pairs = lmu.get_all_pairs_indices(labels, labels)
    as_references = loss_class()(embeddings, labels, pairs, embeddings.detach().clone(), labels.clone())
    torch.testing.assert_close(as_references, whole, rtol=1e-12, atol=1e-12)


def test_indices_tuple_restricts_each_ranking_and_the_calibration_to_its_pairs():
    labels = torch.randint(0, 4, (20,), generator=torch.Generator().manual_seed(4))
    embeddings = seeded(20, seed=4, scale=3.0)
    pairs = miners.MultiSimilarityMiner(epsilon=0.3)(embeddings, labels)
    allowed = set(zip(pairs[0].tolist(), pairs[1].tolist())) | set(zip(pairs[2].tolist(), pairs[3].tolist()))
    assert 0 < len(allowed) < 20 * 19
    expected = reference.roadmap_loss(embeddings, labels, allowed_pairs=allowed)
    assert_same_loss_and_gradients(ROADMAPLoss()(embeddings, labels, pairs), expected, (embeddings,))


def test_gradcheck():
    labels = torch.tensor([0, 0, 1, 1, 1, 2, 3, 3])
    embeddings = seeded(8, dim=4, seed=5)
    loss_func = ROADMAPLoss(temperature=0.1, rho=3.0, delta=0.2)
    assert torch.autograd.gradcheck(lambda e: loss_func(e, labels), (embeddings,))


def test_nothing_to_learn():
    embeddings = seeded(6)
    distinct = torch.arange(6)
    assert SupAPLoss()(embeddings, distinct).item() == 0
    # ROADMAP still calibrates the negatives: only the calibration's negative term.
    calibration = pml_losses.ContrastiveLoss(pos_margin=0.9, neg_margin=0.6, distance=CosineSimilarity())
    torch.testing.assert_close(ROADMAPLoss()(embeddings, distinct), 0.5 * calibration(embeddings, distinct))
    one_class = torch.zeros(6, dtype=torch.long)
    loss = SupAPLoss()(embeddings, one_class)
    assert loss.item() == 0
    loss.backward()
    assert not embeddings.grad.any()


@pytest.mark.parametrize("loss_class", [SupAPLoss, ROADMAPLoss])
def test_half_precision_is_computed_in_float32(loss_class):
    labels = torch.arange(16) // 4
    half = torch.randn(16, 8, generator=torch.Generator().manual_seed(0)).half().requires_grad_()
    loss = loss_class()(half, labels)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, loss_class()(half.detach().float(), labels))
    loss.backward()
    assert half.grad.dtype == torch.float16 and torch.isfinite(half.grad).all()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": 0}, "SupAPLoss: temperature must be a finite number > 0, got 0"),
        ({"rho": -1.0}, "SupAPLoss: rho must be a finite number >= 0, got -1.0"),
        ({"delta": math.inf}, "SupAPLoss: delta must be a finite number >= 0, got inf"),
        ({"offset": math.nan}, "SupAPLoss: offset must be a finite number, got nan"),
    ],
)
def test_parameters_out_of_range_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SupAPLoss(**kwargs)
    with pytest.raises(ValueError, match=message.replace("SupAPLoss", "ROADMAPLoss")):
        ROADMAPLoss(**kwargs)


def test_roadmap_parameters_out_of_range_are_named():
    with pytest.raises(ValueError, match="ROADMAPLoss: lambda_ must be in \\[0, 1\\], got 1.5"):
        ROADMAPLoss(lambda_=1.5)
    with pytest.raises(ValueError, match="ROADMAPLoss: neg_margin must be a finite number, got inf"):
        ROADMAPLoss(neg_margin=math.inf)


@pytest.mark.parametrize("per_class", [4, 64])
def test_peak_memory_is_a_few_similarity_matrices_whatever_the_class_size(per_class):
    size = 256
    embeddings = torch.randn(size, 32, generator=torch.Generator().manual_seed(0)).requires_grad_()
    labels = torch.arange(size) // per_class
    peak = peak_memory(ROADMAPLoss(), (embeddings, labels), torch.device("cpu"))
    matrix = size * size * 4
    assert peak < 12 * matrix, f"{peak / matrix:.1f} similarity matrices"


@pytest.mark.parametrize("loss_class", [SupAPLoss, ROADMAPLoss])
def test_a_negative_level_with_a_positive_counts_as_half_of_one_above_it(loss_class):
    """H⁻(0) = σ(0) = 1/2: a tie is not above the positive (the `start` step counts from x > 0).
    Query 0's positive 1 and negative 2 score exactly 0.6 (mirror images)."""
    embeddings = torch.tensor([[1.0, 0.0], [0.6, 0.8], [0.6, -0.8]], dtype=torch.float64)
    labels = torch.tensor([0, 0, 1])
    loss = loss_class(**({"lambda_": 0.0} if loss_class is ROADMAPLoss else {}))(embeddings, labels)
    expected = reference.supap_losses(embeddings, labels)
    torch.testing.assert_close(loss, sum(expected.values()) / len(expected), rtol=1e-12, atol=1e-12)
    # Query 0: itself (σ(−40) of a negative above it) and positive 1 (rank 2 among the
    # positives, half a negative above): AP = (1 + 2 / 2.5) / 2. Query 1: nothing above, AP = 1.
    assert loss.item() == pytest.approx((1 - (1 + 2 / 2.5) / 2) / 2, abs=1e-12)


def _reducing_in_pml():
    """ROADMAP's default reducers, but recording statistics: the calibration's pair losses
    then go to PML's AvgNonZeroReducer instead of being averaged in the loss."""
    recording = {name: AvgNonZeroReducer(collect_stats=True) for name in ("pos_loss", "neg_loss")}
    return MultipleReducers(recording, MeanReducer())


@pytest.mark.parametrize("lambda_", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("references", ["batch", "ref_emb", "miner"])
def test_the_calibration_averaged_in_the_loss_equals_pmls_avg_non_zero_reducer(references, lambda_):
    generator = torch.Generator().manual_seed(6)
    labels = torch.randint(0, 12, (60,), generator=generator)
    embeddings = seeded(60, seed=6, scale=3.0)
    kwargs, tensors = {}, (embeddings,)
    if references == "ref_emb":
        kwargs = {"ref_emb": seeded(40, seed=7, scale=3.0), "ref_labels": labels[:40]}
        tensors = (embeddings, kwargs["ref_emb"])
    elif references == "miner":
        kwargs = {"indices_tuple": miners.MultiSimilarityMiner(epsilon=0.3)(embeddings, labels)}
    ours = ROADMAPLoss(lambda_=lambda_)(embeddings, labels, **kwargs)
    pmls = ROADMAPLoss(lambda_=lambda_, reducer=_reducing_in_pml())(embeddings, labels, **kwargs)
    assert_same_loss_and_gradients(ours, pmls, tensors)


@pytest.mark.parametrize("references", ["batch", "ref_emb", "miner", "distance"])
def test_the_calibration_by_panels_of_rows_equals_pmls_avg_non_zero_reducer(monkeypatch, references):
    """On the CPU the calibration's terms go a panel of rows at a time (`_device_policy`): panels
    of one to a few rows, each term's sums and counts added over them, give PML's value and
    gradients; pairs by label (no masks), by `ref_emb`, by a miner; for a similarity and for a
    distance (its margins the other way round)."""
    monkeypatch.setattr(_device_policy, "PANEL_ELEMENTS", 100)
    generator = torch.Generator().manual_seed(8)
    labels = torch.randint(0, 9, (45,), generator=generator)
    embeddings = seeded(45, seed=8, scale=3.0)
    kwargs, tensors, settings = {}, (embeddings,), {"lambda_": 0.7}
    if references == "ref_emb":
        kwargs = {"ref_emb": seeded(30, seed=9, scale=3.0), "ref_labels": labels[:30]}
        tensors = (embeddings, kwargs["ref_emb"])
    elif references == "miner":
        kwargs = {"indices_tuple": miners.MultiSimilarityMiner(epsilon=0.3)(embeddings, labels)}
    elif references == "distance":
        settings.update(distance=LpDistance(), pos_margin=0.6, neg_margin=1.3, temperature=0.05)
    ours = ROADMAPLoss(**settings)(embeddings, labels, **kwargs)
    pmls = ROADMAPLoss(**settings, reducer=_reducing_in_pml())(embeddings, labels, **kwargs)
    assert_same_loss_and_gradients(ours, pmls, tensors)


def test_the_default_reducer_adds_what_pmls_multiple_reducers_add():
    """One level of reducers, one per sub-loss (an embedding regularizer's to the default
    MeanReducer), summed without PML's buffer: PML's value and gradients, fewer operations."""
    embeddings = seeded(48, seed=3, scale=2.0)
    labels = torch.arange(48) // 4
    ours = ROADMAPLoss(embedding_regularizer=LpRegularizer())
    assert type(ours.reducer).__name__ == "SumOfReducers"
    assert all(type(r) is not MultipleReducers for r in ours.reducer.reducers.values())
    pmls = ROADMAPLoss(embedding_regularizer=LpRegularizer())
    pmls.reducer = MultipleReducers(dict(ours.reducer.reducers), MeanReducer())
    counts = []
    for loss in (ours, pmls):
        with OperationNames() as operations:
            value = loss(embeddings, labels)
            value.backward(retain_graph=True)
        counts.append(sum(operations.names.values()))
    assert_same_loss_and_gradients(ours(embeddings, labels), pmls(embeddings, labels), (embeddings,))
    assert counts[0] < counts[1] - 10, counts


def test_the_calibration_picks_no_pairs_out_and_waits_for_nothing():
    """ROADMAP adds the calibration to SupAP without nonzero (index tensors as long as
    the pairs, a wait for the device), boolean indexing or reading a number back."""
    embeddings = torch.randn(64, 16, generator=torch.Generator().manual_seed(0)).requires_grad_()
    labels = torch.arange(64) // 4
    counted = {}
    for loss_class in (SupAPLoss, ROADMAPLoss):
        with OperationNames() as operations:
            loss_class()(embeddings, labels).backward()
        counted[loss_class] = operations.names
    for name in ("aten::nonzero", "aten::index", "aten::index_put", "aten::_local_scalar_dense"):
        assert counted[ROADMAPLoss][name] == counted[SupAPLoss][name], name
