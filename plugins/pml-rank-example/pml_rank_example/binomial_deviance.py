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
            if indices_tuple is None:
                loss = self.all_pairs_loss(sim, labels, ref_labels)
            else:
                loss = self.listed_pairs_loss(sim, labels, indices_tuple, ref_labels, dtype)
        if loss is None:
            return self.zero_losses()
        return {"loss": {"losses": loss, "indices": None, "reduction_type": "already_reduced"}}

    def listed_pairs_loss(self, sim, labels, indices_tuple, ref_labels, dtype):
        """The loss over the pairs of `indices_tuple` (None when it has no positive or no
        negative pair), in `dtype`."""
        a1, p, a2, n = lmu.convert_to_pairs(indices_tuple, labels, ref_labels)
        if len(a1) == 0 or len(a2) == 0:
            return None
        positive = F.softplus(-self.alpha * (sim[a1, p].to(dtype) - self.beta))
        negative = F.softplus(self.alpha * self.cost * (sim[a2, n].to(dtype) - self.beta))
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


# Beyond this many pairs the deviance's passes run on `ROW_BLOCKS` blocks of the matrix's rows,
# so that its float32 working copies (the arguments, the deviances, their gradients) take a
# quarter of a matrix at once: a call launches at most 4 times the kernels, whatever the batch.
BLOCKED_FROM = 1 << 24
ROW_BLOCKS = 4


class _PairMeans(torch.autograd.Function):
    """The mean deviance softplus(m (s − β)) of the positive pairs (m = −α) plus that of the
    negative pairs (m = α · cost) of a similarity matrix, self-pairs (its diagonal, when
    `no_diagonal`) in neither, computed in float32 (float64 for a float64 matrix) from a
    matrix kept as it is (autocast's half-precision product: no float32 copy). The backward
    pass recomputes m (s − β) from the similarities: what autograd would keep of the
    elementwise steps (m, the arguments, the masked deviances) is three more matrices at
    once, at batch 8192 over 5 times the similarity product's own peak memory."""

    @staticmethod
    def forward(ctx, sim, positive, no_diagonal, num_positive, num_negative, alpha, beta, cost):
        positive_sum = negative_sum = 0
        for rows in _row_blocks(sim):
            deviance = F.softplus(_arguments(sim[rows], positive[rows], alpha, beta, cost))
            if no_diagonal:  # the block's own pairs (i, i): its diagonal from column rows.start
                deviance.diagonal(rows.start).zero_()
            block_positive = deviance.where(positive[rows], 0).sum()
            positive_sum = positive_sum + block_positive
            negative_sum = negative_sum + (deviance.sum() - block_positive)
        ctx.save_for_backward(sim, positive, num_positive, num_negative)
        ctx.constants = no_diagonal, alpha, beta, cost
        return positive_sum / num_positive.clamp(min=1) + negative_sum / num_negative.clamp(min=1)

    @staticmethod
    def backward(ctx, grad):
        sim, positive, num_positive, num_negative = ctx.saved_tensors
        no_diagonal, alpha, beta, cost = ctx.constants
        dtype = torch.promote_types(sim.dtype, torch.float32)
        counts = [n.clamp(min=1).to(dtype) for n in (num_positive, num_negative)]
        # d/ds of softplus(m (s − β)) / count is σ(m (s − β)) · m / count; rounded to the
        # matrix's precision once, where each block is stored.
        scales = (-alpha / counts[0] * grad, alpha * cost / counts[1] * grad)
        blocks = _row_blocks(sim)
        if len(blocks) == 1:
            grad_sim = _block_gradient(sim, positive, blocks[0], no_diagonal, scales, alpha, beta, cost).to(sim.dtype)
        else:
            grad_sim = torch.empty_like(sim)
            for rows in blocks:
                grad_sim[rows] = _block_gradient(sim, positive, rows, no_diagonal, scales, alpha, beta, cost)
        return grad_sim, None, None, None, None, None, None, None


def _block_gradient(sim, positive, rows, no_diagonal, scales, alpha, beta, cost):
    """The gradient of rows `rows`: σ(m (s − β)) times the positive or the negative pairs' scale."""
    block = _arguments(sim[rows], positive[rows], alpha, beta, cost).sigmoid_()
    block.mul_(torch.where(positive[rows], *scales))
    if no_diagonal:  # the block's own pairs (i, i): its diagonal from column rows.start
        block.diagonal(rows.start).zero_()
    return block


def _row_blocks(sim):
    """Slices of `sim`'s rows: all of them, or `ROW_BLOCKS` blocks of a matrix of more than
    `BLOCKED_FROM` entries."""
    blocks = ROW_BLOCKS if sim.numel() > BLOCKED_FROM else 1
    bounds = [len(sim) * k // blocks for k in range(blocks + 1)]
    return [slice(start, stop) for start, stop in zip(bounds, bounds[1:]) if stop > start]


def _arguments(sim, positive, alpha, beta, cost):
    """m (s − β) in float32 (or float64): −α at the positive pairs, α · cost elsewhere."""
    dtype = torch.promote_types(sim.dtype, torch.float32)
    # s − β on a copy that is float32's (or float64's) already: a half-precision s's own copy
    shifted = sim - beta if sim.dtype == dtype else sim.to(dtype).sub_(beta)
    return torch.full_like(sim, alpha * cost, dtype=dtype).masked_fill_(positive, -alpha).mul_(shifted)
