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
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from ..losses.auc import AUCLoss
from ..plugins import registry
from . import outputs
from .budget import SPEED_DEFAULT_SIZES as DEFAULT_BATCH_SIZES
from .budget import SPEED_DEFAULT_SIZES_PER_LOSS
from .references.auc import auc_bh_loss
from .text_table import format_text_table

DEFAULT_DIM = 512


def labelled_batch(per_class):
    """Inputs for embedding losses: a random batch with `per_class` samples of each class."""

    def make(batch_size, dim, generator, device):
        embeddings = torch.randn(batch_size, dim, generator=generator).to(device)
        labels = torch.arange(batch_size) // per_class
        return embeddings.requires_grad_(), labels.to(device)

    return make


def scaled(inputs, scale):
    """`inputs` with the embeddings (or scores) multiplied by `scale`: large norms turn
    unnormalised inner products into exponent arguments of hundreds or thousands."""

    def make(size, dim, generator, device):
        values, labels = inputs(size, dim, generator, device)
        return (values.detach() * scale).requires_grad_(), labels

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


def rambo_reference(dotted, name):
    """Factory for the authors' way of the registered RaMBO loss `name` (the function
    ``pml_rank.<dotted>``), with that loss's own default λ and margin."""

    def make():
        loss = registry.losses()[name]()
        return function(dotted, lambda_val=loss.lambda_val, margin=loss.margin)()

    return make


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
    pml: Callable | None = None
    reference: Callable | None = None
    floor: Callable | None = similarity_floor
    inputs: Callable = labelled_batch(per_class=4)
    # The reference is skipped above this size (loop references can take minutes), and
    # PML's loss above its own (B^3 tensors would exhaust the memory).
    reference_max_size: int | None = None
    pml_max_size: int | None = None
    # What the sizes on the command line mean, for the table header, and the sizes
    # used when the command line names none (None: DEFAULT_BATCH_SIZES).
    size_name: str = "batch"
    default_sizes: tuple | None = None
    # Untimed calls of every contender before the rounds (fills a score memory).
    prime: int = 0
    # The no-slow-path case (`measure_underflow`): inputs that drive exp/sigmoid/softplus
    # arguments far outside (-87, 87), where float32 results underflow to denormals or
    # zero (or overflow) and a CPU may take a slow path, and the loss to time on them
    # (None: `ours`), e.g. a steeper AUC sigmoid.
    underflow_inputs: Callable | None = None
    underflow_loss: Callable | None = None
    underflow_scale: float = 30.0  # default underflow inputs: `inputs` times this

    def contenders(self, size):
        named = {"ours": self.ours, "pml": self.pml, "reference": self.reference, "floor": self.floor}
        if self.reference_max_size is not None and size > self.reference_max_size:
            named["reference"] = None
        if self.pml_max_size is not None and size > self.pml_max_size:
            named["pml"] = None
        return {name: factory for name, factory in named.items() if factory is not None}

    def underflow(self):
        """(loss factory, inputs factory) of the no-slow-path case."""
        return self.underflow_loss or self.ours, self.underflow_inputs or scaled(self.inputs, self.underflow_scale)


def _npairs_pml():
    """PML's NPairsLoss set up to compute NPairsMCLoss's default function: the paper's
    unnormalised inner product and the same L2 penalty from PML's own regularizer."""
    from pytorch_metric_learning import distances, losses, regularizers

    return losses.NPairsLoss(
        distance=distances.DotProductSimilarity(normalize_embeddings=False),
        embedding_regularizer=regularizers.LpRegularizer(power=2),
        embedding_reg_weight=0.002,
    )


def _steep_auc():
    """AUCLoss with a sigmoid 10 times steeper than its default: slope · (score − threshold)
    reaches thousands, far past where exp underflows."""
    return registry.losses()["AUCLoss"](slope=10 * AUCLoss().slope)


def auc_reference():
    """AUC-BH's Algorithm 1 as a loop, with AUCLoss's default step and slope."""

    defaults = AUCLoss()
    return lambda embeddings, labels: auc_bh_loss(embeddings, labels, defaults.step, defaults.slope)


# Losses with a PML equivalent and/or a reference. Any other registered loss is timed
# alone against the floor. Keep entries alphabetical.
CASES = {
    # The reference's per-row autograd takes about a minute per call at batch 2048.
    "AUCLoss": SpeedCase(
        ours=registered("AUCLoss"), reference=auc_reference, reference_max_size=1024, underflow_loss=_steep_auc
    ),
    "FastAPLoss": SpeedCase(
        ours=registered("FastAPLoss"),
        pml=pml_loss("FastAPLoss"),
        reference=function("harness.references.fastap.fast_ap_loss"),
        reference_max_size=1024,
    ),
    # The loop references take about 20 s per call at batch 2048: skipped above 1024.
    "NPairsMCLoss": SpeedCase(
        ours=registered("NPairsMCLoss"),
        pml=_npairs_pml,
        reference_max_size=1024,
        reference=function("harness.references.npairs.npairs_loss", mode="mc", l2_reg_weight=0.002),
        inputs=labelled_batch(per_class=2),
    ),
    # PML has no one-vs-one N-pair loss: its NPairsLoss (same pairs, softmax) is the nearest.
    "NPairsOVOLoss": SpeedCase(
        ours=registered("NPairsOVOLoss"),
        pml=_npairs_pml,
        reference_max_size=1024,
        reference=function("harness.references.npairs.npairs_loss", mode="ovo", l2_reg_weight=0.002),
        inputs=labelled_batch(per_class=2),
    ),
    # The AP loss on one sequence of scores (paper Table 6), 10% positives. The memory
    # is off in the recall case and in the AP loss's on a batch: the reference has none.
    "RaMBOAPLoss": SpeedCase(
        ours=function("ranking.average_precision_loss", lambda_val=0.5, margin=0.15),
        reference=function("harness.references.rambo.average_precision_loss", lambda_val=0.5, margin=0.15),
        floor=sort_floor,
        inputs=labelled_scores(positive_rate=0.1),
        size_name="scores",
        default_sizes=SPEED_DEFAULT_SIZES_PER_LOSS["RaMBOAPLoss"],
        underflow_scale=1e4,
    ),
    # The registered AP loss on a batch of embeddings, as training calls it.
    "RaMBOAPLoss-batch": SpeedCase(
        ours=registered("RaMBOAPLoss", memory_size=0),
        reference=rambo_reference("harness.references.rambo.ap_retrieval_loss", "RaMBOAPLoss"),
    ),
    # The same with its default score memory (3 batches), full before the timed rounds.
    "RaMBOAPLoss-memory3": SpeedCase(ours=registered("RaMBOAPLoss"), prime=3),
    # PML's PNPLoss builds B x B x B tensors (repeat, difference, sigmoid): capped at 512.
    # The loop reference takes seconds per call at 1024: skipped above. Underflow case: τ
    # ten times smaller (the clamp at ±50 is what keeps float32 off denormals).
    "PNPLoss": SpeedCase(
        ours=registered("PNPLoss"),
        pml=pml_loss("PNPLoss", variant="Dq", alpha=4),
        pml_max_size=512,
        reference=function("harness.references.pnp.pnp_loss"),
        reference_max_size=1024,
        underflow_loss=registered("PNPLoss", anneal=1e-3),
    ),
    "ROADMAPLoss": SpeedCase(
        ours=registered("ROADMAPLoss"),
        reference=function("harness.references.roadmap.roadmap_loss"),
        reference_max_size=1024,
        underflow_loss=registered("ROADMAPLoss", temperature=1e-3),
    ),
    "RaMBORecallLoss": SpeedCase(
        ours=registered("RaMBORecallLoss", memory_size=0),
        reference=rambo_reference("harness.references.rambo.recall_loss", "RaMBORecallLoss"),
    ),
    # The same with its default score memory (3 batches), full before the timed rounds.
    "RaMBORecallLoss-memory3": SpeedCase(ours=registered("RaMBORecallLoss"), prime=3),
    # No PML counterpart. The reference loops over the queries (about 2 s per call at
    # batch 1024): skipped above. Cosine similarities do not grow with the embeddings'
    # scale; a 10 times colder rank sigmoid (τ1 = 0.001) pushes its arguments to ±2000.
    "RecallAtKSurrogateLoss": SpeedCase(
        ours=registered("RecallAtKSurrogateLoss"),
        reference=function("harness.references.recall_at_k.recall_at_k_loss"),
        reference_max_size=1024,
        underflow_loss=registered("RecallAtKSurrogateLoss", rank_temperature=0.001),
    ),
    # PML's SmoothAPLoss peaks at 5.3 B^3 float32 values (measured): 2.7 GB at batch 512,
    # 9.7 GB at 768, 21 GB at 1024. Underflow case: τ ten times smaller (σ arguments to ±2000).
    "SmoothAPLoss": SpeedCase(
        ours=registered("SmoothAPLoss"),
        pml=pml_loss("SmoothAPLoss"),
        pml_max_size=768,
        underflow_loss=registered("SmoothAPLoss", temperature=1e-3),
    ),
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


def summary(values):
    """Median and min-max of a list of per-round ratios."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def round_ratios(times, pairs):
    """Per-round ratios ``times[a][i] / times[b][i]`` for each (key, a, b) in `pairs`:
    contenders timed in the same round share that moment's machine load, so their ratio
    is steadier than a ratio of separately taken medians."""
    return {key: [x / y for x, y in zip(times[a], times[b]) if y > 0] for key, a, b in pairs}


def amp_dtype(device):
    """The half precision of mixed-precision training on `device`: float16 on CUDA (its
    tensor cores, with a GradScaler), bfloat16 elsewhere (the CPU's autocast type)."""
    return torch.float16 if torch.device(device).type == "cuda" else torch.bfloat16


def under_autocast(fn, dtype):
    """`fn` called under `torch.autocast` in `dtype` on its first input's device, as a
    mixed-precision training step calls a loss; `fn` itself when `dtype` is None."""
    if dtype is None:
        return fn

    def call(*inputs):
        with torch.autocast(inputs[0].device.type, dtype=dtype):
            return fn(*inputs)

    return call


def _prepare(factory, device, prime, inputs, amp=False):
    fn = factory()
    if isinstance(fn, torch.nn.Module):
        fn.to(device)
    fn = under_autocast(fn, amp_dtype(device) if amp else None)
    for _ in range(prime):
        _run(fn, inputs)
    return fn


def _interleaved(contenders, rounds, warmup, device, bar):
    """{label: [seconds per timed round]} for {label: (fn, inputs)}, every round timing
    each contender once, in turn, so that a noisy moment hurts them all alike."""
    times = {label: [] for label in contenders}
    for round_ in range(warmup + rounds):
        for label, (fn, inputs) in contenders.items():
            elapsed = _timed(fn, inputs, device)
            if round_ >= warmup:
                times[label].append(elapsed)
            bar.update()
    return times


def _aggregate(times_per_run, pairs):
    """Pools the rounds of every run: per ratio key, the median of all per-round ratios,
    their min-max, each run's own median and the raw ratios."""
    pooled = {key: [] for key, _, _ in pairs}
    run_medians = {key: [] for key, _, _ in pairs}
    for times in times_per_run:
        for key, values in round_ratios(times, pairs).items():
            pooled[key] += values
            if values:
                run_medians[key].append(statistics.median(values))
    pooled = {key: values for key, values in pooled.items() if values}
    return ({key: summary(values) for key, values in pooled.items()}, {key: run_medians[key] for key in pooled}, pooled)


def _machine():
    import platform

    model = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {
        "platform": platform.platform(),
        "cpu": model,
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "load_average": load,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "cuda": torch.version.cuda,
    }


def measure(
    name,
    sizes=DEFAULT_BATCH_SIZES,
    dim=DEFAULT_DIM,
    repeats=5,
    warmup=1,
    device="cpu",
    seed=0,
    progress=True,
    runs=1,
    amp=False,
):
    """Time and measure every contender of loss `name` at each size (`amp`: every one under
    `torch.autocast` in `amp_dtype`, the floor included).

    `runs` repeats the whole measurement (fresh losses, warm-up, `repeats` interleaved
    rounds). Returns a JSON-ready dict with one row per size: median seconds and peak
    bytes per contender; ``ratios``, ours over each other contender, time as the
    median of the per-round ratios of all runs' rounds (memory: one measurement);
    ``spread``, those ratios' min and max; ``run_medians``, each run's own median;
    ``round_ratios``, the ratios themselves.
    """
    device = torch.device(device)
    case = case_for(name)
    rows = []
    steps = sum(len(case.contenders(s)) * (runs * (warmup + repeats) + 1) for s in sizes)
    bar = tqdm(total=steps, desc=f"speed {name}", disable=not progress, leave=False)
    for size in sizes:
        generator = torch.Generator().manual_seed(seed)
        inputs = case.inputs(size, dim, generator, device)
        factories = case.contenders(size)
        pairs = [(f"time_vs_{label}", "ours", label) for label in factories if label != "ours"]
        times_per_run = []
        for _ in range(runs):
            fns = {
                label: (_prepare(factory, device, case.prime, inputs, amp), inputs)
                for label, factory in factories.items()
            }
            times_per_run.append(_interleaved(fns, repeats, warmup, device, bar))
        memory = {}
        for label, factory in factories.items():
            memory[label] = peak_memory(_prepare(factory, device, case.prime, inputs, amp), inputs, device)
            bar.update()
        seconds = {label: statistics.median(t for times in times_per_run for t in times[label]) for label in factories}
        stats, run_medians, raw = _aggregate(times_per_run, pairs)
        ratios = {key: value["median"] for key, value in stats.items()}
        ratios.update(
            {
                f"memory_vs_{label}": memory["ours"] / memory[label]
                for label in memory
                if label != "ours" and memory[label] > 0
            }
        )
        rows.append(
            {
                "size": size,
                "seconds": seconds,
                "peak_bytes": memory,
                "ratios": ratios,
                "spread": {key: [value["min"], value["max"]] for key, value in stats.items()},
                "run_medians": run_medians,
                "round_ratios": raw,
            }
        )
    bar.close()
    return {
        "loss": name,
        "size_name": case.size_name,
        "dim": dim,
        "repeats": repeats,
        "runs": runs,
        "device": str(device),
        "autocast": str(amp_dtype(device)).removeprefix("torch.") if amp else None,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "rows": rows,
    }


def measure_underflow(
    name, size=2048, dim=DEFAULT_DIM, repeats=5, warmup=1, device="cpu", seed=0, progress=True, runs=1, amp=False
):
    """The no-slow-path case: loss `name` on its usual inputs against the same loss on
    inputs that push exponent arguments far out of float range (`SpeedCase.underflow`),
    interleaved (`amp`: both under `torch.autocast`, as `measure`). ``ratio`` is the median
    of the per-round ratios underflow / normal."""
    device = torch.device(device)
    case = case_for(name)
    underflow_loss, underflow_inputs = case.underflow()
    inputs = {
        "normal": case.inputs(size, dim, torch.Generator().manual_seed(seed), device),
        "underflow": underflow_inputs(size, dim, torch.Generator().manual_seed(seed), device),
    }
    factories = {"normal": case.ours, "underflow": underflow_loss}
    bar = tqdm(total=2 * runs * (warmup + repeats), desc=f"underflow {name}", disable=not progress, leave=False)
    times_per_run = []
    for _ in range(runs):
        fns = {
            label: (_prepare(factories[label], device, case.prime, inputs[label], amp), inputs[label])
            for label in factories
        }
        times_per_run.append(_interleaved(fns, repeats, warmup, device, bar))
    bar.close()
    stats, run_medians, raw = _aggregate(times_per_run, [("underflow_vs_normal", "underflow", "normal")])
    stat = stats["underflow_vs_normal"]
    return {
        "loss": name,
        "size_name": case.size_name,
        "size": size,
        "dim": dim,
        "repeats": repeats,
        "runs": runs,
        "autocast": str(amp_dtype(device)).removeprefix("torch.") if amp else None,
        "seconds": {label: statistics.median(t for times in times_per_run for t in times[label]) for label in fns},
        "ratio": stat["median"],
        "spread": [stat["min"], stat["max"]],
        "run_medians": run_medians["underflow_vs_normal"],
        "round_ratios": raw["underflow_vs_normal"],
        "largest_abs_input": float(inputs["underflow"][0].detach().abs().max()),
    }


def _ratio_cell(row, key):
    if key not in row["ratios"]:
        return "-"
    if key in row.get("spread", {}):
        low, high = row["spread"][key]
        return f"{row['ratios'][key]:.3f} ({low:.2f}-{high:.2f})"
    return f"{row['ratios'][key]:.3f}"


def format_table(result):
    labels = list(result["rows"][0]["seconds"]) if result["rows"] else []
    rounds = result["repeats"] * result.get("runs", 1)
    lines = [
        f"{result['loss']}: forward+backward, dim {result['dim']}, {result.get('runs', 1)} run(s) of "
        f"{result['repeats']} rounds, {result['device']}, {result['threads']} threads"
        + (f", autocast {result['autocast']}" if result.get("autocast") else "")
    ]
    header = [result["size_name"]] + [f"{label} s" for label in labels] + [f"{label} MB" for label in labels]
    ratio_keys = sorted({k for row in result["rows"] for k in row["ratios"]})
    header += [k.replace("_vs_", "/") for k in ratio_keys]
    table = [header]
    for row in result["rows"]:
        cells = [str(row["size"])]
        cells += [f"{row['seconds'].get(label, float('nan')):.4f}" for label in labels]
        cells += [f"{row['peak_bytes'].get(label, float('nan')) / 2**20:.1f}" for label in labels]
        cells += [_ratio_cell(row, k) for k in ratio_keys]
        table.append(cells)
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    for r in table:
        lines.append("  ".join(cell.rjust(w) for cell, w in zip(r, widths)))
    lines.append(
        f"ratios are ours / other: time = median of the {rounds} per-round ratios (min-max), "
        "memory = peak above inputs; below 1 means ours is faster or leaner"
    )
    return "\n".join(lines)


def format_underflow(results):
    rows = [
        (
            r["loss"],
            r["size"],
            f"{r['seconds']['normal']:.4f}",
            f"{r['seconds']['underflow']:.4f}",
            f"{r['ratio']:.3f}",
            f"{r['spread'][0]:.2f}-{r['spread'][1]:.2f}",
        )
        for r in results
    ]
    return format_text_table(("loss", "size", "normal s", "underflow s", "underflow/normal", "min-max"), rows)


def _device_lines(report):
    """Where the measured work ran and in which precision, for the report's header."""
    results = report["results"] or report["underflow"] or [{}]
    device, autocast = results[0].get("device", "cpu"), results[0].get("autocast")
    machine = report["machine"]
    where = f"GPU {machine.get('gpu')} (CUDA {machine.get('cuda')}, times synchronised)" if "cuda" in device else "CPU"
    return [f"Device: {device}, {where}; precision: {f'autocast {autocast}' if autocast else 'float32'}.", ""]


def report_markdown(report):
    """The readable side of a speed report: time ratios with their spread, memory
    ratios, the no-slow-path case."""
    machine = report["machine"]
    lines = [
        f"# pml-rank speed report, {report['date']}",
        "",
        f"Command: `{report['command']}`",
        "",
        f"Machine: {machine['cpu']}, {machine['cpu_count']} CPU(s), {machine['platform']}; "
        f"Python {machine['python']}, torch {machine['torch']}, {machine['threads']} thread(s); "
        f"load average at start {report['load_average_start']}, at end {report['load_average_end']}.",
        "",
        *_device_lines(report),
        "Time ratios are ours / other, forward+backward: the median of the per-round ratios "
        "(contenders interleaved within each round) over all rounds of all runs, with their "
        "min-max and each run's median. Memory: peak bytes above the inputs, one measurement. "
        "floor = the cosine-similarity matrix product (forward+backward) alone.",
        "",
        "| loss | size | ratio | median | min-max | run medians |",
        "| --- | ---: | --- | ---: | --- | --- |",
    ]
    for result in report["results"]:
        for row in result["rows"]:
            for key in sorted(row["ratios"], key=lambda k: (not k.startswith("time"), k)):
                if key in row["spread"]:
                    low, high = row["spread"][key]
                    runs = ", ".join(f"{v:.3f}" for v in row["run_medians"][key])
                    lines.append(
                        f"| {result['loss']} | {row['size']} | {key.replace('_vs_', ' / ')} | "
                        f"{row['ratios'][key]:.3f} | {low:.3f}-{high:.3f} | {runs} |"
                    )
                else:
                    lines.append(
                        f"| {result['loss']} | {row['size']} | {key.replace('_vs_', ' / ')} | "
                        f"{row['ratios'][key]:.3f} | | |"
                    )
    if report.get("underflow"):
        lines += [
            "",
            "No slow path: each loss on inputs that push exp/sigmoid arguments far out of float "
            "range (embeddings ×30, AUC slope ×10, AP scores ×1e4) against its usual inputs.",
            "",
            "| loss | size | underflow / normal | min-max | largest input |",
            "| --- | ---: | ---: | --- | ---: |",
        ]
        for r in report["underflow"]:
            low, high = r["spread"]
            lines.append(
                f"| {r['loss']} | {r['size']} | {r['ratio']:.3f} | {low:.3f}-{high:.3f} "
                f"| {r['largest_abs_input']:.3g} |"
            )
    return "\n".join(lines) + "\n"


def write_report(results, underflow, path, command, started, load_average_start=None):
    """`path`.json (everything, raw per-round ratios included) and `path`.md (tables).
    `started` is the measurement's start (a datetime), `load_average_start` the load then."""
    import datetime

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    machine = _machine()
    report = {
        "date": started.isoformat(timespec="seconds"),
        "finished": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command,
        "machine": machine,
        "load_average_start": load_average_start,
        "load_average_end": machine.pop("load_average"),
        "results": results,
        "underflow": underflow,
    }
    json_path, md_path = path.with_suffix(".json"), path.with_suffix(".md")
    json_path.write_text(json.dumps(report, indent=2))
    md_path.write_text(report_markdown(report))
    return json_path, md_path


def write_json(result, path):
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return outputs.write_text(path, json.dumps(result, indent=2))


def run_command(names, args, out):
    """`pml-rank speed`: measures `names` as the parsed `args` say, prints each table and
    writes speed-<loss>.json into `out` (and the --report files); returns the exit status."""
    import datetime
    import shlex

    started = datetime.datetime.now(datetime.timezone.utc)
    load_start = os.getloadavg() if hasattr(os, "getloadavg") else None
    results, underflow = [], []
    # What every measurement of this command shares.
    common = dict(dim=args.dim, repeats=args.repeats, device=args.device, seed=args.seed, runs=args.runs, amp=args.amp)
    for name in names:
        sizes = args.sizes or case_for(name).default_sizes or DEFAULT_BATCH_SIZES
        result = measure(name, sizes=sizes, **common)
        results.append(result)
        print(format_table(result))
        path = write_json(result, out / f"speed-{name}.json")
        print(f"written: {path}\n")
    if args.underflow:
        for name in names:
            size = max(args.sizes or case_for(name).default_sizes or DEFAULT_BATCH_SIZES)
            underflow.append(measure_underflow(name, size=size, **common))
        print(
            "No slow path: each loss on underflow-provoking inputs / on its usual inputs "
            f"(median of per-round ratios, min-max)\n{format_underflow(underflow)}\n"
        )
    if args.report:
        command = "pml-rank " + " ".join(shlex.quote(a) for a in args.argv)
        for path in write_report(results, underflow, args.report, command, started, load_start):
            print(f"written: {path}")
    return 0
