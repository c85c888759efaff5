"""What an experiment is made of on a machine: the `Machine` that runs it, the budget's data
set (loaded once per process) and image transforms, and its trunk and embedder."""

import dataclasses
import functools

import torch

from . import backbones
from .budget import class_count
from .data import SmallCNN, real
from .data.glyphs import DEFAULT_CACHE_DIR
from .datasets import DataError, NormalizedImages, Transformed, data_root_missing, image_transforms, load_dataset
from .evaluation import StandardSplits

# The papers' data sets, which the standard protocol reads, are colour photographs.
STANDARD_CHANNELS = 3


@dataclasses.dataclass(frozen=True)
class Machine:
    """What an experiment takes from the machine that runs it: where its data are read and
    its models kept, its device and loader processes. Not part of its result, so several
    machines with other paths share one bench."""

    data_root: str | None = None
    cache_dir: str | None = None
    device: str = "cpu"
    loader_workers: int = 0
    models_dir: str | None = None  # keep each trained experiment's fold models and logs here


class ChannelsToRGB(torch.nn.Module):
    """Repeats a single-channel image three times, for ImageNet trunks on grayscale sets."""

    def forward(self, images):
        return images.expand(-1, 3, -1, -1) if images.shape[1] == 1 else images


def model_factories(budget, channels, load_weights=True):
    """``(make_trunk, make_embedder)`` for the budget's trunk on images of `channels`
    channels (8-bit ones normalised by the trunk: `datasets.NormalizedImages`); `make_embedder`
    is None for the small CNN, which embeds by itself.
    ``load_weights=False``: the same networks without reading ImageNet weights."""
    name, size = budget["trunk"], budget["embedding_size"]
    if name == "small-cnn":
        return (lambda: NormalizedImages.attach(SmallCNN(embedding_size=size, in_channels=channels), channels)), None
    features = backbones.BACKBONES[name].features

    def make_trunk():
        trunk = backbones.build_trunk(name, pretrained=not budget["random_init"], load_weights=load_weights)
        trunk = trunk if channels == 3 else torch.nn.Sequential(ChannelsToRGB(), trunk)
        return NormalizedImages.attach(trunk, channels)

    return make_trunk, (lambda: torch.nn.Linear(features, size))


def dataset_of(budget, machine):
    """The budget's data set (its first ``num_classes`` classes), loaded once per process."""
    return load_dataset(budget["dataset"], machine.data_root, machine.cache_dir, class_count(budget["num_classes"]))


def transforms_of(budget, data):
    """``(train, eval)`` image transforms of the budget for `data`, or None for the glyphs,
    which are tensors already."""
    return None if budget["dataset"] == "glyphs" else image_transforms(budget, data.channels)


@functools.cache
def _standard_splits(name, data_root, cache_dir):
    spec = real.DATASETS[name]
    try:
        train, query = (
            spec.load(data_root, split, cache_dir=cache_dir) for split in (spec.train_split, spec.query_split)
        )
        same = spec.reference_split == spec.query_split
        reference = None if same else spec.load(data_root, spec.reference_split, cache_dir=cache_dir)
    except (real.DataSetNotFoundError, real.ImageReadError) as error:
        raise DataError(str(error)) from None
    return StandardSplits(train, query, reference)


def standard_splits(budget, machine, transforms=None):
    """The budget's data set as the standard protocol reads it, its own training, query and
    reference splits (`evaluation.StandardSplits`), loaded once per process; with
    ``transforms=(train, eval)``, the training split through the first, the others through
    the second."""
    if machine.data_root is None:
        raise data_root_missing(budget["dataset"])
    splits = _standard_splits(budget["dataset"], machine.data_root, machine.cache_dir or DEFAULT_CACHE_DIR)
    if transforms is None:
        return splits
    train, evaluation = transforms
    return StandardSplits(
        Transformed(splits.train, train),
        Transformed(splits.query, evaluation),
        None if splits.reference is None else Transformed(splits.reference, evaluation),
    )
