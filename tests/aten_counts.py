"""What the operation-counting tests share: the aten operations that run inside a context."""

import collections

from torch.utils._python_dispatch import TorchDispatchMode


class OperationNames(TorchDispatchMode):
    """The aten operations run inside the context, counted by name (``aten::nonzero``)."""

    def __init__(self):
        super().__init__()
        self.names = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names[func._schema.name] += 1
        return func(*args, **(kwargs or {}))
