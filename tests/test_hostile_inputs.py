"""Property-based tests: every loss, fed batches no unit test anticipated, returns a
finite loss with finite gradients (zero where there is nothing to learn), or raises a
ValueError/TypeError that names the loss. Never a NaN, never a warning but RaMBO's
`ZeroRankGradientWarning`, and that one only with an exactly zero gradient."""

import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pml_rank
from pml_rank.losses.rambo import ZeroRankGradientWarning

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
CASES_PER_LOSS = 200


def _losses():
    """pml-rank's own losses (third-party plugins make their own promises)."""
    return sorted(c.name for c in pml_rank.registry.components() if c.kind == "losses" and c.distribution == "pml-rank")


@st.composite
def hostile_batches(draw):
    size = draw(st.integers(1, 24))
    dim = draw(st.integers(1, 12))
    dtype = draw(st.sampled_from(DTYPES))
    label_dtype = draw(st.sampled_from([torch.int32, torch.int64]))
    layout = draw(st.sampled_from(["one class", "all distinct", "random", "singletons and pairs"]))
    if layout == "one class":
        labels = [0] * size
    elif layout == "all distinct":
        labels = list(range(size))
    elif layout == "random":
        labels = draw(st.lists(st.integers(0, max(1, size // 3)), min_size=size, max_size=size))
    else:
        labels = [i // 2 if i < size // 2 else size + i for i in range(size)]
    seed = draw(st.integers(0, 2**16))
    embeddings = torch.randn(size, dim, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    if draw(st.booleans()):  # ties: duplicated rows
        source = draw(st.lists(st.integers(0, size - 1), min_size=size, max_size=size))
        embeddings = embeddings[source]
    # Huge and tiny norms, within what the dtype can hold.
    exponent = draw(st.integers(-30, 30))
    limit = torch.finfo(dtype)
    scale = min(max(10.0**exponent, limit.tiny * 1e3), limit.max / (10 * dim))
    embeddings = (embeddings * scale).to(dtype)
    poison = draw(st.sampled_from([None, None, None, float("nan"), float("inf")]))
    if poison is not None:
        embeddings[draw(st.integers(0, size - 1)), draw(st.integers(0, dim - 1))] = poison
    return embeddings, torch.tensor(labels, dtype=label_dtype), abs(exponent) > 6


@pytest.mark.parametrize("name", _losses())
@settings(
    max_examples=CASES_PER_LOSS, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
@given(batch=hostile_batches())
def test_hostile_batches_give_finite_results_or_a_clear_error(name, batch):
    embeddings, labels, extreme_norms = batch
    embeddings.requires_grad_()
    loss_func = pml_rank.registry.losses()[name]()
    finite_input = bool(torch.isfinite(embeddings).all())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("error")
        warnings.simplefilter("always", ZeroRankGradientWarning)
        if not finite_input:
            with pytest.raises(ValueError, match=name):
                loss_func(embeddings, labels)
            return
        try:
            loss = loss_func(embeddings, labels)
        except ValueError as error:
            # Norms like 1e30 may be refused, by name; ordinary batches never are.
            assert extreme_norms and name in str(error), error
            return
        assert torch.is_tensor(loss) and loss.dim() == 0
        assert torch.isfinite(loss), f"{name}: loss {loss} on finite input"
        if loss.requires_grad:
            loss.backward()
            assert embeddings.grad is None or bool(torch.isfinite(embeddings.grad).all())
            if caught:  # duplicated rows of different classes: collapsed embeddings
                assert not embeddings.grad.any()
