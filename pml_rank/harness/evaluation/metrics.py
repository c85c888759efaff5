"""Accuracy of embeddings as the papers report it, all through PML's `AccuracyCalculator`
(faiss k-nearest neighbours and k-means, GPU when present): the Reality Check's P@1,
R-Precision and MAP@R for concatenated and separated embeddings, with means and 95%
confidence intervals over repeated runs, and the older papers' Recall@K and NMI.

R@K is the share of queries with at least one same-class reference among their K nearest
neighbours (RaMBO eq. 7-8; the N-pair and AUC papers use the same definition). Queries
whose class has no other reference are left out, as PML leaves them out of P@1, so R@1
equals PML's ``precision_at_1``.
"""

import math

import numpy as np
import torch
import torch.nn.functional as F
from pytorch_metric_learning.utils.accuracy_calculator import AccuracyCalculator, try_getting_not_lone_labels
from scipy import stats

RECALL_KS = (1, 2, 4, 8, 10, 16, 20, 30, 32, 50, 100, 1000)

# The papers' column names and PML's metric names: the one table of both.
PML_NAMES = {"P@1": "precision_at_1", "RP": "r_precision", "MAP@R": "mean_average_precision_at_r", "NMI": "NMI"}
PML_NAMES.update({f"R@{k}": f"recall_at_{k}" for k in RECALL_KS})
SHORT_NAMES = {pml: short for short, pml in PML_NAMES.items()}

# What the Reality Check protocol reports.
METRICS = ("precision_at_1", "r_precision", "mean_average_precision_at_r")


class RetrievalAccuracyCalculator(AccuracyCalculator):
    """PML's `AccuracyCalculator` with ``recall_at_<K>`` metrics for K in `RECALL_KS`.
    k-nearest neighbours are taken as deep as the largest requested K and, when
    R-Precision or MAP@R are requested, the largest class ("max_bin_count")."""

    def requires_knn(self):
        return super().requires_knn() + [f"recall_at_{k}" for k in RECALL_KS]

    def determine_k(self, bin_counts, num_reference_embeddings, ref_includes_query):
        available = num_reference_embeddings - int(ref_includes_query)
        wanted = [int(m.rsplit("_", 1)[1]) for m in self.get_curr_metrics() if m.startswith("recall_at_")]
        if set(self.get_curr_metrics()) & {"r_precision", "mean_average_precision_at_r", "precision_at_1"}:
            wanted.append(int(torch.max(bin_counts).item()) - int(ref_includes_query))
        return max(1, min(max(wanted, default=1), available))


def _recall_method(k):
    def calculate(self, knn_labels, query_labels, not_lone_query_mask, **kwargs):
        knn_labels, query_labels = try_getting_not_lone_labels(knn_labels, query_labels, not_lone_query_mask)
        if knn_labels is None:
            return float("nan")
        return (knn_labels[:, :k] == query_labels.reshape(-1, 1)).any(dim=1).float().mean().item()

    calculate.__name__ = f"calculate_recall_at_{k}"
    return calculate


for _k in RECALL_KS:
    setattr(RetrievalAccuracyCalculator, f"calculate_recall_at_{_k}", _recall_method(_k))


def accuracy(embeddings, labels, reference=None, reference_labels=None, metrics=METRICS, device=None):
    """``{metric: value in [0, 1]}`` for `metrics`, named either as PML names them
    (``"mean_average_precision_at_r"``) or as the papers' columns (``"MAP@R"``, ``"R@8"``,
    ``"NMI"``); the keys are the names given.

    Without `reference`, every embedding is a query against all the others (itself
    excluded). With `reference`, the queries are `embeddings` and the retrieval set is
    `reference` (In-shop's gallery). Embeddings are used as given: normalise them first
    if the metric should be cosine (`concatenate` does)."""
    unknown = [m for m in metrics if m not in PML_NAMES and m not in SHORT_NAMES]
    if unknown:
        raise ValueError(f"accuracy: unknown metric {unknown}; known: {', '.join(PML_NAMES)}")
    include = tuple(PML_NAMES.get(m, m) for m in metrics)
    calculator = RetrievalAccuracyCalculator(include=include, device=device)
    labels = torch.as_tensor(np.asarray(labels))
    if reference is not None:
        reference, reference_labels = torch.as_tensor(reference), torch.as_tensor(np.asarray(reference_labels))
    result = calculator.get_accuracy(torch.as_tensor(embeddings), labels, reference, reference_labels)
    return {m: float(result[PML_NAMES.get(m, m)]) for m in metrics}


def concatenate(embeddings_per_model):
    """L2-normalises each model's embeddings, concatenates them along the feature axis
    and L2-normalises the result (the paper's "concatenated" embeddings)."""
    parts = [F.normalize(torch.as_tensor(e).float(), dim=1) for e in embeddings_per_model]
    return F.normalize(torch.cat(parts, dim=1), dim=1)


def concatenated_and_separated(embeddings_per_model, labels, device=None):
    """Both accuracies of the paper for the test-set embeddings of the fold models:
    ``{"concatenated": accuracy of concatenate(...), "separated": mean over models of
    each model's accuracy, "per_model": [...]}``."""
    per_model = [
        accuracy(F.normalize(torch.as_tensor(e).float(), dim=1), labels, device=device) for e in embeddings_per_model
    ]
    separated = {name: float(np.mean([m[name] for m in per_model])) for name in METRICS}
    concatenated = accuracy(concatenate(embeddings_per_model), labels, device=device)
    return {"concatenated": concatenated, "separated": separated, "per_model": per_model}


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
    return mean, float(stats.t.ppf(0.5 + confidence / 2, values.size - 1) * sem)
