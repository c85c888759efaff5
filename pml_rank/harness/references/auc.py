"""AUC-BH (Gajić et al., CVPR-W 2022), Algorithm 1 written out line by line.

Line 12 of the paper reads ``σ⁻[i, s] − σ⁺[i, s + Δs]``; the second term is σ⁻ (the
FPR drop over the interval), a typo in the paper. Line 5's step vector holds the S
left ends of the intervals, ``t_min, ..., t_max − Δs``; the right end ``s + Δs`` of the
last one is ``t_max``.
"""

import torch
import torch.nn.functional as F


def auc_bh_loss(embeddings, labels, step, slope, t_min=-1.0, t_max=1.0, ref_emb=None, ref_labels=None):
    # line 2: cosine similarities (of the batch with itself unless a reference set is given)
    self_reference = ref_emb is None
    if self_reference:
        ref_emb, ref_labels = embeddings, labels
    similarities = F.normalize(embeddings, dim=1) @ F.normalize(ref_emb, dim=1).T

    # lines 3-4: hardest positive (lowest) and hardest negative (highest) per row;
    # rows lacking either are left out.
    hps, hns = [], []
    for i in range(len(embeddings)):
        same = ref_labels == labels[i]
        positive = same.clone()
        if self_reference:
            positive[i] = False
        negative = ~same
        if positive.any() and negative.any():
            hps.append(similarities[i][positive].min())
            hns.append(similarities[i][negative].max())
    if not hps:
        return None
    hps, hns = torch.stack(hps), torch.stack(hns)
    n = len(hps)

    # line 5: the S left ends of the intervals
    intervals = round((t_max - t_min) / step)
    step_vector = [t_min + j * step for j in range(intervals)]

    # lines 7-8: sigmoids of every anchor's HPS / HNS at a threshold
    def sigma_plus(threshold):
        return 1 / (1 + torch.exp(-slope * (hps - threshold)))

    def sigma_minus(threshold):
        return 1 / (1 + torch.exp(-slope * (hns - threshold)))

    # lines 9-13, the sums over i written as .sum()
    s1, s2 = [], []
    for s in step_vector:
        s1.append((sigma_plus(s) + sigma_plus(s + step)).sum())
        s2.append((sigma_minus(s) - sigma_minus(s + step)).sum())

    # lines 14-15
    area = sum(a * b for a, b in zip(s1, s2)) / (2 * n**2)
    return 1 - area
