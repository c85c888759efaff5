"""Every check that can refuse an experiment before any training: the batch size against
the rows and the classes (`check_rows`, reading nothing), then the trunk's weights and the
data set's files (`check`)."""

import numpy as np
from PIL import Image

from . import backbones, recipes
from .budget import STANDARD_PROTOCOL, BudgetError, class_count
from .datasets import DataError, data_root_missing, needs_data_root
from .experiment import dataset_of, standard_splits


def items_per_model(budget, data):
    """Training items of one model of the budget's protocol on `data` (what `check`
    returned): the standard protocol's training split, or a fold's share of the Reality
    Check's training half."""
    if budget["protocol"] == STANDARD_PROTOCOL:
        return len(data.train)
    folds = budget["num_folds"]
    return len(data) // 2 * (folds - 1) // folds


def check_rows(budget, row_recipes, validation_only=False):
    """Refuses (`budget.BudgetError`) a batch size that the rows `row_recipes` (``{row:
    Recipe}`` with the budget's batches, the rows that train) cannot make, and a number of
    classes too small for them when the budget gives one; ``validation_only`` (tuning, which
    scores validation folds): the standard protocol, which has none. Reads nothing, so it
    runs first; `check` does the rest."""
    standard = budget["protocol"] == STANDARD_PROTOCOL
    if standard and validation_only:
        raise BudgetError("--protocol", "standard: tuning scores validation folds, which only reality-check has")
    recipes.check_budget(
        row_recipes, budget["batch_size"], None if standard else budget["num_classes"], budget["num_folds"]
    )


def check(budget, row_recipes, machine):
    """Everything else that can refuse an experiment of the rows `row_recipes` (``{row:
    Recipe}``, checked by `check_rows`), before any training: the trunk's weights
    (`backbones.WeightsNotFoundError`), the data set (files, images, classes with fewer
    than 2 images: `datasets.DataError`) and, when the budget takes all its classes or on
    the standard protocol's training split, their number for the rows (`budget.BudgetError`).
    Returns the loaded data set (on the standard protocol, its `evaluation.StandardSplits`)."""
    standard = budget["protocol"] == STANDARD_PROTOCOL
    if budget["trunk"] != "small-cnn" and not budget["random_init"]:
        backbones.require_weights(budget["trunk"])
    if standard:
        splits = standard_splits(budget, machine)
        _check_training_classes(row_recipes, budget["batch_size"], splits.train)
        return splits
    if needs_data_root(budget["dataset"]) and machine.data_root is None:
        raise data_root_missing(budget["dataset"])
    try:
        data = dataset_of(budget, machine)
    except ValueError as error:
        # load_glyphs says "num_classes", `FirstClasses` "--classes"; a `DataError` is about the files.
        if isinstance(error, DataError) or class_count(budget["num_classes"]) is None or "classes" not in str(error):
            raise
        raise BudgetError("--classes", str(error).removeprefix("--classes ")) from None
    if class_count(budget["num_classes"]) is None:  # all the classes: their number is known only now
        recipes.check_budget(row_recipes, budget["batch_size"], len(np.unique(data.labels)), budget["num_folds"])
    if budget["dataset"] != "glyphs" and budget["image_size"] is None:
        _check_one_image_size(budget["dataset"], data)
    return data


def _check_training_classes(row_recipes, batch_size, train_set):
    """Raises `BudgetError` unless the standard protocol's training split holds the classes
    of a batch of every row."""
    classes = len(np.unique(np.asarray(train_set.labels)))
    for name, recipe in row_recipes.items():
        needed = batch_size // (recipe.per_class or batch_size)
        if needed > classes:
            raise BudgetError(
                "--batch-size", f"{batch_size}: a batch of {name} holds {needed} classes, the training split {classes}"
            )


def _image_paths(data):
    if hasattr(data, "paths"):
        return list(data.paths)
    if hasattr(data, "indices") and hasattr(data.dataset, "paths"):  # `datasets.FirstClasses`
        return [data.dataset.paths[i] for i in data.indices]
    return None


def _check_one_image_size(dataset, data):
    """Without an image size, images are used as they are and a batch stacks them: raises
    `BudgetError` unless they all have one size (read from the files' headers)."""
    paths = _image_paths(data)
    advice = "give --image-size N (they are resized to N x 256/227 and centre-cropped to N)"
    if paths is None:
        raise BudgetError("--image-size", f"{dataset}'s photographs differ in size; {advice}")
    sizes = {}
    for path in paths:
        with Image.open(path) as image:
            sizes.setdefault(image.size, path)
        if len(sizes) > 1:
            (first, a), (second, b) = sizes.items()
            raise BudgetError(
                "--image-size",
                f"the images differ in size ({first[0]}x{first[1]} {a}, {second[0]}x{second[1]} {b}) "
                f"and no image size was given (the glyphs preset uses images as they are); {advice}",
            )
