"""PML's ProxyNCA loss with finite gradients at the Reality Check's large softmax scales."""

import torch
from pytorch_metric_learning.losses import ProxyNCALoss
from pytorch_metric_learning.utils import common_functions as c_f
from pytorch_metric_learning.utils import loss_and_miner_utils as lmu


class LogSpaceProxyNCALoss(ProxyNCALoss):
    """PML's `ProxyNCALoss` (same constructor, proxies and function) with ``-log p``, p the
    softmax probability of the sample's own proxy, computed as a difference of
    log-sum-exps. PML takes the log of p itself: once p is subnormal in float32 (a logit gap
    of about 88 to 103, reached at softmax_scale above about 40 on random embeddings, while
    the paper searched up to 100) 1/p overflows and every gradient of the batch is NaN; a
    sample whose p underflows to 0 is dropped. Here both give the finite -log p."""

    def nca_computation(self, query, reference, query_labels, reference_labels, indices_tuple):
        # The reference is the proxies (ProxyNCALoss.compute_loss), never the query itself.
        miner_weights = lmu.convert_to_weights(indices_tuple, query_labels, dtype=query.dtype, using_ref=True)
        logits = self.distance(query, reference)
        if not self.distance.is_inverted:
            logits = -logits
        logits = self.softmax_scale * logits
        same = query_labels.unsqueeze(1) == reference_labels.unsqueeze(0)
        own = torch.logsumexp(logits.masked_fill(~same, c_f.neg_inf(logits.dtype)), dim=1)
        return {
            "loss": {
                "losses": (torch.logsumexp(logits, dim=1) - own) * miner_weights,
                "indices": c_f.torch_arange_from_size(query),
                "reduction_type": "element",
            }
        }
