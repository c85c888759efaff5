"""The relaxed rank shared by Smooth-AP, Recall@k, SupAP (ROADMAP) and PNP
(`RelaxedRanks`): a kernel of score differences summed over each (query, positive)'s
references, in panels of (query, positive) pairs sized for the device.

Queries with the same number of positives c are cut into panels of r queries, so that
a panel's work is one broadcast [r, c, references] tensor: on the CPU it stays in cache
while a few elementwise passes and reductions go over it (passes over whole similarity
matrices would go through memory instead); on an accelerator a call is a few large
panels (`pml_rank._device_policy`). On CUDA, float32 sums go through two Triton kernels
instead (`fused_ranks`), which these panels are the reference for.

Each query's loss depends on its own row of scores only, so its gradient with respect
to that row (its row of the Jacobian) can be computed in the forward pass, panel by
panel, while the kernel's values are in cache; the backward pass then only scales each
row by the incoming gradient, in place. One similarity matrix of memory instead of a
second pass over every kernel value. The boolean-mask helpers below avoid PyTorch's
slow paths for boolean tensors.
"""

from typing import NamedTuple

import torch
from torch.autograd.function import once_differentiable

from .. import _device_policy as policy
from ..ranking import true_indices
from . import fused_ranks


def panel_elements(device, num_queries, num_references):
    """Entries of one panel of a [queries, positives, references] tensor on `device`
    (`policy.work_budget`), on the CPU never more than one similarity matrix."""
    matrix = num_queries * num_references
    budget = policy.work_budget(device, matrix)
    return min(budget, matrix) if policy.sized_for(device) == "cache" else budget


def mask_weights(mask, dtype):
    """A boolean mask as 1 and 0 of `dtype`: multiplying by it leaves the kept entries as they
    are and zeroes the others (finite ones), several times faster than `masked_fill_` with a
    boolean mask; converted through bytes, as booleans convert several times slower."""
    return mask.view(torch.uint8).to(dtype)


def row_counts(mask):
    """int32 number of True entries in each row of a boolean matrix. Sums bytes a block
    of rows at a time: `sum` on booleans first copies the whole matrix to int64, and on
    bytes to int32 (a fresh matrix of 4 or 8 bytes per entry: page faults, about 20
    times slower at batch 2048). One block on an accelerator (`policy.sized_for`)."""
    rows = mask.view(torch.uint8)
    step = max(1, panel_elements(mask.device, *rows.shape) // max(1, rows.shape[1]))
    return torch.cat([block.sum(1, dtype=torch.int32) for block in rows.split(step)])


def any_per_row(mask):
    """Whether each row of a boolean matrix has a True entry, as a byte maximum
    (`Tensor.any` on booleans is not vectorised: about 30 times slower at batch 2048)."""
    return mask.view(torch.uint8).amax(1).bool()


def is_all_true(mask):
    """Whether every entry of a boolean tensor is True, as a byte minimum (`Tensor.all`
    on booleans is not vectorised: about 30 times slower at batch 2048)."""
    return mask.numel() == 0 or bool(mask.view(torch.uint8).amin())


def true_rows(mask, count, device=None):
    """The indices of the True entries of a boolean vector with `count` of them (known
    already): an arange (on `device` when `mask` is None, all True) when all are, without
    the `nonzero` that makes a GPU's host wait (`ranking.true_indices` otherwise)."""
    if mask is None or count == len(mask):
        return torch.arange(count, device=device if mask is None else mask.device)
    return true_indices(mask, count)[0]


def queries_in_range(per_query, fewest, most=None, extremes=None):
    """The queries with `fewest` to `most` (None: any number of) pairs, from their numbers
    of pairs `per_query`: a boolean per query (None when all are in range), how many are,
    and c when all are, with c pairs each (else None). One read-back of the extremes
    (unless given as `extremes`, ``(fewest, most)`` of `per_query`), made before the
    similarity product is queued so that it does not wait for the product (and the relaxed
    ranks need not ask the device again, `relaxed_ranks`' ``pairs_per_query``); a second
    only when a query is out of range."""
    if len(per_query) == 0:
        return None, 0, None
    low, high = extremes or torch.stack(torch.aminmax(per_query)).tolist()
    if low >= fewest and (most is None or high <= most):
        return None, len(per_query), high if low == high else None
    kept = per_query >= fewest
    if most is not None:
        kept &= per_query <= most
    return kept, int(kept.sum()), None


def true_entries(mask):
    """``mask.nonzero(as_tuple=True)`` of a boolean matrix: rows and columns of its True
    entries in row-major order. On the CPU (`policy.sized_for`) a sparse mask is scanned
    eight bytes at a time (as int64 words), then only the nonzero words byte by byte: about
    6 times faster than `nonzero` at batch 2048; on an accelerator, one `nonzero`."""
    rows, columns = mask.shape
    if (
        policy.sized_for(mask.device) != "cache"
        or columns % 8
        or mask.stride() != (columns, 1)
        or mask.storage_offset() % 8
    ):
        return mask.nonzero(as_tuple=True)
    word_rows, word_columns = mask.view(torch.int64).nonzero(as_tuple=True)
    word, byte = mask.view(rows, columns // 8, 8)[word_rows, word_columns].nonzero(as_tuple=True)
    return word_rows[word], word_columns[word] * 8 + byte


def occurrences(indices, length):
    """How often each of 0 .. `length` − 1 occurs in `indices` (int64): ``bincount`` with
    ``minlength=length`` for indices known to be in range, without its read-back of their
    extremes (on a GPU, a wait). On MPS, whose int64 ``index_add_`` failed before torch 2.9,
    ``bincount`` itself."""
    if indices.device.type == "mps":
        return torch.bincount(indices, minlength=length)
    counts = torch.zeros(length, dtype=torch.int64, device=indices.device)
    return counts.index_add_(0, indices, torch.ones_like(indices))


def query_panels(pair_query, num_queries, num_references, elements=None, slices=True, per_query=None):
    """The pairs (`pair_query`: their queries, sorted) in panels of queries with equally
    many pairs c: a list of ``(queries, pairs)``, where `queries` selects the panel's r
    queries from a [queries, ...] tensor (a slice when they are consecutive, else an
    index tensor) and `pairs` [r, c] holds the indices of each query's pairs, in order.
    Every query with pairs is in exactly one panel. A panel's c · r · `num_references`
    entries are at most `elements` (default `panel_elements` for the pairs' device) or,
    when one query's c · `num_references` are more, that. The host waits for the device
    three times (`bincount`'s size, two read-backs), whatever the number of panels and of
    distinct counts; twice without `slices` (every `queries` an index tensor: the read-back
    of the counts' first and last queries is what finds the slices). `per_query`:
    ``occurrences(pair_query, num_queries)``, when the caller has it."""
    if elements is None:
        elements = panel_elements(pair_query.device, num_queries, num_references)
    if per_query is None:
        per_query = occurrences(pair_query, num_queries)
    per_pair = per_query[pair_query]
    queries_with = torch.bincount(per_query).tolist()  # how many queries have c pairs, for every c
    # The pairs ordered by their query's count, stably: each count's pairs are one run, its
    # queries' pairs in order (where a nonzero per count would wait for the device each).
    order = torch.argsort(per_pair, stable=True)
    by_count, start = [], 0
    for count, how_many in enumerate(queries_with):
        if count and how_many:
            pairs = order[start : start + count * how_many].view(how_many, count)
            by_count.append((pairs, pair_query[pairs[:, 0]]))
            start += count * how_many
    ends = [(None, None)] * len(by_count)
    if slices and by_count:  # the first and last query of each count, in one transfer
        ends = torch.stack([end for _, queries in by_count for end in (queries[0], queries[-1])]).view(-1, 2).tolist()
    panels = []
    for (pairs, queries), (first, last) in zip(by_count, ends):
        consecutive = slices and last - first + 1 == len(queries)
        step = max(1, elements // (pairs.shape[1] * max(1, num_references)))
        for start in range(0, len(queries), step):
            stop = min(start + step, len(queries))
            panels.append(
                (slice(first + start, first + stop) if consecutive else queries[start:stop], pairs[start:stop])
            )
    return panels


def jacobian_buffer(scores, per_query):
    """An uninitialised matrix like `scores` for the rows of a Jacobian that the panels
    write, with zeros in the rows of the queries without pairs (`per_query`: each row's
    number of pairs; a fill of the whole matrix would be one more pass over it)."""
    jacobian = torch.empty_like(scores)
    without_pairs = per_query == 0
    if bool(without_pairs.any()):
        jacobian[without_pairs] = 0
    return jacobian


def left_out_of(positive, negative):
    """The pairs in neither mask, left out of each query's ranking, as a boolean mask
    (`left_out_filled_`'s form for many pairs); None when every pair is in one."""
    ranked = positive | negative
    return None if is_all_true(ranked) else ranked.logical_not_()


class LabelWeights(NamedTuple):
    """`RelaxedRanks`'s weights w_qj = 1 where ``labels[q] != ref_labels[j]``, else 0: a
    ranking by labels over the negatives alone, without a [queries, references] matrix of
    weights (the fused kernels compare the labels themselves; the panels build a panel's
    rows at a time)."""

    labels: torch.Tensor
    ref_labels: torch.Tensor

    def rows(self, queries, dtype):
        """The weights of the rows of `queries` (a slice or indices), as a float matrix."""
        return mask_weights(self.labels[queries].unsqueeze(1) != self.ref_labels.unsqueeze(0), dtype)


class OwnColumns(tuple):
    """``(queries, queries)``: each query's own column (q, q), in `left_out_filled_`'s index
    form, known to be no more than that: the fused kernels skip these columns themselves
    instead of reading a [queries, references] matrix of weights with zeros there."""


def own_columns(num_queries, device):
    """Each query's own column, (q, q) for every query q (`OwnColumns`): what a ranking by
    labels leaves out when the references are the batch."""
    return OwnColumns((torch.arange(num_queries, device=device),) * 2)


def left_out_per_query(left_out, num_queries):
    """How many pairs `left_out` (in any of `left_out_filled_`'s forms) takes from each
    query's ranking."""
    if left_out is None:
        return 0
    if isinstance(left_out, OwnColumns):
        return 1
    if torch.is_tensor(left_out):
        return row_counts(left_out)
    return occurrences(left_out[0], num_queries)


def left_out_by_panel(left_out, panels, num_queries):
    """`left_out` (None, a boolean [queries, references] mask, or the (query, reference)
    indices of a few left-out pairs) as `left_out_filled_` takes it for each panel of
    `panels` (`query_panels`): indices become each panel's own (row in the panel,
    reference), found for every panel at once (the host waits once)."""
    if left_out is None or torch.is_tensor(left_out):
        return [left_out] * len(panels)
    at_query, at_reference = left_out
    # Each query's panel (len(panels): none) and row in it.
    panel_of = at_query.new_full((num_queries,), len(panels))
    row_in_panel = torch.zeros_like(panel_of)
    for index, (queries, pairs) in enumerate(panels):
        panel_of[queries] = index
        row_in_panel[queries] = torch.arange(len(pairs), device=at_query.device)
    pair_panel = panel_of[at_query]
    order = torch.argsort(pair_panel, stable=True)
    sizes = occurrences(pair_panel, len(panels) + 1).tolist()
    rows = row_in_panel[at_query[order]].split(sizes)
    return list(zip(rows, at_reference[order].split(sizes)))[: len(panels)]


def left_out_filled_(rows, queries, left_out):
    """`rows`, the [r, references] rows of `queries` (a slice or indices), with −inf at
    the pairs left out of each query's ranking, in place. `left_out`: None (no pair is),
    a boolean [queries, references] mask, or the (row in `rows`, reference) indices of a
    few left-out pairs (`left_out_by_panel`), written by index: a pass over a boolean
    mask costs several times more (76 against 15 µs for 128 x 2048 rows)."""
    if left_out is None:
        return rows
    if torch.is_tensor(left_out):
        return rows.masked_fill_(left_out[queries], -torch.inf)
    rows[left_out] = -torch.inf
    return rows


def panel_buffer(like, panels, num_references):
    """One uninitialised tensor, like `like`, large enough for the largest panel's
    [r, c, references] entries: reused by every panel through `differences`, since a
    fresh tensor of a megabyte per operation costs more (allocation, page faults) than
    the arithmetic that fills it."""
    return like.new_empty(max((pairs.numel() for _, pairs in panels), default=0) * num_references)


def differences(scaled_rows, own, buffer=None):
    """[r, c, references] tensor of ``scaled_rows[q, j] − own[q, i]``: each reference's
    scaled score minus that of each of the query's c positives, written into the start
    of `buffer` when given."""
    shape = (*own.shape, scaled_rows.shape[1])
    out = None if buffer is None else buffer[: own.numel() * scaled_rows.shape[1]].view(shape)
    return torch.sub(scaled_rows.unsqueeze(1), own.unsqueeze(2), out=out)


class RelaxedRanks(torch.autograd.Function):
    """The relaxed rank that Smooth-AP, Recall@k, SupAP and PNP share, with its one
    backward. For each (query q, positive i) pair (`pair_query`, `pair_positive`:
    row-major, sorted by query), a kernel h summed over q's references j:

        S_qi = Σ_j w_qj h(x_qij),      x_qij = scale · (s_qj − s_qi),

    where w_qj is 0 at the pairs `left_out` of q's ranking (see `left_out_filled_`: x is
    −inf there, where h and its slope must vanish) and else `weights[q, j]` (a float
    [queries, references] matrix, `LabelWeights`, or 1 when None). Each query's value is
    ``formula(S, own, queries)`` of its sums and its own scaled scores scale · s_qi, for
    the r queries of a panel with c pairs each ([r, c] tensors; `queries` selects theirs
    from per-query tensors); 0 for a query without pairs; a formula may carry its own
    derivative (`formula_and_gradients`). `kernel.value(x)` gives h and
    `kernel.slope(x, values)` h' (both free to overwrite their arguments).

    Each value depends on its query's row of scores only, so the forward pass computes
    the row's gradient (its row of the Jacobian) panel by panel while the kernel's values
    are in cache (`query_panels`), the formula's part from its own derivative or by
    autograd on the small [r, c] tensors; the backward pass scales each row by the
    incoming gradient, in place. The fused kernels (`fused_ranks`) instead keep the
    formula's gradients by pair and compute the scaled rows in the backward pass, in one
    kernel."""

    @staticmethod
    def forward(ctx, scores, pair_query, pair_positive, ranking):
        values, ctx.gradient = _values_and_gradient(scores, pair_query, pair_positive, ranking, ctx.needs_input_grad[0])
        ctx.save_for_backward(scores, pair_query, pair_positive)
        ctx.ranking = ranking
        return values

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_values):
        gradient, ctx.gradient = ctx.gradient, None
        if gradient is None:  # a second backward pass through the graph (retain_graph=True)
            _, gradient = _values_and_gradient(*ctx.saved_tensors, ctx.ranking, True)
        return gradient(grad_values), None, None, None


class Ranking(NamedTuple):
    """What `RelaxedRanks` sums and what it makes of the sums (see there)."""

    kernel: object
    formula: object
    scale: float = 1.0
    left_out: object = None
    weights: torch.Tensor | None = None
    pairs_per_query: int | None = None


def relaxed_ranks(
    scores, pair_query, pair_positive, kernel, formula, scale=1.0, left_out=None, weights=None, pairs_per_query=None
):
    """Each query's ``formula`` value over its relaxed ranks: `RelaxedRanks`. `pairs_per_query`:
    c when the caller has counted c pairs for every query (the fused kernels then read no
    count back from the device, where the caller's count could wait before the similarity
    product instead of after it)."""
    if pairs_per_query is not None and len(pair_query) != pairs_per_query * len(scores):
        raise ValueError(f"relaxed_ranks: {len(pair_query)} pairs are not {pairs_per_query} for each of {len(scores)}")
    ranking = Ranking(kernel, formula, scale, left_out, weights, pairs_per_query)
    return RelaxedRanks.apply(scores, pair_query, pair_positive, ranking)


def formula_and_gradients(formula, sums, own, queries, scale=1.0):
    """A formula's values [r] and `scale` times their gradients with respect to `sums` and
    `own` (each [r, c], or None for no dependence; fresh tensors): its own
    ``formula.gradients(sums, own, queries, scale)`` when it has one (the same three, the
    scale folded into its factors), else autograd on the [r, c] tensors. Autograd's graph
    costs about 250 µs a panel on the CPU, a hand-written derivative a few elementwise
    operations on tensors this small."""
    gradients = getattr(formula, "gradients", None)
    if gradients is not None:
        return gradients(sums, own, queries, scale)
    with torch.enable_grad():
        sums.requires_grad_()
        own.requires_grad_()
        value = formula(sums, own, queries)
        grad_sums, grad_own = torch.autograd.grad(value, (sums, own), torch.ones_like(value), allow_unused=True)
    if scale != 1:
        grad_sums, grad_own = (None if g is None else g.mul_(scale) for g in (grad_sums, grad_own))
    return value.detach(), grad_sums, grad_own


def _values_and_gradient(scores, pair_query, pair_positive, ranking, with_gradient):
    """`RelaxedRanks`'s value per query and, when asked, the function that takes the
    incoming gradient of the values to that of `scores` (else None): rows of the
    [queries, references] Jacobian, each query's with respect to its row of `scores`,
    scaled by the query's gradient (once: it may scale the Jacobian in place)."""
    # The sums and the Jacobian in the input's precision: autocast would take the matrix
    # products to half precision.
    with torch.autocast(scores.device.type, enabled=False):
        if fused_ranks.applies(scores, ranking.kernel):
            return _fused(scores, pair_query, pair_positive, *ranking, with_gradient)
        values, jacobian = _panel_by_panel(scores, pair_query, pair_positive, *ranking, with_gradient)
    if jacobian is None:
        return values, None
    return values, lambda grad_values: jacobian.mul_(grad_values.unsqueeze(1))


def _fused(
    scores, pair_query, pair_positive, kernel, formula, scale, left_out, weights, pairs_per_query, with_gradient
):
    """`_values_and_gradient` from `fused_ranks`' two kernels, with the formula applied once
    per group of queries with equally many pairs; the Jacobian kernel runs in the backward
    pass, on the incoming gradient (no Jacobian is kept between the passes)."""
    scores = scores if scores.stride(1) == 1 else scores.contiguous()
    skip_own = isinstance(left_out, OwnColumns)
    weights = _weights_with(None if skip_own else left_out, weights, scores)
    if torch.is_tensor(weights) and weights.stride(1) != 1:
        weights = weights.contiguous()
    # The groups' sizes, read back (unless the caller counted them) before the sums kernel is
    # queued: the host then queues the formula's operations while the device sums (at batch
    # 8192, a millisecond).
    if pairs_per_query:
        per_query, uniform, most = None, True, pairs_per_query
    else:
        per_query = occurrences(pair_query, len(scores))
        fewest, most = torch.stack(torch.aminmax(per_query)).tolist()
        uniform = fewest == most > 0
    if not uniform:
        # One group per number of pairs c, whatever its size: the formula's [r, c] tensors are small.
        elements = scores.numel() * max(1, len(pair_query))
        groups = query_panels(pair_query, *scores.shape, elements=elements, slices=False, per_query=per_query)
    sums, slopes, own = fused_ranks.pair_sums(
        scores, weights, pair_query, pair_positive, kernel.fused, scale, with_gradient, skip_own
    )
    if not with_gradient:
        if uniform:
            return formula(sums.view(-1, most), own.view(-1, most), slice(0, len(scores))), None
        values = sums.new_zeros(len(scores))
        for queries, pairs in groups:
            values[queries] = formula(sums[pairs], own[pairs], queries)
        return values, None
    if uniform:
        # Every query has c pairs, in order: the group is [queries, c] views, no gathers; a
        # formula with a kernel of its own computes it in one launch.
        fused_gradients = getattr(formula, "fused_gradients", None)
        computed = fused_gradients and fused_gradients(sums, own, most, scale)
        if computed:
            values, pair_gradients, own_gradients = computed
        else:
            values, pair_gradients, own_gradients = formula_and_gradients(
                formula, sums.view(-1, most), own.view(-1, most), slice(0, len(scores)), scale
            )
        pair_gradients = pair_gradients.view(-1)
        own_gradients = None if own_gradients is None else own_gradients.view(-1)
        query_pairs = most  # each query's pairs, for the Jacobian kernel: c of them in order
    else:
        values = sums.new_zeros(len(scores))
        pair_gradients, own_gradients = torch.empty_like(sums), None
        for queries, pairs in groups:
            values[queries], grad_sums, grad_own = formula_and_gradients(
                formula, sums[pairs], own[pairs], queries, scale
            )
            pair_gradients[pairs] = grad_sums
            if grad_own is not None:
                own_gradients = torch.zeros_like(sums) if own_gradients is None else own_gradients
                own_gradients[pairs] = grad_own
        # Each query's pairs: delimited by offsets.
        query_pairs = torch.zeros(len(scores) + 1, dtype=pair_query.dtype, device=scores.device)
        torch.cumsum(per_query, 0, out=query_pairs[1:])

    def gradient(grad_values):
        return fused_ranks.scaled_jacobian(
            scores,
            weights,
            query_pairs,
            pair_positive,
            own,
            pair_gradients,
            slopes,
            own_gradients,
            grad_values,
            kernel.fused,
            scale,
            skip_own,
        )

    return values, gradient


def _weights_with(left_out, weights, scores):
    """`weights` (None: all 1) with 0 at the pairs `left_out` of each ranking (None, a
    boolean mask or indices, as `left_out_filled_` takes them): the fused kernels' form of
    the panels' −inf; None when both are None."""
    if left_out is None:
        return weights
    if isinstance(weights, LabelWeights):
        weights = weights.rows(slice(None), scores.dtype)
    if torch.is_tensor(left_out):
        kept = mask_weights(left_out.logical_not(), scores.dtype)
    else:
        kept = torch.ones_like(scores)
        kept[left_out] = 0
    return kept if weights is None else kept.mul_(weights)


def _weights_of_rows(weights, queries, dtype):
    """The [r, references] weights of the rows of `queries`; None for all 1."""
    if weights is None:
        return None
    return weights.rows(queries, dtype) if isinstance(weights, LabelWeights) else weights[queries]


def _panel_by_panel(
    scores, pair_query, pair_positive, kernel, formula, scale, left_out, weights, pairs_per_query, with_jacobian
):
    own = scores[pair_query, pair_positive]
    if scale != 1:
        own = own * scale
    values = scores.new_zeros(len(scores))
    per_query = occurrences(pair_query, len(scores))
    jacobian = jacobian_buffer(scores, per_query) if with_jacobian else None
    panels = query_panels(pair_query, *scores.shape, per_query=per_query)
    buffer = panel_buffer(scores, panels, scores.shape[1])
    # On the CPU a panel whose gradient moves few pairs takes only their slopes (a host
    # wait per panel); on an accelerator every panel takes the same dense kernels.
    may_skip = policy.sized_for(scores.device) == "cache"
    for (queries, pairs), panel_left_out in zip(panels, left_out_by_panel(left_out, panels, len(scores))):
        rows = scores[queries]
        if scale != 1:
            rows = rows * scale
        elif panel_left_out is not None:
            rows = rows.clone()
        rows = left_out_filled_(rows, queries, panel_left_out)
        panel_own = own[pairs]
        x = differences(rows, panel_own, buffer)
        kernel_values = kernel.value(x)
        panel_weights = _weights_of_rows(weights, queries, scores.dtype)
        if panel_weights is None:
            sums = kernel_values.sum(2)
        else:
            sums = torch.bmm(kernel_values, panel_weights.unsqueeze(2)).squeeze(2)
        if jacobian is None:
            values[queries] = formula(sums, panel_own, queries)
            continue
        value, grad_sums, grad_own = formula_and_gradients(formula, sums, panel_own, queries, scale)
        values[queries] = value
        positive_columns = pair_positive[pairs]
        # dS_qi moves s_qj by w_qj h'(x_qij) · scale and s_qi by minus the sum over j.
        active = None
        if may_skip:
            active = grad_sums.nonzero(as_tuple=True)
            if 2 * len(active[0]) > grad_sums.numel():
                active = None
        if active is None:
            slopes = kernel.slope(x, kernel_values)
            if isinstance(queries, slice):
                target = jacobian[queries]
                torch.bmm(grad_sums.unsqueeze(1), slopes, out=target.unsqueeze(1))
            else:
                target = torch.bmm(grad_sums.unsqueeze(1), slopes).squeeze(1)
            per_pair = (
                slopes.sum(2) if panel_weights is None else torch.bmm(slopes, panel_weights.unsqueeze(2)).squeeze(2)
            )
            if panel_weights is not None:
                target.mul_(panel_weights)
            own_column = per_pair.mul_(grad_sums).neg_()
        else:
            # Few pairs move (Recall@k's ranks far from every k): their slopes only.
            row, column = active
            if isinstance(queries, slice):
                target = jacobian[queries].zero_()
            else:
                target = scores.new_zeros(len(pairs), scores.shape[1])
            gathered = kernel_values[row, column]
            slopes = kernel.slope(gathered if x is kernel_values else x[row, column], gathered)
            slopes.mul_(grad_sums[row, column].unsqueeze(1))
            if panel_weights is not None:
                slopes.mul_(panel_weights[row])
            target.index_add_(0, row, slopes)
            own_column = torch.zeros_like(grad_sums).index_put_((row, column), slopes.sum(1).neg_())
        if grad_own is not None:
            own_column.add_(grad_own)
        target.scatter_add_(1, positive_columns, own_column)
        if not isinstance(queries, slice):
            jacobian[queries] = target
    return values, jacobian
