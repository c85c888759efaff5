"""Accuracy of embeddings as the Reality Check protocol reports it: P@1, R-Precision and
MAP@R from PML's `AccuracyCalculator` (faiss, GPU when present), for concatenated and
separated embeddings, with means and 95% confidence intervals over repeated runs."""

import math

import numpy as np
import torch
import torch.nn.functional as F
from pytorch_metric_learning.utils.accuracy_calculator import AccuracyCalculator

METRICS = ("precision_at_1", "r_precision", "mean_average_precision_at_r")
SHORT_NAMES = {"precision_at_1": "P@1", "r_precision": "RP", "mean_average_precision_at_r": "MAP@R"}


def accuracy(embeddings, labels, reference=None, reference_labels=None, device=None):
    """``{metric: value in [0, 1]}`` for `METRICS`, computed by PML's
    ``AccuracyCalculator(k="max_bin_count")``.

    Without `reference`, every embedding is a query against all the others (itself
    excluded), as in the paper. With `reference`, the queries are `embeddings` and the
    retrieval set is `reference`. Embeddings are used as given: normalise them first if
    the metric should be cosine (`concatenate` does)."""
    calculator = AccuracyCalculator(include=METRICS, k="max_bin_count", device=device)
    labels = torch.as_tensor(np.asarray(labels))
    if reference is not None:
        reference_labels = torch.as_tensor(np.asarray(reference_labels))
    result = calculator.get_accuracy(torch.as_tensor(embeddings), labels,
                                     None if reference is None else torch.as_tensor(reference),
                                     reference_labels)
    return {name: float(result[name]) for name in METRICS}


def concatenate(embeddings_per_model):
    """L2-normalises each model's embeddings, concatenates them along the feature axis
    and L2-normalises the result (the paper's "concatenated" embeddings)."""
    parts = [F.normalize(torch.as_tensor(e).float(), dim=1) for e in embeddings_per_model]
    return F.normalize(torch.cat(parts, dim=1), dim=1)


def concatenated_and_separated(embeddings_per_model, labels, device=None):
    """Both accuracies of the paper for the test-set embeddings of the fold models:
    ``{"concatenated": accuracy of concatenate(...), "separated": mean over models of
    each model's accuracy, "per_model": [...]}``."""
    per_model = [accuracy(F.normalize(torch.as_tensor(e).float(), dim=1), labels, device=device)
                 for e in embeddings_per_model]
    separated = {name: float(np.mean([m[name] for m in per_model])) for name in METRICS}
    concatenated = accuracy(concatenate(embeddings_per_model), labels, device=device)
    return {"concatenated": concatenated, "separated": separated, "per_model": per_model}


def student_t_quantile(probability, dof):
    """Quantile of Student's t distribution with `dof` degrees of freedom, from its
    density by numerical integration and bisection (no scipy needed)."""
    if not 0.5 <= probability < 1:
        raise ValueError(f"student_t_quantile: probability must be in [0.5, 1), got {probability}")
    if dof < 1:
        raise ValueError(f"student_t_quantile: dof must be >= 1, got {dof}")
    log_norm = math.lgamma((dof + 1) / 2) - math.lgamma(dof / 2) - 0.5 * math.log(dof * math.pi)

    def cdf(x):
        # Simpson's rule on [0, x]: the density is smooth, and 2,000 intervals agree with
        # scipy to 1e-6 for the quantiles a confidence interval needs (see the tests).
        n = 2000
        ts = np.linspace(0.0, x, n + 1)
        density = np.exp(log_norm - (dof + 1) / 2 * np.log1p(ts * ts / dof))
        weights = np.ones(n + 1)
        weights[1:-1:2], weights[2:-1:2] = 4, 2
        return 0.5 + x / (3 * n) * float(weights @ density)

    low, high = 0.0, 1.0
    while cdf(high) < probability:
        low, high = high, high * 2
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if cdf(mid) < probability else (low, mid)
    return (low + high) / 2


def mean_and_ci(values, confidence=0.95):
    """``(mean, half_width)`` of the `confidence` interval of the mean of `values`
    (Student's t with n-1 degrees of freedom; the sample standard deviation uses n-1).
    With a single value the half width is NaN: one run gives no interval."""
    values = np.asarray(values, dtype=np.float64)
    if values.size == 0:
        raise ValueError("mean_and_ci needs at least one value")
    mean = float(values.mean())
    if values.size == 1:
        return mean, float("nan")
    sem = values.std(ddof=1) / math.sqrt(values.size)
    return mean, float(student_t_quantile(0.5 + confidence / 2, values.size - 1) * sem)
