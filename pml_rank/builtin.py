"""pml-rank's own plugin: registers the package's components through the ``pml_rank``
entry point (see pyproject.toml), exactly as a third-party plugin would."""

from .plugins import hookimpl


@hookimpl
def pml_rank_losses():
    from . import losses

    return [getattr(losses, name) for name in losses.__all__]


@hookimpl
def pml_rank_miners():
    from . import miners

    return [getattr(miners, name) for name in miners.__all__]


@hookimpl
def pml_rank_samplers():
    from . import samplers

    return [getattr(samplers, name) for name in samplers.__all__]
