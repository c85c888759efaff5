"""Every registered loss under PML's DistributedLossWrapper with two gloo processes on
the CPU gives what one process gives on the concatenated batch.

PML's wrapper gathers the other ranks' embeddings (without gradient), computes the loss
on the whole batch and multiplies it by the world size, so that DDP's gradient average
yields the single-process gradient. Hence, on every rank, loss == world_size * L(batch)
and d loss / d own embeddings == world_size * dL/d(own rows). Losses with a memory are
run for several steps, which also checks that their memories stay consistent.
"""

import socket
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from pytorch_metric_learning.utils.distributed import DistributedLossWrapper

import pml_rank

pytestmark = pytest.mark.slow  # DDP processes

WORLD_SIZE = 2
PER_RANK = 12
STEPS = 3


def _losses():
    return sorted(pml_rank.registry.losses())


def _batch(step, name):
    """The whole batch of one step. Classes are spread over both ranks, so positives
    and negatives cross the rank boundary, except for the N-pair losses: they take
    each class's first two samples as (anchor, positive), and PML's wrapper puts a
    rank's own rows first, so a pair split over two ranks would swap roles on one of
    them. N-pair batches therefore keep each class on one rank, as the
    HardNegativeClassSampler's batches of whole pairs do."""
    generator = torch.Generator().manual_seed(1000 + step)
    size = WORLD_SIZE * PER_RANK
    embeddings = torch.randn(size, 8, generator=generator, dtype=torch.float64)
    if name.startswith("NPairs"):
        labels = torch.arange(size) // 2
    else:
        labels = (torch.arange(size) // 4)[torch.randperm(size, generator=generator)]
    return embeddings, labels


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, port, names, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE)
    try:
        results = {}
        for name in names:
            wrapped = DistributedLossWrapper(pml_rank.registry.losses()[name]())
            steps = []
            for step in range(STEPS):
                embeddings, labels = _batch(step, name)
                own = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
                mine = embeddings[own].clone().requires_grad_()
                loss = wrapped(mine, labels[own])
                loss.backward()
                steps.append((loss.detach(), mine.grad))
            results[name] = steps
        torch.save(results, f"{out_dir}/rank{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def distributed_results(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("distributed")
    mp.spawn(_worker, args=(_free_port(), _losses(), str(out_dir)), nprocs=WORLD_SIZE)
    return [torch.load(out_dir / f"rank{r}.pt") for r in range(WORLD_SIZE)]


@pytest.mark.parametrize("name", _losses())
def test_two_gloo_processes_equal_one_process_on_the_whole_batch(name, distributed_results):
    single = pml_rank.registry.losses()[name]()
    for step in range(STEPS):
        embeddings, labels = _batch(step, name)
        embeddings.requires_grad_()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the wrapper is not involved here
            loss = single(embeddings, labels)
        (grad,) = torch.autograd.grad(loss, embeddings) if loss.requires_grad else (torch.zeros_like(embeddings),)
        for rank, results in enumerate(distributed_results):
            rank_loss, rank_grad = results[name][step]
            own = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
            torch.testing.assert_close(
                rank_loss, WORLD_SIZE * loss.detach(), msg=f"{name}, step {step}, rank {rank}: loss"
            )
            torch.testing.assert_close(
                rank_grad, WORLD_SIZE * grad[own], msg=f"{name}, step {step}, rank {rank}: gradient"
            )


def test_torchrun_example_trains_with_two_processes():
    import math
    import re
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parents[1] / "examples" / "distributed_training.py"
    loss = "AUCLoss" if "AUCLoss" in _losses() else "BinomialDevianceLoss"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            str(script),
            "--loss",
            loss,
            "--epochs",
            "3",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    losses = [float(v) for v in re.findall(rf"mean {loss} (\S+)", result.stdout)]
    # torch's gloo threads can abort a rank during interpreter shutdown, after its work and
    # destroy_process_group ("terminate called without an active exception", pytorch/pytorch
    # PR 179291): a crash in torch's teardown; rank 0 printed all three epochs before it.
    torch_teardown_abort = "terminate called without an active exception" in result.stderr and len(losses) == 3
    assert result.returncode == 0 or torch_teardown_abort, result.stdout[-2000:] + result.stderr[-6000:]
    assert len(losses) == 3 and all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0]
