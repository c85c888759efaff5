"""Multi-class N-pair loss and its one-vs-one variant (Sohn, NIPS 2016)."""

import math

import torch
import torch.nn.functional as F
from pytorch_metric_learning.distances import DotProductSimilarity
from pytorch_metric_learning.reducers import MeanReducer
from pytorch_metric_learning.regularizers import LpRegularizer
from pytorch_metric_learning.utils import common_functions as c_f
from pytorch_metric_learning.utils import loss_and_miner_utils as lmu
from torch.autograd.function import once_differentiable

from .. import _triton
from .._checks import check_numbers
from .._triton import triton
from .base import RankLossBase, plain_reducer, reference_is_batch


class NPairsMCLoss(RankLossBase):
    """N-pair-mc: for N pairs (f_i, f_i⁺) of N distinct classes,

        mean_i log(1 + Σ_{j≠i} exp(s(f_i, f_j⁺) − s(f_i, f_i⁺)))
        + l2_reg_weight · mean over the batch of ‖f‖²

    with s the distance's similarity (the paper's inner product f_iᵀf_j⁺ by default).

    Pairs are formed exactly as PML's ``NPairsLoss`` forms them, so with
    ``l2_reg_weight=0`` and the same distance both compute the same function: for each
    class, the anchor is its first sample in the batch and the positive its second
    (classes with a single sample are left out), or, given ``indices_tuple``, the first
    positive pair of each anchor label; given ``ref_emb``, positives come from ``ref_emb``
    (the first sample of the anchor's class there) and so do the negatives.

    Args:
        l2_reg_weight: weight of the penalty on squared embedding norms, which keeps
            the unnormalised inner products from growing without bound (0 switches it
            off). Implemented as PML's ``LpRegularizer(power=2)`` embedding regularizer
            (`SquaredNorms`), reported as the sub-loss ``embedding_reg_loss``.
        distance: default ``DotProductSimilarity(normalize_embeddings=False)``, the
            paper's inner product. PML's ``NPairsLoss`` defaults to the normalised one
            (cosine similarity); pass ``DotProductSimilarity()`` to get that.
    """

    finite_for_bounded_scores = True  # see RankLossBase

    def __init__(self, l2_reg_weight: float = 0.002, **kwargs):
        check_numbers(self, ">= 0", l2_reg_weight=l2_reg_weight)
        if l2_reg_weight > 0:
            if kwargs.get("embedding_regularizer") is not None:
                raise ValueError(
                    f"{type(self).__name__}: l2_reg_weight={l2_reg_weight} is itself an embedding "
                    "regularizer; pass l2_reg_weight=0 to use your own embedding_regularizer"
                )
            kwargs["embedding_regularizer"] = SquaredNorms()
            kwargs["embedding_reg_weight"] = l2_reg_weight
        super().__init__(**kwargs)
        self.l2_reg_weight = l2_reg_weight
        self.add_to_recordable_attributes(name="l2_reg_weight", is_stat=False)
        self.add_to_recordable_attributes(name="num_pairs", is_stat=True)

    def compute_loss(self, embeddings, labels, indices_tuple, ref_emb, ref_labels):
        c_f.labels_required(labels)
        using_ref = not reference_is_batch(labels, ref_labels)
        pairs = self.pairs(labels, indices_tuple, using_ref, ref_labels)
        self.num_pairs = pairs.shape[1]
        if self.num_pairs == 0:
            return self.zero_losses()
        if ref_emb is embeddings and self.plain_inner_product():
            self.distance.reset_stats()
            similarities = _PairProducts.apply(embeddings, pairs)
        else:
            if ref_emb is embeddings:
                # One gather of both ends: one scatter of their gradients in the backward pass.
                anchors, positives = embeddings[pairs].unbind(0)
            else:
                anchors, positives = embeddings[pairs[0]], ref_emb[pairs[1]]
            similarities = self.similarity_matrix(anchors, positives)
        if not self.distance.is_inverted:
            similarities = -similarities
        return {
            "loss": {
                "losses": self.per_anchor_losses(similarities),
                "indices": pairs[0],
                "reduction_type": "element",
            }
        }

    def plain_inner_product(self):
        """Whether the similarity is the paper's plain inner product (the default distance,
        recording no statistics, outside autocast), which `_PairProducts` computes."""
        distance = self.distance
        plain = type(distance) is DotProductSimilarity and not distance.normalize_embeddings
        plain = plain and distance.power == 1 and not distance.collect_stats
        return plain and getattr(self, "autocast_dtype", None) is None

    def per_anchor_losses(self, similarities):
        """Row i holds s(f_i, f_j⁺) for every j; the positive is on the diagonal.
        log(1 + Σ_{j≠i} exp(s_ij − s_ii)) is the cross entropy of row i with target i
        (`_SoftmaxCrossEntropy`: no exp of a far-out-of-range argument)."""
        return _SoftmaxCrossEntropy.apply(similarities)

    @staticmethod
    def pairs(labels, indices_tuple=None, using_ref=False, ref_labels=None):
        """The rows (anchor indices, positive indices) of a 2 x pairs tensor, one pair per
        class, in PML's order (ascending label). Positive indices point into ``ref_emb``
        when ``using_ref``."""
        if indices_tuple is None and not using_ref:
            return first_two_of_each_class(labels)
        if indices_tuple is None:
            indices_tuple = lmu.get_all_pairs_indices(labels, ref_labels)
        return torch.stack(lmu.convert_to_pos_pairs_with_unique_labels(indices_tuple, labels))

    def get_default_distance(self):
        return DotProductSimilarity(normalize_embeddings=False)


class SquaredNorms(LpRegularizer):
    """PML's ``LpRegularizer(p=2, power=2)``, each embedding's squared norm, with its
    gradient 2x computed in one pass (4 operations forward and backward where PML's
    autograd takes 9; the same values, the gradient to float rounding)."""

    def __init__(self):
        super().__init__(p=2, power=2)

    def forward(self, embeddings):
        reducer = self.reducer
        if plain_reducer(reducer, MeanReducer) and not self.collect_stats:
            # PML's reducer would take the mean of the norms too, after two aranges (the
            # losses' indices and the rows' "labels") that it does not read.
            self.reset_stats()
            reducer.reset_stats()
            return torch.mean(_SquaredNorms.apply(embeddings))
        return super().forward(embeddings)

    def compute_loss(self, embeddings):
        losses = _SquaredNorms.apply(embeddings)
        return {
            "loss": {"losses": losses, "indices": c_f.torch_arange_from_size(embeddings), "reduction_type": "element"}
        }


class _SquaredNorms(torch.autograd.Function):
    @staticmethod
    def forward(ctx, embeddings):
        ctx.save_for_backward(embeddings)
        return torch.linalg.vector_norm(embeddings, dim=1) ** 2

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_norms):
        (embeddings,) = ctx.saved_tensors
        return embeddings * (2 * grad_norms).unsqueeze(1)


class _PairProducts(torch.autograd.Function):
    """The inner products of the anchors ``embeddings[pairs[0]]`` and the positives
    ``embeddings[pairs[1]]`` (one gather of both), with the gradient of both written
    straight into the buffer that is scattered back: autograd's graph stacks the two
    halves first. The same operations otherwise, and the same numbers."""

    @staticmethod
    def forward(ctx, embeddings, pairs):
        anchors, positives = embeddings[pairs].unbind(0)
        ctx.save_for_backward(anchors, positives, pairs)
        ctx.shape = embeddings.shape
        return torch.matmul(anchors, positives.transpose(-1, -2))

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        anchors, positives, pairs = ctx.saved_tensors
        ends = grad.new_empty(2, *anchors.shape)
        torch.mm(grad, positives, out=ends[0])
        torch.mm(grad.t(), anchors, out=ends[1])
        return grad.new_zeros(ctx.shape).index_put_((pairs,), ends, accumulate=True), None


class NPairsOVOLoss(NPairsMCLoss):
    """N-pair-ovo (one-vs-one): the same pairs and penalty as :class:`NPairsMCLoss`,
    but each negative is contrasted with the positive on its own,

        mean_i Σ_{j≠i} log(1 + exp(s(f_i, f_j⁺) − s(f_i, f_i⁺))).
    """

    def per_anchor_losses(self, similarities):
        return _OneVsOneSoftplus.apply(similarities)


# Exponent arguments are kept at or above this: exp(-60) ≈ 8.8e-27 is a
# normal float in float32 and float64. Beyond about ±87 float32's exp (and sigmoid, softplus) under- or
# overflows, produces denormals or takes a slow path on some CPUs (measured here: 5 to
# 70 times slower per element), and with the paper's unnormalised inner product most
# pairs of a random batch land there. Terms below exp(-60) times the largest term are
# far below float precision (2^-24 in float32, 2^-53 in float64, for rows of fewer than
# 10^10 terms), so leaving them out changes no loss and no gradient that float
# arithmetic can resolve.
EXP_FLOOR = -60.0


class _SoftmaxCrossEntropy(torch.autograd.Function):
    """Per row i of a square matrix s: logsumexp_j s_ij − s_ii, with the softmax as
    gradient. Entries more than |EXP_FLOOR| below their row's maximum count as
    exp(EXP_FLOOR) in the sum and its gradient: invisible next to the maximum's 1, as is
    their exact gradient next to the largest one."""

    @staticmethod
    def forward(ctx, similarities):
        if _triton.runs_on(similarities):
            losses, probabilities = _fused_cross_entropy(similarities)
            ctx.save_for_backward(probabilities)
            return losses
        row_max = similarities.max(dim=1, keepdim=True).values
        shifted = torch.sub(similarities, row_max)
        probabilities = shifted.clamp_(min=EXP_FLOOR).exp_()
        total = probabilities.sum(dim=1, keepdim=True)
        losses = (total.log() + row_max).squeeze(1) - similarities.diagonal()
        ctx.save_for_backward(probabilities.div_(total))
        return losses

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_losses):
        (probabilities,) = ctx.saved_tensors
        if _triton.runs_on(probabilities):
            return _fused_cross_entropy_gradient(probabilities, grad_losses)
        grad = probabilities * grad_losses.unsqueeze(1)
        grad.diagonal().sub_(grad_losses)
        return grad


class _OneVsOneSoftplus(torch.autograd.Function):
    """Per row i: Σ_{j≠i} softplus(s_ij − s_ii), gradient sigmoid. Margins below
    EXP_FLOOR count as EXP_FLOOR (softplus(−60) ≈ 8.8e-27: each such term is off by
    less than that) and get gradient 0; sigmoid's argument stays below −EXP_FLOOR, where
    it is 1 to float precision."""

    @staticmethod
    def forward(ctx, similarities):
        margins = torch.sub(similarities, similarities.diagonal().unsqueeze(1)).clamp_(min=EXP_FLOOR)
        margins.diagonal().fill_(-math.inf)  # softplus(-inf) = 0 drops j = i exactly
        losses = F.softplus(margins).sum(dim=1)
        ctx.save_for_backward(margins)
        return losses

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_losses):
        (margins,) = ctx.saved_tensors
        if _triton.runs_on(margins):
            return _fused_one_vs_one_gradient(margins, grad_losses)
        # sigmoid'(m) weights; clamped margins (exactly EXP_FLOOR) and the diagonal get 0.
        grad = F.threshold_(margins.clamp(max=-EXP_FLOOR).sigmoid_(), _SIGMOID_AT_FLOOR, 0.0)
        grad.mul_(grad_losses.unsqueeze(1))
        grad.diagonal().sub_(grad.sum(dim=1))  # the diagonal holds 0 (margin -inf)
        return grad


# Just above sigmoid(EXP_FLOOR) in any float type: what a clamped margin's weight turns
# into, for threshold_ to zero.
_SIGMOID_AT_FLOOR = math.exp(EXP_FLOOR) * (1 + 1e-4)


# Columns per step of the cross-entropy kernels.
CROSS_ENTROPY_BLOCK = 1024


def _fused_cross_entropy(similarities):
    """`_SoftmaxCrossEntropy`'s losses [n] and the softmax of each row [n, n] of the square
    `similarities`, in `_cross_entropy_kernel`: one launch where torch takes nine (the row
    maxima, the shift, the floor, the exponentials, their sums, the logarithms, the sum with the
    maxima, the diagonal's difference, the division)."""
    n = len(similarities)
    losses = similarities.new_empty(n)
    probabilities = similarities.new_empty(n, n)
    if n:
        with _triton.on_device(similarities.device):
            _cross_entropy_kernel[(n,)](
                similarities, similarities.stride(0), similarities.stride(1), losses, probabilities, n, EXP_FLOOR,
                BLOCK=min(CROSS_ENTROPY_BLOCK, triton.next_power_of_2(n)),
            )  # fmt: skip
    return losses, probabilities


def _fused_cross_entropy_gradient(probabilities, grad_losses):
    """`_SoftmaxCrossEntropy.backward`'s gradient, the softmax times each row's incoming
    gradient less that on the diagonal, in `_cross_entropy_gradient_kernel`."""
    n = len(probabilities)
    grad = torch.empty_like(probabilities)
    if n:
        block = min(CROSS_ENTROPY_BLOCK, triton.next_power_of_2(n))
        with _triton.on_device(probabilities.device):
            _cross_entropy_gradient_kernel[(n, triton.cdiv(n, block))](
                probabilities, grad_losses, grad_losses.stride(0), grad, n, BLOCK=block
            )  # fmt: skip
    return grad


def _fused_one_vs_one_gradient(margins, grad_losses):
    """`_OneVsOneSoftplus.backward`'s gradient in `_one_vs_one_gradient_kernel`: one launch
    where torch takes six (the clamp, the sigmoids, the threshold, the incoming gradient, the
    rows' sums, the diagonal)."""
    # The kernel reads and writes rows of n: the margins keep the similarities' strides (a
    # transposed matrix's columns would be read as rows), and so would empty_like.
    margins = margins.contiguous()
    n = len(margins)
    grad = torch.empty_like(margins)
    if n:
        with _triton.on_device(margins.device):
            _one_vs_one_gradient_kernel[(n,)](
                margins, grad_losses, grad_losses.stride(0), grad, n, -EXP_FLOOR, _SIGMOID_AT_FLOOR,
                BLOCK=min(CROSS_ENTROPY_BLOCK, triton.next_power_of_2(n)),
            )  # fmt: skip
    return grad


def first_two_of_each_class(labels):
    """For every label with at least two samples: its first and second index in the
    batch, as the rows (anchors, positives) of a 2 x labels tensor, sorted by label. The same pairs as PML's
    ``convert_to_pos_pairs_with_unique_labels`` on all pairs, in O(B log B) instead of
    the B×B match matrix."""
    sorted_labels, order = torch.sort(labels, stable=True)
    if len(labels) < 2:
        return order.new_empty(2, 0)
    # Position k of the sorted batch starts a class (k = 0 always does); a pair starts
    # where a class starts and the next position does not.
    starts = F.pad(sorted_labels[1:] != sorted_labels[:-1], (1, 0), value=True)
    pair_starts = (starts[:-1] > starts[1:]).nonzero().squeeze(1)
    return order.unfold(0, 2, 1)[pair_starts].T  # (first, second) of each such class


if triton is not None:
    import triton.language as tl

    @triton.jit
    def _cross_entropy_kernel(
        similarities, stride, column_stride, losses, probabilities, columns, floor, BLOCK: tl.constexpr
    ):
        # _SoftmaxCrossEntropy.forward's operations on one row, in their order.
        row = tl.program_id(0)
        start = similarities + row.to(tl.int64) * stride
        highest = -float("inf")
        for first in range(0, columns, BLOCK):
            j = first + tl.arange(0, BLOCK)
            s = tl.load(start + j * column_stride, mask=j < columns, other=-float("inf"))
            highest = tl.maximum(highest, tl.max(s, axis=0))
        total = 0.0
        for first in range(0, columns, BLOCK):
            j = first + tl.arange(0, BLOCK)
            inside = j < columns
            s = tl.load(start + j * column_stride, mask=inside, other=0.0)
            total += tl.sum(tl.where(inside, tl.exp(tl.maximum(s - highest, floor)), 0.0), axis=0)
        own = tl.load(start + row * column_stride)
        tl.store(losses + row, (tl.log(total) + highest) - own)
        out = probabilities + row.to(tl.int64) * columns
        for first in range(0, columns, BLOCK):
            j = first + tl.arange(0, BLOCK)
            inside = j < columns
            s = tl.load(start + j * column_stride, mask=inside, other=0.0)
            tl.store(out + j, tl.exp(tl.maximum(s - highest, floor)) / total, mask=inside)

    @triton.jit
    def _cross_entropy_gradient_kernel(probabilities, grad_losses, grad_stride, grad, columns, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = j < columns
        at = row.to(tl.int64) * columns + j
        incoming = tl.load(grad_losses + row * grad_stride)
        value = tl.load(probabilities + at, mask=inside, other=0.0) * incoming
        tl.store(grad + at, tl.where(j == row, value - incoming, value), mask=inside)

    @triton.jit
    def _one_vs_one_gradient_kernel(
        margins, grad_losses, grad_stride, grad, columns, ceiling, floor_weight, BLOCK: tl.constexpr
    ):
        # _OneVsOneSoftplus.backward's operations on one row; the diagonal (margin −inf, weight
        # 0) is written once, after the row's sum.
        row = tl.program_id(0)
        incoming = tl.load(grad_losses + row * grad_stride)
        at = row.to(tl.int64) * columns
        total = 0.0
        for first in range(0, columns, BLOCK):
            j = first + tl.arange(0, BLOCK)
            inside = j < columns
            weight = tl.sigmoid(tl.minimum(tl.load(margins + at + j, mask=inside, other=0.0), ceiling))
            value = tl.where(inside & (weight > floor_weight), weight, 0.0) * incoming
            tl.store(grad + at + j, value, mask=inside & (j != row))
            total += tl.sum(value, axis=0)
        own = tl.sigmoid(tl.minimum(tl.load(margins + at + row), ceiling))
        tl.store(grad + at + row, tl.where(own > floor_weight, own, 0.0) * incoming - total)
