import torch
from pytorch_metric_learning.losses import BaseMetricLossFunction


class RankLossBase(BaseMetricLossFunction):
    """Base of pml-rank's losses: PML's `BaseMetricLossFunction` that first rejects bad
    input with an error naming the loss and the offending value, so that a NaN never
    travels silently into training."""

    def forward(self, embeddings, labels=None, indices_tuple=None, ref_emb=None, ref_labels=None):
        check_embeddings(self, embeddings=embeddings, ref_emb=ref_emb)
        return super().forward(embeddings, labels, indices_tuple, ref_emb, ref_labels)


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
