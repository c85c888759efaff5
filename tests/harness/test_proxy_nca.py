"""`LogSpaceProxyNCALoss`: PML's ProxyNCA function, with finite gradients where PML's are NaN."""

import pytest
import torch
import torch.nn.functional as F
from pytorch_metric_learning.losses import ProxyNCALoss

from pml_rank.harness.baselines.proxy_nca import LogSpaceProxyNCALoss

NUM_CLASSES, EMBEDDING_SIZE = 8, 16


def pair(softmax_scale, seed=0, dtype=torch.float32):
    """PML's loss and ours with the same proxies, and a batch of 8 classes x 4."""
    torch.manual_seed(seed)
    theirs = ProxyNCALoss(NUM_CLASSES, EMBEDDING_SIZE, softmax_scale=softmax_scale)
    ours = LogSpaceProxyNCALoss(NUM_CLASSES, EMBEDDING_SIZE, softmax_scale=softmax_scale)
    ours.proxies.data = theirs.proxies.data.clone()
    embeddings = torch.randn(
        NUM_CLASSES * 4, EMBEDDING_SIZE, dtype=dtype, generator=torch.Generator().manual_seed(seed)
    )
    labels = torch.arange(NUM_CLASSES).repeat_interleave(4)
    return theirs, ours, embeddings, labels


def value_and_gradients(loss, embeddings, labels):
    embeddings = embeddings.clone().requires_grad_()
    value = loss(embeddings, labels)
    value.backward()
    return value.detach(), embeddings.grad, loss.proxies.grad


def reference(embeddings, proxies, labels, softmax_scale):
    """Proxy NCA from its formula: mean over samples of -log softmax_k(-s ||x - p_k||^2) at k = y."""
    x, p = F.normalize(embeddings.double(), dim=1), F.normalize(proxies.double(), dim=1)
    log_p = torch.log_softmax(-softmax_scale * torch.cdist(x, p) ** 2, dim=1)
    return -log_p[torch.arange(len(labels)), labels].mean()


@pytest.mark.parametrize("softmax_scale", [0.01, 1.0, 13.98, 30.0])
def test_same_loss_and_gradients_as_pml_where_pml_is_finite(softmax_scale):
    for seed in range(3):
        theirs, ours, embeddings, labels = pair(softmax_scale, seed, dtype=torch.float64)
        expected = value_and_gradients(theirs, embeddings, labels)
        got = value_and_gradients(ours, embeddings, labels)
        for a, b in zip(got, expected):
            assert torch.allclose(a, b, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("softmax_scale", [60.0, 100.0])
def test_finite_where_pml_is_not(softmax_scale):
    pml_faults = 0
    for seed in range(5):
        theirs, ours, embeddings, labels = pair(softmax_scale, seed)
        their_value, their_grad, _ = value_and_gradients(theirs, embeddings, labels)
        value, grad, proxy_grad = value_and_gradients(ours, embeddings, labels)
        assert torch.isfinite(grad).all() and torch.isfinite(proxy_grad).all() and grad.abs().sum() > 0
        expected = reference(embeddings, ours.proxies.detach(), labels, softmax_scale).item()
        assert value.item() == pytest.approx(expected, rel=1e-4)
        # PML 2.9: NaN gradients (p subnormal) or a different value (samples whose p is 0 dropped).
        pml_faults += (not torch.isfinite(their_grad).all()) or their_value.item() != pytest.approx(expected, rel=1e-4)
    assert pml_faults >= 3


def test_gradients_match_autograd_of_the_reference_in_float64():
    _, ours, embeddings, labels = pair(100.0, dtype=torch.float64)
    proxies = ours.proxies.detach().double()
    x = embeddings.clone().requires_grad_()
    reference(x, proxies, labels, 100.0).backward()
    _, grad, _ = value_and_gradients(ours, embeddings, labels)
    assert torch.allclose(grad, x.grad, rtol=1e-7, atol=1e-10)
