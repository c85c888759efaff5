"""`pml-rank speed`: forward+backward time and peak memory of a loss, side by side with
PML's nearest equivalent and a straightforward reference written from the paper, as
ratios measured in one run.

This machine-independent comparison is the point: absolute times on a shared machine are
noise, ratios taken in the same process with the contenders interleaved are not.
Every registered loss can be timed; the losses listed in `CASES` also get their PML
equivalent and their reference.
"""

import contextlib
import dataclasses
import functools
import importlib
import json
import os
import statistics
import time
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from tqdm import tqdm

from ..losses.auc import AUCLoss
from ..plugins import registry
from . import outputs
from .references.auc import auc_bh_loss

DEFAULT_BATCH_SIZES = (512, 1024, 2048)
DEFAULT_DIM = 512


def labelled_batch(per_class):
    """Inputs for embedding losses: a random batch with `per_class` samples of each class."""

    def make(batch_size, dim, generator, device):
        embeddings = torch.randn(batch_size, dim, generator=generator).to(device)
        labels = torch.arange(batch_size) // per_class
        return embeddings.requires_grad_(), labels.to(device)

    return make


def similarity_floor():
    """The cosine-similarity matrix product alone: no embedding loss can be cheaper."""

    def floor(embeddings, labels):
        normalized = F.normalize(embeddings, dim=1)
        return (normalized @ normalized.T).sum()

    return floor


def registered(name, **kwargs):
    """Factory for a loss looked up in the registry, called as ``loss(embeddings, labels)``."""

    def make():

        return registry.losses()[name](**kwargs)

    return make


def labelled_scores(positive_rate):
    """Inputs for sequence losses: one sequence of `size` scores, a fraction
    `positive_rate` of them relevant (`dim` is ignored)."""

    def make(size, dim, generator, device):
        scores = torch.randn(size, generator=generator).to(device)
        targets = torch.rand(size, generator=generator) < positive_rate
        return scores.requires_grad_(), targets.to(device)

    return make


def sort_floor():
    """One sort forward and its scatter backward: no ranking loss can be cheaper."""

    def floor(scores, targets):
        return torch.sort(scores, descending=True).values.sum()

    return floor


def pml_loss(name, **kwargs):
    """Factory for PML's own loss `name`, called as ``loss(embeddings, labels)``."""

    def make():
        from pytorch_metric_learning import losses

        return getattr(losses, name)(**kwargs)

    return make


def function(dotted, **kwargs):
    """Factory for the function ``pml_rank.<dotted>`` with `kwargs` bound, called as
    ``fn(*inputs)``: ``function("harness.references.fastap.fast_ap_loss")``."""

    def make():
        module, name = f"pml_rank.{dotted}".rsplit(".", 1)
        return functools.partial(getattr(importlib.import_module(module), name), **kwargs)

    return make


@dataclasses.dataclass
class SpeedCase:
    """How to time one loss. Each contender is a zero-argument factory returning a
    callable that maps the inputs to a scalar loss."""

    ours: Callable
    pml: Optional[Callable] = None
    reference: Optional[Callable] = None
    floor: Optional[Callable] = similarity_floor
    inputs: Callable = labelled_batch(per_class=4)
    # The reference is skipped above this size (loop references can take minutes).
    reference_max_size: Optional[int] = None
    # What the sizes on the command line mean, for the table header, and the sizes
    # used when the command line names none (None: DEFAULT_BATCH_SIZES).
    size_name: str = "batch"
    default_sizes: Optional[tuple] = None

    def contenders(self, size):
        named = {"ours": self.ours, "pml": self.pml, "reference": self.reference, "floor": self.floor}
        if self.reference_max_size is not None and size > self.reference_max_size:
            named["reference"] = None
        return {name: factory for name, factory in named.items() if factory is not None}


def _npairs_pml():
    """PML's NPairsLoss set up to compute NPairsMCLoss's default function: the paper's
    unnormalised inner product and the same L2 penalty from PML's own regularizer."""
    from pytorch_metric_learning import distances, losses, regularizers

    return losses.NPairsLoss(distance=distances.DotProductSimilarity(normalize_embeddings=False),
                             embedding_regularizer=regularizers.LpRegularizer(power=2),
                             embedding_reg_weight=0.002)
def auc_reference():
    """AUC-BH's Algorithm 1 as a loop, with AUCLoss's default step and slope."""

    defaults = AUCLoss()
    return lambda embeddings, labels: auc_bh_loss(embeddings, labels, defaults.step, defaults.slope)


# Losses with a PML equivalent and/or a reference. Any other registered loss is timed
# alone against the floor. Keep entries alphabetical.
CASES = {
    # The reference's per-row autograd takes about a minute per call at batch 2048.
    "AUCLoss": SpeedCase(ours=registered("AUCLoss"), reference=auc_reference, reference_max_size=1024),
    "FastAPLoss": SpeedCase(
        ours=registered("FastAPLoss"), pml=pml_loss("FastAPLoss"),
        reference=function("harness.references.fastap.fast_ap_loss"), reference_max_size=1024),
    "NPairsMCLoss": SpeedCase(ours=registered("NPairsMCLoss"), pml=_npairs_pml,
                              reference=function("harness.references.npairs.npairs_loss", mode="mc", l2_reg_weight=0.002),
                              inputs=labelled_batch(per_class=2)),
    # PML has no one-vs-one N-pair loss: its NPairsLoss (same pairs, softmax) is the nearest.
    "NPairsOVOLoss": SpeedCase(ours=registered("NPairsOVOLoss"), pml=_npairs_pml,
                               reference=function("harness.references.npairs.npairs_loss", mode="ovo", l2_reg_weight=0.002),
                               inputs=labelled_batch(per_class=2)),
    # The AP loss on one sequence of scores (paper Table 6), 10% positives. The memory
    # is off in the recall case: the reference has none.
    "RaMBOAPLoss": SpeedCase(
        ours=function("ranking.average_precision_loss", lambda_val=0.5, margin=0.15),
        reference=function("harness.references.rambo.average_precision_loss", lambda_val=0.5, margin=0.15),
        floor=sort_floor, inputs=labelled_scores(positive_rate=0.1),
        size_name="scores", default_sizes=(100_000, 1_000_000)),
    "RaMBORecallLoss": SpeedCase(
        ours=registered("RaMBORecallLoss", memory_size=0),
        reference=function("harness.references.rambo.recall_loss", lambda_val=0.2, margin=0.02)),
}


def case_for(name):
    return CASES.get(name) or SpeedCase(ours=registered(name))


def _run(fn, inputs):
    for tensor in inputs:
        if tensor.requires_grad:
            tensor.grad = None
    loss = fn(*inputs)
    loss.backward()


def _timed(fn, inputs, device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    _run(fn, inputs)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


@contextlib.contextmanager
def _quiet_stderr():
    """The profiler's C++ side prints start/stop chatter on fd 2; keep the table clean."""
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def peak_memory(fn, inputs, device):
    """Peak bytes allocated by one forward+backward, above what the inputs already hold."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        _run(fn, inputs)
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    from torch.profiler import ProfilerActivity, profile

    with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        _run(fn, inputs)
    # The raw allocation records, not the per-op totals: an op's self memory is net of
    # what it frees, so a temporary allocated and freed inside one Python-level op (a
    # custom autograd.Function) would vanish from the peak.
    records = sorted(
        (e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
        key=lambda e: e.start_ns(),
    )
    current = peak = 0
    for record in records:
        current += record.nbytes()
        peak = max(peak, current)
    return peak


def measure(name, sizes=DEFAULT_BATCH_SIZES, dim=DEFAULT_DIM, repeats=5, warmup=1,
            device="cpu", seed=0, progress=True):
    """Time and measure every contender of loss `name` at each size.

    Returns a JSON-ready dict with one row per size: median seconds and peak bytes per
    contender, and the ratios of ours to each other contender.
    """
    device = torch.device(device)
    case = case_for(name)
    rows = []
    steps = sum(len(case.contenders(s)) * (warmup + repeats + 1) for s in sizes)
    bar = tqdm(total=steps, desc=f"speed {name}", disable=not progress, leave=False)
    for size in sizes:
        generator = torch.Generator().manual_seed(seed)
        inputs = case.inputs(size, dim, generator, device)
        fns = {label: factory() for label, factory in case.contenders(size).items()}
        for fn in fns.values():
            if isinstance(fn, torch.nn.Module):
                fn.to(device)
        times = {label: [] for label in fns}
        for round_ in range(warmup + repeats):
            # Interleave the contenders so that a noisy moment hurts them all alike.
            for label, fn in fns.items():
                elapsed = _timed(fn, inputs, device)
                if round_ >= warmup:
                    times[label].append(elapsed)
                bar.update()
        memory = {}
        for label, fn in fns.items():
            memory[label] = peak_memory(fn, inputs, device)
            bar.update()
        seconds = {label: statistics.median(t) for label, t in times.items()}
        ratios = {
            f"time_vs_{label}": seconds["ours"] / seconds[label]
            for label in seconds if label != "ours" and seconds[label] > 0
        }
        ratios.update({
            f"memory_vs_{label}": memory["ours"] / memory[label]
            for label in memory if label != "ours" and memory[label] > 0
        })
        rows.append({"size": size, "seconds": seconds, "peak_bytes": memory, "ratios": ratios})
    bar.close()
    return {
        "loss": name,
        "size_name": case.size_name,
        "dim": dim,
        "repeats": repeats,
        "device": str(device),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "rows": rows,
    }


def format_table(result):
    labels = list(result["rows"][0]["seconds"]) if result["rows"] else []
    lines = [f"{result['loss']}: forward+backward, dim {result['dim']}, median of "
             f"{result['repeats']}, {result['device']}, {result['threads']} threads"]
    header = [result["size_name"]] + [f"{label} s" for label in labels] + [f"{label} MB" for label in labels]
    ratio_keys = sorted({k for row in result["rows"] for k in row["ratios"]})
    header += [k.replace("_vs_", "/") for k in ratio_keys]
    table = [header]
    for row in result["rows"]:
        cells = [str(row["size"])]
        cells += [f"{row['seconds'].get(label, float('nan')):.4f}" for label in labels]
        cells += [f"{row['peak_bytes'].get(label, float('nan')) / 2**20:.1f}" for label in labels]
        cells += [f"{row['ratios'][k]:.3f}" if k in row["ratios"] else "-" for k in ratio_keys]
        table.append(cells)
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    for r in table:
        lines.append("  ".join(cell.rjust(w) for cell, w in zip(r, widths)))
    lines.append("ratios are ours / other (time = median seconds, memory = peak above inputs); "
                 "below 1 means ours is faster or leaner")
    return "\n".join(lines)


def write_json(result, path):
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return outputs.write_text(path, json.dumps(result, indent=2))
