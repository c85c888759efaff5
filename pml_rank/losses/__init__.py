"""pml-rank's losses, one module per paper. Everything in __all__ is registered as a plugin component."""

from .fastap import FastAPLoss

__all__ = ["FastAPLoss"]
