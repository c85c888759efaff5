"""Entry-point module: pml-rank imports it and calls its hooks."""

import pml_rank

from .binomial_deviance import BinomialDevianceLoss


@pml_rank.hookimpl
def pml_rank_losses():
    return [BinomialDevianceLoss]
