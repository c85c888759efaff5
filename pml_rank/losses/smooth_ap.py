"""Smooth-AP: Brown et al., "Smooth-AP: Smoothing the Path Towards Large-Scale Image
Retrieval" (ECCV 2020).

Per query q and each of its positives i, the ranks in the AP are relaxed with a
sigmoid of temperature τ:

    R_P(i) = 1 + Σ_{j ∈ P, j ≠ i} σ((s_qj − s_qi) / τ)       (rank among the positives)
    R(i)   = R_P(i) + Σ_{j ∈ N} σ((s_qj − s_qi) / τ)         (rank among all)
    AP_q   = (1 / |P|) Σ_{i ∈ P} R_P(i) / R(i)

and the loss of q is 1 − AP_q. Only positives i need a rank, so a query costs |P| × M
sigmoids (M references), not M × M: R(i) − 1/2 is the relaxed rank that the rank losses
share (`query_panels.RelaxedRanks`, panels of queries with equally many positives, each
query's gradient row computed alongside), and AP_q a formula over it: memory stays a few
similarity matrices whatever the class sizes.
"""

import torch
from pytorch_metric_learning.distances import CosineSimilarity
from pytorch_metric_learning.utils import common_functions as c_f

from .._checks import check_numbers
from . import fused_ranks
from .base import (
    RankLossBase,
    pair_masks,
    pairs_by_label,
    reference_is_batch,
    with_query_as_positive,
    with_query_as_positive_pairs,
)
from .fused_ranks import FusedForm
from .query_panels import (
    any_per_row,
    left_out_of,
    own_columns,
    relaxed_ranks,
    true_entries,
    true_rows,
)


class SmoothAPLoss(RankLossBase):
    """Smooth-AP loss: 1 − the sigmoid-relaxed AP of each query that has a positive
    other than itself.

    Args:
        temperature: τ of the sigmoid that replaces the rank's step function (the
            paper's and the authors' 0.01, for cosine similarities in [-1, 1]).
        include_query: True (the authors' code): the query is its own positive,
            ranked by its self-similarity (first, for cosine similarity), so a class of
            n samples gives each of its queries n positives, the query included. False
            (the paper's text): the query is left out of its own ranking, so it has
            n − 1 positives. A query without a positive other than itself is left out
            in both conventions.

    Every sample is a query that retrieves the rest of the batch. With `ref_emb`, the
    queries retrieve `ref_emb` instead; a query cannot be identified among them, so
    every reference counts (a copy of the query in `ref_emb` is an ordinary positive)
    and, with ``include_query=True``, the query is added as one more positive with its
    self-similarity. With an `indices_tuple`, its pairs (converted with PML's
    `convert_to_pairs`) are each query's positives and negatives, and the other
    references are left out of its ranking. Any PML distance works (a distance is
    negated into a score); τ is in the score's units.

    Per-query losses go to PML's reducer ("element" reduction, indices = queries); the
    default MeanReducer gives the authors' loss, 1 − the mean AP over queries.
    """

    finite_for_bounded_scores = True  # see RankLossBase

    def __init__(self, temperature: float = 0.01, include_query: bool = True, **kwargs):
        super().__init__(**kwargs)
        check_numbers(self, "> 0", temperature=temperature)
        self.temperature = float(temperature)
        self.include_query = include_query
        self.add_to_recordable_attributes(list_of_names=["temperature"], is_stat=False)
        self.add_to_recordable_attributes(list_of_names=["num_queries"], is_stat=True)

    def get_default_distance(self):
        return CosineSimilarity()

    def compute_loss(self, embeddings, labels, indices_tuple, ref_emb, ref_labels):
        c_f.labels_required(labels)
        # Each query is its own positive by its own column: its pair comes with the others'.
        own_column = indices_tuple is None and self.include_query and ref_emb is embeddings
        own_column = own_column and reference_is_batch(labels, ref_labels)
        pairs_per_query = None
        if indices_tuple is None:  # no [queries, references] mask is needed
            pair_query, pair_positive, kept, self.num_queries, pairs = pairs_by_label(
                labels, ref_labels, with_self=own_column
            )
            if pairs is not None:  # each query's own pair, when it comes later, is one more
                pairs_per_query = pairs + int(self.include_query and not own_column)
        else:
            positive, negative = pair_masks(labels, ref_labels, indices_tuple)
            has_positive = any_per_row(positive)
            self.num_queries = int(has_positive.sum())
            kept = None if self.num_queries == len(has_positive) else has_positive
        if self.num_queries == 0:
            return self.zero_losses()
        matrix = self.similarity_matrix(embeddings, ref_emb, half=True)  # read by relaxed_ranks alone
        scores = matrix if self.distance.is_inverted else -matrix
        if indices_tuple is None:
            left_out = None
            if self.include_query and not own_column:
                scores, pair_query, pair_positive = with_query_as_positive_pairs(
                    self.distance, embeddings, ref_emb, scores, pair_query, pair_positive
                )
            elif not self.include_query and reference_is_batch(labels, ref_labels):
                left_out = own_columns(len(labels), scores.device)
        else:
            if self.include_query:
                scores, positive, negative = with_query_as_positive(
                    self.distance, embeddings, ref_emb, scores, positive, negative
                )
            left_out = left_out_of(positive, negative)
            pair_query, pair_positive = true_entries(positive)
        if kept is not None:  # a query whose only positive is itself is left out
            in_kept = kept[pair_query]
            pair_query, pair_positive = pair_query[in_kept], pair_positive[in_kept]
        ap = relaxed_ranks(
            scores, pair_query, pair_positive, Sigmoid, smooth_ap, 1 / self.temperature, left_out, None, pairs_per_query
        )
        queries = true_rows(kept, self.num_queries, scores.device)
        ap = ap if self.num_queries == len(ap) else ap[queries]
        return {"loss": {"losses": 1 - ap, "indices": queries, "reduction_type": "element"}}


class Sigmoid:
    """h(x) = σ(x) and its derivative, for `query_panels.RelaxedRanks`: σ(−inf) = 0, slope 0."""

    fused = FusedForm()

    @staticmethod
    def value(x):
        return x.sigmoid_()

    @staticmethod
    def slope(x, values):
        return values.addcmul_(values, values, value=-1)


def smooth_ap(sums, own, queries):
    """AP of each query from the sums of σ((s_qj − s_qi) / τ) over its ranked references j
    ([queries, positives]) and its positives' scaled scores s_qi / τ (`RelaxedRanks`)."""
    return _precisions(sums, own)[2].mean(1)


def _precisions(sums, own):
    """Each positive's rank R_i among all, σ(s_qj/τ − s_qi/τ) over positives j [r, c, c]
    and its precision R_P(i) / R(i)."""
    # The positive's own column adds σ(0) = 1/2: its rank is 1 + the others' sum.
    rank = sums + 0.5
    over_positives = torch.sigmoid(own.unsqueeze(1) - own.unsqueeze(2))
    return rank, over_positives, (over_positives.sum(2) + 0.5) / rank


def smooth_ap_gradients(sums, own, queries, scale=1.0):
    """`smooth_ap` and `scale` times its gradients with respect to `sums` and `own`, by
    hand: autograd's graph would cost more than the rest of a panel's formula
    (`formula_and_gradients`)."""
    rank, over_positives, precision = _precisions(sums, own)
    ap = precision.mean(1)
    # AP = mean over the c positives of R_P(i) / R(i): d/dR(i) = −precision_i / (c R(i)),
    # d/dR_P(i) = 1 / (c R(i)); σ(own_j − own_i) in R_P(i) moves own_j by σ', own_i by −σ'.
    # The minus sign and the scale go into the one factor.
    minus_per_rank = rank.reciprocal_().mul_(-scale / own.shape[1])
    grad_sums = precision.mul_(minus_per_rank)
    slopes = over_positives.addcmul_(over_positives, over_positives, value=-1).mul_(minus_per_rank.unsqueeze(2))
    return ap, grad_sums, slopes.sum(2).sub_(slopes.sum(1))


smooth_ap.gradients = smooth_ap_gradients


def fused_smooth_ap_gradients(sums, own, pairs_per_query, scale):
    """`smooth_ap_gradients` of queries with c pairs each ([pairs] `sums` and `own`, query by
    query) in one Triton kernel (`_smooth_ap_kernel`), for the fused relaxed ranks; None
    where `fused_ranks.formula_by_blocks` takes no such c."""
    arguments = (sums, own, -scale / pairs_per_query)
    return fused_ranks.formula_by_blocks(_smooth_ap_kernel, sums, pairs_per_query, arguments, own_gradients=True)


if fused_ranks.triton is not None:
    import triton
    import triton.language as tl

    smooth_ap.fused_gradients = fused_smooth_ap_gradients

    @triton.jit
    def _smooth_ap_kernel(
        values,
        grad_sums,
        grad_own,
        queries,
        c,
        sums,
        own,
        minus_scale_per_pair,
        BLOCK_Q: tl.constexpr,
        BLOCK_C: tl.constexpr,
    ):
        # As `smooth_ap_gradients`, on [BLOCK_Q, BLOCK_C] tiles of queries and their pairs,
        # and [BLOCK_Q, BLOCK_C (i), BLOCK_C (j)] for σ(own_j − own_i).
        q = tl.program_id(0) * BLOCK_Q + tl.arange(0, BLOCK_Q)
        i = tl.arange(0, BLOCK_C)
        valid = (q < queries)[:, None] & (i < c)[None, :]
        at = q[:, None].to(tl.int64) * c + i[None, :]
        rank = tl.load(sums + at, mask=valid, other=0.0) + 0.5
        scores = tl.load(own + at, mask=valid, other=0.0)
        over_positives = tl.sigmoid(scores[:, None, :] - scores[:, :, None])
        over_positives = tl.where(valid[:, None, :], over_positives, 0.0)
        precision = (tl.sum(over_positives, axis=2) + 0.5) / rank
        tl.store(values + q, tl.sum(tl.where(valid, precision, 0.0), axis=1) / c, mask=q < queries)
        minus_per_rank = minus_scale_per_pair / rank
        tl.store(grad_sums + at, precision * minus_per_rank, mask=valid)
        slopes = (over_positives - over_positives * over_positives) * minus_per_rank[:, :, None]
        slopes = tl.where(valid[:, :, None], slopes, 0.0)
        tl.store(grad_own + at, tl.sum(slopes, axis=2) - tl.sum(slopes, axis=1), mask=valid)
