"""FastAP: Cakir et al., "Deep Metric Learning to Rank" (CVPR 2019).

The same function as the authors' code and PML's `FastAPLoss` (which builds a
(num_bins+1) x N x N pulse tensor and differentiates it with autograd). Here each
distance falls into at most two adjacent triangular bins, so its bin index and weight
are computed once, the histograms are accumulated with `scatter_add_`, and the backward
pass applies the paper's analytic gradient through a custom autograd function. Memory
stays a few N x M matrices whatever `num_bins` is. On a GPU, with labels, one Triton kernel
bins every pair of a query into its histograms and takes its AP from them (`_histograms_kernel`)
and one gives each pair its gradient (`_gradient_kernel`), reading the labels instead of N x M
masks; the scattered histograms stay the reference, and the path wherever those cannot run.
"""

import torch
from pytorch_metric_learning.distances import LpDistance
from pytorch_metric_learning.reducers import MeanReducer
from pytorch_metric_learning.utils import common_functions as c_f
from torch.autograd.function import once_differentiable

from .. import _device_policy, _triton
from .._triton import triton
from .base import (
    RankLossBase,
    normalized_with_distance_stats,
    pair_masks,
    plain_reducer,
    reference_is_batch,
    symmetrize_,
)
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

    finite_for_bounded_scores = True  # see RankLossBase

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
        # Half precision arrives here as float32 (RankLossBase): in float16 / bfloat16,
        # bin counts beyond 2048 / 256 would be inexact.
        queries, references = normalized_with_distance_stats(self.distance, embeddings, ref_emb)
        exclude_self = indices_tuple is None and reference_is_batch(labels, ref_labels)
        half = None
        if indices_tuple is None and fused_applies(queries, self.num_bins):
            # The kernels compare the labels themselves: no N x M masks. Under float16
            # autocast they read its product of the embeddings as it is; not bfloat16's, whose
            # rounding would move a pair on the bin axis by up to a hundredth of a bin (10 bins).
            pairs = (labels, ref_labels)
            half = torch.float16 if self.autocast_dtype == torch.float16 else None
        elif indices_tuple is None:
            # The diagonal's pairs, when the batch is its own reference set, are left out.
            pairs = (labels.unsqueeze(1) == ref_labels.unsqueeze(0), None)
        else:
            positive, negative = pair_masks(labels, ref_labels, indices_tuple)
            pairs = (positive, ~(positive | negative))
        losses, num_positives = FastAPFunction.apply(queries, references, *pairs, exclude_self, self.num_bins, half)
        # The one number read back from the device: with it, a batch in which every query
        # has a positive (the usual one) needs no selection of the queries (a nonzero and a
        # boolean index, each a wait for the device, and a scatter in the backward pass).
        self.num_queries = int(torch.count_nonzero(num_positives))
        if self.num_queries == 0:
            return self.zero_losses()
        if self.num_queries == len(losses) and plain_reducer(self.reducer, MeanReducer):
            # What that reducer would return, without the queries' indices it does not read (an arange).
            return {"loss": {"losses": torch.mean(losses), "indices": None, "reduction_type": "already_reduced"}}
        indices = true_rows(num_positives, self.num_queries)
        losses = losses if self.num_queries == len(losses) else losses[indices]
        return {"loss": {"losses": losses, "indices": indices, "reduction_type": "element"}}

    def get_default_distance(self):
        return LpDistance(power=2)


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


def _scattered_histograms(position, positive, excluded, exclude_self, num_bins):
    """``(hist [N, 2, C], flat slots)``: per query, the soft histograms of its negative and its
    positive pairs over the C = num_bins + 1 centres from the clamped `position` matrix, and
    each pair's slot in them (int32, in `position`'s storage where it is float32) for the
    backward pass."""
    n, m = position.shape
    num_centres = num_bins + 1
    # Per query, the soft histograms of its negative pairs (centres 0 ... C - 1) and of
    # its positive pairs (C ... 2C - 1) side by side, then two centres where the pairs
    # that are neither add (their gradient is 0). Triangular kernels: a pair adds 1 - w
    # to its lower centre and w to the next. Scattered along the rows (threads share
    # them), a chunk of rows at a time, into INTERLEAVE copies of each centre, pair j
    # adding to copy j % INTERLEAVE: consecutive pairs in one centre (most of a row
    # is) then add to different addresses and do not wait on each other.
    hist = position.new_zeros(n, (2 * num_centres + 2) * INTERLEAVE)
    nowhere = 2 * num_centres * INTERLEAVE
    pair_copy = torch.arange(m, dtype=position.dtype, device=position.device).remainder_(INTERLEAVE)
    # Each pair's slot in the flattened (N, slots) histogram, for the backward pass, as
    # int32: in float32, in place of the positions a chunk has used up (a fresh N x M
    # buffer, let alone an int64 one, costs more in page faults than the pass that fills it).
    if position.dtype == torch.float32:
        flat_slots = position.view(torch.int32)
    else:
        flat_slots = torch.empty(position.shape, dtype=torch.int32, device=position.device)
    row_start = torch.arange(0, hist.numel(), hist.shape[1], device=position.device)[:, None]
    for rows in _row_chunks(n, m, position.device):
        # Slots are small integers, computed exactly in floating point (float ops are
        # the fast ones, and an int64 copy of the mask would take more memory). At
        # distance exactly 4 the whole weight goes to the last centre, as the upper
        # weight of the one before.
        lower = position[rows].floor().clamp_(max=num_bins - 1)
        upper_weight = position[rows].sub_(lower)
        slot = lower.mul_(INTERLEAVE).add_(pair_copy)
        slot.add_(positive[rows].view(torch.uint8), alpha=num_centres * INTERLEAVE)
        if exclude_self:
            slot.diagonal(rows.start).fill_(nowhere)
        if excluded is not None:
            slot.masked_fill_(excluded[rows], nowhere)
        index = slot.to(torch.int64)  # scatter_add_ wants int64
        del lower, slot
        hist[rows, INTERLEAVE:].scatter_add_(1, index, upper_weight)
        hist[rows].scatter_add_(1, index, torch.rsub(upper_weight, 1))
        flat_slots[rows].copy_(index.add_(row_start[rows]))
    hist = hist.view(n, -1, INTERLEAVE).sum(-1)[:, : 2 * num_centres].view(n, 2, num_centres)
    return hist, flat_slots


def average_precision_sums(hist):
    """From the [N, 2, C] histograms of the negatives and the positives: each query's 1 − FastAP,
    its number of positives, and what the gradient takes: h⁺ H⁻ and h⁺ H⁺ [N, 2, C], H⁻ and H⁺
    [N, 2, C], 1 / H [N, C] (0 for an empty prefix) and 1 / max(N⁺, 1) [N]. On a GPU
    `_histograms_kernel` computes them where it counts the histograms."""
    # H⁻ and H⁺: the cumulative histograms of the negatives and positives.
    cumulative = hist.cumsum(2)
    inv_cum = (cumulative[:, 0] + cumulative[:, 1]).reciprocal().nan_to_num_(posinf=0.0)  # empty prefix: 0
    # Each pair adds 1 in all, so the positives' total is their number (to rounding).
    num_positives = cumulative[:, 1, -1]
    scale = num_positives.clamp(min=1).reciprocal_()
    # h⁺ H⁻ and h⁺ H⁺.
    pos_products = hist[:, 1].unsqueeze(1) * cumulative
    losses = torch.rsub((pos_products[:, 1] * inv_cum).sum(1) * scale, 1)
    return losses, num_positives, pos_products, cumulative, inv_cum, scale


class FastAPFunction(torch.autograd.Function):
    """1 - FastAP of every query (1 for a query without positives) and its number of
    positives, with the paper's analytic gradient. `queries` (N x D) and `references`
    (M x D) are L2-normalised float32; `positive` (N x M, bool) marks positive pairs,
    `excluded` (N x M, bool or None) and `exclude_self` (the diagonal) the pairs that are
    neither positive nor negative; or, for the fused kernels (`fused_applies`), `positive`
    and `excluded` are the labels [N] and the reference labels [M], and the kernels read the
    similarities, in `half` precision where given: the matrix products (forward and backward)
    then run on the tensor cores in it, as autocast runs every other loss's, while the bins'
    weights, counts and sums stay float32 (in float16 counts beyond 2048 would be inexact)."""

    @staticmethod
    def forward(ctx, queries, references, positive, excluded, exclude_self, num_bins, half=None):
        delta = MAX_DISTANCE / num_bins
        # Position of each distance 2 - 2 cos on the bin axis, in units of delta. Rounding
        # can push a distance just outside [0, 4]; clamping keeps its whole unit of mass.
        per_unit = 2.0 / delta
        ctx.delta, ctx.half = delta, half
        ctx.same = references is queries
        if positive.dim() == 1:  # labels: the kernels bin every pair from its similarity
            dtype = half or queries.dtype
            rows = queries.to(dtype)
            similarity = rows @ (rows if ctx.same else references.to(dtype)).T
            sums = _fused_histograms(similarity, per_unit, positive, excluded, exclude_self, num_bins)
            flat_slots = None
        else:
            # new_full, not new_tensor: filled on the device, where a copy from the host waits.
            position = torch.addmm(queries.new_full((), per_unit), queries, references.T, alpha=-per_unit)
            position.clamp_(0, num_bins)
            hist, flat_slots = _scattered_histograms(position, positive, excluded, exclude_self, num_bins)
            sums = average_precision_sums(hist)
        losses, num_positives, pos_products, cumulative, inv_cum, scale = sums

        if flat_slots is None:
            ctx.save_for_backward(queries, references, similarity, pos_products, cumulative, inv_cum, scale)
            ctx.labels = positive, excluded, exclude_self, num_bins, per_unit
        else:
            ctx.save_for_backward(queries, references, flat_slots, pos_products, cumulative, inv_cum, scale)
            ctx.labels = None
        ctx.mark_non_differentiable(num_positives)
        ctx.set_materialize_grads(False)
        return losses, num_positives

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_losses, _):
        queries, references, slots_or_similarity, pos_products, cumulative, inv_cum, scale = ctx.saved_tensors
        # dAP/dh⁺_l and dAP/dh⁻_l (paper's analytic gradient, N⁺ held constant):
        #   dAP/dh⁺_l =  (H⁺_l / H_l + Σ_{k≥l} h⁺_k H⁻_k / H_k²) / N⁺
        #   dAP/dh⁻_l = -(Σ_{k≥l} h⁺_k H⁺_k / H_k²) / N⁺
        # A pair in bin l moves weight from centre l to l + 1 as its distance grows, so
        # its gradient is the difference of these at l + 1 and l, in which the sums cancel
        # but for their term k = l: H⁺_{l+1} / H_{l+1} - H⁺_l / H_l - h⁺_l H⁻_l / H_l² for
        # a positive, h⁺_l H⁺_l / H_l² for a negative (times 1 / N⁺).
        n, num_centres = inv_cum.shape
        # d loss / d cos(query, reference), up to the factor dd/dcos · d(position)/dd =
        # -2 / delta (times -1 from d loss / dAP) that the products below apply.
        unit = None
        if ctx.labels is not None:  # the table's entries and the scaling by d loss / dAP = -1 and 1 / N⁺ in the kernel
            row_scales = None
            if ctx.half:
                # In half precision relative to the largest row scale (1 / (batch N⁺) after a
                # mean: float16's subnormals), which the products' results are scaled back by.
                row_scales = grad_losses * scale
                unit = row_scales.abs().amax().clamp_(min=torch.finfo(torch.float32).tiny)
                row_scales = row_scales / unit
            sums = (pos_products, cumulative, inv_cum)
            grad_cos = _fused_gradient(slots_or_similarity, sums, grad_losses, scale, row_scales, *ctx.labels)
        else:
            terms = pos_products * (inv_cum * inv_cum).unsqueeze(1)  # h⁺ H⁻ / H², h⁺ H⁺ / H²
            table = inv_cum.new_zeros(n, 2 * num_centres + 2)  # as the histograms; the last bins stay 0
            table[:, :num_centres] = terms[:, 1]
            ratio = cumulative[:, 1] * inv_cum
            torch.sub(ratio.diff(dim=1), terms[:, 0, :-1], out=table[:, num_centres : 2 * num_centres - 1])
            # Scaled by d loss / dAP = -1 and 1 / N⁺, in each of the INTERLEAVE copies.
            weight = (grad_losses * scale).view(-1, 1, 1).expand(-1, 1, INTERLEAVE)
            table = (table.unsqueeze(-1) * weight).view(n, -1)
            # index_select takes int32 indices as they are.
            flat_slots = slots_or_similarity
            grad_cos = table.view(-1).index_select(0, flat_slots.view(-1)).view(flat_slots.shape)
        factor = 2.0 / ctx.delta

        def product(a, b, out):
            """factor · a @ b, as float32 [len(out), D]: in half precision, scaled back by `unit`."""
            if unit is None:  # `out` only gives addmm the shape of its result (beta=0)
                return torch.addmm(out, a, b, beta=0, alpha=factor)
            return torch.mm(a, b.to(a.dtype)).float().mul_(unit * factor)

        grad_queries = grad_references = None
        if ctx.same:
            grad_queries = product(symmetrize_(grad_cos), queries, queries)
        else:
            if ctx.needs_input_grad[0]:
                grad_queries = product(grad_cos, references, queries)
            if ctx.needs_input_grad[1]:
                grad_references = product(grad_cos.T, queries, references)
        return grad_queries, grad_references, None, None, None, None, None


# Pairs per step of `_histograms_kernel` times a histogram's centres (padded to a power of
# 2): the [pairs, centres] tile of each pair's weights at every centre.
FUSED_TILE = 4096
# The most bin centres the fused kernels hold per histogram (a power of 2).
FUSED_MOST_CENTRES = 256
# Pairs per program of `_gradient_kernel`.
GRADIENT_BLOCK = 1024


def fused_applies(queries, num_bins):
    """Whether `_histograms_kernel` and `_gradient_kernel` bin the pairs of these queries by
    label: where Triton kernels run (`_triton.runs_on`), for up to `FUSED_MOST_CENTRES`
    centres."""
    return _triton.runs_on(queries) and num_bins + 1 <= FUSED_MOST_CENTRES


def _fused_histograms(similarity, per_unit, labels, ref_labels, exclude_self, num_bins):
    """`average_precision_sums` of `_scattered_histograms`' histograms (float32) from the
    `similarity` matrix (float32 or float16: each pair's position per_unit · (1 − similarity) on
    the bin axis is computed in float32 as it is loaded) and the labels, in `_histograms_kernel`,
    which keeps each query's histograms in registers: no [N, 2, C] tensor and none of the dozen
    operations on them that a GPU's host would queue one by one."""
    n, m = similarity.shape
    centres = triton.next_power_of_2(num_bins + 1)
    # Per query h⁺ H⁻, h⁺ H⁺, H⁻, H⁺ and 1 / H, side by side: the gradient kernel reads them by row.
    per_centre = similarity.new_empty(n, 5, num_bins + 1, dtype=torch.float32)
    per_query = similarity.new_empty(3, n, dtype=torch.float32)  # 1 − FastAP, N⁺, 1 / max(N⁺, 1)
    if n:
        with _triton.on_device(similarity.device):
            _histograms_kernel[(n,)](
                similarity, similarity.stride(0), float(per_unit), labels.contiguous(), ref_labels.contiguous(),
                per_centre, per_query, m, num_bins, SKIP_OWN=exclude_self, CENTRES=centres,
                BLOCK=max(16, FUSED_TILE // centres),
            )  # fmt: skip
    losses, num_positives, scale = per_query
    return losses, num_positives, per_centre[:, :2], per_centre[:, 2:4], per_centre[:, 4], scale


def _fused_gradient(
    similarity, sums, grad_losses, scale, row_scales, labels, ref_labels, exclude_self, num_bins, per_unit
):
    """d loss / d position for every pair, in `similarity`'s precision, in `_gradient_kernel`:
    FastAPFunction.backward's table entry of its bin (from its query's ``sums``: h⁺ H⁻ and
    h⁺ H⁺ [N, 2, C], H⁻ and H⁺ [N, 2, C], 1 / H [N, C], as the forward pass left them) times its
    query's `grad_losses` · `scale`, or its given `row_scales`; 0 for the diagonal with
    `exclude_self`. The table is not built: its few operations on [N, C] tensors cost a GPU
    more than the kernel's extra loads of the sums, which stay in its cache."""
    n, m = similarity.shape
    grad = torch.empty_like(similarity)
    pos_products, cumulative, inv_cum = sums  # rows of one [N, 5, C] tensor (`_fused_histograms`)
    scaled = row_scales is not None
    row_scales = row_scales.contiguous() if scaled else scale.contiguous()
    if grad.numel():
        with _triton.on_device(similarity.device):
            _gradient_kernel[(n, triton.cdiv(m, GRADIENT_BLOCK))](
                similarity, similarity.stride(0), float(per_unit), labels.contiguous(), ref_labels.contiguous(),
                pos_products, cumulative, inv_cum, inv_cum.stride(0), grad_losses, grad_losses.stride(0), row_scales,
                grad, m, num_bins, SCALED=scaled, SKIP_OWN=exclude_self, BLOCK=GRADIENT_BLOCK,
            )  # fmt: skip
    return grad


if triton is not None:
    import triton.language as tl

    @triton.jit
    def _bin(position, num_bins):
        """The clamped position's lower centre (a float, exact) and its weight at the next."""
        x = tl.minimum(tl.maximum(position, 0.0), num_bins * 1.0)
        lower = tl.minimum(tl.floor(x), num_bins - 1.0)
        return lower, x - lower

    @triton.jit
    def _histograms_kernel(
        similarity,
        stride,
        per_unit,
        labels,
        ref_labels,
        per_centre,
        per_query,
        columns,
        num_bins,
        SKIP_OWN: tl.constexpr,
        CENTRES: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0)
        label = tl.load(labels + row)
        centre = tl.arange(0, CENTRES).to(tl.float32)
        negatives = tl.zeros([CENTRES], dtype=tl.float32)
        positives = tl.zeros([CENTRES], dtype=tl.float32)
        for first in range(0, columns, BLOCK):
            j = first + tl.arange(0, BLOCK)
            inside = j < columns
            if SKIP_OWN:
                inside = inside & (j != row)
            s = tl.load(similarity + row.to(tl.int64) * stride + j, mask=inside, other=0.0)
            lower, upper_weight = _bin(per_unit - per_unit * s.to(tl.float32), num_bins)
            same = tl.load(ref_labels + j, mask=inside, other=0) == label
            # Each pair's weights at every centre: 1 - w at its lower one, w at the next.
            at = tl.where(lower[:, None] == centre[None, :], 1.0 - upper_weight[:, None], 0.0)
            at += tl.where(lower[:, None] + 1.0 == centre[None, :], upper_weight[:, None], 0.0)
            positives += tl.sum(tl.where((inside & same)[:, None], at, 0.0), axis=0)
            negatives += tl.sum(tl.where((inside & ~same)[:, None], at, 0.0), axis=0)
        # average_precision_sums of the two histograms (centres past num_bins hold 0).
        c = tl.arange(0, CENTRES)
        held = c <= num_bins
        cumulative_negatives = tl.cumsum(negatives, axis=0)
        cumulative_positives = tl.cumsum(positives, axis=0)
        total = cumulative_negatives + cumulative_positives
        inverse = tl.where(total == 0.0, 0.0, 1.0 / tl.where(total == 0.0, 1.0, total))
        count = tl.sum(tl.where(c == num_bins, cumulative_positives, 0.0), axis=0)
        scale = 1.0 / tl.maximum(count, 1.0)
        products = positives * cumulative_positives
        loss = 1.0 - tl.sum(products * inverse, axis=0) * scale
        centres = num_bins + 1
        queries = tl.num_programs(0)
        out = per_centre + row.to(tl.int64) * 5 * centres + c
        tl.store(out, positives * cumulative_negatives, mask=held)
        tl.store(out + centres, products, mask=held)
        tl.store(out + 2 * centres, cumulative_negatives, mask=held)
        tl.store(out + 3 * centres, cumulative_positives, mask=held)
        tl.store(out + 4 * centres, inverse, mask=held)
        tl.store(per_query + row, loss)
        tl.store(per_query + queries + row, count)
        tl.store(per_query + 2 * queries + row, scale)

    @triton.jit
    def _gradient_kernel(
        similarity,
        stride,
        per_unit,
        labels,
        ref_labels,
        pos_products,
        cumulative,
        inv_cum,
        sums_stride,
        grad_losses,
        grad_stride,
        row_scales,
        grad,
        columns,
        num_bins,
        SCALED: tl.constexpr,
        SKIP_OWN: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0)
        j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = j < columns
        at = row.to(tl.int64) * stride + j
        s = tl.load(similarity + at, mask=inside, other=0.0)
        lower, _ = _bin(per_unit - per_unit * s.to(tl.float32), num_bins)
        same = tl.load(ref_labels + j, mask=inside, other=0) == tl.load(labels + row)
        # The table of FastAPFunction.backward at the pair's bin l, in its operations' order: a
        # negative's h⁺_l H⁺_l / H_l², a positive's H⁺_{l+1} / H_{l+1} − H⁺_l / H_l − h⁺_l H⁻_l / H_l².
        centres = num_bins + 1
        l = lower.to(tl.int32)
        sums = row.to(tl.int64) * sums_stride + l
        inv = tl.load(inv_cum + sums, mask=inside, other=0.0)
        inv_next = tl.load(inv_cum + sums + 1, mask=inside, other=0.0)
        inv_squared = inv * inv
        negative = tl.load(pos_products + sums + centres, mask=inside & ~same, other=0.0) * inv_squared
        ratio_next = tl.load(cumulative + sums + centres + 1, mask=inside & same, other=0.0) * inv_next
        ratio = tl.load(cumulative + sums + centres, mask=inside & same, other=0.0) * inv
        positive = (ratio_next - ratio) - tl.load(pos_products + sums, mask=inside & same, other=0.0) * inv_squared
        value = tl.where(same, positive, negative)
        if SCALED:
            value = value * tl.load(row_scales + row)
        else:
            value = value * (tl.load(grad_losses + row * grad_stride) * tl.load(row_scales + row))
        if SKIP_OWN:
            value = tl.where(j == row, 0.0, value)
        tl.store(grad + at, value, mask=inside)
