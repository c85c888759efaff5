"""Accuracy of embeddings as the papers report it: the Reality Check's P@1, R-Precision
and MAP@R for concatenated and separated embeddings, with means and 95% confidence
intervals over repeated runs, and the older papers' Recall@K and NMI.

The retrieval metrics are PML's `AccuracyCalculator` values (``k="max_bin_count"``),
computed block by block of queries: the same exact squared-L2 search (faiss's
``IndexFlatL2``; on a CUDA device without a GPU build of faiss, the same distances by
torch on the GPU, `TorchFlatL2`), the same removal of the query itself, the same lone-query rule, but
memory of a block's k nearest neighbours instead of PML's (classes x references) label
matrices: on 60,000 embeddings in 11,000 classes (Stanford Online Products' test set is
60,502 in 11,316), PML's peak is 6.8 GiB and ours 0.8 GiB, that of the search alone
(examples/eval_memory.py; PML issues #353, #566). NMI is PML's (faiss k-means).

R@K is the share of queries with at least one same-class reference among their K nearest
neighbours (RaMBO eq. 7-8; the N-pair and AUC papers use the same definition). Queries
whose class has no other reference are left out, as PML leaves them out of P@1, so R@1
equals PML's ``precision_at_1``.
"""

import math

import faiss
import numpy as np
import torch
import torch.nn.functional as F
from pytorch_metric_learning.distances import LpDistance
from pytorch_metric_learning.utils.accuracy_calculator import AccuracyCalculator
from pytorch_metric_learning.utils.inference import CustomKNN
from scipy import stats

from ..._checks import check_embeddings

RECALL_KS = (1, 2, 4, 8, 10, 16, 20, 30, 32, 50, 100, 1000)

# The papers' column names and PML's metric names: the one table of both.
PML_NAMES = {"P@1": "precision_at_1", "RP": "r_precision", "MAP@R": "mean_average_precision_at_r", "NMI": "NMI"}
PML_NAMES.update({f"R@{k}": f"recall_at_{k}" for k in RECALL_KS})
SHORT_NAMES = {pml: short for short, pml in PML_NAMES.items()}

# What the Reality Check protocol reports.
METRICS = ("precision_at_1", "r_precision", "mean_average_precision_at_r")

# Most neighbours (queries x k) searched at once: with the labels and hit masks of a
# block, about 40 bytes each. SOP's k of 11 to 1,000 stays far below it.
MAX_NEIGHBOURS_PER_BLOCK = 2**22
# faiss's largest k on the GPU; beyond it, the search runs on the CPU (as PML does).
GPU_MAX_K = 2048


def _precision_at_1(hits, relevant):
    return hits[:, 0]


def _r_precision(hits, relevant):
    return _first_r(hits, relevant).sum(axis=1) / relevant


def _map_at_r(hits, relevant):
    hits = _first_r(hits, relevant)
    ranks = np.arange(1, hits.shape[1] + 1)
    return (np.cumsum(hits, axis=1) * hits / ranks).sum(axis=1) / relevant


def _first_r(hits, relevant):
    """`hits` with the columns beyond each query's R (its number of relevant references) cleared."""
    return hits & (np.arange(hits.shape[1]) < relevant[:, None])


def _recall_at(k):
    return lambda hits, relevant: hits[:, :k].any(axis=1)


# Each retrieval metric's value for each query, from `hits` (queries x k: is the i-th
# nearest reference of the query's class?) and `relevant` (each query's R).
PER_QUERY = {
    "precision_at_1": _precision_at_1,
    "r_precision": _r_precision,
    "mean_average_precision_at_r": _map_at_r,
    **{f"recall_at_{k}": _recall_at(k) for k in RECALL_KS},
}


def accuracy(embeddings, labels, reference=None, reference_labels=None, metrics=METRICS, device=None):
    """``{metric: value in [0, 1]}`` for `metrics`, named either as PML names them
    (``"mean_average_precision_at_r"``) or as the papers' columns (``"MAP@R"``, ``"R@8"``,
    ``"NMI"``); the keys are the names given. PML's `AccuracyCalculator` gives the same
    values, with ``k="max_bin_count"`` (deeper when a deeper R@K is asked for).

    Without `reference`, every embedding is a query against all the others (itself
    excluded). With `reference`, the queries are `embeddings` and the retrieval set is
    `reference` (In-shop's gallery). Embeddings are used as given: normalise them first
    if the metric should be cosine (`concatenate` does). Queries whose class has no
    reference are left out; a metric none is left for is NaN. `device` (default: CUDA
    when torch sees it) is where the neighbours are searched (`knn_backend`)."""
    unknown = [m for m in metrics if m not in PML_NAMES and m not in SHORT_NAMES]
    if unknown:
        raise ValueError(f"accuracy: unknown metric {unknown}; known: {', '.join(PML_NAMES)}")
    names = [PML_NAMES.get(m, m) for m in metrics]
    query, query_labels = _checked_rows("embeddings", embeddings, "labels", labels)
    if (reference is None) != (reference_labels is None):
        raise ValueError("accuracy: reference and reference_labels go together; pass both or neither")
    if reference is not None:
        reference, reference_labels = _checked_rows("reference", reference, "reference_labels", reference_labels)
        if reference.shape[1] != query.shape[1]:
            raise ValueError(
                f"accuracy: reference has {reference.shape[1]} dimensions but embeddings have {query.shape[1]}"
            )
    device = torch.device(device if device is not None else "cuda" if torch.cuda.is_available() else "cpu")
    result = {}
    retrieval_names = [name for name in names if name in PER_QUERY]
    if retrieval_names:
        result = retrieval_accuracy(query, query_labels, reference, reference_labels, retrieval_names, device)
    if "NMI" in names:
        calculator = AccuracyCalculator(include=("NMI",), device=device)
        result["NMI"] = calculator.get_accuracy(torch.from_numpy(query), torch.from_numpy(query_labels))["NMI"]
    return {m: float(result[PML_NAMES.get(m, m)]) for m in metrics}


def retrieval_accuracy(query, query_labels, reference, reference_labels, names, device):
    """``{name: mean over the queries}`` for retrieval metrics `names` (keys of `PER_QUERY`)
    of float32 `query` (rows) against `reference` (`None`: the queries themselves, each
    without itself), searched a block of queries at a time."""
    excludes_self = reference is None
    if excludes_self:
        reference, reference_labels = query, query_labels
    classes, class_of = np.unique(np.concatenate([query_labels, reference_labels]), return_inverse=True)
    class_of = class_of.reshape(-1)
    query_classes, reference_classes = class_of[: len(query)], class_of[len(query) :]
    # R: each query's references of its own class. PML's "lone" queries (R = 0) are left out.
    relevant = np.bincount(reference_classes, minlength=len(classes))[query_classes] - int(excludes_self)
    answerable = relevant > 0
    if not answerable.any():
        return dict.fromkeys(names, float("nan"))
    wanted = [int(name.rsplit("_", 1)[1]) for name in names if name.startswith("recall_at_")]
    if set(names) - {f"recall_at_{k}" for k in wanted}:
        wanted.append(int(relevant.max()))  # PML's "max_bin_count"
    k = min(max(wanted), len(reference) - int(excludes_self))
    search_k = k + int(excludes_self)  # PML searches one more and removes the query itself

    index, _gpu_resources = flat_l2_index(reference, device, search_k)
    sums = dict.fromkeys(names, 0.0)
    for start, stop in _query_blocks(len(query), query.shape[1], search_k):
        _, neighbours = index.search(query[start:stop], search_k)
        if excludes_self:
            neighbours = _without_self(neighbours, start)
        kept = answerable[start:stop]
        hits = reference_classes[neighbours[kept]] == query_classes[start:stop][kept, None]
        for name in names:
            sums[name] += float(np.sum(PER_QUERY[name](hits, relevant[start:stop][kept]), dtype=np.float64))
    return {name: total / int(answerable.sum()) for name, total in sums.items()}


def _checked_rows(name, embeddings, labels_name, labels):
    """`embeddings` as a C-contiguous float32 (n, d) array and `labels` as an (n,) array,
    or ValueError/TypeError naming the parameter."""
    embeddings = torch.as_tensor(embeddings).detach()
    check_embeddings("accuracy", **{name: embeddings})
    if embeddings.ndim != 2 or len(embeddings) == 0:
        raise ValueError(f"accuracy: {name} must be a non-empty (n, d) matrix, got shape {tuple(embeddings.shape)}")
    labels = labels.detach().cpu().numpy() if torch.is_tensor(labels) else np.asarray(labels)
    if labels.shape != (len(embeddings),):
        raise ValueError(
            f"accuracy: {labels_name} must hold one label per row of {name} ({len(embeddings)}), "
            f"got shape {labels.shape}"
        )
    return np.ascontiguousarray(embeddings.cpu().float().numpy()), labels


def faiss_has_gpu():
    """Whether this faiss was built with GPU support and sees a GPU."""
    return hasattr(faiss, "StandardGpuResources") and faiss.get_num_gpus() > 0


def knn_backend(device):
    """Which exact k-NN search retrieval on `device` uses: "faiss-gpu", "torch" (a CUDA
    device without a GPU faiss: the GPU computes the distances, `TorchFlatL2`) or
    "faiss-cpu"."""
    if torch.device(device).type != "cuda" or not torch.cuda.is_available():
        return "faiss-cpu"
    return "faiss-gpu" if faiss_has_gpu() else "torch"


class TorchFlatL2:
    """faiss's ``IndexFlatL2`` search (exact squared L2, nearest first) over `reference`
    on a torch device, by PML's torch k-NN (`CustomKNN`): ``search(queries, k)`` returns
    numpy ``(distances, indices)`` as faiss does; neighbours at equal distance may come in
    another order."""

    def __init__(self, reference, device):
        self.reference = torch.from_numpy(reference).to(device)
        self.knn = CustomKNN(LpDistance(normalize_embeddings=False, power=2))

    def search(self, queries, k):
        distances, indices = self.knn(torch.from_numpy(queries).to(self.reference.device), k, self.reference)
        return distances.cpu().numpy(), indices.cpu().numpy()


def flat_l2_index(reference, device, k):
    """``(index, gpu_resources)``: an exact squared-L2 index holding `reference` for
    `device` (`knn_backend`): faiss's, moved to the GPU when faiss can and `k` fits (the
    resources must outlive the index), else a `TorchFlatL2` on a CUDA device."""
    backend = knn_backend(device)
    if backend == "torch":
        return TorchFlatL2(reference, device), None
    index = faiss.IndexFlatL2(reference.shape[1])
    index.add(reference)
    if backend == "faiss-cpu" or k > GPU_MAX_K:
        return index, None
    resources = faiss.StandardGpuResources()
    gpu = device.index if device.index is not None else torch.cuda.current_device()
    return faiss.index_cpu_to_gpu(resources, gpu, index), resources


def _query_blocks(num_queries, dimensions, k):
    """``(start, stop)`` of the blocks of queries searched at once. faiss computes the
    distances of a search in blocks of ``distance_compute_blas_query_bs`` queries, and
    another way (without BLAS) for a search smaller than ``distance_compute_blas_threshold``:
    whole multiples of its block, never below the threshold, with a short remainder joined
    to the last block, give each query the distances, hence the neighbours in the same
    order, ties included, of one search of all queries (PML's). Blocks of more than
    `MAX_NEIGHBOURS_PER_BLOCK` neighbours are cut smaller, at the cost of that identity."""
    faiss_block = faiss.cvar.distance_compute_blas_query_bs
    # The threshold is on queries x dimensions since faiss 1.15, on queries before.
    threshold = faiss.cvar.distance_compute_blas_threshold
    block = faiss_block * max(1, math.ceil(threshold / (dimensions * faiss_block)))
    if block * k > MAX_NEIGHBOURS_PER_BLOCK:
        block = max(1, MAX_NEIGHBOURS_PER_BLOCK // k)
    starts = list(range(0, num_queries, block))
    if len(starts) > 1 and num_queries - starts[-1] < block:
        starts.pop()
    return list(zip(starts, starts[1:] + [num_queries]))


def _without_self(neighbours, start):
    """`neighbours` (queries ``start, start + 1, ...`` x k + 1) without each query's own index,
    or without the last column for a query not found among its own neighbours (as PML's
    ``return_results``)."""
    is_self = neighbours == np.arange(start, start + len(neighbours))[:, None]
    is_self[~is_self.any(axis=1), -1] = True
    return neighbours[~is_self].reshape(len(neighbours), -1)


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
