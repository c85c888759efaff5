"""pml-rank's own plugin: registers the package's components through the ``pml_rank``
entry point (see pyproject.toml), exactly as a third-party plugin would."""

from . import losses, samplers
from .plugins import hookimpl
from .search_spaces import SEARCH_SPACES


@hookimpl
def pml_rank_losses():
    return [getattr(losses, name) for name in losses.__all__]


@hookimpl
def pml_rank_samplers():
    return [getattr(samplers, name) for name in samplers.__all__]


@hookimpl
def pml_rank_search_spaces():
    """The `pml-rank tune` search spaces of pml-rank's losses (`search_spaces`): RaMBO's λ,
    margin, memory size and variant (and the recall loss's weighting), AUC's threshold step
    and sigmoid slope, FastAP's number of bins, N-pair's L2 weight, the Recall@k surrogate's
    two temperatures and SiMix, Smooth-AP's temperature and query convention, SupAP's τ, ρ, δ
    (and ROADMAP's λ and margins), PNP-D_q's τ and α."""
    return dict(SEARCH_SPACES)
