"""Recall@K and NMI as the papers report them, through PML's `AccuracyCalculator` (faiss
k-nearest neighbours and k-means, GPU when present).

R@K is the share of queries with at least one same-class reference among their K nearest
neighbours (RaMBO eq. 7-8; the N-pair and AUC papers use the same definition). Queries
whose class has no other reference are left out, as PML leaves them out of P@1, so R@1
equals PML's ``precision_at_1``.
"""

import torch
from pytorch_metric_learning.utils.accuracy_calculator import AccuracyCalculator, try_getting_not_lone_labels

RECALL_KS = (1, 2, 4, 8, 10, 16, 20, 30, 32, 50, 100, 1000)


def recall_at_k(knn_labels, query_labels, k):
    """Share of rows of ``knn_labels`` (nearest first) holding ``query_labels`` within the
    first ``k`` columns."""
    hits = (knn_labels[:, :k] == query_labels.reshape(-1, 1)).any(dim=1)
    return hits.float().mean().item()


class RetrievalAccuracyCalculator(AccuracyCalculator):
    """PML's `AccuracyCalculator` with ``recall_at_<K>`` metrics for K in `RECALL_KS`.

    ``include=("recall_at_1", "recall_at_8", "NMI")``; k-nearest neighbours are taken as
    deep as the largest requested K (and the largest class, when R-Precision or MAP@R
    are requested too)."""

    def requires_knn(self):
        return super().requires_knn() + [f"recall_at_{k}" for k in RECALL_KS]

    def determine_k(self, bin_counts, num_reference_embeddings, ref_includes_query):
        available = num_reference_embeddings - int(ref_includes_query)
        wanted = [int(m.rsplit("_", 1)[1]) for m in self.get_curr_metrics() if m.startswith("recall_at_")]
        if set(self.get_curr_metrics()) & {"r_precision", "mean_average_precision_at_r"}:
            wanted.append(int(torch.max(bin_counts).item()) - int(ref_includes_query))
        return max(1, min(max(wanted, default=1), available))


def _make_recall_method(k):
    def calculate(self, knn_labels, query_labels, not_lone_query_mask, **kwargs):
        knn_labels, query_labels = try_getting_not_lone_labels(knn_labels, query_labels, not_lone_query_mask)
        if knn_labels is None:
            return float("nan")
        return recall_at_k(knn_labels, query_labels, k)

    calculate.__name__ = f"calculate_recall_at_{k}"
    calculate.__doc__ = f"R@{k}: share of queries with a same-class reference among their {k} nearest."
    return calculate


for _k in RECALL_KS:
    setattr(RetrievalAccuracyCalculator, f"calculate_recall_at_{_k}", _make_recall_method(_k))


# The papers' column names and PML's metric names.
METRIC_NAMES = {f"R@{k}": f"recall_at_{k}" for k in RECALL_KS}
METRIC_NAMES.update({"NMI": "NMI", "P@1": "precision_at_1", "RP": "r_precision",
                     "MAP@R": "mean_average_precision_at_r"})


def retrieval_accuracy(query, query_labels, reference=None, reference_labels=None, metrics=("R@1",),
                       device=None):
    """``{column: value in [0, 1]}`` for the papers' column names (``"R@8"``, ``"NMI"``,
    ``"MAP@R"``, ...). Without ``reference``, each query is retrieved among the other
    queries (itself excluded); with it, among ``reference`` (In-shop's gallery)."""
    unknown = [m for m in metrics if m not in METRIC_NAMES]
    if unknown:
        raise ValueError(f"retrieval_accuracy: unknown metric {unknown}; known: {', '.join(METRIC_NAMES)}")
    include = tuple(METRIC_NAMES[m] for m in metrics)
    calculator = RetrievalAccuracyCalculator(include=include, device=device)
    query_labels = torch.as_tensor(query_labels)
    if reference is not None:
        reference_labels = torch.as_tensor(reference_labels)
    result = calculator.get_accuracy(torch.as_tensor(query), query_labels, reference, reference_labels,
                                     ref_includes_query=False)
    return {m: float(result[METRIC_NAMES[m]]) for m in metrics}
