"""The harness's settings: the option table of `pml-rank bench` and `pml-rank tune`, with
each budget key's command-line option and its value in each preset. The parser's options,
`--help`'s values and the budget `resolve` returns are generated from `SETTINGS`: adding a
setting is one entry there. Importable without torch (the command line's --help shows it).

A budget is one flat dict: the preset's values with every option the command line gave in
their place (`resolve`); the table header and the JSON record it whole. The runner turns it
into the frozen `evaluation.TrainingConfig` its trainer takes.
"""

import argparse
import dataclasses
import hashlib
import json
from collections.abc import Callable
from pathlib import Path

from . import arguments

OPTIMIZERS = ("adam", "rmsprop", "sgd")
# "cosine" anneals the learning rate to zero over the epochs (`CosineAnnealingLR`, stepped
# after each epoch), "constant" keeps it.
LR_SCHEDULES = ("cosine", "constant")
AUGMENTATIONS = ("none", "random-resized-crop", "crop-flip")
# "reality-check": one model per cross-validation fold of the first half of the classes, tested on
# the second half (`evaluation.run_protocol`); "standard": the older papers' protocol, one model
# trained on a data set's training split and tested on its test split (`evaluation.run_standard_protocol`).
REALITY_CHECK_PROTOCOL, STANDARD_PROTOCOL = "reality-check", "standard"
PROTOCOLS = (REALITY_CHECK_PROTOCOL, STANDARD_PROTOCOL)
TRUNKS = ("small-cnn", "bn-inception", "googlenet", "resnet50")
# `--classes all`: every class of the data set.
ALL_CLASSES = "all"
# How much larger than the crop (--image-size) the images are resized first, when --resize
# is not given: the Reality Check crops 227 of a 256 resize (every bench and tune budget);
# the older papers, ImageNet practice since ResNet, crop 224 of 256 (the paper scripts'
# --image-size, `reproduce.running`).
REALITY_CHECK_RESIZE_PER_CROP = 256 / 227
PAPERS_RESIZE_PER_CROP = 256 / 224

# Fixed by the protocol, never an option: the training classes are split into this many
# cross-validation folds, one model each.
NUM_FOLDS = 4
# The protocol's score, PML's name for MAP@R: what tune maximises, a bench job's trial value,
# and the metric a row must beat the untrained networks on.
MAP_AT_R = "mean_average_precision_at_r"


@dataclasses.dataclass(frozen=True)
class Setting:
    """One budget key: its option, what it means, and its value in each preset."""

    key: str
    flag: str
    help: str
    glyphs: object
    reality_check: object
    type: Callable | None = None
    choices: tuple | None = None
    metavar: str | None = None
    switch: bool = False  # an option without a value that sets True (--random-init, --amp)
    command: str | None = None  # the one command that has the option (None: bench and tune)
    none_means: str = "none"  # what a preset's None stands for, in --help
    reality_check_on: dict = dataclasses.field(default_factory=dict)  # {data set: value} where it differs

    def preset_value(self, preset, dataset):
        if preset == "glyphs":
            return self.glyphs
        return self.reality_check_on.get(dataset, self.reality_check)

    def describe(self, value):
        """`value` as --help writes it."""
        if value is None:
            return self.none_means
        if isinstance(value, bool):
            return "yes" if value else "no"
        return f"{value:g}" if isinstance(value, float) else str(value)

    def help_text(self):
        """The help with each preset's value, read from this entry (never typed twice)."""
        exceptions = "".join(f", {self.describe(v)} on {d}" for d, v in self.reality_check_on.items())
        return (
            f"{self.help} (glyphs: {self.describe(self.glyphs)}; "
            f"reality-check: {self.describe(self.reality_check)}{exceptions})"
        )


# The glyph preset: 64 classes, 10 epochs x 60 iterations, Adam at 3e-3 annealed to zero by
# a cosine schedule, so that 2 cores run the default bench (15 trained rows x 3 seeds x 4
# folds) in under 10 minutes; twice the epochs gains 2 points on average, 3 rows beyond their
# 95% CI. With all 274 classes validation MAP@R was still rising after 3,000 iterations
# (examples/README.md, "Choosing the budget").
# The reality-check preset: Musgrave et al., A Metric Learning Reality Check (ECCV 2020),
# section 4: BN-Inception (torchvision has none: GoogLeNet with BatchNorm stands in) with
# frozen BatchNorm, 128-d, batches of 32 (8 classes x 4), RMSprop lr 1e-6 (weight decay
# 1e-4, momentum 0.9), random resized crops of 227 px (16-100% of the area) and flips,
# centre crop 227 of a 256 resize for evaluation, 100 iterations per epoch, up to 1000
# epochs with early stopping on validation MAP@R (patience 9; 39 on SOP), 50 search trials.
SETTINGS = (
    Setting(
        "protocol",
        "--protocol",
        f"reality-check: {NUM_FOLDS}-fold cross-validation over the first half of the classes, one model per "
        "fold, tested on the second half; standard: one model trained on the data set's training split for every "
        "epoch (no validation, no early stopping), tested on its test split (in-shop: query against gallery); "
        "the papers' image data sets only",
        REALITY_CHECK_PROTOCOL,
        REALITY_CHECK_PROTOCOL,
        choices=PROTOCOLS,
    ),
    Setting("trunk", "--trunk", "trunk network", "small-cnn", "bn-inception", choices=TRUNKS),
    Setting(
        "random_init",
        "--random-init",
        "train the trunk from random weights, no weights file needed (otherwise ImageNet's, from the torch "
        "cache; the small CNN has none)",
        True,
        False,
        switch=True,
    ),
    Setting(
        "freeze_batchnorm",
        "--freeze-batchnorm",
        "keep the trunk's BatchNorm statistics fixed",
        False,
        True,
        type=arguments.boolean,
        metavar="yes|no",
    ),
    Setting("embedding_size", "--embedding-size", "embedding dimension, >= 1", 64, 128, type=arguments.positive_int),
    Setting("epochs", "--epochs", "epochs per fold model, >= 1", 10, 1000, type=arguments.positive_int),
    Setting("iterations_per_epoch", "--iterations", "iterations per epoch, >= 1", 60, 100, type=arguments.positive_int),
    Setting(
        "batch_size",
        "--batch-size",
        "batch size; a multiple of 4 and >= 8 for the m=4 rows, even and >= 4 for the N-pair rows",
        32,
        32,
        type=arguments.positive_int,
    ),
    Setting(
        "samples_per_class",
        "--samples-per-class",
        "samples of each class in a batch, >= 2, for every row PML's MPerClassSampler batches (all but the rows "
        "that mine hard negative classes)",
        None,
        None,
        type=arguments.at_least(2),
        none_means="each row's own, 4 (2 for pml:NPairsLoss)",
    ),
    Setting(
        "class_mining",
        "--class-mining",
        "the N-pair rows (NPairsMCLoss, NPairsOVOLoss) choose a batch's classes by hard negative class mining "
        "with the network being trained; no: at random (PML's MPerClassSampler, 2 per class)",
        True,
        True,
        type=arguments.boolean,
        metavar="yes|no",
    ),
    Setting("optimizer", "--optimizer", "optimizer of the trunk and embedder", "adam", "rmsprop", choices=OPTIMIZERS),
    Setting("lr", "--lr", "learning rate, > 0", 3e-3, 1e-6, type=arguments.positive_float),
    Setting(
        "embedder_lr_factor",
        "--embedder-lr-factor",
        "the embedding layer trains at the learning rate times this, > 0 (a pretrained trunk's new layer "
        "learns faster; the small CNN has no separate embedding layer)",
        1.0,
        1.0,
        type=arguments.positive_float,
    ),
    Setting("weight_decay", "--weight-decay", "weight decay, >= 0", 0.0, 1e-4, type=arguments.non_negative_float),
    Setting("momentum", "--momentum", "rmsprop/sgd momentum, >= 0", 0.0, 0.9, type=arguments.non_negative_float),
    Setting(
        "lr_schedule",
        "--lr-schedule",
        "cosine: anneal the learning rate to zero over the epochs; constant: keep it",
        "cosine",
        "constant",
        choices=LR_SCHEDULES,
    ),
    Setting(
        "lr_drop",
        "--lr-drop",
        "after EPOCH epochs, multiply the learning rate by FACTOR (with the constant schedule)",
        None,
        None,
        type=arguments.epoch_and_factor,
        metavar="EPOCH:FACTOR",
    ),
    Setting(
        "patience",
        "--patience",
        "stop a fold model after this many epochs without a better validation MAP@R",
        None,
        9,
        type=arguments.positive_int,
        none_means="none",
        reality_check_on={"sop": 39},
    ),
    Setting(
        "num_classes",
        "--classes",
        "use the first N classes of the data set, or 'all'. Half are for training, split over "
        f"{NUM_FOLDS} folds; each fold model must hold a batch's classes (a refusal names the minimum)",
        64,
        ALL_CLASSES,
        type=arguments.class_count,
        metavar="N",
    ),
    Setting(
        "image_size",
        "--image-size",
        "training crop and evaluation centre crop in pixels, >= 16; image data sets only (the glyphs are "
        "used as they are)",
        None,
        227,
        type=arguments.at_least(16),
        none_means="the images as they are",
    ),
    Setting(
        "resize",
        "--resize",
        "pixels the images are resized to before cropping (the shorter side; crop-flip and none: a square), "
        ">= 16; image data sets only",
        None,
        None,
        type=arguments.at_least(16),
        none_means="the image size x 256/227",
    ),
    Setting(
        "augmentation",
        "--augmentation",
        "none: resize and centre crop only (the glyphs: as they are); random-resized-crop: 16-100%% of the "
        "area, and flips; crop-flip: a random crop of the square resize, and flips",
        "none",
        "random-resized-crop",
        choices=AUGMENTATIONS,
    ),
    Setting("amp", "--amp", "automatic mixed precision, float16 on CUDA", False, False, switch=True),
    Setting(
        "seeds",
        "--seeds",
        "repeated runs (seeds 0 to N-1) for the 95%% confidence intervals, >= 1; 1 gives no interval",
        3,
        3,
        type=arguments.positive_int,
        command="bench",
    ),
    Setting(
        "trials",
        "--trials",
        "finished trials each study should hold, >= 1; a rerun resumes to N",
        20,
        50,
        type=arguments.positive_int,
        command="tune",
    ),
)

SETTING_BY_KEY = {setting.key: setting for setting in SETTINGS}
PRESETS = {preset: {s.key: s.preset_value(preset, None) for s in SETTINGS} for preset in ("glyphs", "reality-check")}
GLYPHS, REALITY_CHECK = PRESETS["glyphs"], PRESETS["reality-check"]
# Without --preset: the glyph budget on the glyphs, the Reality Check on every image data set.
AUTO_PRESET = "auto"

# What makes two training budgets the same: a bench store and a tuning study hold runs of
# one budget only. Not the device index, the data root or the threads (several machines
# share one bench), nor the seeds or trials a command runs.
TRAINING_KEYS = ("dataset", *(s.key for s in SETTINGS if s.command is None), "num_folds")
# The keys that shape images: the glyphs are 32 x 32 tensors, used as they are.
IMAGE_KEYS = ("image_size", "resize", "augmentation")


class BudgetError(ValueError):
    """A budget that cannot be trained as stated. ``option`` is the command-line option at
    fault (``"--batch-size"``, ``"--classes"``); the message names it."""

    def __init__(self, option, message):
        super().__init__(f"argument {option}: {message}")
        self.option = option


def preset_for(dataset, preset=AUTO_PRESET):
    """The preset name a run on `dataset` uses when --preset is `preset`."""
    if preset != AUTO_PRESET:
        return preset
    return "glyphs" if dataset == "glyphs" else "reality-check"


def resolve(dataset="glyphs", preset=AUTO_PRESET, **given):
    """The effective budget: the preset's value of every key of `SETTINGS`, then every
    `given` value that is not None, then what follows from them (the resize from the image
    size, a random init for the small CNN, which has no pretrained weights; on the standard
    protocol no folds and no patience). Also holds ``dataset``, ``preset`` (its name) and
    ``num_folds`` (`NUM_FOLDS`; not an option: fewer folds only make tests faster). Raises
    `BudgetError` for a value that would not be applied (an image size on the glyphs, a
    learning rate drop on the cosine schedule, a momentum with Adam, a patience on the
    standard protocol)."""
    name = preset_for(dataset, preset)
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; available: {', '.join(PRESETS)}")
    unknown = sorted(set(given) - set(SETTING_BY_KEY) - {"num_folds"})
    if unknown:
        raise TypeError(f"budget: unknown keys {', '.join(unknown)}")
    given = {key: value for key, value in given.items() if value is not None}
    budget = {s.key: s.preset_value(name, dataset) for s in SETTINGS}
    budget.update(dataset=dataset, preset=name, num_folds=NUM_FOLDS)
    budget.update(given)
    if budget["trunk"] == "small-cnn":
        budget["random_init"] = True
    _apply_image_keys(budget, given)
    _check_learning_rates(budget)
    _apply_optimizer_keys(budget, given)
    if budget["protocol"] == STANDARD_PROTOCOL:
        _apply_standard_protocol(budget, given)
    return budget


def _apply_image_keys(budget, given):
    """Sets the image keys that follow (none on the glyphs, the resize from the image size);
    refuses those that cannot apply."""
    if budget["dataset"] == "glyphs":
        for key in IMAGE_KEYS:
            if given.get(key, "none") != "none":
                raise BudgetError(
                    SETTING_BY_KEY[key].flag,
                    f"{given[key]} cannot apply to the glyphs, 32 x 32 tensors used as they are "
                    "(image data sets only: cub200, cars196, sop, inshop, folder:PATH)",
                )
        budget.update(image_size=None, resize=None, augmentation="none")
    elif budget["image_size"] is not None and budget["resize"] is None:
        budget["resize"] = round(budget["image_size"] * REALITY_CHECK_RESIZE_PER_CROP)
    if budget["resize"] is not None and budget["image_size"] is None:
        raise BudgetError("--resize", f"{budget['resize']} needs an --image-size to crop to")
    if budget["resize"] is not None and budget["resize"] < budget["image_size"]:
        raise BudgetError("--resize", f"{budget['resize']} is smaller than the image size {budget['image_size']}")


def _check_learning_rates(budget):
    """Refuses a learning rate drop the schedule would override and an embedding layer
    factor without an embedding layer."""
    if budget["lr_drop"] is not None and budget["lr_schedule"] != "constant":
        epoch, factor = budget["lr_drop"]
        raise BudgetError(
            "--lr-drop",
            f"{epoch}:{factor:g} drops a constant learning rate, not the {budget['lr_schedule']} schedule's "
            "(give --lr-schedule constant)",
        )
    if budget["embedder_lr_factor"] != 1 and budget["trunk"] == "small-cnn":
        raise BudgetError(
            "--embedder-lr-factor", f"{budget['embedder_lr_factor']:g}: the small CNN has no separate embedding layer"
        )


def _apply_optimizer_keys(budget, given):
    """Adam has no momentum setting: a momentum given with it is refused, and the budget
    records the none it applies (the reality-check preset's 0.9 belongs to RMSprop)."""
    if budget["optimizer"] != "adam":
        return
    if given.get("momentum", 0) != 0:
        raise BudgetError(
            "--momentum", f"{given['momentum']:g}: Adam has no momentum setting (give --optimizer rmsprop or sgd)"
        )
    budget["momentum"] = 0.0


def _apply_standard_protocol(budget, given):
    """The standard protocol trains one model on every class of a data set's training split
    for every epoch: no folds, no validation set to stop early on. Refuses what it cannot
    apply."""
    dataset = budget["dataset"]
    if dataset not in DATASET_NAMES or dataset == "glyphs":
        papers = ", ".join(name for name in DATASET_NAMES if name != "glyphs")
        raise BudgetError(
            "--protocol", f"standard needs the papers' training and test splits ({papers}), not {dataset}"
        )
    for key in ("patience", "num_folds"):
        if key in given:
            raise BudgetError(
                SETTING_BY_KEY[key].flag if key in SETTING_BY_KEY else key,
                f"{given[key]}: the standard protocol trains one model for every epoch, without validation",
            )
    if budget["num_classes"] != ALL_CLASSES:
        raise BudgetError(
            "--classes", f"{budget['num_classes']}: the standard protocol trains on every class of the training split"
        )
    budget.update(num_folds=None, patience=None)


def budget_warnings(budget):
    """What a resolved budget will likely get wrong without being wrong: one line each."""
    rates = REALITY_CHECK["optimizer"], REALITY_CHECK["lr"]
    if budget["random_init"] and budget["preset"] == "reality-check" and (budget["optimizer"], budget["lr"]) == rates:
        return [
            f"{budget['trunk']} from random weights at the reality-check preset's {rates[0]} lr {rates[1]:g}, "
            "set for a pretrained trunk, learns next to nothing: give --lr (the glyphs preset: "
            f"{GLYPHS['optimizer']} lr {GLYPHS['lr']:g}) or drop --random-init"
        ]
    return []


def training_key(budget):
    """The budget's `TRAINING_KEYS`: what a result depends on (a bench's identity, a
    study's, a saved experiment's)."""
    return {key: budget.get(key) for key in TRAINING_KEYS}


def digest(value):
    """A short hex digest of a JSON-able value (key order does not matter)."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]


def add_setting_options(parser, command):
    """Adds `SETTINGS`' options of `command` ("bench" or "tune") to `parser` (an argparse
    parser), each stored under its budget key, None when not given (the preset decides)."""
    for s in SETTINGS:
        if s.command not in (None, command):
            continue
        if s.switch:
            parser.add_argument(s.flag, dest=s.key, action="store_const", const=True, help=s.help_text())
        else:
            metavar = s.metavar or (None if s.choices else s.flag.removeprefix("--").upper().replace("-", "_"))
            parser.add_argument(s.flag, dest=s.key, type=s.type, choices=s.choices, metavar=metavar, help=s.help_text())
    return parser


def given_settings(args):
    """``{key: value}`` of every setting option the parsed `args` hold (None: not given)."""
    return {s.key: getattr(args, s.key, None) for s in SETTINGS}


# The tuned parameters `pml-rank bench` uses by default on the glyphs (`--untuned`: the
# papers' defaults), made by the `pml-rank tune` run recorded inside the file.
SHIPPED_PARAMS = Path(__file__).with_name("tuned_glyphs.json")

# `pml-rank bench` without row names: every registered loss and these of PML's baselines
# (`pml-rank bench --list` shows the others).
DEFAULT_BASELINES = ("pml:ContrastiveLoss", "pml:TripletMarginLoss", "pml:FastAPLoss", "pml:NPairsLoss")

# The data sets `--dataset` names (cub200-cropped: CUB-200-2011 cropped to the birds' boxes, the AUC
# paper's table 2); `folder:PATH` is a user's own images.
DATASET_NAMES = ("glyphs", "cub200", "cub200-cropped", "cars196", "sop", "inshop")
FOLDER_PREFIX = "folder:"


def dataset_argument(text):
    """``--dataset``'s argparse type: the data set's name as the harness writes it
    (``folder:`` with an absolute path); an unknown name or a folder that does not exist is
    an `argparse.ArgumentTypeError`."""
    if text.startswith(FOLDER_PREFIX):
        path = Path(text[len(FOLDER_PREFIX) :]).expanduser()
        if not path.is_dir():
            raise argparse.ArgumentTypeError(
                f"{text!r}: no such folder (folder:PATH names a folder with one subfolder per class)"
            )
        return FOLDER_PREFIX + str(path.resolve())
    if text not in DATASET_NAMES:
        raise argparse.ArgumentTypeError(
            f"unknown data set {text!r}; available: {', '.join(DATASET_NAMES)}, folder:PATH"
        )
    return text


# `pml-rank speed`'s sizes when the command line names none: batch sizes, except for the
# losses listed, whose sizes mean something else (RaMBOAPLoss: scores in one sequence).
# Defined here, in a module without torch, so that `pml-rank speed --help` shows them;
# speed.py runs with them.
SPEED_DEFAULT_SIZES = (512, 1024, 2048)
SPEED_DEFAULT_SIZES_PER_LOSS = {"RaMBOAPLoss": (100_000, 1_000_000)}


def fold_training_classes(num_classes, num_folds=NUM_FOLDS):
    """Classes the smallest fold model of the Reality Check protocol trains on, with
    `num_classes` classes in all: half of them are the training classes, and each fold
    leaves one of `num_folds` contiguous partitions out for validation
    (`evaluation.splits.class_partitions`); 0 when there are too few to split."""
    training = num_classes // 2
    if training < num_folds:
        return 0
    largest_partition = max(training * (k + 1) // num_folds - training * k // num_folds for k in range(num_folds))
    return training - largest_partition


def minimum_classes(per_class, batch_size, num_folds=NUM_FOLDS):
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
