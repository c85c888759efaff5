"""F.normalize's L2 normalisation of the embeddings (`base._UnitRows`) on a GPU in one Triton
kernel each way, instead of four forward (norm, clamp, divide, and the clamp's mask) and five
backward: every loss that normalises pays them on each call, and at batch 2048 a call is
bound by its kernel launches.

Forward, per row x: ‖x‖ clamped at eps, and x / that. Backward, per row with incoming gradient
g and output y: (g − y (y · g)) / ‖x‖, or g / eps where the norm was clamped. The torch path in
`base._UnitRows` stays the reference and runs wherever this cannot (`_triton.runs_on`); the
tests hold the two equal.
"""

import torch

from .. import _triton
from .._triton import triton

if triton is not None:
    import triton.language as tl

# Elements of a row per step: a row of up to this many is read in one step.
ELEMENTS_PER_STEP = 1024


def applies(x):
    """Whether the kernels normalise `x` (float32 [rows, columns])."""
    return _triton.runs_on(x) and x.dim() == 2


def unit_rows(x, eps):
    """``(rows, clamped)``: each row of `x` over its L2 norm clamped at `eps`, and the
    clamped norms [rows, 1]."""
    x = x.contiguous()
    rows, clamped = torch.empty_like(x), x.new_empty(len(x), 1)
    if len(x):
        with _triton.on_device(x.device):
            _unit_rows_kernel[(len(x),)](x, rows, clamped, x.shape[1], float(eps), BLOCK=_block(x.shape[1]))
    return rows, clamped


def unit_rows_gradient(grad_rows, rows, clamped, eps):
    """The gradient by `unit_rows`'s input of `grad_rows`, from its outputs."""
    grad = torch.empty_like(rows)
    if len(rows):
        with _triton.on_device(rows.device):
            _unit_rows_gradient_kernel[(len(rows),)](
                grad_rows.contiguous(), rows, clamped, grad, rows.shape[1], float(eps), BLOCK=_block(rows.shape[1])
            )
    return grad


def _block(columns):
    return min(triton.next_power_of_2(max(columns, 1)), ELEMENTS_PER_STEP)


if triton is not None:

    @triton.jit
    def _unit_rows_kernel(x, rows, clamped, columns, eps, BLOCK: tl.constexpr):
        start = tl.program_id(0).to(tl.int64) * columns
        squares = tl.zeros([BLOCK], dtype=tl.float32)
        for first in range(0, columns, BLOCK):
            at = first + tl.arange(0, BLOCK)
            value = tl.load(x + start + at, mask=at < columns, other=0.0)
            squares += value * value
        # Round-to-nearest square root and division, as torch's.
        norm = tl.maximum(tl.sqrt_rn(tl.sum(squares, axis=0)), eps)
        tl.store(clamped + tl.program_id(0), norm)
        for first in range(0, columns, BLOCK):
            at = first + tl.arange(0, BLOCK)
            inside = at < columns
            value = tl.load(x + start + at, mask=inside, other=0.0)
            tl.store(rows + start + at, tl.div_rn(value, norm), mask=inside)

    @triton.jit
    def _unit_rows_gradient_kernel(grad_rows, rows, clamped, grad, columns, eps, BLOCK: tl.constexpr):
        start = tl.program_id(0).to(tl.int64) * columns
        products = tl.zeros([BLOCK], dtype=tl.float32)
        for first in range(0, columns, BLOCK):
            at = first + tl.arange(0, BLOCK)
            inside = at < columns
            products += tl.load(rows + start + at, mask=inside, other=0.0) * tl.load(
                grad_rows + start + at, mask=inside, other=0.0
            )
        norm = tl.load(clamped + tl.program_id(0))
        # A row whose norm was clamped is x / eps: its gradient is g / eps.
        along = tl.where(norm > eps, tl.sum(products, axis=0), 0.0)
        for first in range(0, columns, BLOCK):
            at = first + tl.arange(0, BLOCK)
            inside = at < columns
            g = tl.load(grad_rows + start + at, mask=inside, other=0.0)
            y = tl.load(rows + start + at, mask=inside, other=0.0)
            tl.store(grad + start + at, tl.div_rn(g - y * along, norm), mask=inside)
