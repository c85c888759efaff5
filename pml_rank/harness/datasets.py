"""The data sets `pml-rank bench` and `tune` run on, by their command-line name:

    glyphs        embedded, generated from fonts already on disk (the default)
    cub200, cars196, sop, inshop
                  the papers' data sets, read from --data-root (`data.real`; never downloaded)
    folder:PATH   a user's own images: one subfolder per class, any image Pillow reads;
                  classes in sorted folder-name order, images in sorted file-name order

Every data set goes through the same protocol: the whole set (train and test splits of the
papers' data sets together) is split class-disjointly by `evaluation.splits`. Problems (a
missing file, a class with fewer than 2 images, an unreadable image) raise `DataError`
when the data set is loaded, before any training. A process loads each data set once.
Its data sets are map-style, as torch's `DataLoader` and PML's trainers take them; the
command line checks a --dataset name with `budget.dataset_argument`, without torch.
"""

import logging
import os
from pathlib import Path

import numpy as np
import torch

from .budget import DATASET_NAMES, FOLDER_PREFIX, class_count
from .data import load_glyphs, real
from .data.glyphs import DEFAULT_CACHE_DIR
from .images import GRAYSCALE_MODES, ImageReadError, image_modes, open_8bit

IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
# For one channel (grayscale images), their means.
IMAGENET_MEAN_GRAY, IMAGENET_STD_GRAY = (float(np.mean(IMAGENET_MEAN)),), (float(np.mean(IMAGENET_STD)),)
# File names Pillow is asked to open in a folder: anything else (README, .DS_Store) is skipped.
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm")


class DataError(ValueError):
    """A data set cannot be used as it is; the message names the file and what to do."""


def needs_data_root(name):
    return name in DATASET_NAMES and name != "glyphs"


def data_root_missing(name):
    """The `DataError` for a papers' data set named without --data-root: what goes where."""
    layout = real.DATASETS[name].layout
    return DataError(
        f"--dataset {name} reads its images from --data-root: <data-root>/{layout.folder}/ holds "
        f"{', '.join(layout.required)}. {layout.download} Every layout: section "
        '"Real data sets and the papers\' tables" of examples/README.md.'
    )


class ImageFolder:
    """A folder with one subfolder per class. Items are ``(PIL image, label)``; ``labels``
    is an int64 array, ``classes`` the folder names (label k is ``classes[k]``), ``paths``
    the files. A set whose images are all grayscale stays single-channel (``channels``).

    Every image is decoded in full here, before any training (`images.image_modes`, its
    checks remembered in `cache_dir`): the first bad file (empty, truncated, not an image,
    a broken symbolic link) raises `DataError` naming it. Images in subfolders of a class
    folder belong to that class; hidden files and folders (``.ipynb_checkpoints``) are
    ignored, and images left out (hidden, or beside the class folders) are counted in
    ``ignored``, one line each, logged as a warning."""

    def __init__(self, root, transform=None, cache_dir=None):
        root = Path(root)
        folders = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
        if len(folders) < 2:
            raise DataError(
                f"folder:{root}: needs one subfolder per class and at least 2 classes, found {len(folders)}"
            )
        self.root, self.classes, self.paths, labels = root, [], [], []
        left_out = {"hidden": [], "loose": [], "not an image": []}
        for entry in sorted(root.iterdir()):
            if entry.name.startswith("."):
                left_out["hidden"] += _images_under(entry) if entry.is_dir() else _images_in([entry])
            elif not entry.is_dir():
                left_out["loose"] += _images_in([entry])
        for folder in folders:
            files = _image_files(folder, left_out)
            if len(files) < 2:
                raise DataError(
                    f"folder:{root}: class folder {folder} has {len(files)} image(s); every class needs 2 or more "
                    "(a retrieval query needs another image of its class): add images or remove the folder"
                )
            self.paths += files
            labels += [len(self.classes)] * len(files)
            self.classes.append(folder.name)
        self.labels = np.asarray(labels, dtype=np.int64)
        self.ignored = _ignored_lines(root, left_out)
        for line in self.ignored:
            logging.getLogger(__name__).warning("pml-rank: %s", line)
        try:
            modes, problems = image_modes(self.paths, cache_dir, desc=f"checking folder:{root}")
        except ImageReadError as error:
            raise DataError(f"folder:{root}: {error}") from None
        if problems:
            many = f" (1 of {len(problems)} unreadable images)" if len(problems) > 1 else ""
            raise DataError(f"folder:{root}: {problems[0]}{many}: replace or delete the file")
        self.channels = 1 if all(mode in GRAYSCALE_MODES for mode in modes) else 3
        self.transform = transform

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, index):
        image = open_8bit(self.paths[index], "L" if self.channels == 1 else "RGB")
        if self.transform is not None:
            image = self.transform(image)
        return image, int(self.labels[index])


def _images_in(paths):
    return [path for path in paths if path.suffix.lower() in IMAGE_SUFFIXES]


def _images_under(folder):
    return _images_in(Path(top, name) for top, _, names in os.walk(folder) for name in names)


def _image_files(folder, left_out):
    """The files of `folder` and its subfolders with an image suffix, sorted, hidden ones
    left out; symbolic links to folders followed (each folder once). Adds the hidden
    images to ``left_out["hidden"]`` and files without an image suffix to
    ``left_out["not an image"]``."""
    files, seen = [], set()
    for top, dirs, names in os.walk(folder, followlinks=True):
        resolved = os.path.realpath(top)
        if resolved in seen:  # a link back up the tree
            dirs[:] = []
            continue
        seen.add(resolved)
        for name in [d for d in dirs if d.startswith(".")]:
            left_out["hidden"] += _images_under(Path(top, name))
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        for name in names:
            path = Path(top, name)
            if path.suffix.lower() not in IMAGE_SUFFIXES:
                left_out["not an image"].append(path)
            elif name.startswith("."):
                left_out["hidden"].append(path)
            else:
                files.append(path)
    return sorted(files)


def _ignored_lines(root, left_out):
    """One line per kind of file a folder data set leaves out, with a count and an example."""
    reasons = {
        "hidden": "image(s) in hidden files or folders (names starting with '.')",
        "loose": "image(s) directly in the folder, outside every class folder",
        "not an image": f"file(s) without an image suffix ({' '.join(IMAGE_SUFFIXES)})",
    }
    return [
        f"folder:{root}: ignored {len(paths)} {reasons[kind]}, e.g. {min(paths)}"
        for kind, paths in left_out.items()
        if paths
    ]


class FirstClasses:
    """The items of `dataset` whose class is among its first `num_classes` (in label order),
    relabelled 0..num_classes-1 in that order."""

    def __init__(self, dataset, num_classes):
        labels = np.asarray(dataset.labels)
        classes = np.unique(labels)
        if not 2 <= num_classes <= len(classes):
            raise ValueError(f"--classes must be between 2 and {len(classes)} for this data set, got {num_classes}")
        self.indices = np.flatnonzero(np.isin(labels, classes[:num_classes]))
        self.labels = np.searchsorted(classes, labels[self.indices]).astype(np.int64)
        self.dataset, self.channels = dataset, getattr(dataset, "channels", 3)

    def __len__(self):
        return len(self.indices)

    def __getitem__(self, index):
        return self.dataset[int(self.indices[index])][0], int(self.labels[index])


def _load(name, data_root, cache_dir, num_classes):
    if name == "glyphs":
        dataset = load_glyphs(cache_dir=cache_dir, num_classes=num_classes)
        dataset.channels = 1
        return dataset
    if name.startswith(FOLDER_PREFIX):
        dataset = ImageFolder(name[len(FOLDER_PREFIX) :], cache_dir=cache_dir or DEFAULT_CACHE_DIR)
    else:
        if data_root is None:
            raise data_root_missing(name)
        whole = "all" if name == "inshop" else "train+test"
        try:
            dataset = real.load(name, data_root, whole, cache_dir=cache_dir or DEFAULT_CACHE_DIR)
        except (real.DataSetNotFoundError, real.ImageReadError) as error:
            raise DataError(str(error)) from None
        dataset.labels = np.asarray(dataset.labels, dtype=np.int64)
        dataset.channels = 3
        counts = np.unique(dataset.labels, return_counts=True)
        single = counts[0][counts[1] < 2]
        if len(single):
            raise DataError(f"{name}: class {single[0]} has fewer than 2 images: re-extract the archive")
    return dataset if num_classes is None else FirstClasses(dataset, num_classes)


_LOADED = {}


def load_dataset(name, data_root=None, cache_dir=None, num_classes=None):
    """The data set `name` (a `budget.dataset_argument` value), its first `num_classes` classes (a
    count, "all" or None for all), loaded once per process. Items are ``(image, label)``
    with a PIL image (or, for the glyphs, a tensor); ``labels`` and ``channels`` are set."""
    key = (name, None if data_root is None else os.fspath(data_root), cache_dir, class_count(num_classes))
    if key not in _LOADED:
        _LOADED[key] = _load(*key)
    return _LOADED[key]


def image_transforms(budget, channels):
    """``(train, eval)`` transforms for a budget's ``augmentation``: "none" (eval's
    transform for both; without an ``image_size``, the image as it is, as a tensor in
    [0, 1]: the glyphs' own form), "random-resized-crop" (Reality
    Check: shorter side to ``resize``, a random crop of 16-100% of the area with aspect
    3/4-4/3 to ``image_size``, flip; eval: shorter side ``resize``, centre crop) or
    "crop-flip" (resize to ``resize`` square, random ``image_size`` crop, flip; eval: centre
    crop). All but the first give 8-bit images (uint8, channels first), which the trunk
    normalises on its own device (`NormalizedImages`)."""
    from torchvision import transforms

    if budget["augmentation"] == "none" and budget["image_size"] is None:
        return transforms.ToTensor(), transforms.ToTensor()
    tail = [transforms.PILToTensor()]
    size, resize = budget["image_size"], budget["resize"]
    if budget["augmentation"] == "random-resized-crop":
        train = [transforms.Resize(resize), transforms.RandomResizedCrop(size, scale=(0.16, 1.0), ratio=(3 / 4, 4 / 3))]
        test = [transforms.Resize(resize), transforms.CenterCrop(size)]
    else:
        train = [transforms.Resize((resize, resize)), transforms.RandomCrop(size)]
        test = [transforms.Resize((resize, resize)), transforms.CenterCrop(size)]
    if budget["augmentation"] == "none":
        return transforms.Compose(test + tail), transforms.Compose(test + tail)
    return (
        transforms.Compose(train + [transforms.RandomHorizontalFlip()] + tail),
        transforms.Compose(test + tail),
    )


class NormalizedImages:
    """A trunk's forward pre-hook (`attach`): a batch of 8-bit images, as `image_transforms`
    gives them, normalised with ImageNet's statistics (their means for one channel) on the
    batch's own device; any other input passes unchanged (the glyphs' float images). The
    loader processes hand a quarter of the bytes and skip the float arithmetic, which took
    0.63 of 2.1 ms an image at 224 px on a CPU core; on a GPU it is one pass over the batch."""

    def __init__(self, channels):
        mean, std = (IMAGENET_MEAN, IMAGENET_STD) if channels == 3 else (IMAGENET_MEAN_GRAY, IMAGENET_STD_GRAY)
        # 255 too is a tensor of the images' device: torch's CUDA division by a number from the CPU
        # multiplies by its reciprocal, one bit off the CPU's division for about half the 256 values.
        statistics = tuple(torch.tensor(s, dtype=torch.float32) for s in (255.0, mean, std))
        self._statistics = {torch.device("cpu"): statistics}

    @classmethod
    def attach(cls, trunk, channels):
        """`trunk`, which now reads 8-bit images of `channels` channels too (returned)."""
        trunk.register_forward_pre_hook(cls(channels))
        return trunk

    def __call__(self, module, inputs):
        """The hook: `inputs` with its images normalised; None where they are not 8-bit."""
        images = self.normalized(inputs[0])
        return None if images is inputs[0] else (images, *inputs[1:])

    def normalized(self, images):
        """8-bit `images` ([..., channels, height, width]) as ImageNet trunks read them, on
        their device: float32 in [0, 1] less the mean, over the standard deviation (torchvision's
        ToTensor then Normalize, the same operations: the same bits, on a GPU too); anything else, itself."""
        if not torch.is_tensor(images) or images.dtype != torch.uint8:
            return images
        if images.device not in self._statistics:
            # Copied once a device: a copy at every batch would make the host wait for the GPU.
            on_cpu = self._statistics[torch.device("cpu")]
            self._statistics[images.device] = tuple(s.to(images.device) for s in on_cpu)
        scale, mean, std = self._statistics[images.device]
        return images.float().div_(scale).sub_(mean.view(-1, 1, 1)).div_(std.view(-1, 1, 1))


class Transformed:
    """`subset` (a `LabelledSubset`) with `transform` applied to each item's image; None
    leaves tensors (the glyphs) as they are.

    An item is read by its index or by the key ``(index, seed)``: then the transform's random
    draws (torchvision's come from torch's generator) come from a generator seeded with
    `seed`, and the process's own is left as it was, so the item is the same in whichever
    process decodes it. The training loader keys every item it draws (`evaluation.training`)."""

    def __init__(self, subset, transform):
        self.subset, self.transform, self.labels = subset, transform, subset.labels

    def __len__(self):
        return len(self.subset)

    def __getitem__(self, key):
        index, seed = key if isinstance(key, tuple) else (key, None)
        image, label = self.subset[index]
        if self.transform is None or not hasattr(image, "mode"):
            return image, label
        if seed is None:
            return self.transform(image), label
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(seed)  # the CPU's alone: a GPU's generator is not forked
            return self.transform(image), label
