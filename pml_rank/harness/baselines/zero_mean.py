"""The regulariser of the Reality Check's signal-to-noise-ratio contrastive loss."""

import torch.nn.functional as F
from pytorch_metric_learning.regularizers import ZeroMeanRegularizer


class NormalizedZeroMeanRegularizer(ZeroMeanRegularizer):
    """PML's `ZeroMeanRegularizer` on L2-normalised embeddings: ``|sum_j e_j|`` of each
    unit-length embedding ``e``, averaged over the batch. The paper ran PML <= 0.9.86, whose
    SignalToNoiseRatioContrastiveLoss computed this term (times ``regularizer_weight``) on
    the embeddings its base class had normalised; PML 2.9's regulariser sees them raw."""

    def compute_loss(self, embeddings):
        return super().compute_loss(F.normalize(embeddings, p=2, dim=1))
