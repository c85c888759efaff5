import torch
from pytorch_metric_learning.losses import BaseMetricLossFunction


HALF_PRECISION = (torch.float16, torch.bfloat16)


class RankLossBase(BaseMetricLossFunction):
    """Base of pml-rank's losses: PML's `BaseMetricLossFunction` that first rejects bad
    input with an error naming the loss and the offending value, so that a NaN never
    travels silently into training, and computes float16/bfloat16 input in float32
    (similarities, exponentials and sums overflow or lose all precision in half
    precision; the gradient flows back in the input's dtype)."""

    def forward(self, embeddings, labels=None, indices_tuple=None, ref_emb=None, ref_labels=None):
        check_embeddings(self, embeddings=embeddings, ref_emb=ref_emb)
        same = ref_emb is embeddings
        embeddings = _at_least_float32(embeddings)
        ref_emb = embeddings if same else _at_least_float32(ref_emb)
        loss = super().forward(embeddings, labels, indices_tuple, ref_emb, ref_labels)
        if not bool(torch.isfinite(loss)):
            # Inputs were finite, so only their scale can have done this (1e20-norm rows).
            norms = [t.double().norm(dim=-1).max().item() for t in (embeddings, ref_emb) if t is not None and t.numel()]
            raise ValueError(
                f"{type(self).__name__}: the loss overflowed to {loss.item()} although the "
                f"embeddings are finite; their largest norm is {max(norms):.3g}. "
                "Normalise or rescale the embeddings."
            )
        return loss


def _at_least_float32(tensor):
    if tensor is not None and tensor.dtype in HALF_PRECISION:
        return tensor.float()
    return tensor


def check_embeddings(component, **tensors):
    """Raise TypeError for non-float and ValueError for non-finite tensors, naming
    `component` (an instance or a name) and the tensor. `None` values are skipped."""
    owner = component if isinstance(component, str) else type(component).__name__
    for name, tensor in tensors.items():
        if tensor is None:
            continue
        if not torch.is_tensor(tensor) or not torch.is_floating_point(tensor):
            kind = tensor.dtype if torch.is_tensor(tensor) else type(tensor).__name__
            raise TypeError(f"{owner}: {name} must be a floating-point tensor, got {kind}")
        finite = torch.isfinite(tensor)
        if not bool(finite.all()):
            bad = (~finite).nonzero()[0].tolist()
            raise ValueError(
                f"{owner}: {name} contains {int((~finite).sum())} NaN/Inf value(s), "
                f"first at index {tuple(bad)}: {tensor[tuple(bad)].item()}"
            )
