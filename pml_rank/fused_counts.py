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

0. `_counts_kernel` (`ranking.positive_counts`): each sequence's number of positives and
   the numbers the host reads back (the most in one sequence, the total, the sequences with
   one), in one launch where torch takes four reductions and a stack;
   `_label_positives_kernel`: RaMBO's mask of positives by label (without each query's own
   column in its batch) with the same counts, where torch compares, drops the diagonal
   (a copy) and counts.
1. `_ranks_kernel` (forward): per positive, its rank (the elements above it, plus one)
   and its rank among its sequence's positives.
2. `_crossings_kernel` (backward): per element, how many positives passed it on their
   way (its rank change, times Algorithm 1's factor); per positive, its own rank change.

Both shift the scores by RaMBO's margin as they read them (`ranking.shift_by_margin`: the
same float32 sums), and the backward one scales its step and its changes by Algorithm 1's
factors: on a GPU, where a call's time is its launches, no [sequences, n] pass of its own
for either.

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


def applies(scores, dtypes=(torch.float32,)):
    """Whether the kernels count for these `scores` [sequences, n] (or, of `dtypes`, a mask)."""
    return _triton.runs_on(scores, dtypes)


def counts(positives):
    """Of a boolean [sequences, n] mask (any strides): each sequence's number of True entries
    (int32) and [3] int64: the most in one sequence, their total and the number of sequences
    with one, which `ranking.positive_counts` reads back. Integer atomics: the same numbers
    whatever order the sequences' programs run in."""
    per_sequence = torch.empty(len(positives), dtype=torch.int32, device=positives.device)
    numbers = torch.zeros(3, dtype=torch.int64, device=positives.device)
    if len(positives):
        with _triton.on_device(positives.device):
            _counts_kernel[(len(positives),)](
                positives.view(torch.uint8),
                per_sequence,
                numbers,
                positives.shape[1],
                positives.stride(0),
                positives.stride(1),
                BLOCK_N=ELEMENTS_PER_STEP,
            )
    return per_sequence, numbers


def label_positives(labels, ref_labels, skip_own):
    """The positives by label, a boolean [queries, references] mask of equal labels (1-D
    integer tensors), without each query's own column where `skip_own` (as
    `rambo.without_self` drops it: [queries, references - 1]), and `counts` of it: the
    comparison, the mask and its counts in one launch."""
    width = len(ref_labels) - int(skip_own)
    mask = torch.empty(len(labels), width, dtype=torch.bool, device=labels.device)
    per_sequence = torch.empty(len(labels), dtype=torch.int32, device=labels.device)
    numbers = torch.zeros(3, dtype=torch.int64, device=labels.device)
    if len(labels):
        with _triton.on_device(labels.device):
            _label_positives_kernel[(len(labels),)](
                labels,
                ref_labels,
                mask.view(torch.uint8),
                per_sequence,
                numbers,
                width,
                SKIP_OWN=bool(skip_own),
                BLOCK_N=ELEMENTS_PER_STEP,
            )
    return mask, per_sequence, numbers


def ranks(scores, element, per_sequence, ends, most, half_margin=0.0):
    """Per positive (`element`, row-major; `per_sequence` of them in each sequence, whose
    run ends at `ends`, `most` at most): its rank, counted in the scores' dtype, and its
    rank among its sequence's positives (int64), 1 = highest, in the scores shifted by
    `half_margin` (`ranking.shift_by_margin`: positives down, the others up). `element` may
    be strided (a column of `nonzero_static`'s output: no copy)."""
    scores = scores.contiguous()
    rank = torch.empty(element.shape, dtype=scores.dtype, device=scores.device)
    among = torch.empty(element.shape, dtype=torch.int64, device=scores.device)
    if len(element):
        with _triton.on_device(scores.device):
            _ranks_kernel[(len(scores),)](
                scores,
                element,
                element.stride(0),
                per_sequence,
                ends,
                rank,
                among,
                scores.shape[1],
                half_margin,
                BLOCK_S=_block(most),
                BLOCK_N=ELEMENTS_PER_STEP,
            )
    return rank, among


def crossings(scores, element, per_sequence, ends, most, grad, step_factor, change_factor, half_margin=0.0):
    """rk(perturbed) − rk(scores) for every element [sequences, n] times `change_factor`, in
    the scores' dtype, and for each positive on its own (unscaled), where the positives (as
    for `ranks`, the scores shifted by `half_margin`) moved by `grad` times `step_factor`.
    The factors (Algorithm 1's, `ranking._algorithm_1_factors`) are numbers or 0-d float64
    tensors on the scores' device, rounded to float32 as torch's products round them."""
    scores = scores.contiguous()
    # Numbers (no loss scale) filled on the device: a tensor made from them would be a copy
    # that makes a GPU's host wait.
    step_factor, change_factor = (
        f if torch.is_tensor(f) else torch.full((), f, dtype=torch.float64, device=scores.device)
        for f in (step_factor, change_factor)
    )
    change, own = torch.empty_like(scores), torch.empty_like(grad)
    if len(scores):  # a sequence without positives: every change 0
        with _triton.on_device(scores.device):
            _crossings_kernel[(len(scores),)](
                scores,
                element,
                element.stride(0),
                per_sequence,
                ends,
                grad.contiguous(),
                step_factor,
                change_factor,
                change,
                own,
                scores.shape[1],
                half_margin,
                BLOCK_S=_block(most),
                BLOCK_N=ELEMENTS_PER_STEP,
                # A perturbed value is the product's float32 rounding plus the score, as in
                # torch: no fused multiply-add.
                enable_fp_fusion=False,
            )
    return change, own


def _block(count):
    """A power of two at least `count` (and 2: a block of Triton's shape)."""
    return max(2, triton.next_power_of_2(count))


if triton is not None:

    @triton.jit
    def _counts_kernel(positives, per_sequence, numbers, n, stride_sequence, stride_element, BLOCK_N: tl.constexpr):
        sequence = tl.program_id(0).to(tl.int64)
        total = tl.zeros([BLOCK_N], dtype=tl.int32)
        for first in range(0, n, BLOCK_N):
            j = first + tl.arange(0, BLOCK_N)
            at = positives + sequence * stride_sequence + j.to(tl.int64) * stride_element
            total += (tl.load(at, mask=j < n, other=0) != 0).to(tl.int32)
        _counted(tl.sum(total, axis=0), sequence, per_sequence, numbers)

    @triton.jit
    def _counted(count, sequence, per_sequence, numbers):
        """Stores a sequence's count and adds it to the numbers read back (integer atomics)."""
        tl.store(per_sequence + sequence, count)
        tl.atomic_max(numbers, count.to(tl.int64))
        tl.atomic_add(numbers + 1, count.to(tl.int64))
        tl.atomic_add(numbers + 2, (count > 0).to(tl.int64))

    @triton.jit
    def _label_positives_kernel(
        labels, ref_labels, mask, per_sequence, numbers, width, SKIP_OWN: tl.constexpr, BLOCK_N: tl.constexpr
    ):
        query = tl.program_id(0).to(tl.int64)
        label = tl.load(labels + query)
        total = tl.zeros([BLOCK_N], dtype=tl.int32)
        for first in range(0, width, BLOCK_N):
            column = first + tl.arange(0, BLOCK_N).to(tl.int64)
            inside = column < width
            # Past the query's own column, a column holds the next reference.
            reference = column + (column >= query).to(tl.int64) if SKIP_OWN else column
            equal = (tl.load(ref_labels + reference, mask=inside, other=0) == label) & inside
            tl.store(mask + query * width + column, equal.to(tl.uint8), mask=inside)
            total += equal.to(tl.int32)
        _counted(tl.sum(total, axis=0), query, per_sequence, numbers)

    @triton.jit
    def _positives(
        scores, element, element_stride, per_sequence, ends, sequence, n, half_margin, BLOCK_S: tl.constexpr
    ):
        """A sequence's row, its positives' slots (padding: not valid), their places in
        the positives' list and in the row, and their values shifted down by `half_margin`
        (padding: NaN)."""
        count = tl.load(per_sequence + sequence)
        slot = tl.arange(0, BLOCK_S)
        valid = slot < count
        listed = tl.load(ends + sequence) - count + slot
        where = tl.load(element + listed * element_stride, mask=valid, other=0)
        row = scores + sequence * n
        value = tl.load(row + where, mask=valid, other=float("nan")) + (0.0 - half_margin)
        return row, slot, valid, listed, where, value

    @triton.jit
    def _shifted_step(row, j, n, valid, where, half_margin):
        """Elements j of a row, shifted by the margin (positives down, the others up; past
        the end: NaN), and which of them are the sequence's positives, and where: [slots, j]."""
        x = tl.load(row + j, mask=j < n, other=float("nan"))
        own_column = (j[None, :] == where[:, None]) & valid[:, None]
        is_positive = tl.max(own_column.to(tl.int32), axis=0) > 0
        return x + tl.where(is_positive, 0.0 - half_margin, half_margin), own_column, is_positive

    @triton.jit
    def _above(x, j, value, where):
        """[slots, elements]: whether element j (value x) ranks above each positive: larger,
        or equal at a lower position."""
        return (x[None, :] > value[:, None]) | ((x[None, :] == value[:, None]) & (j[None, :] < where[:, None]))

    @triton.jit
    def _ranks_kernel(
        scores,
        element,
        element_stride,
        per_sequence,
        ends,
        rank,
        among,
        n,
        half_margin,
        BLOCK_S: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        sequence = tl.program_id(0).to(tl.int64)
        row, slot, valid, listed, where, value = _positives(
            scores, element, element_stride, per_sequence, ends, sequence, n, half_margin, BLOCK_S
        )
        above = tl.zeros([BLOCK_S], dtype=tl.int32)
        for first in range(0, n, BLOCK_N):
            j = first + tl.arange(0, BLOCK_N)
            x, _, _ = _shifted_step(row, j, n, valid, where, half_margin)
            above += tl.sum(_above(x, j, value, where).to(tl.int32), axis=1)
        tl.store(rank + listed, (above + 1).to(rank.dtype.element_ty), mask=valid)
        among_above = tl.sum(_above(value, slot, value, slot).to(tl.int32), axis=1)
        tl.store(among + listed, (among_above + 1).to(tl.int64), mask=valid)

    @triton.jit
    def _crossings_kernel(
        scores,
        element,
        element_stride,
        per_sequence,
        ends,
        grad,
        step_factor,
        change_factor,
        change,
        own,
        n,
        half_margin,
        BLOCK_S: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        sequence = tl.program_id(0).to(tl.int64)
        row, slot, valid, listed, where, value = _positives(
            scores, element, element_stride, per_sequence, ends, sequence, n, half_margin, BLOCK_S
        )
        step = tl.load(grad + listed, mask=valid, other=0.0) * tl.load(step_factor).to(tl.float32)
        new = value + step
        factor = tl.load(change_factor).to(change.dtype.element_ty)
        passed_by = tl.zeros([BLOCK_S], dtype=tl.int32)
        for first in range(0, n, BLOCK_N):
            j = first + tl.arange(0, BLOCK_N)
            x, own_column, is_positive = _shifted_step(row, j, n, valid, where, half_margin)
            # The perturbed sequence: each positive's column holds its new value.
            perturbed = tl.where(is_positive, tl.sum(tl.where(own_column, new[:, None], 0.0), axis=0), x)
            before = _above(x, j, value, where)
            # Ties with a perturbed value keep the forward order.
            after = (perturbed[None, :] > new[:, None]) | ((perturbed[None, :] == new[:, None]) & before)
            passed = before.to(tl.int32) - after.to(tl.int32)
            # The positives' own columns get their own change below: no two stores to one place.
            passed_j = tl.sum(passed, axis=0).to(change.dtype.element_ty) * factor
            tl.store(change + sequence * n + j, passed_j, mask=(j < n) & ~is_positive)
            passed_by += tl.sum(passed, axis=1)
        moved = (0 - passed_by).to(own.dtype.element_ty)
        tl.store(own + listed, moved, mask=valid)
        tl.store(change + sequence * n + where, moved * factor, mask=valid)
