"""The default training budget of `pml-rank bench`, importable without torch (the
command line's --help shows it)."""

from pathlib import Path

# 64 classes, 10 epochs x 60 iterations, Adam at 3e-3 annealed to zero by a cosine
# schedule: 2 cores train the 12 contenders x 3 seeds x 4 folds in under 8 minutes, and
# twice the epochs changes no row beyond its 95% CI. With all 274 classes validation MAP@R
# was still rising after 3,000 iterations (examples/README.md, "Choosing the budget").
DEFAULTS = dict(
    dataset="glyphs",
    epochs=10,
    iterations_per_epoch=60,
    batch_size=32,
    seeds=3,
    embedding_size=64,
    lr=3e-3,
    lr_schedule="cosine",
    num_classes=64,
    num_folds=4,
    device="cpu",
    threads=1,
)

# What makes two training budgets the same: a bench store and a tuning study hold runs of
# one budget only (the bench adds the device, tune its sampler's seed).
TRAINING_KEYS = (
    "dataset",
    "epochs",
    "iterations_per_epoch",
    "batch_size",
    "embedding_size",
    "lr",
    "lr_schedule",
    "num_folds",
    "num_classes",
)

# `--lr-schedule`: "cosine" anneals the learning rate to zero over the epochs
# (`torch.optim.lr_scheduler.CosineAnnealingLR`, stepped after each epoch), "constant" keeps it.
LR_SCHEDULES = ("cosine", "constant")

# `--classes all`: every class of the data set.
ALL_CLASSES = "all"

# The tuned parameters `pml-rank bench` uses by default (`--untuned`: the papers' defaults),
# made by the `pml-rank tune` run recorded inside the file.
SHIPPED_PARAMS = Path(__file__).with_name("tuned_glyphs.json")

# The data sets `pml-rank bench` can run on (the keys of `bench.DATASETS`).
DATASET_NAMES = ("glyphs",)

# `pml-rank speed`'s sizes when the command line names none: batch sizes, except for the
# losses listed, whose sizes mean something else (RaMBOAPLoss: scores in one sequence).
SPEED_DEFAULT_SIZES = (512, 1024, 2048)
SPEED_DEFAULT_SIZES_PER_LOSS = {"RaMBOAPLoss": (100_000, 1_000_000)}


def fold_training_classes(num_classes, num_folds=DEFAULTS["num_folds"]):
    """Classes the smallest fold model of the Reality Check protocol trains on, with
    `num_classes` classes in all: half of them are the training classes, and each fold
    leaves one of `num_folds` contiguous partitions out for validation
    (`evaluation.splits.class_partitions`); 0 when there are too few to split."""
    training = num_classes // 2
    if training < num_folds:
        return 0
    largest_partition = max(training * (k + 1) // num_folds - training * k // num_folds for k in range(num_folds))
    return training - largest_partition


def minimum_classes(per_class, batch_size, num_folds=DEFAULTS["num_folds"]):
    """The fewest classes with which every fold model can fill a batch of `batch_size`
    with `per_class` samples of each class (and at least two classes)."""
    needed = max(batch_size // per_class, 2)
    num_classes = 2 * num_folds
    while fold_training_classes(num_classes, num_folds) < needed:
        num_classes += 1
    return num_classes


def with_defaults(**given):
    """`given` with `DEFAULTS` in place of every None."""
    return {key: DEFAULTS[key] if value is None else value for key, value in given.items()}
