"""The glyph bench's training step (small CNN, batch 32, Smooth-AP or PML's triplet loss,
Adam) timed in the ways a bench job could drive it, to choose how it should: the optimizer's
foreach step (torch's default on a GPU) against its fused step (the bench's since 17c84e8),
the trunk's forward and backward replayed as a CUDA graph (`torch.cuda.make_graphed_callables`;
the bench does not do this yet), each in float32 and under float16 autocast with a GradScaler,
and the fused and graphed ways in float32 in several processes sharing the GPU (as the
bench's workers do). Per way: ms a step (median of rounds, synchronised), the kernels and host waits of one
step (torch.profiler). Part of `bash .ci/gpu`; on a CPU it times the ways a CPU has.

    python3 .ci/gpu_glyph_steps.py [--device cuda] [--steps 200] [--rounds 3] [--processes 4]
"""

import argparse
import contextlib
import json
import multiprocessing
import statistics
import time

import torch
from pytorch_metric_learning import losses
from torch.profiler import ProfilerActivity, profile

from pml_rank.harness.data import SmallCNN
from pml_rank.losses import SmoothAPLoss

WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
LOSSES = {"SmoothAPLoss": SmoothAPLoss, "TripletMarginLoss": losses.TripletMarginLoss}


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Step:
    """One way of taking the step: `optimizer` "foreach" or "fused", `graphed` trunk,
    `amp` (float16 autocast and a GradScaler on CUDA, bfloat16 autocast on the CPU)."""

    def __init__(self, device, loss, optimizer, graphed, amp, batches=8, seed=0):
        torch.manual_seed(seed)
        self.device, self.amp = device, amp
        generator = torch.Generator().manual_seed(seed)
        self.images = torch.rand(batches, 32, 1, 32, 32, generator=generator).to(device)
        self.labels = torch.arange(8).repeat_interleave(4).to(device)
        self.trunk = SmallCNN().to(device)
        self.loss = LOSSES[loss]()
        self.optimizer = torch.optim.Adam(self.trunk.parameters(), lr=3e-3, **{optimizer: True})
        cuda = device.type == "cuda"
        self.scaler = torch.amp.GradScaler("cuda", enabled=amp and cuda)
        # A graphed callable runs under autocast only without autocast's cast cache.
        self.autocast = lambda: torch.autocast(
            device.type, dtype=torch.float16 if cuda else torch.bfloat16, enabled=amp, cache_enabled=False
        )
        if graphed:
            # The capture's warm-up steps move BatchNorm's running statistics: put them back.
            state = {k: v.clone() for k, v in self.trunk.state_dict().items()}
            with self.autocast():
                self.trunk = torch.cuda.make_graphed_callables(self.trunk, (self.images[0].clone(),))
            self.trunk.load_state_dict(state)
        self.taken = 0

    def __call__(self):
        images = self.images[self.taken % len(self.images)]
        self.taken += 1
        self.optimizer.zero_grad()
        with self.autocast():
            loss = self.loss(self.trunk(images), self.labels)
        self.scaler.scale(loss).backward()
        self.scaler.step(self.optimizer)
        self.scaler.update()

    def ms_per_step(self, steps, rounds):
        for _ in range(20):
            self()
        times = []
        for _ in range(rounds):
            synchronize(self.device)
            started = time.perf_counter()
            for _ in range(steps):
                self()
            synchronize(self.device)
            times.append(1000 * (time.perf_counter() - started) / steps)
        return times

    def kernels_and_waits(self):
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        with profile(activities=activities) as prof:
            self()
            synchronize(self.device)
        events = prof.events()
        kernels = sum(1 for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
        launch = ("cudaLaunchKernel", "cuLaunchKernel", "cudaGraphLaunch")
        launches = sum(1 for e in events if e.name.startswith(launch))
        operators = sum(1 for e in events if e.name.startswith("aten::") and e.cpu_parent is None)
        return {
            "kernels": kernels,
            "launches": launches,
            "waits": sum(1 for e in events if e.name in WAITS),
            "top-level operators": operators,
        }


def _in_process(device, way, steps, rounds, barrier, results):
    """A process of the shared-GPU run: its steps timed between two barriers; puts its
    seconds, or its error (and breaks the barrier for the others)."""
    try:
        step = Step(torch.device(device), **way)
        for _ in range(20):
            step()
        synchronize(step.device)
        barrier.wait(timeout=120)
        started = time.perf_counter()
        for _ in range(steps * rounds):
            step()
        synchronize(step.device)
        results.put(time.perf_counter() - started)
    except Exception as error:
        barrier.abort()
        results.put(f"{type(error).__name__}: {error}"[:300])


def shared(device, way, steps, rounds, processes):
    """Steps a second, all processes together, each taking `steps * rounds` steps at once."""
    context = multiprocessing.get_context("spawn")
    barrier, results = context.Barrier(processes), context.Queue()
    workers = [
        context.Process(target=_in_process, args=(device, way, steps, rounds, barrier, results))
        for _ in range(processes)
    ]
    for worker in workers:
        worker.start()
    seconds = [results.get(timeout=300) for _ in workers]
    for worker in workers:
        worker.join()
    errors = [s for s in seconds if isinstance(s, str)]
    if errors:
        raise RuntimeError(f"in a process of {processes}: {errors[0]}")
    return round(processes * steps * rounds / max(seconds), 1)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--loss", choices=sorted(LOSSES), nargs="+", default=sorted(LOSSES))
    args = parser.parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if not cuda:
        torch.set_num_threads(1)  # as a bench worker on the CPU
    rows = []
    for loss in args.loss:
        for amp in (False, True):
            for optimizer, graphed in (("foreach", False), ("fused", False), ("fused", True)):
                if graphed and not cuda:
                    continue
                way = {"loss": loss, "optimizer": optimizer, "graphed": graphed, "amp": amp}
                row = dict(way)
                try:
                    step = Step(device, **way)
                    times = step.ms_per_step(args.steps, args.rounds)
                    row["ms per step"] = round(statistics.median(times), 3)
                    row["spread"] = [round(min(times), 3), round(max(times), 3)]
                    row.update(step.kernels_and_waits())
                    del step
                    if cuda and args.processes > 1 and optimizer == "fused" and not amp:
                        row["steps/s, 1 process"] = round(1000 / row["ms per step"], 1)
                        row[f"steps/s, {args.processes} processes"] = shared(
                            args.device, way, args.steps, args.rounds, args.processes
                        )
                except Exception as error:  # a way that fails is reported, and the others still run
                    row["error"] = f"{type(error).__name__}: {error}"[:300]
                rows.append(row)
                print(json.dumps(row), flush=True)
    name = torch.cuda.get_device_name(device) if cuda else "CPU"
    print(json.dumps({"device": name, "torch": torch.__version__, "rows": rows}))


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
