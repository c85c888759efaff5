"""pml_rank.losses.CrossBatchMemory: every registered loss, inside it, gives the value and
the gradient of an explicit computation on the batch against batch + memory, over steps
that fill the memory and wrap around it."""

import inspect

import pytest
import torch
from pytorch_metric_learning import losses as pml_losses

import pml_rank
from pml_rank.losses import AUCLoss, CrossBatchMemory, FastAPLoss, RaMBOAPLoss

BATCH, DIM, MEMORY, STEPS = 8, 6, 20, 6  # the third batch straddles the end of the memory


def make(name):
    """The registered loss with its defaults, and no memory of its own."""
    loss_class = pml_rank.registry.losses()[name]
    own_memory = "memory_size" in inspect.signature(loss_class).parameters
    return loss_class(**({"memory_size": 0} if own_memory else {}))


def step_batch(step):
    generator = torch.Generator().manual_seed(100 + step)
    embeddings = torch.randn(BATCH, DIM, generator=generator, dtype=torch.float64)
    return embeddings, torch.randint(0, 5, (BATCH,), generator=generator)


class ExplicitMemory:
    """The last MEMORY samples in a ring, oldest overwritten first, as the paper keeps them."""

    def __init__(self):
        self.embeddings = torch.zeros(MEMORY, DIM, dtype=torch.float64)
        self.labels = torch.zeros(MEMORY, dtype=torch.long)
        self.seen = 0

    def add(self, embeddings, labels):
        """Stores the batch; returns the slot of each of its samples."""
        slots = (self.seen + torch.arange(len(labels))) % MEMORY
        self.embeddings[slots], self.labels[slots] = embeddings.detach(), labels
        self.seen += len(labels)
        return slots

    def contents(self):
        stored = min(self.seen, MEMORY)
        return self.embeddings[:stored], self.labels[:stored]


def value_and_grad(loss_of, embeddings):
    embeddings = embeddings.clone().requires_grad_()
    loss = loss_of(embeddings)
    if not loss.requires_grad:  # nothing to learn in this batch
        return loss.detach(), torch.zeros_like(embeddings)
    (grad,) = torch.autograd.grad(loss, embeddings)
    return loss.detach(), grad


# RaMBO warns when Algorithm 1 moves no rank on these random batches: a zero gradient both ways.
@pytest.mark.filterwarnings("ignore::pml_rank.losses.rambo.ZeroRankGradientWarning")
@pytest.mark.parametrize("name", sorted(pml_rank.registry.losses()))
def test_inside_cross_batch_memory_equals_the_loss_against_batch_and_memory(name):
    wrapped = CrossBatchMemory(make(name), embedding_size=DIM, memory_size=MEMORY)
    alone, memory = make(name), ExplicitMemory()
    learned = False
    for step in range(STEPS):
        embeddings, labels = step_batch(step)
        got = value_and_grad(lambda e: wrapped(e, labels), embeddings)
        slots = memory.add(embeddings, labels)
        references, reference_labels = memory.contents()
        # Every pair of a query with a reference, but its own stored copy.
        same = labels[:, None] == reference_labels[None, :]
        own = torch.zeros_like(same)
        own[torch.arange(BATCH), slots] = True
        pairs = (*torch.where(same & ~own), *torch.where(~same))
        expected = value_and_grad(lambda e: alone(e, labels, pairs, references, reference_labels), embeddings)
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12, msg=f"{name}, step {step}")
        learned |= bool(expected[1].any())
    assert memory.seen > MEMORY and learned


def test_a_loss_with_its_own_memory_is_refused():
    with pytest.raises(
        ValueError, match=r"CrossBatchMemory: loss RaMBOAPLoss keeps a memory of its own \(memory_size=3\)"
    ):
        CrossBatchMemory(RaMBOAPLoss(), embedding_size=DIM)


def test_pmls_loss_of_a_registered_name_is_not_taken_for_ours():
    with pytest.raises(ValueError, match="loss is pytorch_metric_learning.losses.fast_ap_loss.FastAPLoss, which PML's"):
        CrossBatchMemory(pml_losses.FastAPLoss(), embedding_size=DIM)
    CrossBatchMemory(FastAPLoss(), embedding_size=DIM)


def test_pmls_supported_losses_still_work_and_pmls_own_wrapper_is_untouched():
    embeddings, labels = step_batch(0)
    ours = CrossBatchMemory(pml_losses.TripletMarginLoss(), embedding_size=DIM, memory_size=MEMORY)
    theirs = pml_losses.CrossBatchMemory(pml_losses.TripletMarginLoss(), embedding_size=DIM, memory_size=MEMORY)
    torch.testing.assert_close(ours(embeddings, labels), theirs(embeddings, labels))
    with pytest.raises(Exception, match="CrossBatchMemory not supported for AUCLoss"):
        pml_losses.CrossBatchMemory(AUCLoss(), embedding_size=DIM)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"embedding_size": "8"}, TypeError, "CrossBatchMemory: embedding_size must be an integer, got the string '8'"),
        ({"embedding_size": 0}, ValueError, "CrossBatchMemory: embedding_size and memory_size must be >= 1"),
        ({"embedding_size": 8, "memory_size": 0}, ValueError, "got embedding_size=8, memory_size=0"),
    ],
)
def test_bad_sizes_are_refused_by_name(kwargs, error, message):
    with pytest.raises(error, match=message):
        CrossBatchMemory(FastAPLoss(), **kwargs)
