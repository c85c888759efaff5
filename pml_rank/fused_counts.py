"""RaMBO's rank counting (`ranking._CountedRanks`) on a GPU in two Triton kernels that read
each score once, instead of writing every (element, threshold) comparison of a sequence
to memory and summing it back: at batch 8192 with 3 positives a row, 12 comparisons per
score, the loss's largest cost after the similarity product.

1. `_counts_kernel`: how many elements of each sequence exceed each of its thresholds
   (the forward pass's counts above and at each positive, the backward pass's above each
   perturbed positive).
2. `_changes_kernel`: per element x of a sequence, Σ_s ([x > v_s] − [x > t_s]) over its
   slots s: how many positives passed x on their way from v_s to t_s (the backward pass's
   rank change of the elements that are no positives).

NaN thresholds (the slots' padding) exceed nothing. The plain-torch passes in `ranking`
stay the reference: the tests hold these equal to them (in Triton's interpreter on the
CPU, on CUDA under the `cuda` marker), and they run wherever these cannot (`_triton.runs_on`).
"""

import torch

from . import _triton
from ._triton import triton

if triton is not None:
    import triton.language as tl

# Elements of a sequence per step of the counting kernel, and per program of the changes
# kernel: with up to 32 thresholds, a [32, 1024] tile of comparisons in registers.
ELEMENTS_PER_STEP = 1024


def applies(scores, thresholds):
    """Whether the kernels count for these `scores` [sequences, n] and `thresholds`."""
    return _triton.runs_on(scores) and thresholds.dtype == scores.dtype


def counts_above(scores, thresholds):
    """[sequences, T] int32: how many elements of each sequence of `scores` [sequences, n]
    exceed each of its `thresholds` [sequences, T]."""
    scores, thresholds = scores.contiguous(), thresholds.contiguous()
    counts = torch.empty(thresholds.shape, dtype=torch.int32, device=scores.device)
    if counts.numel():
        with _triton.on_device(scores.device):
            _counts_kernel[(len(scores),)](
                scores,
                thresholds,
                counts,
                scores.shape[1],
                thresholds.shape[1],
                BLOCK_T=_block(thresholds.shape[1]),
                BLOCK_N=ELEMENTS_PER_STEP,
            )
    return counts


def changes(scores, before, after):
    """[sequences, n] of `scores`' dtype: Σ_s ([x > before_s] − [x > after_s]) for each
    element x of each sequence, over its slots' `before` and `after` [sequences, S]."""
    scores, before, after = scores.contiguous(), before.contiguous(), after.contiguous()
    out = torch.empty_like(scores)
    if out.numel():
        grid = (len(scores), triton.cdiv(scores.shape[1], ELEMENTS_PER_STEP))
        with _triton.on_device(scores.device):
            _changes_kernel[grid](
                scores,
                before,
                after,
                out,
                scores.shape[1],
                before.shape[1],
                BLOCK_S=_block(before.shape[1]),
                BLOCK_N=ELEMENTS_PER_STEP,
            )
    return out


def _block(count):
    """A power of two at least `count` (and 2: a block of Triton's shape)."""
    return max(2, triton.next_power_of_2(count))


if triton is not None:

    @triton.jit
    def _counts_kernel(scores, thresholds, counts, n, t, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr):
        sequence = tl.program_id(0).to(tl.int64)
        slot = tl.arange(0, BLOCK_T)
        # Padding thresholds are NaN: nothing exceeds them.
        threshold = tl.load(thresholds + sequence * t + slot, mask=slot < t, other=float("nan"))
        total = tl.zeros([BLOCK_T], dtype=tl.int32)
        for first in range(0, n, BLOCK_N):
            j = first + tl.arange(0, BLOCK_N)
            x = tl.load(scores + sequence * n + j, mask=j < n, other=float("nan"))
            total += tl.sum((x[None, :] > threshold[:, None]).to(tl.int32), axis=1)
        tl.store(counts + sequence * t + slot, total, mask=slot < t)

    @triton.jit
    def _changes_kernel(scores, before, after, out, n, s, BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr):
        sequence = tl.program_id(0).to(tl.int64)
        j = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        slot = tl.arange(0, BLOCK_S)
        first = tl.load(before + sequence * s + slot, mask=slot < s, other=float("nan"))
        second = tl.load(after + sequence * s + slot, mask=slot < s, other=float("nan"))
        x = tl.load(scores + sequence * n + j, mask=j < n, other=0.0)
        passed = (x[None, :] > first[:, None]).to(tl.int32) - (x[None, :] > second[:, None]).to(tl.int32)
        tl.store(out + sequence * n + j, tl.sum(passed, axis=0).to(out.dtype.element_ty), mask=j < n)
