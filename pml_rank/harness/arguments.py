"""Command-line argument types shared by `pml-rank` and the example scripts, and the measured
defaults of the processes per GPU that `--help` quotes (defined here, where importing is cheap).

Each is an ``argparse`` ``type=`` callable that turns a bad value into an
``argparse.ArgumentTypeError``, so argparse reports it in one line naming the option
and exits with status 2 before any work. Importing this module imports no torch;
`device` imports it only to check a device other than the CPU.
"""

import argparse
import math

# How many processes share one GPU, by trunk, measured on one H200 (`bash .ci/gpu`'s sweep,
# examples/results/gpu-check-sweep.md: 11 glyph jobs of 2 epochs): the small CNN's steps are
# launch-bound, yet the GPU time-slices between the processes' CUDA contexts, so each job
# slows as processes are added (1.44 x its time with 2 processes, 2.14 x with 4): 1.4 and
# 1.9 times the jobs per second of one process, no gain beyond 4. An ImageNet trunk's step
# fills the GPU alone.
PROCESSES_PER_GPU = {"small-cnn": 4}
# Image-decoding processes per worker on a GPU: a ResNet-50 step at 224 px (21.8 ms on an H200)
# needs a batch of 32 images decoded, resized, cropped and normalised in that time, which took
# one process 75-125 ms on a 2-core Xeon (`examples/bench_throughput.py` prints it): 4 processes
# could not keep up (the fold model ran at 0.47 of the raw step's rate); 8 can, with room to
# spare (on the H200 machine: 83-108 ms a batch in one process; a fold model at 0.62 with 8 processes,
# 0.57 with 4, 0.56 with 12, one machine, examples/results/gpu-check.md).
LOADER_WORKERS_PER_GPU_PROCESS = 8


class ArgumentParser(argparse.ArgumentParser):
    """`argparse.ArgumentParser` whose errors are one line: ``prog: error: message (see
    prog --help)``, exit status 2, instead of the usage block followed by the message."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _integer(text):
    try:
        return int(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"invalid integer {text!r}") from None


def at_least(minimum):
    """Type: an integer not below `minimum` (``at_least(1)`` for every count)."""

    def convert(text):
        value = _integer(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {value}")
        return value

    convert.__name__ = f"integer >= {minimum}"
    return convert


positive_int = at_least(1)
positive_int.__name__ = "positive integer"
non_negative_int = at_least(0)
non_negative_int.__name__ = "non-negative integer"


def class_count(text):
    """Type: a number of classes, an integer >= 2, or "all"."""
    if text == "all":
        return text
    try:
        value = int(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"must be an integer >= 2 or 'all', got {text!r}") from None
    if value < 2:
        raise argparse.ArgumentTypeError(f"must be an integer >= 2 or 'all', got {value}")
    return value


def positive_float(text):
    """Type: a finite number above zero (learning rates)."""
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"invalid number {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def non_negative_float(text):
    """Type: a finite number >= 0 (weight decay, momentum)."""
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"invalid number {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def epoch_and_factor(text):
    """Type: ``EPOCH:FACTOR``, an epoch >= 1 and a finite factor > 0 (a learning rate
    drop), as ``(epoch, factor)``."""
    epoch, colon, factor = str(text).partition(":")
    if not colon:
        raise argparse.ArgumentTypeError(f"must be EPOCH:FACTOR, e.g. 35:0.3, got {text!r}")
    return positive_int(epoch), positive_float(factor)


def boolean(text):
    """Type: yes/no (also true/false, 1/0)."""
    value = str(text).strip().lower()
    if value in ("yes", "true", "1"):
        return True
    if value in ("no", "false", "0"):
        return False
    raise argparse.ArgumentTypeError(f"must be yes or no, got {text!r}")


DEVICE_HELP = "cpu, cuda, cuda:N (when torch sees a CUDA device) or mps (when torch sees one)"


def device(text):
    """Type: a torch device this machine has, returned as the string given. ``cpu`` is
    accepted without importing torch; anything else is checked with torch."""
    name = str(text).strip()
    if name == "cpu":
        return name
    import torch

    try:
        parsed = torch.device(name)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"unknown device {text!r}; expected {DEVICE_HELP}") from None
    if parsed.type == "cpu":
        return name
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError(
                f"{text!r}: torch {torch.__version__} sees no CUDA device on this machine; use cpu"
            )
        count = torch.cuda.device_count()
        if parsed.index is not None and parsed.index >= count:
            raise argparse.ArgumentTypeError(
                f"{text!r}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}"
            )
        return name
    if parsed.type == "mps":
        mps = getattr(torch.backends, "mps", None)
        if mps is None or not mps.is_available():
            raise argparse.ArgumentTypeError(f"{text!r}: torch sees no MPS device on this machine; use cpu")
        return name
    raise argparse.ArgumentTypeError(f"unsupported device {text!r}; expected {DEVICE_HELP}")


def device_list(text):
    """Type: comma-separated devices (``cuda:0,cuda:1``), each checked by `device`."""
    names = [name.strip() for name in str(text).split(",") if name.strip()]
    if not names:
        raise argparse.ArgumentTypeError("expected one device or more, e.g. cuda:0,cuda:1")
    return [device(name) for name in names]


def default_device():
    """``"cuda"`` when torch sees a CUDA device, else ``"cpu"`` (imports torch)."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"
