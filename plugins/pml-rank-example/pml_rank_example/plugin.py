"""Entry-point module: pml-rank imports it and calls its hooks."""

import pml_rank

from .binomial_deviance import BinomialDevianceLoss


@pml_rank.hookimpl
def pml_rank_losses():
    return [BinomialDevianceLoss]


def binomial_deviance_space(trial):
    """What `pml-rank tune BinomialDevianceLoss` searches: the constructor's keywords."""
    return {
        "alpha": trial.suggest_float("alpha", 0.5, 10.0, log=True),
        "beta": trial.suggest_float("beta", 0.0, 1.0),
        "cost": trial.suggest_float("cost", 1.0, 50.0, log=True),
    }


@pml_rank.hookimpl
def pml_rank_search_spaces():
    return {"BinomialDevianceLoss": binomial_deviance_space}
