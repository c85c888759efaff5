"""The fused Triton kernels of the relaxed rank (`losses.fused_ranks`) compute what the
plain-torch panels compute (`query_panels._panel_by_panel`), for every loss over the
primitive and every form of left-out pairs, weights and references: on CUDA under the
``cuda`` marker, and on the CPU in Triton's interpreter (TRITON_INTERPRET=1, a fresh
process, since Triton reads it when a kernel is defined)."""

import contextlib
import functools
import importlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import types
import warnings
from pathlib import Path

import pytest
import torch
from aten_counts import OperationNames
from pytorch_metric_learning.distances import DotProductSimilarity, LpDistance
from pytorch_metric_learning.miners import MultiSimilarityMiner
from pytorch_metric_learning.reducers import SumReducer
from torch.utils._python_dispatch import TorchDispatchMode

import pml_rank
from pml_rank import _device_policy, _triton, fused_counts, ranking
from pml_rank.losses import (
    AUCLoss,
    FastAPLoss,
    NPairsMCLoss,
    NPairsOVOLoss,
    PNPLoss,
    RaMBOAPLoss,
    RaMBORecallLoss,
    RecallAtKSurrogateLoss,
    ROADMAPLoss,
    SmoothAPLoss,
    SupAPLoss,
    fused_calibration,
    fused_label_pairs,
    fused_ranks,
    fused_unit_rows,
    fused_without_self,
    query_panels,
)
from pml_rank.losses import auc as auc_module
from pml_rank.losses import fastap as fastap_module
from pml_rank.losses import npairs as npairs_module
from pml_rank.losses import rambo as rambo_module
from pml_rank.losses.base import _UnitRows, label_pairs_and_counts, pair_masks
from pml_rank.losses.recall_at_k import recall_formula
from pml_rank.losses.smooth_ap import Sigmoid, smooth_ap

LOSSES = {
    "SmoothAP": SmoothAPLoss,
    "SmoothAP-no-query": lambda: SmoothAPLoss(include_query=False),
    # Unnormalised: each query's own column, left out, then has a gradient of its own.
    "SmoothAP-no-query-dot": lambda: SmoothAPLoss(
        include_query=False, temperature=2.0, distance=DotProductSimilarity(normalize_embeddings=False)
    ),
    "Recall@k": RecallAtKSurrogateLoss,
    "Recall@k-query-in-ranking": lambda: RecallAtKSurrogateLoss(query_in_ranking=True),
    "PNP": PNPLoss,
    "PNP-O": lambda: PNPLoss(variant="O"),
    "SupAP": SupAPLoss,
    "ROADMAP": ROADMAPLoss,
    "ROADMAP-offset": lambda: ROADMAPLoss(offset=1.44, start=0.0, delta=0.1),
    "ROADMAP-distance": lambda: ROADMAPLoss(distance=LpDistance(), pos_margin=0.6, neg_margin=1.3, temperature=0.05),
}
# "labels": classes of 6, 4 and 2, so queries with unequal numbers of pairs (a group each);
# "classes-of-4": every query with as many pairs (one group, as views of the pairs);
# "singleton": "labels" and a class of one, whose query has no positive but itself.
INPUTS = ("labels", "classes-of-4", "singleton", "ref_emb", "miner")


def value_and_gradients(make_loss, inputs, device, fused, batch=40):
    """The loss and the gradients of its embeddings (and `ref_emb`), with the fused kernels
    or the plain-torch panels, and whether the fused kernels ran."""
    generator = torch.Generator().manual_seed(0)
    labels = torch.arange(batch) // 4
    if inputs != "classes-of-4":
        labels[:6] = 100  # classes of 6, 4 and 2: panels of several sizes
    if inputs == "singleton":
        labels[-1] = 101
    embeddings = torch.randn(batch, 16, generator=generator).to(device).requires_grad_()
    kwargs = {}
    if inputs == "ref_emb":
        kwargs = {"ref_emb": torch.randn(52, 16, generator=generator).to(device).requires_grad_()}
        kwargs["ref_labels"] = (torch.arange(52) // 5).to(device)
    labels = labels.to(device)
    if inputs == "miner":
        kwargs = {"indices_tuple": MultiSimilarityMiner(epsilon=0.3)(embeddings, labels)}
    calls = []
    original = query_panels._fused, fused_calibration.calibration_terms, query_panels.query_panels
    query_panels._fused = lambda *args: calls.append("ranks") or original[0](*args)
    fused_calibration.calibration_terms = lambda *args: calls.append("calibration") or original[1](*args)
    query_panels.query_panels = lambda *args, **kw: calls.append("groups") or original[2](*args, **kw)
    runs_on = fused_ranks.runs_on
    if not fused:
        fused_ranks.runs_on = lambda *args: False
    try:
        loss = make_loss()(embeddings, labels, **kwargs)
        loss.backward()
    finally:
        (query_panels._fused, fused_calibration.calibration_terms, query_panels.query_panels) = original
        fused_ranks.runs_on = runs_on
    tensors = [embeddings, *(kwargs.get("ref_emb", None),)]
    return loss.detach(), [t.grad for t in tensors if t is not None], set(calls)


def check_fused_equals_torch(name, inputs, device, batch=40):
    value, gradients, ran = value_and_gradients(LOSSES[name], inputs, device, True, batch)
    expected, expected_gradients, ran_torch = value_and_gradients(LOSSES[name], inputs, device, False, batch)
    # ROADMAP's calibration with its default reducer has its own fused pass; with queries of
    # equally many pairs, the fused path takes them as one group without cutting any.
    assert ran - {"groups"} == ({"ranks", "calibration"} if name.startswith("ROADMAP") else {"ranks"})
    if inputs in ("labels", "classes-of-4", "singleton"):
        assert ("groups" in ran) == (inputs != "classes-of-4") and "groups" in ran_torch
    torch.testing.assert_close(value, expected, rtol=1e-5, atol=1e-6)
    for gradient, expected_gradient in zip(gradients, expected_gradients, strict=True):
        assert gradient.abs().max() > 0
        scale = expected_gradient.abs().max()
        torch.testing.assert_close(gradient / scale, expected_gradient / scale, rtol=0, atol=2e-5)


@pytest.mark.cuda
@pytest.mark.parametrize("inputs", INPUTS)
@pytest.mark.parametrize("name", LOSSES)
def test_fused_kernels_on_cuda_equal_the_torch_panels(name, inputs):
    check_fused_equals_torch(name, inputs, "cuda")


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["SmoothAP", "Recall@k", "PNP", "ROADMAP"])
def test_fused_kernels_on_cuda_at_batch_3000(name):
    """Many blocks of pairs and of references, a last block of each only partly full."""
    check_fused_equals_torch(name, "labels", "cuda", batch=3000)


@pytest.mark.skipif(not fused_ranks.interpreted(), reason="runs in Triton's interpreter (test_in_tritons_interpreter)")
@pytest.mark.parametrize("inputs", INPUTS)
@pytest.mark.parametrize("name", LOSSES)
def test_interpreted_fused_kernels_equal_the_torch_panels(name, inputs):
    check_fused_equals_torch(name, inputs, "cpu")


# Past the sums kernel's first step of references (`fused_ranks.REFERENCES_PER_STEP`): whole
# steps read without masks, then a partial one; by label, with a miner's weights, skipping the
# own column, and with label weights.
WHOLE_STEP_CASES = [("SmoothAP", "labels"), ("SmoothAP", "miner"), ("Recall@k", "labels"), ("ROADMAP", "labels")]


@pytest.mark.skipif(not fused_ranks.interpreted(), reason="runs in Triton's interpreter (test_in_tritons_interpreter)")
@pytest.mark.parametrize("name, inputs", WHOLE_STEP_CASES)
def test_interpreted_fused_kernels_past_a_step_of_references(name, inputs):
    assert 140 > fused_ranks.REFERENCES_PER_STEP and 140 % fused_ranks.REFERENCES_PER_STEP
    check_fused_equals_torch(name, inputs, "cpu", batch=140)


HALF_READERS = (
    "SmoothAP",
    "SmoothAP-no-query",
    "Recall@k",
    "Recall@k-query-in-ranking",
    "PNP",
    "PNP-O",
    "SupAP",
    "ROADMAP",
)


@pytest.mark.skipif(not fused_ranks.interpreted(), reason="runs in Triton's interpreter (test_in_tritons_interpreter)")
@pytest.mark.parametrize(
    "inputs, dtype",
    [("labels", torch.float16), ("ref_emb", torch.float16), ("miner", torch.float16), ("labels", torch.bfloat16)],
    ids=["labels", "ref_emb", "miner", "labels-bfloat16"],
)
@pytest.mark.parametrize("name", HALF_READERS)
def test_interpreted_kernels_read_a_half_product_as_its_float32_copy(name, inputs, dtype, monkeypatch):
    """Under autocast the relaxed ranks' kernels (and ROADMAP's calibration's) read the
    half-precision product as it is (`fused_ranks.reads_half`): the same loss, bit for bit,
    as from its float32 copy, which they no longer need (nor a float32 gradient of it), and
    in float16 the same gradients bit for bit. ROADMAP's two gradients of the matrix are
    added in half precision, not in float32 before one rounding: equal to its rounding. Triton's
    interpreter rounds a bfloat16 store differently from a GPU (and torch's cast): bfloat16's
    gradients to a couple of its units in the last place."""
    read = []
    pair_sums = fused_ranks.pair_sums
    monkeypatch.setattr(
        fused_ranks, "pair_sums", lambda scores, *args: read.append(scores.dtype) or pair_sums(scores, *args)
    )
    with torch.autocast("cpu", dtype=dtype):
        half = value_and_gradients(LOSSES[name], inputs, "cpu", True)
        monkeypatch.setattr(fused_ranks, "reads_half", lambda matrix: False)
        copied = value_and_gradients(LOSSES[name], inputs, "cpu", True)
    kernels = {"ranks", "calibration"} if name == "ROADMAP" else {"ranks"}
    assert half[0].dtype == torch.float32 and half[2] == copied[2] == kernels | (half[2] & {"groups"})
    # A query that ranks itself by a float32 column of its own scores (with ref_emb; Recall@k's
    # also with a miner's pairs) makes the scores float32 again.
    own_column = inputs == "ref_emb" and name in ("SmoothAP", "PNP", "PNP-O", "SupAP", "ROADMAP")
    own_column |= inputs != "labels" and name == "Recall@k-query-in-ranking"
    half_read = torch.float32 if own_column else dtype
    assert read == [half_read, torch.float32]
    assert torch.equal(half[0], copied[0]) and half[0] != 0
    for gradient, expected in zip(half[1], copied[1], strict=True):
        assert gradient.abs().max() > 0
        if name == "ROADMAP" or dtype == torch.bfloat16:
            scale = expected.abs().max()
            atol = 2e-3 if dtype == torch.float16 else 1.6e-2
            torch.testing.assert_close(gradient / scale, expected / scale, rtol=0, atol=atol)
        else:
            assert torch.equal(gradient, expected)


class ReadBacks(TorchDispatchMode):
    """In order, the operations inside the context after which a GPU's host waits for the
    device ("wait": a number or a list read back, nonzero's or bincount's size, or host data
    made a tensor, whose upload waits for the device's queue) and the matrix products
    ("product"); a test may add marks of its own to `events`."""

    def __init__(self):
        super().__init__()
        self.events = []
        self._tolist = None

    def __enter__(self):
        self._tolist = tolist = torch.Tensor.tolist
        torch.Tensor.tolist = lambda tensor: self.events.append("wait") or tolist(tensor)
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name in ("aten::_local_scalar_dense", "aten::nonzero", "aten::bincount", "aten::lift_fresh"):
            self.events.append("wait")
        elif func._schema.name == "aten::mm":
            self.events.append("product")
        return func(*args, **(kwargs or {}))


@pytest.mark.skipif(not fused_ranks.interpreted(), reason="runs in Triton's interpreter (test_in_tritons_interpreter)")
@pytest.mark.parametrize("inputs", ["labels", "classes-of-4"])
def test_interpreted_fused_ranks_wait_for_the_device_before_the_sums_kernel(inputs):
    """Every read-back of the fused path (the groups' sizes) comes before the sums kernel is
    queued, so that on a GPU the host queues the formula while the device sums."""
    read_backs = ReadBacks()
    pair_sums = fused_ranks.pair_sums
    fused_ranks.pair_sums = lambda *args: read_backs.events.append("sums") or pair_sums(*args)
    try:
        scores = torch.randn(40, 40, generator=torch.Generator().manual_seed(0))
        labels = torch.arange(40) // 4
        if inputs == "labels":
            labels[:6] = 100
        pair_query, pair_positive = (labels[:, None] == labels[None, :]).nonzero(as_tuple=True)
        with read_backs:
            query_panels.relaxed_ranks(scores, pair_query, pair_positive, Sigmoid, smooth_ap, 10.0)
    finally:
        fused_ranks.pair_sums = pair_sums
    events = read_backs.events
    assert "wait" in events and "wait" not in events[events.index("sums") :], events


@pytest.mark.skipif(not fused_ranks.interpreted(), reason="runs in Triton's interpreter (test_in_tritons_interpreter)")
@pytest.mark.parametrize("name", ["SmoothAP", "SmoothAP-no-query", "Recall@k", "SupAP", "PNP", "ROADMAP"])
def test_interpreted_losses_by_labels_read_nothing_back_after_the_similarity_product(name):
    """With as many pairs for every query, the counts are read back before the product is
    queued; after it nothing waits for the device: unit rows bound the scores, so the loss
    is not read back to be checked (`RankLossBase._may_overflow`)."""
    embeddings = torch.randn(40, 16, generator=torch.Generator().manual_seed(0))
    with ReadBacks() as read_backs:
        LOSSES[name]()(embeddings, torch.arange(40) // 4)
    events = read_backs.events
    assert events[events.index("product") + 1 :] == [], events


def test_a_count_of_pairs_per_query_that_does_not_add_up_is_refused():
    scores = torch.zeros(4, 4)
    pair_query, pair_positive = torch.tensor([0, 0, 1, 2, 3]), torch.tensor([1, 2, 0, 3, 2])
    with pytest.raises(ValueError, match="relaxed_ranks: 5 pairs are not 2 for each of 4"):
        query_panels.relaxed_ranks(scores, pair_query, pair_positive, Sigmoid, smooth_ap, pairs_per_query=2)


# RaMBO's counting (`fused_counts`): recall with labels and with `ref_emb`, the AP loss on
# sequences of scores;
# similarities rounded to 2 decimals have ties, which the kernels count as the passes do.
RAMBO_CASES = ("recall", "recall-ties", "recall-ref_emb", "ap")


def rambo_value_and_gradients(case, device, fused):
    """RaMBO's loss and gradients under the accelerator's policy, with the counting
    kernels or the plain-torch passes, and whether the kernels ran."""
    generator = torch.Generator().manual_seed(1)
    calls = []
    original = fused_counts.applies, _device_policy.sized_for
    fused_counts.applies = lambda *args: (fused and original[0](*args)) and not calls.append("counts")
    _device_policy.sized_for = lambda device: "memory"
    try:
        if case == "ap":
            scores = torch.randn(6, 300, generator=generator).to(device).requires_grad_()
            targets = (torch.rand(6, 300, generator=generator) < 0.01).to(device)
            targets[:, 0] = True
            loss, tensors = ranking.average_precision_loss(scores, targets), [scores]
        else:
            embeddings = torch.randn(48, 8, generator=generator)
            if case == "recall-ties":
                embeddings = embeddings.round(decimals=0)
            embeddings = embeddings.to(device).requires_grad_()
            labels = (torch.arange(48) // 3).to(device)
            kwargs = {}
            if case == "recall-ref_emb":
                kwargs = {"ref_emb": torch.randn(40, 8, generator=generator).to(device).requires_grad_()}
                kwargs["ref_labels"] = (torch.arange(40) // 4).to(device)
            loss = RaMBORecallLoss(memory_size=0)(embeddings, labels, **kwargs)
            tensors = [embeddings, *kwargs.values()][: 2 if kwargs else 1]
        gradients = torch.autograd.grad(loss, tensors)
    finally:
        fused_counts.applies, _device_policy.sized_for = original
    return loss.detach(), gradients, bool(calls)


def check_counting_kernels_equal_the_passes(case, device):
    value, gradients, ran = rambo_value_and_gradients(case, device, True)
    expected, expected_gradients, _ = rambo_value_and_gradients(case, device, False)
    assert ran
    # Counts are exact: the same ranks, so the same loss and gradients to the last bit.
    torch.testing.assert_close(value, expected, rtol=0, atol=0)
    for gradient, expected_gradient in zip(gradients, expected_gradients, strict=True):
        assert gradient.abs().max() > 0
        torch.testing.assert_close(gradient, expected_gradient, rtol=0, atol=0)


@pytest.mark.cuda
@pytest.mark.parametrize("case", RAMBO_CASES)
def test_counting_kernels_on_cuda_equal_the_passes(case):
    check_counting_kernels_equal_the_passes(case, "cuda")


@pytest.mark.skipif(not fused_ranks.interpreted(), reason="runs in Triton's interpreter (test_in_tritons_interpreter)")
@pytest.mark.parametrize("case", RAMBO_CASES)
def test_interpreted_counting_kernels_equal_the_passes(case):
    check_counting_kernels_equal_the_passes(case, "cpu")


def tied_rankings():
    """Scores, positives and an incoming gradient per positive whose ranks tie every way the
    stable order rules: small integers (positives equal to each other and to other
    elements, steps landing on scores), a sequence longer than a step of the kernel, a
    sequence without positives, and one of two elements."""
    generator = torch.Generator().manual_seed(2)
    long = 2 * fused_counts.ELEMENTS_PER_STEP + 5
    for rows, n, values, rate in [(6, 25, 4, 0.15), (5, long, 9, 0.003), (3, 2, 2, 0.5)]:
        scores = torch.randint(0, values, (rows, n), generator=generator).float()
        positives = torch.rand(rows, n, generator=generator) < rate
        positives[0] = False
        positives[1, :2] = True
        incoming = torch.randint(-2, 3, (int(positives.sum()),), generator=generator).float()
        yield scores, positives, incoming


def counted_ranks_and_gradient(scores, positives, incoming, fused, margin=0.0, scale=1.0):
    """The ranks, ranks among positives and gradient of ``scale · Σ incoming · rank`` by the
    kernels (`fused`, which shift by `margin` themselves) or by the plain-torch passes (on
    `ranking.shift_by_margin`'s scores); with a `scale` other than 1, through a `LossScale`."""
    x = scores.clone().requires_grad_()
    counts = ranking.positive_counts(positives)
    loss_scale = None if scale == 1 else ranking.LossScale()
    if fused:
        index = ranking.true_indices(positives, counts.total)
        ranks, among = ranking._FusedCountedRanks.apply(x, 1.0, loss_scale, index[1], counts, margin)
    else:
        shifted = ranking.shift_by_margin(x, positives, margin)
        ranks, among, *index = ranking._CountedRanks.apply(shifted, positives, 1.0, loss_scale)
    loss = (ranks * incoming).sum()
    (scale * (loss if loss_scale is None else loss_scale.attach(loss))).backward()
    return ranks.detach(), among, x.grad


@pytest.mark.skipif(not fused_ranks.interpreted(), reason="runs in Triton's interpreter (test_in_tritons_interpreter)")
@pytest.mark.parametrize("margin, scale", [(0.0, 1.0), (2.0, 1.0), (0.7, 3.0)])
def test_interpreted_counting_kernels_follow_the_stable_order_through_ties(margin, scale):
    """The kernels rank ties as the passes do (their exact pass for sequences with ties),
    with the margin's shift (2 on integer scores: positives tied with the shifted others;
    0.7: shifted values that round) and Algorithm 1's factors from a loss's scale k (3),
    which the kernels apply themselves: the same bits."""
    moved = []
    for scores, positives, incoming in tied_rankings():
        fused = counted_ranks_and_gradient(scores, positives, incoming, True, margin, scale)
        expected = counted_ranks_and_gradient(scores, positives, incoming, False, margin, scale)
        for got, want in zip(fused, expected, strict=True):
            assert torch.equal(got, want)
        moved.append(bool(fused[2].abs().max() > 0))
    assert moved[:2] == [True, True]


@pytest.mark.skipif(not fused_ranks.interpreted(), reason="runs in Triton's interpreter (test_in_tritons_interpreter)")
@pytest.mark.parametrize("loss_class", [RaMBORecallLoss, RaMBOAPLoss])
def test_interpreted_rambo_finds_no_ties_on_the_host(loss_class, monkeypatch):
    """Its kernels rank ties themselves: a call waits for the device three times (`tolist`:
    the input check, the positives' counts and whether a rank moved), where the plain-torch
    passes wait a fourth time to find the sequences with ties (a `nonzero`)."""
    monkeypatch.setattr(_device_policy, "sized_for", lambda device: "memory")
    tolists, tolist = [], torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda tensor: tolists.append(1) or tolist(tensor))
    embeddings = torch.randn(256, 32, generator=torch.Generator().manual_seed(0)).requires_grad_()
    with OperationNames() as operations:
        loss_class(memory_size=0)(embeddings, torch.arange(256) // 4).backward()
    waiting = {"aten::_local_scalar_dense", "aten::nonzero", "aten::bincount", "aten::masked_select"}
    assert len(tolists) == 3 and not waiting & set(operations.names), (tolists, operations.names)


def formula_of(name, queries, c, generator, device):
    """A relaxed-rank formula with a kernel of its own, for `queries` of `c` pairs each."""
    if name == "SmoothAP":
        return smooth_ap
    k_values = torch.tensor([1.0, 2.0, 4.0, 8.0, 16.0])
    if name == "Recall@k-shared-k":  # one row of k values for every query, as a view
        k = k_values.expand(queries, -1)
    else:  # each query's k clipped at its own list length
        k = torch.minimum(k_values, torch.randint(2, 20, (queries, 1), generator=generator).float())
    normalizer = torch.minimum(k, torch.randint(1, c + 1, (queries, 1), generator=generator).float())
    k, normalizer = k.to(device), normalizer.to(device)
    return recall_formula(k, normalizer, recall_temperature=0.01 if name == "Recall@k-ties" else 0.5)


def check_formula_kernel_equals_its_torch_formula(name, c, device):
    """A formula's own kernel gives what its torch operations give, values and gradients, for
    numbers of pairs that fill their block or not; Recall@k's margins beyond the sigmoid's
    clamp included (ranks up to 3c, k up to 16, τ2 = 0.5), and its counts equal to k (ranks
    a half above integers, τ2 = 0.01: every sigmoid clamped to 0 or 1)."""
    generator = torch.Generator().manual_seed(c)
    queries = 37
    if name == "Recall@k-ties":
        sums = torch.randint(0, 3 * c, (queries * c,), generator=generator).float()
    else:
        sums = torch.rand(queries * c, generator=generator) * 3 * c
    own = torch.randn(queries * c, generator=generator) * 5
    formula = formula_of(name, queries, c, generator, device)
    sums, own = sums.to(device), own.to(device)
    values, grad_sums, grad_own = formula.fused_gradients(sums, own, c, 3.0)
    expected = query_panels.formula_and_gradients(
        formula, sums.view(-1, c).clone(), own.view(-1, c).clone(), slice(0, queries), 3.0
    )
    torch.testing.assert_close(values, expected[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad_sums, expected[1].view(-1), rtol=1e-5, atol=1e-6)
    if expected[2] is None:
        assert grad_own is None
    else:
        torch.testing.assert_close(grad_own, expected[2].view(-1), rtol=1e-5, atol=1e-6)


FORMULA_CASES = ["SmoothAP", "Recall@k", "Recall@k-shared-k", "Recall@k-ties"]


@pytest.mark.cuda
@pytest.mark.parametrize("c", [1, 3, 4, 17, 64])
@pytest.mark.parametrize("name", FORMULA_CASES)
def test_formula_kernels_on_cuda_equal_their_torch_formulas(name, c):
    check_formula_kernel_equals_its_torch_formula(name, c, "cuda")


@pytest.mark.skipif(not fused_ranks.interpreted(), reason="runs in Triton's interpreter (test_in_tritons_interpreter)")
@pytest.mark.parametrize("c", [1, 3, 4, 17, 64])
@pytest.mark.parametrize("name", FORMULA_CASES)
def test_interpreted_formula_kernels_equal_their_torch_formulas(name, c):
    check_formula_kernel_equals_its_torch_formula(name, c, "cpu")


@pytest.mark.skipif(not fused_ranks.interpreted(), reason="runs in Triton's interpreter (test_in_tritons_interpreter)")
def test_interpreted_formula_kernels_leave_more_pairs_to_torch():
    c = fused_ranks.FORMULA_MOST_PAIRS + 1
    assert smooth_ap.fused_gradients(torch.zeros(2 * c), torch.zeros(2 * c), c, 1.0) is None


# A test of a kernel against its torch path on CUDA (the ``cuda`` marker) and on the CPU in
# Triton's interpreter, whose run (`test_in_tritons_interpreter`) selects it by its id.
ON_CUDA_OR_INTERPRETED = [
    pytest.param("cuda", marks=pytest.mark.cuda, id="cuda"),
    pytest.param(
        "cpu",
        marks=pytest.mark.skipif(not fused_ranks.interpreted(), reason="runs in Triton's interpreter"),
        id="interpreted",
    ),
]


# AUC's hardest pairs by label: the batch against itself, 37 queries against 2100 references
# (three steps of 1024), an anchor without a positive, and none.
HARDEST_CASES = [(40, 40, True), (37, 2100, False), (0, 4, False)]


def check_hardest_kernel_equals_the_torch_path(case, device, monkeypatch):
    """`AUCLoss.hardest_of_each_anchor` by labels through `auc._hardest_kernel` and through
    torch's masks: the same indices, and of equal similarities the first (in one step and
    across steps); and the loss and its gradient through either."""
    rows, columns, itself = case
    generator = torch.Generator().manual_seed(0)
    similarity = torch.randn(rows, columns, generator=generator)
    labels = torch.randint(0, 4, (rows,), generator=generator)
    ref_labels = labels if itself else torch.randint(0, 4, (columns,), generator=generator)
    if rows:
        labels[1] = 9  # no positive
    if columns > 2000:
        ref_labels[[3, 1500, 5, 2000]] = torch.tensor([labels[0], labels[0], labels[0] + 1, labels[0] + 1])
        similarity[0, [3, 1500, 5, 2000]] = torch.tensor([-9.0, -9.0, 9.0, 9.0])
    results = []
    for fused in (True, False):
        monkeypatch.setattr(fused_ranks, "reads", lambda t, fused=fused: fused)
        on_device = [t.to(device) for t in (similarity, labels)]
        references = on_device[1] if itself else ref_labels.to(device)
        results.append(AUCLoss.hardest_of_each_anchor(on_device[0].clone(), on_device[1], None, references))
        if itself:  # a matrix whose rows are not contiguous (the transpose of one) too
            transposed = on_device[0].T.contiguous().T
            results[-1] += AUCLoss.hardest_of_each_anchor(transposed, on_device[1], None, references)
    for fused, plain in zip(*results):
        assert torch.equal(fused, plain), (fused, plain)
    if columns > 2000:
        assert results[0][0][0] == 3 and results[0][1][0] == 5
    if itself and rows:
        embeddings = torch.randn(rows, 8, generator=generator)
        losses = []
        for fused in (True, False):
            monkeypatch.setattr(auc_module._triton, "runs_on", lambda t, fused=fused: fused)
            monkeypatch.setattr(fused_ranks, "reads", lambda t, fused=fused: fused)
            leaf = embeddings.to(device, copy=True).requires_grad_()
            loss = AUCLoss()(leaf, labels.to(device))
            loss.backward()
            losses.append((loss.detach(), leaf.grad))
        torch.testing.assert_close(losses[0], losses[1])  # the normalisation kernels also in the first


@pytest.mark.parametrize("device", ON_CUDA_OR_INTERPRETED)
@pytest.mark.parametrize("case", HARDEST_CASES)
def test_hardest_kernel_equals_the_torch_path(case, device, monkeypatch):
    check_hardest_kernel_equals_the_torch_path(case, device, monkeypatch)


# AUC's ROC rates: one anchor, 300 (three steps of the rates kernel's loop), AUCLoss's grid;
# a steep slope that takes most arguments to the clamp, on a grid of 41 thresholds; and a grid
# of 5001, more than the area kernel holds (the area from the fused rates by torch).
ROC_RATES_CASES = [(1, 0.005, 1.0), (300, 0.005, 1.0), (300, 0.05, 10.0), (3, 0.0004, 1.0)]


@pytest.mark.parametrize("device", ON_CUDA_OR_INTERPRETED)
@pytest.mark.parametrize("case", ROC_RATES_CASES)
def test_roc_rates_kernel_equals_the_torch_path(case, device, monkeypatch):
    """AUCLoss's relaxed ROC area of stacked scores through `auc._roc_rates_kernel`,
    `_roc_area_kernel` and `_roc_gradient_kernel` and through torch's passes: the loss and the
    scores' gradient."""
    anchors, step, steeper = case
    generator = torch.Generator().manual_seed(anchors)
    scores = torch.rand(2, anchors, generator=generator) * 1.6 - 0.8
    grid = auc_module.thresholds(step, device=device)
    slope = steeper * AUCLoss().slope
    results = []
    for fused in (True, False):
        monkeypatch.setattr(auc_module._triton, "runs_on", lambda t, fused=fused: fused)
        leaf = scores.to(device, copy=True).requires_grad_()
        loss = auc_module._RocArea.apply(grid, slope, True, leaf)
        loss.backward()
        results.append((loss.detach(), leaf.grad))
    torch.testing.assert_close(results[0], results[1], rtol=1e-5, atol=1e-6)
    assert results[0][1].abs().max() > 0


# N-pair-mc's cross entropy: 40 classes of 2 (one step of its kernels), 1500 (two steps),
# the paper's unnormalised inner products (exponents past EXP_FLOOR), and a summed loss (its
# rows' incoming gradient an expanded scalar, read with stride 0); N-pair-ovo's gradient alike.
NPAIRS_CASES = [(80, 1.0, None), (3000, 1.0, None), (80, 8.0, None), (80, 1.0, "sum")]
NPAIRS_CASES += [(80, 1.0, "ovo"), (3000, 1.0, "ovo"), (80, 8.0, "ovo")]


@pytest.mark.parametrize("device", ON_CUDA_OR_INTERPRETED)
@pytest.mark.parametrize("case", NPAIRS_CASES)
def test_npairs_cross_entropy_kernels_equal_the_torch_path(case, device, monkeypatch):
    """NPairsMCLoss through `npairs._cross_entropy_kernel` and `_cross_entropy_gradient_kernel`
    (NPairsOVOLoss through `_one_vs_one_gradient_kernel`) and through torch's operations: the
    loss and the gradient."""
    batch, scale, reducer = case
    generator = torch.Generator().manual_seed(batch)
    embeddings = torch.randn(batch, 16, generator=generator) * scale
    labels = torch.arange(batch) // 2
    results = []
    for fused in (True, False):
        monkeypatch.setattr(npairs_module._triton, "runs_on", lambda t, fused=fused: fused)
        leaf = embeddings.to(device, copy=True).requires_grad_()
        loss_class = NPairsOVOLoss if reducer == "ovo" else NPairsMCLoss
        loss_func = loss_class(l2_reg_weight=0, reducer=SumReducer() if reducer == "sum" else None)
        loss = loss_func(leaf, labels.to(device))
        loss.backward()
        results.append((loss.detach(), leaf.grad))
    torch.testing.assert_close(results[0], results[1], rtol=1e-5, atol=1e-5 * scale)
    assert results[0][1].abs().max() > 0


@pytest.mark.parametrize("device", ON_CUDA_OR_INTERPRETED)
def test_one_vs_one_gradient_kernel_takes_a_transposed_matrix(device, monkeypatch):
    """`npairs._one_vs_one_gradient_kernel` on the margins of a transposed similarity matrix
    (a distance whose product comes out column-major; the margins keep its strides): the
    torch path's gradient, each row's sum on its own diagonal entry."""
    generator = torch.Generator().manual_seed(3)
    matrix = torch.randn(6, 6, generator=generator).to(device)
    weights = torch.arange(1.0, 7.0).to(device)  # a different incoming gradient for each row
    gradients = []
    for fused in (True, False):
        monkeypatch.setattr(npairs_module._triton, "runs_on", lambda t, fused=fused: fused)
        leaf = matrix.clone().requires_grad_()  # its transpose: column-major
        (npairs_module._OneVsOneSoftplus.apply(leaf.T) * weights).sum().backward()
        gradients.append(leaf.grad)
    torch.testing.assert_close(gradients[0], gradients[1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("device", ON_CUDA_OR_INTERPRETED)
def test_label_reading_kernels_take_a_strided_label_vector(device):
    """The kernels that read the labels one by one (the relaxed ranks' weights by label,
    ROADMAP's calibration terms) given a column of a [batch, 2] target tensor (stride 2): the
    loss and gradient of its contiguous copy, for ROADMAP (both), SupAP and PNP (the ranks'),
    and the calibration terms on their own."""
    generator = torch.Generator().manual_seed(4)
    embeddings = torch.randn(24, 8, generator=generator).to(device)
    targets = torch.stack([torch.arange(24) // 4, torch.randint(0, 100, (24,), generator=generator)], 1).to(device)
    strided = targets[:, 0]
    assert strided.stride(0) == 2
    for make_loss in (ROADMAPLoss, SupAPLoss, PNPLoss):
        results = []
        for labels in (strided, strided.contiguous()):
            leaf = embeddings.clone().requires_grad_()
            loss = make_loss()(leaf, labels)
            loss.backward()
            results.append((loss.detach(), leaf.grad))
        torch.testing.assert_close(results[0], results[1], rtol=0, atol=0)
    matrix = embeddings @ embeddings.T
    assert fused_calibration.applies(matrix)
    terms = [
        fused_calibration.calibration_terms(matrix, labels, 0.9, 0.6, 0.5, 1.0)
        for labels in (strided, strided.contiguous())
    ]
    torch.testing.assert_close(terms[0], terms[1], rtol=0, atol=0)
    assert terms[1][0] > 0 and terms[1][1] > 0


def _loss_and_gradient(name, embeddings, labels):
    """The registered loss `name`, built with its defaults, on `embeddings` (a leaf of their own,
    in their layout) and `labels`: its value and its gradient (zeros where it gives none)."""
    leaf = embeddings.detach().requires_grad_()
    loss = pml_rank.registry.losses()[name]()(leaf, labels)
    loss.backward()
    return loss.detach(), leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)


# The losses whose call on CUDA adds floats with torch's index_add_, whose CUDA kernel adds with
# atomics in whatever order its threads run: two calls on the same numbers may differ in the last
# bits (AUC's gradient, scattered back to the rows of its hardest pairs; RaMBO-AP's precisions,
# summed per query). Every other loss's call is the same operations in the same order each time.
FLOAT_ATOMICS_ON_CUDA = {"AUCLoss", "RaMBOAPLoss"}


@pytest.mark.parametrize("name", sorted(pml_rank.registry.losses()))
@pytest.mark.parametrize(
    "device",
    [*ON_CUDA_OR_INTERPRETED, pytest.param("cpu", marks=pytest.mark.skipif(fused_ranks.interpreted(), reason="above"))],
)
def test_every_loss_takes_a_strided_label_vector(name, device):
    """Every registered loss given a column of a [batch, 2] target tensor (stride 2) as its
    labels, by its kernels where they run (and by torch on the CPU): the loss and gradient of
    the column's contiguous copy, bit for bit (a kernel reading labels + i compares other
    samples' labels), and no warning; on CUDA, for the losses that add with float atomics
    there (`FLOAT_ATOMICS_ON_CUDA`), within a few float32 roundings of the largest entry."""
    generator = torch.Generator().manual_seed(5)
    embeddings = torch.randn(32, 8, generator=generator).to(device)
    targets = torch.stack([torch.arange(32) // 4, torch.randint(0, 100, (32,), generator=generator)], 1).to(device)
    results = []
    for labels in (targets[:, 0], targets[:, 0].contiguous()):
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)  # nor a warning of torch about the strides
            # torch's once-a-process note when a backward pass's thread first runs cuBLAS, unrelated
            # to the labels (an earlier CUDA test usually takes it; this one, when run alone).
            warnings.filterwarnings("ignore", "Attempting to run cuBLAS, but there was no current CUDA context")
            results.append(_loss_and_gradient(name, embeddings, labels))
    assert results[1][1].abs().max() > 0
    if device == "cuda" and name in FLOAT_ATOMICS_ON_CUDA:
        (loss, gradient), (expected, expected_gradient) = results
        torch.testing.assert_close(loss, expected, rtol=1e-6, atol=0)
        scale = float(expected_gradient.abs().max())
        torch.testing.assert_close(gradient, expected_gradient, rtol=0, atol=1e-6 * scale)
    else:
        torch.testing.assert_close(results[0], results[1], rtol=0, atol=0)


def _odd_inputs(kind, embeddings, labels):
    """`embeddings` and `labels` as a caller may hand them over: the same numbers in another layout or type."""
    if kind == "transposed embeddings":  # columns of a [dim, batch] tensor
        return embeddings.T.contiguous().T, labels
    if kind == "strided embeddings":  # every other column of a wider tensor
        wide = torch.zeros(len(embeddings), 2 * embeddings.shape[1], device=embeddings.device)
        wide[:, ::2] = embeddings
        return wide[:, ::2], labels
    return embeddings, labels.int()  # "int32 labels"


@pytest.mark.parametrize("kind", ["transposed embeddings", "strided embeddings", "int32 labels"])
@pytest.mark.parametrize("name", sorted(pml_rank.registry.losses()))
@pytest.mark.parametrize(
    "device",
    [*ON_CUDA_OR_INTERPRETED, pytest.param("cpu", marks=pytest.mark.skipif(fused_ranks.interpreted(), reason="above"))],
)
def test_every_loss_takes_other_layouts_and_label_types(name, kind, device):
    """Every registered loss on embeddings that are a view with other strides, or on int32
    labels, by its kernels where they run (and by torch on the CPU): the loss of contiguous
    float32 embeddings and int64 labels, and its gradient, within float32 rounding (a
    matrix product may sum in another order on another layout)."""
    generator = torch.Generator().manual_seed(6)
    embeddings = torch.randn(32, 8, generator=generator).to(device)
    labels = (torch.arange(32) // 4).to(device)
    results = [_loss_and_gradient(name, x, y) for x, y in ((embeddings, labels), _odd_inputs(kind, embeddings, labels))]
    assert results[0][1].abs().max() > 0
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-5, atol=1e-6)
    scale = results[0][1].abs().max()
    torch.testing.assert_close(results[1][1] / scale, results[0][1] / scale, rtol=0, atol=1e-5)


# Batches with nothing or little to learn (the README's table), as label vectors.
DEGENERATE_BATCHES = {
    "empty": [],
    "one sample": [0],
    "all classes distinct": list(range(8)),
    "all one class": [0] * 8,
    "one pair among singletons": [0, 0, 1, 2, 3, 4, 5, 6],
}


@pytest.mark.parametrize("batch", list(DEGENERATE_BATCHES))
@pytest.mark.parametrize("name", sorted(pml_rank.registry.losses()))
@pytest.mark.parametrize("device", ON_CUDA_OR_INTERPRETED)
def test_every_loss_on_a_batch_with_little_to_learn_gives_the_torch_paths_result(name, batch, device, monkeypatch):
    """Every registered loss on the degenerate batches, by its kernels (empty launches, no
    pairs, one positive): the value and gradient of the plain-torch path (which the CPU's
    tests hold to the README's table), finite."""
    labels = torch.tensor(DEGENERATE_BATCHES[batch], dtype=torch.int64, device=device)
    embeddings = torch.randn(len(labels), 8, generator=torch.Generator().manual_seed(7)).to(device)
    results = []
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(_triton, "runs_on", lambda *args, **kwargs: False)
            monkeypatch.setattr(fused_ranks, "runs_on", lambda *args, **kwargs: False)
        results.append(_loss_and_gradient(name, embeddings, labels))
    assert bool(torch.isfinite(results[0][0])) and bool(torch.isfinite(results[0][1]).all())
    torch.testing.assert_close(results[0], results[1], rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not fused_ranks.interpreted(), reason="runs in Triton's interpreter (test_in_tritons_interpreter)")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
def test_interpreted_hardest_kernel_reads_a_half_product_as_its_float32_copy(dtype, monkeypatch):
    """Under autocast AUC's hardest pairs by label are chosen from the half-precision product
    as it is (each similarity converted to float32 as it is loaded): the same pairs, loss and
    gradient, bit for bit, as from its float32 copy."""
    read = []
    hardest = auc_module._hardest_by_label
    monkeypatch.setattr(auc_module, "_hardest_by_label", lambda s, *args: read.append(s.dtype) or hardest(s, *args))
    generator = torch.Generator().manual_seed(0)
    embeddings = torch.randn(40, 16, generator=generator)
    labels = torch.arange(40) // 4
    results = []
    for half in (True, False):
        if not half:
            monkeypatch.setattr(fused_ranks, "reads_half", lambda matrix: False)
        leaf = embeddings.clone().requires_grad_()
        with torch.autocast("cpu", dtype=dtype):
            loss = AUCLoss()(leaf, labels)
        loss.backward()
        results.append((loss.detach(), leaf.grad))
    assert read == [dtype, torch.float32]
    (loss, gradient), (expected, expected_gradient) = results
    assert loss.dtype == torch.float32 and torch.equal(loss, expected) and torch.equal(gradient, expected_gradient)
    assert gradient.abs().max() > 0


# FastAP by labels: the batch against itself, 10 bins and 100 (128 centres a histogram),
# and against 1100 references (two steps of the gradient kernel); the batch against itself
# summed (its queries' incoming gradient an expanded scalar, read with stride 0).
FASTAP_CASES = [("itself", 10), ("itself", 100), ("ref_emb", 10), ("summed", 10)]


def check_fastap_kernels_equal_the_torch_path(case, device, monkeypatch):
    """`FastAPLoss` by labels through `fastap._histograms_kernel` and `_gradient_kernel` and
    through the scattered histograms: the loss and the gradients, pairs at distance 0 and 4
    (the axis' ends, clamped) and a query without a positive included (but where summed)."""
    inputs, num_bins = case
    generator = torch.Generator().manual_seed(0)
    embeddings = torch.randn(36, 16, generator=generator)
    labels = torch.arange(36) // 4
    embeddings[1], embeddings[2], labels[35] = embeddings[0], -embeddings[0], 99  # distances 0 and 4; no positive
    if inputs == "summed":  # every query with a positive: the losses are summed unselected
        labels[35] = labels[34]
    references = torch.randn(1100, 16, generator=generator) if inputs == "ref_emb" else None
    ref_labels = torch.randint(0, 9, (1100,), generator=generator) if inputs == "ref_emb" else None
    results = []
    for fused in (True, False):
        monkeypatch.setattr(fastap_module, "fused_applies", lambda q, b, fused=fused: fused)
        leaves = [t.to(device, copy=True).requires_grad_() for t in (embeddings, references) if t is not None]
        extra = {} if references is None else {"ref_emb": leaves[1], "ref_labels": ref_labels.to(device)}
        reducer = SumReducer() if inputs == "summed" else None
        loss = FastAPLoss(num_bins=num_bins, reducer=reducer)(leaves[0], labels.to(device), **extra)
        loss.backward()
        results.append([loss.detach(), *(leaf.grad for leaf in leaves)])
    for fused, plain in zip(*results):
        torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("device", ON_CUDA_OR_INTERPRETED)
@pytest.mark.parametrize("case", FASTAP_CASES)
def test_fastap_kernels_equal_the_torch_path(case, device, monkeypatch):
    check_fastap_kernels_equal_the_torch_path(case, device, monkeypatch)


@pytest.mark.parametrize("device", ON_CUDA_OR_INTERPRETED)
@pytest.mark.parametrize("inputs", ["itself", "ref_emb"])
def test_fastap_kernels_read_autocasts_float16_product(inputs, device, monkeypatch):
    """Under float16 autocast FastAP's kernels read the half-precision product of the
    embeddings as it is and its backward products run in float16 (as autograd runs every
    other loss's), the bins' weights and sums in float32: the loss within the product's own
    rounding of the float32 computation on the same (float32) embeddings, the gradient in its
    direction however small the incoming gradient (each pair's, in float16, relative to the
    largest row scale: else in float16's subnormals, or 0)."""
    generator = torch.Generator().manual_seed(0)
    labels = torch.arange(96) // 4
    embeddings = torch.randn(24, 32, generator=generator)[labels] + torch.randn(96, 32, generator=generator)
    references = torch.randn(120, 32, generator=generator) if inputs == "ref_emb" else None
    ref_labels = torch.randint(0, 24, (120,), generator=generator) if inputs == "ref_emb" else None
    read = []
    histograms = fastap_module._fused_histograms
    monkeypatch.setattr(
        fastap_module,
        "_fused_histograms",
        lambda similarity, *args: read.append(similarity.dtype) or histograms(similarity, *args),
    )
    results = []
    for dtype in (torch.float16, None):
        leaves = [t.to(device, copy=True).requires_grad_() for t in (embeddings, references) if t is not None]
        extra = {} if references is None else {"ref_emb": leaves[1], "ref_labels": ref_labels.to(device)}
        with torch.autocast(device, dtype=torch.float16, enabled=dtype is not None):
            loss = FastAPLoss()(leaves[0], labels.to(device), **extra)
        (loss * 1e-6).backward()  # each pair's gradient would be in float16's subnormals
        results.append([loss.detach(), *(leaf.grad for leaf in leaves)])
    assert read == [torch.float16, torch.float32] and results[0][0].dtype == torch.float32
    (loss, *gradients), (expected, *expected_gradients) = results
    torch.testing.assert_close(loss, expected, rtol=1e-3, atol=0)
    for gradient, expected_gradient in zip(gradients, expected_gradients, strict=True):
        gradient, expected_gradient = gradient.double().flatten(), expected_gradient.double().flatten()
        cosine = gradient @ expected_gradient / (gradient.norm() * expected_gradient.norm())  # no eps: norms ~1e-9
        assert cosine > 0.999, cosine


# A row of 5 (one step), of 1500 (two steps of 1024), and no row at all.
UNIT_ROWS_SHAPES = [(6, 5), (3, 1500), (0, 4)]


def check_unit_rows_equal_the_torch_path(shape, device, monkeypatch):
    """`base._UnitRows` through `fused_unit_rows`' kernels and through torch: the rows and the
    gradient, rows whose norm is clamped (a zero row, one below eps) included."""
    generator = torch.Generator().manual_seed(0)
    x, grad = torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)
    if len(x) >= 3:
        x[1], x[2] = 0, x[2] * 1e-14  # both with norms below eps, clamped
    results = []
    for fused in (True, False):
        monkeypatch.setattr(fused_unit_rows, "applies", lambda t, fused=fused: fused)
        leaf = x.to(device, copy=True).requires_grad_()  # a leaf of its own in each pass
        rows = _UnitRows.apply(leaf, 1e-12)
        rows.backward(grad.to(device))
        results.append((rows.detach(), leaf.grad))
    (rows, gradient), (expected_rows, expected_gradient) = results
    torch.testing.assert_close(rows, expected_rows, rtol=2e-6, atol=1e-7)
    torch.testing.assert_close(gradient, expected_gradient, rtol=2e-6, atol=1e-6)
    if len(x) >= 3:  # a clamped row's gradient is g / eps
        for row in (1, 2):
            torch.testing.assert_close(gradient[row], grad[row].to(device) / 1e-12)


@pytest.mark.parametrize("device", ON_CUDA_OR_INTERPRETED)
@pytest.mark.parametrize("shape", UNIT_ROWS_SHAPES)
def test_unit_rows_kernels_equal_the_torch_path(shape, device, monkeypatch):
    check_unit_rows_equal_the_torch_path(shape, device, monkeypatch)


@pytest.mark.parametrize("device", ON_CUDA_OR_INTERPRETED)
def test_positive_counts_kernel_equals_the_torch_path(device, monkeypatch):
    """`ranking.positive_counts` through `fused_counts.counts` and through torch: each row's
    count (int32) and the numbers read back, for rows of several steps, a transposed mask
    (strided), rows without positives or all positives, rows of nothing, and no rows."""
    generator = torch.Generator().manual_seed(4)
    masks = [
        torch.rand(7, 30, generator=generator) < 0.2,
        torch.rand(5, 2 * fused_counts.ELEMENTS_PER_STEP + 3, generator=generator) < 0.01,
        (torch.rand(40, 6, generator=generator) < 0.3).T,
        torch.zeros(4, 9, dtype=torch.bool),
        torch.ones(3, 5, dtype=torch.bool),
        torch.zeros(3, 0, dtype=torch.bool),
        torch.zeros(0, 5, dtype=torch.bool),
    ]
    for mask in masks:
        mask = mask.to(device)
        assert fused_counts.applies(mask, (torch.bool,))
        counts = ranking.positive_counts(mask)
        with monkeypatch.context() as patch:
            patch.setattr(fused_counts, "applies", lambda *args: False)
            expected = ranking.positive_counts(mask)
        assert torch.equal(counts.per_sequence, expected.per_sequence) and counts.per_sequence.dtype == torch.int32
        assert counts[1:] == expected[1:] and expected.total == int(mask.sum())


@pytest.mark.parametrize("device", ON_CUDA_OR_INTERPRETED)
def test_label_positives_kernel_equals_the_torch_path(device, monkeypatch):
    """`rambo.positives_by_label` through `fused_counts.label_positives` and through torch
    (labels compared, the query's own column dropped by `without_self`, then counted): the
    same mask and counts, for a batch as its own references and other references (the
    memory's among them), rows of several steps, labels of two integer types and negative
    ones, a batch of one (no column left) and rows without a positive."""
    generator = torch.Generator().manual_seed(5)
    long = 2 * fused_counts.ELEMENTS_PER_STEP + 3
    for size, ref_size in [(1, 1), (7, 7), (30, 30), (5, long), (long, long), (9, 4)]:
        labels = torch.randint(-2, max(3, size // 3), (size,), generator=generator).to(device)
        for batch in (True, False):
            if batch and ref_size != size:
                continue
            ref_labels = labels if batch else torch.randint(-2, 5, (ref_size,), generator=generator).int().to(device)
            mask, counts = rambo_module.positives_by_label(labels, ref_labels, batch)
            with monkeypatch.context() as patch:
                patch.setattr(fused_counts, "applies", lambda *args: False)
                expected_mask, none = rambo_module.positives_by_label(labels, ref_labels, batch)
                expected = ranking.positive_counts(expected_mask)
            assert counts is not None and none is None
            assert torch.equal(mask, expected_mask) and mask.is_contiguous()
            assert torch.equal(counts.per_sequence, expected.per_sequence) and counts[1:] == expected[1:]


WITHOUT_SELF_SIZES = [1, 2, 5, 2 * fused_without_self.TILE + 3]


@pytest.mark.parametrize("device", ON_CUDA_OR_INTERPRETED)
@pytest.mark.parametrize("n", WITHOUT_SELF_SIZES)
def test_without_self_gradient_kernel_equals_the_torch_path(n, device):
    """`fused_without_self` against `rambo.symmetric_with_zero_diagonal`, to the last bit: one
    tile or several, non-finite entries included (a NaN, infinities of both signs, whose sum
    is NaN), and through RaMBO's similarities' backward pass."""
    generator = torch.Generator().manual_seed(n)
    grad = torch.randn(n, n - 1, generator=generator)
    if n >= 5:
        grad[0, 1], grad[2, 3], grad[3, 2] = float("nan"), float("inf"), float("-inf")
    grad = grad.to(device)
    assert fused_without_self.applies(grad)
    full = fused_without_self.symmetric_with_zero_diagonal(grad)
    torch.testing.assert_close(
        full, rambo_module.symmetric_with_zero_diagonal(grad.clone()), rtol=0, atol=0, equal_nan=True
    )
    queries = torch.randn(n, 8, generator=generator).to(device).requires_grad_()
    gradients = []
    for fused in (True, False):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(fused_without_self, "applies", lambda grad, fused=fused: fused)
            (gradient,) = torch.autograd.grad(rambo_module._SimilaritiesWithoutSelf.apply(queries), queries, grad)
        gradients.append(gradient)
    torch.testing.assert_close(gradients[0], gradients[1], rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("device", ON_CUDA_OR_INTERPRETED)
def test_label_pair_kernels_equal_the_positive_mask_entries(device):
    """`fused_label_pairs` (through `base.label_pairs_and_counts`) against the entries of
    `pair_masks`'s positive mask, row-major, (i, i) included `with_self`, each query's count
    and their extremes: shuffled and unequal classes, singletons, negative labels, labels of
    two integer types, a query without pairs, and batches of several programs and steps;
    neither `nonzero` nor `bincount` waits for the device (the one read-back, of the pairs'
    total and the counts' extremes, is a `tolist`)."""
    generator = torch.Generator().manual_seed(3)
    sizes = [(trial % 23 + 1, trial % 17 + 1) for trial in range(0, 30, 3)] + [(300, 300), (40, 600)]
    for size, ref_size in sizes:
        for batch in (True, False):
            labels = torch.randint(-3, max(6, size // 4), (size,), generator=generator).to(device)
            ref_labels = labels if batch else torch.randint(-3, 6, (ref_size,), generator=generator).int().to(device)
            assert fused_label_pairs.applies(labels, ref_labels)
            for with_self in (False, True):
                positive, _ = pair_masks(labels, ref_labels)
                if with_self and batch:
                    positive.fill_diagonal_(True)
                with ReadBacks() as read_backs:
                    queries, references, per_query, extremes = label_pairs_and_counts(labels, ref_labels, with_self)
                assert read_backs.events == ["wait"]  # the tolist
                for ours, expected in zip((queries, references), positive.nonzero(as_tuple=True), strict=True):
                    assert torch.equal(ours, expected)
                counts = positive.sum(1)
                assert torch.equal(per_query, counts) and per_query.dtype == torch.int64
                assert extremes == (int(counts.min()), int(counts.max()))


# Operations that launch no kernel besides views: fresh uninitialised tensors.
UNINITIALISED = {"aten::empty", "aten::empty_like", "aten::new_empty", "aten::empty_strided", "aten::new_empty_strided"}


class Launches(TorchDispatchMode):
    """The operations inside the context that launch something (about a kernel each on a
    GPU: no views, no uninitialised tensors), none while a fused kernel runs in the
    interpreter, which counts once (`pause`)."""

    def __init__(self):
        super().__init__()
        self.count, self.paused = 0, False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += not (self.paused or func.is_view or func._schema.name in UNINITIALISED)
        return func(*args, **(kwargs or {}))

    def pause(self, device):
        launches = self

        class Launch:
            def __enter__(self):
                launches.paused = True

            def __exit__(self, *exc):
                launches.paused = False
                launches.count += 1

        return Launch()


# The losses whose fused kernels the count below covers besides the relaxed ranks'.
COUNTED = {**LOSSES, "AUC": AUCLoss, "FastAP": FastAPLoss, "NPairs": NPairsMCLoss, "NPairsOVO": NPairsOVOLoss}
COUNTED["RaMBO"] = lambda: RaMBORecallLoss(memory_size=0)


@pytest.mark.skipif(not fused_ranks.interpreted(), reason="runs in Triton's interpreter (test_in_tritons_interpreter)")
@pytest.mark.parametrize(
    "name, most",
    [("SmoothAP", 29), ("Recall@k", 32), ("SupAP", 34), ("PNP", 32), ("ROADMAP", 43)]
    + [("AUC", 22), ("FastAP", 17), ("NPairs", 31), ("NPairsOVO", 35), ("RaMBO", 32)],
)
def test_interpreted_operations_per_call_stay_at_most_what_they_are(name, most, monkeypatch):
    """Forward and backward at batch 32 and 64, 4 per class, under the accelerator's policy,
    with the fused kernels (issue 34: the similarity product's own 23 are among them;
    Smooth-AP, Recall@k, SupAP, PNP and ROADMAP took 91, 107, 91, 87 and 139 before; AUC,
    FastAP and RaMBO recall with their kernels too; RaMBO 63 before its positives' counts
    were read back in one transfer and k kept on the device, two waits fewer for three
    operations more, then 65 before its kernels took the positives as listed, ties
    included, and the factors of Algorithm 1 came from CPU scalars, 49 before its kernels
    shifted by the margin and applied Algorithm 1's factors themselves, 42 before the
    gradient of its similarities without self took one kernel, 39 before its positives were
    counted by one, 36 before they were also found by label in it, 33 before the kernels read
    the positives' places as strided columns; AUC 44 before its hardest kernel wrote the whole
    index and its ROC area's backward took no pads, stack or sign, 37 before three kernels gave
    the ROC rates and the sigmoids' derivatives, the area, and its gradient; FastAP 37 before
    its histogram kernel took the AP from the histograms and its gradient kernel read those sums
    instead of a table built for it; N-pair-mc 40 before two kernels took its cross entropy and
    its gradient, N-pair-ovo 40 before one took its gradient): as many at either
    batch, and a count that creeps back up fails here. It depends on the code alone, not
    on the machine."""
    monkeypatch.setattr(_device_policy, "sized_for", lambda device: "memory")

    loss = COUNTED[name]()

    def launched(batch):
        launches = Launches()
        monkeypatch.setattr(fused_ranks, "on_device", launches.pause)
        monkeypatch.setattr(_triton, "on_device", launches.pause)
        embeddings = torch.randn(batch, 32, generator=torch.Generator().manual_seed(0)).requires_grad_()
        labels = torch.arange(batch) // 4
        with launches:
            loss(embeddings, labels).backward()
        return launches.count

    launched(32)  # a first call's one-time work (imports, caches) is not counted
    counts = [launched(32), launched(64)]
    assert counts[0] == counts[1] <= most, counts


def test_plain_torch_path_where_the_kernels_cannot_run():
    """float64 scores, a kernel without a fused form, and the CPU outside Triton's
    interpreter take the plain-torch panels."""
    for device in ["cpu"] + (["cuda"] if torch.cuda.is_available() else []):
        scores = torch.zeros(4, 4, device=device)
        assert not fused_ranks.applies(scores.double(), Sigmoid)
        assert not fused_ranks.applies(scores, object())
        assert fused_ranks.applies(scores, Sigmoid) == (device == "cuda" or fused_ranks.interpreted())


@pytest.mark.parametrize("capability, runs", [((6, 1), False), ((7, 0), True), ((9, 0), True)])
def test_kernels_run_on_the_gpus_triton_compiles_for(capability, runs, monkeypatch):
    """A CUDA GPU older than Triton supports (a Pascal card) takes the plain-torch path."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: capability)
    # The answer is kept per device: a fresh memory for this test's made-up GPU.
    monkeypatch.setattr(_triton, "_compiles_for", functools.cache(_triton._compiles_for.__wrapped__))
    scores = types.SimpleNamespace(dtype=torch.float32, device=torch.device("cuda", 0))
    assert fused_ranks.runs_on(scores) == (runs and fused_ranks.triton is not None)
    assert not fused_ranks.runs_on(types.SimpleNamespace(dtype=torch.float64, device=torch.device("cuda", 0)))


_INTERPRETED = {}  # the interpreted run's process and folder, once started


def start_interpreted_run():
    """Starts every case above marked "interpreted" on the CPU in Triton's interpreter, in a
    fresh process that records its kernel launches (`triton_launches.py`): a couple of
    minutes of one core, which `conftest.pytest_collection_finish` starts as soon as the
    suite is collected so that it runs beside the other tests. A no-op once started."""
    if _INTERPRETED or fused_ranks.triton is None or fused_ranks.interpreted():
        return
    folder = Path(tempfile.mkdtemp(prefix="pml-rank-interpreted-"))
    recorder = Path(__file__).parents[1] / "triton_launches.py"
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONWARNINGS": "ignore"}
    command = [sys.executable, str(recorder), str(folder / "launches.json"), "-q", "-p", "no:cacheprovider"]
    with open(folder / "stdout", "w") as stdout, open(folder / "stderr", "w") as stderr:
        process = subprocess.Popen(
            [*command, "-W", "ignore", __file__, "-k", "interpreted"], env=env, stdout=stdout, stderr=stderr
        )
    _INTERPRETED.update(process=process, folder=folder)


def stop_interpreted_run():
    """Ends the interpreted run if no test waited for it (a session stopped early) and removes its folder."""
    if _INTERPRETED:
        _INTERPRETED["process"].kill()
        _INTERPRETED["process"].wait()
        shutil.rmtree(_INTERPRETED["folder"], ignore_errors=True)


@pytest.fixture(scope="module")
def interpreted_run():
    """The interpreted run's ``(pytest's result, the kernel launches it made)``, waited for."""
    if fused_ranks.triton is None:
        pytest.skip("Triton is not installed")
    if fused_ranks.interpreted():
        pytest.skip("already in the interpreter")
    start_interpreted_run()
    process, folder = _INTERPRETED["process"], _INTERPRETED["folder"]
    process.wait(timeout=600)
    result = subprocess.CompletedProcess(
        process.args, process.returncode, (folder / "stdout").read_text(), (folder / "stderr").read_text()
    )
    launches = folder / "launches.json"
    return result, json.loads(launches.read_text()) if launches.exists() else []


def test_in_tritons_interpreter(interpreted_run):
    """Every case above, on the CPU in Triton's interpreter, in a fresh process."""
    result, _ = interpreted_run
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    expected = len(LOSSES) * len(INPUTS) + len(RAMBO_CASES) + 9 + len(FORMULA_CASES) * 5 + 1 + 10
    # Besides: label pairs 1, FastAP's float16 read 2, the hardest kernel's half reads 2.
    expected += len(UNIT_ROWS_SHAPES) + len(HARDEST_CASES) + len(ROC_RATES_CASES) + len(NPAIRS_CASES)
    expected += len(FASTAP_CASES)
    expected += len(HALF_READERS) * 4
    expected += 1 + 2 + len(WHOLE_STEP_CASES) + 2
    expected += 2  # RaMBO's waits, recall and AP
    expected += 2  # RaMBO's counting through ties: with a margin, and with a loss's scale
    expected += len(WITHOUT_SELF_SIZES)  # RaMBO's similarities' gradient
    expected += 2  # RaMBO's positives' counts, and by label
    expected += 2  # N-pair-ovo's gradient of a transposed matrix; strided labels
    expected += len(pml_rank.registry.losses()) * 4  # every loss on strided labels, other layouts and label types
    expected += len(pml_rank.registry.losses()) * len(DEGENERATE_BATCHES)  # and on batches with little to learn
    assert f"{expected} passed" in result.stdout, result.stdout[-1000:]


def ptxas_log(record, capability):
    """Compiles one recorded launch for a CUDA GPU of `capability` without one (Triton's
    compiler and its bundled ptxas) and returns ptxas's log; raises where it does not compile."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = getattr(importlib.import_module(record["module"]), record["kernel"])
    source = ASTSource(kernel, record["signature"], record["constants"])
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        fused_ranks.triton.compile(
            source,
            target=GPUTarget("cuda", capability, 32),
            options={"num_warps": record["num_warps"], **record["options"]},
        )
    return log.getvalue()


def test_every_kernel_launch_compiles_for_a_gpu_without_spilling(interpreted_run, tmp_path, monkeypatch):
    """Triton's interpreter accepts kernels that its compiler rejects, and says nothing of
    registers: every launch the cases above make (each kernel, its argument types, constants
    and warps) compiles for an H100 or H200 (sm_90) and keeps its values in registers.
    ROADMAP's label-reading calibration gradient at Triton's default 4 warps spilled 276
    bytes a thread (`fused_calibration.WARPS_PER_BLOCK`; 96 for an A100, sm_80, which
    compiles as well but is left out to keep the suite short)."""
    try:
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
    except ImportError:
        pytest.skip("this Triton has no CUDA backend")
    result, launches = interpreted_run
    assert result.returncode == 0, result.stdout[-3000:]
    kernels = {(r["module"], r["kernel"]) for r in launches}
    every = {"_sums_kernel", "_jacobian_kernel", "_smooth_ap_kernel", "_recall_kernel", "_ranks_kernel"}
    every |= {"_crossings_kernel", "_terms_kernel", "_finish_kernel", "_gradient_kernel", "_unit_rows_kernel"}
    every |= {"_unit_rows_gradient_kernel", "_hardest_kernel", "_histograms_kernel"}
    every |= {"_roc_rates_kernel", "_roc_area_kernel", "_roc_gradient_kernel"}
    every |= {"_cross_entropy_kernel", "_cross_entropy_gradient_kernel", "_one_vs_one_gradient_kernel"}
    every |= {"_label_counts_kernel", "_label_pairs_kernel"}
    every |= {"_symmetric_kernel", "_counts_kernel", "_label_positives_kernel"}
    assert {kernel for _, kernel in kernels} == every
    # Compiled as launched: the crossings kernel rounds as torch's separate multiply and add.
    assert all(r["options"] == {"enable_fp_fusion": False} for r in launches if r["kernel"] == "_crossings_kernel")
    # ptxas writes its log only for a kernel it compiles, not one found in Triton's cache.
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(fused_ranks.triton.knobs.nvidia, "dump_ptxas_log", True)
    spilled = []
    for record in launches:
        log = ptxas_log(record, 90)
        spills = re.findall(r"(\d+) bytes spill stores", log)
        assert spills, log
        if any(int(n) for n in spills):
            spilled.append((record["kernel"], record["constants"], record["num_warps"], spills))
    assert not spilled, spilled
