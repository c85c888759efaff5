"""PNP loss: Li et al., "Rethinking the Optimization of Average Precision: Only Penalizing
Negative Instances before Positive Ones is Enough" (AAAI 2022).

For a query q and each of its positives i (q itself included, by its self-similarity),
the number of negatives ranked above i is relaxed with a sigmoid of temperature τ
(`anneal`):

    N(i) = Σ_{j ∈ N_q} σ((s_qj − s_qi) / τ)

and the loss of q is the mean over its positives of f(N(i)), where the variant chooses f:
O: N; Ds: log(1 + N); Iu: (1 + N) log(1 + N); Ib: (bN − log(1 + bN)) / b²; Dq:
1 − (1 + N)^−α (the mean of 1 − f is 1 − the mean of f). As in the authors' code, the
sigmoid's argument is clamped to [−50, 50]: beyond, the value is constant (and float32
never reaches the denormals of σ(−88) and below).
"""

import torch
from pytorch_metric_learning.distances import CosineSimilarity
from pytorch_metric_learning.utils import common_functions as c_f

from .._checks import check_numbers
from .base import RankLossBase, pair_masks, ranking_by_label, with_query_as_positive
from .fused_ranks import FusedForm
from .query_panels import LabelWeights, any_per_row, mask_weights, relaxed_ranks, true_entries, true_rows

# Where the authors' sigmoid stops: σ(±50) and a zero gradient beyond.
SIGMOID_CLAMP = 50.0


class ClampedSigmoid:
    """h(x) = σ(clamp(x / τ, −50, 50)) and its derivative, for `query_panels.RelaxedRanks`."""

    def __init__(self, temperature):
        self.temperature = temperature
        self.fused = FusedForm(temperature, limit=SIGMOID_CLAMP)

    def value(self, x):
        return x.div_(self.temperature).clamp_(-SIGMOID_CLAMP, SIGMOID_CLAMP).sigmoid_()

    def slope(self, x, values):
        # Beyond the clamp the authors' gradient is 0, this one σ'(±50) / τ ≈ 2e-22 / τ.
        return values.addcmul_(values, values, value=-1).div_(self.temperature)


class PNPLoss(RankLossBase):
    """PNP loss: the mean over each query's positives of a function of the relaxed number
    of negatives ranked above them; 0 for a query with every positive above every negative.

    Args:
        b: the Ib variant's b.
        alpha: the Dq variant's exponent α.
        anneal: τ of the sigmoid, in the similarity's units (cosine by default).
        variant: "O", "Ds", "Dq", "Iu" or "Ib" (PML's names; the paper's PNP-O, PNP-Dₛ,
            PNP-D_q, PNP-Iᵤ, PNP-I_b). The default is the authors' recommended run
            (PNP-D_q, α = 4); their code's parser defaults to O with α = 1, as PML does.

    The same function as PML's `PNPLoss` (and the authors' code) where they apply, plus
    `ref_emb`, an `indices_tuple` (each query's positives and negatives are its pairs),
    any PML distance (a distance is negated into a score) and per-query losses for PML's
    reducers ("element" reduction; MeanReducer, the default, gives the authors' mean).
    Each query is one of its own positives by its self-similarity, as in the authors'
    code: its column when the references are the batch, an extra one with `ref_emb`. A
    query without another positive is left out.
    """

    finite_for_bounded_scores = True  # see RankLossBase

    VARIANTS = ("O", "Ds", "Dq", "Iu", "Ib")

    def __init__(self, b: float = 2, alpha: float = 4, anneal: float = 0.01, variant: str = "Dq", **kwargs):
        super().__init__(**kwargs)
        if variant not in self.VARIANTS:
            raise ValueError(f"PNPLoss: variant must be one of {', '.join(self.VARIANTS)}, got {variant!r}")
        check_numbers(self, "> 0", b=b, alpha=alpha, anneal=anneal)
        self.b, self.alpha, self.anneal, self.variant = float(b), float(alpha), float(anneal), variant
        self.add_to_recordable_attributes(list_of_names=["anneal"], is_stat=False)
        self.add_to_recordable_attributes(list_of_names=["num_queries"], is_stat=True)

    def get_default_distance(self):
        return CosineSimilarity()

    def compute_loss(self, embeddings, labels, indices_tuple, ref_emb, ref_labels):
        c_f.labels_required(labels)
        by_label = ranking_by_label(labels, ref_labels, indices_tuple, embeddings, ref_emb)
        if by_label is not None:
            self.num_queries = by_label.num_queries
            if self.num_queries == 0:
                return self.zero_losses()
            scores = self.scores(embeddings, ref_emb)
            losses = self.penalties(scores, *by_label.ranked(), LabelWeights(labels, labels), by_label.pairs_per_query)
            queries = by_label.kept_queries()
            losses = losses if len(queries) == len(losses) else losses[queries]
            return {"loss": {"losses": losses, "indices": queries, "reduction_type": "element"}}
        positive, negative = pair_masks(labels, ref_labels, indices_tuple)
        has_positive = any_per_row(positive)
        self.num_queries = int(has_positive.sum())
        if self.num_queries == 0:
            return self.zero_losses()
        scores, positive, negative = with_query_as_positive(
            self.distance, embeddings, ref_emb, self.scores(embeddings, ref_emb), positive, negative
        )
        queries = true_rows(has_positive, self.num_queries)
        if len(queries) < len(scores):
            scores, positive, negative = scores[queries], positive[queries], negative[queries]
        losses = self.penalties(scores, *true_entries(positive), mask_weights(negative, scores.dtype))
        return {"loss": {"losses": losses, "indices": queries, "reduction_type": "element"}}

    def scores(self, embeddings, ref_emb):
        """The similarity matrix as scores: higher is closer."""
        matrix = self.similarity_matrix(embeddings, ref_emb, half=True)  # read by relaxed_ranks alone
        return matrix if self.distance.is_inverted else -matrix

    def penalties(self, scores, pair_query, pair_positive, weights, pairs_per_query=None):
        """Each query's loss over its pairs, its negatives weighed by `weights` (`relaxed_ranks`)."""
        kernel = ClampedSigmoid(self.anneal)
        formula = MeanPenalty(self.variant, self.alpha, self.b)
        losses = relaxed_ranks(
            scores, pair_query, pair_positive, kernel, formula, weights=weights, pairs_per_query=pairs_per_query
        )
        return 1 - losses if self.variant == "Dq" else losses


class MeanPenalty:
    """PNP's formula for `query_panels.RelaxedRanks`: the mean over each query's positives
    of the variant's f(N), from N [queries, positives], with its derivative by hand
    (`gradients`): autograd's graph would cost more than the formula."""

    def __init__(self, variant, alpha, b):
        self.variant, self.alpha, self.b = variant, alpha, b

    def __call__(self, above, own, queries):
        return self.penalty(above).mean(1)

    def penalty(self, above):
        """f(N) of the variant (Dq: (1 + N)^−α, subtracted from 1 after the mean)."""
        if self.variant == "O":
            return above
        if self.variant == "Ds":
            return torch.log1p(above)
        if self.variant == "Dq":
            return (1 + above) ** -self.alpha
        if self.variant == "Iu":
            return (1 + above) * torch.log1p(above)
        scaled = self.b * above  # Ib
        return (scaled - torch.log1p(scaled)) / self.b**2

    def slope(self, above):
        """f'(N), a fresh tensor."""
        if self.variant == "O":
            return torch.ones_like(above)
        if self.variant == "Ds":
            return (1 + above).reciprocal_()
        if self.variant == "Iu":
            return torch.log1p(above).add_(1)
        return above / (1 + self.b * above)  # Ib: (b − b / (1 + bN)) / b²

    def gradients(self, above, own, queries, scale=1.0):
        factor = scale / above.shape[1]
        if self.variant == "Dq":  # f' = −α (1 + N)^−α / (1 + N), from f's own powers
            shifted = 1 + above
            penalty = shifted.pow(-self.alpha)
            return penalty.mean(1), torch.div(penalty, shifted).mul_(-self.alpha * factor), None
        return self(above, own, queries), self.slope(above).mul_(factor), None
