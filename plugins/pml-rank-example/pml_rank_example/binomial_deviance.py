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
        # In float32 under autocast too: the means of many pairs keep no digits in 16 bits.
        with torch.autocast(embeddings.device.type, enabled=False):
            dtype = torch.promote_types(embeddings.dtype, torch.float32)
            queries = embeddings.to(dtype)
            sim = self.distance(queries, queries if ref_emb is embeddings else ref_emb.to(dtype))
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
        negative = ~positive
        self_pairs = len(labels) if ref_labels is labels else 0
        if self_pairs:
            positive.fill_diagonal_(False)
        # -alpha for the positive pairs, alpha * cost for the negative ones.
        factor = torch.full_like(sim, self.alpha * self.cost).masked_fill_(positive, -self.alpha)
        deviance = F.softplus((sim - self.beta).mul_(factor))
        # Not mask.sum(): a sum of booleans converts them to int64 first. Every pair but
        # the self-pairs is positive or negative: one count gives both.
        num_positive = torch.count_nonzero(positive)
        num_negative = sim.numel() - self_pairs - num_positive
        positive_mean = deviance.where(positive, 0).sum() / num_positive.clamp(min=1)
        negative_mean = deviance.where(negative, 0).sum() / num_negative.clamp(min=1)
        both = (num_positive > 0) & (num_negative > 0)
        return torch.where(both, positive_mean + negative_mean, 0)

    def get_default_distance(self):
        return CosineSimilarity()
