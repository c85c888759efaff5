"""pml-rank's losses, one module per paper. Everything in __all__ is registered as a plugin component."""

from .auc import AUCLoss
from .fastap import FastAPLoss
from .npairs import NPairsMCLoss, NPairsOVOLoss
from .rambo import RaMBOAPLoss, RaMBORecallLoss
from .recall_at_k import RecallAtKSurrogateLoss

__all__ = [
    "AUCLoss",
    "FastAPLoss",
    "NPairsMCLoss",
    "NPairsOVOLoss",
    "RaMBOAPLoss",
    "RaMBORecallLoss",
    "RecallAtKSurrogateLoss",
]
