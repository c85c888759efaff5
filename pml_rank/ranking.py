"""Blackbox-differentiable ranking (RaMBO: Rolínek et al., *Optimizing Rank-Based Metrics
with Blackbox Differentiation*, CVPR 2020, Algorithm 1) and the AP losses built on it.

This is the one place in pml-rank that ranks. Conventions:

- Ranks run along the last dimension, 1 = highest score, and `blackbox_rank` returns
  them divided by the sequence length, as the authors' code does, so that the paper's
  λ values carry over.
- Ties are ranked by position: of two equal scores the one with the lower index ranks
  higher (a stable sort). In the backward pass, ties among perturbed scores keep their
  forward order. Everything is deterministic.
- Cost: one sort plus a scatter (the inverse permutation) per ranking, in the forward
  pass and again in the backward pass, where the perturbed scores are sorted in forward
  order (nearly sorted already, faster). On the CPU the sort runs on order-preserving
  integer keys (faster; a radix sort for one sequence). The rank among the positives is
  a cumulative count in sorted order (`ranks_among_positives`), never a second sort.
- The losses need ranks at the positives only (`blackbox_ranks_of_positives`). When every
  sequence has few positives (at most log2(n), as in in-batch retrieval), Algorithm 1
  moves only them, and their ranks and the perturbed ranking are counted by comparing
  each positive with its sequence, O(positives · n), instead of sorting every row,
  O(n log n): the same ranks and gradients, ties included.

**Scale of the incoming gradient.** Algorithm 1 is not homogeneous: the gradient of
k·L with λ is k times the gradient of L with k·λ. Anything that multiplies the loss
(PML's `DistributedLossWrapper` multiplies it by the world size, trainers' loss weights,
mixed-precision gradient scalers) would silently change λ. The losses here therefore
record, in the backward pass, the factor k = ∂(objective)/∂(loss) that reached them
(`LossScale`) and perturb with λ·g/k, returning k times Algorithm 1's gradient of the
loss itself: λ means what it means for the bare loss, whatever multiplies it, and a
loss weight scales the gradient and nothing else. With k = 1 (a bare ``loss.backward()``)
this is exactly Algorithm 1. `blackbox_rank` without a `loss_scale` is plain Algorithm 1.
"""

import math
from functools import cached_property
from typing import NamedTuple

import torch

from . import _device_policy, fused_counts
from ._checks import check_embeddings, check_numbers

__all__ = [
    "LossScale",
    "apc_loss",
    "average_precision_loss",
    "blackbox_rank",
    "blackbox_ranks_of_positives",
    "descending_order",
    "map_loss",
    "ranks_among_positives",
]


def descending_order(scores):
    """The permutation sorting the last dimension in descending order; ties keep their
    positions' order (a stable sort)."""
    if scores.device.type == "cpu" and scores.dtype in _SAME_WIDTH_INT and scores.numel() >= _KEYS_FROM:
        # PyTorch sorts integers faster than floats on the CPU (one sequence: with a
        # radix sort, several times faster), so sort order-preserving integer keys.
        keys = _descending_keys(scores)
        if scores.shape[:-1].numel() == 1:
            return torch.sort(keys.reshape(-1), stable=True).indices.view(scores.shape)
        return torch.sort(keys, dim=-1, stable=True).indices
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices


_SAME_WIDTH_INT = {torch.float32: torch.int32, torch.float64: torch.int64}
# Below about this many scores the keys' five operations (some 30 us on a CPU core) cost more
# than the integer sort saves (1 thread, a 2-core Xeon, keys against the float sort: one
# sequence of 64, 37 against 6 us; of 4096, 202 against 188; of 8192, 418 against 460; 16 rows
# of 1023, 615 against 663).
_KEYS_FROM = 1 << 13


def _descending_keys(scores):
    """Integers whose ascending order is the descending order of `scores` (not NaN): the
    bits of −scores, with the magnitude bits of the negative ones flipped (IEEE floats
    order like sign-magnitude integers; the flip gives two's-complement order).
    0.0 − x also turns −0.0 into 0.0, which it equals."""
    bits = (0.0 - scores).view(_SAME_WIDTH_INT[scores.dtype])
    magnitude = torch.iinfo(bits.dtype).max
    return bits ^ ((bits >> (bits.element_size() * 8 - 1)) & magnitude)


def ranks_among_positives(positives, order, total=None):
    """Every positive element, as an index tuple (like ``positives.nonzero(as_tuple=True)``,
    listed in ranking order), and its rank among the positives of its sequence
    (1 = highest): a cumulative count in sorted order, no second sort. `total`: the
    number of positives, when known (then no wait for the device to count them)."""
    in_order = positives.gather(-1, order)
    counts = in_order.cumsum(-1, dtype=torch.int32)
    where = true_indices(in_order, total)
    return where[:-1] + (order[where],), counts[where].long()


def true_indices(mask, total=None, contiguous=True):
    """``mask.nonzero(as_tuple=True)``; with `total`, the number of True entries known on
    the host, without the device-to-host wait that finding the output's size takes, and
    unless `contiguous`, as strided columns of one tensor (no copy)."""
    if total is None:
        return mask.nonzero(as_tuple=True)
    if not total:  # (nonzero_static of an empty mask failed on CUDA before torch 2.9)
        return tuple(torch.zeros(0, dtype=torch.long, device=mask.device) for _ in range(mask.ndim))
    found = mask.nonzero_static(size=total)
    if not contiguous:
        return found.unbind(1)
    # Transposed to [dims, total] first: each index tensor contiguous, as nonzero's are.
    return found.T.contiguous().unbind(0)


class PositiveCounts(NamedTuple):
    """`positive_counts`: each sequence's number of positives (int32 tensor); the most in
    one sequence, their total and the number of sequences with one (Python ints)."""

    per_sequence: torch.Tensor
    most: int
    total: int
    sequences_with_one: int


def positive_counts(positives):
    """`PositiveCounts` of a boolean [sequences, n] mask, its numbers read back in one
    transfer (on a GPU, the one wait of a ranking's forward pass beside the input check:
    which way to rank and every output's size follow from them). Where Triton runs, one
    kernel counts them (`fused_counts.counts`)."""
    if len(positives) and fused_counts.applies(positives, (torch.bool,)):
        per_sequence, numbers = fused_counts.counts(positives)
        return PositiveCounts(per_sequence, *numbers.tolist())
    per_sequence = positives.view(torch.uint8).sum(-1, dtype=torch.int32)  # a bool sum converts first: 3 times slower
    if not len(per_sequence):
        return PositiveCounts(per_sequence, 0, 0, 0)
    numbers = [per_sequence.max(), per_sequence.sum(), per_sequence.count_nonzero()]
    return PositiveCounts(per_sequence, *torch.stack(numbers).tolist())


class LossScale:
    """Records k = ∂(training objective)/∂(loss) during the backward pass, so that a
    ranker upstream of the loss can undo it (see the module docstring).

    ``loss = scale.attach(loss)`` is the identity in the forward pass; in the backward
    pass it stores the incoming gradient. Autograd runs it before any node the loss
    depends on, so the rankers read the value before they need it.

    The rankers also record whether Algorithm 1's perturbation moved any rank
    (`ranks_moved`; `blackbox_ranks_of_positives`: any positive's; when every positive is
    pushed the same way, as by RaMBO's losses, no positive moving means no rank moved).
    k and that flag stay on the device until `ranks_moved` is read: a backward pass that
    nobody asks never waits for them.
    """

    def __init__(self):
        self.value = None
        self._moved = None

    def attach(self, loss):
        return _RecordScale.apply(loss, self)

    def factor(self, like):
        """k as a 0-d tensor on `like`'s device (1 before a backward pass set it)."""
        if self.value is None:
            return torch.ones((), dtype=torch.float64, device=like.device)
        return self.value.to(like.device)

    def record_moved(self, moved):
        """The rankers' flag (a bool tensor): whether any rank moved."""
        self._moved = moved

    @property
    def ranks_moved(self):
        """Whether the perturbation moved any rank: False means an exactly zero gradient;
        None, not computed (no backward pass yet, or k = 0). Reading it waits for the
        device."""
        if self._moved is None:
            return None
        if self.value is None:
            return bool(self._moved)
        # k and the flag in one transfer (the flag promoted to k's dtype); k = 0 compared on the host.
        k, moved = torch.stack([self.value, self._moved]).tolist()
        return None if k == 0 else bool(moved)


class _RecordScale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, loss, scale):
        ctx.scale = scale
        return loss.clone()  # not a view: PML trainers scale the loss in place

    @staticmethod
    def backward(ctx, grad_output):
        if grad_output.numel() != 1:
            raise ValueError(f"LossScale: the loss must be a scalar, got shape {tuple(grad_output.shape)}")
        ctx.scale.value = grad_output.detach().reshape(())
        return grad_output, None


class _BlackboxRank(torch.autograd.Function):
    @staticmethod
    def forward(ctx, scores, lambda_val, loss_scale):
        order = descending_order(scores)
        values = scores.gather(-1, order)
        n = scores.shape[-1]
        # The inverse permutation: the element at sorted position j gets rank (j + 1) / n.
        positions = torch.arange(1, n + 1, dtype=scores.dtype, device=scores.device).div_(n).expand_as(order)
        ranks = torch.empty_like(scores).scatter_(-1, order, positions)
        ctx.lambda_val, ctx.loss_scale = lambda_val, loss_scale
        ctx.save_for_backward(values, order)
        ctx.mark_non_differentiable(order)
        ctx.set_materialize_grads(False)  # the order takes no gradient: no zeros for it
        return ranks, order

    @staticmethod
    def backward(ctx, grad_ranks, _grad_order):
        values, order = ctx.saved_tensors
        # Algorithm 1 on the loss itself: perturb by λ·g/k, return k·(−(rk − rk_λ)/λ).
        # Everything happens in forward (sorted) order, where rk is the position + 1.
        n = values.shape[-1]
        step_factor, change_factor = _algorithm_1_factors(ctx.loss_scale, ctx.lambda_val, n, values)
        step = grad_ranks.gather(-1, order).mul_(step_factor)
        change = _rank_change(values, step)
        if ctx.loss_scale is not None:
            ctx.loss_scale.record_moved(change.any())
        change = change.to(values.dtype).mul_(change_factor)
        return torch.empty_like(change).scatter_(-1, order, change), None, None


def _algorithm_1_factors(loss_scale, lambda_val, n, like):
    """λ / k, the perturbation's factor, and k / (λ n), the rank change's: Python numbers
    without a `loss_scale` (k = 1), else 0-d tensors on `like`'s device, so that the
    backward pass never waits to read k. With k = 0 the incoming gradient is 0 and its
    perturbation 0 · inf (NaN): the ranks it gives are finite counts, times k = 0."""
    if loss_scale is None:
        return lambda_val, 1 / (lambda_val * n)
    k = loss_scale.factor(like)
    # λ and λ n as float64 CPU scalars: each factor is one float64 division on k's device, rounded
    # as the same numbers in Python would be, without reading k back.
    lambda_, lambda_n = (torch.tensor(number, dtype=torch.float64) for number in (lambda_val, lambda_val * n))
    return torch.div(lambda_, k), torch.div(k, lambda_n)


def _rank_change(values, step):
    """rk(y + step) − rk(y) in sorted order, for `values` sorted descending: a stable sort
    of the perturbed values, which are nearly sorted (and sort faster). The element at
    position i moves to the position q where `moved[q] = i`; ties keep forward order."""
    moved = descending_order(values + step)
    positions = torch.arange(values.shape[-1], device=values.device).expand_as(moved)
    return torch.empty_like(moved).scatter_(-1, moved, positions - moved)


def blackbox_rank(scores, lambda_val, loss_scale=None, return_order=False):
    """Ranks of `scores` along the last dimension (1 = highest) divided by the sequence
    length, differentiable by RaMBO's Algorithm 1 with interpolation strength
    `lambda_val`. With `loss_scale` (a `LossScale` attached to the final loss), λ is
    independent of what multiplies that loss. With `return_order`, also returns the
    descending order (not differentiable), for `ranks_among_positives`."""
    check_numbers("blackbox_rank", "> 0", lambda_val=lambda_val)
    if not torch.is_tensor(scores) or not torch.is_floating_point(scores) or scores.ndim == 0:
        raise TypeError("blackbox_rank: scores must be a floating-point tensor with at least one dimension")
    ranks, order = _BlackboxRank.apply(scores, float(lambda_val), loss_scale)
    return (ranks, order) if return_order else ranks


def blackbox_ranks_of_positives(scores, positives, lambda_val, loss_scale=None, indices=None, counts=None, margin=0.0):
    """For sequences `scores` [sequences, n] and a boolean mask `positives`: the index
    (sequence, element) of every positive, its blackbox rank divided by n (differentiable
    by Algorithm 1 with respect to all scores) and its rank among the positives (an
    integer, not differentiated). Ranks and gradients are those of `blackbox_rank`, of the
    scores shifted by `margin` (`shift_by_margin`; the kernels shift as they read).
    `indices`: ``positives.nonzero(as_tuple=True)``, and `counts`: `positive_counts(positives)`,
    when already at hand.

    A loss of these ranks sends an incoming gradient to the positives only, so
    Algorithm 1's perturbed ranking moves only them. With few positives per sequence
    (at most log2(n)) the ranks are therefore counted, O(positives · n), instead
    of sorted, O(n log n) per sequence (`_CountedRanks`); otherwise one sort ranks
    everything (`blackbox_rank`, `ranks_among_positives`)."""
    check_numbers("blackbox_ranks_of_positives", "> 0", lambda_val=lambda_val)
    sequences, n = scores.shape
    counts = positive_counts(positives) if counts is None else counts
    # Measured break-even (2048 sequences, CPU): about 12 positives at n = 2047, 22 at n = 8191.
    if sequences and counts.most <= math.log2(max(n, 2)):
        if fused_counts.applies(scores):
            indices = true_indices(positives, counts.total) if indices is None else indices
            ranks, among = _FusedCountedRanks.apply(scores, float(lambda_val), loss_scale, indices[1], counts, margin)
            return indices, ranks, among
        scores = shift_by_margin(scores, positives, margin)
        slots = _Slots(positives, counts, indices)
        ranks, among, sequence, element = _CountedRanks.apply(scores, positives, float(lambda_val), loss_scale, slots)
        return (sequence, element), ranks, among
    scores = shift_by_margin(scores, positives, margin)
    ranks, order = blackbox_rank(scores, lambda_val, loss_scale, return_order=True)
    index, among = ranks_among_positives(positives, order, counts.total)
    return index, ranks[index], among


def _above(scores, values, elements):
    """[sequences, slots, n] mask: which elements of each sequence rank above the element
    at position `elements` [sequences, slots] with value `values`: larger, or equal at a
    lower position (as the stable sort). NaN values (padding) have nothing above."""
    positions = torch.arange(scores.shape[-1], device=scores.device)
    scores, values = scores[:, None, :], values[:, :, None]
    return (scores > values) | ((scores == values) & (positions < elements[:, :, None]))


class _Slots:
    """The positives of each sequence side by side: [sequences, slots] tensors padded with
    NaN values, so that every comparison broadcasts over the sequence's n elements. A
    sequence's slots hold its positives in the order of their positions."""

    def __init__(self, positives, counts, indices=None):
        """`counts`: `positive_counts(positives)`; `indices`: ``positives.nonzero(as_tuple=True)``
        when already at hand."""
        # Contiguous (given ones may be strided): searched and indexed many times below.
        given = true_indices(positives, counts.total) if indices is None else indices
        self.sequence, self.element = (index.contiguous() for index in given)
        # Listed by sequence, then position: a positive's slot is its distance from its
        # sequence's first one, found by a binary search of the sorted sequence indices.
        first = torch.searchsorted(self.sequence, self.sequence)
        self.slot = torch.arange(len(self.sequence), device=positives.device) - first
        self.shape = (len(positives), counts.most)

    @cached_property
    def elements(self):
        """[sequences, slots]: each positive's position in its sequence (padding: 0)."""
        return self.spread(self.element, 0)

    @cached_property
    def valid(self):
        """[sequences, slots]: which slots hold a positive."""
        return self.spread(torch.ones_like(self.element, dtype=torch.bool), False)

    def spread(self, per_positive, pad):
        out = per_positive.new_full(self.shape, pad)
        out[self.sequence, self.slot] = per_positive
        return out

    def gather(self, per_slot):
        return per_slot[self.sequence, self.slot]


def _compared(scores, thresholds, budget=None):
    """For each chunk of sequences, its slice and the [sequences, thresholds, n] 0/1
    floats ``scores > thresholds`` (every threshold of a sequence against all its
    elements), in one reused buffer of `_comparison_dtype`, to be summed in
    `_count_dtype`. Comparisons written as floats and summed as floats run about three
    times faster than through bool tensors (vectorised on the CPU; a sum of booleans
    first converts them to the sum's type). A chunk has at most `budget` comparisons,
    by default the device's (`_device_policy.work_budget`): on the CPU 2^20, few steps
    (each synchronises the threads) and a buffer small enough to stay in cache (at
    batch 2048 with 3 positives a row, the counting forward+backward took 20-22 ms on
    one thread from 2^19 to 2^21, 30 ms at 2^17); on an accelerator as many as `scores`
    has entries, twice as many in float16 (the same bytes as float32 ones), so that the
    chunks do not grow with the batch."""
    dtype = _comparison_dtype(scores)
    if budget is None:
        budget = _device_policy.work_budget(scores.device, scores.numel())
        if dtype == torch.float16:
            budget *= 2
    width = thresholds.shape[1] * scores.shape[-1]
    step = max(1, budget // max(1, width))
    buffer = torch.empty(
        min(step, len(scores)),
        *thresholds.shape[1:],
        scores.shape[-1],
        dtype=dtype,
        device=scores.device,
    )
    for start in range(0, len(scores), step):
        part = slice(start, start + step)
        rows = scores[part, None, :]
        yield part, torch.gt(rows, thresholds[part, :, None], out=buffer[: len(rows)])


def _count_dtype(scores):
    """A floating-point type in which counting up to the sequence length is exact."""
    if scores.dtype == torch.float64 or scores.shape[-1] >= 2**24:  # float32 integers end at 2^24
        return torch.float64
    return torch.float32


def _comparison_dtype(scores):
    """The type the 0/1 comparisons are written in: the counts' on the CPU (where float16
    has no fast arithmetic); on an accelerator (`_device_policy.sized_for`), where writing
    and reading them back is the whole cost, float16, half the bytes, summed into the
    counts' type by the same kernel that reads them. Exact: the entries are 0 and 1 (−1
    to 1 after the backward pass's subtraction), their sums accumulate in float32 or wider."""
    return _count_dtype(scores) if _device_policy.sized_for(scores.device) == "cache" else torch.float16


def _counts(scores, values):
    """[sequences, slots] int32 counts of the elements of each sequence greater than each
    slot's value [sequences, slots], and of those at least as large (the positive itself
    included; padding slots count 0)."""
    # x > the float just below a value <=> x >= the value: both counts in one pass.
    # −inf made on the values' device: nextafter, unlike most binary operations, takes no
    # CPU scalar beside a GPU tensor.
    thresholds = torch.cat([values, torch.nextafter(values, values.new_full((), -math.inf))], dim=1)
    counts = _summed_per_threshold(scores, thresholds)
    return counts[:, : values.shape[1]], counts[:, values.shape[1] :]


def _summed_per_threshold(scores, thresholds):
    """[sequences, thresholds] int32: how many elements of each sequence exceed each of
    its thresholds. Summed chunk by chunk straight into one float tensor (exact, see
    `_count_dtype`), converted once."""
    counts = torch.empty(thresholds.shape, dtype=_count_dtype(scores), device=scores.device)
    for part, larger in _compared(scores, thresholds):
        torch.sum(larger, -1, dtype=counts.dtype, out=counts[part])
    return counts.to(torch.int32)


def _ranks_and_ties(scores, values):
    """For each slot of `values` [sequences, slots]: the count of elements at least as
    large as its value (its rank, the positive itself included, where no other element
    equals it) and the count of slots at least as large (its rank among them, where no
    two are equal), int32 and int64 (padding: 0 and 0); and [sequences] whether another
    element equals some slot's value (a tie)."""
    greater, rank = _counts(scores, values)
    among = torch.count_nonzero(values[:, None, :] >= values[:, :, None], -1)
    return rank, among, (rank - greater > 1).any(-1)


class _CountedRanks(torch.autograd.Function):
    """Ranks of the positives by counting, and Algorithm 1's perturbed ranking by
    counting crossings. In a sequence where no other element equals a positive's value,
    the elements above a positive are just the larger ones: two comparison passes in the
    forward pass, two in the backward pass, where ties with the perturbed values follow
    from the stable order (`_crossings_without_ties`). Sequences with ties before the
    perturbation (a few per batch of 2048 cosine similarities in float32) are redone with
    the tie rules of a stable sort (`_above`)."""

    @staticmethod
    def forward(ctx, scores, positives, lambda_val, loss_scale, slots=None):
        slots = _Slots(positives, positive_counts(positives)) if slots is None else slots
        at_positives = scores[slots.sequence, slots.element]
        values = slots.spread(at_positives, float("nan"))
        rank, among, tied = _ranks_and_ties(scores, values)
        # The sequences with ties, read back once (a nonzero waits as any() would) and
        # kept for the backward pass, are counted again by the stable order's rules.
        tied = tied.nonzero().squeeze(1)
        if len(tied):
            rank[tied] = _above(scores[tied], values[tied], slots.elements[tied]).sum(-1, dtype=torch.int32) + 1
            # Slots hold their sequence's positives in the order of their positions.
            in_order = torch.arange(slots.shape[1], device=scores.device).expand(len(tied), -1)
            among[tied] = _above(values[tied], values[tied], in_order).sum(-1) + 1
        ctx.lambda_val, ctx.loss_scale, ctx.slots = lambda_val, loss_scale, slots
        ctx.save_for_backward(scores, values, at_positives, rank, tied)
        ranks = slots.gather(rank).to(scores.dtype) / scores.shape[-1]
        among = slots.gather(among)
        ctx.mark_non_differentiable(among, slots.sequence, slots.element)
        ctx.set_materialize_grads(False)  # the other outputs take no gradient: no zeros for them
        return ranks, among, slots.sequence, slots.element

    @staticmethod
    def backward(ctx, grad_ranks, *_):
        scores, values, at_positives, rank, tied = ctx.saved_tensors
        slots = ctx.slots
        # Algorithm 1 as in _BlackboxRank, counting crossings instead of sorting: a
        # positive moves down by the elements that pass above it and up by those it
        # leaves behind; every other element moves by the positives that cross it.
        step_factor, change_factor = _algorithm_1_factors(ctx.loss_scale, ctx.lambda_val, scores.shape[-1], scores)
        step = grad_ranks * step_factor
        new_values = values.index_put((slots.sequence, slots.slot), at_positives + step)
        change, own = _crossings_without_ties(scores, values, new_values, rank)
        if len(tied):
            change[tied], own[tied] = _crossings(
                scores[tied], values[tied], new_values[tied], slots.elements[tied], slots.valid[tied]
            )
        change[slots.sequence, slots.element] = slots.gather(own)
        if ctx.loss_scale is not None:
            ctx.loss_scale.record_moved(own.any())
        return change.mul_(change_factor), None, None, None, None


class _FusedCountedRanks(torch.autograd.Function):
    """`_CountedRanks` in one kernel per pass (`fused_counts`), on the positives as
    `true_indices` lists them (`element`: their positions; `counts`: `positive_counts`):
    the kernels follow the stable order's rules in every sequence, so none is redone and
    no tie is read back; a few operations a pass, where the padded slots take a dozen.
    The kernels also shift the scores by `margin` (`shift_by_margin`) and apply Algorithm 1's
    factors: no pass over the scores of their own."""

    @staticmethod
    def forward(ctx, scores, lambda_val, loss_scale, element, counts, margin=0.0):
        per_sequence, most = counts.per_sequence, counts.most
        ends = per_sequence.cumsum(0)
        rank, among = fused_counts.ranks(scores, element, per_sequence, ends, most, margin / 2)
        ctx.lambda_val, ctx.loss_scale, ctx.most, ctx.half_margin = lambda_val, loss_scale, most, margin / 2
        ctx.save_for_backward(scores, element, per_sequence, ends)
        ctx.mark_non_differentiable(among)
        ctx.set_materialize_grads(False)  # the among-positives ranks take no gradient: no zeros for them
        return rank / scores.shape[-1], among

    @staticmethod
    def backward(ctx, grad_ranks, _grad_among):
        scores, element, per_sequence, ends = ctx.saved_tensors
        factors = _algorithm_1_factors(ctx.loss_scale, ctx.lambda_val, scores.shape[-1], scores)
        change, own = fused_counts.crossings(
            scores, element, per_sequence, ends, ctx.most, grad_ranks, *factors, ctx.half_margin
        )
        if ctx.loss_scale is not None:
            ctx.loss_scale.record_moved(own.any())
        return change, None, None, None, None, None


def _crossings_without_ties(scores, values, new_values, rank):
    """rk(perturbed) − rk(scores) per element that is no positive, and per positive
    slot (`own`), in the scores' dtype, exact in every sequence where no other element
    equals a positive's value before the perturbation. The comparisons use the
    unperturbed scores; the positives' own columns, where that is wrong, are corrected
    slot by slot. `rank`: the slots' ranks."""
    # Ties with a perturbed value keep the forward order: an element equal to a positive
    # that moved up was above it (x > value), so it stays above (x >= new value: x > the
    # float just below it, the step toward the old value); one equal to a positive that
    # moved down or stayed stays below (x > new value; the step toward the old value
    # would go up, and the minimum takes the new value).
    thresholds = torch.minimum(new_values, torch.nextafter(new_values, values))
    slots = values.shape[1]
    change = torch.empty_like(scores)
    greater = torch.empty(values.shape, dtype=_count_dtype(scores), device=scores.device)
    for part, larger in _compared(scores, torch.cat([values, thresholds], dim=1)):
        above_before, above_after = larger[:, :slots], larger[:, slots:]
        torch.sum(above_after, -1, dtype=greater.dtype, out=greater[part])
        torch.sum(above_before.sub_(above_after), 1, dtype=change.dtype, out=change[part])
    # In the positives' columns the perturbed sequence holds new_values, not values:
    # take out what the pass counted there and count the perturbed positives at or above
    # each other, itself included (equal ones in forward order, at least as large
    # before: no two positives are equal before): the perturbed rank.
    new_t, new_s = new_values[:, None, :], new_values[:, :, None]
    at_least = values[:, None, :] >= values[:, :, None]
    moved_at_or_above = torch.where(new_t == new_s, at_least, new_t > new_s)
    counted_there = values[:, None, :] > thresholds[:, :, None]
    # Booleans as bytes: their difference summed in one pass.
    greater += (moved_at_or_above.view(torch.int8) - counted_there.view(torch.int8)).sum(-1, dtype=greater.dtype)
    return change, greater.sub_(rank).to(scores.dtype)


def _crossings(scores, values, new_values, elements, valid):
    """rk(perturbed) − rk(scores) per element and per slot (`own`) for the sequences
    given, ties ranked as a stable sort ranks them (ties among perturbed scores keep
    their forward order)."""
    sequence, slot = valid.nonzero(as_tuple=True)
    perturbed = scores.index_put((sequence, elements[sequence, slot]), new_values[sequence, slot])
    before = _above(scores, values, elements)
    rows, new = perturbed[:, None, :], new_values[:, :, None]
    after = (rows > new) | ((rows == new) & before)
    passed = before.view(torch.int8) - after.view(torch.int8)
    # At most log2(n) slots: the per-element sums fit in a byte.
    return passed.sum(1, dtype=torch.int8).to(scores.dtype), passed.sum(-1, dtype=scores.dtype).neg_()


def shift_by_margin(scores, positives, margin):
    """Eq. 14: positives shifted down by margin/2, negatives up by margin/2."""
    if margin == 0:
        return scores
    half = margin / 2
    return torch.where(positives, -half, half).to(scores.dtype).add_(scores)  # no second N x M buffer


def precision_at_positives(scores, positives, lambda_val, margin, loss_scale=None, indices=None, counts=None):
    """Per sequence (last dimension): the mean precision at its positives (eq. 21,
    margin by eq. 14-15), and whether it has any positive. Sequences without a
    positive get 0. `indices`: ``positives.nonzero(as_tuple=True)``, and `counts`:
    `positive_counts`, of the [sequences, n] mask, when already at hand."""
    batch_shape, n = scores.shape[:-1], scores.shape[-1]
    scores, positives = scores.reshape(-1, n), positives.reshape(-1, n)
    counts = positive_counts(positives) if counts is None else counts
    (sequence, element), ranks, among_positives = blackbox_ranks_of_positives(
        scores, positives, lambda_val, loss_scale, indices, counts, margin
    )
    # rk(y+) / rk(y) as counts: the normalised rank times the length.
    precision = among_positives / (ranks * n)  # the integers converted by the division
    summed = scores.new_zeros(len(scores)).index_add(0, sequence, precision)
    num_positives = counts.per_sequence
    mean = summed / num_positives.clamp(min=1)
    return mean.view(batch_shape), (num_positives > 0).view(batch_shape)


def _check_targets(owner, scores, targets):
    if not torch.is_tensor(targets) or targets.shape != scores.shape:
        shape = tuple(targets.shape) if torch.is_tensor(targets) else type(targets).__name__
        raise ValueError(f"{owner}: targets must have the shape of scores {tuple(scores.shape)}, got {shape}")
    if targets.dtype != torch.bool:
        if not bool(((targets == 0) | (targets == 1)).all()):
            raise ValueError(f"{owner}: targets must be 0/1 or boolean")
        targets = targets.bool()
    return targets


def _checked_targets(owner, scores, targets, lambda_val):
    """The AP losses' checks of their arguments; returns `targets` as booleans."""
    check_numbers(owner, "> 0", lambda_val=lambda_val)
    check_embeddings(owner, scores=scores)
    return _check_targets(owner, scores, targets)


def _ap_loss(scores, targets, lambda_val, margin, loss_scale, counts):
    """1 − the mean AP over the sequences with a positive; `counts`: `positive_counts`."""
    if not counts.total:
        return (scores * 0).sum()
    precision, _ = precision_at_positives(scores, targets, lambda_val, margin, loss_scale, counts=counts)
    # The others' precisions are 0: the sum over all over the number with a positive.
    return 1 - precision.sum() / counts.sequences_with_one


def average_precision_loss(scores, targets, lambda_val=0.5, margin=0.15):
    """Eq. 22: 1 − AP, averaged over the sequences along the last dimension that have a
    positive (0 when none has). `targets` are 0/1 or boolean, shaped like `scores`.
    Defaults are the paper's detection values (sec. 5.2)."""
    targets = _checked_targets("average_precision_loss", scores, targets, lambda_val)
    counts = positive_counts(targets.reshape(-1, targets.shape[-1]))
    scale = LossScale()
    return scale.attach(_ap_loss(scores, targets, lambda_val, margin, scale, counts))


def map_loss(scores, targets, lambda_val=0.5, margin=0.15, apc_weight=1 / 3):
    """The classification / detection loss of sec. 4.6 and 5.2 for `scores` and 0/1
    `targets` of shape [batch, classes]:

        (1 − apc_weight) · L_mAP + apc_weight · L_APC

    L_mAP ranks each class's column over the batch and averages 1 − AP over the classes
    present in the batch (eq. 22 and 6); L_APC ranks all batch × classes scores as one
    sequence (eq. 23). The paper weights mAP:APC 2:1 (apc_weight = 1/3), with λ = 0.5
    and margin 0.15. The weighting is part of the loss, as in the authors' code: it
    scales the gradient reaching each ranking, while a factor on the whole loss does
    not change λ (see the module docstring).
    """
    if not torch.is_tensor(scores) or scores.ndim != 2:
        shape = tuple(scores.shape) if torch.is_tensor(scores) else type(scores).__name__
        raise ValueError(f"map_loss: scores must have shape [batch, classes], got {shape}")
    if not 0 <= apc_weight <= 1:
        raise ValueError(f"map_loss: apc_weight must be in [0, 1], got {apc_weight!r}")
    targets = _checked_targets("map_loss", scores, targets, lambda_val)
    per_class_counts = positive_counts(targets.T)
    # The one sequence of all scores: its counts follow from the classes' without a read-back.
    total = per_class_counts.total
    one_sequence = PositiveCounts(per_class_counts.per_sequence.sum().view(1), total, total, int(total > 0))
    scale = LossScale()
    per_class = _ap_loss(scores.T, targets.T, lambda_val, margin, scale, per_class_counts)
    across_classes = _ap_loss(scores.reshape(-1), targets.reshape(-1), lambda_val, margin, scale, one_sequence)
    return scale.attach((1 - apc_weight) * per_class + apc_weight * across_classes)


def apc_loss(scores, targets, lambda_val=0.5, margin=0.15):
    """Eq. 23: 1 − AP of all scores ranked as one sequence (any shape)."""
    if not torch.is_tensor(scores):
        raise TypeError(f"apc_loss: scores must be a tensor, got {type(scores).__name__}")
    flat_targets = targets.reshape(-1) if torch.is_tensor(targets) else targets
    return average_precision_loss(scores.reshape(-1), flat_targets, lambda_val, margin)
