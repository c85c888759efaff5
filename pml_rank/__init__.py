"""pml-rank: rank- and AUC-based metric-learning losses as pytorch-metric-learning
components (AUC-BH, RaMBO, FastAP, N-pair-mc, Smooth-AP, Recall@k surrogate, cross-batch
memory), discoverable through pluggy entry points.

    from pml_rank import losses
    loss_func = losses.AUCLoss()   # instead of pytorch_metric_learning.losses.TripletMarginLoss()
"""

import importlib
from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("pml-rank")
except PackageNotFoundError:  # running from a checkout that is not installed
    __version__ = "0+unknown"

__all__ = ["hookimpl", "hookspec", "install", "registry", "__version__"]


def __getattr__(name):
    # The plugin wiring imports torch and PML: load it on first use, so that
    # `pml-rank --help` answers without them.
    if name in ("hookimpl", "hookspec", "install", "registry"):
        return getattr(importlib.import_module(".plugins", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
