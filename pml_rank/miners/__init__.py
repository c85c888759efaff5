"""pml-rank's miners, one module per paper. Everything in __all__ is registered as a plugin component."""

__all__ = []
