"""Smooth-AP: Brown et al., "Smooth-AP: Smoothing the Path Towards Large-Scale Image
Retrieval" (ECCV 2020).

Per query q and each of its positives i, the ranks in the AP are relaxed with a
sigmoid of temperature τ:

    R_P(i) = 1 + Σ_{j ∈ P, j ≠ i} σ((s_qj − s_qi) / τ)       (rank among the positives)
    R(i)   = R_P(i) + Σ_{j ∈ N} σ((s_qj − s_qi) / τ)         (rank among all)
    AP_q   = (1 / |P|) Σ_{i ∈ P} R_P(i) / R(i)

and the loss of q is 1 − AP_q. Only positives i need a rank, so a query costs |P| × M
sigmoids (M references), not M × M; the (query, positive) pairs are processed in chunks
of about the size of the similarity matrix, and a custom autograd function recomputes
each chunk in the backward pass with the analytic gradient, so memory stays O(B²)
whatever the class sizes.
"""

import torch
from pytorch_metric_learning.distances import CosineSimilarity
from pytorch_metric_learning.utils import common_functions as c_f
from torch.autograd.function import once_differentiable

from .base import RankLossBase, pair_masks

# Elements of a chunk's (pairs x references) tensors when the similarity matrix is smaller.
MIN_CHUNK_ELEMENTS = 2**16


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

    def __init__(self, temperature=0.01, include_query=True, **kwargs):
        super().__init__(**kwargs)
        if (
            isinstance(temperature, bool)
            or not isinstance(temperature, (int, float))
            or not 0 < temperature < float("inf")
        ):
            raise ValueError(f"SmoothAPLoss: temperature must be a finite number > 0, got {temperature!r}")
        if not isinstance(include_query, bool):
            raise TypeError(f"SmoothAPLoss: include_query must be True or False, got {include_query!r}")
        self.temperature = float(temperature)
        self.include_query = include_query
        self.add_to_recordable_attributes(list_of_names=["temperature"], is_stat=False)
        self.add_to_recordable_attributes(list_of_names=["num_queries"], is_stat=True)

    def get_default_distance(self):
        return CosineSimilarity()

    def compute_loss(self, embeddings, labels, indices_tuple, ref_emb, ref_labels):
        c_f.labels_required(labels)
        positive, negative = pair_masks(labels, ref_labels, indices_tuple)
        has_positive = positive.any(1)
        self.num_queries = int(has_positive.sum())
        if self.num_queries == 0:
            return self.zero_losses()
        matrix = self.distance(embeddings, ref_emb)
        scores = matrix if self.distance.is_inverted else -matrix
        if self.include_query:
            scores, positive, negative = self.with_query_as_positive(embeddings, ref_emb, scores, positive, negative)
        positive &= has_positive.unsqueeze(1)  # a query whose only positive is itself is left out
        ap = SmoothAPFunction.apply(scores, positive, negative, self.temperature)
        queries = torch.where(has_positive)[0]
        return {"loss": {"losses": 1 - ap[queries], "indices": queries, "reduction_type": "element"}}

    def with_query_as_positive(self, embeddings, ref_emb, scores, positive, negative):
        """Scores and masks in which each query is one of its own positives: its column
        when the references are the batch itself, otherwise an extra first column
        holding its self-similarity. Mutates `positive` and `negative`."""
        if ref_emb is embeddings:
            positive.fill_diagonal_(True)
            negative.fill_diagonal_(False)
            return scores, positive, negative
        normalized = self.distance.maybe_normalize(embeddings)
        self_scores = self.distance.pairwise_distance(normalized, normalized) ** self.distance.power
        if not self.distance.is_inverted:
            self_scores = -self_scores
        first = torch.ones_like(positive[:, :1])
        return (
            torch.cat([self_scores.unsqueeze(1), scores], dim=1),
            torch.cat([first, positive], dim=1),
            torch.cat([~first, negative], dim=1),
        )


def _pair_chunks(rows, num_references):
    """Slices of the (query, positive) pairs, each about the size of the similarity
    matrix (at least MIN_CHUNK_ELEMENTS elements) once expanded over the references."""
    num_queries = int(rows.max()) + 1 if len(rows) else 1
    per_chunk = max(1, max(num_queries * num_references, MIN_CHUNK_ELEMENTS) // num_references)
    return [slice(start, start + per_chunk) for start in range(0, len(rows), per_chunk)]


def _relaxed_ranks(scores, positive, negative, rows, columns, inv_temperature):
    """For each (query, positive) pair of a chunk: the sigmoids σ((s_qj − s_qi) / τ) over
    the references j, R_P(i) and the negatives' sum R(i) − R_P(i)."""
    row_scores = scores[rows]
    sigmoids = torch.sigmoid((row_scores - row_scores.gather(1, columns.unsqueeze(1))) * inv_temperature)
    row_positive = positive[rows]
    row_negative = negative[rows]
    # The positive's own column is in R_P as σ(0) = 1/2: 1 + Σ_{j≠i} = 1/2 + Σ_j.
    rank_among_positives = sigmoids.masked_fill(~row_positive, 0).sum(1) + 0.5
    negatives_above = sigmoids.masked_fill(~row_negative, 0).sum(1)
    return sigmoids, row_positive, row_negative, rank_among_positives, negatives_above


class SmoothAPFunction(torch.autograd.Function):
    """Smooth-AP of every query (0 for a query without positives) from `scores`
    (queries x references), boolean `positive` and `negative` masks (a reference in
    neither is left out of the query's ranking) and τ; exact analytic gradient with
    respect to `scores`, recomputed chunk by chunk."""

    @staticmethod
    def forward(ctx, scores, positive, negative, temperature):
        rows, columns = positive.nonzero(as_tuple=True)
        num_positives = positive.sum(1, dtype=torch.int32)
        inv_temperature = 1.0 / temperature
        ap = scores.new_zeros(len(scores))
        for chunk in _pair_chunks(rows, scores.shape[1]):
            *_, rank_among_positives, negatives_above = _relaxed_ranks(
                scores, positive, negative, rows[chunk], columns[chunk], inv_temperature
            )
            ap.index_add_(0, rows[chunk], rank_among_positives / (rank_among_positives + negatives_above))
        ap /= num_positives.clamp(min=1)
        ctx.save_for_backward(scores, positive, negative, rows, columns, num_positives)
        ctx.inv_temperature = inv_temperature
        return ap

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_ap):
        scores, positive, negative, rows, columns, num_positives = ctx.saved_tensors
        inv_temperature = ctx.inv_temperature
        grad_scores = torch.zeros_like(scores)
        per_pair = grad_ap / num_positives.clamp(min=1)
        for chunk in _pair_chunks(rows, scores.shape[1]):
            chunk_rows, chunk_columns = rows[chunk], columns[chunk]
            sigmoids, row_positive, row_negative, rank_p, rank_n = _relaxed_ranks(
                scores, positive, negative, chunk_rows, chunk_columns, inv_temperature
            )
            # Term R_P / (R_P + R_N): d/dR_P = R_N / R², d/dR_N = −R_P / R².
            scale = per_pair[chunk_rows] / (rank_p + rank_n).square()
            d_positive = (scale * rank_n).unsqueeze(1)
            d_negative = (scale * -rank_p).unsqueeze(1)
            # d σ((s_j − s_i)/τ) / d s_j = σ(1 − σ)/τ; the same with a minus sign for s_i.
            slopes = sigmoids.sub_(sigmoids.square()).mul_(inv_temperature)
            weights = torch.where(row_positive, d_positive, 0.0) + torch.where(row_negative, d_negative, 0.0)
            grad_rows = slopes.mul_(weights)
            grad_scores.index_add_(0, chunk_rows, grad_rows)
            grad_scores.index_put_((chunk_rows, chunk_columns), -grad_rows.sum(1), accumulate=True)
        return grad_scores, None, None, None
