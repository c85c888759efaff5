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
        a1, p, a2, n = lmu.convert_to_pairs(indices_tuple, labels, ref_labels)
        if len(a1) == 0 or len(a2) == 0:
            return self.zero_losses()
        # In float32 under autocast too: the means of many pairs keep no digits in 16 bits.
        with torch.autocast(embeddings.device.type, enabled=False):
            dtype = torch.promote_types(embeddings.dtype, torch.float32)
            queries = embeddings.to(dtype)
            sim = self.distance(queries, queries if ref_emb is embeddings else ref_emb.to(dtype))
            positive = F.softplus(-self.alpha * (sim[a1, p] - self.beta))
            negative = F.softplus(self.alpha * self.cost * (sim[a2, n] - self.beta))
            loss = positive.mean() + negative.mean()
        return {"loss": {"losses": loss, "indices": None, "reduction_type": "already_reduced"}}

    def get_default_distance(self):
        return CosineSimilarity()
