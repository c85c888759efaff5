"""pml-rank's losses, one module per paper. Everything in __all__ is registered as a plugin
component; `CrossBatchMemory`, a loss wrapper, is not."""

from .auc import AUCLoss
from .cross_batch_memory import CrossBatchMemory as CrossBatchMemory
from .fastap import FastAPLoss
from .npairs import NPairsMCLoss, NPairsOVOLoss
from .pnp import PNPLoss
from .rambo import RaMBOAPLoss, RaMBORecallLoss
from .recall_at_k import RecallAtKSurrogateLoss
from .roadmap import ROADMAPLoss, SupAPLoss
from .smooth_ap import SmoothAPLoss

__all__ = [
    "AUCLoss",
    "FastAPLoss",
    "NPairsMCLoss",
    "NPairsOVOLoss",
    "PNPLoss",
    "RaMBOAPLoss",
    "RaMBORecallLoss",
    "ROADMAPLoss",
    "RecallAtKSurrogateLoss",
    "SmoothAPLoss",
    "SupAPLoss",
]
