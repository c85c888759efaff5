"""A data set and a trunk that tell which process loaded each batch a model saw."""

import os

import numpy as np
import torch

from pml_rank.harness.datasets import NormalizedImages


class PidStamped(torch.utils.data.Dataset):
    """Points of `classes` classes (labels from `first_label`), `per_class` each, whose last
    feature is the id of the process that loaded them."""

    def __init__(self, classes=8, per_class=8, first_label=0, seed=0):
        generator = torch.Generator().manual_seed(seed)
        self.labels = np.repeat(np.arange(first_label, first_label + classes), per_class)
        self.points = torch.randn(len(self.labels), 6, generator=generator)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        return torch.cat([self.points[index], torch.tensor([float(os.getpid())])]), int(self.labels[index])


class RecordingTrunk(torch.nn.Module):
    """A linear layer over the points that records the loading processes' ids, in
    ``loader_pids[mode]`` ("train" or "eval": the module's mode when it saw them); `record`
    lets several trunks share one record."""

    def __init__(self, record=None):
        super().__init__()
        self.linear = torch.nn.Linear(6, 4)
        self.loader_pids = {"train": set(), "eval": set()} if record is None else record

    def forward(self, x):
        self.loader_pids["train" if self.training else "eval"].update(x[:, -1].long().tolist())
        return self.linear(x[:, :-1])


def write_image_folder(root, classes=4, per_class=6, size=16):
    """A `folder:` data set of random RGB images, alternately PNG and JPEG; returns `root`."""
    from PIL import Image

    rng = np.random.default_rng(0)
    for c in range(classes):
        (root / f"class-{c}").mkdir(parents=True)
        for i in range(per_class):
            pixels = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / f"class-{c}" / f"{i}.{'png' if i % 2 else 'jpg'}")
    return root


class FlatTrunk(torch.nn.Module):
    """A linear layer over flattened 3 x 8 x 8 images that keeps every training batch it saw,
    after a dropout of probability `dropout`: torch's generator draws at every step. It reads
    8-bit images (`image_transforms`'), normalised as the harness's trunks normalise them."""

    def __init__(self, dropout=0.0):
        super().__init__()
        self.linear, self.dropout = torch.nn.Linear(3 * 8 * 8, 4), torch.nn.Dropout(dropout)
        self.seen = []
        NormalizedImages.attach(self, 3)

    def forward(self, x):
        if self.training:
            self.seen.append(x.detach().clone())
        return self.linear(self.dropout(x.flatten(1)))
