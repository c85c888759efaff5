"""RaMBO's rank counting (`ranking._CountedRanks`) on a GPU in one Triton kernel per
pass that reads each score once, instead of writing every (element, threshold)
comparison of a sequence to memory and summing it back: at batch 8192 with 3 positives
a row, 12 comparisons per score, the loss's largest cost after the similarity product.
The slots' own small [slots, slots] comparisons happen in the same kernel.

1. `_ranks_kernel` (forward): per slot of a sequence, the elements at least as large as
   its value and the slots at least as large, and whether another element equals a
   slot's value (a tie).
2. `_crossings_kernel` (backward): per element x of a sequence, Σ_s ([x > v_s] − [x > t_s])
   over its slots s (t_s: the perturbed value's threshold, see
   `ranking._crossings_without_ties`), how many positives passed x on their way, and per
   slot its perturbed rank minus its rank.

NaN values (the slots' padding) count nothing and are counted by nothing. The
plain-torch passes in `ranking` stay the reference: the tests hold these equal to them
(in Triton's interpreter on the CPU, on CUDA under the `cuda` marker), and they run
wherever these cannot (`_triton.runs_on`).
"""

import torch

from . import _triton
from ._triton import triton

if triton is not None:
    import triton.language as tl

# Elements of a sequence per step of either kernel: with up to 32 slots, a [32, 1024]
# tile of comparisons in registers.
ELEMENTS_PER_STEP = 1024


def applies(scores, values):
    """Whether the kernels count for these `scores` [sequences, n] and slot `values`."""
    return _triton.runs_on(scores) and values.dtype == scores.dtype


def ranks(scores, values):
    """`ranking._ranks_and_ties` for `scores` [sequences, n] and `values` [sequences, S]."""
    scores, values = scores.contiguous(), values.contiguous()
    rank = torch.empty(values.shape, dtype=torch.int32, device=scores.device)
    among = torch.empty(values.shape, dtype=torch.int64, device=scores.device)
    tied = torch.empty(len(values), dtype=torch.bool, device=scores.device)
    if len(scores):  # no slots: each program writes that it found no tie
        with _triton.on_device(scores.device):
            _ranks_kernel[(len(scores),)](
                scores,
                values,
                rank,
                among,
                tied,
                scores.shape[1],
                values.shape[1],
                BLOCK_S=_block(values.shape[1]),
                BLOCK_N=ELEMENTS_PER_STEP,
            )
    return rank, among, tied


def crossings(scores, values, new_values, rank):
    """`ranking._crossings_without_ties` for `scores` [sequences, n], the slots' `values`
    and `new_values` [sequences, S] and their `rank`."""
    scores, values, new_values = scores.contiguous(), values.contiguous(), new_values.contiguous()
    change, own = torch.empty_like(scores), torch.empty_like(values)
    if len(scores):
        with _triton.on_device(scores.device):
            _crossings_kernel[(len(scores),)](
                scores,
                values,
                new_values,
                rank.contiguous(),
                change,
                own,
                scores.shape[1],
                values.shape[1],
                BLOCK_S=_block(values.shape[1]),
                BLOCK_N=ELEMENTS_PER_STEP,
            )
    return change, own


def _block(count):
    """A power of two at least `count` (and 2: a block of Triton's shape)."""
    return max(2, triton.next_power_of_2(count))


if triton is not None:

    @triton.jit
    def _ranks_kernel(scores, values, rank, among, tied, n, s, BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr):
        sequence = tl.program_id(0).to(tl.int64)
        slot = tl.arange(0, BLOCK_S)
        value = tl.load(values + sequence * s + slot, mask=slot < s, other=float("nan"))
        greater = tl.zeros([BLOCK_S], dtype=tl.int32)
        at_least = tl.zeros([BLOCK_S], dtype=tl.int32)
        for first in range(0, n, BLOCK_N):
            j = first + tl.arange(0, BLOCK_N)
            x = tl.load(scores + sequence * n + j, mask=j < n, other=float("nan"))
            greater += tl.sum((x[None, :] > value[:, None]).to(tl.int32), axis=1)
            at_least += tl.sum((x[None, :] >= value[:, None]).to(tl.int32), axis=1)
        tl.store(rank + sequence * s + slot, at_least, mask=slot < s)
        # [s, t]: whether slot t's value is at least slot s's.
        slots_at_least = tl.sum((value[None, :] >= value[:, None]).to(tl.int32), axis=1)
        tl.store(among + sequence * s + slot, slots_at_least.to(tl.int64), mask=slot < s)
        tl.store(tied + sequence, tl.max(at_least - greater, axis=0) > 1)

    @triton.jit
    def _crossings_kernel(
        scores,
        values,
        new_values,
        rank,
        change,
        own,
        n,
        s,
        BLOCK_S: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        sequence = tl.program_id(0).to(tl.int64)
        slot = tl.arange(0, BLOCK_S)
        value = tl.load(values + sequence * s + slot, mask=slot < s, other=float("nan"))
        new = tl.load(new_values + sequence * s + slot, mask=slot < s, other=float("nan"))
        # ranking._crossings_without_ties's threshold t, without nextafter: x > t is
        # x >= the new value for a positive that moved up, x > it otherwise.
        up = (new > value)[:, None]
        greater = tl.zeros([BLOCK_S], dtype=tl.int32)
        for first in range(0, n, BLOCK_N):
            j = first + tl.arange(0, BLOCK_N)
            x = tl.load(scores + sequence * n + j, mask=j < n, other=float("nan"))
            above_after = tl.where(up, x[None, :] >= new[:, None], x[None, :] > new[:, None]).to(tl.int32)
            passed = (x[None, :] > value[:, None]).to(tl.int32) - above_after
            tl.store(change + sequence * n + j, tl.sum(passed, axis=0).to(change.dtype.element_ty), mask=j < n)
            greater += tl.sum(above_after, axis=1)
        # The positives' columns, as ranking._crossings_without_ties corrects them; [s, t]:
        # slot t against slot s.
        at_least = value[None, :] >= value[:, None]
        moved_at_or_above = tl.where(new[None, :] == new[:, None], at_least, new[None, :] > new[:, None])
        counted_there = tl.where(up, value[None, :] >= new[:, None], value[None, :] > new[:, None])
        greater += tl.sum(moved_at_or_above.to(tl.int32) - counted_there.to(tl.int32), axis=1)
        before = tl.load(rank + sequence * s + slot, mask=slot < s, other=0)
        tl.store(own + sequence * s + slot, (greater - before).to(own.dtype.element_ty), mask=slot < s)
