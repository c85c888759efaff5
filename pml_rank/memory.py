"""Score memory (RaMBO, sec. 4.3): the last τ batches' embeddings and labels, detached,
appended to the references every current query is ranked against. Gradients flow only
through the current batch.

The memory lives in module buffers, so ``state_dict()`` saves it, ``load_state_dict()``
restores it (whatever its fill level), and ``.to(device)`` moves it. Batches may change
size from one call to the next; the first calls work with a partly filled memory.
"""

import torch


class ScoreMemory(torch.nn.Module):
    """Keeps the last `size` batches (0 disables the memory)."""

    def __init__(self, size, owner="ScoreMemory"):
        super().__init__()
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ValueError(f"{owner}: memory_size must be an integer >= 0, got {size!r}")
        self.size = size
        self.owner = owner
        # All stored batches concatenated, oldest first, and each batch's length.
        self.register_buffer("embeddings", torch.zeros(0, 0))
        self.register_buffer("labels", torch.zeros(0, dtype=torch.long))
        self.register_buffer("batch_sizes", torch.zeros(0, dtype=torch.long))

    def __len__(self):
        """Number of stored batches."""
        return len(self.batch_sizes)

    def extend(self, embeddings, labels):
        """The given references followed by the stored ones (which carry no gradient)."""
        if len(self) == 0:
            return embeddings, labels
        self._check_size(embeddings)
        stored = self.embeddings.to(embeddings.device, embeddings.dtype)
        return (torch.cat([embeddings, stored]),
                torch.cat([labels, self.labels.to(labels.device, labels.dtype)]))

    def push(self, embeddings, labels):
        """Store a batch (detached), forgetting the oldest beyond `size`."""
        if self.size == 0:
            return
        embeddings, labels = embeddings.detach(), labels.detach()
        if len(self):
            self._check_size(embeddings)
        else:
            self.embeddings = embeddings.new_zeros(0, embeddings.shape[1])
            self.labels = labels.new_zeros(0)
        sizes = torch.cat([self.batch_sizes.to(labels.device), torch.tensor([len(labels)], device=labels.device)])
        kept = sizes[-self.size:]
        dropped = int(sizes.sum() - kept.sum())
        self.embeddings = torch.cat([self.embeddings.to(embeddings), embeddings])[dropped:]
        self.labels = torch.cat([self.labels.to(labels), labels])[dropped:]
        self.batch_sizes = kept

    def _check_size(self, embeddings):
        if self.embeddings.shape[1] != embeddings.shape[1]:
            raise ValueError(
                f"{self.owner}: embedding size {embeddings.shape[1]} differs from the "
                f"{self.embeddings.shape[1]} stored in the memory; call reset_memory() first"
            )

    def reset(self):
        self.embeddings = torch.zeros(0, 0, device=self.embeddings.device)
        self.labels = torch.zeros(0, dtype=torch.long, device=self.labels.device)
        self.batch_sizes = torch.zeros(0, dtype=torch.long, device=self.batch_sizes.device)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # The stored tensors' shapes depend on the fill level: take the saved shapes.
        for name in ("embeddings", "labels", "batch_sizes"):
            saved = state_dict.get(prefix + name)
            if saved is not None:
                self._buffers[name] = torch.empty_like(saved, device=self._buffers[name].device)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def extra_repr(self):
        return f"size={self.size}, stored_batches={len(self)}"
