from .binomial_deviance import BinomialDevianceLoss

__all__ = ["BinomialDevianceLoss"]
