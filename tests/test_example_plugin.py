"""The third-party example plugin in plugins/: computes its formula, and trains inside
PML's trainers after pml_rank.install()."""

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from aten_counts import OperationNames
from pytorch_metric_learning import losses as pml_losses
from pytorch_metric_learning import trainers
from pytorch_metric_learning.utils import loss_and_miner_utils as lmu

import pml_rank
from pml_rank.harness.speed import peak_memory
from pml_rank.plugins import NameClashWarning


def binomial_deviance_reference(embeddings, labels, alpha, beta, cost):
    """Loops over pairs, straight from the definition."""
    e = F.normalize(embeddings, dim=1)
    positive, negative = [], []
    for i in range(len(e)):
        for j in range(len(e)):
            if i == j:
                continue
            s = torch.dot(e[i], e[j])
            if labels[i] == labels[j]:
                positive.append(torch.log(1 + torch.exp(-alpha * (s - beta))))
            else:
                negative.append(torch.log(1 + torch.exp(alpha * cost * (s - beta))))
    return torch.stack(positive).mean() + torch.stack(negative).mean()


def test_binomial_deviance_matches_its_formula_value_and_gradient():
    loss_cls = pml_rank.registry.losses()["BinomialDevianceLoss"]
    generator = torch.Generator().manual_seed(0)
    embeddings = torch.randn(12, 5, generator=generator, dtype=torch.float64, requires_grad=True)
    labels = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 3, 3, 4, 5])
    ours = loss_cls(alpha=2.0, beta=0.4, cost=5.0)(embeddings, labels)
    (grad_ours,) = torch.autograd.grad(ours, embeddings)
    reference = binomial_deviance_reference(embeddings, labels, 2.0, 0.4, 5.0)
    (grad_reference,) = torch.autograd.grad(reference, embeddings)
    torch.testing.assert_close(ours, reference)
    torch.testing.assert_close(grad_ours, grad_reference)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("references", ["batch", "ref_emb"])
def test_binomial_deviance_over_all_pairs_equals_the_loss_over_their_listed_pairs(dtype, references):
    """Without an indices_tuple the loss sums the deviance of the whole matrix under the
    pair masks; with every pair listed (PML's own all-pairs indices) it gathers them:
    the same value and gradients. Unequal classes, singletons among them."""
    loss_cls = pml_rank.registry.losses()["BinomialDevianceLoss"]
    generator = torch.Generator().manual_seed(3)
    labels = torch.randint(0, 40, (200,), generator=generator)
    embeddings = torch.randn(200, 16, generator=generator, dtype=dtype)
    kwargs = {}
    if references == "ref_emb":
        kwargs = {"ref_emb": torch.randn(90, 16, generator=generator, dtype=dtype), "ref_labels": labels[:90]}
    pairs = lmu.get_all_pairs_indices(labels, kwargs.get("ref_labels", labels))
    results = []
    for indices_tuple in (None, pairs):
        inputs = {"embeddings": embeddings, **kwargs}
        inputs = {k: v.clone().requires_grad_() if v.is_floating_point() else v for k, v in inputs.items()}
        value = loss_cls(alpha=2.0, beta=0.4, cost=5.0)(labels=labels, indices_tuple=indices_tuple, **inputs)
        tensors = [v for v in inputs.values() if v.requires_grad]
        results.append((value, *torch.autograd.grad(value, tensors)))
    tolerance = {"rtol": 1e-5, "atol": 1e-7} if dtype == torch.float32 else {"rtol": 1e-12, "atol": 1e-15}
    torch.testing.assert_close(results[0], results[1], **tolerance)
    assert results[0][0] > 0.1 and results[0][1].abs().max() > 1e-4


@pytest.mark.parametrize("labels", [[0, 1, 2, 3, 4], [5, 5, 5, 5]], ids=["no positive pair", "no negative pair"])
def test_binomial_deviance_without_a_positive_or_a_negative_pair_is_zero(labels):
    loss_cls = pml_rank.registry.losses()["BinomialDevianceLoss"]
    embeddings = torch.randn(len(labels), 8, generator=torch.Generator().manual_seed(0)).requires_grad_()
    value = loss_cls()(embeddings, torch.tensor(labels))
    value.backward()
    assert value.item() == 0
    assert torch.equal(embeddings.grad, torch.zeros_like(embeddings))


def _operations(batch):
    loss = pml_rank.registry.losses()["BinomialDevianceLoss"]()
    embeddings = torch.randn(batch, 32, generator=torch.Generator().manual_seed(0)).requires_grad_()
    with OperationNames() as operations:
        loss(embeddings, torch.arange(batch) // 4).backward()
    return operations.names


def test_binomial_deviance_picks_no_pairs_out_of_the_matrix():
    """No index tensors of the pairs (nonzero waits for the device and is as long as the
    pairs), no gather and no scatter of the gradients back (index_put, which cost 25 ms of
    35 at batch 8192 on a GPU): the same operations at any batch size."""
    small, large = _operations(64), _operations(512)
    assert small == large
    assert not {"aten::nonzero", "aten::index", "aten::index_put", "aten::_local_scalar_dense"} & set(large)


def test_binomial_deviance_keeps_under_four_similarity_matrices():
    """Its backward pass recomputes the deviance's arguments instead of keeping them: 5.75
    matrices at once before (batch 2048), autograd keeping the margins, the arguments and
    the masked deviances of every pair."""
    n = 512
    embeddings = torch.randn(n, 32, generator=torch.Generator().manual_seed(0)).requires_grad_()
    loss = pml_rank.registry.losses()["BinomialDevianceLoss"]()
    peak = peak_memory(loss, (embeddings, torch.arange(n) // 4), torch.device("cpu"))
    assert peak < 4 * n * n * 4, f"{peak / (n * n * 4):.2f} matrices"


@pytest.mark.parametrize("references", ["batch", "ref_emb"])
def test_binomial_deviance_by_row_blocks_equals_the_whole_matrix(references, monkeypatch):
    """A large matrix's passes run on row blocks (uneven here: 203 rows in 4 blocks): the same
    value and gradients as the whole matrix at once, self-pairs left out of every block."""
    from pml_rank_example import binomial_deviance

    loss_cls = pml_rank.registry.losses()["BinomialDevianceLoss"]
    generator = torch.Generator().manual_seed(5)
    labels = torch.randint(0, 30, (203,), generator=generator)
    inputs = {"embeddings": torch.randn(203, 16, generator=generator, dtype=torch.float64)}
    if references == "ref_emb":
        inputs.update(ref_emb=torch.randn(150, 16, generator=generator, dtype=torch.float64), ref_labels=labels[:150])
    results = []
    for blocked_from in (binomial_deviance.BLOCKED_FROM, 1000):
        monkeypatch.setattr(binomial_deviance, "BLOCKED_FROM", blocked_from)
        given = {k: v.clone().requires_grad_() if v.is_floating_point() else v for k, v in inputs.items()}
        value = loss_cls(alpha=2.0, beta=0.4, cost=5.0)(labels=labels, **given)
        results.append((value, *torch.autograd.grad(value, [v for v in given.values() if v.requires_grad])))
    assert len(binomial_deviance._row_blocks(torch.empty(203, 150))) == 4
    torch.testing.assert_close(results[0], results[1], rtol=1e-12, atol=1e-15)
    assert results[1][0] > 0.1 and results[1][1].abs().max() > 1e-4


def test_binomial_deviance_keeps_a_half_precision_product_as_it_is(monkeypatch):
    """Under autocast the product stays bfloat16 (no float32 copy kept for the backward pass),
    and with row blocks the float32 working copies take a quarter of the matrix at once: a
    float32 matrix's worth less at the peak. The gradient is the same bit for bit."""
    from pml_rank_example import binomial_deviance

    n = 512
    generator = torch.Generator().manual_seed(0)
    embeddings = torch.randn(n, 32, generator=generator).requires_grad_()
    layer = torch.nn.Linear(32, 32)
    loss = pml_rank.registry.losses()["BinomialDevianceLoss"]()

    def under_autocast(x, labels):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return loss(layer(x), labels)

    labels = torch.arange(n) // 4
    peaks, gradients = [], []
    for blocked_from in (binomial_deviance.BLOCKED_FROM, 1000):
        monkeypatch.setattr(binomial_deviance, "BLOCKED_FROM", blocked_from)
        peaks.append(peak_memory(under_autocast, (embeddings, labels), torch.device("cpu")) / (n * n * 4))
        gradients.append(torch.autograd.grad(under_autocast(embeddings, labels), embeddings)[0])
    assert peaks[1] < peaks[0] - 0.5, f"{peaks} float32 matrices"
    assert torch.equal(gradients[0], gradients[1])


def _clustered_dataset(num_classes=8, per_class=16, dim=16, seed=0):
    generator = torch.Generator().manual_seed(seed)
    centres = torch.randn(num_classes, dim, generator=generator) * 2
    labels = torch.arange(num_classes).repeat_interleave(per_class)
    data = centres[labels] + torch.randn(len(labels), dim, generator=generator) * 1.5
    return torch.utils.data.TensorDataset(data, labels)


def _mean_loss(model, loss_func, dataset):
    with torch.no_grad():
        data, labels = dataset.tensors
        return loss_func(model(data), labels).item()


def test_example_loss_trains_inside_pml_metric_loss_only():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NameClashWarning)
        report = pml_rank.install()
    try:
        torch.manual_seed(0)
        dataset = _clustered_dataset()
        trunk = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
        # Looked up by name in PML's own namespace, as a config-driven pipeline would.
        loss_func = pml_losses.BinomialDevianceLoss()
        before = _mean_loss(trunk, loss_func, dataset)
        trainer = trainers.MetricLossOnly(
            models={"trunk": trunk, "embedder": torch.nn.Identity()},
            optimizers={"trunk_optimizer": torch.optim.Adam(trunk.parameters(), lr=1e-2)},
            batch_size=32,
            loss_funcs={"metric_loss": loss_func},
            dataset=dataset,
            dataloader_num_workers=0,
        )
        trainer.train(num_epochs=5)
        after = _mean_loss(trunk, loss_func, dataset)
        assert math.isfinite(after)
        assert after < 0.8 * before
    finally:
        for dotted in report["installed"]:
            module_name, name = dotted.rsplit(".", 1)
            delattr(__import__(module_name, fromlist=[name]), name)
