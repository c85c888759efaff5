import contextlib
import functools
import math
import operator
from typing import NamedTuple

import torch
from pytorch_metric_learning.distances import BaseDistance, CosineSimilarity, DotProductSimilarity, LpDistance
from pytorch_metric_learning.losses import BaseMetricLossFunction
from pytorch_metric_learning.reducers import BaseReducer, MultipleReducers
from pytorch_metric_learning.regularizers import BaseRegularizer
from pytorch_metric_learning.utils import loss_and_miner_utils as lmu
from torch.autograd.function import once_differentiable

from .. import _device_policy
from .._checks import check_embeddings, check_references, checked_constructor
from . import fused_label_pairs, fused_ranks, fused_unit_rows
from .query_panels import occurrences, queries_in_range, true_rows

HALF_PRECISION = (torch.float16, torch.bfloat16)
# The score magnitudes up to which a `finite_for_bounded_scores` loss is not read back: 2^20 stays
# finite in float32 through any formula's scaling (a temperature of 1e-30 included), 2^10 far below
# float16's largest number (65504) for a float16 product under autocast.
_UNCHECKED_SCORE = {None: 2.0**20, torch.float16: 2.0**10}


@checked_constructor
class RankLossBase(BaseMetricLossFunction):
    """Base of pml-rank's losses: PML's `BaseMetricLossFunction` that first rejects bad input with
    an error naming the loss and the offending value, so that a NaN never travels silently into
    training (and, where the inputs' scale could make it overflow, checks the loss it returns:
    `_may_overflow`), and computes in float32 whatever the input's dtype and whether
    `torch.autocast` is on: float16/bfloat16 input is upcast and autocast is switched off
    inside the loss, so counts, ranks and sums are float32 and the loss is a float32 number (in
    bfloat16, 256 + 1 = 256). Only the similarity matrix's product (`similarity_matrix`) runs
    in the caller's autocast precision, on the tensor cores, its result upcast to float32 (or
    read as it is by kernels that convert each score to float32 as they load it: the relaxed
    ranks', ROADMAP's calibration's and AUC's hardest pairs' on a GPU, and in float16
    FastAP's): its rounding is all the loss inherits from half precision. The gradient flows
    back in the input's dtype. PML's `c_f.to_dtype` is a no-op under autocast, so PML's own
    losses leave this to each loss. A batch without rows, or without references, gives PML's
    zero loss.

    Every constructor argument of a subclass is checked against the annotations of its
    ``__init__`` (``step: float = 0.005``), which every parameter must have, before any
    work: see `pml_rank._checks.checked_constructor`. The keywords below are PML's."""

    def __init__(
        self,
        distance: BaseDistance | None = None,
        reducer: BaseReducer | None = None,
        embedding_regularizer: BaseRegularizer | None = None,
        embedding_reg_weight: float = 1,
        collect_stats: bool | None = None,
    ):
        super().__init__(
            distance=distance,
            reducer=reducer,
            embedding_regularizer=embedding_regularizer,
            embedding_reg_weight=embedding_reg_weight,
            collect_stats=collect_stats,
        )

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "__init__" in cls.__dict__:
            checked_constructor(cls)

    def set_reducer(self, reducer):
        if reducer is None and isinstance(default := self.get_default_reducer(), MultipleReducers):
            # A default made for the sub-losses themselves (ROADMAP's): PML would give each
            # sub-loss a copy of it, nesting a MultipleReducers in another.
            reducer = default
        super().set_reducer(reducer)
        built = self.reducer
        if type(built) is MultipleReducers and built is not reducer:
            # PML's for a loss with several sub-losses (an embedding regularizer's, too).
            self.reducer = SumOfReducers(dict(built.reducers), built.default_reducer)

    #: Whether every finite score no larger than `_UNCHECKED_SCORE` (in magnitude) gives this loss
    #: a finite value, for any parameters it accepts: then, where the embeddings' magnitudes bound
    #: the scores below it, the loss is not read back to be checked (`_may_overflow`). Each of
    #: pml-rank's losses says so (sigmoids, softplus, shifted log-sum-exp, ranks, histograms); a
    #: subclass that does not is always checked.
    finite_for_bounded_scores = False

    def forward(self, embeddings, labels=None, indices_tuple=None, ref_emb=None, ref_labels=None):
        magnitudes = check_embeddings(self, embeddings=embeddings, ref_emb=ref_emb)
        self.distance.check_shapes(embeddings, ref_emb)
        check_references(self, labels, ref_emb, ref_labels)
        if len(embeddings) == 0 or (ref_emb is not None and len(ref_emb) == 0):
            self.reset_stats()
            return self.reducer(self.zero_losses(), embeddings, labels)
        same = ref_emb is embeddings
        embeddings = _at_least_float32(embeddings)
        ref_emb = embeddings if same else _at_least_float32(ref_emb)
        self.autocast_dtype = product_dtype = autocast_dtype(embeddings.device)
        try:
            with autocast_off(embeddings.device):
                loss = super().forward(embeddings, labels, indices_tuple, ref_emb, ref_labels)
        finally:
            self.autocast_dtype = None
        may_overflow = self._may_overflow(magnitudes, embeddings.shape[-1], product_dtype)
        if torch.is_tensor(loss) and may_overflow and not math.isfinite(loss.item()):  # one read-back, no kernel
            # Inputs were finite, so only their scale can have done this (1e20-norm rows).
            norms = [t.double().norm(dim=-1).max().item() for t in (embeddings, ref_emb) if t is not None and t.numel()]
            raise ValueError(
                f"{type(self).__name__}: the loss overflowed to {loss.item()} although the "
                f"embeddings are finite; their largest norm is {max(norms):.3g}. "
                "Normalise or rescale the embeddings."
            )
        return loss

    def _may_overflow(self, magnitudes, dim, product_dtype):
        """Whether the loss must be read back to be checked: unless it is `finite_for_bounded_scores`
        and scores of PML's dot-product and 2-norm distances between rows of `dim` entries at most
        `magnitudes` (`check_embeddings`) stay below `_UNCHECKED_SCORE` (1024 for a float16
        product): a GPU waits at a read-back for the forward pass to finish before the host can
        queue the backward pass (about 0.5 ms of a 3-ms call at batch 8192 under autocast on an H200)."""
        distance = self.distance
        known = type(distance) in (DotProductSimilarity, CosineSimilarity, LpDistance)
        if not (self.finite_for_bounded_scores and known and distance.p == 2 and distance.power in (1, 2)):
            return True
        if distance.normalize_embeddings and self.embedding_regularizer is None:
            bound = 4.0  # unit rows: |dot| <= 1, |a - b|^2 <= 4
        else:  # |dot| <= dim m m', |a - b|^2 <= dim (m + m')^2, |a - b| <= max(that, 1); a regularizer reads them raw
            largest = list(magnitudes.values())
            bound = max(dim * (largest[0] + largest[-1]) ** 2, 1.0)
        return not bound <= _UNCHECKED_SCORE.get(product_dtype, _UNCHECKED_SCORE[None])

    def similarity_matrix(self, embeddings, ref_emb, half=False):
        """``self.distance(embeddings, ref_emb)``, in float32. Under the caller's autocast
        its matrix product runs in the autocast precision and only the result is upcast
        (with `half`, not where the relaxed ranks' kernels read it as it is,
        `fused_ranks.reads_half`: no float32 copy of the matrix, nor of its gradient):
        the rounding of a float16 (bfloat16) product, relative 2^-11 (2^-8), moves each
        rank loss by under 3e-4 (4e-3) of its float32 value on clustered embeddings at batch
        1024 (tests/losses/test_autocast.py), at a tenth of a float32 product's time on a GPU.
        The embeddings are normalised as the distance's forward normalises them
        (`normalized_with_distance_stats`: once when `ref_emb` is `embeddings`, with a
        hand-written gradient where the distance's normalisation is F.normalize's); a
        distance with a forward of its own computes the whole matrix itself."""
        if type(self.distance).forward is not BaseDistance.forward:
            with self.caller_autocast(embeddings.device):
                matrix = self.distance(embeddings, None if ref_emb is embeddings else ref_emb)
            return _in_float32(matrix, half)
        return self.matrix_of_normalized(*normalized_with_distance_stats(self.distance, embeddings, ref_emb), half)

    def matrix_of_normalized(self, queries, references, half=False):
        """`similarity_matrix` of rows that the distance has normalised already."""
        with self.caller_autocast(queries.device):
            matrix = self.distance.compute_mat(queries, references)
            if self.distance.power != 1:
                matrix = matrix**self.distance.power
        return _in_float32(matrix, half)

    def caller_autocast(self, device):
        """The caller's autocast, switched off inside the loss (`forward`), for a matrix
        product; a no-op where the caller had none."""
        dtype = getattr(self, "autocast_dtype", None)
        return contextlib.nullcontext() if dtype is None else torch.autocast(device.type, dtype=dtype)


class SumOfReducers(MultipleReducers):
    """PML's `MultipleReducers` (each sub-loss to its reducer, the sum of the results),
    adding the results directly: PML copies each into a zeros buffer and sums that, a
    kernel per copy and more in the backward pass (28 of ROADMAP's 119 operations per
    call; tests/losses/test_roadmap.py counts them). The rank losses' reducer wherever PML
    would build a MultipleReducers itself."""

    def forward(self, loss_dict, embeddings, labels):
        self.reset_stats()
        reduced = [
            self.reducers[name]({name: info}, embeddings, labels)
            if name in self.reducers
            else self.default_reducer({name: info}, embeddings, labels)
            for name, info in loss_dict.items()
        ]
        return functools.reduce(operator.add, reduced).to(embeddings.dtype)


def _in_float32(matrix, half=False):
    """A half-precision `matrix` upcast to float32, unless `half` and the relaxed ranks'
    kernels read it as it is."""
    if matrix.dtype not in HALF_PRECISION or (half and fused_ranks.reads_half(matrix)):
        return matrix
    return matrix.float()


def autocast_dtype(device):
    """The dtype of the `torch.autocast` that is on for `device`'s type; None when off."""
    try:
        return torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else None
    except RuntimeError:  # a device type autocast does not know
        return None


def autocast_off(device):
    """A context in which `torch.autocast` is off for `device`'s type (a no-op for a device
    type autocast does not know)."""
    try:
        return torch.autocast(device.type, enabled=False)
    except RuntimeError:
        return contextlib.nullcontext()


def _at_least_float32(tensor):
    if tensor is not None and tensor.dtype in HALF_PRECISION:
        return tensor.float()
    return tensor


def plain_reducer(reducer, kind):
    """Whether `reducer` is PML's reducer class `kind` itself, recording no statistics: then a loss
    may give the number it would give (an "already_reduced" loss) without the indices it would not read."""
    return type(reducer) is kind and not reducer.collect_stats


def reference_is_batch(labels, ref_labels):
    """PML's rule (`lmu.get_matches_and_diffs`): the references are the batch itself,
    and a sample is not paired with itself, exactly when `ref_labels is labels`."""
    return ref_labels is labels


def pair_masks(labels, ref_labels, indices_tuple=None, shape=None):
    """Boolean [queries, references] masks of the positive and the negative pairs:
    every pair by label, without (i, i) when `reference_is_batch`, or the pairs of
    `indices_tuple` (pairs or triplets, via PML's `convert_to_pairs`; `shape` gives
    the size when there are no labels)."""
    if indices_tuple is None:
        positive = labels.unsqueeze(1) == ref_labels.unsqueeze(0)
        negative = ~positive
        if reference_is_batch(labels, ref_labels):
            positive.fill_diagonal_(False)
        return positive, negative
    a1, p, a2, n = lmu.convert_to_pairs(indices_tuple, labels, ref_labels)
    shape = shape or (len(labels), len(ref_labels))
    positive = torch.zeros(shape, dtype=torch.bool, device=a1.device)
    negative = torch.zeros_like(positive)
    positive[a1, p] = True
    negative[a2, n] = True
    return positive, negative


def label_pairs(labels, ref_labels, with_self=False):
    """The positive pairs by label as ``(queries, references)`` index tensors in row-major
    order: ``true_entries(pair_masks(labels, ref_labels)[0])``. (i, i) is left out when
    `reference_is_batch`, unless `with_self`."""
    return label_pairs_and_counts(labels, ref_labels, with_self)[:2]


def label_pairs_and_counts(labels, ref_labels, with_self=False):
    """`label_pairs`, each query's number of pairs (``bincount``) and their extremes
    ``(fewest, most)`` where they were read back with the pairs (else None). Where Triton runs,
    two kernels that compare labels in registers (`fused_label_pairs`: one read-back). Else
    on the CPU without building any [queries, references] mask (comparing every pair of
    labels costs more than the loss's own work on the pairs): each query's run of equal
    labels among the references sorted stably by label. On an accelerator without Triton
    (`sized_for`), the comparison of every pair and one `nonzero`: a handful of kernels
    where the runs' sort, searches and repeats take dozens (and three waits for the
    device)."""
    batch = reference_is_batch(labels, ref_labels) and not with_self
    if fused_label_pairs.applies(labels, ref_labels):
        return fused_label_pairs.label_pairs_and_counts(labels, ref_labels, batch)
    if _device_policy.sized_for(labels.device) == "memory":
        positive = labels.unsqueeze(1) == ref_labels.unsqueeze(0)
        if batch:
            positive.fill_diagonal_(False)
        queries, references = positive.nonzero(as_tuple=True)
        return queries, references, occurrences(queries, len(labels)), None
    common = torch.promote_types(labels.dtype, ref_labels.dtype)
    # Contiguous: searchsorted copies (and warns of) a strided vector, a column of a [batch, k] target.
    labels, ref_labels = labels.to(common).contiguous(), ref_labels.to(common).contiguous()
    sorted_labels, order = torch.sort(ref_labels, stable=True)
    first = torch.searchsorted(sorted_labels, labels)
    counts = torch.searchsorted(sorted_labels, labels, right=True).sub_(first)
    queries = torch.repeat_interleave(torch.arange(len(labels), device=labels.device), counts)
    # Each pair's place in its query's run: 0, 1, ..., count − 1.
    run_starts = (counts.cumsum(0) - counts).repeat_interleave(counts)
    within = torch.arange(len(queries), device=labels.device).sub_(run_starts)
    references = order[first.repeat_interleave(counts).add_(within)]
    if batch:  # every query's run holds the query itself
        different = queries != references
        queries, references, counts = queries[different], references[different], counts - 1
    return queries, references, counts, None


class LabelPairs(NamedTuple):
    """A batch's positive pairs by label, as `pairs_by_label` gives them: `query` and
    `positive` (row-major index tensors), which queries have a positive other than
    themselves (`kept`: a boolean per query, None when all have), how many
    (`num_queries`), and c when every query has c pairs (else None)."""

    query: torch.Tensor
    positive: torch.Tensor
    kept: torch.Tensor | None
    num_queries: int
    pairs_per_query: int | None

    def ranked(self):
        """`query` and `positive` of the kept queries, their query numbers unchanged."""
        if self.kept is None:
            return self.query, self.positive
        kept = self.kept[self.query]
        return self.query[kept], self.positive[kept]

    def kept_queries(self):
        """The indices of the kept queries."""
        return true_rows(self.kept, self.num_queries, self.query.device)


def pairs_by_label(labels, ref_labels, with_self=False):
    """`label_pairs` with what a ranking of them needs to know (`LabelPairs`), read back in
    one transfer before the similarity product is queued (`queries_in_range`): on a GPU
    it then waits for the labels' few kernels, not for the product. A query whose only
    positive is itself is not kept (its pair stays, `LabelPairs.ranked` drops it)."""
    pair_query, pair_positive, per_query, extremes = label_pairs_and_counts(labels, ref_labels, with_self)
    return LabelPairs(pair_query, pair_positive, *queries_in_range(per_query, int(with_self) + 1, extremes=extremes))


def ranking_by_label(labels, ref_labels, indices_tuple, embeddings, ref_emb):
    """For the losses that rank each query as one of its own positives (SupAP, ROADMAP,
    PNP): its `LabelPairs` when the batch ranks itself by label (no `indices_tuple`, the
    batch its own references), its self-pairs included; else None, and the ranking takes
    [queries, references] masks. By label, a ranking's negatives are the references of
    other labels (`query_panels.LabelWeights`), and no mask is needed."""
    if indices_tuple is None and ref_emb is embeddings and reference_is_batch(labels, ref_labels):
        return pairs_by_label(labels, ref_labels, with_self=True)
    return None


def normalized_with_distance_stats(distance, embeddings, ref_emb):
    """`embeddings` and `ref_emb` normalised as `distance` normalises them (one tensor
    when `ref_emb is embeddings`), recording the distance's statistics as its own forward
    does."""
    distance.reset_stats()
    queries = normalized(distance, embeddings)
    references = queries if ref_emb is embeddings else normalized(distance, ref_emb)
    distance.set_default_stats(embeddings, ref_emb, queries, references)
    return queries, references


def normalized(distance, embeddings):
    """``distance.maybe_normalize(embeddings, dim=1)``; where that is F.normalize's L2
    normalisation, with its gradient by hand (`_UnitRows`)."""
    own = type(distance).normalize is not BaseDistance.normalize
    own = own or type(distance).maybe_normalize is not BaseDistance.maybe_normalize
    if distance.normalize_embeddings and distance.p == 2 and not own:
        return _UnitRows.apply(embeddings, _NORMALIZE_EPS)
    return distance.maybe_normalize(embeddings, dim=1)


# F.normalize's default: norms are clamped at it.
_NORMALIZE_EPS = 1e-12


class _UnitRows(torch.autograd.Function):
    """F.normalize(x, dim=1): each row over its L2 norm clamped at `eps`, with the gradient
    in one pass, (g − y (y · g)) / ‖x‖, or g / eps for a row whose norm was clamped:
    autograd's graph for F.normalize is about 15 kernels in the backward pass, this 5; on a
    GPU one Triton kernel each way (`fused_unit_rows`)."""

    @staticmethod
    def forward(ctx, x, eps):
        if fused_unit_rows.applies(x):
            rows, clamped = fused_unit_rows.unit_rows(x, eps)
        else:
            clamped = torch.linalg.vector_norm(x, dim=1, keepdim=True).clamp_min(eps)
            rows = x / clamped
        ctx.save_for_backward(rows, clamped)
        ctx.eps = eps
        return rows

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_rows):
        rows, clamped = ctx.saved_tensors
        if fused_unit_rows.applies(rows):
            return fused_unit_rows.unit_rows_gradient(grad_rows, rows, clamped, ctx.eps), None
        # The norm was clamped where its clamped value is not above eps (NaN included).
        along = (rows * grad_rows).sum(1, keepdim=True).mul_(clamped > ctx.eps)
        return torch.addcmul(grad_rows, rows, along, value=-1).div_(clamped), None


def symmetrize_(matrix, block=128):
    """``matrix + matrix.T`` of a square matrix, in place, a panel at a time: `block`
    rows from the diagonal on and the matching columns. No second N x N buffer, and
    cache-sized transposes (adding a whole transposed view reads it strided, 3 times
    slower). The sums are those of ``matrix + matrix.T``. On an accelerator (`sized_for`),
    one pass with one transposed copy: a kernel per panel would grow with the batch."""
    if _device_policy.sized_for(matrix.device) == "memory":
        return matrix.add_(matrix.T.contiguous())
    n = len(matrix)
    for start in range(0, n, block):
        rows = slice(start, start + block)
        upper, lower = matrix[rows, start:], matrix[start:, rows]  # share the diagonal block
        # Transposed through contiguous copies: a transposed view of the large matrix
        # steps to another page at every element (at N = 2048, 10 ms against 6 ms).
        total = upper + lower.contiguous().T
        upper.copy_(total)
        lower.copy_(total.T.contiguous())
    return matrix


def query_self_scores(distance, embeddings):
    """Each query's score (higher = closer) against itself under `distance`."""
    rows = normalized(distance, embeddings)
    self_scores = distance.pairwise_distance(rows, rows) ** distance.power
    return self_scores if distance.is_inverted else -self_scores


def with_query_as_positive(distance, embeddings, ref_emb, scores, positive, negative):
    """Scores and masks in which each query is one of its own positives: its column when
    the references are the batch itself, otherwise an extra first column holding its
    self-similarity under `distance`. Mutates `positive` and `negative`."""
    if ref_emb is embeddings:
        positive.fill_diagonal_(True)
        negative.fill_diagonal_(False)
        return scores, positive, negative
    first = torch.ones_like(positive[:, :1])
    return (
        torch.cat([query_self_scores(distance, embeddings).unsqueeze(1), scores], dim=1),
        torch.cat([first, positive], dim=1),
        torch.cat([~first, negative], dim=1),
    )


def with_query_as_positive_pairs(distance, embeddings, ref_emb, scores, pair_query, pair_positive):
    """`with_query_as_positive` for positive pairs given as row-major (query, reference)
    index tensors (`label_pairs`): scores and pairs, still row-major, with (q, q) added
    for every query q, or (q, 0) and the columns shifted by one when the first column is
    added."""
    queries = torch.arange(len(scores), device=scores.device)
    if ref_emb is embeddings:
        own_columns = queries
    else:
        scores = torch.cat([query_self_scores(distance, embeddings).unsqueeze(1), scores], dim=1)
        pair_positive = pair_positive + 1
        own_columns = torch.zeros_like(queries)
    pair_query, pair_positive = torch.cat([pair_query, queries]), torch.cat([pair_positive, own_columns])
    order = torch.argsort(pair_query * scores.shape[1] + pair_positive)
    return scores, pair_query[order], pair_positive[order]
