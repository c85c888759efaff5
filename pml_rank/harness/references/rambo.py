"""RaMBO (Rolínek et al., CVPR 2020), straightforward: ranks from two argsorts, the rank
among positives from two more, Algorithm 1 with two more in the backward pass, and the
losses written from eq. 14-23 with plain autograd. Vectorised over rows only, as one
would write it in a hurry; ties fall where `argsort` puts them.
"""

import torch
import torch.nn.functional as F


def rank(scores):
    """Eq. 2 with a sort: 1 + position in descending order, along the last dimension."""
    return torch.argsort(torch.argsort(scores, dim=-1, descending=True), dim=-1) + 1


class BlackboxRanker(torch.autograd.Function):
    """Algorithm 1 on ranks normalised by the sequence length."""

    @staticmethod
    def forward(ctx, scores, lambda_val):
        ranks = rank(scores).to(scores.dtype) / scores.shape[-1]
        ctx.lambda_val = lambda_val
        ctx.save_for_backward(scores, ranks)
        return ranks

    @staticmethod
    def backward(ctx, grad_ranks):
        scores, ranks = ctx.saved_tensors
        perturbed = scores + ctx.lambda_val * grad_ranks
        perturbed_ranks = rank(perturbed).to(scores.dtype) / scores.shape[-1]
        return -(ranks - perturbed_ranks) / ctx.lambda_val, None


def shifted(scores, positives, margin):
    """Eq. 14."""
    return torch.where(positives, scores - margin / 2, scores + margin / 2)


def rank_among_positives(scores, positives):
    """rk(y+): the rank of each positive when only the positives are ranked."""
    only_positives = torch.where(positives, scores, torch.full_like(scores, -float("inf")))
    return rank(only_positives)


def similarities_without_self(embeddings, labels, ref_emb=None, ref_labels=None, memory_emb=None, memory_labels=None):
    """Cosine similarities of each query to every reference (the batch itself when
    `ref_emb` is None, then the query itself is left out), followed by the memory."""
    exclude_self = ref_emb is None
    refs = embeddings if exclude_self else ref_emb
    refs_labels = labels if exclude_self else ref_labels
    if memory_emb is not None:
        refs = torch.cat([refs, memory_emb.detach()])
        refs_labels = torch.cat([refs_labels, memory_labels])
    scores = F.normalize(embeddings, dim=1) @ F.normalize(refs, dim=1).T
    positives = labels[:, None] == refs_labels[None, :]
    if exclude_self:
        keep = ~torch.eye(len(embeddings), len(refs), dtype=torch.bool)
        scores = scores[keep].view(len(embeddings), -1)
        positives = positives[keep].view(len(embeddings), -1)
    return scores, positives


def recall_loss(embeddings, labels, lambda_val, margin, weighting="log", **refs):
    """Eq. 16-20: mean over positive pairs of ℓ(r) ("log") or ℓ(ℓ(r)) ("loglog"),
    ℓ(k) = log(1 + k), r = number of negatives ranked above the positive."""
    scores, positives = similarities_without_self(embeddings, labels, **refs)
    y = shifted(scores, positives, margin)
    ranks = BlackboxRanker.apply(y, lambda_val) * y.shape[-1]
    negatives_above = ranks - rank_among_positives(y, positives).to(y.dtype)
    losses = torch.log1p(negatives_above[positives])
    if weighting == "loglog":
        losses = torch.log1p(losses)
    return losses.mean()


def average_precision_loss(scores, targets, lambda_val, margin):
    """Eq. 21-22 per sequence along the last dimension, averaged over the sequences
    that have a positive."""
    positives = targets.bool()
    y = shifted(scores, positives, margin)
    ranks = BlackboxRanker.apply(y, lambda_val) * y.shape[-1]
    precision = rank_among_positives(y, positives).to(y.dtype) / ranks
    per_sequence = (precision * positives).sum(-1) / positives.sum(-1).clamp(min=1)
    has_positive = positives.any(-1)
    return 1 - per_sequence[has_positive].mean()


def ap_retrieval_loss(embeddings, labels, lambda_val, margin, **refs):
    """1 − AP of every query's ranking of the references, averaged over queries with a
    positive."""
    scores, positives = similarities_without_self(embeddings, labels, **refs)
    return average_precision_loss(scores, positives, lambda_val, margin)


def map_loss(scores, targets, lambda_val, margin, apc_weight):
    """(1 − w) · mean over present classes of 1 − AP over the batch + w · (1 − AP of all
    scores as one sequence), eq. 22-23."""
    per_class = average_precision_loss(scores.T, targets.T, lambda_val, margin)
    across = average_precision_loss(scores.reshape(1, -1), targets.reshape(1, -1), lambda_val, margin)
    return (1 - apc_weight) * per_class + apc_weight * across
