"""SmoothAPLoss against two straightforward references, in float64, values and gradients:
`paper_losses`, loops over the paper's formula for any label layout, and
`authors_loss`, the computation of the authors' `SmoothAP.forward`
(Andrew-Brown1/Smooth_AP, src/Smooth_AP_loss.py) rewritten from reading it, on the
layouts it accepts. Also PML's `SmoothAPLoss`, which groups rows by the wrong count."""

import importlib.util
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from pytorch_metric_learning import losses as pml_losses
from pytorch_metric_learning import miners
from pytorch_metric_learning.distances import LpDistance
from pytorch_metric_learning.reducers import DoNothingReducer
from pytorch_metric_learning.utils import loss_and_miner_utils as lmu

from pml_rank import _device_policy
from pml_rank.harness import speed
from pml_rank.harness.speed import peak_memory
from pml_rank.losses import SmoothAPLoss

TAU = 0.01


def paper_losses(
    embeddings, labels, temperature=TAU, include_query=True, ref_emb=None, ref_labels=None, allowed_pairs=None
):
    """{query index: 1 − AP_q} with the paper's relaxed AP written out term by term.

    Query q retrieves the batch without itself (or `ref_emb`, all of it), restricted to
    `allowed_pairs` ({(q, j)}) when given; positives share its label. With
    `include_query`, q is one more positive, scored by its own cosine similarity. Queries
    without a positive other than themselves are absent."""
    queries = F.normalize(embeddings, dim=1)
    in_batch = ref_emb is None
    references = queries if in_batch else F.normalize(ref_emb, dim=1)
    ref_labels = labels if in_batch else ref_labels
    losses = {}
    for q in range(len(queries)):
        items = []  # (score, is positive)
        for j in range(len(references)):
            if (in_batch and j == q) or (allowed_pairs is not None and (q, j) not in allowed_pairs):
                continue
            items.append((queries[q] @ references[j], bool(labels[q] == ref_labels[j])))
        if not any(positive for _, positive in items):
            continue
        if include_query:
            items.append((queries[q] @ queries[q], True))
        precisions = []
        for a, (score_a, positive_a) in enumerate(items):
            if not positive_a:
                continue
            rank_positive, rank_all = 1.0, 1.0
            for b, (score_b, positive_b) in enumerate(items):
                if b == a:
                    continue
                above = torch.sigmoid((score_b - score_a) / temperature)
                rank_all = rank_all + above
                if positive_b:
                    rank_positive = rank_positive + above
            precisions.append(rank_positive / rank_all)
        losses[q] = 1 - sum(precisions) / len(precisions)
    return losses


def paper_loss(*args, **kwargs):
    losses = paper_losses(*args, **kwargs)
    return sum(losses.values()) / len(losses)


def _authors_sigmoid(tensor, temperature):
    # Their sigmoid clamps the exponent to [-50, 50].
    return 1.0 / (1.0 + torch.exp((-tensor / temperature).clamp(-50, 50)))


def authors_loss(preds, num_id, anneal=TAU):
    """The authors' computation: `preds` (their network's output, L2-normalised) ordered
    class by class, `num_id` classes of equal size. Ranks of every batch item among the
    whole batch (the query included, as its own first positive) and among its class, from
    B x B x B and num_id x g x g x g sigmoid tensors; 1 − the mean over queries of
    (1/g) Σ_class rank_in_class / rank_in_batch."""
    batch_size = len(preds)
    group = batch_size // num_id
    similarity = preds @ preds.T
    # difference[q, i, j] = s_qj − s_qi; an item is not compared with itself.
    difference = similarity.unsqueeze(1) - similarity.unsqueeze(2)
    not_self = 1.0 - torch.eye(batch_size, dtype=preds.dtype)
    rank_in_batch = (_authors_sigmoid(difference, anneal) * not_self).sum(-1) + 1
    per_class = preds.view(num_id, group, -1)
    class_similarity = per_class @ per_class.transpose(1, 2)
    class_difference = class_similarity.unsqueeze(2) - class_similarity.unsqueeze(3)
    not_self = 1.0 - torch.eye(group, dtype=preds.dtype)
    rank_in_class = (_authors_sigmoid(class_difference, anneal) * not_self).sum(-1) + 1
    ap = 0.0
    for c in range(num_id):
        block = slice(c * group, (c + 1) * group)
        ap = ap + (rank_in_class[c] / rank_in_batch[block, block]).sum() / group / batch_size
    return 1 - ap


def seeded(size, dim=16, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(size, dim, generator=generator, dtype=torch.float64).requires_grad_()


def grad(loss, embeddings):
    return torch.autograd.grad(loss, embeddings, retain_graph=True)[0]


def assert_same_loss_and_gradient(ours, reference, embeddings):
    torch.testing.assert_close(ours, reference, rtol=1e-12, atol=1e-12)
    reference_grad = grad(reference, embeddings)
    assert reference_grad.abs().max() > 1e-3  # the comparison below is not trivially zero
    torch.testing.assert_close(grad(ours, embeddings), reference_grad, rtol=1e-9, atol=1e-12)


# (classes, samples per class): every layout the authors' code accepts has equal,
# contiguous classes, in any number.
AUTHORS_LAYOUTS = [(2, 2), (3, 4), (4, 4), (8, 2), (2, 8), (5, 3), (16, 4)]


@pytest.mark.parametrize("classes, per_class", AUTHORS_LAYOUTS)
def test_equals_the_authors_computation_and_the_paper_on_their_layouts(classes, per_class):
    embeddings = seeded(classes * per_class, seed=classes * 100 + per_class)
    labels = torch.arange(classes * per_class) // per_class
    authors = authors_loss(F.normalize(embeddings, dim=1), classes)
    ours = SmoothAPLoss()(embeddings, labels)
    assert_same_loss_and_gradient(ours, authors, embeddings)
    assert_same_loss_and_gradient(ours, paper_loss(embeddings, labels), embeddings)
    # Their order is a requirement of their code only: any order gives the same loss.
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(1))
    shuffled = embeddings.detach()[order].requires_grad_()
    shuffled_loss = SmoothAPLoss()(shuffled, labels[order])
    torch.testing.assert_close(shuffled_loss, authors, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad(shuffled_loss, shuffled), grad(authors, embeddings)[order])


LAYOUTS = {
    "unequal classes": [0, 0, 0, 0, 0, 1, 1, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3],
    "singletons among pairs": [0, 1, 1, 2, 3, 3, 4, 5, 5, 5, 6],
    "one class": [7] * 9,
    "shuffled random": torch.randint(0, 5, (23,), generator=torch.Generator().manual_seed(3)).tolist(),
}


@pytest.mark.parametrize("include_query", [True, False])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_equals_the_paper_on_any_layout(layout, include_query):
    labels = torch.tensor(LAYOUTS[layout])
    embeddings = seeded(len(labels), seed=len(labels))
    loss_func = SmoothAPLoss(include_query=include_query, reducer=DoNothingReducer())
    per_query = loss_func(embeddings, labels)["loss"]
    reference = paper_losses(embeddings, labels, include_query=include_query)
    assert per_query["indices"].tolist() == sorted(reference)
    assert loss_func.num_queries == len(reference)
    torch.testing.assert_close(per_query["losses"], torch.stack(list(reference.values())), rtol=1e-12, atol=1e-12)
    if layout == "one class":  # nothing ranks above a positive: AP = 1, no gradient (up to rounding)
        torch.testing.assert_close(per_query["losses"], torch.zeros(9, dtype=torch.float64))
        loss = SmoothAPLoss(include_query=include_query)(embeddings, labels)
        assert grad(loss, embeddings).abs().max() < 1e-14
    else:
        loss = SmoothAPLoss(include_query=include_query)(embeddings, labels)
        assert_same_loss_and_gradient(loss, paper_loss(embeddings, labels, include_query=include_query), embeddings)


@pytest.mark.parametrize("panel_elements", [1, 100])
@pytest.mark.parametrize("layout", ["unequal classes", "shuffled random"])
def test_panels_of_one_to_a_few_queries_equal_the_paper(layout, panel_elements, monkeypatch):
    """Panels of 1 query, or of 1 to 6 queries of a group (the last one shorter), queries
    consecutive or not: each query's ranks come from its own panel."""
    monkeypatch.setattr(_device_policy, "PANEL_ELEMENTS", panel_elements)
    labels = torch.tensor(LAYOUTS[layout])
    embeddings = seeded(len(labels), seed=len(labels))
    for include_query in (True, False):
        loss = SmoothAPLoss(include_query=include_query)(embeddings, labels)
        assert_same_loss_and_gradient(loss, paper_loss(embeddings, labels, include_query=include_query), embeddings)


def test_the_conventions_differ_and_the_default_is_the_authors():
    labels = torch.arange(12) // 3
    embeddings = seeded(12)
    authors = authors_loss(F.normalize(embeddings, dim=1), 4)
    torch.testing.assert_close(SmoothAPLoss()(embeddings, labels), authors)
    assert abs(SmoothAPLoss(include_query=False)(embeddings, labels) - authors) > 0.01


@pytest.mark.parametrize("include_query", [True, False])
def test_gradcheck(include_query):
    labels = torch.tensor([0, 0, 1, 1, 1, 2, 3, 3])
    embeddings = seeded(8, dim=4, seed=5)
    loss_func = SmoothAPLoss(temperature=0.1, include_query=include_query)
    assert torch.autograd.gradcheck(lambda e: loss_func(e, labels), (embeddings,))


@pytest.mark.parametrize("per_class", [4, 64])
def test_peak_memory_is_a_few_similarity_matrices_whatever_the_class_size(per_class):
    size = 256  # PML's and the authors' B x B x B float32 tensors: 64 MB each
    embeddings = torch.randn(size, 32, generator=torch.Generator().manual_seed(0)).requires_grad_()
    labels = torch.arange(size) // per_class
    peak = peak_memory(SmoothAPLoss(), (embeddings, labels), torch.device("cpu"))
    matrix = size * size * 4
    assert peak < 12 * matrix, f"{peak / matrix:.1f} similarity matrices"


def test_speed_times_pml_only_where_its_cubes_fit():
    case = speed.CASES["SmoothAPLoss"]
    assert "pml" in case.contenders(768) and "pml" not in case.contenders(1024)
    assert "ours" in case.contenders(2048)


@pytest.mark.parametrize("include_query", [True, False])
def test_ref_emb_every_reference_counts(include_query):
    embeddings, ref_emb = seeded(10, seed=1), seeded(14, seed=2)
    labels = torch.tensor([0, 0, 1, 2, 3, 3, 4, 5, 6, 9])
    ref_labels = torch.tensor([0, 1, 1, 2, 2, 2, 3, 4, 4, 5, 5, 7, 8, 8])
    loss_func = SmoothAPLoss(include_query=include_query)
    loss = loss_func(embeddings, labels, ref_emb=ref_emb, ref_labels=ref_labels)
    reference = paper_losses(embeddings, labels, include_query=include_query, ref_emb=ref_emb, ref_labels=ref_labels)
    assert loss_func.num_queries == len(reference) == 8  # queries 6 and 9 have no positive reference
    reference_loss = sum(reference.values()) / len(reference)
    torch.testing.assert_close(loss, reference_loss, rtol=1e-12, atol=1e-12)
    ours_grads = torch.autograd.grad(loss, (embeddings, ref_emb))
    reference_grads = torch.autograd.grad(reference_loss, (embeddings, ref_emb))
    for ours_grad, reference_grad in zip(ours_grads, reference_grads):
        torch.testing.assert_close(ours_grad, reference_grad, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("include_query", [True, False])
def test_batch_as_references_with_pairs_equals_the_batch(include_query):
    """What PML's DistributedLossWrapper(efficient=True) and CrossBatchMemory pass: the
    batch again as references and every pair but the self pairs."""
    labels = torch.tensor([0, 0, 0, 1, 1, 2, 3, 3, 3, 3])
    embeddings = seeded(10)
    loss_func = SmoothAPLoss(include_query=include_query)
    whole = loss_func(embeddings, labels)
    pairs = lmu.get_all_pairs_indices(labels, labels)
    as_references = loss_func(embeddings, labels, pairs, embeddings.detach().clone(), labels.clone())
    torch.testing.assert_close(as_references, whole, rtol=1e-12, atol=1e-12)


def test_indices_tuple_restricts_each_ranking_to_its_pairs():
    labels = torch.randint(0, 4, (20,), generator=torch.Generator().manual_seed(4))
    embeddings = seeded(20, seed=4)
    pairs = miners.MultiSimilarityMiner(epsilon=0.3)(embeddings, labels)
    a1, p, a2, n = pairs
    allowed = set(zip(a1.tolist(), p.tolist())) | set(zip(a2.tolist(), n.tolist()))
    assert 0 < len(allowed) < 20 * 19
    loss = SmoothAPLoss()(embeddings, labels, pairs)
    assert_same_loss_and_gradient(loss, paper_loss(embeddings, labels, allowed_pairs=allowed), embeddings)


def test_a_distance_is_turned_into_a_score():
    """With a distance, the score is minus the distance; τ is in its units. Unit vectors:
    squared Euclidean distance = 2 − 2 cos, so τ doubles."""
    labels = torch.arange(12) // 4
    embeddings = seeded(12)
    by_distance = SmoothAPLoss(temperature=2 * TAU, distance=LpDistance(power=2))(embeddings, labels)
    torch.testing.assert_close(by_distance, SmoothAPLoss()(embeddings, labels), rtol=1e-9, atol=1e-12)


def test_nothing_to_learn_gives_zero_losses():
    embeddings = seeded(6)
    loss = SmoothAPLoss()(embeddings, torch.arange(6))
    assert loss.item() == 0
    loss.backward()
    assert not embeddings.grad.any()


def test_half_precision_is_computed_in_float32():
    labels = torch.arange(16) // 4
    embeddings = torch.randn(16, 8, generator=torch.Generator().manual_seed(0))
    half = embeddings.half().requires_grad_()
    loss = SmoothAPLoss()(half, labels)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, SmoothAPLoss()(half.detach().float(), labels))
    loss.backward()
    assert half.grad.dtype == torch.float16 and torch.isfinite(half.grad).all()


@pytest.mark.parametrize("temperature", [0, -0.01, math.inf])
def test_temperature_out_of_range_is_named(temperature):
    # Types (text, bools, unknown keywords) are the shared constructor check's, tested in
    # tests/test_constructor_arguments.py for every component.
    with pytest.raises(ValueError, match=f"SmoothAPLoss: temperature must be a finite number > 0, got {temperature}"):
        SmoothAPLoss(temperature=temperature)


def _example():
    path = Path(__file__).parents[2] / "examples" / "smooth_ap_vs_pml.py"
    spec = importlib.util.spec_from_file_location("smooth_ap_vs_pml", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_example_prints_the_table(capsys):
    _example().main(["--seed", "1", "--dim", "8"])
    out = capsys.readouterr().out
    assert "seed 1, dim 8" in out and all(f"| {c} x {n} |" in out for c, n in _example().LAYOUTS)


def test_pml_groups_rows_by_the_wrong_count_unless_classes_equal_samples_per_class():
    """The README's table (examples/smooth_ap_vs_pml.py): on every batch ours is the
    paper's loss; PML's is only where classes == samples per class."""
    example = _example()
    table = example.rows()
    for (classes, per_class, embeddings, labels), (_, _, pml, ours) in zip(example.batches(), table):
        assert ours == pytest.approx(paper_loss(embeddings, labels).item(), abs=1e-12)
        if classes == per_class:
            assert pml == pytest.approx(ours, abs=1e-6)
        else:
            assert abs(pml - ours) > 1e-3
    with pytest.raises(ValueError, match="same number of elements"):  # and it refuses unequal classes
        pml_losses.SmoothAPLoss()(seeded(5), torch.tensor([0, 0, 0, 1, 1]))


def test_a_second_backward_pass_and_no_grad_give_the_same_results():
    """The backward pass scales the Jacobian computed in the forward pass in place; a
    second pass through the graph computes it again, and without autograd none is made."""
    labels = torch.tensor(LAYOUTS["unequal classes"])
    embeddings = seeded(len(labels), seed=4)
    loss = SmoothAPLoss()(embeddings, labels)
    first, second = grad(3 * loss, embeddings), grad(loss, embeddings)
    torch.testing.assert_close(first, 3 * second, rtol=1e-12, atol=1e-15)
    with torch.no_grad():
        torch.testing.assert_close(SmoothAPLoss()(embeddings, labels), loss.detach(), rtol=0, atol=0)
