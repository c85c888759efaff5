"""FastAP written directly from Cakir et al., "Deep Metric Learning to Rank" (CVPR 2019),
eq. 14: one soft histogram per bin centre, plain autograd.

For a query q, distances to the retrieval set are squared Euclidean distances of
L2-normalised embeddings, in [0, 4]. The bin centres are z_l = l * 4 / L for
l = 0..L (L = num_bins), each with a triangular kernel of half-width Δ = 4 / L:

    h⁺_l = Σ_{j positive}  max(0, 1 - |d_qj - z_l| / Δ)       H⁺_l = Σ_{k≤l} h⁺_k
    h_l  = Σ_{j retrieved} max(0, 1 - |d_qj - z_l| / Δ)       H_l  = Σ_{k≤l} h_k
    FastAP(q) = (1 / N⁺_q) Σ_l h⁺_l H⁺_l / H_l                (terms with H_l = 0 are 0)

and the loss is 1 - mean of FastAP over the queries that have at least one positive.
"""

import torch
import torch.nn.functional as F


def pair_masks(labels, ref_labels=None):
    """Positive and retrieved (positive or negative) pairs: every reference with the same
    label is a positive, and without a separate reference set a sample is neither its own
    positive nor retrieved."""
    same_set = ref_labels is None
    ref_labels = labels if same_set else ref_labels
    positive = labels[:, None] == ref_labels[None, :]
    retrieved = torch.ones_like(positive)
    if same_set:
        positive.fill_diagonal_(False)
        retrieved.fill_diagonal_(False)
    return positive, retrieved


def fast_ap_per_query(embeddings, labels, ref_emb=None, ref_labels=None, num_bins=10, positive=None, retrieved=None):
    """FastAP of every query (0 for queries without a positive) and the number of positives.
    `positive` / `retrieved` (boolean, queries x references) override the label masks."""
    if positive is None:
        positive, retrieved = pair_masks(labels, ref_labels)
    queries = F.normalize(embeddings, dim=1)
    references = queries if ref_emb is None else F.normalize(ref_emb, dim=1)
    distances = 2 - 2 * queries @ references.T  # |q - r|² for unit vectors, in [0, 4]

    delta = 4.0 / num_bins
    positive = positive.to(distances.dtype)
    retrieved = retrieved.to(distances.dtype)
    pos_hist, all_hist = [], []
    for l in range(num_bins + 1):
        pulse = torch.clamp(1 - torch.abs(distances - l * delta) / delta, min=0)
        pos_hist.append((pulse * positive).sum(1))
        all_hist.append((pulse * retrieved).sum(1))
    pos_hist = torch.stack(pos_hist, 1)
    all_hist = torch.stack(all_hist, 1)
    pos_cum = pos_hist.cumsum(1)
    all_cum = all_hist.cumsum(1)

    safe_cum = torch.where(all_cum > 0, all_cum, torch.ones_like(all_cum))
    terms = torch.where(all_cum > 0, pos_hist * pos_cum / safe_cum, torch.zeros_like(all_cum))
    num_positives = positive.sum(1)
    return terms.sum(1) / num_positives.clamp(min=1), num_positives


def fast_ap_loss(embeddings, labels, ref_emb=None, ref_labels=None, num_bins=10, positive=None, retrieved=None):
    """1 - mean FastAP over the queries with a positive (0 if there is none)."""
    ap, num_positives = fast_ap_per_query(embeddings, labels, ref_emb, ref_labels, num_bins, positive, retrieved)
    has_positive = num_positives > 0
    if not has_positive.any():
        return embeddings.sum() * 0
    return 1 - ap[has_positive].mean()
