"""`evaluation.accuracy` (queries searched a block at a time) against PML's own
`AccuracyCalculator` on seeded data, against Recall@K written from its definition, and
in bounded memory."""

import math
import subprocess
import sys

import faiss
import numpy as np
import pytest
import torch
from pytorch_metric_learning.utils.accuracy_calculator import AccuracyCalculator

from pml_rank.harness.evaluation import METRICS, accuracy
from pml_rank.harness.evaluation import metrics as metrics_module


def pml_accuracy(query, labels, reference=None, reference_labels=None, include=METRICS, device="cpu"):
    """PML's values, its calculator configured as the Reality Check reports them."""
    calculator = AccuracyCalculator(include=include, k="max_bin_count", device=torch.device(device))
    return calculator.get_accuracy(query, labels, reference, reference_labels)


def clustered(seed, n, classes, dimensions, ties=False, dtype=np.float32):
    """``(embeddings, labels)``: `n` points around `classes` random centres, classes of
    unequal sizes (a Zipf-like draw: a few large classes, many singletons). With `ties`,
    coordinates are rounded to a coarse grid, so many distances are exactly equal."""
    rng = np.random.default_rng(seed)
    weights = 1 / np.arange(1, classes + 1)
    labels = rng.choice(classes, size=n, p=weights / weights.sum())
    centres = rng.standard_normal((classes, dimensions))
    embeddings = centres[labels] + 0.7 * rng.standard_normal((n, dimensions))
    if ties:
        embeddings = np.round(2 * embeddings)
    else:
        embeddings /= np.linalg.norm(embeddings, axis=1, keepdims=True)
    return embeddings.astype(dtype), labels


def assert_same_values(ours, theirs):
    assert ours.keys() == theirs.keys()
    for name in ours:
        if math.isnan(theirs[name]):
            assert math.isnan(ours[name]), name
        else:
            assert ours[name] == pytest.approx(theirs[name], abs=1e-12), name


@pytest.mark.parametrize(
    "seed, n, classes, dimensions, ties",
    [
        (0, 2, 1, 3, False),  # one class of two
        (1, 40, 30, 4, False),  # mostly singletons
        (2, 300, 30, 16, False),
        (3, 500, 120, 8, True),  # exact ties everywhere, including with the query itself
        (4, 257, 60, 2, True),
    ],
)
def test_accuracy_equals_pmls_calculator_queries_against_the_rest(seed, n, classes, dimensions, ties):
    embeddings, labels = clustered(seed, n, classes, dimensions, ties)
    assert_same_values(accuracy(embeddings, labels, device="cpu"), pml_accuracy(embeddings, labels))


def test_accuracy_equals_pmls_calculator_for_float64_and_tensors():
    embeddings, labels = clustered(5, 200, 40, 6, dtype=np.float64)
    expected = pml_accuracy(embeddings, labels)  # PML computes in float32, as we do
    assert_same_values(accuracy(embeddings, labels, device="cpu"), expected)
    assert_same_values(accuracy(torch.from_numpy(embeddings), torch.from_numpy(labels), device="cpu"), expected)


@pytest.mark.parametrize("ties", [False, True])
def test_accuracy_equals_pmls_calculator_for_queries_against_a_reference_set(ties):
    # Queries of classes 0-29 against a gallery of classes 10-59: classes 0-9 have no
    # reference (left out), classes 30-59 are only distractors.
    embeddings, labels = clustered(6, 700, 60, 8, ties)
    is_query = (labels < 30) & (np.arange(700) % 3 == 0)
    is_reference = (labels >= 10) & ~is_query
    args = embeddings[is_query], labels[is_query], embeddings[is_reference], labels[is_reference]
    assert (labels[is_query] < 10).any()
    assert_same_values(accuracy(*args, device="cpu"), pml_accuracy(*args))


def test_a_query_hidden_behind_its_duplicates_is_handled_as_pml_does():
    # Two spots of 15 identical points, 10 classes of 3: k = 2, so 3 neighbours are
    # searched, and most queries are not among their own 3 (faiss keeps the first
    # indices of a tie). PML then drops the last neighbour instead of the query.
    embeddings = np.zeros((30, 2), dtype=np.float32)
    embeddings[15:, 0] = 1
    labels = np.arange(30) % 10
    index = faiss.IndexFlatL2(2)
    index.add(embeddings)
    neighbours = index.search(embeddings, 3)[1]
    assert not (neighbours == np.arange(30)[:, None]).any(axis=1).all()
    assert_same_values(accuracy(embeddings, labels, device="cpu"), pml_accuracy(embeddings, labels))


def test_singletons_are_no_queries_but_stay_references():
    # One dimension: class 0 at 0 and 1, the singleton class 1 at 0.4, class 2 at 5 and 6.
    # Both points of class 0 find the singleton first; class 2 finds itself; the singleton
    # has nothing to find and is left out: 2 hits out of 4 queries, not 2 out of 5.
    embeddings = np.array([[0.0], [1.0], [0.4], [5.0], [6.0]], dtype=np.float32)
    labels = np.array([0, 0, 1, 2, 2])
    result = accuracy(embeddings, labels, device="cpu")
    assert result == {name: 0.5 for name in METRICS}
    assert_same_values(result, pml_accuracy(embeddings, labels))


def test_without_any_query_to_answer_every_metric_is_nan_as_in_pml():
    embeddings, _ = clustered(7, 6, 2, 3)
    labels = np.arange(6)  # all singletons
    result = accuracy(embeddings, labels, device="cpu")
    assert all(math.isnan(v) for v in result.values())
    assert_same_values(result, pml_accuracy(embeddings, labels))


def recall_at_k_by_definition(embeddings, labels, k):
    """Share of the queries with another point of their class whose k nearest other points
    (float64 Euclidean distances) include one of their class."""
    x = torch.from_numpy(embeddings).double()
    distances = torch.cdist(x, x).fill_diagonal_(math.inf)
    order = distances.argsort(dim=1)[:, :k].numpy()
    found = [(labels[order[i]] == labels[i]).any() for i in range(len(labels)) if (labels == labels[i]).sum() > 1]
    return float(np.mean(found))


def test_recall_at_k_follows_its_definition_and_r_at_1_is_p_at_1():
    embeddings, labels = clustered(8, 240, 50, 8)
    names = ("P@1", "R@1", "R@4", "R@32", "R@1000")
    result = accuracy(embeddings, labels, metrics=names, device="cpu")
    assert result["R@1"] == result["P@1"]
    for k in (1, 4, 32, 1000):
        assert result[f"R@{k}"] == pytest.approx(recall_at_k_by_definition(embeddings, labels, k), abs=1e-12)
    assert result["R@1000"] == 1.0  # deeper than the data: every answered query finds its class
    assert 0 < result["R@1"] < result["R@4"] < 1


def test_nmi_is_pmls():
    embeddings, labels = clustered(9, 200, 10, 8)
    expected = AccuracyCalculator(include=("NMI",), device=torch.device("cpu")).get_accuracy(embeddings, labels)
    assert accuracy(embeddings, labels, metrics=("NMI",), device="cpu")["NMI"] == expected["NMI"]


@pytest.fixture
def small_faiss_blocks(monkeypatch):
    """faiss computing distances in blocks of 64 queries (BLAS from 2 x 64 x 8 values on),
    so a few hundred queries take several of our blocks. PML's search sees the same settings."""
    monkeypatch.setattr(faiss.cvar, "distance_compute_blas_query_bs", 64)
    monkeypatch.setattr(faiss.cvar, "distance_compute_blas_threshold", 2 * 64 * 8)


@pytest.mark.parametrize("n", [128, 300, 650])
def test_query_blocks_are_whole_faiss_blocks_above_its_threshold_covering_every_query(small_faiss_blocks, n):
    blocks = metrics_module._query_blocks(n, 8, k=10)
    assert blocks[0][0] == 0 and blocks[-1][1] == n
    assert all(stop == next_start for (_, stop), (next_start, _) in zip(blocks, blocks[1:]))
    # 128 queries of 8 values reach the threshold; the last block takes the short remainder.
    assert all(stop - start == 128 for start, stop in blocks[:-1])
    assert 128 <= blocks[-1][1] - blocks[-1][0] < 256 or blocks == [(0, n)]


@pytest.mark.parametrize("ties", [False, True])
def test_accuracy_over_several_blocks_equals_pmls_single_search(small_faiss_blocks, ties):
    embeddings, labels = clustered(10, 650, 150, 8, ties)
    assert len(metrics_module._query_blocks(650, 8, k=10)) == 5
    assert_same_values(accuracy(embeddings, labels, device="cpu"), pml_accuracy(embeddings, labels))


def test_blocks_cut_smaller_for_a_deep_k_give_the_same_values(monkeypatch):
    embeddings, labels = clustered(11, 400, 80, 8)
    names = ("P@1", "RP", "MAP@R", "R@100")
    expected = accuracy(embeddings, labels, metrics=names, device="cpu")
    monkeypatch.setattr(metrics_module, "MAX_NEIGHBOURS_PER_BLOCK", 3000)  # 29 queries x 101 neighbours
    assert len(metrics_module._query_blocks(400, 8, k=101)) == 13
    assert accuracy(embeddings, labels, metrics=names, device="cpu") == pytest.approx(expected, abs=1e-12)


PEAK_MEMORY_GROWTH = """
import resource
import numpy as np
from pml_rank.harness.evaluation import accuracy

rng = np.random.default_rng(12)
embeddings = rng.standard_normal((12_000, 8)).astype(np.float32)
labels = rng.integers(0, 3_000, 12_000)
accuracy(embeddings[:500], labels[:500], device="cpu")  # faiss's and the BLAS's own buffers
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
accuracy(embeddings, labels, device="cpu")
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)
"""


@pytest.mark.slow
def test_peak_memory_grows_with_the_queries_not_with_classes_times_references():
    # 12,000 points in 3,000 classes: PML's label comparison takes 36 million entries
    # (classes x references; its peak grows by 345 MB here). Ours holds k nearest
    # neighbours per query.
    grown_kib = int(
        subprocess.run([sys.executable, "-c", PEAK_MEMORY_GROWTH], capture_output=True, text=True, check=True).stdout
    )
    assert grown_kib < 3_000 * 12_000 / 1024  # less than a byte per (class, reference)


@pytest.mark.parametrize(
    "args, kwargs, message",
    [
        ((np.zeros((3, 2)), [0, 1]), {}, "labels must hold one label per row of embeddings"),
        ((np.zeros(3), [0, 1, 1]), {}, r"embeddings must be a non-empty \(n, d\) matrix"),
        ((np.zeros((0, 2)), []), {}, r"embeddings must be a non-empty \(n, d\) matrix"),
        ((np.array([[0.0], [math.nan]]), [0, 0]), {}, "embeddings contains 1 NaN/Inf"),
        ((np.zeros((2, 2)), [0, 0]), {"reference": np.zeros((2, 2))}, "reference and reference_labels go together"),
        (
            (np.zeros((2, 2)), [0, 0]),
            {"reference": np.zeros((2, 3)), "reference_labels": [0, 0]},
            "reference has 3 dimensions but embeddings have 2",
        ),
        (
            (np.zeros((2, 2)), [0, 0]),
            {"reference": np.zeros((2, 2)), "reference_labels": [0]},
            "reference_labels must hold one label per row of reference",
        ),
        ((np.zeros((2, 2)), [0, 0]), {"metrics": ("MAP@10",)}, "unknown metric"),
    ],
)
def test_bad_input_is_refused_naming_the_parameter(args, kwargs, message):
    with pytest.raises(ValueError, match=f"accuracy: {message}"):
        accuracy(*args, **kwargs)


def test_the_torch_search_finds_faiss_neighbours_in_faiss_order():
    generator = np.random.default_rng(0)
    reference = generator.standard_normal((500, 24)).astype(np.float32)
    queries = generator.standard_normal((70, 24)).astype(np.float32)
    index = faiss.IndexFlatL2(24)
    index.add(reference)
    expected_distances, expected = index.search(queries, 9)
    distances, found = metrics_module.TorchFlatL2(reference, "cpu").search(queries, 9)
    np.testing.assert_array_equal(found, expected)
    np.testing.assert_allclose(distances, expected_distances, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("with_reference", [False, True])
def test_accuracy_with_the_torch_search_equals_faisss(with_reference, monkeypatch):
    embeddings, labels = clustered(13, 400, 40, 8)
    args = (embeddings[:250], labels[:250], embeddings[250:], labels[250:]) if with_reference else (embeddings, labels)
    with_faiss = accuracy(*args, metrics=(*METRICS, "R@4"), device="cpu")
    monkeypatch.setattr(metrics_module, "knn_backend", lambda device: "torch")
    assert accuracy(*args, metrics=(*METRICS, "R@4"), device="cpu") == with_faiss


def test_retrieval_without_a_gpu_uses_faiss_on_the_cpu():
    assert metrics_module.knn_backend("cpu") == "faiss-cpu"
    if not torch.cuda.is_available():
        assert metrics_module.knn_backend("cuda") == "faiss-cpu"


@pytest.mark.cuda
def test_retrieval_on_cuda_runs_on_the_gpu():
    assert metrics_module.knn_backend("cuda") == ("faiss-gpu" if metrics_module.faiss_has_gpu() else "torch")


@pytest.mark.cuda
def test_accuracy_on_the_gpu_equals_pmls_on_the_gpu_and_ours_on_the_cpu():
    embeddings, labels = clustered(14, 600, 100, 16)
    on_gpu = accuracy(torch.from_numpy(embeddings).cuda(), labels, device="cuda")
    assert on_gpu == pytest.approx(accuracy(embeddings, labels, device="cpu"), abs=1e-6)
    assert on_gpu == pytest.approx(pml_accuracy(embeddings, labels, device="cuda"), abs=1e-6)
    args = embeddings[:200], labels[:200], embeddings[200:], labels[200:]
    assert accuracy(*args, device="cuda") == pytest.approx(pml_accuracy(*args, device="cuda"), abs=1e-6)
