"""Mixed precision: under `torch.autocast`, with half-precision embeddings from a `Linear`
layer (what AMP training hands a loss), every registered loss runs, returns a float32
loss, and computes what it computes in float32 on the same embeddings: value within the
similarity product's own rounding, gradient finite and in the same direction. bfloat16
on the CPU here; float16 and bfloat16 on CUDA under the ``cuda`` marker."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import pml_rank
from pml_rank.losses import CrossBatchMemory

LOSSES = sorted(pml_rank.registry.losses())
# Relative tolerance of the value: the similarity product's own rounding in each dtype.
VALUE_RTOL = {torch.float16: 1e-3, torch.bfloat16: 5e-3}
BATCH, DIM, PER_CLASS = 1024, 64, 4


def clustered_half_embeddings(device, dtype, batch=BATCH):
    """Half-precision embeddings of `batch` samples, `PER_CLASS` per class, from a `Linear`
    layer under autocast: class centres plus noise, so that every loss has something to
    learn (on pure noise AUC-BH's hardest pairs saturate it: loss 1, gradient about 1e-12
    in float32 too)."""
    generator = torch.Generator().manual_seed(0)
    labels = torch.arange(batch // PER_CLASS).repeat_interleave(PER_CLASS)
    inputs = torch.randn(batch // PER_CLASS, DIM, generator=generator)[labels] * 1.0
    inputs += torch.randn(batch, DIM, generator=generator)
    layer = torch.nn.Linear(DIM, DIM)
    torch.nn.init.orthogonal_(layer.weight, generator=generator)
    torch.nn.init.zeros_(layer.bias)
    with torch.autocast(device, dtype=dtype):
        embeddings = layer.to(device)(inputs.to(device))
    assert embeddings.dtype == dtype
    return embeddings.detach(), labels.to(device)


def loss_and_gradient(make_loss, embeddings, labels, autocast_dtype=None):
    x = embeddings.clone().requires_grad_()
    with torch.autocast(embeddings.device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
        loss = make_loss()(x, labels)
    loss.backward()
    return loss.detach(), x.grad


def assert_autocast_matches_float32(make_loss, device, dtype):
    embeddings, labels = clustered_half_embeddings(device, dtype)
    loss, grad = loss_and_gradient(make_loss, embeddings, labels, autocast_dtype=dtype)
    expected_loss, expected_grad = loss_and_gradient(make_loss, embeddings.float(), labels)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, expected_loss, rtol=VALUE_RTOL[dtype], atol=0)
    assert grad.dtype == dtype
    assert_same_direction(grad, expected_grad)


def assert_same_direction(grad, expected_grad):
    assert bool(torch.isfinite(grad).all()) and expected_grad.norm() > 0
    cosine = torch.nn.functional.cosine_similarity(grad.double().flatten(), expected_grad.double().flatten(), dim=0)
    assert cosine >= 0.99, f"gradient direction: cosine {cosine.item():.4f} with the float32 computation's"


def make(name):
    return pml_rank.registry.losses()[name]


@pytest.mark.parametrize("name", LOSSES)
def test_every_loss_under_cpu_bfloat16_autocast_computes_in_float32(name):
    assert_autocast_matches_float32(make(name), "cpu", torch.bfloat16)


@pytest.mark.parametrize("name", ["SmoothAPLoss", "RaMBORecallLoss"])
def test_losses_inside_cross_batch_memory_under_autocast(name):
    embeddings, labels = clustered_half_embeddings("cpu", torch.bfloat16, batch=256)
    kwargs = {"memory_size": 0} if name.startswith("RaMBO") else {}
    make_memory = lambda: CrossBatchMemory(make(name)(**kwargs), embedding_size=DIM, memory_size=512)
    loss, grad = loss_and_gradient(make_memory, embeddings, labels, autocast_dtype=torch.bfloat16)
    expected_loss, expected_grad = loss_and_gradient(make_memory, embeddings.float(), labels)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, expected_loss, rtol=VALUE_RTOL[torch.bfloat16], atol=0)
    assert_same_direction(grad, expected_grad)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("name", LOSSES)
def test_every_loss_under_cuda_autocast_computes_in_float32(name, dtype):
    assert_autocast_matches_float32(make(name), "cuda", dtype)


class HalfPrecisionOperations(TorchDispatchMode):
    """The aten operations inside the context that produce a bfloat16 tensor, by name."""

    def __init__(self):
        super().__init__()
        self.names = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if any(torch.is_tensor(o) and o.dtype == torch.bfloat16 for o in (out if isinstance(out, tuple) else (out,))):
            self.names.add(str(func))
        return out


@pytest.mark.parametrize(
    "name", ["AUCLoss", "NPairsMCLoss", "PNPLoss", "ROADMAPLoss", "RecallAtKSurrogateLoss", "SmoothAPLoss"]
)
def test_only_the_similarity_product_runs_in_half_precision(name):
    """Under autocast the similarity matrix's product runs in bfloat16 (forward, and its
    backward where autograd computes it) and nothing else does: counts, ranks, sums and
    the loss stay float32."""
    embeddings, labels = clustered_half_embeddings("cpu", torch.bfloat16, batch=64)
    embeddings.requires_grad_()
    with HalfPrecisionOperations() as half:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = make(name)()(embeddings, labels)
        loss.backward()
    assert "aten.mm.default" in half.names
    # The rest: the product's operands cast to bfloat16, transposed and detached, and the input
    # checks' reductions of the bfloat16 embeddings themselves (their extremes, stacked to be read at once).
    allowed = {"aten.mm.default", "aten._to_copy.default", "aten.t.default", "aten.detach.default"}
    allowed |= {"aten.aminmax.default", "aten.stack.default", "aten.abs.default"}
    assert half.names <= allowed, half.names - allowed
