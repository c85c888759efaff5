"""pml-rank's losses, one module per paper. Everything in __all__ is registered as a plugin component."""

from .npairs import NPairsMCLoss, NPairsOVOLoss
from .rambo import RaMBOAPLoss, RaMBORecallLoss

__all__ = ["NPairsMCLoss", "NPairsOVOLoss", "RaMBOAPLoss", "RaMBORecallLoss"]
