"""pml-rank's own plugin: registers the package's components through the ``pml_rank``
entry point (see pyproject.toml), exactly as a third-party plugin would."""

from . import losses, samplers
from .plugins import hookimpl


@hookimpl
def pml_rank_losses():
    return [getattr(losses, name) for name in losses.__all__]


@hookimpl
def pml_rank_samplers():
    return [getattr(samplers, name) for name in samplers.__all__]
