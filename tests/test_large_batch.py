"""Large-batch training: chunked gradients equal full-batch gradients."""

import copy
import inspect
import warnings

import pytest
import torch
from pytorch_metric_learning import losses as pml_losses
from pytorch_metric_learning import miners as pml_miners
from pytorch_metric_learning.trainers import MetricLossOnly

import pml_rank
from pml_rank.large_batch import LargeBatchMetricLossOnly, large_batch_backward
from pml_rank.losses import FastAPLoss

DIM_IN, DIM_OUT = 6, 5


def model(dropout=0.0, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(DIM_IN, 16),
        torch.nn.ReLU(),
        torch.nn.Dropout(dropout),
        torch.nn.Linear(16, DIM_OUT),
    ).double()


def batch(n=24, per_class=2, seed=0):
    generator = torch.Generator().manual_seed(seed)
    data = torch.randn(n, DIM_IN, generator=generator, dtype=torch.float64)
    labels = torch.arange(n) // per_class
    return data, labels


def full_batch_gradients(net, loss_func, data, labels, miner=None):
    embeddings = net(data)
    indices_tuple = miner(embeddings, labels) if miner is not None else None
    loss = loss_func(embeddings, labels, indices_tuple)
    loss.backward()
    return loss.detach(), _grads(net, loss_func)


def chunked_gradients(net, loss_func, data, labels, chunk_size, miner=None):
    loss = large_batch_backward(net, loss_func, data, labels, chunk_size, miner=miner)
    return loss, _grads(net, loss_func)


def _grads(*modules):
    return [p.grad.clone() for m in modules for p in m.parameters()]


def assert_same_step(loss_func, chunk_size=5, miner=None, data_and_labels=None):
    data, labels = data_and_labels or batch()
    twin = copy.deepcopy(loss_func)  # losses with a memory or parameters start equal
    full_loss, full = full_batch_gradients(model(), loss_func, data, labels, miner)
    chunk_loss, chunked = chunked_gradients(model(), twin, data, labels, chunk_size, miner)
    torch.testing.assert_close(chunk_loss, full_loss, rtol=1e-10, atol=1e-12)
    assert any(g.abs().max() > 0 for g in full)  # there is something to compare
    for a, b in zip(chunked, full):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-12)


# Collected from the registry, so every loss registered later is covered too.
@pytest.mark.parametrize("name", sorted(pml_rank.registry.losses()))
def test_every_registered_loss_chunked_equals_full_batch(name):
    loss_class = pml_rank.registry.losses()[name]
    required = [
        p.name
        for p in inspect.signature(loss_class).parameters.values()
        if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]
    if required:
        pytest.skip(f"{name}() needs arguments: {', '.join(required)}")
    assert_same_step(loss_class())


@pytest.mark.parametrize("chunk_size", [1, 7, 24, 100])
def test_fast_ap_any_chunk_size(chunk_size):
    assert_same_step(FastAPLoss(), chunk_size, data_and_labels=batch(n=24, per_class=4))


def test_pml_loss_with_a_miner():
    assert_same_step(pml_losses.MultiSimilarityLoss(), miner=pml_miners.MultiSimilarityMiner(epsilon=0.5))


def test_pml_loss_with_parameters_gets_their_gradient_too():
    num_classes = 12
    assert_same_step(pml_losses.ProxyAnchorLoss(num_classes, DIM_OUT).double())


def test_dropout_sees_the_same_random_numbers_in_both_passes():
    data, labels = batch(n=24, per_class=4)
    net = model(dropout=0.5)
    torch.manual_seed(123)
    loss, chunked = chunked_gradients(net, FastAPLoss(), data, labels, chunk_size=8)
    # The same chunks embedded with a graph, in the same order, from the same seed.
    net = model(dropout=0.5)
    torch.manual_seed(123)
    embeddings = torch.cat([net(data[i : i + 8]) for i in range(0, 24, 8)])
    expected = FastAPLoss()(embeddings, labels)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach())
    for a, b in zip(chunked, _grads(net)):
        torch.testing.assert_close(a, b)


def test_nothing_to_learn_returns_the_zero_loss_and_no_gradient():
    data, _ = batch(n=10)
    net = model()
    loss = large_batch_backward(net, FastAPLoss(), data, torch.arange(10), chunk_size=3)
    assert loss.item() == 0
    assert all(p.grad is None or not p.grad.any() for p in net.parameters())


@pytest.mark.parametrize("chunk_size", [0, -1, 2.0, True])
def test_bad_chunk_size(chunk_size):
    data, labels = batch()
    with pytest.raises(ValueError, match="chunk_size must be a positive integer"):
        large_batch_backward(model(), FastAPLoss(), data, labels, chunk_size)


def _train_one_step(trainer_class, loss_weight=1.0, **extra):
    data, labels = batch(n=32, per_class=4, seed=1)
    dataset = torch.utils.data.TensorDataset(data, labels)
    trunk = model(seed=3)
    trainer = trainer_class(
        models={"trunk": trunk},
        optimizers={"trunk_optimizer": torch.optim.SGD(trunk.parameters(), lr=0.5)},
        batch_size=32,
        loss_funcs={"metric_loss": FastAPLoss()},
        loss_weights={"metric_loss": loss_weight},
        mining_funcs={"tuple_miner": pml_miners.MultiSimilarityMiner(epsilon=0.5)},
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
    return [p.detach().clone() for p in trunk.parameters()], trainer


def test_trainer_takes_the_same_step_as_metric_loss_only():
    for weight in (1.0, 0.3):
        expected, _ = _train_one_step(MetricLossOnly, weight)
        updated, trainer = _train_one_step(LargeBatchMetricLossOnly, weight, chunk_size=5)
        initial = list(model(seed=3).parameters())
        assert any((a - b).abs().max() > 0 for a, b in zip(updated, initial))  # it trained
        for a, b in zip(updated, expected):
            torch.testing.assert_close(a, b)


def test_trainer_logs_the_loss_metric_loss_only_logs_whatever_its_weight():
    for weight in (1.0, 0.3):
        logged = {}
        for trainer_class, extra in ((MetricLossOnly, {}), (LargeBatchMetricLossOnly, {"chunk_size": 5})):
            record = lambda trainer: logged.setdefault(trainer_class, {k: float(v) for k, v in trainer.losses.items()})
            _train_one_step(trainer_class, weight, end_of_iteration_hook=record, **extra)
        expected = logged[MetricLossOnly]
        assert expected["metric_loss"] > 0  # something to learn
        assert logged[LargeBatchMetricLossOnly] == pytest.approx(expected)


def test_trainer_warns_about_batchnorm_in_training_mode():
    data, labels = batch(n=16, per_class=4)
    trunk = torch.nn.Sequential(torch.nn.Linear(DIM_IN, 8), torch.nn.BatchNorm1d(8)).double()
    dataset = torch.utils.data.TensorDataset(data, labels)
    trainer = LargeBatchMetricLossOnly(
        models={"trunk": trunk},
        optimizers={},
        batch_size=16,
        loss_funcs={"metric_loss": FastAPLoss()},
        dataset=dataset,
        iterations_per_epoch=1,
        data_device=torch.device("cpu"),
        dtype=torch.float64,
        dataloader_num_workers=0,
        chunk_size=4,
    )
    with pytest.warns(UserWarning, match=r"BatchNorm layers in training mode \(trunk.1\)"):
        trainer.train(num_epochs=1)
