"""Smooth-AP: Brown et al., "Smooth-AP: Smoothing the Path Towards Large-Scale Image
Retrieval" (ECCV 2020).

Per query q and each of its positives i, the ranks in the AP are relaxed with a
sigmoid of temperature τ:

    R_P(i) = 1 + Σ_{j ∈ P, j ≠ i} σ((s_qj − s_qi) / τ)       (rank among the positives)
    R(i)   = R_P(i) + Σ_{j ∈ N} σ((s_qj − s_qi) / τ)         (rank among all)
    AP_q   = (1 / |P|) Σ_{i ∈ P} R_P(i) / R(i)

and the loss of q is 1 − AP_q. Only positives i need a rank, so a query costs |P| × M
sigmoids (M references), not M × M. The (query, positive) pairs are taken in cache-sized
panels of queries with equally many positives (`query_panels`), and a custom autograd
function computes each query's analytic gradient row alongside: memory stays a few
similarity matrices whatever the class sizes.
"""

import torch
from pytorch_metric_learning.distances import CosineSimilarity
from pytorch_metric_learning.utils import common_functions as c_f
from torch.autograd.function import once_differentiable

from .._checks import check_numbers
from .base import (
    RankLossBase,
    label_pairs,
    pair_masks,
    reference_is_batch,
    with_query_as_positive,
    with_query_as_positive_pairs,
)
from .query_panels import (
    any_per_row,
    differences,
    jacobian_buffer,
    left_out_by_panel,
    left_out_filled_,
    left_out_of,
    own_columns,
    panel_buffer,
    query_panels,
    true_entries,
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
        if indices_tuple is None:  # no [queries, references] mask is needed
            pair_query, pair_positive = label_pairs(labels, ref_labels)
            has_positive = torch.bincount(pair_query, minlength=len(labels)) > 0
        else:
            positive, negative = pair_masks(labels, ref_labels, indices_tuple)
            has_positive = any_per_row(positive)
        self.num_queries = int(has_positive.sum())
        if self.num_queries == 0:
            return self.zero_losses()
        # Without a separate ref_emb, PML's distance normalises the embeddings once.
        matrix = self.distance(embeddings, None if ref_emb is embeddings else ref_emb)
        scores = matrix if self.distance.is_inverted else -matrix
        if indices_tuple is None:
            left_out = None
            if self.include_query:
                scores, pair_query, pair_positive = with_query_as_positive_pairs(
                    self.distance, embeddings, ref_emb, scores, pair_query, pair_positive
                )
            elif reference_is_batch(labels, ref_labels):
                left_out = own_columns(len(labels), scores.device)
        else:
            if self.include_query:
                scores, positive, negative = with_query_as_positive(
                    self.distance, embeddings, ref_emb, scores, positive, negative
                )
            left_out = left_out_of(positive, negative)
            pair_query, pair_positive = true_entries(positive)
        if self.num_queries < len(has_positive):  # a query whose only positive is itself is left out
            kept = has_positive[pair_query]
            pair_query, pair_positive = pair_query[kept], pair_positive[kept]
        ap = SmoothAPFunction.apply(scores, pair_query, pair_positive, left_out, self.temperature)
        queries = torch.where(has_positive)[0]
        return {"loss": {"losses": 1 - ap[queries], "indices": queries, "reduction_type": "element"}}


class SmoothAPFunction(torch.autograd.Function):
    """Smooth-AP of every query (0 for a query without positives) from `scores`
    (queries x references), the positive pairs (`pair_query`, `pair_positive`: row-major
    index tensors), the pairs `left_out` of each query's ranking (see
    `query_panels.left_out_filled_`; every other reference is a negative) and τ; exact
    analytic gradient with respect to `scores`, each query's row computed in the forward
    pass (`query_panels`)."""

    @staticmethod
    def forward(ctx, scores, pair_query, pair_positive, left_out, temperature):
        inputs = scores, pair_query, pair_positive, left_out, temperature
        ap, ctx.jacobian = _ap_and_jacobian(*inputs, ctx.needs_input_grad[0])
        ctx.save_for_backward(scores, pair_query, pair_positive)
        ctx.left_out, ctx.temperature = left_out, temperature
        return ap

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_ap):
        # Each AP depends on its own row of scores only: the rows of its Jacobian scaled
        # by the incoming gradient, in place (a fresh matrix costs page faults).
        jacobian, ctx.jacobian = ctx.jacobian, None
        if jacobian is None:  # a second backward pass through the graph (retain_graph=True)
            _, jacobian = _ap_and_jacobian(*ctx.saved_tensors, ctx.left_out, ctx.temperature, True)
        return jacobian.mul_(grad_ap.unsqueeze(1)), None, None, None, None


def _ap_and_jacobian(scores, pair_query, pair_positive, left_out, temperature, with_jacobian):
    """`SmoothAPFunction`'s AP per query and, when asked, the [queries, references]
    Jacobian of each query's AP with respect to its row of `scores` (else None)."""
    own = scores[pair_query, pair_positive] / temperature
    ap = scores.new_zeros(len(scores))
    jacobian = jacobian_buffer(scores, pair_query) if with_jacobian else None
    panels = query_panels(pair_query, *scores.shape)
    buffer = panel_buffer(scores, panels, scores.shape[1])
    for (queries, pairs), panel_left_out in zip(panels, left_out_by_panel(left_out, panels, len(scores))):
        # σ((s_qj − s_qi) / τ) for the panel's queries q, their positives i and every
        # reference j; one left out of q's ranking has s_qj = −inf: σ = 0, slope 0.
        scaled = left_out_filled_(scores[queries] / temperature, queries, panel_left_out)
        panel_own = own[pairs]
        over_all = differences(scaled, panel_own, buffer).sigmoid_()
        over_positives = differences(panel_own, panel_own).sigmoid_()
        # The positive's own column adds σ(0) = 1/2: its rank is 1 + the others' sum.
        rank = over_all.sum(2).add_(0.5)
        precision = over_positives.sum(2).add_(0.5).div_(rank)
        ap[queries] = precision.mean(1)
        if jacobian is None:
            continue
        # d(R_P / R) = dR_P / R − R_P dR / R², and d σ((s_j − s_i)/τ) / d s_j =
        # σ(1 − σ) / τ, the opposite for s_i: each row's sum goes to the positive i.
        scale = rank.reciprocal_().mul_(1 / (pairs.shape[1] * temperature))
        weight_all = precision.mul_(scale).neg_()
        slope = over_all.addcmul_(over_all, over_all, value=-1)
        grad_positives = over_positives.addcmul_(over_positives, over_positives, value=-1).mul_(scale.unsqueeze(2))
        own_column = grad_positives.sum(1).sub_(grad_positives.sum(2)).addcmul_(weight_all, slope.sum(2), value=-1)
        if isinstance(queries, slice):
            rows = jacobian[queries]
            torch.bmm(weight_all.unsqueeze(1), slope, out=rows.unsqueeze(1))
            rows.scatter_add_(1, pair_positive[pairs], own_column)
        else:
            rows = torch.bmm(weight_all.unsqueeze(1), slope).squeeze(1)
            jacobian[queries] = rows.scatter_add_(1, pair_positive[pairs], own_column)
    return ap, jacobian
