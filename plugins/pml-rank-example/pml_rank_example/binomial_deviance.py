import torch
import torch.nn.functional as F
from pytorch_metric_learning.distances import CosineSimilarity
from pytorch_metric_learning.losses import BaseMetricLossFunction
from pytorch_metric_learning.utils import loss_and_miner_utils as lmu


class BinomialDevianceLoss(BaseMetricLossFunction):
    """Binomial deviance over all pairs (Yi et al. 2014), averaged separately over the
    positive and the negative pairs so that the many negatives do not drown the few
    positives."""

    def __init__(self, alpha=2.0, beta=0.5, cost=25.0, **kwargs):
        super().__init__(**kwargs)
        self.alpha, self.beta, self.cost = alpha, beta, cost
        self.add_to_recordable_attributes(list_of_names=["alpha", "beta", "cost"], is_stat=False)

    def compute_loss(self, embeddings, labels, indices_tuple, ref_emb, ref_labels):
        dtype = torch.promote_types(embeddings.dtype, torch.float32)
        # The similarity product in the caller's autocast precision, if any (on a GPU's tensor
        # cores: a float32 product takes 4 times as long), and everything after it in
        # float32: the means of many pairs keep no digits in 16 bits. No ref_emb for the
        # batch against itself: PML's distance then normalises it once.
        sim = self.distance(embeddings.to(dtype), None if ref_emb is embeddings else ref_emb.to(dtype))
        with torch.autocast(embeddings.device.type, enabled=False):
            sim = sim.to(dtype)
            if indices_tuple is None:
                loss = self.all_pairs_loss(sim, labels, ref_labels)
            else:
                loss = self.listed_pairs_loss(sim, labels, indices_tuple, ref_labels)
        if loss is None:
            return self.zero_losses()
        return {"loss": {"losses": loss, "indices": None, "reduction_type": "already_reduced"}}

    def listed_pairs_loss(self, sim, labels, indices_tuple, ref_labels):
        """The loss over the pairs of `indices_tuple` (None when it has no positive or no
        negative pair)."""
        a1, p, a2, n = lmu.convert_to_pairs(indices_tuple, labels, ref_labels)
        if len(a1) == 0 or len(a2) == 0:
            return None
        positive = F.softplus(-self.alpha * (sim[a1, p] - self.beta))
        negative = F.softplus(self.alpha * self.cost * (sim[a2, n] - self.beta))
        return positive.mean() + negative.mean()

    def all_pairs_loss(self, sim, labels, ref_labels):
        """The loss over every pair by label (PML's pairs: no (i, i) when the references
        are the batch): the deviance of the whole matrix, summed under the two masks.
        Picking the pairs out instead (index tensors of every pair, and a scatter of
        their gradients back) costs several times the rest on a GPU. 0 when there is no
        positive or no negative pair, without asking the device whether there is."""
        # PML's pairs (`lmu.get_all_pairs_indices`): equal labels, less (i, i) when the
        # references are the batch.
        positive = labels.unsqueeze(1) == ref_labels.unsqueeze(0)
        self_pairs = len(labels) if ref_labels is labels else 0
        if self_pairs:
            positive.fill_diagonal_(False)
        # Not mask.sum(): a sum of booleans converts them to int64 first. Every pair but
        # the self-pairs is positive or negative: one count gives both.
        num_positive = torch.count_nonzero(positive)
        num_negative = sim.numel() - self_pairs - num_positive
        loss = _PairMeans.apply(
            sim, positive, self_pairs > 0, num_positive, num_negative, self.alpha, self.beta, self.cost
        )
        return torch.where((num_positive > 0) & (num_negative > 0), loss, 0)

    def get_default_distance(self):
        return CosineSimilarity()


class _PairMeans(torch.autograd.Function):
    """The mean deviance softplus(m (s − β)) of the positive pairs (m = −α) plus that of the
    negative pairs (m = α · cost) of a similarity matrix, self-pairs (its diagonal, when
    `no_diagonal`) in neither. The backward pass recomputes m (s − β) from the
    similarities: what autograd would keep of the elementwise steps (m, the arguments,
    the masked deviances) is three more matrices at once, at batch 8192 over 5 times the
    similarity product's own peak memory."""

    @staticmethod
    def forward(ctx, sim, positive, no_diagonal, num_positive, num_negative, alpha, beta, cost):
        deviance = F.softplus(_arguments(sim, positive, alpha, beta, cost))
        if no_diagonal:
            deviance.diagonal().zero_()
        positive_sum = deviance.where(positive, 0).sum()
        negative_sum = deviance.sum() - positive_sum
        ctx.save_for_backward(sim, positive, num_positive, num_negative)
        ctx.constants = no_diagonal, alpha, beta, cost
        return positive_sum / num_positive.clamp(min=1) + negative_sum / num_negative.clamp(min=1)

    @staticmethod
    def backward(ctx, grad):
        sim, positive, num_positive, num_negative = ctx.saved_tensors
        no_diagonal, alpha, beta, cost = ctx.constants
        # d/ds of softplus(m (s − β)) / count is σ(m (s − β)) · m / count.
        grad_sim = _arguments(sim, positive, alpha, beta, cost).sigmoid_()
        positive_count, negative_count = (n.clamp(min=1).to(sim.dtype) for n in (num_positive, num_negative))
        grad_sim.mul_(torch.where(positive, -alpha / positive_count, alpha * cost / negative_count).mul_(grad))
        if no_diagonal:
            grad_sim.fill_diagonal_(0)
        return grad_sim, None, None, None, None, None, None, None


def _arguments(sim, positive, alpha, beta, cost):
    """m (s − β): −α at the positive pairs, α · cost elsewhere."""
    return torch.full_like(sim, alpha * cost).masked_fill_(positive, -alpha).mul_(sim - beta)
