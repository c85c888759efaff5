"""A training run checkpointed mid-way and resumed gives the same next losses as the
uninterrupted run: models, optimizers, the loss's score memory and the hard negative
class sampler's state all go through the checkpoint."""

import pytest
import torch

from pml_rank.losses import NPairsMCLoss, RaMBORecallLoss
from pml_rank.samplers import HardNegativeClassSampler

EPOCHS, BATCHES_PER_EPOCH, CLASSES_PER_BATCH = 4, 3, 6


def _data():
    generator = torch.Generator().manual_seed(0)
    labels = torch.arange(24).repeat_interleave(5)
    data = torch.randn(24, 10, generator=generator)[labels] + torch.randn(len(labels), 10, generator=generator)
    return data, labels


def _fresh_run(data, labels):
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(10, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = {"rambo": RaMBORecallLoss(memory_size=2), "npairs": NPairsMCLoss()}
    sampler = HardNegativeClassSampler(
        labels, CLASSES_PER_BATCH, candidate_classes=12, batches_per_epoch=BATCHES_PER_EPOCH, seed=3
    )
    sampler.attach(model, torch.utils.data.TensorDataset(data, labels))
    return model, optimizer, losses, sampler


def _train(run, data, labels, epochs):
    model, optimizer, losses, sampler = run
    recorded = []
    for _ in range(epochs):
        indices = list(sampler)
        for start in range(0, len(indices), 2 * CLASSES_PER_BATCH):
            batch = torch.tensor(indices[start : start + 2 * CLASSES_PER_BATCH])
            embeddings = model(data[batch])
            values = {name: loss(embeddings, labels[batch]) for name, loss in losses.items()}
            optimizer.zero_grad()
            sum(values.values()).backward()
            optimizer.step()
            recorded.append({name: value.item() for name, value in values.items()})
    return recorded


def _checkpoint(run):
    model, optimizer, losses, sampler = run
    return {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "losses": {name: loss.state_dict() for name, loss in losses.items()},
        "sampler": sampler.state_dict(),
    }


def _restore(run, checkpoint):
    model, optimizer, losses, sampler = run
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    for name, loss in losses.items():
        loss.load_state_dict(checkpoint["losses"][name])
    sampler.load_state_dict(checkpoint["sampler"])


def test_resumed_run_continues_exactly_like_the_uninterrupted_one(tmp_path):
    data, labels = _data()
    uninterrupted = _train(_fresh_run(data, labels), data, labels, EPOCHS)

    first = _fresh_run(data, labels)
    head = _train(first, data, labels, EPOCHS // 2)
    torch.save(_checkpoint(first), tmp_path / "checkpoint.pt")
    assert len(first[2]["rambo"].memory) == 2  # the memory really is part of the state

    resumed = _fresh_run(data, labels)  # new objects, as in a new process
    _restore(resumed, torch.load(tmp_path / "checkpoint.pt", weights_only=False))
    tail = _train(resumed, data, labels, EPOCHS - EPOCHS // 2)
    assert head + tail == uninterrupted


@pytest.mark.parametrize("forget", ["score memory", "sampler state"])
def test_a_checkpoint_missing_a_part_gives_a_different_run(forget):
    """The controls: the test above can fail."""
    data, labels = _data()
    uninterrupted = _train(_fresh_run(data, labels), data, labels, EPOCHS)
    first = _fresh_run(data, labels)
    head = _train(first, data, labels, EPOCHS // 2)
    checkpoint = _checkpoint(first)
    resumed = _fresh_run(data, labels)
    _restore(resumed, checkpoint)
    if forget == "score memory":
        resumed[2]["rambo"].reset_memory()
    else:
        resumed[3].load_state_dict(_fresh_run(data, labels)[3].state_dict())
    tail = _train(resumed, data, labels, EPOCHS - EPOCHS // 2)
    assert head + tail != uninterrupted
