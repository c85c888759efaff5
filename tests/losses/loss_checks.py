"""What the float64 comparisons of the AP losses share (test_pnp.py, test_roadmap.py): seeded
embeddings, the label layouts, and one assertion on a loss's value and gradients."""

import torch

LAYOUTS = {
    "4 x 4": (torch.arange(16) // 4).tolist(),
    "5 x 3": (torch.arange(15) // 3).tolist(),
    "2 x 8": (torch.arange(16) // 8).tolist(),
    "unequal classes": [0, 0, 0, 0, 0, 1, 1, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3],
    "singletons among pairs": [0, 1, 1, 2, 3, 3, 4, 5, 5, 5, 6],
    "one class": [7] * 9,
    "shuffled random": torch.randint(0, 5, (23,), generator=torch.Generator().manual_seed(3)).tolist(),
}


def seeded(size, dim=8, seed=0, scale=1.0):
    """[size, dim] float64 normal embeddings times `scale`, requiring a gradient."""
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(size, dim, generator=generator, dtype=torch.float64) * scale).requires_grad_()


def grads(loss, tensors):
    return torch.autograd.grad(loss, tensors, retain_graph=True)


def assert_same_loss_and_gradients(ours, theirs, tensors):
    """`ours` equals `theirs` in value and in gradient with respect to `tensors`, which is not
    trivially zero."""
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)
    expected = grads(theirs, tensors)
    assert max(g.abs().max() for g in expected) > 1e-4
    for got, want in zip(grads(ours, tensors), expected):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
