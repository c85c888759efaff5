"""Components by name, as the command line and the example scripts write them:
a registered name (``"AUCLoss"``, pml-rank's or any plugin's) or ``"pml:<Name>"`` for
PML's own class of that kind (``"pml:TripletMarginLoss"``, ``"pml:BatchHardMiner"``)."""

PML_PREFIX = "pml:"


class MissingComponentError(LookupError):
    """A named loss, miner, sampler or row is neither registered nor PML's."""
