"""Multi-process training with torch.distributed and any registered loss.

    torchrun --standalone --nproc_per_node=2 examples/distributed_training.py --loss AUCLoss

gloo on CPUs, NCCL on GPUs (one process per GPU). Each process embeds its own shard of
the batch; PML's DistributedLossWrapper (and DistributedMinerWrapper for a miner) gathers
the embeddings of all ranks, so the loss sees the whole batch, and DDP averages the
gradients: the update equals one process training on the concatenated batch. The data
here are synthetic Gaussian clusters so that the script runs anywhere in seconds.
"""

import argparse
import os

import torch
import torch.distributed as dist
from pytorch_metric_learning.utils.distributed import (
    DistributedLossWrapper,
    DistributedMinerWrapper,
)

import pml_rank
from pml_rank.harness.recipes import PAPER_RECIPES


def clustered_data(num_classes, per_class, dim, seed=0):
    generator = torch.Generator().manual_seed(seed)
    centres = torch.randn(num_classes, dim, generator=generator) * 2
    labels = torch.arange(num_classes).repeat_interleave(per_class)
    return centres[labels] + torch.randn(len(labels), dim, generator=generator), labels


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loss", default="AUCLoss", help="a name in pml_rank.registry.losses()")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch, split over ranks")
    args = parser.parse_args(argv)

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if backend == "nccl" else "cpu")
    torch.manual_seed(0)  # identical initial weights on every rank

    data, labels = clustered_data(num_classes=16, per_class=16, dim=16)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16)).to(device)
    model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    loss_func = DistributedLossWrapper(pml_rank.registry.losses()[args.loss]())
    # The paper's miner, as pml-rank bench uses it, wrapped for distribution as well.
    make_miner = PAPER_RECIPES.get(args.loss, {}).get("make_miner")
    miner = DistributedMinerWrapper(make_miner()) if make_miner else None

    dataset = torch.utils.data.TensorDataset(data, labels)
    sampler = torch.utils.data.distributed.DistributedSampler(dataset, seed=0, drop_last=True)
    loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size // world, sampler=sampler, drop_last=True)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        total = 0.0
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            embeddings = model(x)
            indices_tuple = miner(embeddings, y) if miner else None
            loss = loss_func(embeddings, y, indices_tuple)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total += loss.item() / world  # the wrapper multiplies by the world size
        if rank == 0:
            print(f"epoch {epoch}: mean {args.loss} {total / len(loader):.4f}", flush=True)
    dist.barrier()  # no rank tears the group down while another still talks to it
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
