"""The bench's training throughput as a ratio to the raw step.

The raw step is what the bench cannot go below: SmallCNN forward, PML's TripletMarginLoss,
backward and an Adam step on a batch already in memory, nothing else. The bench's rate is
one fold model of `pml-rank bench` (PML's MetricLossOnly trainer with its hooks, the
record-keeper, the sampler and data loader, and validation after every epoch) at the
default budget, in iterations per second. Both run in this one process on one thread,
alternately, so that other load on the machine hits them alike.

    python examples/bench_throughput.py [--epochs 10 --iterations 60] [--repeats 5]
"""

import argparse
import itertools
import statistics
import time

import torch
from pytorch_metric_learning import losses

from pml_rank.harness.budget import resolve
from pml_rank.harness.data import SmallCNN, load_glyphs
from pml_rank.harness.evaluation import TrainingConfig, test_set_and_folds
from pml_rank.harness.evaluation.training import default_sampler, train_model

DEFAULTS = resolve("glyphs")  # the glyph bench's budget


def raw_step_seconds(train_set, batch_size, steps=50, channels_last=True):
    torch.manual_seed(0)
    # One pass of the sampler holds about len(train_set) samples: draw passes until every
    # step has a full batch (a short slice would time empty batches).
    sampler = default_sampler(train_set.labels, batch_size)
    passes = itertools.chain.from_iterable(iter(sampler) for _ in itertools.count())
    indices = list(itertools.islice(passes, batch_size * (steps + 10)))
    images = torch.stack([train_set[i][0] for i in indices])
    labels = torch.tensor([int(train_set.labels[i]) for i in indices])
    net = SmallCNN(embedding_size=DEFAULTS["embedding_size"])
    if not channels_last:  # the layout before this change, for comparison
        net = net.to(memory_format=torch.contiguous_format)
        images = images.contiguous()
        features, embedding = net.features, net.embedding
        net.forward = lambda x: embedding(features(x).mean(dim=(2, 3)))
    loss, optimizer = losses.TripletMarginLoss(), torch.optim.Adam(net.parameters(), lr=DEFAULTS["lr"])

    def step(b):
        optimizer.zero_grad()
        batch = slice(b * batch_size, (b + 1) * batch_size)
        loss(net(images[batch]), labels[batch]).backward()
        optimizer.step()

    for b in range(10):
        step(b)
    started = time.perf_counter()
    for b in range(10, 10 + steps):
        step(b)
    return (time.perf_counter() - started) / steps


def bench_iteration_seconds(train_set, val_set, epochs, iterations):
    started = time.perf_counter()
    config = TrainingConfig.from_budget(dict(DEFAULTS, epochs=epochs, iterations_per_epoch=iterations))
    train_model(
        losses.TripletMarginLoss(),
        train_set,
        config,
        trunk=SmallCNN(embedding_size=DEFAULTS["embedding_size"]),
        val_set=val_set,
    )
    return (time.perf_counter() - started) / (epochs * iterations)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=DEFAULTS["epochs"])
    parser.add_argument("--iterations", type=int, default=DEFAULTS["iterations_per_epoch"])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    folds, _ = test_set_and_folds(load_glyphs(num_classes=DEFAULTS["num_classes"]), DEFAULTS["num_folds"])
    train_set, val_set = folds[0]
    bench_iteration_seconds(train_set, val_set, 1, 2)  # imports and first-call costs, once per process
    raw, raw_nchw, bench = [], [], []
    for _ in range(args.repeats):
        raw.append(raw_step_seconds(train_set, DEFAULTS["batch_size"]))
        raw_nchw.append(raw_step_seconds(train_set, DEFAULTS["batch_size"], channels_last=False))
        bench.append(bench_iteration_seconds(train_set, val_set, args.epochs, args.iterations))
    ratios = [r / b for r, b in zip(raw, bench)]  # per round: both halves met the same load

    def spread(values, scale=1.0):
        return f"{scale * statistics.median(values):.2f} ({scale * min(values):.2f}-{scale * max(values):.2f})"

    print(f"{args.repeats} rounds, median (min-max):")
    print(f"raw step (SmallCNN channels-last + triplet + Adam, batch {DEFAULTS['batch_size']}): {spread(raw, 1000)} ms")
    print(f"raw step, contiguous (NCHW) layout: {spread(raw_nchw, 1000)} ms")
    print(
        f"bench, one fold model, {args.epochs} epochs x {args.iterations} iterations with validation: "
        f"{spread(bench, 1000)} ms per iteration"
    )
    print(f"throughput ratio bench / raw step: {spread(ratios)}")


if __name__ == "__main__":
    main()
