"""`query_panels.RelaxedRanks` on a GPU in two Triton kernels: the sums of every
(query, positive) pair in one pass over the scores, and the Jacobian in another, instead of
a few dozen elementwise kernels per panel (each a pass over a [queries, positives,
references] tensor through memory).

1. `_sums_kernel`: for each pair p = (q, i), S_p = Σ_j w_qj h(x_qpj) and T_p = Σ_j w_qj h'(x_qpj),
   x_qpj = scale · s_qj − scale · s_qi (and scale · s_qi itself): a block of pairs (sorted by
   query, so that their rows come from the cache) against every reference.
2. The losses' formulas on the [r, c] sums, per group of queries with equally many pairs,
   as the panels do (`query_panels.formula_and_gradients`); when every query has c pairs, a
   formula may compute its values and gradients in one kernel of its own instead
   (``formula.fused_gradients``, launched by `formula_by_blocks`).
3. `_jacobian_kernel`, in the backward pass: each query's row of the gradient, the incoming
   gradient g_q times the Jacobian's row J_qj = w_qj Σ_{p of q} G_p h'(x_qpj) plus each
   pair's own column −G_p T_p + the formula's own-score gradient; a block of one query's
   references per program, its pairs in a loop.

Each kernel h is one formula with parameters (`FusedForm`), which every kernel of the
plain-torch path gives as its ``fused`` attribute:

    h(x)  = σ(clamp(min(x, δ) / τ, −L, L)) + start·[x > 0] + ρ·[x − δ]₊ + jump·[x > δ]
    h'(x) = ρ where x > δ, else σ(clamp(x / τ, −L, L))' / τ; 0 where it is at most `slope_floor`

(Smooth-AP's sigmoid, PNP's and Recall@k's clamped sigmoids, SupAP's bound H⁻.) The weights
w_qj are 1, a float matrix, or 1 where the query's and the reference's labels differ
(`query_panels.LabelWeights`); pairs left out of a ranking get weight 0 (the torch path's
−inf), and each query's own column (q, q) is skipped without weights when it is all that a
ranking leaves out (`query_panels.OwnColumns`). The plain-torch path stays the
reference: the tests hold this one equal to it (in Triton's interpreter on the CPU, on
CUDA under the `cuda` marker), and it runs wherever this one cannot (no Triton, the CPU,
float64, a kernel without a ``fused`` form).
"""

import math
from typing import NamedTuple

import torch

from .._triton import interpreted, on_device, runs_on, triton

if triton is not None:
    import triton.language as tl

# Pairs per program of the sums kernel and references per step: a [16, 128] tile of float32
# scores (8 KB) at a time, over SUMS_WARPS warps; references per program of the Jacobian
# kernel. Chosen by `.ci/gpu_kernels.py` (12 settings, examples/results/gpu-kernels.md):
# on an H200 the fastest or within 3% of it for Smooth-AP and ROADMAP at 2048 and 8192.
PAIRS_PER_BLOCK = 16
REFERENCES_PER_STEP = 128
SUMS_WARPS = 4
REFERENCES_PER_BLOCK = 1024

__all__ = [
    "FusedForm",
    "applies",
    "formula_by_blocks",
    "interpreted",
    "on_device",
    "pair_sums",
    "reads",
    "reads_half",
    "runs_on",
    "scaled_jacobian",
]

# A formula kernel's block holds at most this many [queries, c, c] entries (Smooth-AP
# compares each query's positives pairwise), and c at most FORMULA_MOST_PAIRS (rounded up
# to a power of 2): beyond, the formula's torch operations run instead.
FORMULA_BLOCK_ENTRIES = 4096
FORMULA_MOST_PAIRS = 64


class FusedForm(NamedTuple):
    """The parameters of a relaxed-rank kernel h in the fused kernels' one formula (see the
    module's docstring); the defaults give the plain sigmoid σ(x)."""

    temperature: float = 1.0
    limit: float = math.inf
    delta: float = math.inf
    rho: float = 0.0
    start: float = 0.0
    jump: float = 0.0
    slope_floor: float = 0.0


# What the two kernels read besides float32: autocast's half-precision product, each score
# converted to float32 as it is loaded, so that the sums and the Jacobian are float32's and
# the gradient is rounded to half precision once, where it is stored (as autograd's cast of a
# float32 gradient would).
HALF_SCORES = (torch.float16, torch.bfloat16)


def reads(scores):
    """Whether the kernels that read a similarity matrix (these, ROADMAP's calibration's,
    AUC's hardest pairs') run on `scores`: float32 or `HALF_SCORES` where Triton runs."""
    return runs_on(scores, (torch.float32, *HALF_SCORES))


def applies(scores, kernel):
    """Whether the fused kernels compute `RelaxedRanks` for these `scores` (`reads`) and this
    kernel (one with a ``fused`` form)."""
    return reads(scores) and hasattr(kernel, "fused")


def reads_half(matrix):
    """Whether `matrix` is a half-precision product the kernels read as it is (`applies`),
    so that a loss need not keep a float32 copy of it."""
    return matrix.dtype in HALF_SCORES and runs_on(matrix, HALF_SCORES)


def pair_sums(scores, weights, pair_query, pair_positive, form, scale, with_slopes, skip_own):
    """S [pairs], T [pairs] when `with_slopes` (else None) and the pairs' own scaled scores
    scale · s_qi [pairs] of `_sums_kernel`; with `skip_own`, weight 0 at each query's own
    column (q, q)."""
    pairs = len(pair_query)
    sums, own = (scores.new_empty(pairs, dtype=torch.float32) for _ in range(2))
    slopes = scores.new_empty(pairs, dtype=torch.float32) if with_slopes else sums
    if pairs:
        grid = (triton.cdiv(pairs, PAIRS_PER_BLOCK),)
        with on_device(scores.device):
            _sums_kernel[grid](
                *_matrices(scores, weights),
                pair_query,
                pair_positive,
                own,
                sums,
                slopes,
                pairs,
                scores.shape[1],
                float(scale),
                *map(float, form),
                **_form_terms(form),
                WEIGHTS=_weights_form(weights),
                SKIP_OWN=skip_own,
                WITH_SLOPES=with_slopes,
                BLOCK_P=PAIRS_PER_BLOCK,
                BLOCK_J=REFERENCES_PER_STEP,
                num_warps=SUMS_WARPS,
            )
    return sums, slopes if with_slopes else None, own


def formula_by_blocks(kernel, sums, pairs_per_query, arguments, own_gradients, width=None, **constants):
    """A formula's values [queries] and `scale` times its gradients by the sums and by the own
    scores ([pairs] each; the latter None unless `own_gradients`) from its Triton `kernel`,
    for queries of c = `pairs_per_query` pairs each: programs of BLOCK_Q queries, their
    pairs padded to BLOCK_C, called as ``kernel[grid](values, grad_sums, grad_own, queries,
    c, *arguments, BLOCK_Q, BLOCK_C, **constants)``; a query's tile is BLOCK_C × `width`
    entries (default BLOCK_C). None when c is beyond `FORMULA_MOST_PAIRS`."""
    block_c = triton.next_power_of_2(pairs_per_query)
    if block_c > FORMULA_MOST_PAIRS:
        return None
    queries = len(sums) // pairs_per_query
    block_q = max(1, FORMULA_BLOCK_ENTRIES // (block_c * (width or block_c)))
    values, grad_sums = sums.new_empty(queries), torch.empty_like(sums)
    grad_own = torch.empty_like(sums) if own_gradients else grad_sums
    if queries:
        with on_device(sums.device):
            kernel[(triton.cdiv(queries, block_q),)](
                values, grad_sums, grad_own, queries, pairs_per_query, *arguments,
                BLOCK_Q=block_q, BLOCK_C=block_c, **constants,
            )  # fmt: skip
    return values, grad_sums, grad_own if own_gradients else None


def _form_terms(form):
    """Which terms of the kernels' formula h (`FusedForm`) a form has, as the kernels'
    constants: the others are identities for it (x / 1, a clamp at ±inf, + 0, nothing
    beyond δ = inf, a slope floor that no slope is below), left out of the compiled kernel
    rather than computed for every entry; the values and slopes are the same to the bit.
    At most 2^5 variants, whatever the parameters' values."""
    bounded = math.isfinite(form.delta)
    return {
        "DIVIDE": form.temperature != 1.0,
        "CLAMP": math.isfinite(form.limit),
        "BOUNDED": bounded,
        "START": form.start != 0.0,
        "FLOOR": bounded or form.slope_floor > 0.0,
    }


# How the kernels weigh each (query q, reference j): by 1, by a float [queries, references]
# matrix, or by labels: 1 where the query's label differs from the reference's, else 0.
NO_WEIGHTS, WEIGHT_MATRIX, WEIGHTS_BY_LABEL = 0, 1, 2


def _weights_form(weights):
    if weights is None:
        return NO_WEIGHTS
    return WEIGHT_MATRIX if torch.is_tensor(weights) else WEIGHTS_BY_LABEL


def _matrices(scores, weights):
    """The kernels' first arguments: the scores and their row stride, the weight matrix and
    its row stride, the query and reference labels (`_weights_form`; the scores where the
    form reads none, and strides 0)."""
    form = _weights_form(weights)
    matrix = weights if form == WEIGHT_MATRIX else scores
    # The kernels step through the labels one by one: a strided view (a column of a [batch, k]
    # target tensor) read as it is would compare other samples' labels.
    labels, ref_labels = (t.contiguous() for t in weights) if form == WEIGHTS_BY_LABEL else (scores, scores)
    return scores, scores.stride(0), matrix, matrix.stride(0) if form == WEIGHT_MATRIX else 0, labels, ref_labels


def scaled_jacobian(
    scores,
    weights,
    pairs_per_query,
    pair_positive,
    own,
    pair_gradients,
    slopes,
    own_gradients,
    row_scales,
    form,
    scale,
    skip_own,
):
    """[queries, references] rows of `_jacobian_kernel`'s Jacobian, each scaled by its query's
    `row_scales` (the incoming gradient). `pairs_per_query`: c when every query has c pairs,
    else offsets [queries + 1] that delimit each query's pairs; `pair_gradients` G_p (the
    formula's gradient by S_p, times `scale`), `slopes` T_p, and `own_gradients` (what each
    pair's own column gains besides −G_p T_p; None: nothing); with `skip_own`, weight 0 at
    each query's own column (q, q)."""
    out = torch.empty_like(scores)
    uniform = not torch.is_tensor(pairs_per_query)
    if out.numel():
        grid = (scores.shape[0], triton.cdiv(scores.shape[1], REFERENCES_PER_BLOCK))
        with on_device(scores.device):
            _jacobian_kernel[grid](
                *_matrices(scores, weights),
                pair_positive if uniform else pairs_per_query,
                pairs_per_query if uniform else 0,
                pair_positive,
                own,
                pair_gradients,
                slopes,
                pair_gradients if own_gradients is None else own_gradients,
                row_scales.contiguous(),
                out,
                out.stride(0),
                scores.shape[1],
                float(scale),
                *map(float, form),
                **_form_terms(form),
                WEIGHTS=_weights_form(weights),
                SKIP_OWN=skip_own,
                UNIFORM=uniform,
                OWN_GRADIENTS=own_gradients is not None,
                BLOCK_J=REFERENCES_PER_BLOCK,
            )
    return out


if triton is not None:

    @triton.jit
    def _sigmoid(x, temperature, limit, DIVIDE, CLAMP):
        if DIVIDE:
            x = x / temperature
        if CLAMP:
            x = tl.minimum(tl.maximum(x, -limit), limit)
        return 1.0 / (1.0 + tl.exp(-x))

    @triton.jit
    def _slope(x, sigmoid, temperature, delta, rho, slope_floor, DIVIDE, BOUNDED, FLOOR):
        slope = sigmoid - sigmoid * sigmoid
        if DIVIDE:
            slope = slope / temperature
        if BOUNDED:
            slope = tl.where(x > delta, rho, slope)
        if FLOOR:
            slope = tl.where(slope > slope_floor, slope, 0.0)
        return slope

    @triton.jit
    def _value(x, sigmoid, temperature, limit, delta, rho, start, jump, DIVIDE, CLAMP, BOUNDED, START):
        # Beyond δ the sigmoid stops at σ(δ/τ): one exponential per entry serves the value
        # and the slope.
        value = sigmoid
        if BOUNDED:
            value = tl.where(x > delta, _sigmoid(delta, temperature, limit, DIVIDE, CLAMP), value)
        if START:
            value += tl.where(x > 0.0, start, 0.0)
        if BOUNDED:
            value += rho * tl.maximum(x - delta, 0.0)
            value += tl.where(x > delta, jump, 0.0)
        return value

    @triton.jit
    def _sums_step(scores, score_stride, weights, weight_stride, ref_labels, query, query_label, own_score, j,
                   in_pairs, references, scale, temperature, limit, delta, rho, start, jump, slope_floor, DIVIDE,
                   CLAMP, BOUNDED, START, FLOOR, WEIGHTS, SKIP_OWN, WITH_SLOPES, MASKED):  # fmt: skip
        """One step of `_sums_kernel`: the [pairs, references] tiles of weighted values and
        slopes (0 where masked out; the slopes' tile is 0 without `WITH_SLOPES`); `MASKED`
        for a step past the last pair or reference."""
        inside = in_pairs[:, None] & (j < references)[None, :]
        rows = scores + query[:, None] * score_stride + j[None, :]
        s = tl.load(rows, mask=inside, other=0.0) if MASKED else tl.load(rows)
        x = s.to(tl.float32) * scale - own_score[:, None]
        sigmoid = _sigmoid(x, temperature, limit, DIVIDE, CLAMP)
        value = _value(x, sigmoid, temperature, limit, delta, rho, start, jump, DIVIDE, CLAMP, BOUNDED, START)
        w = value  # unused without weights
        if WEIGHTS == 1:
            at = weights + query[:, None] * weight_stride + j[None, :]
            w = (tl.load(at, mask=inside, other=0.0) if MASKED else tl.load(at)).to(tl.float32)
        if WEIGHTS == 2:
            ref_label = tl.load(ref_labels + j, mask=j < references, other=0) if MASKED else tl.load(ref_labels + j)
            w = (ref_label[None, :] != query_label[:, None]).to(tl.float32)
        if WEIGHTS != 0:
            value = value * w
        slope = tl.zeros_like(value)
        if WITH_SLOPES:
            slope = _slope(x, sigmoid, temperature, delta, rho, slope_floor, DIVIDE, BOUNDED, FLOOR)
            if WEIGHTS != 0:
                slope = slope * w
        kept = inside if MASKED else tl.full(value.shape, 1, tl.int1)
        if SKIP_OWN:
            kept = kept & (j[None, :] != query[:, None])
        if MASKED or SKIP_OWN:
            value = tl.where(kept, value, 0.0)
            slope = tl.where(kept, slope, 0.0)
        return value, slope

    @triton.jit
    def _sums_kernel(
        scores,
        score_stride,
        weights,
        weight_stride,
        labels,
        ref_labels,
        pair_query,
        pair_positive,
        own,
        sums,
        slopes,
        pairs,
        references,
        scale,
        temperature,
        limit,
        delta,
        rho,
        start,
        jump,
        slope_floor,
        DIVIDE: tl.constexpr,
        CLAMP: tl.constexpr,
        BOUNDED: tl.constexpr,
        START: tl.constexpr,
        FLOOR: tl.constexpr,
        WEIGHTS: tl.constexpr,
        SKIP_OWN: tl.constexpr,
        WITH_SLOPES: tl.constexpr,
        BLOCK_P: tl.constexpr,
        BLOCK_J: tl.constexpr,
    ):
        p = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
        in_pairs = p < pairs
        query = tl.load(pair_query + p, mask=in_pairs, other=0).to(tl.int64)
        positive = tl.load(pair_positive + p, mask=in_pairs, other=0).to(tl.int64)
        own_score = tl.load(scores + query * score_stride + positive, mask=in_pairs, other=0.0).to(tl.float32) * scale
        tl.store(own + p, own_score, mask=in_pairs)
        query_label = query  # unused unless the weights are by label
        if WEIGHTS == 2:
            query_label = tl.load(labels + query, mask=in_pairs, other=0)
        # Each entry of the tile sums its own references, the tile is summed once at the end:
        # a sum across the tile's threads at every step took most of a step's instructions.
        total = tl.zeros([BLOCK_P, BLOCK_J], dtype=tl.float32)
        total_slope = tl.zeros([BLOCK_P, BLOCK_J], dtype=tl.float32)
        # Whole steps read without masks (a pair beyond the last reads row 0, and is not
        # stored), the last step's partial tile with them: masks took a fifth of a step.
        whole = references - references % BLOCK_J
        for first in range(0, whole, BLOCK_J):
            value, slope = _sums_step(
                scores, score_stride, weights, weight_stride, ref_labels, query, query_label, own_score,
                first + tl.arange(0, BLOCK_J), in_pairs, references, scale, temperature, limit, delta, rho,
                start, jump, slope_floor, DIVIDE, CLAMP, BOUNDED, START, FLOOR, WEIGHTS, SKIP_OWN,
                WITH_SLOPES, False,
            )  # fmt: skip
            total += value
            total_slope += slope
        if whole < references:
            value, slope = _sums_step(
                scores, score_stride, weights, weight_stride, ref_labels, query, query_label, own_score,
                whole + tl.arange(0, BLOCK_J), in_pairs, references, scale, temperature, limit, delta, rho,
                start, jump, slope_floor, DIVIDE, CLAMP, BOUNDED, START, FLOOR, WEIGHTS, SKIP_OWN,
                WITH_SLOPES, True,
            )  # fmt: skip
            total += value
            total_slope += slope
        tl.store(sums + p, tl.sum(total, axis=1), mask=in_pairs)
        if WITH_SLOPES:
            tl.store(slopes + p, tl.sum(total_slope, axis=1), mask=in_pairs)

    @triton.jit
    def _jacobian_kernel(
        scores,
        score_stride,
        weights,
        weight_stride,
        labels,
        ref_labels,
        pair_offsets,
        pairs_per_query,
        pair_positive,
        own,
        pair_gradients,
        slopes,
        own_gradients,
        row_scales,
        out,
        out_stride,
        references,
        scale,
        temperature,
        limit,
        delta,
        rho,
        start,
        jump,
        slope_floor,
        DIVIDE: tl.constexpr,
        CLAMP: tl.constexpr,
        BOUNDED: tl.constexpr,
        START: tl.constexpr,
        FLOOR: tl.constexpr,
        WEIGHTS: tl.constexpr,
        SKIP_OWN: tl.constexpr,
        UNIFORM: tl.constexpr,
        OWN_GRADIENTS: tl.constexpr,
        BLOCK_J: tl.constexpr,
    ):
        query = tl.program_id(0).to(tl.int64)
        j = tl.program_id(1) * BLOCK_J + tl.arange(0, BLOCK_J)
        inside = j < references
        scaled = tl.load(scores + query * score_stride + j, mask=inside, other=0.0).to(tl.float32) * scale
        through_sums = tl.zeros([BLOCK_J], dtype=tl.float32)
        own_columns = tl.zeros([BLOCK_J], dtype=tl.float32)
        if UNIFORM:
            first = query * pairs_per_query
            last = first + pairs_per_query
        else:
            first = tl.load(pair_offsets + query)
            last = tl.load(pair_offsets + query + 1)
        for p in range(first, last):
            x = scaled - tl.load(own + p)
            sigmoid = _sigmoid(x, temperature, limit, DIVIDE, CLAMP)
            slope = _slope(x, sigmoid, temperature, delta, rho, slope_floor, DIVIDE, BOUNDED, FLOOR)
            gradient = tl.load(pair_gradients + p)
            through_sums += gradient * slope
            # dS_p moves s_qi by minus the sum of its slopes: T_p · scale (in G_p).
            own_column = -gradient * tl.load(slopes + p)
            if OWN_GRADIENTS:
                own_column += tl.load(own_gradients + p)
            own_columns += tl.where(j == tl.load(pair_positive + p), own_column, 0.0)
        if WEIGHTS == 1:
            weight = tl.load(weights + query * weight_stride + j, mask=inside, other=0.0)
            through_sums = through_sums * weight.to(tl.float32)
        if WEIGHTS == 2:
            ref_label = tl.load(ref_labels + j, mask=inside, other=0)
            through_sums = tl.where(ref_label != tl.load(labels + query), through_sums, 0.0)
        if SKIP_OWN:
            through_sums = tl.where(j == query, 0.0, through_sums)
        row = (through_sums + own_columns) * tl.load(row_scales + query)
        tl.store(out + query * out_stride + j, row, mask=inside)
