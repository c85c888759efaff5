"""On a CUDA device every registered loss computes what it computes on the CPU, value and
gradient. Runs where torch sees a GPU (marker ``cuda``); skipped elsewhere."""

import pytest
import torch

import pml_rank

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("name", sorted(pml_rank.registry.losses()))
def test_every_loss_on_cuda_equals_the_cpu(name):
    generator = torch.Generator().manual_seed(0)
    embeddings = torch.randn(32, 16, generator=generator, dtype=torch.float64)
    labels = torch.arange(8).repeat_interleave(4)
    results = {}
    for device in ("cpu", "cuda"):
        loss_func = pml_rank.registry.losses()[name]().to(device)
        x = embeddings.to(device).requires_grad_(True)
        loss = loss_func(x, labels.to(device))
        loss.backward()
        results[device] = (loss.detach().cpu(), x.grad.cpu())
    torch.testing.assert_close(results["cuda"][0], results["cpu"][0], rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(results["cuda"][1], results["cpu"][1], rtol=1e-6, atol=1e-8)
