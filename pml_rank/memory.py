"""Score memory (RaMBO, sec. 4.3): the last τ batches' embeddings and labels, detached,
appended to the references every current query is ranked against. Gradients flow only
through the current batch.

The memory is part of the module's state: ``state_dict()`` saves it (as the module's
extra state), ``load_state_dict()`` restores it whatever its fill level, and
``.to(device)`` moves it. Batches may change size from one call to the next; the first
calls work with a partly filled memory.

The stored tensors are kept out of the module's attributes and buffers on purpose: PML's
logging hooks (record-keeper) record every tensor they find in a loss module's buffers
at every logged iteration, which would copy the whole memory into the logs (and fails
on an empty one).
"""

import torch


class _Stored:
    """The memory's tensors, in a holder that logging hooks do not walk into."""

    def __init__(self, embeddings, labels, batch_sizes):
        self.embeddings, self.labels, self.batch_sizes = embeddings, labels, batch_sizes


class ScoreMemory(torch.nn.Module):
    """Keeps the last `size` batches (0 disables the memory)."""

    def __init__(self, size, owner="ScoreMemory"):
        super().__init__()
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ValueError(f"{owner}: memory_size must be an integer >= 0, got {size!r}")
        self.size = size
        self.owner = owner
        self.reset()

    # All stored batches concatenated, oldest first, and each batch's length.
    embeddings = property(lambda self: self._stored.embeddings)
    labels = property(lambda self: self._stored.labels)
    batch_sizes = property(lambda self: self._stored.batch_sizes)

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
            old_embeddings, old_labels = self.embeddings.to(embeddings), self.labels.to(labels)
        else:
            old_embeddings, old_labels = embeddings.new_zeros(0, embeddings.shape[1]), labels.new_zeros(0)
        sizes = torch.cat([self.batch_sizes.to(labels.device), torch.tensor([len(labels)], device=labels.device)])
        kept = sizes[-self.size:]
        dropped = int(sizes.sum() - kept.sum())
        self._stored = _Stored(torch.cat([old_embeddings, embeddings])[dropped:],
                               torch.cat([old_labels, labels])[dropped:], kept)

    def _check_size(self, embeddings):
        if self.embeddings.shape[1] != embeddings.shape[1]:
            raise ValueError(
                f"{self.owner}: embedding size {embeddings.shape[1]} differs from the "
                f"{self.embeddings.shape[1]} stored in the memory; call reset_memory() first"
            )

    def reset(self):
        device = self._stored.embeddings.device if hasattr(self, "_stored") else None
        self._stored = _Stored(torch.zeros(0, 0, device=device),
                               torch.zeros(0, dtype=torch.long, device=device),
                               torch.zeros(0, dtype=torch.long, device=device))

    def get_extra_state(self):
        return {"embeddings": self.embeddings, "labels": self.labels, "batch_sizes": self.batch_sizes}

    def set_extra_state(self, state):
        device = self.embeddings.device
        self._stored = _Stored(*(state[k].to(device) for k in ("embeddings", "labels", "batch_sizes")))

    def _apply(self, fn, *args, **kwargs):
        # .to(device), .cuda(), .double() reach the stored tensors too.
        stored = self._stored
        self._stored = _Stored(fn(stored.embeddings), fn(stored.labels), fn(stored.batch_sizes))
        return super()._apply(fn, *args, **kwargs)

    def extra_repr(self):
        return f"size={self.size}, stored_batches={len(self)}"
