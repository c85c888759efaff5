"""Sohn, "Improved Deep Metric Learning with Multi-class N-pair Loss Objective" (NIPS 2016),
written plainly from the slides' formulas."""

import math

import torch


def paired_indices(labels):
    """One (anchor, positive) pair per class with two or more samples: its first and
    second sample in the batch, classes in ascending label order."""
    values = labels.tolist()
    pairs = []
    for label in sorted(set(values)):
        members = [i for i, value in enumerate(values) if value == label]
        if len(members) >= 2:
            pairs.append((members[0], members[1]))
    return pairs


def npairs_loss(embeddings, labels, mode="mc", l2_reg_weight=0.0, normalize=False):
    """N-pair-mc:  mean_i log(1 + Σ_{j≠i} exp(f_iᵀf_j⁺ − f_iᵀf_i⁺))
    N-pair-ovo: mean_i Σ_{j≠i} log(1 + exp(f_iᵀf_j⁺ − f_iᵀf_i⁺))
    plus l2_reg_weight · mean_b ‖f_b‖² over every embedding of the batch (before any
    normalisation). ``normalize`` uses unit-length f in the inner products."""
    pairs = paired_indices(labels)
    f = embeddings / embeddings.norm(dim=1, keepdim=True) if normalize else embeddings
    anchors = f[[anchor for anchor, _ in pairs]]
    positives = f[[positive for _, positive in pairs]]
    per_anchor = []
    for i in range(len(pairs)):
        similarities = positives @ anchors[i]  # f_iᵀf_j⁺ for every j
        differences = torch.cat([similarities[:i], similarities[i + 1 :]]) - similarities[i]
        if mode == "mc":
            per_anchor.append(torch.log(1 + torch.exp(differences).sum()))
        elif mode == "ovo":
            per_anchor.append(torch.log(1 + torch.exp(differences)).sum())
        else:
            raise ValueError(f"unknown mode {mode}")
    loss = torch.stack(per_anchor).mean() if per_anchor else embeddings.sum() * 0
    penalty = (embeddings**2).sum(dim=1).mean()
    return loss + l2_reg_weight * penalty


def greedy_hard_negative_classes(class_embeddings, n, start):
    """Hard negative class mining, step 2, from class ``start``: repeatedly add the class
    whose largest inner product with an already selected class is largest (assumes no
    ties). Returns the selected class positions in selection order."""
    selected = [start]
    while len(selected) < n:
        best, best_violation = None, -math.inf
        for candidate in range(len(class_embeddings)):
            if candidate in selected:
                continue
            violation = max(float(class_embeddings[s] @ class_embeddings[candidate]) for s in selected)
            if violation > best_violation:
                best, best_violation = candidate, violation
        selected.append(best)
    return selected
