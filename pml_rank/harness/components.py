"""Components by name, as the command line and the example scripts write them:
a registered name (``"AUCLoss"``, pml-rank's or any plugin's) or ``"pml:<Name>"`` for
PML's own class of that kind (``"pml:TripletMarginLoss"``, ``"pml:BatchHardMiner"``)."""

import importlib

from ..plugins import registry

PML_PREFIX = "pml:"


class MissingComponentError(LookupError):
    """A named loss, miner or sampler is neither registered nor PML's."""


def component_class(kind, name):
    """The class `name` of `kind` ("losses", "miners" or "samplers")."""
    if name.startswith(PML_PREFIX):
        module = importlib.import_module(f"pytorch_metric_learning.{kind}")
        cls = getattr(module, name[len(PML_PREFIX) :], None)
        if cls is None:
            raise MissingComponentError(f"pytorch_metric_learning.{kind} has no {name[len(PML_PREFIX) :]}")
        return cls
    found = getattr(registry, kind)()
    if name not in found:
        raise MissingComponentError(
            f"{name} is not registered ({kind}: {', '.join(sorted(found)) or 'none'}); "
            f"`pml-rank list` shows what is installed, and {PML_PREFIX}<Name> names PML's own."
        )
    return found[name]
