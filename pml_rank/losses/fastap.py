"""FastAP: Cakir et al., "Deep Metric Learning to Rank" (CVPR 2019).

The same function as the authors' code and PML's `FastAPLoss` (which builds a
(num_bins+1) x N x N pulse tensor and differentiates it with autograd). Here each
distance falls into at most two adjacent triangular bins, so its bin index and weight
are computed once, the histograms are accumulated with `scatter_add_`, and the backward
pass applies the paper's analytic gradient through a custom autograd function. Memory
stays a few N x M matrices whatever `num_bins` is.
"""

import torch
from pytorch_metric_learning.distances import LpDistance
from pytorch_metric_learning.utils import common_functions as c_f
from torch.autograd.function import once_differentiable

from .. import _device_policy
from .base import RankLossBase, normalized_with_distance_stats, pair_masks, reference_is_batch, symmetrize_
from .query_panels import true_rows

# Squared Euclidean distances between unit vectors lie in [0, MAX_DISTANCE].
MAX_DISTANCE = 4.0
# Copies of each histogram centre that consecutive pairs add to in turn (see
# FastAPFunction.forward): at batch 2048 on one thread, 4 copies took the two scatters
# from 16 to 7 ms (2 copies: 10 ms, 8 copies: as 4).
INTERLEAVE = 4


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
        # Summed as bytes: a bool sum converts every element first (3 times slower).
        num_positives = positive.view(torch.uint8).sum(1, dtype=torch.int32)
        has_positive = num_positives > 0
        # The one number read back from the device: with it, a batch in which every query
        # has a positive (the usual one) needs no selection of the queries (a nonzero and a
        # boolean index, each a wait for the device, and a scatter in the backward pass).
        self.num_queries = int(torch.count_nonzero(has_positive))
        if self.num_queries == 0:
            return self.zero_losses()
        # Half precision arrives here as float32 (RankLossBase): in float16 / bfloat16,
        # bin counts beyond 2048 / 256 would be inexact.
        queries, references = normalized_with_distance_stats(self.distance, embeddings, ref_emb)
        ap = FastAPFunction.apply(queries, references, positive, excluded, exclude_self, num_positives, self.num_bins)
        indices = true_rows(has_positive, self.num_queries)
        ap = ap if self.num_queries == len(ap) else ap[indices]
        return {"loss": {"losses": 1 - ap, "indices": indices, "reduction_type": "element"}}

    def get_default_distance(self):
        return LpDistance(power=2)


def _leave_out(pairs, excluded, exclude_self, first_row=0):
    """Zero, in place, the entries of rows `first_row`... of a queries x references
    matrix that are no pair (`excluded`: those rows' mask)."""
    if exclude_self:
        pairs.diagonal(first_row).zero_()
    if excluded is not None:
        pairs.masked_fill_(excluded, 0)


# Entries of one chunk of rows on the CPU. Their temporaries (int64 indices: 8 bytes an
# entry) stay small enough to be reused, not freshly mapped (page faults), and there are few
# enough chunks (each operation on a chunk synchronises the threads). At batch 2048, 2^17
# to 2^19 take the same time on one thread; from 2^21 the whole loss takes 25% longer.
CACHE_CHUNK_ENTRIES = 1 << 19


def _row_chunks(n, m, device):
    """Slices of rows of an n x m matrix, as `_device_policy` sizes work on `device`: chunks
    of at most `CACHE_CHUNK_ENTRIES` entries on the CPU (at least one row), the whole
    matrix elsewhere (a chunk's kernels, launched per chunk, cost more than its work)."""
    cache = _device_policy.sized_for(device) == "cache"
    budget = CACHE_CHUNK_ENTRIES if cache else _device_policy.work_budget(device, n * m)
    step = max(1, budget // max(m, 1))
    return [slice(start, start + step) for start in range(0, n, step)]


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
        n, m = len(queries), len(references)
        num_centres = num_bins + 1
        delta = MAX_DISTANCE / num_bins
        # Position of each distance 2 - 2 cos on the bin axis, in units of delta. Rounding
        # can push a distance just outside [0, 4]; clamping keeps its whole unit of mass.
        per_unit = 2.0 / delta
        # new_full, not new_tensor: filled on the device, where a copy from the host waits.
        position = torch.addmm(queries.new_full((), per_unit), queries, references.T, alpha=-per_unit)
        position.clamp_(0, num_bins)
        # Per query, the soft histograms of its negative pairs (centres 0 ... C - 1) and of
        # its positive pairs (C ... 2C - 1) side by side. Triangular kernels: a pair adds
        # 1 - w to its lower centre and w to the next. Scattered along the rows (threads
        # share them), a chunk of rows at a time, into INTERLEAVE copies of each centre,
        # pair j adding to copy j % INTERLEAVE: consecutive pairs in one centre (most of
        # a row is) then add to different addresses and do not wait on each other.
        num_slots = 2 * num_centres * INTERLEAVE
        hist = position.new_zeros(n, num_slots)
        pair_copy = torch.arange(m, device=position.device).remainder_(INTERLEAVE).to(position.dtype)
        # Each pair's slot in the flattened (N, num_slots) histogram, for the backward pass.
        # In float32 they take the place of the positions a chunk has used up: a fresh
        # N x M buffer costs more (page faults) than the pass that fills it.
        if position.dtype == torch.float32:
            flat_slots = position.view(torch.int32)
        else:
            flat_slots = torch.empty(position.shape, dtype=torch.int32, device=position.device)
        row_start = torch.arange(0, n * num_slots, num_slots, device=position.device)[:, None]
        for rows in _row_chunks(n, m, position.device):
            # Slots are small integers, computed exactly in floating point (float ops are
            # the fast ones; scatter_add_ then wants int64). At distance exactly 4 the
            # whole weight goes to the last centre, as the upper weight of the one before.
            lower = position[rows].floor().clamp_(max=num_bins - 1)
            upper_weight = position[rows].sub_(lower)
            # The slot, in place of `lower`: each temporary here is an N x M matrix at once
            # on an accelerator (one chunk).
            slot = lower.mul_(INTERLEAVE).add_(pair_copy)
            slot.add_(positive[rows].view(torch.uint8), alpha=num_centres * INTERLEAVE)
            index = slot.to(torch.int64)
            del lower, slot
            excluded_rows = None if excluded is None else excluded[rows]
            _leave_out(upper_weight, excluded_rows, exclude_self, rows.start)
            hist[rows, INTERLEAVE:].scatter_add_(1, index, upper_weight)
            lower_weight = upper_weight.neg_().add_(1)
            _leave_out(lower_weight, excluded_rows, exclude_self, rows.start)
            hist[rows].scatter_add_(1, index, lower_weight)
            flat_slots[rows].copy_(index.add_(row_start[rows]))
        del position
        hist = hist.view(n, 2, num_centres, INTERLEAVE).sum(-1)
        pos_hist = hist[:, 1]
        all_hist = hist[:, 0] + pos_hist

        pos_cum = pos_hist.cumsum(1)
        inv_cum = all_hist.cumsum(1)
        inv_cum = torch.where(inv_cum > 0, inv_cum.reciprocal(), 0.0)  # empty prefix: term is 0
        scale = 1.0 / num_positives.clamp(min=1).to(queries.dtype)
        ap = (pos_hist * pos_cum * inv_cum).sum(1) * scale

        ctx.save_for_backward(queries, references, flat_slots, excluded, pos_hist, pos_cum, inv_cum, all_hist, scale)
        ctx.exclude_self = exclude_self
        ctx.delta = delta
        ctx.same = references is queries
        return ap

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_ap):
        queries, references, flat_slots, excluded, pos_hist, pos_cum, inv_cum, all_hist, scale = ctx.saved_tensors
        # dAP/dh⁺_l and dAP/dh⁻_l (paper's analytic gradient, N⁺ held constant):
        #   dAP/dh⁺_l =  (H⁺_l / H_l + Σ_{k≥l} h⁺_k H⁻_k / H_k²) / N⁺
        #   dAP/dh⁻_l = -(Σ_{k≥l} h⁺_k H⁺_k / H_k²) / N⁺
        inv_sq = inv_cum * inv_cum
        d_pos = pos_cum * inv_cum + _tail_sum(pos_hist * (all_hist.cumsum(1) - pos_cum) * inv_sq)
        d_neg = -_tail_sum(pos_hist * pos_cum * inv_sq)
        # A pair in bin l moves weight from centre l to l + 1 as its distance grows:
        # dAP/dd = (dAP/dh_{l+1} - dAP/dh_l) / Δ. Also fold in d(distance)/d(cos) = -2.
        weight = (grad_ap * scale * (-2.0 / ctx.delta)).view(-1, 1, 1)
        table = torch.stack([d_neg, d_pos], dim=1) * weight  # (N, 2, C), as the histograms
        table = torch.nn.functional.pad(table.diff(dim=2), (0, 1))
        table = table.unsqueeze(-1).expand(-1, -1, -1, INTERLEAVE).reshape(-1)
        # d loss / d cos(query, reference); index_select takes int32 indices as they are.
        grad_cos = table.index_select(0, flat_slots.view(-1)).view(flat_slots.shape)
        _leave_out(grad_cos, excluded, ctx.exclude_self)

        grad_queries = grad_references = None
        if ctx.same:
            grad_queries = symmetrize_(grad_cos) @ queries
        else:
            if ctx.needs_input_grad[0]:
                grad_queries = grad_cos @ references
            if ctx.needs_input_grad[1]:
                grad_references = grad_cos.T @ queries
        return grad_queries, grad_references, None, None, None, None, None
