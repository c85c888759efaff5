"""Input checks shared by the losses, the ranking functions and the sampler. A leaf
module: it imports nothing from pml-rank."""

import torch


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
        if bool(torch.isfinite(tensor.sum())):  # one cheap pass (isfinite is 10 times slower)
            continue
        finite = torch.isfinite(tensor)
        if not bool(finite.all()):  # else the sum overflowed
            bad = (~finite).nonzero()[0].tolist()
            raise ValueError(
                f"{owner}: {name} contains {int((~finite).sum())} NaN/Inf value(s), "
                f"first at index {tuple(bad)}: {tensor[tuple(bad)].item()}"
            )


def check_references(component, labels, ref_emb, ref_labels):
    """Raise ValueError when labelled embeddings come with `ref_emb` but without `ref_labels`."""
    if ref_emb is not None and ref_labels is None and labels is not None:
        owner = component if isinstance(component, str) else type(component).__name__
        raise ValueError(f"{owner}: ref_emb was given without ref_labels; pass the labels of ref_emb as ref_labels")
