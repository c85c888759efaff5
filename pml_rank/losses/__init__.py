"""pml-rank's losses, one module per paper. Everything in __all__ is registered as a plugin component."""

from .auc import AUCLoss

__all__ = ["AUCLoss"]
