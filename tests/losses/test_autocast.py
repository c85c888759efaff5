"""Mixed precision: under `torch.autocast`, with half-precision embeddings from a `Linear`
layer (what AMP training hands a loss), every registered loss runs, returns a float32
loss, and computes what it computes in float32 on the same embeddings: value within the
similarity product's own rounding, gradient finite and in the same direction. bfloat16
on the CPU here; float16 and bfloat16 on CUDA under the ``cuda`` marker."""

import pytest
import torch

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
    assert grad.dtype == dtype and bool(torch.isfinite(grad).all())
    assert expected_grad.norm() > 0
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
    torch.testing.assert_close(loss, expected_loss, rtol=5e-3, atol=0)
    torch.testing.assert_close(grad.float(), expected_grad, rtol=2e-2, atol=1e-5)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("name", LOSSES)
def test_every_loss_under_cuda_autocast_computes_in_float32(name, dtype):
    assert_autocast_matches_float32(make(name), "cuda", dtype)
