"""Cross-batch memory (Wang et al., "Cross-Batch Memory for Embedding Learning", CVPR
2020) for pml-rank's losses.

PML's `CrossBatchMemory` refuses every loss outside the list its ``supported_losses()``
returns. Its extension point is that list: ``check_loss_support`` looks names up in
``cls.supported_losses()``. This subclass adds the registered losses to it and is
otherwise PML's own class, so everything else (the queue, ``enqueue_mask``, miners,
``reset_queue()``, `DistributedLossWrapper`) is PML's.
"""

from pytorch_metric_learning import losses as pml_losses
from pytorch_metric_learning.losses import BaseMetricLossFunction
from pytorch_metric_learning.miners import BaseMiner

from .._checks import checked_constructor
from ..plugins import registry


@checked_constructor
class CrossBatchMemory(pml_losses.CrossBatchMemory):
    """PML's ``CrossBatchMemory`` that also takes every loss registered with pml-rank
    (``pml_rank.registry.losses()``: pml-rank's own and any plugin's).

    Each call enqueues the batch (detached) and then computes
    ``loss(embeddings, labels, indices_tuple, memory, memory_labels)``: the queries are the
    batch, the references the memory, which holds this batch and the previous ones up to
    `memory_size` samples, and the `indices_tuple` holds every pair except each query with
    its own stored copy (or the pairs of `miner`). As in PML and the paper, the references
    are detached: gradients reach the embeddings through the queries only. pml-rank's
    losses rank a query's references in that tuple's pairs only.

    Args:
        loss: a loss PML's ``CrossBatchMemory`` supports or a registered one. A loss with
            a memory of its own (RaMBO's ``memory_size`` > 0) is refused: the two would
            stack; pass ``memory_size=0`` to it.
        embedding_size, memory_size, miner: as PML's.
    """

    def __init__(
        self, loss: BaseMetricLossFunction, embedding_size: int, memory_size: int = 1024, miner: BaseMiner | None = None
    ):
        name = type(loss).__name__
        registered = registry.losses().get(name)
        if registered is not None and not isinstance(loss, registered) and name not in self.pml_supported_losses():
            raise ValueError(
                f"CrossBatchMemory: loss is {type(loss).__module__}.{name}, which PML's CrossBatchMemory does "
                f"not support; the registered {name} is {registered.__module__}.{name}"
            )
        if getattr(loss, "memory_size", 0):
            raise ValueError(
                f"CrossBatchMemory: loss {name} keeps a memory of its own (memory_size={loss.memory_size}); "
                "inside CrossBatchMemory the two would stack: pass memory_size=0 to the loss"
            )
        if embedding_size < 1 or memory_size < 1:
            raise ValueError(
                "CrossBatchMemory: embedding_size and memory_size must be >= 1, "
                f"got embedding_size={embedding_size}, memory_size={memory_size}"
            )
        super().__init__(loss, embedding_size, memory_size=memory_size, miner=miner)

    @staticmethod
    def pml_supported_losses():
        return pml_losses.CrossBatchMemory.supported_losses()

    @staticmethod
    def supported_losses():
        return CrossBatchMemory.pml_supported_losses() + sorted(registry.losses())
