"""Where pml-rank's Triton kernels (`losses.fused_ranks`, `losses.fused_calibration`,
`fused_counts`) run: float32 tensors on a CUDA GPU that Triton compiles for, or on the CPU
under Triton's interpreter (TRITON_INTERPRET=1), which is how the CPU's tests hold each
kernel equal to its plain-torch path. A leaf module: it imports nothing from pml-rank."""

import contextlib
import functools
import os

import torch

try:
    import triton
except ImportError:  # pragma: no cover - torch's CUDA wheels bring Triton
    triton = None

# The oldest CUDA GPUs Triton compiles for (as torch.compile's Triton backend requires).
MIN_CAPABILITY = (7, 0)
# Whether Triton runs its interpreter on the CPU: read when Triton defines the kernels,
# as Triton itself does.
_INTERPRETED = triton is not None and os.environ.get("TRITON_INTERPRET") == "1"


def interpreted():
    """Whether Triton runs its interpreter on the CPU (TRITON_INTERPRET=1 when this module was
    imported): then the kernels take CPU tensors."""
    return _INTERPRETED


def runs_on(tensor, dtypes=(torch.float32,)):
    """Whether Triton kernels run on this tensor: float32 (or one of `dtypes`, for a kernel
    that reads them) on a CUDA device Triton compiles for, or on the CPU under Triton's
    interpreter."""
    if triton is None or tensor.dtype not in dtypes:
        return False
    if tensor.device.type == "cuda":
        return _compiles_for(tensor.device.index)
    return _INTERPRETED and tensor.device.type == "cpu"


@functools.cache
def _compiles_for(index):
    """Whether Triton compiles for CUDA device `index`: asked once per device, as a loss call
    asks several times and torch's query costs microseconds of the host's time that a call
    at batch 2048 on a GPU is made of (`.ci/gpu_profile.py`)."""
    return torch.cuda.get_device_capability(index) >= MIN_CAPABILITY


_ALREADY_CURRENT = contextlib.nullcontext()


def on_device(device):
    """The context that makes `device` current for a launch: Triton launches on the current
    CUDA device, which need not be the tensors' (cuda:1 while cuda:0 is current). Nothing to
    enter where it is current already (about 8 µs of the host's time a launch otherwise)."""
    if device.type != "cuda" or device.index in (None, torch.cuda.current_device()):
        return _ALREADY_CURRENT
    return torch.cuda.device(device)
