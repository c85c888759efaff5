"""The bench's training throughput as a ratio to the raw step.

The raw step is what a bench job cannot go below: the trunk (and embedding layer) forward,
PML's TripletMarginLoss, backward and the budget's optimizer steps (the trunk's and the
embedding layer's, as the trainer takes them) on a batch already on the device, the trunk's
BatchNorm layers frozen where the budget freezes them, nothing else. The bench's rate is one
fold model of `pml-rank bench` (PML's MetricLossOnly trainer with its hooks, the record-keeper,
the sampler and data loader with the device's default loader processes, validation after every
epoch and the best epoch's models kept) in iterations per second. With loader processes, the
timed fold models share one set that reads their training (each one's sampler passes as one
stream) and one that serves their validations, as the fold models of a bench job do; the
warm-up's fold model starts them, as a job's first fold model does (`--fresh-loaders`: each
fold model starts its own). Both run in this one process, alternately, so that other load on
the machine hits them alike; on a GPU, times are synchronised.

    python examples/bench_throughput.py [--epochs 10 --iterations 60] [--repeats 5]
    python examples/bench_throughput.py --dataset folder:DIR --trunk resnet50 --image-size 224 --device cuda
    python examples/bench_throughput.py ... --profile 40   (then where one more fold model's time goes)
    python examples/bench_throughput.py ... --phases       (one more fold model's time by phase)
    python examples/bench_throughput.py ... --trace 8 [--trace-dir DIR]  (raw steps and a fold model profiled)

The glyphs' small CNN runs on one thread (as a bench worker does); an ImageNet trunk from
random weights (no weights file needed), on `--threads` threads on the CPU.
"""

import argparse
import collections
import contextlib
import cProfile
import dataclasses
import itertools
import json
import pathlib
import pstats
import re
import statistics
import time
from unittest import mock

import torch
from pytorch_metric_learning import losses
from pytorch_metric_learning.utils import common_functions as c_f

from pml_rank.harness import runner
from pml_rank.harness.arguments import DEVICE_HELP, device, non_negative_int, positive_int
from pml_rank.harness.budget import TRUNKS, dataset_argument, resolve
from pml_rank.harness.evaluation import TrainingConfig, test_set_and_folds, training
from pml_rank.harness.evaluation.loaders import embedding_loaders, training_loaders
from pml_rank.harness.evaluation.training import EMBEDDING_BATCH, default_sampler, train_model, training_batches
from pml_rank.harness.workers import default_loader_workers


def synchronize(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def raw_step_seconds(train_set, budget, config, make_trunk, make_embedder, steps=20, warmup=5, trace=None):
    """Seconds per raw step: `steps` steps on batches drawn by the bench's sampler, already
    on the device; with `trace` (a scheduled `torch.profiler.profile`), those steps under it
    instead (returns None)."""
    torch.manual_seed(0)
    batch_size, device = budget["batch_size"], config.device
    # One pass of the sampler holds about len(train_set) samples: draw passes until every
    # step has a full batch (a short slice would time empty batches).
    sampler = default_sampler(train_set.labels, batch_size)
    passes = itertools.chain.from_iterable(iter(sampler) for _ in itertools.count())
    indices = list(itertools.islice(passes, batch_size * min(steps + warmup, 8)))
    images = torch.stack([train_set[i][0] for i in indices]).to(device)
    labels = torch.tensor([int(train_set.labels[i]) for i in indices], device=device)
    trunk = make_trunk().to(device).train()
    embedder = (make_embedder() if make_embedder else torch.nn.Identity()).to(device).train()
    if config.freeze_batchnorm:  # as the trainer's models train (PML's freeze_trunk_batchnorm)
        trunk.apply(c_f.set_layers_to_eval("BatchNorm"))
    loss = losses.TripletMarginLoss()
    optimizers = list(training._optimized(config, trunk, embedder, loss, None, None)[1].values())
    batches = len(indices) // batch_size

    def step(b):
        for optimizer in optimizers:
            optimizer.zero_grad()
        batch = slice((b % batches) * batch_size, (b % batches + 1) * batch_size)
        loss(embedder(trunk(images[batch])), labels[batch]).backward()
        for optimizer in optimizers:
            optimizer.step()

    for b in range(warmup):
        step(b)
    if trace is not None:
        with trace:
            for b in range(steps):
                step(b)
                trace.step()
        return None
    synchronize(device)
    started = time.perf_counter()
    for b in range(steps):
        step(b)
    synchronize(device)
    return (time.perf_counter() - started) / steps


def loader_batch_seconds(train_set, budget, batches=5):
    """Seconds one process takes to prepare a training batch of the bench's sampler (read,
    decode, augment, collate: 8-bit images, which the trunk normalises; images keyed by their
    seeds, as the trainer's loader reads them): with the raw step's time, how many loader
    processes keep a device fed."""
    batch_size = budget["batch_size"]
    keyed = training_batches(train_set, default_sampler(train_set.labels, batch_size), batch_size, draws_seed=0)
    seconds = []
    for batch in itertools.islice(keyed, batches + 1):  # the first warms the caches
        started = time.perf_counter()
        torch.utils.data.default_collate([train_set[key] for key in batch])
        seconds.append(time.perf_counter() - started)
    return seconds[1:]


def bench_iteration_seconds(train_set, val_set, config, make_trunk, make_embedder, loaders=(None, None)):
    """Seconds per iteration of one fold model; `loaders`: the `EmbeddingLoaders` and
    `TrainingLoaders` it reads from (None: its own)."""
    # The networks are built before the clock starts, as for the raw step: building ResNet-50
    # (its initialisation on the CPU) is no part of training it.
    trunk, embedder = make_trunk(), make_embedder() if make_embedder else None
    synchronize(config.device)
    started = time.perf_counter()
    train_model(
        losses.TripletMarginLoss(),
        train_set,
        config,
        trunk=trunk,
        embedder=embedder,
        val_set=val_set,
        loaders=loaders[0],
        training_loaders=loaders[1],
    )
    synchronize(config.device)
    return (time.perf_counter() - started) / (config.epochs * config.iterations_per_epoch)


PHASES = ("batch", "step", "epoch end", "other")


def phase_seconds(run, device):
    """Seconds of ``run()`` (one fold model) by phase, the device synchronised at each phase's
    end: "batch" (the trainer's `get_batch`: waiting for the loader and the copy to the device),
    "step" (the rest of its `forward_and_backward`: forward, loss, backward, optimizer step),
    "epoch end" (validation, records, the best models kept) and "other" (the rest: the hooks
    after each iteration, the learning-rate schedulers, setup), and the number of iterations.
    Synchronising takes away the overlap of the host's work with the device's, so on a GPU the
    phases add up to more than an unsynchronised run."""
    seconds, iterations = collections.Counter(), [0]

    def timed(phase, method):
        def wrapper(*args, **kwargs):
            started = time.perf_counter()
            result = method(*args, **kwargs)
            synchronize(device)
            seconds[phase] += time.perf_counter() - started
            return result

        return wrapper

    get_batch = training.MetricLossOnly.get_batch
    forward_and_backward = training.MetricLossOnly.forward_and_backward
    end_of_epoch = training._EpochRecorder.end_of_epoch

    def iteration(self):
        iterations[0] += 1
        before = seconds["batch"]
        started = time.perf_counter()
        forward_and_backward(self)
        synchronize(device)
        seconds["step"] += time.perf_counter() - started - (seconds["batch"] - before)

    with (
        mock.patch.object(training.MetricLossOnly, "get_batch", timed("batch", get_batch)),
        mock.patch.object(training.MetricLossOnly, "forward_and_backward", iteration),
        mock.patch.object(training._EpochRecorder, "end_of_epoch", timed("epoch end", end_of_epoch)),
    ):
        synchronize(device)
        started = time.perf_counter()
        run()
        seconds["other"] = time.perf_counter() - started - sum(seconds.values())
    return seconds, iterations[0]


def profiler(device, iterations, skip=0):
    """A torch.profiler stepped once an iteration, recording `iterations` of them after `skip`
    (and one warm-up iteration), with Python's functions (`with_stack`) to see what the host
    does where the device idles."""
    from torch.profiler import ProfilerActivity, profile, schedule

    cuda = torch.device(device).type == "cuda"
    return profile(
        activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []),
        schedule=schedule(wait=skip, warmup=1, active=iterations, repeat=1),
        with_stack=True,
    )


def traced_fold_model(run, trace):
    """``run()`` (one fold model) with `trace` stepped after each of its iterations."""
    forward_and_backward = training.MetricLossOnly.forward_and_backward

    def iteration(self):
        forward_and_backward(self)
        trace.step()

    with trace, mock.patch.object(training.MetricLossOnly, "forward_and_backward", iteration):
        run()


def trace_summary(trace, top=12):
    """From a finished `profiler`: its recorded iterations' median ms, the device's busy ms an
    iteration (the union of its kernels' intervals), the host's waits for the device an
    iteration, and the `top` operators of most own host time (ms an iteration)."""
    events = trace.events()
    cuda = torch.autograd.DeviceType.CUDA
    steps = [e for e in events if e.name.startswith("ProfilerStep") and e.device_type != cuda]
    if not steps:
        return {}
    start, end, host = min(e.time_range.start for e in steps), max(e.time_range.end for e in steps), steps[0].thread
    within = [e for e in events if start <= e.time_range.start < end and not e.name.startswith("ProfilerStep")]
    kernels = sorted((e.time_range.start, e.time_range.end) for e in within if e.device_type == cuda)
    busy, reach = 0, start
    for begin, finish in kernels:
        busy += max(0, finish - max(begin, reach))
        reach = max(reach, finish)
    waits = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
    own = collections.Counter()
    for e in within:
        if e.device_type != cuda and e.thread == host:
            own[re.sub(r" at 0x[0-9a-f]+>$", ">", e.name)] += e.self_cpu_time_total
    n = len(steps)
    return {
        "iterations": n,
        "ms": round(statistics.median(e.time_range.elapsed_us() for e in steps) / 1e3, 2),
        "device busy ms": round(busy / n / 1e3, 2),
        "waits": round(sum(1 for e in within if e.name in waits) / n, 1),
        "host ms": {name: round(us / n / 1e3, 2) for name, us in own.most_common(top)},
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--dataset", type=dataset_argument, default="glyphs", help="glyphs or folder:PATH (default %(default)s)"
    )
    parser.add_argument("--trunk", choices=TRUNKS, help="trunk network (default: the data set's preset's)")
    parser.add_argument(
        "--image-size", type=positive_int, help="crop size of an image data set (default: its preset's)"
    )
    parser.add_argument("--device", type=device, default="cpu", help=f"{DEVICE_HELP} (default %(default)s)")
    parser.add_argument("--epochs", type=positive_int, help="epochs of the fold model (default: the glyph bench's, 10)")
    parser.add_argument("--iterations", type=positive_int, help="iterations per epoch (default: the glyph bench's, 60)")
    parser.add_argument("--loader-workers", type=non_negative_int, help="default: the bench's default on --device")
    parser.add_argument("--threads", type=positive_int, default=2, help="CPU threads of an ImageNet trunk (default 2)")
    parser.add_argument("--repeats", type=positive_int, default=5, help="rounds (default %(default)s)")
    parser.add_argument(
        "--fresh-loaders",
        action="store_true",
        help="each fold model starts its own loader processes (default: they share one set, as in a bench job)",
    )
    parser.add_argument(
        "--profile",
        type=positive_int,
        metavar="N",
        help="after the rounds, profile one more fold model (cProfile) and print its N functions of most "
        "cumulative time: where a fold model's time beyond the raw steps goes (on a GPU, a function that "
        "waits for the device holds the time of what it waits for)",
    )
    parser.add_argument(
        "--phases",
        action="store_true",
        help="after the rounds, time one more fold model by phase (batch, step, epoch end, other), the device "
        "synchronised at each phase's end: which part of a fold model is slower than the raw steps",
    )
    parser.add_argument(
        "--trace",
        type=positive_int,
        metavar="N",
        help="after the rounds, N raw steps and N iterations of one more fold model (after its first 10, where it "
        "has that many) under torch.profiler: ms an iteration, the device's busy ms, the host's waits and busiest "
        "operators",
    )
    parser.add_argument("--trace-dir", help="with --trace, where to write the two Chrome traces (.json.gz)")
    args = parser.parse_args(argv)
    if args.trace_dir is not None:
        if not args.trace:
            parser.error("--trace-dir: given without --trace")
        try:  # before any work: a folder that cannot be made fails now, not after the rounds
            pathlib.Path(args.trace_dir).mkdir(parents=True, exist_ok=True)
        except OSError as error:
            parser.error(f"--trace-dir: cannot make {args.trace_dir!r}: {error.strerror}")
    glyphs = resolve("glyphs")
    given = {"trunk": args.trunk, "image_size": args.image_size}
    if args.trunk not in (None, "small-cnn"):
        given["random_init"] = True
    budget = resolve(args.dataset, **given)
    budget.update(
        epochs=args.epochs or glyphs["epochs"], iterations_per_epoch=args.iterations or glyphs["iterations_per_epoch"]
    )
    small = budget["trunk"] == "small-cnn"
    torch.set_num_threads(1 if small else args.threads)
    data = runner.dataset_of(budget, runner.Machine())
    loader_workers = args.loader_workers
    if loader_workers is None:
        loader_workers = default_loader_workers(args.device, budget["dataset"] == "glyphs", processes=1)
    config = dataclasses.replace(TrainingConfig.from_budget(budget), device=args.device, loader_workers=loader_workers)
    folds, _ = test_set_and_folds(data, budget["num_folds"], runner.transforms_of(budget, data))
    train_set, val_set = folds[0]
    make_trunk, make_embedder = runner.model_factories(budget, data.channels)
    raw, bench = [], []
    with contextlib.ExitStack() as stack:
        shared = (None, None)
        if not args.fresh_loaders:
            cuda = torch.device(args.device).type == "cuda"
            shared = (
                stack.enter_context(embedding_loaders([val_set], EMBEDDING_BATCH, loader_workers, args.device)),
                stack.enter_context(training_loaders([train_set], loader_workers, cuda)),
            )
        # Imports, first-call costs, (CUDA) kernel selection and the shared loaders' start, once.
        warm_up = dataclasses.replace(config, epochs=1, iterations_per_epoch=2)
        bench_iteration_seconds(train_set, val_set, warm_up, make_trunk, make_embedder, shared)
        for _ in range(args.repeats):
            raw.append(raw_step_seconds(train_set, budget, config, make_trunk, make_embedder))
            bench.append(bench_iteration_seconds(train_set, val_set, config, make_trunk, make_embedder, shared))
        if args.profile:
            profile = cProfile.Profile()
            profile.runcall(bench_iteration_seconds, train_set, val_set, config, make_trunk, make_embedder, shared)
        if args.phases:
            # Built before, as the timed fold models' networks are: building ResNet-50 took 0.3 s on the
            # H200 machine, which "other" held when it was built inside.
            built = (make_trunk(), make_embedder() if make_embedder else None)
            phases, iterations = phase_seconds(
                lambda: bench_iteration_seconds(
                    train_set, val_set, config, lambda: built[0], None if built[1] is None else lambda: built[1], shared
                ),
                config.device,
            )
        if args.trace:
            with profiler(config.device, 1):  # the H200's first profiling in a process timed no kernels
                torch.ones(1, device=config.device).add_(1)
            raw_trace = profiler(config.device, args.trace)
            raw_step_seconds(train_set, budget, config, make_trunk, make_embedder, args.trace + 1, trace=raw_trace)
            # Past the first iterations (the loader's first batches), where the training has that many.
            skip = max(0, min(10, config.epochs * config.iterations_per_epoch - args.trace - 1))
            fold_trace = profiler(config.device, args.trace, skip=skip)
            traced_fold_model(
                lambda: bench_iteration_seconds(train_set, val_set, config, make_trunk, make_embedder, shared),
                fold_trace,
            )
    ratios = [r / b for r, b in zip(raw, bench)]  # per round: both halves met the same load
    with torch.random.fork_rng(devices=[]):
        loader = loader_batch_seconds(train_set, budget)

    def spread(values, scale=1.0):
        return f"{scale * statistics.median(values):.2f} ({scale * min(values):.2f}-{scale * max(values):.2f})"

    where = (
        torch.cuda.get_device_name(0)
        if torch.device(args.device).type == "cuda"
        else f"{torch.get_num_threads()} CPU thread(s)"
    )
    print(
        f"{budget['trunk']}, {budget['dataset']}, image size {budget.get('image_size')}, batch {budget['batch_size']}, "
        f"{budget['optimizer']}, {where}, loader workers {loader_workers}; {args.repeats} rounds, median (min-max):"
    )
    print(f"raw step: {spread(raw, 1000)} ms")
    print(
        f"bench, one fold model, {config.epochs} epochs x {config.iterations_per_epoch} iterations with validation: "
        f"{spread(bench, 1000)} ms per iteration"
    )
    print(f"throughput ratio bench / raw step: {spread(ratios)}")
    print(
        f"a training batch prepared by one loader process: {spread(loader, 1000)} ms, "
        f"{statistics.median(loader) / statistics.median(raw):.2g} raw steps"
    )
    if args.phases:
        per_iteration = ", ".join(f"{name} {1000 * phases[name] / iterations:.2f}" for name in PHASES)
        print(
            f"one more fold model by phase, synchronised at each phase's end, ms per iteration ({iterations}): "
            f"{per_iteration}; raw step {1000 * statistics.median(raw):.2f}"
        )
    if args.trace:
        for name, trace in (("raw steps", raw_trace), ("fold model", fold_trace)):
            print(f"{name} under torch.profiler: {json.dumps(trace_summary(trace))}")
            if args.trace_dir:
                trace.export_chrome_trace(str(pathlib.Path(args.trace_dir) / f"{name.replace(' ', '-')}.json.gz"))
    if args.profile:
        print(f"one more fold model under cProfile, its {args.profile} functions of most cumulative time:")
        pstats.Stats(profile).sort_stats("cumulative").print_stats(args.profile)


if __name__ == "__main__":
    main()
