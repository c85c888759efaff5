"""The gradient of RaMBO's similarities without the query's own column (`rambo._SimilaritiesWithoutSelf`)
on a GPU in one Triton kernel, instead of four operations (fill the off-diagonal of an [n, n]
matrix from the [n, n - 1] gradient, zero its diagonal, copy its transpose, add it): at batch
2048 a call is bound by its kernel launches.

Per entry (i, j) of the [n, n] output: G[i, j] + G[j, i], where G is the gradient with the
diagonal put back as zeros (the diagonal: 0 + 0). The same float32 sums as torch's (an
addition of two numbers rounds the same in either order). The torch path in `rambo` stays the
reference and runs wherever this cannot (`_triton.runs_on`); the tests hold the two equal.
"""

from .. import _triton
from .._triton import triton

if triton is not None:
    import triton.language as tl

# Rows and columns of the output per program: two 64 x 64 tiles of float32 in registers.
TILE = 64


def applies(grad):
    """Whether the kernel symmetrises `grad` (float32 [n, n - 1])."""
    return _triton.runs_on(grad) and grad.dim() == 2


def symmetric_with_zero_diagonal(grad):
    """G + Gᵀ [n, n], G the [n, n - 1] `grad` of a matrix without its diagonal with the
    diagonal put back as zeros."""
    grad = grad.contiguous()
    n = len(grad)
    full = grad.new_empty(n, n)
    if n:
        with _triton.on_device(grad.device):
            _symmetric_kernel[(triton.cdiv(n, TILE), triton.cdiv(n, TILE))](grad, full, n, TILE=TILE)
    return full


if triton is not None:

    @triton.jit
    def _without_self(grad, i, j, n):
        """[rows i, columns j]: G[i, j], read from the gradient without the diagonal (column j
        of row i is its column j − 1 past the diagonal); 0 on the diagonal."""
        off_diagonal = (i[:, None] != j[None, :]) & (i[:, None] < n) & (j[None, :] < n)
        column = j[None, :] - (j[None, :] > i[:, None]).to(tl.int64)
        return tl.load(grad + i[:, None] * (n - 1) + column, mask=off_diagonal, other=0.0)

    @triton.jit
    def _symmetric_kernel(grad, full, n, TILE: tl.constexpr):
        i = tl.program_id(0).to(tl.int64) * TILE + tl.arange(0, TILE)
        j = tl.program_id(1).to(tl.int64) * TILE + tl.arange(0, TILE)
        total = _without_self(grad, i, j, n) + tl.trans(_without_self(grad, j, i, n))
        tl.store(full + i[:, None] * n + j[None, :], total, mask=(i[:, None] < n) & (j[None, :] < n))
