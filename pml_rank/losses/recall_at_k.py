"""Recall@k surrogate (RS@k): Patel, Tolias, Matas, "Recall@k Surrogate Loss with Large
Batches and Similarity Mixup", CVPR 2022.

For a query q with positives P_q among the references Ω_q it ranks (the batch without q,
or ``ref_emb``), the rank of a positive x is relaxed with a sigmoid of temperature τ1,

    r(q, x) = 1 + Σ_{z ∈ Ω_q, z ≠ x} σ((s(q, z) − s(q, x)) / τ1),

the count of positives within the top k with a sigmoid of temperature τ2, and recall@k
is that count over the most it can be:

    R̃@k(q) = min(Σ_{x ∈ P_q} σ((k − r(q, x)) / τ2), k) / min(k, |P_q|),
    loss(q) = 1 − (1 / |K|) Σ_{k ∈ K} R̃@k(q),

averaged over the queries. k larger than the ranked list is replaced by its length
(exact recall@k no longer changes there). The clip at k (a relaxed count can exceed k,
an exact one cannot) and the replacement of k are the authors' code's.

Differs from the authors' code (yash0307/RecallatK_surrogate, checked against it in
tests/losses/test_recall_at_k.py, not copied):

- Their ranks count the query itself: its similarity to itself (1 for unit vectors) is
  one of the references above each of its positives, so every rank is about one higher
  and k is clipped at the batch size rather than at the list without the query.
  ``query_in_ranking=True`` computes exactly that; the default follows the paper's text.
- Their batch must be equal class blocks in order, at least 2 per class (1 divides by
  zero), and their SiMix takes 3, 4 or 6 per class; here any labels, ``ref_emb`` and
  ``indices_tuple``.
- Their sigmoids clamp the exponent at ±50, these at ±30 (see SIGMOID_LIMIT): values
  differ by less than e^-30 per term.

Memory: every (query, positive) pair needs a sigmoid of its query's whole row of
similarities: r(q, x) − 1/2 is the relaxed rank that the rank losses share
(`query_panels.RelaxedRanks`, panels of queries sized for the device, each query's
gradient row computed alongside), and R̃@k a formula over it: a few queries x references
matrices, never B x B x B.
"""

import functools
import math
import numbers

import torch
import torch.nn.functional as F
from pytorch_metric_learning.distances import CosineSimilarity
from pytorch_metric_learning.utils import common_functions as c_f

from .._checks import check_numbers
from . import fused_ranks
from .base import RankLossBase, label_pairs_and_counts, normalized, pair_masks, reference_is_batch
from .fused_ranks import FusedForm
from .query_panels import (
    any_per_row,
    left_out_of,
    left_out_per_query,
    occurrences,
    own_columns,
    queries_in_range,
    relaxed_ranks,
    true_entries,
)

# Sigmoid arguments are clamped to ±SIGMOID_LIMIT and get no gradient beyond it.
# σ(±30) is 0 or 1 to float32 precision (e^-30 ≈ 9.4e-14 < 2^-24), and the product of
# two derivatives (rank sigmoid times recall sigmoid) stays far above float32's smallest
# normal number, so the backward pass never computes with denormals (a slow path on
# CPUs). τ1 = 0.01 puts similarity gaps beyond 0.3 there.
SIGMOID_LIMIT = 30.0
# Just above σ'(±SIGMOID_LIMIT) in any float type: what a clamped entry's derivative
# turns into, for threshold_ to zero.
_SLOPE_AT_LIMIT = math.exp(-SIGMOID_LIMIT) * (1 + 1e-4)
PAPER_K_VALUES = (1, 2, 4, 8, 16)


class RecallAtKSurrogateLoss(RankLossBase):
    """1 − the relaxed recall@k averaged over `k_values`, per query (RS@k).

    Args:
        k_values: the k of recall@k (the paper's K = {1, 2, 4, 8, 16}).
        rank_temperature: τ1 of the sigmoid that relaxes the ranks (paper: 0.01).
        recall_temperature: τ2 of the sigmoid of k − rank (paper: 1).
        similarity_mixup: SiMix (paper sec. 3.3). Every pair (i, j) of samples of the
            same class in the batch gives a virtual sample of that class, the mixture
            α·x̂_i + (1 − α)·x̂_j with a fresh α ~ U(0, 1) (torch's global generator).
            Its similarities are the same mixture of the real ones, and between two
            virtual samples the bilinear mixture: the dot products of the mixed
            unit-norm embeddings when the similarity is cosine, as in the authors' code.
            Virtual samples are queries and references like the real ones; the loss is
            the mean over all queries, and a virtual query's loss carries the index of
            its first sample (for reducers). Needs the batch as its own reference set
            (no ``ref_emb``, no ``indices_tuple``). Under ``DistributedLossWrapper`` each
            process draws its own α: seed them alike for one function. False (default):
            the batch as it is.
        query_in_ranking: False (the paper's text, default): a query ranks the other
            references only. True (the authors' code): the query's similarity to itself
            also counts in the rank of each of its positives, as a reference that is no
            positive (with cosine similarity it ranks above them all, so every rank is
            about one higher), and k is clipped at the list length including the query.

    Queries without a positive, or without a negative (exact recall@k is then 1 for any
    ranking), are left out; a batch without any other query gives PML's zero loss. With
    an `indices_tuple`, its pairs (PML's ``convert_to_pairs``) are each query's positives
    and negatives, and references in neither are left out of its ranking. Per-query
    losses go through PML's reducer ("element", indices = queries).
    Recorded statistic: ``num_queries``.
    """

    finite_for_bounded_scores = True  # see RankLossBase

    def __init__(
        self,
        k_values: tuple | list = PAPER_K_VALUES,
        rank_temperature: float = 0.01,
        recall_temperature: float = 1.0,
        similarity_mixup: bool = False,
        query_in_ranking: bool = False,
        **kwargs,
    ):
        super().__init__(**kwargs)
        owner = type(self).__name__
        if not k_values or not all(
            isinstance(k, numbers.Integral) and not isinstance(k, bool) and k >= 1 for k in k_values
        ):
            raise ValueError(f"{owner}: k_values must be a non-empty list of integers >= 1, got {k_values!r}")
        check_numbers(owner, "> 0", rank_temperature=rank_temperature, recall_temperature=recall_temperature)
        if not self.distance.is_inverted:
            raise ValueError(
                f"{owner}: the distance must be a similarity (higher = closer), got {type(self.distance).__name__}"
            )
        self.k_values = [int(k) for k in k_values]
        self.rank_temperature = float(rank_temperature)
        self.recall_temperature = float(recall_temperature)
        self.similarity_mixup = similarity_mixup
        self.query_in_ranking = query_in_ranking
        self.add_to_recordable_attributes(list_of_names=["rank_temperature", "recall_temperature"], is_stat=False)
        self.add_to_recordable_attributes(list_of_names=["num_queries"], is_stat=True)

    def get_default_distance(self):
        return CosineSimilarity()

    def compute_loss(self, embeddings, labels, indices_tuple, ref_emb, ref_labels):
        c_f.labels_required(labels)
        batch_is_reference = indices_tuple is None and reference_is_batch(labels, ref_labels)
        if self.similarity_mixup and not batch_is_reference:
            raise ValueError(
                f"{type(self).__name__}: similarity_mixup=True mixes the batch with itself; "
                "it takes no ref_emb and no indices_tuple"
            )
        # Without SiMix the similarities are computed after the pairs are counted: on a GPU the
        # count's read-back then does not wait for the matrix product.
        scores = self.similarity_matrix(embeddings, ref_emb) if self.similarity_mixup else None
        query_index = torch.arange(len(embeddings), device=embeddings.device)
        if self.similarity_mixup:
            scores, labels, query_index = with_virtual_samples(scores, labels)
            ref_labels = labels
        shape = (len(labels), len(ref_labels))
        if indices_tuple is None:  # no [queries, references] mask is needed
            pair_query, pair_positive, positives, extremes = label_pairs_and_counts(labels, ref_labels)
            left_out = own_columns(shape[0], labels.device) if batch_is_reference else None
            # Every query ranks the same references, and every one that is no positive is a negative.
            ranked = shape[1] - int(batch_is_reference)
            keep, self.num_queries, pairs_per_query = queries_in_range(positives, 1, ranked - 1, extremes)
        else:
            positive, negative = pair_masks(labels, ref_labels, indices_tuple, shape=shape)
            pair_query, pair_positive = true_entries(positive)
            left_out = left_out_of(positive, negative)
            positives = occurrences(pair_query, shape[0])
            # Each query's number of ranked references, as `positives` counts its positives.
            ranked = torch.full_like(positives, shape[1]) - left_out_per_query(left_out, shape[0])
            keep = (positives > 0) & any_per_row(negative)
            self.num_queries, pairs_per_query = int(keep.sum()), None
            keep = None if self.num_queries == shape[0] else keep
        if self.num_queries == 0:
            return self.zero_losses()
        # Before the similarity product is queued: on a GPU the upload of the k values waits
        # for the device's queue.
        k, normalizer = self.k_and_normalizer(ranked + int(self.query_in_ranking), positives, embeddings.dtype)
        if scores is None:  # read by relaxed_ranks alone (the mixup's rows are float32)
            scores = self.similarity_matrix(embeddings, ref_emb, half=True)
        if self.query_in_ranking:
            if batch_is_reference:
                own = scores.diagonal()
            else:
                rows = normalized(self.distance, embeddings)
                own = self.distance.pairwise_distance(rows, rows)
            scores = torch.cat([scores, own.unsqueeze(1)], dim=1)
            if torch.is_tensor(left_out):
                left_out = torch.cat([left_out, left_out.new_zeros(len(left_out), 1)], dim=1)
        if keep is not None:
            scores, k, normalizer = scores[keep], k[keep], normalizer[keep]
            pair_query, pair_positive = kept_pairs(keep, pair_query, pair_positive)
            if torch.is_tensor(left_out):
                left_out = left_out[keep]
            elif left_out is not None:
                left_out = kept_pairs(keep, *left_out)
        recall = relaxed_recall(
            scores,
            left_out,
            pair_query,
            pair_positive,
            k,
            normalizer,
            self.rank_temperature,
            self.recall_temperature,
            pairs_per_query,
        )
        queries = query_index if keep is None else query_index[keep]
        return {"loss": {"losses": 1 - recall, "indices": queries, "reduction_type": "element"}}

    def k_and_normalizer(self, ranked, positives, dtype):
        """[queries, |K|] tensors of `dtype`: each k clipped at the query's list length
        (`ranked`: each query's number of ranked references, or one number for all), and
        min(that k, the query's number of `positives`)."""
        if torch.is_tensor(ranked):
            k = torch.minimum(torch.tensor(self.k_values, device=ranked.device), ranked.unsqueeze(1)).to(dtype)
        else:
            k = torch.tensor([min(k, ranked) for k in self.k_values], dtype=dtype, device=positives.device)
            k = k.expand(len(positives), -1)
        return k, torch.minimum(k, positives.unsqueeze(1))


def kept_pairs(keep, pair_query, pair_reference):
    """The (query, reference) pairs of the queries where `keep` is True, their queries
    renumbered among those."""
    kept = keep[pair_query]
    renumbered = torch.cumsum(keep, 0).sub_(1)
    return renumbered[pair_query[kept]], pair_reference[kept]


def same_class_pairs(labels):
    """(i, j) of every pair of samples with the same label, i < j, in row-major order."""
    same = labels.unsqueeze(1) == labels.unsqueeze(0)
    return torch.triu(same, diagonal=1).nonzero(as_tuple=True)


def with_virtual_samples(scores, labels):
    """SiMix on a square similarity matrix of the batch against itself: the matrix of the
    batch followed by one virtual sample per same-class pair (i, j), the mixture
    α·s(i, ·) + (1 − α)·s(j, ·) in rows and then in columns, α ~ U(0, 1); the labels of
    all samples; and each row's query index (a virtual sample's is its i)."""
    first, second = same_class_pairs(labels)
    alpha = torch.rand(len(first), dtype=scores.dtype, device=scores.device)
    rows = torch.cat([scores, torch.lerp(scores[second], scores[first], alpha.unsqueeze(1))])
    scores = torch.cat([rows, torch.lerp(rows[:, second], rows[:, first], alpha)], dim=1)
    query_index = torch.cat([torch.arange(len(labels), device=labels.device), first])
    return scores, torch.cat([labels, labels[first]]), query_index


class ClampedSigmoid:
    """h(x) = σ(clamp(x, ±SIGMOID_LIMIT)) and its derivative, zero where x was clamped
    (unranked references, at −inf, included), for `query_panels.RelaxedRanks`."""

    fused = FusedForm(limit=SIGMOID_LIMIT, slope_floor=_SLOPE_AT_LIMIT)

    @staticmethod
    def value(x):
        return x.clamp_(-SIGMOID_LIMIT, SIGMOID_LIMIT).sigmoid_()

    @staticmethod
    def slope(x, values):
        # σ' = σ − σ², zero where the argument was clamped.
        return F.threshold_(values.addcmul_(values, values, value=-1), _SLOPE_AT_LIMIT, 0.0)


def relaxed_recall(
    scores, left_out, pair_query, pair_positive, k, normalizer, rank_temperature, recall_temperature, pairs=None
):
    """Per query: (1/|K|) Σ_k min(Σ_{x ∈ P_q} σ((k − r(q, x)) / τ2), k) / normalizer, from
    `scores` [queries, references], the pairs `left_out` of each query's list (see
    `query_panels.left_out_filled_`), the positive pairs (`pair_query`, `pair_positive`,
    sorted by query) and per-query k and normalizer [queries, |K|]; the ranks r are
    `query_panels.RelaxedRanks`'s; `pairs`: its ``pairs_per_query``."""
    recall = recall_formula(k, normalizer, recall_temperature)
    scale = 1 / rank_temperature
    return relaxed_ranks(scores, pair_query, pair_positive, ClampedSigmoid, recall, scale, left_out, None, pairs)


def recall_formula(k, normalizer, recall_temperature):
    """`RelaxedRanks`'s formula of `relaxed_recall` (sums [r, c] of its panel's r queries
    to their recall [r]), with its derivative by hand (``recall.gradients``): autograd's
    graph would cost more than the rest of a panel's formula (`formula_and_gradients`)."""

    def in_top_k(sums, queries):
        # 1 + Σ_{z ≠ x}: the z = x term of the sums is σ(0) = 1/2.
        ranks = sums + 0.5
        margins = (k[queries].unsqueeze(1) - ranks.unsqueeze(2)) / recall_temperature
        return margins, margins.clamp(-SIGMOID_LIMIT, SIGMOID_LIMIT).sigmoid()

    def recall(sums, own, queries):
        counts = in_top_k(sums, queries)[1].sum(1)
        return (torch.minimum(counts, k[queries]) / normalizer[queries]).mean(1)

    def gradients(sums, own, queries, scale=1.0):
        margins, sigmoids = in_top_k(sums, queries)
        counts = sigmoids.sum(1)
        panel_k = k[queries]
        value = (torch.minimum(counts, panel_k) / normalizer[queries]).mean(1)
        # d value / d count: 1 / (|K| normalizer) below k, 0 above, half at a tie (as
        # autograd's minimum); each count moves with each rank by −σ' / τ2 where the
        # margin was not clamped (clamp passes the gradient at the limits).
        per_count = (counts < panel_k).to(counts.dtype).add_(counts <= panel_k).mul_(0.5)
        per_count.div_(normalizer[queries]).div_(k.shape[1])
        slopes = sigmoids.addcmul_(sigmoids, sigmoids, value=-1).mul_(margins.abs_() <= SIGMOID_LIMIT)
        grad_sums = slopes.mul_(per_count.unsqueeze(1)).sum(2).mul_(-scale / recall_temperature)
        return value, grad_sums, None

    recall.gradients = gradients
    if fused_ranks.triton is not None:
        recall.fused_gradients = functools.partial(fused_recall_gradients, k, normalizer, recall_temperature)
    return recall


def fused_recall_gradients(k, normalizer, recall_temperature, sums, own, pairs_per_query, scale):
    """``recall.gradients`` of `recall_formula` for queries with c pairs each ([pairs] `sums`,
    query by query) in one Triton kernel (`_recall_kernel`), for the fused relaxed ranks; None
    where `fused_ranks.formula_by_blocks` takes no such c."""
    count = k.shape[1]
    arguments = (sums, k, k.stride(0), normalizer, normalizer.stride(0), count, recall_temperature, SIGMOID_LIMIT)
    arguments += (-scale / (recall_temperature * count),)
    block_k = triton.next_power_of_2(count)
    return fused_ranks.formula_by_blocks(
        _recall_kernel, sums, pairs_per_query, arguments, own_gradients=False, width=block_k, BLOCK_K=block_k
    )


if fused_ranks.triton is not None:
    import triton
    import triton.language as tl

    @triton.jit
    def _recall_kernel(
        values,
        grad_sums,
        grad_own,
        queries,
        c,
        sums,
        k,
        k_stride,
        normalizer,
        normalizer_stride,
        k_count,
        recall_temperature,
        limit,
        gradient_factor,
        BLOCK_Q: tl.constexpr,
        BLOCK_C: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        # As ``recall.gradients``, on [BLOCK_Q, BLOCK_C (pairs), BLOCK_K (k values)] tiles.
        q = tl.program_id(0) * BLOCK_Q + tl.arange(0, BLOCK_Q)
        i = tl.arange(0, BLOCK_C)
        kk = tl.arange(0, BLOCK_K)
        valid = (q < queries)[:, None] & (i < c)[None, :]
        valid_k = (q < queries)[:, None] & (kk < k_count)[None, :]
        at = q[:, None].to(tl.int64) * c + i[None, :]
        ranks = tl.load(sums + at, mask=valid, other=0.0) + 0.5
        query_k = tl.load(k + q[:, None].to(tl.int64) * k_stride + kk[None, :], mask=valid_k, other=0.0)
        query_normalizer = tl.load(
            normalizer + q[:, None].to(tl.int64) * normalizer_stride + kk[None, :], mask=valid_k, other=1.0
        )
        margins = (query_k[:, None, :] - ranks[:, :, None]) / recall_temperature
        sigmoids = tl.sigmoid(tl.minimum(tl.maximum(margins, -limit), limit))
        sigmoids = tl.where(valid[:, :, None] & valid_k[:, None, :], sigmoids, 0.0)
        counts = tl.sum(sigmoids, axis=1)
        recalls = tl.where(valid_k, tl.minimum(counts, query_k) / query_normalizer, 0.0)
        tl.store(values + q, tl.sum(recalls, axis=1) / k_count, mask=q < queries)
        # d value / d count: 1 below k, 0 above, half at a tie (as autograd's minimum), over
        # |K| normalizer (in `gradient_factor` with −scale / τ2).
        per_count = tl.where(counts < query_k, 1.0, tl.where(counts == query_k, 0.5, 0.0)) / query_normalizer
        slopes = tl.where(tl.abs(margins) <= limit, sigmoids - sigmoids * sigmoids, 0.0)
        gradient = tl.sum(slopes * per_count[:, None, :], axis=2) * gradient_factor
        tl.store(grad_sums + at, gradient, mask=valid)
