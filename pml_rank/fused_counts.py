"""RaMBO's rank counting (`ranking._CountedRanks`) on a GPU in one Triton kernel per
pass that reads each score once, instead of writing every (element, positive)
comparison of a sequence to memory and summing it back: at batch 8192 with 3 positives
a row, 12 comparisons per score, the loss's largest cost after the similarity product.

The kernels take the positives as the ranking lists them, row-major (`element`: each
one's position in its sequence; `ends`: where each sequence's run of them ends), and
write one number per positive in that order: no padded [sequences, slots] copies to
build and gather back. They follow the stable order's rules everywhere (of two equal
scores the one at the lower position ranks higher; ties among perturbed scores keep
their forward order), so a sequence with ties needs no second pass, and the host never
waits to find one.

1. `_ranks_kernel` (forward): per positive, its rank (the elements above it, plus one)
   and its rank among its sequence's positives.
2. `_crossings_kernel` (backward): per element, how many positives passed it on their
   way (its rank change); per positive, its own rank change.

The plain-torch passes in `ranking` stay the reference: the tests hold these equal to them
(in Triton's interpreter on the CPU, on CUDA under the `cuda` marker), and they run
wherever these cannot (`_triton.runs_on`).
"""

import torch

from . import _triton
from ._triton import triton

if triton is not None:
    import triton.language as tl

# Elements of a sequence per step of either kernel: with up to 32 positives, a [32, 1024]
# tile of comparisons in registers.
ELEMENTS_PER_STEP = 1024


def applies(scores):
    """Whether the kernels count for these `scores` [sequences, n]."""
    return _triton.runs_on(scores)


def ranks(scores, element, per_sequence, ends, most):
    """Per positive (`element`, row-major; `per_sequence` of them in each sequence, whose
    run ends at `ends`, `most` at most): its rank, counted in the scores' dtype, and its
    rank among its sequence's positives (int64), 1 = highest."""
    scores, element = scores.contiguous(), element.contiguous()
    rank = torch.empty(element.shape, dtype=scores.dtype, device=scores.device)
    among = torch.empty(element.shape, dtype=torch.int64, device=scores.device)
    if len(element):
        with _triton.on_device(scores.device):
            _ranks_kernel[(len(scores),)](
                scores,
                element,
                per_sequence,
                ends,
                rank,
                among,
                scores.shape[1],
                BLOCK_S=_block(most),
                BLOCK_N=ELEMENTS_PER_STEP,
            )
    return rank, among


def crossings(scores, element, per_sequence, ends, most, step):
    """rk(perturbed) − rk(scores) for every element [sequences, n], in the scores' dtype,
    and for each positive on its own, where the positives (as for `ranks`) moved by `step`."""
    scores, element = scores.contiguous(), element.contiguous()
    change, own = torch.empty_like(scores), torch.empty_like(step)
    if len(scores):  # a sequence without positives: every change 0
        with _triton.on_device(scores.device):
            _crossings_kernel[(len(scores),)](
                scores,
                element,
                per_sequence,
                ends,
                step.contiguous(),
                change,
                own,
                scores.shape[1],
                BLOCK_S=_block(most),
                BLOCK_N=ELEMENTS_PER_STEP,
            )
    return change, own


def _block(count):
    """A power of two at least `count` (and 2: a block of Triton's shape)."""
    return max(2, triton.next_power_of_2(count))


if triton is not None:

    @triton.jit
    def _positives(scores, element, per_sequence, ends, sequence, n, BLOCK_S: tl.constexpr):
        """A sequence's row, its positives' slots (padding: not valid), their places in
        the positives' list and in the row, and their values (padding: NaN)."""
        count = tl.load(per_sequence + sequence)
        slot = tl.arange(0, BLOCK_S)
        valid = slot < count
        listed = tl.load(ends + sequence) - count + slot
        where = tl.load(element + listed, mask=valid, other=0)
        row = scores + sequence * n
        value = tl.load(row + where, mask=valid, other=float("nan"))
        return row, slot, valid, listed, where, value

    @triton.jit
    def _above(x, j, value, where):
        """[slots, elements]: whether element j (value x) ranks above each positive: larger,
        or equal at a lower position."""
        return (x[None, :] > value[:, None]) | ((x[None, :] == value[:, None]) & (j[None, :] < where[:, None]))

    @triton.jit
    def _ranks_kernel(
        scores, element, per_sequence, ends, rank, among, n, BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr
    ):
        sequence = tl.program_id(0).to(tl.int64)
        row, slot, valid, listed, where, value = _positives(scores, element, per_sequence, ends, sequence, n, BLOCK_S)
        above = tl.zeros([BLOCK_S], dtype=tl.int32)
        for first in range(0, n, BLOCK_N):
            j = first + tl.arange(0, BLOCK_N)
            x = tl.load(row + j, mask=j < n, other=float("nan"))
            above += tl.sum(_above(x, j, value, where).to(tl.int32), axis=1)
        tl.store(rank + listed, (above + 1).to(rank.dtype.element_ty), mask=valid)
        among_above = tl.sum(_above(value, slot, value, slot).to(tl.int32), axis=1)
        tl.store(among + listed, (among_above + 1).to(tl.int64), mask=valid)

    @triton.jit
    def _crossings_kernel(
        scores,
        element,
        per_sequence,
        ends,
        step,
        change,
        own,
        n,
        BLOCK_S: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        sequence = tl.program_id(0).to(tl.int64)
        row, slot, valid, listed, where, value = _positives(scores, element, per_sequence, ends, sequence, n, BLOCK_S)
        new = value + tl.load(step + listed, mask=valid, other=0.0)
        passed_by = tl.zeros([BLOCK_S], dtype=tl.int32)
        for first in range(0, n, BLOCK_N):
            j = first + tl.arange(0, BLOCK_N)
            x = tl.load(row + j, mask=j < n, other=float("nan"))
            # The perturbed sequence: each positive's column holds its new value.
            own_column = (j[None, :] == where[:, None]) & valid[:, None]
            is_positive = tl.max(own_column.to(tl.int32), axis=0) > 0
            perturbed = tl.where(is_positive, tl.sum(tl.where(own_column, new[:, None], 0.0), axis=0), x)
            before = _above(x, j, value, where)
            # Ties with a perturbed value keep the forward order.
            after = (perturbed[None, :] > new[:, None]) | ((perturbed[None, :] == new[:, None]) & before)
            passed = before.to(tl.int32) - after.to(tl.int32)
            # The positives' own columns get their own change below: no two stores to one place.
            passed_j = tl.sum(passed, axis=0).to(change.dtype.element_ty)
            tl.store(change + sequence * n + j, passed_j, mask=(j < n) & ~is_positive)
            passed_by += tl.sum(passed, axis=1)
        moved = (0 - passed_by).to(own.dtype.element_ty)
        tl.store(own + listed, moved, mask=valid)
        tl.store(change + sequence * n + where, moved, mask=valid)
