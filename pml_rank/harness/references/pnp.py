"""The PNP loss written directly from Li et al., "Rethinking the Optimization of Average
Precision: Only Penalizing Negative Instances before Positive Ones is Enough" (AAAI 2022):
a loop over the queries, plain autograd.

For a query q (cosine similarities s) and each positive i (q itself included, by its
self-similarity), the relaxed number of negatives above i is

    N(i) = Σ_{j ∈ N_q} σ((s_qj − s_qi) / τ)        (σ's argument clamped to [−50, 50])

and the loss of q is the mean over its positives of f(N(i)): O: N; Ds: log(1 + N);
Iu: (1 + N) log(1 + N); Ib: (bN − log(1 + bN)) / b²; Dq: 1 − (1 + N)^−α. The loss is
the mean over the queries with a positive besides themselves.
"""

import torch

from .roadmap import _similarities

PENALTIES = {
    "O": lambda n, alpha, b: n,
    "Ds": lambda n, alpha, b: torch.log(1 + n),
    "Dq": lambda n, alpha, b: 1 - (1 + n) ** -alpha,
    "Iu": lambda n, alpha, b: (1 + n) * torch.log(1 + n),
    "Ib": lambda n, alpha, b: (b * n - torch.log(1 + b * n)) / b**2,
}


def pnp_losses(
    embeddings, labels, ref_emb=None, ref_labels=None, allowed_pairs=None, variant="Dq", alpha=4.0, b=2.0, anneal=0.01
):
    """{query index: its loss} for the queries with a positive besides themselves."""
    losses = {}
    for q, (scores, positive) in enumerate(_similarities(embeddings, labels, ref_emb, ref_labels, allowed_pairs)):
        if positive.sum() < 2:
            continue
        terms = []
        for i in torch.nonzero(positive).squeeze(1):
            above = torch.sigmoid(((scores[~positive] - scores[i]) / anneal).clamp(-50, 50)).sum()
            terms.append(PENALTIES[variant](above, alpha, b))
        losses[q] = torch.stack(terms).mean()
    return losses


def pnp_loss(embeddings, labels, **kwargs):
    """The mean of `pnp_losses`."""
    losses = pnp_losses(embeddings, labels, **kwargs)
    return torch.stack(list(losses.values())).mean() if losses else embeddings.sum() * 0
