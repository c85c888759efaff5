"""pml-rank's losses, one module per paper. Everything in __all__ is registered as a plugin component."""

from .rambo import RaMBOAPLoss, RaMBORecallLoss

__all__ = ["RaMBOAPLoss", "RaMBORecallLoss"]
