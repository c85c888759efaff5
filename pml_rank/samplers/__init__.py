"""pml-rank's samplers, one module per paper. Everything in __all__ is registered as a plugin
component; `HierarchicalBatchSampler`, PML's sampler in the type PML's trainers need, is not."""

from .hard_negative_class import HardNegativeClassSampler
from .hierarchical import HierarchicalBatchSampler as HierarchicalBatchSampler

__all__ = ["HardNegativeClassSampler"]
