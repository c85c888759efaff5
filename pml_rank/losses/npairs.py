"""Multi-class N-pair loss and its one-vs-one variant (Sohn, NIPS 2016)."""

import torch
import torch.nn.functional as F
from pytorch_metric_learning.distances import DotProductSimilarity
from pytorch_metric_learning.regularizers import LpRegularizer
from pytorch_metric_learning.utils import common_functions as c_f
from pytorch_metric_learning.utils import loss_and_miner_utils as lmu

from .base import RankLossBase, reference_is_batch


class NPairsMCLoss(RankLossBase):
    """N-pair-mc: for N pairs (f_i, f_i⁺) of N distinct classes,

        mean_i log(1 + Σ_{j≠i} exp(s(f_i, f_j⁺) − s(f_i, f_i⁺)))
        + l2_reg_weight · mean over the batch of ‖f‖²

    with s the distance's similarity (the paper's inner product f_iᵀf_j⁺ by default).

    Pairs are formed exactly as PML's ``NPairsLoss`` forms them, so with
    ``l2_reg_weight=0`` and the same distance both compute the same function: for each
    class, the anchor is its first sample in the batch and the positive its second
    (classes with a single sample are left out), or, given ``indices_tuple``, the first
    positive pair of each anchor label; given ``ref_emb``, positives come from ``ref_emb``
    (the first sample of the anchor's class there) and so do the negatives.

    Args:
        l2_reg_weight: weight of the penalty on squared embedding norms, which keeps
            the unnormalised inner products from growing without bound (0 switches it
            off). Implemented as PML's ``LpRegularizer(power=2)`` embedding regularizer,
            reported as the sub-loss ``embedding_reg_loss``.
        distance: default ``DotProductSimilarity(normalize_embeddings=False)``, the
            paper's inner product. PML's ``NPairsLoss`` defaults to the normalised one
            (cosine similarity); pass ``DotProductSimilarity()`` to get that.
    """

    def __init__(self, l2_reg_weight=0.002, **kwargs):
        if l2_reg_weight < 0:
            raise ValueError(f"{type(self).__name__}: l2_reg_weight must be >= 0, got {l2_reg_weight}")
        if l2_reg_weight > 0:
            if kwargs.get("embedding_regularizer") is not None:
                raise ValueError(
                    f"{type(self).__name__}: l2_reg_weight={l2_reg_weight} is itself an embedding "
                    "regularizer; pass l2_reg_weight=0 to use your own embedding_regularizer"
                )
            kwargs["embedding_regularizer"] = LpRegularizer(p=2, power=2)
            kwargs["embedding_reg_weight"] = l2_reg_weight
        super().__init__(**kwargs)
        self.l2_reg_weight = l2_reg_weight
        self.add_to_recordable_attributes(name="l2_reg_weight", is_stat=False)
        self.add_to_recordable_attributes(name="num_pairs", is_stat=True)

    def compute_loss(self, embeddings, labels, indices_tuple, ref_emb, ref_labels):
        c_f.labels_required(labels)
        using_ref = not reference_is_batch(labels, ref_labels)
        anchor_idx, positive_idx = self.pairs(labels, indices_tuple, using_ref, ref_labels)
        self.num_pairs = len(anchor_idx)
        if self.num_pairs == 0:
            return self.zero_losses()
        similarities = self.distance(embeddings[anchor_idx], ref_emb[positive_idx])
        if not self.distance.is_inverted:
            similarities = -similarities
        return {
            "loss": {
                "losses": self.per_anchor_losses(similarities),
                "indices": anchor_idx,
                "reduction_type": "element",
            }
        }

    def per_anchor_losses(self, similarities):
        """Row i holds s(f_i, f_j⁺) for every j; the positive is on the diagonal.
        log(1 + Σ_{j≠i} exp(s_ij − s_ii)) is the cross entropy of row i with target i."""
        targets = torch.arange(len(similarities), device=similarities.device)
        return F.cross_entropy(similarities, targets, reduction="none")

    @staticmethod
    def pairs(labels, indices_tuple=None, using_ref=False, ref_labels=None):
        """(anchor indices, positive indices), one pair per class, in PML's order
        (ascending label). Positive indices point into ``ref_emb`` when ``using_ref``."""
        if indices_tuple is None and not using_ref:
            return first_two_of_each_class(labels)
        if indices_tuple is None:
            indices_tuple = lmu.get_all_pairs_indices(labels, ref_labels)
        return lmu.convert_to_pos_pairs_with_unique_labels(indices_tuple, labels)

    def get_default_distance(self):
        return DotProductSimilarity(normalize_embeddings=False)


class NPairsOVOLoss(NPairsMCLoss):
    """N-pair-ovo (one-vs-one): the same pairs and penalty as :class:`NPairsMCLoss`,
    but each negative is contrasted with the positive on its own,

        mean_i Σ_{j≠i} log(1 + exp(s(f_i, f_j⁺) − s(f_i, f_i⁺))).
    """

    def per_anchor_losses(self, similarities):
        margins = similarities - similarities.diagonal().unsqueeze(1)
        # softplus(-inf) = 0 drops the j = i term exactly.
        eye = torch.eye(len(margins), dtype=torch.bool, device=margins.device)
        return F.softplus(margins.masked_fill(eye, -float("inf"))).sum(dim=1)


def first_two_of_each_class(labels):
    """For every label with at least two samples: its first and second index in the
    batch, as (anchors, positives) sorted by label. The same pairs as PML's
    ``convert_to_pos_pairs_with_unique_labels`` on all pairs, in O(B log B) instead of
    the B×B match matrix."""
    order = torch.argsort(labels, stable=True)
    sorted_labels = labels[order]
    starts = torch.ones_like(sorted_labels, dtype=torch.bool)
    starts[1:] = sorted_labels[1:] != sorted_labels[:-1]
    first = starts.nonzero().squeeze(1)
    # The sample after a class's first has the same label unless it starts the next
    # class (or is past the end, hence the appended True).
    has_second = ~torch.cat([starts, starts.new_ones(1)])[first + 1]
    return order[first[has_second]], order[first[has_second] + 1]
