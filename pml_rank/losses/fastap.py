"""FastAP: Cakir et al., "Deep Metric Learning to Rank" (CVPR 2019).

The same function as the authors' code and PML's `FastAPLoss` (which builds a
(num_bins+1) x N x N pulse tensor and differentiates it with autograd). Here each
distance falls into at most two adjacent triangular bins, so its bin index and weight
are computed once, the histograms are accumulated with `index_add_`, and the backward
pass applies the paper's analytic gradient through a custom autograd function. Memory
stays a few N x M matrices whatever `num_bins` is.
"""

import torch
from pytorch_metric_learning.distances import LpDistance
from pytorch_metric_learning.utils import common_functions as c_f
from torch.autograd.function import once_differentiable

from .base import RankLossBase, pair_masks, reference_is_batch

# Squared Euclidean distances between unit vectors lie in [0, MAX_DISTANCE].
MAX_DISTANCE = 4.0


class FastAPLoss(RankLossBase):
    """FastAP loss: 1 - mean over queries (with at least one positive) of the
    histogram-approximated average precision.

    Args:
        num_bins: number of bins of [0, 4]; there are num_bins + 1 bin centres
            0, 4/num_bins, ..., 4 (the paper's and PML's default is 10).

    Every sample is a query that retrieves the rest of the batch (or `ref_emb`). With an
    `indices_tuple`, its pairs (converted with PML's `convert_to_pairs`) are each query's
    positives and negatives instead of all other samples; PML's `FastAPLoss` uses a miner
    only to weight queries. float16 / bfloat16 embeddings are computed, and their losses
    returned, in float32; float64 stays float64.
    """

    def __init__(self, num_bins: int = 10, **kwargs):
        super().__init__(**kwargs)
        c_f.assert_distance_type(self, LpDistance, normalize_embeddings=True, p=2, power=2)
        if num_bins < 1:
            raise ValueError(f"FastAPLoss: num_bins must be a positive integer, got {num_bins!r}")
        self.num_bins = int(num_bins)
        self.add_to_recordable_attributes(list_of_names=["num_bins"], is_stat=False)
        self.add_to_recordable_attributes(list_of_names=["num_queries"], is_stat=True)

    def compute_loss(self, embeddings, labels, indices_tuple, ref_emb, ref_labels):
        c_f.labels_required(labels)
        positive, negative = pair_masks(labels, ref_labels, indices_tuple)
        # The pairs that are neither: the diagonal when the batch is its own reference set.
        exclude_self = indices_tuple is None and reference_is_batch(labels, ref_labels)
        excluded = None if indices_tuple is None else ~(positive | negative)
        num_positives = positive.sum(1, dtype=torch.int32)  # summing bool as int64 copies N x M first: 10x slower
        has_positive = num_positives > 0
        if self.collect_stats:
            self.num_queries = int(has_positive.sum())
        if not bool(has_positive.any()):
            return self.zero_losses()
        # Half precision arrives here as float32 (RankLossBase): in float16 / bfloat16,
        # bin counts beyond 2048 / 256 would be inexact.
        queries, references = self.normalized_with_distance_stats(embeddings, ref_emb)
        ap = FastAPFunction.apply(queries, references, positive, excluded, exclude_self, num_positives, self.num_bins)
        return {
            "loss": {
                "losses": 1 - ap[has_positive],
                "indices": torch.where(has_positive)[0],
                "reduction_type": "element",
            }
        }

    def normalized_with_distance_stats(self, embeddings, ref_emb):
        """The L2-normalised embeddings and references, recording the distance's
        statistics as its own forward does (the kernel computes the distances itself)."""
        distance = self.distance
        distance.reset_stats()
        queries = distance.normalize(embeddings, dim=1)
        references = queries if ref_emb is embeddings else distance.normalize(ref_emb, dim=1)
        distance.set_default_stats(embeddings, ref_emb, queries, references)
        return queries, references

    def get_default_distance(self):
        return LpDistance(power=2)


def _leave_out(pairs, excluded, exclude_self):
    """Zero, in place, the entries of a queries x references matrix that are no pair."""
    if exclude_self:
        pairs.diagonal().zero_()
    if excluded is not None:
        pairs.masked_fill_(excluded, 0)


def _soft_histograms(flat_bin, lower_weight, upper_weight, num_queries, num_centres):
    """Per-query histograms: each pair adds `lower_weight` to its lower bin centre and
    `upper_weight` to the next one. `flat_bin` is the lower centre's index in the
    flattened (num_queries, num_centres) histogram, never a row's last centre."""
    hist = lower_weight.new_zeros(num_queries * num_centres)
    hist.index_add_(0, flat_bin.reshape(-1), lower_weight.reshape(-1))
    hist[1:].index_add_(0, flat_bin.reshape(-1), upper_weight.reshape(-1))
    return hist.view(num_queries, num_centres)


def _symmetrize_(matrix, block=256):
    """``matrix + matrix.T`` of a square matrix, in place, block by block: no second
    N x N buffer (the backward's peak memory), and cache-sized reads of the transposed
    side (adding a whole transposed view reads it strided, 3 times slower). The sums
    are those of ``matrix + matrix.T``."""
    n = len(matrix)
    for i in range(0, n, block):
        rows = slice(i, i + block)
        for j in range(i, n, block):
            columns = slice(j, j + block)
            upper, lower = matrix[rows, columns], matrix[columns, rows]
            total = upper + lower.T
            upper.copy_(total)
            if j != i:
                lower.copy_(total.T)
    return matrix


def _tail_sum(x):
    """Σ_{k ≥ l} x_k along the last dimension."""
    return x.flip(-1).cumsum(-1).flip(-1)


class FastAPFunction(torch.autograd.Function):
    """FastAP of every query (0 for a query without positives) with the paper's analytic
    gradient. `queries` (N x D) and `references` (M x D) are L2-normalised float32;
    `positive` (N x M, bool) marks positive pairs, `excluded` (N x M, bool or None) and
    `exclude_self` (the diagonal) the pairs that are neither positive nor negative."""

    @staticmethod
    def forward(ctx, queries, references, positive, excluded, exclude_self, num_positives, num_bins):
        n = queries.shape[0]
        num_centres = num_bins + 1
        delta = MAX_DISTANCE / num_bins
        # Position of each distance 2 - 2 cos on the bin axis, in units of delta. Rounding
        # can push a distance just outside [0, 4]; clamping keeps its whole unit of mass.
        per_unit = 2.0 / delta
        position = torch.addmm(queries.new_tensor(per_unit), queries, references.T, alpha=-per_unit)
        position.clamp_(0, num_bins)
        flat_bin = position.to(torch.int32)  # lower bin (position >= 0)
        # Triangular kernels: 1 - frac below, frac above (frac is exactly position - bin;
        # subtracting the int32 bins would first copy them to float, the peak memory).
        upper_weight = position.frac_()
        if int(flat_bin.max()) == num_bins:  # distance exactly 4: all weight on the last centre
            upper_weight.masked_fill_(flat_bin == num_bins, 1.0)
            flat_bin.clamp_(max=num_bins - 1)
        _leave_out(upper_weight, excluded, exclude_self)
        flat_bin += torch.arange(0, n * num_centres, num_centres, dtype=torch.int32, device=flat_bin.device).unsqueeze(
            1
        )

        positive_pairs = positive.view(-1).nonzero().squeeze(1)
        flat_bin = flat_bin.view(-1)
        positive_upper = upper_weight.view(-1)[positive_pairs]
        pos_hist = _soft_histograms(flat_bin[positive_pairs], 1 - positive_upper, positive_upper, n, num_centres)
        # Every pair: the upper weights, then the lower ones computed in the same buffer.
        # A fresh N x M buffer costs more (page faults) than the pass that fills it.
        all_hist = upper_weight.new_zeros(n * num_centres)
        all_hist[1:].index_add_(0, flat_bin, upper_weight.view(-1))
        lower_weight = upper_weight.neg_().add_(1)
        _leave_out(lower_weight, excluded, exclude_self)
        all_hist.index_add_(0, flat_bin, lower_weight.view(-1))
        all_hist = all_hist.view(n, num_centres)
        del lower_weight, upper_weight, position

        pos_cum = pos_hist.cumsum(1)
        inv_cum = all_hist.cumsum(1)
        inv_cum = torch.where(inv_cum > 0, inv_cum.reciprocal(), 0.0)  # empty prefix: term is 0
        scale = 1.0 / num_positives.clamp(min=1).to(queries.dtype)
        ap = (pos_hist * pos_cum * inv_cum).sum(1) * scale

        # Route positive pairs to the second half of the backward's slope table.
        flat_bin[positive_pairs] += n * num_centres
        flat_bin = flat_bin.view(positive.shape)
        ctx.save_for_backward(queries, references, flat_bin, excluded, pos_hist, pos_cum, inv_cum, all_hist, scale)
        ctx.exclude_self = exclude_self
        ctx.delta = delta
        ctx.same = references is queries
        return ap

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_ap):
        queries, references, flat_bin, excluded, pos_hist, pos_cum, inv_cum, all_hist, scale = ctx.saved_tensors
        # dAP/dh⁺_l and dAP/dh⁻_l (paper's analytic gradient, N⁺ held constant):
        #   dAP/dh⁺_l =  (H⁺_l / H_l + Σ_{k≥l} h⁺_k H⁻_k / H_k²) / N⁺
        #   dAP/dh⁻_l = -(Σ_{k≥l} h⁺_k H⁺_k / H_k²) / N⁺
        inv_sq = inv_cum * inv_cum
        d_pos = pos_cum * inv_cum + _tail_sum(pos_hist * (all_hist.cumsum(1) - pos_cum) * inv_sq)
        d_neg = -_tail_sum(pos_hist * pos_cum * inv_sq)
        # A pair in bin l moves weight from centre l to l + 1 as its distance grows:
        # dAP/dd = (dAP/dh_{l+1} - dAP/dh_l) / Δ. Also fold in d(distance)/d(cos) = -2.
        weight = (grad_ap * scale * (-2.0 / ctx.delta)).unsqueeze(1)
        table = torch.stack([d_neg, d_pos]) * weight
        table = torch.nn.functional.pad(table.diff(dim=2), (0, 1))
        # d loss / d cos(query, reference); index_select takes int32 indices as they are.
        grad_cos = table.view(-1).index_select(0, flat_bin.view(-1)).view(flat_bin.shape)
        _leave_out(grad_cos, excluded, ctx.exclude_self)

        grad_queries = grad_references = None
        if ctx.same:
            grad_queries = _symmetrize_(grad_cos) @ queries
        else:
            if ctx.needs_input_grad[0]:
                grad_queries = grad_cos @ references
            if ctx.needs_input_grad[1]:
                grad_references = grad_cos.T @ queries
        return grad_queries, grad_references, None, None, None, None, None
