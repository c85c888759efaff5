"""RecallAtKSurrogateLoss against the paper's formula (pml_rank.harness.references) and
against the authors' computation (yash0307/RecallatK_surrogate, src/losses.py and
src/mixup.py, read and rewritten here in our own words), values and gradients in float64."""

import itertools
import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from pytorch_metric_learning.distances import LpDistance
from pytorch_metric_learning.reducers import DoNothingReducer
from pytorch_metric_learning.trainers import MetricLossOnly

from pml_rank import _device_policy
from pml_rank.harness.references.recall_at_k import recall_at_k_loss as paper_loss
from pml_rank.large_batch import LargeBatchMetricLossOnly, large_batch_backward
from pml_rank.losses import RecallAtKSurrogateLoss, recall_at_k


def authors_sigmoid(x, temperature):
    """Their sigmoid: the exponent −x/τ clamped to [−50, 50]."""
    return 1 / (1 + torch.exp(torch.clamp(-x / temperature, -50, 50)))


def authors_loss(preds, num_classes, k_values=(1, 2, 4, 8, 16), rank_temperature=0.01, recall_temperature=1.0):
    """What their training loop computes: the sum over every query q of their
    ``RecallatK.forward(preds, q)``. Their batch is `num_classes` blocks of equal size,
    one class each, in order, and `preds` are unit-norm embeddings (mixed ones are not).
    For the query's class block: each block member x is ranked against every row of the
    batch except itself, the query included; the query's own slot is then left out of
    the count; k is clipped at the batch size and the normaliser is min(k, block size − 1)."""
    size = len(preds)
    per_class = size // num_classes
    total = 0
    for q in range(size):
        start = (q // per_class) * per_class
        similarities = preds @ preds[q]
        gaps = similarities[:, None] - similarities[None, start : start + per_class]
        sigmoids = authors_sigmoid(gaps, rank_temperature)
        members = torch.arange(per_class)
        not_itself = torch.ones_like(sigmoids)
        not_itself[start + members, members] = 0
        ranks = 1 + (sigmoids * not_itself).sum(0)
        not_query = torch.ones(per_class, dtype=preds.dtype)
        not_query[q - start] = 0
        recall = 0
        for k in k_values:
            k = min(k, size)
            count = (authors_sigmoid(k - ranks, recall_temperature) * not_query).sum()
            recall = recall + torch.clamp(count, max=k) / min(k, per_class - 1)
        total = total + (1 - recall / len(k_values)) / size
    return total


def authors_mixed_batch(preds, labels, alpha):
    """Their SiMix batch (``pos_mixup``): after each class block, one mixture
    α·x_i + (1 − α)·x_j per pair of the block. `alpha` is given per pair in our order
    (row-major over the whole batch), so that both sides use the same mixtures."""
    pairs = [(i, j) for i, j in itertools.combinations(range(len(labels)), 2) if labels[i] == labels[j]]
    blocks = []
    for c in dict.fromkeys(labels.tolist()):  # classes in order of appearance
        members = (labels == c).nonzero().squeeze(1)
        mixes = [alpha[n] * preds[i] + (1 - alpha[n]) * preds[j] for n, (i, j) in enumerate(pairs) if labels[i] == c]
        blocks.append(torch.cat([preds[members], torch.stack(mixes)]))
    return torch.cat(blocks)


def seeded(size, dim=6, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(size, dim, generator=generator, dtype=torch.float64, requires_grad=True)


def value_and_grad(fn, embeddings, *args, **kwargs):
    loss = fn(embeddings, *args, **kwargs)
    (grad,) = torch.autograd.grad(loss, embeddings)
    return loss.detach(), grad


def assert_same(a, b, rtol=1e-9, atol=1e-11):
    torch.testing.assert_close(a[0], b[0], rtol=rtol, atol=atol)
    torch.testing.assert_close(a[1], b[1], rtol=rtol, atol=atol)
    assert b[1].abs().max() > 1e-6  # there is a gradient to compare


LAYOUTS = {
    "8 classes x 4, in blocks": torch.arange(32) // 4,
    "8 classes x 4, shuffled": (torch.arange(32) // 4)[torch.randperm(32, generator=torch.Generator().manual_seed(1))],
    "unequal classes and singletons": torch.tensor([0] * 7 + [1] * 2 + [2] * 5 + [3, 4, 5] + [6] * 3),
    "two classes of 12": torch.arange(24) % 2,
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_equals_the_papers_formula(layout):
    labels = LAYOUTS[layout]
    embeddings = seeded(len(labels))
    ours = value_and_grad(RecallAtKSurrogateLoss(), embeddings, labels)
    assert_same(ours, value_and_grad(paper_loss, embeddings, labels))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"k_values": [1, 3, 5], "rank_temperature": 0.05, "recall_temperature": 0.5},
        {"k_values": [2, 40]},  # 40 is longer than the list: replaced by its length
        {"rank_temperature": 0.5},
    ],
)
def test_other_k_and_temperatures_equal_the_papers_formula(kwargs):
    labels = torch.arange(20) // 4
    embeddings = seeded(20, seed=3)
    ours = value_and_grad(RecallAtKSurrogateLoss(**kwargs), embeddings, labels)
    assert_same(ours, value_and_grad(paper_loss, embeddings, labels, **kwargs))


def test_ref_emb_equals_the_papers_formula():
    embeddings, references = seeded(10, seed=4), seeded(25, seed=5)
    labels, ref_labels = torch.arange(10) % 5, torch.arange(25) % 6
    loss = RecallAtKSurrogateLoss()
    both = torch.cat([embeddings, references])
    ours = value_and_grad(lambda x: loss(x[:10], labels, ref_emb=x[10:], ref_labels=ref_labels), both)
    expected = value_and_grad(lambda x: paper_loss(x[:10], labels, ref_emb=x[10:], ref_labels=ref_labels), both)
    assert_same(ours, expected)


@pytest.mark.parametrize(("num_classes", "per_class"), [(8, 4), (5, 3), (12, 2), (4, 6)])
def test_query_in_ranking_equals_the_authors_code(num_classes, per_class):
    """On the layouts their code takes (equal class blocks, in order), and shuffled."""
    labels = torch.arange(num_classes * per_class) // per_class
    embeddings = seeded(len(labels), seed=per_class)
    theirs = value_and_grad(lambda x: authors_loss(F.normalize(x, dim=1), num_classes), embeddings)
    loss = RecallAtKSurrogateLoss(query_in_ranking=True)
    assert_same(value_and_grad(loss, embeddings, labels), theirs)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))
    permuted = embeddings.detach()[order].requires_grad_()
    value, grad = value_and_grad(loss, permuted, labels[order])
    torch.testing.assert_close(value, theirs[0], rtol=1e-9, atol=1e-11)
    torch.testing.assert_close(grad, theirs[1][order], rtol=1e-9, atol=1e-11)


def test_the_authors_code_ranks_the_query_itself():
    """The deviation query_in_ranking exists for: their ranks count the query (similarity
    1) above its positives, which the paper's formula does not."""
    labels = torch.arange(32) // 4
    embeddings = seeded(32, seed=7).detach()
    theirs = authors_loss(F.normalize(embeddings, dim=1), num_classes=8)
    assert abs(theirs - paper_loss(embeddings, labels)) > 0.02
    assert abs(theirs - RecallAtKSurrogateLoss()(embeddings, labels)) > 0.02


@pytest.mark.parametrize(("num_classes", "per_class"), [(6, 3), (5, 4)])
def test_similarity_mixup_equals_the_authors_code(num_classes, per_class):
    """Their pos_mixup takes 3, 4 or 6 samples per class; the α are drawn by our loss and
    handed to their layout."""
    labels = torch.arange(num_classes * per_class) // per_class
    embeddings = seeded(len(labels), seed=11)
    loss = RecallAtKSurrogateLoss(similarity_mixup=True, query_in_ranking=True)
    torch.manual_seed(5)
    ours = value_and_grad(loss, embeddings, labels)
    torch.manual_seed(5)
    alpha = torch.rand(num_classes * per_class * (per_class - 1) // 2, dtype=torch.float64)

    def theirs(x):
        return authors_loss(authors_mixed_batch(F.normalize(x, dim=1), labels, alpha), num_classes)

    assert_same(ours, value_and_grad(theirs, embeddings))


def test_similarity_mixup_equals_the_papers_formula_with_virtual_samples():
    labels = LAYOUTS["unequal classes and singletons"]
    embeddings = seeded(len(labels), seed=12)
    torch.manual_seed(3)
    ours = value_and_grad(RecallAtKSurrogateLoss(similarity_mixup=True), embeddings, labels)
    torch.manual_seed(3)
    first, second = zip(*[(i, j) for i, j in itertools.combinations(range(len(labels)), 2) if labels[i] == labels[j]])
    alpha = torch.rand(len(first), dtype=torch.float64)
    virtual = (torch.tensor(first), torch.tensor(second), alpha)
    assert_same(ours, value_and_grad(paper_loss, embeddings, labels, virtual=virtual))


def test_virtual_queries_carry_their_first_samples_index():
    labels = torch.tensor([0, 0, 0, 1, 1, 2])
    losses = RecallAtKSurrogateLoss(similarity_mixup=True, reducer=DoNothingReducer())(seeded(6), labels)
    # Pairs (0, 1), (0, 2), (1, 2), (3, 4); sample 5 has no positive.
    assert losses["loss"]["indices"].tolist() == [0, 1, 2, 3, 4, 0, 0, 1, 3]


@pytest.mark.parametrize("shuffled", [False, True])
@pytest.mark.parametrize("panel_elements", [1, 50])
def test_panels_do_not_change_the_result(panel_elements, shuffled, monkeypatch):
    """Panels of one query, or of one to a few queries with equally many positives, the
    queries of a panel consecutive or not."""
    labels = LAYOUTS["unequal classes and singletons"]
    if shuffled:
        labels = labels[torch.randperm(len(labels), generator=torch.Generator().manual_seed(4))]
    embeddings = seeded(len(labels), seed=2)
    whole = value_and_grad(RecallAtKSurrogateLoss(), embeddings, labels)
    monkeypatch.setattr(_device_policy, "PANEL_ELEMENTS", panel_elements)
    assert_same(value_and_grad(RecallAtKSurrogateLoss(), embeddings, labels), whole, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("as_indices", [False, True], ids=["left out as a mask", "left out as indices"])
def test_gradcheck_of_the_relaxed_recall(as_indices):
    """The analytic backward against finite differences, on similarities directly
    (gaps well inside the sigmoid's range: τ1 = 0.2), with the pairs left out of the
    ranking given either way `query_panels.left_out_filled_` takes them."""
    generator = torch.Generator().manual_seed(0)
    scores = (torch.rand(6, 9, generator=generator, dtype=torch.float64) * 2 - 1).requires_grad_()
    left_out = torch.zeros(6, 9, dtype=torch.bool)
    left_out[torch.arange(6), torch.arange(6)] = True
    left_out[0, 8] = True
    positive = torch.zeros_like(left_out)
    positive[[0, 0, 1, 2, 3, 3, 3, 4, 5], [1, 2, 0, 7, 4, 5, 6, 3, 2]] = True
    loss = RecallAtKSurrogateLoss(k_values=[1, 2, 4], rank_temperature=0.2, recall_temperature=0.7)
    k, normalizer = loss.k_and_normalizer((~left_out).sum(1), positive.sum(1), torch.float64)
    query, element = positive.nonzero(as_tuple=True)
    left_out_arg = left_out.nonzero(as_tuple=True) if as_indices else left_out

    def recall(s):
        return recall_at_k.relaxed_recall(s, left_out_arg, query, element, k, normalizer, 0.2, 0.7)

    assert torch.autograd.gradcheck(recall, (scores,))


def test_the_count_of_positives_in_the_top_k_is_clipped_at_k():
    """Ten positives tied at the top: each has relaxed rank 1 + 9/2 = 5.5, so the relaxed
    count of positives in the top 8 is 10 σ(2.5) ≈ 9.2 > 8: clipped to 8, R@8 = 1 (the
    loss would be negative without the clip) and no gradient."""
    embeddings = torch.cat([torch.ones(11, 2), torch.tensor([[1.0, -1.0]] * 3)]).double().requires_grad_()
    labels = torch.tensor([0] * 11 + [1] * 3)
    assert 10 * torch.sigmoid(torch.tensor(2.5)) > 8
    loss = RecallAtKSurrogateLoss(k_values=[8], reducer=DoNothingReducer())
    losses = loss(embeddings, labels)["loss"]
    assert losses["indices"][:11].tolist() == list(range(11))
    assert losses["losses"][:11].tolist() == [0.0] * 11
    (grad,) = torch.autograd.grad(losses["losses"][:11].sum(), embeddings)
    assert not grad.any()


def test_queries_without_a_positive_or_a_negative_are_left_out():
    labels = torch.tensor([0, 0, 0, 1, 2, 3, 3])
    embeddings = seeded(7, seed=9)
    loss = RecallAtKSurrogateLoss(reducer=DoNothingReducer())
    assert loss(embeddings, labels)["loss"]["indices"].tolist() == [0, 1, 2, 5, 6]
    for no_pairs in (torch.arange(7), torch.zeros(7, dtype=torch.long)):  # no positive / no negative
        total = RecallAtKSurrogateLoss()(embeddings, no_pairs)
        assert total.item() == 0
        total.backward()
        assert not embeddings.grad.any()


def test_indices_tuple_defines_the_positives_and_the_ranked_references():
    """All pairs but the query's own copy, against a copy of the batch: the in-batch loss."""
    labels = LAYOUTS["unequal classes and singletons"]
    embeddings = seeded(len(labels), seed=6)
    same = labels[:, None] == labels[None, :]
    not_self = ~torch.eye(len(labels), dtype=torch.bool)
    tuple_ = (*torch.where(same & not_self), *torch.where(~same))
    loss = RecallAtKSurrogateLoss()
    copy = embeddings.detach().clone()
    value, grad = value_and_grad(loss, embeddings, labels, tuple_, ref_emb=copy, ref_labels=labels.clone())
    expected = value_and_grad(paper_loss, embeddings, labels, ref_emb=copy, ref_labels=labels.clone())
    assert not torch.isclose(value, expected[0])  # without the tuple, each query finds itself
    in_batch = loss(embeddings.detach(), labels)
    torch.testing.assert_close(value, in_batch, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"k_values": []}, "k_values must be a non-empty list of integers >= 1, got []"),
        ({"k_values": [1, 0]}, "k_values must be a non-empty list of integers >= 1, got [1, 0]"),
        ({"k_values": [1.5]}, "k_values must be a non-empty list of integers >= 1, got [1.5]"),
        ({"k_values": [True]}, "k_values must be a non-empty list of integers >= 1, got [True]"),
        ({"rank_temperature": 0}, "rank_temperature must be a finite number > 0, got 0"),
        ({"recall_temperature": float("inf")}, "recall_temperature must be a finite number > 0, got inf"),
        ({"distance": LpDistance()}, "the distance must be a similarity (higher = closer), got LpDistance"),
    ],
)
def test_bad_values_are_refused_by_name(kwargs, message):
    """Types are the shared check's (tests/test_constructor_arguments.py); these are ranges."""
    with pytest.raises(ValueError, match=re.escape(f"RecallAtKSurrogateLoss: {message}")):
        RecallAtKSurrogateLoss(**kwargs)


def test_similarity_mixup_needs_the_batch_as_references():
    embeddings, labels = seeded(8), torch.arange(8) // 2
    with pytest.raises(ValueError, match="RecallAtKSurrogateLoss: similarity_mixup=True .* no ref_emb"):
        RecallAtKSurrogateLoss(similarity_mixup=True)(embeddings, labels, ref_emb=embeddings, ref_labels=labels.clone())


def test_the_papers_batch_size_in_bounded_memory():
    """4000 samples, 4 per class (SOP's and iNaturalist's batches): a B x B x B tensor
    would be 256 GB in float32."""
    generator = torch.Generator().manual_seed(0)
    embeddings = torch.randn(4000, 16, generator=generator).requires_grad_()
    loss = RecallAtKSurrogateLoss()(embeddings, torch.arange(4000) // 4)
    loss.backward()
    assert 0 < loss.item() < 1 and torch.isfinite(embeddings.grad).all()


def _net(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).double()


def test_large_batch_chunks_give_the_full_batch_gradient():
    """The paper's scheme at batch 1000 in chunks of 200 (their bs_base)."""
    generator = torch.Generator().manual_seed(0)
    data = torch.randn(1000, 8, generator=generator, dtype=torch.float64)
    labels = torch.arange(1000) // 4
    full_net, chunked_net = _net(), _net()
    full = RecallAtKSurrogateLoss()(full_net(data), labels)
    full.backward()
    chunked = large_batch_backward(chunked_net, RecallAtKSurrogateLoss(), data, labels, chunk_size=200)
    torch.testing.assert_close(chunked, full.detach(), rtol=1e-12, atol=1e-14)
    for a, b in zip(chunked_net.parameters(), full_net.parameters()):
        assert b.grad.abs().max() > 0
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-9, atol=1e-13)


def _one_step(trainer_class, **extra):
    generator = torch.Generator().manual_seed(1)
    data = torch.randn(512, 8, generator=generator, dtype=torch.float64)
    dataset = torch.utils.data.TensorDataset(data, torch.arange(512) // 4)
    trunk = _net(seed=2)
    trainer = trainer_class(
        models={"trunk": trunk},
        optimizers={"trunk_optimizer": torch.optim.SGD(trunk.parameters(), lr=1.0)},
        batch_size=512,
        loss_funcs={"metric_loss": RecallAtKSurrogateLoss(similarity_mixup=False)},
        dataset=dataset,
        sampler=torch.utils.data.SequentialSampler(dataset),
        iterations_per_epoch=1,
        data_device=torch.device("cpu"),
        dtype=torch.float64,
        dataloader_num_workers=0,
        **extra,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train(num_epochs=1)
    return list(trunk.parameters())


def test_large_batch_trainer_takes_metric_loss_onlys_step():
    expected = _one_step(MetricLossOnly)
    updated = _one_step(LargeBatchMetricLossOnly, chunk_size=128)
    assert any((a - b).abs().max() > 0 for a, b in zip(updated, _net(seed=2).parameters()))  # it trained
    for a, b in zip(updated, expected):
        torch.testing.assert_close(a, b)


def test_speed_case_times_ours_against_the_reference_and_the_floor():
    from pml_rank.harness import speed

    result = speed.measure("RecallAtKSurrogateLoss", sizes=(16,), dim=8, repeats=1, warmup=0, progress=False)
    assert set(result["rows"][0]["seconds"]) == {"ours", "reference", "floor"}
    assert speed.CASES["RecallAtKSurrogateLoss"].underflow()[0]().rank_temperature == 0.001


def test_search_space_gives_valid_constructor_arguments_around_the_papers_values():
    import optuna

    import pml_rank

    space = pml_rank.registry.search_spaces()["RecallAtKSurrogateLoss"]
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    for _ in range(30):
        params = space(study.ask())
        RecallAtKSurrogateLoss(**params)
        assert 1e-3 <= params["rank_temperature"] <= 0.1 and 0.1 <= params["recall_temperature"] <= 10


def test_a_second_backward_pass_and_no_grad_give_the_same_results():
    """The backward pass scales the Jacobian computed in the forward pass in place; a
    second pass through the graph computes it again, and without autograd none is made."""
    labels = LAYOUTS["unequal classes and singletons"]
    embeddings = seeded(len(labels), seed=3)
    loss = RecallAtKSurrogateLoss()(embeddings, labels)
    first = torch.autograd.grad(3 * loss, embeddings, retain_graph=True)[0]
    second = torch.autograd.grad(loss, embeddings)[0]
    assert second.abs().max() > 1e-4
    torch.testing.assert_close(first, 3 * second, rtol=1e-12, atol=1e-15)
    with torch.no_grad():
        torch.testing.assert_close(RecallAtKSurrogateLoss()(embeddings, labels), loss.detach(), rtol=0, atol=0)
