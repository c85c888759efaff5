"""Training one model with PML's trainer (`train_model`): what the loader does around it."""

import dataclasses
import os

import numpy as np
import pytest
import torch

from pml_rank.harness.budget import resolve
from pml_rank.harness.evaluation import TrainingConfig
from pml_rank.harness.evaluation.training import train_model
from pml_rank.losses import SmoothAPLoss


class PidStamped(torch.utils.data.Dataset):
    """Points of 8 classes whose last feature is the id of the process that loaded them."""

    def __init__(self):
        generator = torch.Generator().manual_seed(0)
        self.labels = np.repeat(np.arange(8), 8)
        self.points = torch.randn(len(self.labels), 6, generator=generator)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        return torch.cat([self.points[index], torch.tensor([float(os.getpid())])]), int(self.labels[index])


class RecordingTrunk(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear, self.loader_pids = torch.nn.Linear(6, 4), set()

    def forward(self, x):
        self.loader_pids.update(x[:, -1].long().tolist())
        return self.linear(x[:, :-1])


@pytest.mark.slow  # starts loader processes
def test_the_loaders_processes_live_through_every_pass_and_epoch():
    dataset, trunk = PidStamped(), RecordingTrunk()
    budget = dict(resolve("glyphs"), epochs=2, iterations_per_epoch=5, batch_size=16)
    config = dataclasses.replace(TrainingConfig.from_budget(budget), loader_workers=2)
    train_model(SmoothAPLoss(), dataset, config, trunk=trunk, seed=0)
    # 10 batches of 16 over 64 samples: 2.5 passes over the sampler, each of which started
    # PML's loader processes anew.
    assert len(trunk.loader_pids) == 2 and os.getpid() not in trunk.loader_pids
