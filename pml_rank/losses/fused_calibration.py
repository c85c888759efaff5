"""ROADMAP's calibration terms with their default reducer (`roadmap.calibration_terms`) on a GPU
in one Triton pass over the similarity matrix forward and one backward, instead of a dozen
elementwise passes each way (margin, mask, weight, relu, count, sum; and their gradients).

For the pairs of a mask, each term is λ times the mean of the positive shortfalls over the
pairs that have one (PML's AvgNonZeroReducer over λ · relu(shortfall)):

    positive pairs: shortfall = sign · (α − s),  negative pairs: shortfall = sign · (s − β),

sign = 1 for a similarity, −1 for a distance (PML's `margin`). Forward: each program sums its
block's shortfalls and counts them (float32 sums, int32 counts: float32 counts stop being
exact past 2^24 pairs), and one more program adds the blocks' partial results (int64
counts) into the two terms. The pairs come as two
boolean masks, or as the batch's labels when it is its own references (positive: the same
label, (i, i) aside; negative: another label), read instead of two [B, B] masks. Backward: each pair
with a shortfall moves by ∓ sign · λ · the incoming gradient / its term's count. The plain
torch terms (`roadmap.calibration_terms`, a panel of rows at a time) stay the reference and the path wherever this one
cannot run (`applies`); the tests hold the two equal.
"""

import torch

from . import fused_ranks
from .fused_ranks import triton

# Entries of the matrix per program, in both passes, over WARPS_PER_BLOCK warps: 8 entries a
# thread. With Triton's default of 4 warps (32 a thread) the label-reading gradient kernel
# used every register and spilled 276 bytes a thread to memory on sm_90 (ptxas's log; the test
# `test_every_kernel_launch_compiles_for_a_gpu_without_spilling` checks each launch).
ENTRIES_PER_BLOCK = 4096
WARPS_PER_BLOCK = 16


def applies(matrix):
    """Whether the kernels compute the terms of this matrix: float32, or the half-precision
    product the relaxed ranks' kernels read too (`fused_ranks.HALF_SCORES`)."""
    return fused_ranks.reads(matrix)


def calibration_terms(matrix, pairs, pos_margin, neg_margin, lambda_, sign):
    """(positive term, negative term): two float32 scalars, each λ · mean of the non-zero
    shortfalls of its pairs (0 without one), differentiable with respect to `matrix`.
    `pairs`: the (positive, negative) boolean masks, or the labels of a batch that is its
    own references."""
    if torch.is_tensor(pairs):  # labels: the kernels compare them, in place of the masks
        pairs = (pairs.contiguous(),) * 2  # read one by one: a strided view would give other samples' labels
        by_label = True
    else:
        pairs = tuple(mask.contiguous().view(torch.uint8) for mask in pairs)
        by_label = False
    return CalibrationTerms.apply(matrix, *pairs, (pos_margin, neg_margin, lambda_, sign, by_label))


class CalibrationTerms(torch.autograd.Function):
    @staticmethod
    def forward(ctx, matrix, positive, negative, parameters):
        matrix = matrix.contiguous()
        entries = matrix.numel()
        blocks = triton.cdiv(entries, ENTRIES_PER_BLOCK)
        # Each block writes its row of partial sums and counts: nothing to fill.
        sums = matrix.new_empty(max(blocks, 1), 2, dtype=torch.float32)
        counts = torch.empty(max(blocks, 1), 2, dtype=torch.int32, device=matrix.device)
        # The two terms, and per pair of a term with a shortfall d term / d shortfall = λ / count.
        pos_term, neg_term, scales = (matrix.new_empty(shape, dtype=torch.float32) for shape in ((), (), 2))
        pos_margin, neg_margin, lambda_, sign = map(float, parameters[:4])
        by_label = parameters[4]
        with fused_ranks.on_device(matrix.device):
            if blocks:
                _terms_kernel[(blocks,)](
                    matrix, positive, negative, sums, counts, entries, matrix.shape[1],
                    pos_margin, neg_margin, sign, BY_LABEL=by_label, BLOCK=ENTRIES_PER_BLOCK,
                    num_warps=WARPS_PER_BLOCK,
                )  # fmt: skip
            _finish_kernel[(1,)](sums, counts, blocks, lambda_, pos_term, neg_term, scales, BLOCK=1024)
        ctx.save_for_backward(matrix, positive, negative, scales)
        ctx.parameters = parameters
        return pos_term, neg_term

    @staticmethod
    def backward(ctx, grad_positive_term, grad_negative_term):
        matrix, positive, negative, scales = ctx.saved_tensors
        pos_margin, neg_margin, _, sign = map(float, ctx.parameters[:4])
        by_label = ctx.parameters[4]
        grad = torch.empty_like(matrix)
        entries = matrix.numel()
        if entries:
            with fused_ranks.on_device(matrix.device):
                _gradient_kernel[(triton.cdiv(entries, ENTRIES_PER_BLOCK),)](
                    matrix, positive, negative, grad_positive_term, grad_negative_term, scales, grad, entries,
                    matrix.shape[1], pos_margin, neg_margin, sign, BY_LABEL=by_label, BLOCK=ENTRIES_PER_BLOCK,
                    num_warps=WARPS_PER_BLOCK,
                )  # fmt: skip
        return grad, None, None, None


if triton is not None:
    import triton.language as tl

    @triton.jit
    def _shortfalls(
        matrix, positive, negative, entries, columns, pos_margin, neg_margin, sign, BY_LABEL: tl.constexpr, BLOCK
    ):
        at = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = at < entries
        s = tl.load(matrix + at, mask=inside, other=0.0).to(tl.float32)  # float16 as the ranks' kernels
        if BY_LABEL:  # `positive` and `negative` are both the labels
            row = at // columns
            column = at - row * columns
            same = tl.load(positive + row, mask=inside, other=0) == tl.load(negative + column, mask=inside, other=0)
            is_positive = same & (row != column) & inside
            is_negative = (same == 0) & inside
        else:
            is_positive = tl.load(positive + at, mask=inside, other=0) != 0
            is_negative = tl.load(negative + at, mask=inside, other=0) != 0
        pos_short = tl.where(is_positive, sign * (pos_margin - s), 0.0)
        neg_short = tl.where(is_negative, sign * (s - neg_margin), 0.0)
        return at, inside, pos_short, neg_short

    @triton.jit
    def _terms_kernel(
        matrix,
        positive,
        negative,
        sums,
        counts,
        entries,
        columns,
        pos_margin,
        neg_margin,
        sign,
        BY_LABEL: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        _, _, pos_short, neg_short = _shortfalls(
            matrix, positive, negative, entries, columns, pos_margin, neg_margin, sign, BY_LABEL, BLOCK
        )
        block = tl.program_id(0)
        tl.store(sums + 2 * block, tl.sum(tl.maximum(pos_short, 0.0), axis=0))
        tl.store(sums + 2 * block + 1, tl.sum(tl.maximum(neg_short, 0.0), axis=0))
        tl.store(counts + 2 * block, tl.sum((pos_short > 0.0).to(tl.int32), axis=0))
        tl.store(counts + 2 * block + 1, tl.sum((neg_short > 0.0).to(tl.int32), axis=0))

    @triton.jit
    def _finish_kernel(sums, counts, blocks, lambda_, pos_term, neg_term, scales, BLOCK: tl.constexpr):
        pos_sums = tl.zeros([BLOCK], dtype=tl.float32)
        neg_sums = tl.zeros([BLOCK], dtype=tl.float32)
        pos_counts = tl.zeros([BLOCK], dtype=tl.int64)
        neg_counts = tl.zeros([BLOCK], dtype=tl.int64)
        for first in range(0, blocks, BLOCK):
            block = first + tl.arange(0, BLOCK)
            inside = block < blocks
            pos_sums += tl.load(sums + 2 * block, mask=inside, other=0.0)
            neg_sums += tl.load(sums + 2 * block + 1, mask=inside, other=0.0)
            pos_counts += tl.load(counts + 2 * block, mask=inside, other=0).to(tl.int64)
            neg_counts += tl.load(counts + 2 * block + 1, mask=inside, other=0).to(tl.int64)
        pos_scale = 1.0 / tl.maximum(tl.sum(pos_counts, axis=0), 1).to(tl.float32) * lambda_
        neg_scale = 1.0 / tl.maximum(tl.sum(neg_counts, axis=0), 1).to(tl.float32) * lambda_
        tl.store(pos_term, tl.sum(pos_sums, axis=0) * pos_scale)
        tl.store(neg_term, tl.sum(neg_sums, axis=0) * neg_scale)
        tl.store(scales, pos_scale)
        tl.store(scales + 1, neg_scale)

    @triton.jit
    def _gradient_kernel(
        matrix,
        positive,
        negative,
        grad_pos_term,
        grad_neg_term,
        scales,
        grad,
        entries,
        columns,
        pos_margin,
        neg_margin,
        sign,
        BY_LABEL: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        at, inside, pos_short, neg_short = _shortfalls(
            matrix, positive, negative, entries, columns, pos_margin, neg_margin, sign, BY_LABEL, BLOCK
        )
        # d shortfall / d s: −sign for the positive term, +sign for the negative one.
        pos_coefficient = tl.load(grad_pos_term).to(tl.float32) * tl.load(scales)
        neg_coefficient = tl.load(grad_neg_term).to(tl.float32) * tl.load(scales + 1)
        value = tl.where(pos_short > 0.0, -sign * pos_coefficient, 0.0)
        value += tl.where(neg_short > 0.0, sign * neg_coefficient, 0.0)
        tl.store(grad + at, value, mask=inside)
