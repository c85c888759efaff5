"""What hard negative class mining costs inside a PML training run.

Trains a small CNN with NPairsMCLoss in PML's `trainers.MetricLossOnly`, batches from
`HardNegativeClassSampler`, on synthetic 32×32 images shaped like CUB-200's training split (100 classes of 60
images, 60 pairs per batch as in the paper's CUB runs; seeded, CPU), and reports the
share of each epoch's wall time spent building batches (embedding candidates included),
for the default refresh (each class re-embedded at most once per epoch) and for
re-embedding every candidate for every batch (the slides' letter, ``refresh_every=1``).

    python examples/npairs_mining_cost.py [--epochs 3] [--threads T] [--out pml-rank-results]

On a machine shared by many processes, torch's default intra-op threads make tiny
operations (the mining's) erratically slow; ``--threads 1`` measures without that.
"""

import argparse
import json
import logging
import time

import torch
from pytorch_metric_learning import trainers

from pml_rank.harness import outputs
from pml_rank.losses import NPairsMCLoss
from pml_rank.samplers import HardNegativeClassSampler


def synthetic_images(num_classes, per_class, seed):
    generator = torch.Generator().manual_seed(seed)
    prototypes = torch.randn(num_classes, 3, 32, 32, generator=generator)
    labels = torch.arange(num_classes).repeat_interleave(per_class)
    images = prototypes[labels] + torch.randn(len(labels), 3, 32, 32, generator=generator)
    return torch.utils.data.TensorDataset(images, labels)


def small_cnn(dim):
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, padding=1),
        torch.nn.BatchNorm2d(16),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(16, 32, 3, padding=1),
        torch.nn.BatchNorm2d(32),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Flatten(),
        torch.nn.Linear(32 * 8 * 8, dim),
    )


def run(refresh_every, args):
    torch.manual_seed(args.seed)
    dataset = synthetic_images(args.classes, args.per_class, args.seed)
    trunk = small_cnn(args.dim)
    sampler = HardNegativeClassSampler(dataset.tensors[1], args.n, refresh_every=refresh_every, seed=args.seed)
    epochs = []
    state = {"start": None, "mining": 0.0}

    def end_of_epoch(trainer):
        now = time.perf_counter()
        epochs.append(
            {
                "epoch": trainer.epoch,
                "seconds": now - state["start"],
                "mining_seconds": sampler.mining_seconds - state["mining"],
            }
        )
        epochs[-1]["mining_share"] = epochs[-1]["mining_seconds"] / epochs[-1]["seconds"]
        state["start"], state["mining"] = now, sampler.mining_seconds
        return True

    trainer = trainers.MetricLossOnly(
        models={"trunk": trunk},
        optimizers={"trunk_optimizer": torch.optim.Adam(trunk.parameters(), 1e-3)},
        batch_size=2 * args.n,
        loss_funcs={"metric_loss": NPairsMCLoss()},
        dataset=dataset,
        sampler=sampler,
        dataloader_num_workers=0,
        data_device=torch.device("cpu"),
        end_of_epoch_hook=end_of_epoch,
    )
    sampler.attach_trainer(trainer)
    state["start"] = time.perf_counter()
    trainer.train(num_epochs=args.epochs)
    total_share = sum(e["mining_seconds"] for e in epochs) / sum(e["seconds"] for e in epochs)
    return {
        "refresh_every": refresh_every or sampler.batches_per_epoch,
        "epochs": epochs,
        "mining_share": total_share,
        "embedded_examples": sampler.embedded_examples,
        "mined_batches": sampler.mined_batches,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--classes", type=int, default=100)
    parser.add_argument("--per-class", type=int, default=60)
    parser.add_argument("--n", type=int, default=60, help="classes per batch (batch size 2n)")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--out", default="pml-rank-results")
    args = parser.parse_args()
    out = outputs.prepare_output_dir(args.out)  # before any work
    logging.getLogger("PML").setLevel(logging.WARNING)
    if args.threads:
        torch.set_num_threads(args.threads)
    args.threads = torch.get_num_threads()
    results = {"setup": vars(args), "runs": [run(refresh, args) for refresh in (None, 1)]}
    for result in results["runs"]:
        shares = ", ".join(f"{e['mining_share']:.1%}" for e in result["epochs"])
        print(
            f"refresh_every={result['refresh_every']}: mining share {result['mining_share']:.1%} "
            f"(per epoch {shares}) "
            f"({result['embedded_examples']} examples embedded in {result['mined_batches']} batches)"
        )
    outputs.write_text(out / "npairs-mining-cost.json", json.dumps(results, indent=2))
    plot(results, out / "npairs-mining-cost.png")


def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3))
    for result in results["runs"]:
        epochs = [e["epoch"] for e in result["epochs"]]
        ax.plot(
            epochs,
            [100 * e["mining_share"] for e in result["epochs"]],
            marker="o",
            label=f"refresh_every={result['refresh_every']}",
        )
    ax.axhline(5, color="gray", linestyle="--", label="5% budget")
    ax.set_xlabel("epoch")
    ax.set_ylabel("mining time, % of epoch")
    ax.legend()
    fig.tight_layout()
    outputs.save_figure(fig, path)


if __name__ == "__main__":
    main()
