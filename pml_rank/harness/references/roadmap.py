"""SupAP and ROADMAP written directly from Ramzi et al., "Robust and Decomposable Average
Precision for Image Retrieval" (NeurIPS 2021): a loop over the queries, plain autograd.

For a query q (cosine similarities s), its positives P (q itself included, by its
self-similarity) and negatives N, the rank of a positive i among the positives is exact
and its negatives above it are bounded by H⁻ of x = s_qj − s_qi:

    R⁺(i)  = #{j ∈ P: s_qj ≥ s_qi}
    H⁻(x)  = σ(x / τ) (x ≤ 0),  start + σ(x / τ) (0 < x ≤ δ),  ρ (x − δ) + offset (x > δ)
    AP_q   = (1 / |P|) Σ_{i ∈ P} R⁺(i) / (R⁺(i) + Σ_{j ∈ N} H⁻(s_qj − s_qi))

with the σ arguments clamped to [−50, 50] (the authors' code). SupAP is the mean of
1 − AP_q over the queries with a positive besides themselves. The calibration loss is the
mean over the positive pairs with a non-zero term of [α − s]₊ plus that over the negative
pairs of [s − β]₊; ROADMAP = (1 − λ) SupAP + λ calibration.
"""

import math

import torch
import torch.nn.functional as F

CLAMP = 50.0


def bound(x, temperature=0.01, rho=100.0, offset=None, delta=0.05, start=0.5):
    """H⁻(x), elementwise."""
    if offset is None:
        offset = start + 1 / (1 + math.exp(-min(delta / temperature, CLAMP)))
    sigmoid = torch.sigmoid((x / temperature).clamp(-CLAMP, CLAMP))
    return torch.where(x <= 0, sigmoid, torch.where(x <= delta, start + sigmoid, rho * (x - delta) + offset))


def _similarities(embeddings, labels, ref_emb, ref_labels, allowed_pairs):
    """Per query: (scores of its ranking, positive mask), the query's own score first."""
    queries = F.normalize(embeddings, dim=1)
    in_batch = ref_emb is None
    references = queries if in_batch else F.normalize(ref_emb, dim=1)
    ref_labels = labels if in_batch else ref_labels
    rankings = []
    for q in range(len(queries)):
        keep = torch.ones(len(references), dtype=torch.bool, device=references.device)
        if in_batch:
            keep[q] = False
        if allowed_pairs is not None:
            keep &= torch.tensor([(q, j) in allowed_pairs for j in range(len(references))], device=keep.device)
        scores = torch.cat([(queries[q] @ queries[q]).unsqueeze(0), references[keep] @ queries[q]])
        positive = torch.cat([keep.new_ones(1), ref_labels[keep] == labels[q]])
        rankings.append((scores, positive))
    return rankings


def supap_losses(
    embeddings, labels, ref_emb=None, ref_labels=None, allowed_pairs=None, temperature=0.01, **bound_kwargs
):
    """{query index: 1 − AP_q} for the queries with a positive besides themselves."""
    losses = {}
    rankings = _similarities(embeddings, labels, ref_emb, ref_labels, allowed_pairs)
    for q, (scores, positive) in enumerate(rankings):
        if positive.sum() < 2:
            continue
        precisions = []
        for i in torch.nonzero(positive).squeeze(1):
            rank_positive = (scores[positive] >= scores[i]).sum().to(scores.dtype)
            above = bound(scores[~positive] - scores[i], temperature, **bound_kwargs).sum()
            precisions.append(rank_positive / (rank_positive + above))
        losses[q] = 1 - torch.stack(precisions).mean()
    return losses


def calibration_loss(
    embeddings, labels, ref_emb=None, ref_labels=None, allowed_pairs=None, pos_margin=0.9, neg_margin=0.6
):
    """Mean non-zero [α − s]₊ over positive pairs plus mean non-zero [s − β]₊ over negative
    pairs (self-pairs excluded)."""
    positive_terms, negative_terms = [], []
    for scores, positive in _similarities(embeddings, labels, ref_emb, ref_labels, allowed_pairs):
        positive_terms.append(torch.relu(pos_margin - scores[1:][positive[1:]]))
        negative_terms.append(torch.relu(scores[1:][~positive[1:]] - neg_margin))
    total = embeddings.sum() * 0
    for terms in (torch.cat(positive_terms), torch.cat(negative_terms)):
        nonzero = terms[terms > 0]
        if len(nonzero):
            total = total + nonzero.mean()
    return total


def roadmap_loss(
    embeddings,
    labels,
    ref_emb=None,
    ref_labels=None,
    allowed_pairs=None,
    lambda_=0.5,
    pos_margin=0.9,
    neg_margin=0.6,
    **supap_kwargs,
):
    """(1 − λ) · the mean SupAP loss + λ · the calibration loss."""
    pairs = dict(ref_emb=ref_emb, ref_labels=ref_labels, allowed_pairs=allowed_pairs)
    losses = supap_losses(embeddings, labels, **pairs, **supap_kwargs)
    supap = torch.stack(list(losses.values())).mean() if losses else embeddings.sum() * 0
    calibration = calibration_loss(embeddings, labels, **pairs, pos_margin=pos_margin, neg_margin=neg_margin)
    return (1 - lambda_) * supap + lambda_ * calibration
