"""On a CUDA device pml-rank computes what it computes on the CPU: every registered loss
(value and gradient, with `ref_emb`, with a miner's `indices_tuple`, inside
`CrossBatchMemory`), hard negative class mining with a network, large-batch training, and
the `bench` and `speed` commands through the installed entry point. Mixed precision on
CUDA: tests/losses/test_autocast.py. Runs where torch sees a GPU (marker ``cuda``);
skipped elsewhere (tests/conftest.py)."""

import json
import os
import subprocess

import pytest
import torch
from pytorch_metric_learning import miners
from pytorch_metric_learning.utils import loss_and_miner_utils as lmu
from test_cli import _entry_point

import pml_rank
from pml_rank import ranking
from pml_rank.large_batch import large_batch_backward
from pml_rank.losses import CrossBatchMemory
from pml_rank.samplers import HardNegativeClassSampler

pytestmark = pytest.mark.cuda

LOSSES = sorted(pml_rank.registry.losses())
DEVICES = ("cpu", "cuda")


def seeded_batch(size=32, dim=16, per_class=4, seed=0):
    generator = torch.Generator().manual_seed(seed)
    embeddings = torch.randn(size, dim, generator=generator, dtype=torch.float64)
    return embeddings, torch.arange(size // per_class).repeat_interleave(per_class)


def make(name, **kwargs):
    return pml_rank.registry.losses()[name](**kwargs)


def on_each_device(compute):
    """``{device: what compute(device) returns, moved to the CPU}`` for the CPU and CUDA;
    `compute` gets a fresh copy of every input on its device."""
    results = {}
    for device in DEVICES:
        results[device] = [t.detach().cpu() for t in compute(device)]
    return results


def assert_cuda_equals_cpu(results):
    for cuda, cpu in zip(results["cuda"], results["cpu"]):
        torch.testing.assert_close(cuda, cpu, rtol=1e-6, atol=1e-9)
    assert any(bool(t.abs().max() > 0) for t in results["cpu"][1:]), "a gradient that is zero everywhere"


def loss_and_gradients(loss_func, embeddings, labels, device, ref=None, miner=None):
    """The loss of leaf copies of the inputs on `device` and the gradients of every input.
    (A leaf per device: ``x.to("cpu")`` is `x` itself, ``x.to("cuda")`` a non-leaf without
    ``.grad``.)"""
    x = embeddings.detach().to(device).requires_grad_()
    labels = labels.to(device)
    kwargs, leaves = {}, [x]
    if ref is not None:
        ref_emb = ref[0].detach().to(device).requires_grad_()
        kwargs, leaves = {"ref_emb": ref_emb, "ref_labels": ref[1].to(device)}, [x, ref_emb]
    indices_tuple = miner(x, labels, kwargs.get("ref_emb"), kwargs.get("ref_labels")) if miner else None
    loss = loss_func.to(device)(x, labels, indices_tuple, **kwargs)
    return [loss, *torch.autograd.grad(loss, leaves, allow_unused=True, materialize_grads=True)]


@pytest.mark.parametrize("with_ref", [False, True], ids=["batch", "ref_emb"])
@pytest.mark.parametrize("name", LOSSES)
def test_every_loss_on_cuda_equals_the_cpu(name, with_ref):
    embeddings, labels = seeded_batch()
    ref = seeded_batch(size=48, seed=1) if with_ref else None
    results = on_each_device(lambda device: loss_and_gradients(make(name), embeddings, labels, device, ref))
    assert_cuda_equals_cpu(results)


@pytest.mark.parametrize("name", LOSSES)
def test_every_loss_with_a_miners_pairs_on_cuda_equals_the_cpu(name):
    embeddings, labels = seeded_batch()
    miner = miners.MultiSimilarityMiner(epsilon=0.3)
    if name.startswith("RaMBO"):  # it ranks as many references for every query: every pair but its own
        miner = lambda x, labels, *_: lmu.get_all_pairs_indices(labels)
    results = on_each_device(lambda device: loss_and_gradients(make(name), embeddings, labels, device, miner=miner))
    assert_cuda_equals_cpu(results)


@pytest.mark.parametrize("name", LOSSES)
def test_every_loss_inside_cross_batch_memory_on_cuda_equals_the_cpu(name):
    kwargs = {"memory_size": 0} if name.startswith("RaMBO") else {}
    batches = [seeded_batch(seed=seed) for seed in range(3)]

    def three_steps(device):
        memory = CrossBatchMemory(make(name, **kwargs), embedding_size=16, memory_size=64).to(device)
        return [t for embeddings, labels in batches for t in loss_and_gradients(memory, embeddings, labels, device)]

    assert_cuda_equals_cpu(on_each_device(three_steps))


@pytest.mark.parametrize("name", ["average_precision_loss", "apc_loss", "map_loss"])
@pytest.mark.parametrize("positive_rate", [0.05, 0.5], ids=["counted", "sorted"])
def test_the_ap_losses_on_scores_on_cuda_equal_the_cpu(name, positive_rate):
    """The ranking functions, both ways of ranking (few positives per sequence: counted;
    many: sorted), their sizes from the positives' counts (nonzero_static), the loss's
    scale k kept on the device (a loss weight of 0.37)."""
    generator = torch.Generator().manual_seed(1)
    scores = torch.randn(48, 40, generator=generator, dtype=torch.float64)
    targets = torch.rand(48, 40, generator=generator) < positive_rate

    def compute(device):
        x = scores.to(device).requires_grad_()
        loss = getattr(ranking, name)(x, targets.to(device), lambda_val=4.0) * 0.37
        return [loss, *torch.autograd.grad(loss, [x])]

    assert_cuda_equals_cpu(on_each_device(compute))


def test_hard_negative_class_mining_with_a_network_on_cuda_picks_the_cpus_batches():
    generator = torch.Generator().manual_seed(0)
    labels = torch.arange(40).repeat_interleave(5)
    inputs = torch.randn(40, 12, generator=generator, dtype=torch.float64)[labels]
    inputs += 0.3 * torch.randn(len(labels), 12, generator=generator, dtype=torch.float64)
    dataset = torch.utils.data.TensorDataset(inputs, labels)
    batches = {}
    for device in DEVICES:
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8)).double()
        sampler = HardNegativeClassSampler(labels, classes_per_batch=6, seed=0)
        sampler.attach(net.to(device), dataset)
        batches[device] = [list(sampler) for _ in range(2)]
        assert sampler.embedded_examples > 0
    assert batches["cuda"] == batches["cpu"]


@pytest.mark.parametrize("name", ["FastAPLoss", "SmoothAPLoss", "NPairsMCLoss"])
def test_large_batch_training_on_cuda_equals_the_full_batch_and_the_cpu(name):
    embeddings, labels = seeded_batch(size=24, dim=6, per_class=2)

    def step(device, chunk_size):
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 5)).double()
        net.to(device)
        data, targets = embeddings.to(device), labels.to(device)
        if chunk_size is None:
            loss = make(name)(net(data), targets)
            loss.backward()
        else:
            loss = large_batch_backward(net, make(name), data, targets, chunk_size)
        return [loss.detach().cpu(), *(p.grad.cpu() for p in net.parameters())]

    full = step("cuda", None)
    for cuda, expected in zip(step("cuda", 5), full):
        torch.testing.assert_close(cuda, expected, rtol=1e-8, atol=1e-12)
    assert_cuda_equals_cpu({"cuda": full, "cpu": step("cpu", 5)})


def _run(argv, tmp_path):
    env = dict(os.environ, PML_RANK_CACHE=str(tmp_path / "cache"), PYTHONWARNINGS="ignore")
    return subprocess.run(_entry_point() + argv, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)


def test_a_tiny_bench_on_cuda_through_the_command(tmp_path):
    argv = "bench AUCLoss SmoothAPLoss --classes 24 --epochs 1 --iterations 3 --batch-size 16 --seeds 1"
    done = _run([*argv.split(), "--untuned", "--amp", "--device", "cuda", "--out", str(tmp_path / "out")], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads((tmp_path / "out" / "bench.json").read_text())["rows"]
    assert {row["row"] for row in rows} >= {"AUCLoss", "SmoothAPLoss"}


def test_speed_on_cuda_through_the_command_times_every_loss_and_contender(tmp_path):
    report = tmp_path / "speed-cuda"
    argv = ["speed", "--device", "cuda", "--sizes", "128", "--repeats", "1"]
    done = _run([*argv, "--out", str(tmp_path / "out"), "--report", str(report)], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    written = json.loads(report.with_suffix(".json").read_text())
    assert written["machine"]["gpu"] == torch.cuda.get_device_name(0)
    assert {result["loss"] for result in written["results"]} >= set(LOSSES)
    for result in written["results"]:
        assert result["device"] == "cuda"
        assert all(ratio > 0 for row in result["rows"] for ratio in row["ratios"].values())


def test_validation_on_cuda_measures_what_the_cpu_measures():
    from pml_rank.harness.evaluation.training import make_tester

    generator = torch.Generator().manual_seed(0)
    labels = torch.arange(30).repeat_interleave(6)
    points = torch.randn(30, 16, generator=generator)[labels] + 0.7 * torch.randn(len(labels), 16, generator=generator)
    dataset = torch.utils.data.TensorDataset(points, labels)
    accuracies = {}
    for device in DEVICES:
        tester = make_tester(device)
        tester.test({"val": dataset}, 1, torch.nn.Identity().to(device))
        accuracies[device] = tester.all_accuracies["val"]
    assert accuracies["cuda"] == pytest.approx(accuracies["cpu"], abs=1e-6)


def test_mixed_precision_training_on_cuda_steps_its_optimizers_without_waiting(monkeypatch):
    """Adam's fused step takes the GradScaler's overflow check on the device; the default
    step reads it back, once per optimizer and step, making the CPU wait for the GPU."""
    import dataclasses

    from torch.utils._python_dispatch import TorchDispatchMode

    from pml_rank.harness.budget import resolve
    from pml_rank.harness.evaluation import TrainingConfig
    from pml_rank.harness.evaluation.training import MixedPrecisionTrainer, train_model
    from pml_rank.losses import SmoothAPLoss

    class ReadBacks(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ReadBacks.count += func._schema.name == "aten::_local_scalar_dense"
            return func(*args, **(kwargs or {}))

    step_optimizers, steps = MixedPrecisionTrainer.step_optimizers, []

    def counted(trainer):
        steps.append(trainer.iteration)
        with ReadBacks():
            step_optimizers(trainer)

    monkeypatch.setattr(MixedPrecisionTrainer, "step_optimizers", counted)
    generator = torch.Generator().manual_seed(0)
    labels = torch.arange(8).repeat_interleave(8)
    dataset = torch.utils.data.TensorDataset(torch.randn(8, 6, generator=generator)[labels], labels)
    dataset.labels = labels.numpy()
    budget = dict(resolve("glyphs"), epochs=1, iterations_per_epoch=4, batch_size=16, amp=True)
    config = dataclasses.replace(TrainingConfig.from_budget(budget), device="cuda")
    train_model(SmoothAPLoss(), dataset, config, trunk=torch.nn.Linear(6, 4), seed=0)
    assert len(steps) == 4 and ReadBacks.count == 0


def test_pair_counts_on_cuda_equal_bincount():
    from pml_rank.losses.query_panels import occurrences

    indices = torch.randint(0, 50, (1000,), generator=torch.Generator().manual_seed(0))
    expected = torch.bincount(indices, minlength=60)
    assert torch.equal(occurrences(indices.cuda(), 60).cpu(), expected)
    assert torch.equal(occurrences(indices[:0].cuda(), 60).cpu(), torch.zeros(60, dtype=torch.int64))
