"""One home for the harness's defaults: the training budgets (presets) of `pml-rank bench`
and `pml-rank tune`, importable without torch (the command line's --help shows them).

A budget is one flat dict. The effective budget of a run is its preset's values with every
option the command line gave in their place (`resolve`); the table header and the JSON
record it whole.
"""

import hashlib
import json
from pathlib import Path

# The embedded glyphs: 64 classes, 10 epochs x 60 iterations, Adam at 3e-3 annealed to zero
# by a cosine schedule: 2 cores train the 13 contenders x 3 seeds x 4 folds in under 9
# minutes; twice the epochs gains 2 points on average, 3 rows beyond their 95% CI. With all 274 classes
# validation MAP@R was still rising after 3,000 iterations (examples/README.md, "Choosing
# the budget").
GLYPHS = dict(
    trunk="small-cnn",
    random_init=True,
    freeze_batchnorm=False,
    embedding_size=64,
    epochs=10,
    iterations_per_epoch=60,
    batch_size=32,
    optimizer="adam",
    lr=3e-3,
    weight_decay=0.0,
    momentum=0.0,
    lr_schedule="cosine",
    patience=None,
    num_classes=64,
    image_size=None,  # the glyphs' own 32 x 32 pixels
    resize=None,
    augmentation="none",
    seeds=3,
    trials=20,
)

# Musgrave et al., A Metric Learning Reality Check (ECCV 2020), section 4: BN-Inception
# (torchvision has none: GoogLeNet with BatchNorm stands in) with frozen BatchNorm, 128-d,
# batches of 32 (8 classes x 4), RMSprop lr 1e-6 (weight decay 1e-4, momentum 0.9), random
# resized crops of 227 px (16-100% of the area) and flips, centre crop 227 for evaluation,
# 100 iterations per epoch, up to 1000 epochs with early stopping on validation MAP@R
# (patience 9; 39 on SOP), 50 search trials per loss.
REALITY_CHECK = dict(
    trunk="bn-inception",
    random_init=False,
    freeze_batchnorm=True,
    embedding_size=128,
    epochs=1000,
    iterations_per_epoch=100,
    batch_size=32,
    optimizer="rmsprop",
    lr=1e-6,
    weight_decay=1e-4,
    momentum=0.9,
    lr_schedule="constant",
    patience=9,
    num_classes="all",
    image_size=227,
    resize=256,
    augmentation="random-resized-crop",
    seeds=3,
    trials=50,
)
REALITY_CHECK_PATIENCE = {"sop": 39}

PRESETS = {"glyphs": GLYPHS, "reality-check": REALITY_CHECK}
# Without --preset: the glyph budget on the glyphs, the Reality Check on every image data set.
AUTO_PRESET = "auto"


def preset_for(dataset, preset=AUTO_PRESET):
    """The preset name a run on `dataset` uses when --preset is `preset`."""
    if preset != AUTO_PRESET:
        return preset
    return "glyphs" if dataset == "glyphs" else "reality-check"


def resolve(dataset="glyphs", preset=AUTO_PRESET, **given):
    """The effective budget: the preset's values, then every `given` value that is not None.
    Also holds ``dataset``, ``preset`` (its name) and the fixed protocol keys."""
    name = preset_for(dataset, preset)
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; available: {', '.join(PRESETS)}")
    budget = dict(PRESETS[name])
    if name == "reality-check" and dataset in REALITY_CHECK_PATIENCE:
        budget["patience"] = REALITY_CHECK_PATIENCE[dataset]
    unknown = sorted(set(given) - set(budget) - {"num_folds", "amp"})
    if unknown:
        raise TypeError(f"budget: unknown keys {', '.join(unknown)}")
    budget.update(dataset=dataset, preset=name, num_folds=4, amp=False)
    budget.update({key: value for key, value in given.items() if value is not None})
    return budget


# Kept for the callers that want the glyph budget as it was: the default run.
DEFAULTS = resolve("glyphs")
DEFAULTS.update(device="cpu", threads=1)

# What makes two training budgets the same: a bench store and a tuning study hold runs of
# one budget only. Not the device index, the data root or the threads: several machines
# share one bench.
TRAINING_KEYS = (
    "dataset",
    "trunk",
    "random_init",
    "freeze_batchnorm",
    "embedding_size",
    "epochs",
    "iterations_per_epoch",
    "batch_size",
    "optimizer",
    "lr",
    "weight_decay",
    "momentum",
    "lr_schedule",
    "patience",
    "num_folds",
    "num_classes",
    "image_size",
    "resize",
    "augmentation",
    "amp",
)


def training_key(budget):
    """The budget's `TRAINING_KEYS`: what a result depends on (a bench's identity, a
    study's, a saved experiment's)."""
    return {key: budget.get(key) for key in TRAINING_KEYS}


def digest(value):
    """A short hex digest of a JSON-able value (key order does not matter)."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]


# `--lr-schedule`: "cosine" anneals the learning rate to zero over the epochs
# (`torch.optim.lr_scheduler.CosineAnnealingLR`, stepped after each epoch), "constant" keeps it.
LR_SCHEDULES = ("cosine", "constant")
OPTIMIZERS = ("adam", "rmsprop", "sgd")
AUGMENTATIONS = ("none", "random-resized-crop", "crop-flip")
TRUNKS = ("small-cnn", "bn-inception", "googlenet", "resnet50")

# `--classes all`: every class of the data set.
ALL_CLASSES = "all"

# The tuned parameters `pml-rank bench` uses by default on the glyphs (`--untuned`: the
# papers' defaults), made by the `pml-rank tune` run recorded inside the file.
SHIPPED_PARAMS = Path(__file__).with_name("tuned_glyphs.json")

# `pml-rank bench` without row names: every registered loss and these of PML's baselines
# (`pml-rank bench --list` shows the others).
DEFAULT_BASELINES = ("pml:ContrastiveLoss", "pml:TripletMarginLoss", "pml:FastAPLoss", "pml:NPairsLoss")

# The data sets `--dataset` names; `folder:PATH` is a user's own images.
DATASET_NAMES = ("glyphs", "cub200", "cars196", "sop", "inshop")
FOLDER_PREFIX = "folder:"

# `pml-rank speed`'s sizes when the command line names none: batch sizes, except for the
# losses listed, whose sizes mean something else (RaMBOAPLoss: scores in one sequence).
SPEED_DEFAULT_SIZES = (512, 1024, 2048)
SPEED_DEFAULT_SIZES_PER_LOSS = {"RaMBOAPLoss": (100_000, 1_000_000)}


def fold_training_classes(num_classes, num_folds=4):
    """Classes the smallest fold model of the Reality Check protocol trains on, with
    `num_classes` classes in all: half of them are the training classes, and each fold
    leaves one of `num_folds` contiguous partitions out for validation
    (`evaluation.splits.class_partitions`); 0 when there are too few to split."""
    training = num_classes // 2
    if training < num_folds:
        return 0
    largest_partition = max(training * (k + 1) // num_folds - training * k // num_folds for k in range(num_folds))
    return training - largest_partition


def minimum_classes(per_class, batch_size, num_folds=4):
    """The fewest classes with which every fold model can fill a batch of `batch_size`
    with `per_class` samples of each class (and at least two classes)."""
    needed = max(batch_size // per_class, 2)
    num_classes = 2 * num_folds
    while fold_training_classes(num_classes, num_folds) < needed:
        num_classes += 1
    return num_classes


def class_count(num_classes):
    """`num_classes` as the data loaders take it: None for every class (`ALL_CLASSES`)."""
    return None if num_classes in (None, ALL_CLASSES) else num_classes
