"""pml-rank's samplers, one module per paper. Everything in __all__ is registered as a plugin component."""

from .hard_negative_class import HardNegativeClassSampler

__all__ = ["HardNegativeClassSampler"]
