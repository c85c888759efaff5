"""Straightforward implementations written directly from the papers' formulas.

They are slow on purpose: loops and plain autograd, no tricks. The tests compare the
fast losses against them, and ``pml-rank speed`` times them as the baseline.
"""
