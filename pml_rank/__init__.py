"""pml-rank: rank- and AUC-based metric-learning losses as pytorch-metric-learning
components (AUC-BH, RaMBO, FastAP, N-pair-mc), discoverable through pluggy entry points.

    from pml_rank import losses
    loss_func = losses.AUCLoss()   # instead of pytorch_metric_learning.losses.TripletMarginLoss()
"""

from importlib.metadata import PackageNotFoundError, version

from .plugins import hookimpl, hookspec, install, registry

try:
    __version__ = version("pml-rank")
except PackageNotFoundError:  # running from a checkout that is not installed
    __version__ = "0+unknown"

__all__ = ["hookimpl", "hookspec", "install", "registry", "__version__"]
