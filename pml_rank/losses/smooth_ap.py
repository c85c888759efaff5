"""Smooth-AP: Brown et al., "Smooth-AP: Smoothing the Path Towards Large-Scale Image
Retrieval" (ECCV 2020).

Per query q and each of its positives i, the ranks in the AP are relaxed with a
sigmoid of temperature τ:

    R_P(i) = 1 + Σ_{j ∈ P, j ≠ i} σ((s_qj − s_qi) / τ)       (rank among the positives)
    R(i)   = R_P(i) + Σ_{j ∈ N} σ((s_qj − s_qi) / τ)         (rank among all)
    AP_q   = (1 / |P|) Σ_{i ∈ P} R_P(i) / R(i)

and the loss of q is 1 − AP_q. Only positives i need a rank, so a query costs |P| × M
sigmoids (M references), not M × M. The (query, positive) pairs are taken in slots (each
query's first positive, then its second, ...), each slot at most queries × references,
and a custom autograd function recomputes each slot in the backward pass with the
analytic gradient: memory stays a few similarity matrices whatever the class sizes.
"""

import torch
from pytorch_metric_learning.distances import CosineSimilarity
from pytorch_metric_learning.utils import common_functions as c_f
from torch.autograd.function import once_differentiable

from .base import RankLossBase, pair_masks, with_query_as_positive


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

    def __init__(self, temperature: float = 0.01, include_query: bool = True, **kwargs):
        super().__init__(**kwargs)
        if not 0 < temperature < float("inf"):
            raise ValueError(f"SmoothAPLoss: temperature must be a finite number > 0, got {temperature!r}")
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
            scores, positive, negative = with_query_as_positive(
                self.distance, embeddings, ref_emb, scores, positive, negative
            )
        positive &= has_positive.unsqueeze(1)  # a query whose only positive is itself is left out
        ap = SmoothAPFunction.apply(scores, positive, negative, self.temperature)
        queries = torch.where(has_positive)[0]
        return {"loss": {"losses": 1 - ap[queries], "indices": queries, "reduction_type": "element"}}


def _positive_slots(positive, scaled):
    """Each query's positives as columns of a padded [queries, most positives] matrix and
    their scaled scores (−inf in the padding), and the (query, positive) pairs as
    [(rows, slot)] per slot: slot a holds the a-th positive of every query that has one,
    queries in order, so a slot's tensors over the references are at most queries x
    references."""
    rows, columns = positive.nonzero(as_tuple=True)
    counts = positive.sum(1)
    slot = torch.arange(len(rows), device=rows.device) - (counts.cumsum(0) - counts)[rows]
    most = int(counts.max())
    positive_columns = torch.zeros(len(positive), most, dtype=torch.long, device=rows.device)
    positive_columns[rows, slot] = columns
    positive_scaled = torch.full_like(positive_columns, float("-inf"), dtype=scaled.dtype)
    positive_scaled[rows, slot] = scaled[rows, columns]
    sizes = torch.bincount(slot).tolist()
    slot_rows = rows[torch.argsort(slot, stable=True)].split(sizes)
    return positive_columns, positive_scaled, list(enumerate(slot_rows))


def _sigmoids(scaled, positive_scaled, rows, slot, buffer):
    """For one slot's (query q, positive i) pairs: σ((s_qj − s_qi) / τ) over every
    reference j (written into `buffer`, shaped like `scaled`) and over q's positives j
    (padded with zeros), and, summing them, the ranks R(i) among all references and
    R_P(i) among the positives. `scaled` holds s / τ, −inf where a reference is left
    out of the query's ranking."""
    every_query = len(rows) == len(scaled)  # rows is then 0, 1, ..., queries - 1
    own = positive_scaled[rows, slot].unsqueeze(1)
    # One buffer for every slot: a fresh queries x references tensor per slot costs
    # more in page faults than the subtraction that fills it.
    over_all = buffer[: len(rows)]
    if every_query:
        torch.sub(scaled, own, out=over_all)
    else:
        torch.index_select(scaled, 0, rows, out=over_all).sub_(own)
    over_all.sigmoid_()
    over_positives = torch.sub(positive_scaled[rows], own).sigmoid_()
    # The positive's own column adds σ(0) = 1/2; its rank is 1 + the others' sum.
    rank = over_all.sum(1) + 0.5
    rank_among_positives = over_positives.sum(1) + 0.5
    return over_all, over_positives, rank, rank_among_positives, every_query


class SmoothAPFunction(torch.autograd.Function):
    """Smooth-AP of every query (0 for a query without positives) from `scores`
    (queries x references), boolean `positive` and `negative` masks (a reference in
    neither is left out of the query's ranking) and τ; exact analytic gradient with
    respect to `scores`, recomputed slot by slot (see `_positive_slots`)."""

    @staticmethod
    def forward(ctx, scores, positive, negative, temperature):
        num_positives = positive.sum(1, dtype=torch.int32).clamp_(min=1)
        # σ(−inf) = 0 and its slope is 0: a reference left out counts nowhere.
        scaled = (scores / temperature).masked_fill_(~(positive | negative), float("-inf"))
        positive_columns, positive_scaled, slots = _positive_slots(positive, scaled)
        ap = scores.new_zeros(len(scores))
        buffer = torch.empty_like(scaled)
        for slot, rows in slots:
            *_, rank, rank_among_positives, _ = _sigmoids(scaled, positive_scaled, rows, slot, buffer)
            ap.index_add_(0, rows, rank_among_positives / rank)
        ap /= num_positives
        ctx.save_for_backward(scaled, positive_columns, positive_scaled, num_positives)
        ctx.slots = slots
        ctx.temperature = temperature
        return ap

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_ap):
        scaled, positive_columns, positive_scaled, num_positives = ctx.saved_tensors
        grad_scores = torch.zeros_like(scaled)
        buffer = torch.empty_like(scaled)
        per_pair = grad_ap / num_positives / ctx.temperature
        for slot, rows in ctx.slots:
            over_all, over_positives, rank, rank_among_positives, every_query = _sigmoids(
                scaled, positive_scaled, rows, slot, buffer
            )
            # d(R_P / R) = dR_P / R − R_P dR / R², and d σ((s_j − s_i)/τ) / d s_j =
            # σ(1 − σ) / τ, the opposite for s_i: each row's sum goes to the positive i.
            scale = per_pair[rows] / rank
            grad_all = over_all.addcmul_(over_all, over_all, value=-1).mul_(
                (-scale * rank_among_positives / rank).unsqueeze(1)
            )
            grad_positives = over_positives.addcmul_(over_positives, over_positives, value=-1).mul_(scale.unsqueeze(1))
            if every_query:
                grad_scores += grad_all
            else:
                grad_scores.index_add_(0, rows, grad_all)
            columns = positive_columns[rows]
            # The padding's zeros go to column 0 of their row: accumulate, never overwrite.
            grad_scores.index_put_((rows.unsqueeze(1), columns), grad_positives, accumulate=True)
            grad_scores[rows, columns[:, slot]] -= grad_all.sum(1) + grad_positives.sum(1)
        return grad_scores, None, None, None
