"""ROADMAP: Ramzi et al., "Robust and Decomposable Average Precision for Image Retrieval"
(NeurIPS 2021).

SupAP replaces the step function of a negative j ranked against a positive i of query q
(x = s_qj − s_qi) by a bound that never vanishes above the positive:

    H⁻(x) = σ(x / τ)                 x ≤ 0
            start + σ(x / τ)         0 < x ≤ δ
            ρ (x − δ) + offset       x > δ

(the σ arguments clamped to [−50, 50] as in the authors' code), while positives keep
the exact step H (1 at ties): with R⁺(i) = #{positives j: s_qj ≥ s_qi} (i included),

    AP_q = (1 / |P|) Σ_{i ∈ P} R⁺(i) / (R⁺(i) + Σ_{j ∈ N} H⁻(s_qj − s_qi))

and the SupAP loss of q is 1 − AP_q: only negatives carry a gradient. The calibration
loss, on the same similarities, is the contrastive loss with pos_margin α = 0.9 and
neg_margin β = 0.6, each of its two terms averaged over its non-zero pairs (the authors'
`CalibrationLoss` is PML's `ContrastiveLoss` with those margins); ROADMAP is
(1 − λ) L_SupAP + λ L_calibr.
"""

import math

import torch
from pytorch_metric_learning.distances import CosineSimilarity
from pytorch_metric_learning.reducers import AvgNonZeroReducer, MeanReducer, MultipleReducers
from pytorch_metric_learning.utils import common_functions as c_f
from torch.autograd.function import once_differentiable

from .. import _device_policy
from .._checks import check_numbers
from . import fused_calibration
from .base import (
    RankLossBase,
    SumOfReducers,
    pair_masks,
    plain_reducer,
    ranking_by_label,
    with_query_as_positive,
)
from .fused_ranks import FusedForm
from .pnp import SIGMOID_CLAMP
from .query_panels import LabelWeights, any_per_row, mask_weights, relaxed_ranks, true_entries, true_rows


class SupAPBound:
    """H⁻(x) (see the module's docstring) and its derivative, for `query_panels.RelaxedRanks`."""

    def __init__(self, temperature, rho, offset, delta, start):
        self.temperature, self.rho, self.offset, self.delta, self.start = temperature, rho, offset, delta, start
        self.jump = offset - start - 1 / (1 + math.exp(-max(min(delta / temperature, SIGMOID_CLAMP), -SIGMOID_CLAMP)))
        self.fused = FusedForm(temperature, SIGMOID_CLAMP, delta, rho, start, self.jump)
        # (x, σ(min(x, δ) / τ)) of the last `value`, for `slope` on the same x.
        self._sigmoid_of = None

    def value(self, x):
        # H⁻(x) = σ(min(x, δ) / τ) + start·[x > 0] + ρ·[x − δ]₊ + jump·[x > δ], with jump
        # = offset − start − σ(δ/τ) (0 when H⁻ is continuous): elementwise passes only,
        # no boolean indexing (a B x B nonzero costs more than the rest).
        extra = (x - self.delta).clamp_(min=0).mul_(self.rho)
        # The steps as 1.0 and 0.0 written straight into floats (boolean tensors are several
        # times slower to make and to add), into the buffer that then takes the sigmoids.
        buffer = torch.empty_like(x)
        if self.jump:
            extra.add_(torch.gt(x, self.delta, out=buffer), alpha=self.jump)
        if self.start:
            extra.add_(torch.gt(x, 0, out=buffer), alpha=self.start)
        # The clamp keeps float32 away from the denormals of σ(−88) and below; x stays
        # as it is for `slope`, which takes these sigmoids (the dearest pass) as they are.
        sigmoid = torch.clamp(x, max=self.delta, out=buffer)
        sigmoid = sigmoid.div_(self.temperature).clamp_(-SIGMOID_CLAMP, SIGMOID_CLAMP).sigmoid_()
        self._sigmoid_of = (x, sigmoid)
        return extra.add_(sigmoid)

    def slope(self, x, values):
        # ρ beyond δ, σ's slope up to it, as slope − slope · [x > δ] + ρ · [x > δ] in floats
        # (the same numbers as a boolean masked_fill_, several times faster), in the
        # buffers of the values and of the sigmoids. Up to δ, min(x, δ) is x: the sigmoids of
        # `value` on this x are σ(x / τ); beyond it their slope is taken away, whatever it is.
        beyond = torch.gt(x, self.delta, out=values)
        kept, self._sigmoid_of = self._sigmoid_of, None
        if kept is not None and kept[0] is x:
            sigmoid = kept[1]
        else:  # Beyond the clamp the authors' gradient is 0, this one σ'(±50) / τ ≈ 2e-22 / τ.
            sigmoid = x.div_(self.temperature).clamp_(-SIGMOID_CLAMP, SIGMOID_CLAMP).sigmoid_()
        slopes = sigmoid.addcmul_(sigmoid, sigmoid, value=-1).div_(self.temperature)
        return slopes.addcmul_(slopes, beyond, value=-1).add_(beyond, alpha=self.rho)


class SupAPLoss(RankLossBase):
    """SupAP: 1 − the AP of each query with its negatives' ranks bounded by H⁻ (linear,
    slope ρ, beyond δ above a positive) and its positives' ranks exact.

    Args:
        temperature: τ of the sigmoids, in the similarity's units (cosine by default).
        rho: ρ, the slope beyond δ.
        offset: H⁻ just beyond δ; None (the paper's and the authors' class default):
            start + σ(δ/τ), which makes H⁻ continuous. Their configuration files say 1.44,
            written for their first code's ρx + offset (6.44 here gives that function).
        delta: δ, where the linear part starts (0: right above the positive).
        start: H⁻'s jump at 0 (the authors' iNaturalist configuration uses 0 with offset 1).

    Defaults: the authors' (τ, ρ, δ of config/loss/supap.yaml). Each query is one of
    its own positives, by its self-similarity, as in the authors' code (its column when
    the references are the batch, an extra one with `ref_emb`); a query without another
    positive is left out. With `ref_emb` every reference counts; an `indices_tuple`
    restricts each ranking to its pairs. Per-query losses go to PML's reducer ("element");
    the default MeanReducer gives the authors' 1 − mAP.
    """

    finite_for_bounded_scores = True  # see RankLossBase

    def __init__(
        self,
        temperature: float = 0.01,
        rho: float = 100.0,
        offset: float | None = None,
        delta: float = 0.05,
        start: float = 0.5,
        **kwargs,
    ):
        super().__init__(**kwargs)
        check_numbers(self, "> 0", temperature=temperature)
        check_numbers(self, ">= 0", rho=rho, delta=delta, start=start)
        if offset is not None:
            check_numbers(self, "", offset=offset)
        self.temperature, self.rho, self.delta, self.start = float(temperature), float(rho), float(delta), float(start)
        if offset is None:
            offset = self.start + 1 / (1 + math.exp(-min(self.delta / self.temperature, SIGMOID_CLAMP)))
        self.offset = float(offset)
        self.add_to_recordable_attributes(list_of_names=["temperature", "rho", "delta"], is_stat=False)
        self.add_to_recordable_attributes(list_of_names=["num_queries"], is_stat=True)

    def get_default_distance(self):
        return CosineSimilarity()

    def compute_loss(self, embeddings, labels, indices_tuple, ref_emb, ref_labels):
        c_f.labels_required(labels)
        by_label = ranking_by_label(labels, ref_labels, indices_tuple, embeddings, ref_emb)
        if by_label is not None:
            matrix = (
                self.similarity_matrix(embeddings, ref_emb, half=self.reads_half_product())
                if by_label.num_queries
                else None
            )
            return {"loss": self.ap_losses_by_label(matrix, labels, by_label)}
        matrix, positive, negative = self.pairs(embeddings, labels, indices_tuple, ref_emb, ref_labels)
        return {"loss": self.ap_losses(matrix, positive, negative, embeddings, ref_emb)}

    def pairs(self, embeddings, labels, indices_tuple, ref_emb, ref_labels):
        """The distance matrix and the positive and negative pair masks."""
        positive, negative = pair_masks(labels, ref_labels, indices_tuple)
        return self.similarity_matrix(embeddings, ref_emb, half=self.reads_half_product()), positive, negative

    def reads_half_product(self):
        """Whether only kernels read the similarity matrix (`similarity_matrix`'s `half`):
        the relaxed ranks' do."""
        return True

    def ap_losses(self, matrix, positive, negative, embeddings, ref_emb):
        """PML loss info of 1 − AP per query with a positive (0 when there is none), each
        query one of its own positives, from the pair masks."""
        has_positive = any_per_row(positive)
        self.num_queries = int(has_positive.sum())
        if self.num_queries == 0:
            return self.zero_loss()
        scores = matrix if self.distance.is_inverted else -matrix
        scores, positive, negative = with_query_as_positive(
            self.distance, embeddings, ref_emb, scores, positive.clone(), negative.clone()
        )
        queries = true_rows(has_positive, self.num_queries)
        if len(queries) < len(scores):
            scores, positive, negative = scores[queries], positive[queries], negative[queries]
        ap = self.relaxed_ap(scores, *true_entries(positive), mask_weights(negative, scores.dtype))
        return {"losses": 1 - ap, "indices": queries, "reduction_type": "element"}

    def ap_losses_by_label(self, matrix, labels, pairs):
        """`ap_losses` of a batch that ranks itself by label, from its `ranking_by_label`."""
        self.num_queries = pairs.num_queries
        if self.num_queries == 0:
            return self.zero_loss()
        scores = matrix if self.distance.is_inverted else -matrix
        weights = LabelWeights(labels, labels)
        ap = self.relaxed_ap(scores, *pairs.ranked(), weights, pairs.pairs_per_query)
        queries = pairs.kept_queries()
        return {
            "losses": 1 - (ap if len(queries) == len(ap) else ap[queries]),
            "indices": queries,
            "reduction_type": "element",
        }

    def relaxed_ap(self, scores, pair_query, pair_positive, weights, pairs_per_query=None):
        """Each query's AP over its pairs, its negatives weighed by `weights` (`relaxed_ranks`)."""
        bound = SupAPBound(self.temperature, self.rho, self.offset, self.delta, self.start)
        return relaxed_ranks(
            scores, pair_query, pair_positive, bound, supap, weights=weights, pairs_per_query=pairs_per_query
        )


def supap(negatives_above, own, queries):
    """AP of each query from Σ_{j ∈ N} H⁻(s_qj − s_qi) [queries, positives] and its
    positives' scores s_qi, with R⁺(i), how many positives (i included) score at least
    s_qi, exact and without gradient."""
    return _supap_precisions(negatives_above, own)[1].mean(1)


def _supap_precisions(negatives_above, own):
    """R⁺(i) + N(i) and the precision R⁺(i) / (R⁺(i) + N(i)) of each positive [queries,
    positives]."""
    detached = own.detach()
    rank_among_positives = (detached.unsqueeze(1) >= detached.unsqueeze(2)).sum(2, dtype=own.dtype)
    rank = rank_among_positives + negatives_above
    return rank, rank_among_positives / rank


def supap_gradients(negatives_above, own, queries, scale=1.0):
    """`supap` and `scale` times its gradient with respect to the sums (none through the
    exact R⁺), by hand: autograd's graph would cost more than the formula
    (`formula_and_gradients`). d/dN(i) of the mean of R⁺ / (R⁺ + N) is
    −R⁺ / (R⁺ + N)² / c = −precision / (R⁺ + N) / c."""
    rank, precision = _supap_precisions(negatives_above, own)
    return precision.mean(1), torch.div(precision, rank).mul_(-scale / own.shape[1]), None


supap.gradients = supap_gradients


class ROADMAPLoss(SupAPLoss):
    """ROADMAP: (1 − λ) · SupAP + λ · the calibration loss, on the same similarities.

    Args:
        lambda_: λ, the calibration's weight (0: SupAP alone; 1: the calibration alone).
        pos_margin, neg_margin: the calibration's α and β: positive pairs below α and
            negative pairs above β are penalised linearly (for a distance, above and below).
        temperature, rho, offset, delta, start: SupAP's (see `SupAPLoss`).

    The authors' configuration (config/loss/roadmap.yaml) adds the two losses with
    weight 1 each: twice this loss at λ = 0.5. Sub-losses: "ap_loss" (per query, default
    MeanReducer) and the calibration's "pos_loss" and "neg_loss" (per pair, default
    AvgNonZeroReducer, as PML's `ContrastiveLoss`); pairs are the pairs of `labels`
    (self-pairs excluded), of `ref_emb`, or of `indices_tuple`.
    """

    def __init__(self, lambda_: float = 0.5, pos_margin: float = 0.9, neg_margin: float = 0.6, **kwargs):
        super().__init__(**kwargs)
        if not 0 <= lambda_ <= 1:
            raise ValueError(f"ROADMAPLoss: lambda_ must be in [0, 1], got {lambda_!r}")
        check_numbers(self, "", pos_margin=pos_margin, neg_margin=neg_margin)
        self.lambda_, self.pos_margin, self.neg_margin = float(lambda_), float(pos_margin), float(neg_margin)
        self.add_to_recordable_attributes(list_of_names=["lambda_", "pos_margin", "neg_margin"], is_stat=False)

    def get_default_reducer(self):
        calibration = {name: AvgNonZeroReducer() for name in ("pos_loss", "neg_loss")}
        return SumOfReducers({"ap_loss": MeanReducer(), **calibration})

    def _sub_loss_names(self):
        return ["ap_loss", "pos_loss", "neg_loss"]

    def reads_half_product(self):
        """The calibration reads the matrix in a kernel too, with its default reducers
        (`fused_calibration`); otherwise in float32 torch operations."""
        return self.averaged_here("pos_loss") and self.averaged_here("neg_loss")

    def compute_loss(self, embeddings, labels, indices_tuple, ref_emb, ref_labels):
        c_f.labels_required(labels)
        # Counted before the similarity product is queued, so that their read-back does not wait for it.
        by_label = ranking_by_label(labels, ref_labels, indices_tuple, embeddings, ref_emb)
        if by_label is None:
            matrix, positive, negative = self.pairs(embeddings, labels, indices_tuple, ref_emb, ref_labels)
            ap_loss = self.ap_losses(matrix, positive, negative, embeddings, ref_emb)
        else:  # the masks only where the calibration takes them
            matrix = self.similarity_matrix(embeddings, ref_emb, half=self.reads_half_product())
            positive = negative = None
            ap_loss = self.ap_losses_by_label(matrix, labels, by_label)
        if torch.is_tensor(ap_loss["losses"]):
            ap_loss["losses"] = ap_loss["losses"] * (1 - self.lambda_)
        if self.averaged_here("pos_loss") and self.averaged_here("neg_loss"):
            # Each term that reducer's mean over the non-zero losses, taken here: picking the pairs out
            # (index tensors as long as the pairs, then the reducer's own boolean selection) costs more
            # memory and time than the rest of the term, and waits for the device.
            sign = 1.0 if self.distance.is_inverted else -1.0
            pairs = labels if by_label is not None else (positive, negative)
            terms = (fused_calibration.calibration_terms if fused_calibration.applies(matrix) else calibration_terms)(
                matrix, pairs, self.pos_margin, self.neg_margin, self.lambda_, sign
            )
            pos_loss, neg_loss = (
                {"losses": term, "indices": None, "reduction_type": "already_reduced"} for term in terms
            )
            return {"ap_loss": ap_loss, "pos_loss": pos_loss, "neg_loss": neg_loss}
        if positive is None:
            positive, negative = pair_masks(labels, ref_labels)
        # PML's margin(x, y) is y − x for a similarity, x − y for a distance.
        return {
            "ap_loss": ap_loss,
            "pos_loss": self.calibration("pos_loss", self.distance.margin(matrix, self.pos_margin), positive),
            "neg_loss": self.calibration("neg_loss", self.distance.margin(self.neg_margin, matrix), negative),
        }

    def calibration(self, name, shortfall, pairs):
        """PML loss info of the calibration term `name` for a reducer of the caller's, as PML's
        contrastive loss gives it: λ · relu(shortfall) at the pairs of the mask `pairs`, and
        their indices."""
        indices = pairs.nonzero(as_tuple=True)
        if len(indices[0]) == 0:
            return self.zero_loss()
        reduction_type = "pos_pair" if name == "pos_loss" else "neg_pair"
        return {
            "losses": torch.relu(shortfall[indices]) * self.lambda_,
            "indices": indices,
            "reduction_type": reduction_type,
        }

    def averaged_here(self, name):
        """Whether the sub-loss `name` goes to a plain AvgNonZeroReducer (the default) that
        records no statistics, so that `calibration` may take its mean itself, through
        MultipleReducers nested at any depth (PML's own nesting of a default)."""
        reducer = self.reducer
        while isinstance(reducer, MultipleReducers):
            reducer = reducer.reducers[name] if name in reducer.reducers else reducer.default_reducer
        return plain_reducer(reducer, AvgNonZeroReducer)


def calibration_terms(matrix, pairs, pos_margin, neg_margin, lambda_, sign):
    """`fused_calibration.calibration_terms` in torch operations, wherever its kernels do not run
    (the CPU): (positive term, negative term), each λ · the mean of the non-zero shortfalls
    relu(sign · (α − s)) of the positive pairs and relu(sign · (s − β)) of the negative ones (PML's
    ContrastiveLoss with its AvgNonZeroReducer), differentiable with respect to `matrix`. `pairs`:
    the (positive, negative) boolean masks, or the labels of a batch that is its own references."""
    return _CalibrationTerms.apply(matrix, pairs, (pos_margin, neg_margin, lambda_, sign))


class _CalibrationTerms(torch.autograd.Function):
    """A panel of rows at a time (`_device_policy`: in a CPU core's cache), each pass over it
    forward and backward, where the whole-matrix expression (margin, mask, weight, relu, count,
    sum; and autograd's pass for each) went through memory a dozen times each way and kept as many
    matrices; pairs by label compared a panel at a time, no [B, B] masks. The masks weigh the
    shortfalls as 1.0 and 0.0 (a boolean `where` is 8 times slower on the CPU): the same numbers,
    and with one panel the same sums, bit for bit."""

    @staticmethod
    def forward(ctx, matrix, pairs, parameters):
        lambda_ = parameters[2]
        totals, counts = [0, 0], [0, 0]
        for rows in _row_panels(matrix):
            for term, losses in enumerate(_panel_losses(matrix, pairs, rows, parameters)):
                # λ · relu(x) as relu(λ · x), λ >= 0; the reducer counts the losses > 0.
                losses = losses.mul_(lambda_).relu_()
                totals[term] = totals[term] + losses.sum()
                counts[term] = counts[term] + torch.count_nonzero(losses)
        counts = [torch.as_tensor(count, device=matrix.device).clamp(min=1) for count in counts]
        masks = isinstance(pairs, tuple)
        ctx.save_for_backward(matrix, *counts, *(pairs if masks else (pairs,)))
        ctx.parameters, ctx.masks = parameters, masks
        return tuple(torch.as_tensor(total, dtype=matrix.dtype, device=matrix.device) / count
                     for total, count in zip(totals, counts))  # fmt: skip

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_positive, grad_negative):
        matrix, *counts_and_pairs = ctx.saved_tensors
        counts, pairs = counts_and_pairs[:2], (tuple(counts_and_pairs[2:]) if ctx.masks else counts_and_pairs[2])
        _, _, lambda_, sign = ctx.parameters
        # d/ds of each term at a pair with a loss: (incoming / count) · λ times d shortfall / ds,
        # −sign for the positive pairs and sign for the negative ones (as autograd's steps round them).
        slopes = [
            (grad / count).mul(lambda_) * direction
            for grad, count, direction in zip((grad_positive, grad_negative), counts, (-sign, sign))
        ]
        grad = torch.empty_like(matrix)
        for rows in _row_panels(matrix):
            positive, negative = (
                losses.mul_(lambda_).gt_(0) for losses in _panel_losses(matrix, pairs, rows, ctx.parameters)
            )
            torch.mul(positive, slopes[0], out=grad[rows]).addcmul_(negative, slopes[1])
        return grad, None, None


def _row_panels(matrix):
    """Slices of `matrix`'s rows, as many as `_device_policy.work_budget` holds (at least one)."""
    rows, columns = matrix.shape
    step = max(1, _device_policy.work_budget(matrix.device, matrix.numel()) // max(columns, 1))
    return [slice(start, start + step) for start in range(0, rows, step)]


def _panel_losses(matrix, pairs, rows, parameters):
    """The shortfalls of the positive and the negative pairs of rows `rows`, 0 at the other pairs:
    α − s and s − β for a similarity (sign 1), the opposite for a distance, the numbers PML's
    `margin` gives."""
    pos_margin, neg_margin, _, sign = parameters
    panel = matrix[rows]
    if isinstance(pairs, tuple):  # the masks
        positive, negative = (mask[rows] for mask in pairs)
        pos, neg = torch.where(positive, panel, pos_margin), torch.where(negative, panel, neg_margin)
    else:  # labels of a batch that is its own references: the same label, (i, i) aside; another label
        same = torch.eq(pairs[rows].unsqueeze(1), pairs.unsqueeze(0))
        pos, neg = torch.where(same, panel, pos_margin), torch.where(same, neg_margin, panel)
    # In place; the margins' own entries become exactly 0. (−s + α is α − s, bit for bit.)
    pos = pos.neg_().add_(pos_margin) if sign > 0 else pos.sub_(pos_margin)
    neg = neg.sub_(neg_margin) if sign > 0 else neg.neg_().add_(neg_margin)
    if not isinstance(pairs, tuple):
        pos.diagonal(rows.start).zero_()
    return pos, neg
