"""AUC-BH: the relaxed area under the ROC curve of batch-hard similarities.

Gajić et al., "Area Under the ROC Curve Maximization for Metric Learning", CVPR-W 2022,
Algorithm 1. Per anchor, the hardest positive similarity (HPS, the lowest) and the
hardest negative similarity (HNS, the highest) are the scores of a two-class problem.
Their ROC curve is traced with sigmoid-relaxed true- and false-positive rates at the
thresholds ``t_min, t_min + step, ..., t_max``, its area R taken by the trapezoid rule,
and the loss is ``1 - R``.
"""

import functools
import json
import math
from pathlib import Path

import numpy as np
import torch
from pytorch_metric_learning.distances import CosineSimilarity, DotProductSimilarity
from torch.autograd.function import once_differentiable

from .. import _triton
from .._checks import check_numbers
from .._triton import triton
from . import fused_ranks
from .base import RankLossBase, normalized_with_distance_stats, pair_masks, reference_is_batch
from .query_panels import true_rows

SLOPE_TABLE = Path(__file__).with_name("auc_slopes.json")


@functools.lru_cache(maxsize=1)
def slope_table():
    """The shipped table ``{"steps": [...], "slopes": [...], ...}`` (see
    ``examples/auc_slope_table.py``, which derives and rewrites it)."""
    return json.loads(SLOPE_TABLE.read_text())


def default_slope(step):
    """The table's slope for `step`, interpolated log-log between the table's steps."""
    table = slope_table()
    steps, slopes = np.asarray(table["steps"]), np.asarray(table["slopes"])
    if not steps[0] * (1 - 1e-9) <= step <= steps[-1] * (1 + 1e-9):
        raise ValueError(
            f"AUCLoss: no tabulated slope for step={step}; the table covers steps "
            f"{steps[0]} to {steps[-1]}. Pass slope= explicitly."
        )
    return float(np.exp(np.interp(math.log(step), np.log(steps), np.log(slopes))))


def thresholds(step, t_min=-1.0, t_max=1.0, dtype=torch.float32, device=None):
    """The S + 1 thresholds ``t_min, t_min + step, ..., t_max`` (both ends included).

    Algorithm 1's line 5 lists only the S left ends of the trapezoids; its line 11 adds
    ``s + step``, so the sigmoids are evaluated up to ``t_max`` as the paper's text says.
    """
    intervals = (t_max - t_min) / step
    count = round(intervals)
    if count < 1 or abs(intervals - count) > 1e-6 * max(1.0, intervals):
        raise ValueError(
            f"AUCLoss: (t_max - t_min) / step must be a whole number of at least 1, "
            f"got ({t_max} - {t_min}) / {step} = {intervals:.6g}"
        )
    return torch.linspace(t_min, t_max, count + 1, dtype=dtype, device=device)


def relaxed_roc_area(positive_scores, negative_scores, thresholds, slope):
    """Trapezoid area under the ROC curve with sigmoid-relaxed rates at `thresholds`
    (ascending). Scores are ``(..., n)``, usually one per anchor; leading dimensions
    are independent batches."""
    return _RocArea.apply(thresholds, slope, False, positive_scores, negative_scores)


# sigmoid(±60) is 1 and 8.8e-27 (exactly 1 and 0 to float32 and float64 precision next
# to the rates' other terms); beyond about ±87 float32's exp, and so sigmoid, under-
# or overflows and can take a slow path (measured here 5 times slower per element).
# The default slope (about 340) puts most (score, threshold) pairs there.
SIGMOID_CLAMP = 60.0


class _RocArea(torch.autograd.Function):
    """`relaxed_roc_area` of the positive and the negative scores, or of both stacked
    ``(2, ..., n)`` (one pass for both); with `complement`, 1 − that area (AUCLoss's loss).
    The rates at each threshold are ``sigmoid(slope · (scores[..., :, None] − thresholds)).mean(-2)``,
    the arguments clamped to ±SIGMOID_CLAMP; the sigmoids' derivatives are kept for the backward
    pass, where the gradient is a matrix-vector product: slope / n · σ(1 − σ) @ d area / d rates."""

    @staticmethod
    def forward(ctx, thresholds, slope, complement, *scores):
        derivatives = None
        ctx.slope, ctx.complement = slope, complement
        if len(scores) == 1 and scores[0].dim() == 2 and _triton.runs_on(scores[0]) and _triton.runs_on(thresholds):
            # AUCLoss's stacked scores on a GPU: the rates and the derivatives in one kernel, and
            # the area from them in a second (a third gives the gradient).
            rates, derivatives = _fused_rates(scores[0], thresholds, slope)
            if len(thresholds) <= AREA_MOST_THRESHOLDS:
                padded, loss = _fused_area(rates, complement)
                ctx.save_for_backward(padded, *derivatives)
                ctx.fused = True
                return loss
            tpr, fpr = rates
        else:
            sigmas = [
                torch.sub(x.unsqueeze(-1), thresholds).mul_(slope).clamp_(-SIGMOID_CLAMP, SIGMOID_CLAMP) for x in scores
            ]
            rates = [sigma.sigmoid_().mean(-2) for sigma in sigmas]
            tpr, fpr = rates if len(rates) == 2 else rates[0]
        # Both rates fall as the threshold rises: each interval adds its mean TPR times
        # the FPR it gives up. Written between zeros, from which the backward pass reads
        # each rate's two intervals (no padded copies there).
        padded = tpr.new_zeros(2, *tpr.shape[:-1], tpr.shape[-1] + 1)
        tpr_sums, fpr_drops = padded[..., 1:-1].unbind(0)
        torch.add(tpr[..., :-1], tpr[..., 1:], out=tpr_sums)
        torch.sub(fpr[..., :-1], fpr[..., 1:], out=fpr_drops)
        if derivatives is None:
            # The sigmoids' derivatives σ(1 − σ), in place of the sigmoids, for the backward pass.
            derivatives = [sigma.addcmul_(sigma, sigma, value=-1) for sigma in sigmas]
        ctx.save_for_backward(padded, *derivatives)
        ctx.fused = False
        twice_area = (tpr_sums * fpr_drops).sum(-1)
        # 1 − twice_area / 2 in one operation: the halving is exact either way.
        return torch.rsub(twice_area, 1, alpha=0.5) if complement else twice_area.div_(2)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_area):
        padded, *derivatives = ctx.saved_tensors
        # The complement's sign joins the last factor: negating is exact, wherever it is applied.
        slope = -ctx.slope if ctx.complement else ctx.slope
        if ctx.fused:
            return None, None, None, _fused_area_gradient(derivatives[0], padded, grad_area, slope)
        sums, drops = padded.unbind(0)
        # Each rate is in the intervals on its two sides (none beyond the ends).
        grad_rates = padded.new_empty(2, *padded.shape[1:-1], padded.shape[-1] - 1)
        torch.add(drops[..., :-1], drops[..., 1:], out=grad_rates[0])
        torch.sub(sums[..., 1:], sums[..., :-1], out=grad_rates[1])
        grad_rates.mul_(grad_area.unsqueeze(-1))
        grads = []
        for derivative, grad in zip(derivatives, grad_rates if len(derivatives) == 2 else [grad_rates]):
            grad = (derivative @ grad.unsqueeze(-1)).squeeze(-1)
            grads.append(grad.mul_(slope / (2 * derivative.shape[-2])))  # and the area's 1/2
        return None, None, None, *grads


class _PairedInnerProducts(torch.autograd.Function):
    """The inner products of the rows ``rows[index[0]]``, ``rows[index[1]]`` with
    ``rows[index[2]]``, ``rows[index[3]]`` (the similarities of `CosineSimilarity` and
    `DotProductSimilarity` between rows they have normalised), gathered once, with the gradients
    of both ends written straight into the buffer that is scattered back: autograd's graph
    stacks the two halves first. The same operations otherwise, and the same numbers."""

    @staticmethod
    def forward(ctx, rows, index):
        gathered = rows.index_select(0, index.view(-1))
        anchor_rows, pair_rows = gathered.view(2, 2 * index.shape[1], -1).unbind(0)
        ctx.save_for_backward(anchor_rows, pair_rows, index)
        ctx.shape = rows.shape
        return torch.sum(anchor_rows * pair_rows, dim=1)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        anchor_rows, pair_rows, index = ctx.saved_tensors
        ends = grad.new_empty(2, *anchor_rows.shape)
        torch.mul(grad.unsqueeze(1), pair_rows, out=ends[0])
        torch.mul(grad.unsqueeze(1), anchor_rows, out=ends[1])
        return grad.new_zeros(ctx.shape).index_add_(0, index.view(-1), ends.view(-1, ends.shape[-1])), None


def exact_roc_area(positive_scores, negative_scores):
    """The fraction of (positive, negative) pairs ranked correctly, ties counting half:
    what the relaxed area approximates. Scores are ``(..., n)`` like `relaxed_roc_area`'s."""
    difference = positive_scores.unsqueeze(-1) - negative_scores.unsqueeze(-2)
    return ((difference > 0).double() + (difference == 0).double() / 2).mean((-2, -1))


class AUCLoss(RankLossBase):
    """1 minus the relaxed ROC area of the batch-hard similarities (Algorithm 1).

    Args:
        step: the threshold spacing Δs.
        slope: the sigmoid slope; None takes it from pml-rank's table for `step`.
        t_min, t_max: the lowest and highest threshold; (t_max - t_min) / step must be
            a whole number.

    The hardest pairs come from `indices_tuple` when one is given (PML's
    ``BatchHardMiner`` triplets, or any pairs/triplets: the hardest per anchor among
    them), otherwise from every pair in the batch; both give the same loss and
    gradient. Anchors without a positive or without a negative are left out.
    Recorded statistics: ``num_anchors``, ``mean_hardest_pos_sim``, ``mean_hardest_neg_sim``.
    """

    finite_for_bounded_scores = True  # see RankLossBase

    def __init__(
        self, step: float = 0.005, slope: float | None = None, t_min: float = -1.0, t_max: float = 1.0, **kwargs
    ):
        super().__init__(**kwargs)
        check_numbers(self, "> 0", step=step)
        check_numbers(self, "", t_min=t_min, t_max=t_max)
        if not t_min < t_max:
            raise ValueError(f"AUCLoss: t_min must be below t_max, got t_min={t_min}, t_max={t_max}")
        if slope is not None:
            check_numbers(self, "> 0", slope=slope)
        if not self.distance.is_inverted:
            raise ValueError(
                f"AUCLoss: the distance must be a similarity (higher = closer), got {type(self.distance).__name__}"
            )
        thresholds(step, t_min, t_max)  # validates the grid now rather than in the first batch
        self.step = float(step)
        self.slope = float(slope) if slope is not None else default_slope(step)
        self.t_min = float(t_min)
        self.t_max = float(t_max)
        self.add_to_recordable_attributes(list_of_names=["step", "slope", "t_min", "t_max"], is_stat=False)
        self.add_to_recordable_attributes(
            list_of_names=["num_anchors", "mean_hardest_pos_sim", "mean_hardest_neg_sim"], is_stat=True
        )

    def compute_loss(self, embeddings, labels, indices_tuple, ref_emb, ref_labels):
        # Normalised once: the hardest pairs are chosen from the rows' product, and their
        # similarities (with gradients) taken from the same rows.
        queries, references = normalized_with_distance_stats(self.distance, embeddings, ref_emb)
        with torch.no_grad():
            # Under autocast, by labels, `_hardest_kernel` reads the half-precision product as it is.
            similarity = self.matrix_of_normalized(queries, references, half=indices_tuple is None)
        index, kept = self.hardest_pairs(similarity, labels, indices_tuple, ref_labels)
        del similarity  # not held through the rest
        # The one number read back (as FastAP's): a batch in which every anchor has both
        # (the usual one) needs no selection of the anchors (a nonzero, a wait).
        self.num_anchors = int(torch.count_nonzero(kept))
        if self.num_anchors == 0:
            return self.zero_losses()
        if self.num_anchors < len(kept):
            index = index[:, true_rows(kept, self.num_anchors)]
        # Only the chosen pairs need gradients: N x D work instead of a second N x N, with
        # the rows normalised once and gathered once: (anchor, anchor) against (positive,
        # negative), one pairwise similarity of 2 x anchors rows. index_select, not
        # indexing: its gradient's index_add_ is faster on the CPU than an accumulating
        # index_put_.
        if references is queries and type(self.distance) in (CosineSimilarity, DotProductSimilarity):
            similarities = _PairedInnerProducts.apply(queries, index)
        else:
            if references is queries:
                rows = queries.index_select(0, index.view(-1))
                anchor_rows, pair_rows = rows.view(2, 2 * index.shape[1], -1).unbind(0)
            else:
                anchor_rows = queries.index_select(0, index[:2].reshape(-1))
                pair_rows = references.index_select(0, index[2:].reshape(-1))
            similarities = self.distance.pairwise_distance(anchor_rows, pair_rows)
        similarities = similarities.view(2, -1)  # hps, hns
        if self.collect_stats:
            self.mean_hardest_pos_sim, self.mean_hardest_neg_sim = similarities.detach().float().mean(1).tolist()
        # Half precision arrives here as float32 (RankLossBase).
        grid = thresholds(self.step, self.t_min, self.t_max, dtype=similarities.dtype, device=similarities.device)
        loss = _RocArea.apply(grid, self.slope, True, similarities)
        return {"loss": {"losses": loss, "indices": None, "reduction_type": "already_reduced"}}

    def hardest_triplets(self, embeddings, labels, indices_tuple, ref_emb, ref_labels):
        """Indices ``(anchors, positives, negatives)`` of each anchor's lowest-similarity
        positive and highest-similarity negative, for anchors that have both. Candidates
        are the pairs in `indices_tuple` when given, otherwise every labelled pair."""
        with torch.no_grad():
            similarity = self.similarity_matrix(embeddings, ref_emb)
        positives, negatives, kept = self.hardest_of_each_anchor(similarity, labels, indices_tuple, ref_labels)
        anchors = kept.nonzero().squeeze(1)
        return anchors, positives[anchors], negatives[anchors]

    @staticmethod
    @torch.no_grad()
    def hardest_of_each_anchor(similarity, labels, indices_tuple, ref_labels):
        """`hardest_triplets` of every anchor from the similarity matrix (which it
        overwrites): the indices of its hardest positive and negative (meaningless where it
        has none), and whether it has both."""
        index, kept = AUCLoss.hardest_pairs(similarity, labels, indices_tuple, ref_labels)
        return index[2], index[3], kept

    @staticmethod
    @torch.no_grad()
    def hardest_pairs(similarity, labels, indices_tuple, ref_labels):
        """`hardest_of_each_anchor` as one [4, anchors] index, the rows of the pairs' ends as
        `compute_loss` gathers them (anchor, anchor, hardest positive, hardest negative), and
        whether each anchor has both. By labels on a GPU, one Triton pass over the matrix
        (`_hardest_kernel`) instead of ten (masks, fills, the two reductions) that writes
        the whole index."""
        if indices_tuple is None and labels is None:
            raise ValueError("AUCLoss: labels are required when indices_tuple is None")
        if indices_tuple is None and fused_ranks.reads(similarity):
            return _hardest_by_label(similarity, labels, ref_labels)
        if indices_tuple is None:
            # One comparison gives both masks; (i, i) is no positive of its own.
            not_positive = labels.unsqueeze(1) != ref_labels.unsqueeze(0)
            lowest = similarity.masked_fill(not_positive, torch.inf)
            if reference_is_batch(labels, ref_labels):
                lowest.fill_diagonal_(torch.inf)
            not_negative = ~not_positive
        else:
            positive, negative = pair_masks(labels, ref_labels, indices_tuple, shape=similarity.shape)
            lowest, not_negative = similarity.masked_fill(~positive, torch.inf), ~negative
        hardest_pos, positives = lowest.min(dim=1)
        # The matrix is not needed afterwards: mask it in place instead of copying it.
        hardest_neg, negatives = similarity.masked_fill_(not_negative, -torch.inf).max(dim=1)
        anchors = torch.arange(len(positives), device=positives.device)
        kept = (hardest_pos < torch.inf) & (hardest_neg > -torch.inf)
        return torch.stack([anchors, anchors, positives, negatives]), kept

    def get_default_distance(self):
        return CosineSimilarity()


# Thresholds per program of `_roc_rates_kernel`, and scores per step of its loop.
RATES_THRESHOLDS = 32
RATES_SCORES = 128


def _fused_rates(scores, thresholds, slope):
    """`_RocArea`'s rates [2, T] of the stacked scores [2, n] at the T thresholds and the
    sigmoids' derivatives [2, n, T], in `_roc_rates_kernel`: one pass where torch takes six
    (the differences, the slope, the clamp, the sigmoids, their means, the derivatives)."""
    scores, thresholds = scores.contiguous(), thresholds.contiguous()
    rows, count = scores.shape[1], len(thresholds)
    rates = scores.new_empty(2, count)
    derivatives = scores.new_empty(2, rows, count)
    with _triton.on_device(scores.device):
        _roc_rates_kernel[(2, triton.cdiv(count, RATES_THRESHOLDS))](
            scores, thresholds, rates, derivatives, rows, count, float(slope), SIGMOID_CLAMP,
            SCORES=RATES_SCORES, THRESHOLDS=RATES_THRESHOLDS,
        )  # fmt: skip
    return rates, [derivatives]


# The most thresholds `_roc_area_kernel` holds (in registers, one program); AUCLoss's default grid has 401.
AREA_MOST_THRESHOLDS = 4096


def _fused_area(rates, complement):
    """`_RocArea`'s sums of consecutive TPRs and drops of the FPR between zeros [2, T + 1] and
    its area (1 − that with `complement`) from the rates [2, T], in `_roc_area_kernel`: one
    launch for six small operations."""
    count = rates.shape[1]
    padded = rates.new_empty(2, count + 1)
    loss = rates.new_empty(())
    with _triton.on_device(rates.device):
        _roc_area_kernel[(1,)](
            rates, padded, loss, count, COMPLEMENT=complement, BLOCK=triton.next_power_of_2(count + 1)
        )  # fmt: skip
    return padded, loss


def _fused_area_gradient(derivatives, padded, grad_area, slope):
    """`_RocArea.backward`'s gradient of the stacked scores [2, n] from the derivatives
    [2, n, T], the padded sums and drops (`_fused_area`) and the incoming gradient, in
    `_roc_gradient_kernel`: one launch where torch takes five (each rate's two intervals, the
    incoming gradient, the matrix-vector product, the factor)."""
    rows, count = derivatives.shape[1], derivatives.shape[2]
    grad = derivatives.new_empty(2, rows)
    with _triton.on_device(derivatives.device):
        _roc_gradient_kernel[(2, triton.cdiv(rows, RATES_SCORES))](
            derivatives, padded, grad_area.contiguous(), grad, rows, count, slope / (2 * rows),
            SCORES=RATES_SCORES, THRESHOLDS=RATES_THRESHOLDS,
        )  # fmt: skip
    return grad


# Columns of a row per step of `_hardest_kernel`.
COLUMNS_PER_STEP = 1024


def _hardest_by_label(similarity, labels, ref_labels):
    """`AUCLoss.hardest_pairs` by labels, in `_hardest_kernel`: the same indices (the first
    of equal similarities, as torch's min and max give them)."""
    rows, columns = similarity.shape
    if similarity.stride(1) != 1:  # the kernel steps along a row's columns
        similarity = similarity.contiguous()
    index = torch.empty(4, rows, dtype=torch.int64, device=similarity.device)
    kept = torch.empty(rows, dtype=torch.bool, device=similarity.device)
    if rows:
        with _triton.on_device(similarity.device):
            _hardest_kernel[(rows,)](
                similarity, similarity.stride(0), labels.contiguous(), ref_labels.contiguous(), index, rows, kept,
                columns, SKIP_OWN=reference_is_batch(labels, ref_labels),
                BLOCK=min(triton.next_power_of_2(max(columns, 1)), COLUMNS_PER_STEP),
            )  # fmt: skip
    return index, kept


if triton is not None:
    import triton.language as tl

    @triton.jit
    def _roc_rates_kernel(
        scores,
        thresholds,
        rates,
        derivatives,
        rows,
        count,
        slope,
        clamp,
        SCORES: tl.constexpr,
        THRESHOLDS: tl.constexpr,
    ):
        half = tl.program_id(0)  # the positives' scores, then the negatives'
        t = tl.program_id(1) * THRESHOLDS + tl.arange(0, THRESHOLDS)
        counted = t < count
        threshold = tl.load(thresholds + t, mask=counted, other=0.0)
        total = tl.zeros([THRESHOLDS], dtype=tl.float32)
        for first in range(0, rows, SCORES):
            r = first + tl.arange(0, SCORES)
            held = r < rows
            x = tl.load(scores + half * rows + r, mask=held, other=0.0)
            argument = tl.minimum(tl.maximum((x[:, None] - threshold[None, :]) * slope, -clamp), clamp)
            sigma = tl.sigmoid(argument)
            both = held[:, None] & counted[None, :]
            total += tl.sum(tl.where(both, sigma, 0.0), axis=0)
            at = (half * rows + r).to(tl.int64)[:, None] * count + t[None, :]
            tl.store(derivatives + at, sigma - sigma * sigma, mask=both)
        tl.store(rates + half * count + t, total / rows, mask=counted)

    @triton.jit
    def _roc_area_kernel(rates, padded, loss, count, COMPLEMENT: tl.constexpr, BLOCK: tl.constexpr):
        # Entry k of the padded rows is interval k − 1 (thresholds k − 1 and k); 0 and count stay 0.
        k = tl.arange(0, BLOCK)
        interval = (k >= 1) & (k < count)
        tpr = tl.load(rates + k - 1, mask=interval, other=0.0)
        tpr_next = tl.load(rates + k, mask=interval, other=0.0)
        fpr = tl.load(rates + count + k - 1, mask=interval, other=0.0)
        fpr_next = tl.load(rates + count + k, mask=interval, other=0.0)
        sums = tl.where(interval, tpr + tpr_next, 0.0)
        drops = tl.where(interval, fpr - fpr_next, 0.0)
        tl.store(padded + k, sums, mask=k <= count)
        tl.store(padded + count + 1 + k, drops, mask=k <= count)
        twice_area = tl.sum(sums * drops, axis=0)
        if COMPLEMENT:
            tl.store(loss, 1.0 - 0.5 * twice_area)
        else:
            tl.store(loss, 0.5 * twice_area)

    @triton.jit
    def _roc_gradient_kernel(
        derivatives,
        padded,
        grad_area,
        grad,
        rows,
        count,
        factor,
        SCORES: tl.constexpr,
        THRESHOLDS: tl.constexpr,
    ):
        half = tl.program_id(0)  # the positives' scores (TPR), then the negatives' (FPR)
        r = tl.program_id(1) * SCORES + tl.arange(0, SCORES)
        held = r < rows
        incoming = tl.load(grad_area)
        total = tl.zeros([SCORES], dtype=tl.float32)
        for first in range(0, count, THRESHOLDS):
            t = first + tl.arange(0, THRESHOLDS)
            counted = t < count
            # d area / d rate: a TPR's two neighbouring FPR drops; an FPR's difference of the TPR sums.
            drops = tl.load(padded + count + 1 + t, mask=counted, other=0.0)
            drops_next = tl.load(padded + count + 1 + t + 1, mask=counted, other=0.0)
            sums = tl.load(padded + t, mask=counted, other=0.0)
            sums_next = tl.load(padded + t + 1, mask=counted, other=0.0)
            grad_rate = tl.where(half == 0, drops + drops_next, sums_next - sums) * incoming
            at = (half * rows + r).to(tl.int64)[:, None] * count + t[None, :]
            d = tl.load(derivatives + at, mask=held[:, None] & counted[None, :], other=0.0)
            total += tl.sum(d * grad_rate[None, :], axis=1)
        tl.store(grad + half * rows + r, total * factor, mask=held)

    @triton.jit
    def _hardest_kernel(
        similarity,
        stride,
        labels,
        ref_labels,
        index,
        rows,
        kept,
        columns,
        SKIP_OWN: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0)
        label = tl.load(labels + row)
        lowest, lowest_at = float("inf"), 0
        highest, highest_at = -float("inf"), 0
        for first in range(0, columns, BLOCK):
            j = first + tl.arange(0, BLOCK)
            inside = j < columns
            s = tl.load(similarity + row.to(tl.int64) * stride + j, mask=inside, other=0.0).to(tl.float32)
            same = tl.load(ref_labels + j, mask=inside, other=0) == label
            positive = inside & same
            if SKIP_OWN:
                positive = positive & (j != row)
            candidates = tl.where(positive, s, float("inf"))
            # Strictly lower, so that of equal similarities the first column is kept.
            block_lowest = tl.min(candidates, axis=0)
            if block_lowest < lowest:
                lowest, lowest_at = block_lowest, first + tl.argmin(candidates, axis=0)
            candidates = tl.where(inside & ~same, s, -float("inf"))
            block_highest = tl.max(candidates, axis=0)
            if block_highest > highest:
                highest, highest_at = block_highest, first + tl.argmax(candidates, axis=0)
        # The anchor itself twice (against its positive, then its negative): no arange and
        # concatenation of the index after the kernel.
        tl.store(index + row, row)
        tl.store(index + rows + row, row)
        tl.store(index + 2 * rows + row, lowest_at)
        tl.store(index + 3 * rows + row, highest_at)
        tl.store(kept + row, (lowest < float("inf")) & (highest > -float("inf")))
