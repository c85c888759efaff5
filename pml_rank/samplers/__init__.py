"""pml-rank's samplers, one module per paper. Everything in __all__ is registered as a plugin component."""

__all__ = []
