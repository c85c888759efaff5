"""The Recall@k surrogate written directly from Patel, Tolias, Matas, "Recall@k Surrogate
Loss with Large Batches and Similarity Mixup" (CVPR 2022): a loop over the queries,
plain sigmoids, plain autograd.

For a query q, its positives P_q and the references Ω_q it ranks (cosine similarities s):

    r(q, x)  = 1 + Σ_{z ∈ Ω_q, z ≠ x} σ((s(q, z) − s(q, x)) / τ1)
    R̃@k(q)   = min(Σ_{x ∈ P_q} σ((k − r(q, x)) / τ2), k) / min(k, |P_q|)
    loss     = mean over the queries with a positive and a negative of 1 − mean_k R̃@k(q)

with k replaced by |Ω_q| when it is larger (the clip at k and that replacement are the
authors' code's). SiMix: `virtual` = (i, j, α) appends the virtual samples
α·x̂_i + (1 − α)·x̂_j (unit-norm embeddings mixed, not renormalised) with the label of
i, as queries and references.
"""

import torch
import torch.nn.functional as F


def recall_at_k_loss(
    embeddings,
    labels,
    k_values=(1, 2, 4, 8, 16),
    rank_temperature=0.01,
    recall_temperature=1.0,
    ref_emb=None,
    ref_labels=None,
    virtual=None,
):
    queries = F.normalize(embeddings, dim=1)
    same_set = ref_emb is None
    if virtual is not None:
        first, second, alpha = virtual
        mixed = alpha[:, None] * queries[first] + (1 - alpha[:, None]) * queries[second]
        queries, labels = torch.cat([queries, mixed]), torch.cat([labels, labels[first]])
    references = queries if same_set else F.normalize(ref_emb, dim=1)
    ref_labels = labels if same_set else ref_labels
    similarities = queries @ references.T
    losses = []
    for q in range(len(queries)):
        ranked = torch.ones(len(references), dtype=torch.bool, device=references.device)
        if same_set:
            ranked[q] = False
        positives = (ref_labels == labels[q]) & ranked
        if not positives.any() or not (ranked & ~positives).any():
            continue
        row = similarities[q, ranked]
        positive_scores = similarities[q, positives]
        # sigmoids[x, z] = σ((s(q, z) − s(q, x)) / τ1); the z = x term is left out.
        sigmoids = torch.sigmoid((row[None, :] - positive_scores[:, None]) / rank_temperature)
        is_x = torch.nonzero(ranked).squeeze(1)[None, :] == torch.nonzero(positives).squeeze(1)[:, None]
        ranks = 1 + (sigmoids * ~is_x).sum(1)
        recalls = []
        for k in k_values:
            k = min(k, len(row))
            in_top_k = torch.sigmoid((k - ranks) / recall_temperature).sum()
            recalls.append(torch.clamp(in_top_k, max=k) / min(k, len(positive_scores)))
        losses.append(1 - torch.stack(recalls).mean())
    if not losses:
        return embeddings.sum() * 0
    return torch.stack(losses).mean()
