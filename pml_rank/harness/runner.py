"""The experiment runner: data set x trunk x budget x recipe (row and parameters) x seed ->
the budget's protocol (the Reality Check's fold models, or the standard protocol's one model)
-> metrics. `pml-rank bench` runs many experiments as jobs, `pml-rank tune` scores parameters
with the Reality Check's fold loop on the validation classes only, and the example scripts
call it with the papers' setups.

`check_rows` and `check` do every check that can fail before any training (the batch size
against the rows and the classes, then the trunk's weights and the data set's files); `run`
runs one experiment in the calling process.
"""

import dataclasses
import functools
import json
import os
import shutil
import socket
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from pytorch_metric_learning.utils import common_functions as c_f

from . import backbones, recipes
from .budget import STANDARD_PROTOCOL, BudgetError, class_count, digest, training_key
from .data import SmallCNN, real
from .data.glyphs import DEFAULT_CACHE_DIR
from .datasets import DataError, Transformed, data_root_missing, image_transforms, load_dataset, needs_data_root
from .evaluation import (
    METRICS,
    STANDARD_MODEL,
    StandardSplits,
    TrainingConfig,
    raw_input_accuracy,
    run_protocol,
    run_standard_protocol,
    test_set_and_folds,
)

RAW_INPUT = "raw input"
UNTRAINED = "untrained"
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


def models_folder(models_dir, budget, row, params, seed):
    """Where `run` keeps an experiment's fold models and record-keeper logs:
    ``<models_dir>/<row>/<digest of budget and params>/seed<k>`` (``:`` in a row name
    becomes ``_``), so experiments of other budgets or parameters never share a folder."""
    setup = digest({"budget": training_key(budget), "params": params})
    return Path(models_dir) / row.replace(":", "_") / setup / f"seed{seed}"


def _pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _start_partial_folder(final):
    """A fresh folder beside `final` for this process to train into (renamed to `final`
    when the experiment completes); removes what dead processes of this host left there."""
    host = socket.gethostname()
    for stale in final.parent.glob(f"{final.name}.partial-{host}-*"):
        pid = stale.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not _pid_alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)
    partial = final.parent / f"{final.name}.partial-{host}-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    return partial


class ChannelsToRGB(torch.nn.Module):
    """Repeats a single-channel image three times, for ImageNet trunks on grayscale sets."""

    def forward(self, images):
        return images.expand(-1, 3, -1, -1) if images.shape[1] == 1 else images


def model_factories(budget, channels, load_weights=True):
    """``(make_trunk, make_embedder)`` for the budget's trunk on images of `channels`
    channels; `make_embedder` is None for the small CNN, which embeds by itself.
    ``load_weights=False``: the same networks without reading ImageNet weights."""
    name, size = budget["trunk"], budget["embedding_size"]
    if name == "small-cnn":
        return (lambda: SmallCNN(embedding_size=size, in_channels=channels)), None
    features = backbones.BACKBONES[name].features

    def make_trunk():
        trunk = backbones.build_trunk(name, pretrained=not budget["random_init"], load_weights=load_weights)
        return trunk if channels == 3 else torch.nn.Sequential(ChannelsToRGB(), trunk)

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


def recipes_for(budget, rows):
    """``{row: Recipe}`` of the rows (neither `RAW_INPUT` nor `UNTRAINED`) with the
    budget's batches (`with_budget_batches`)."""
    return with_budget_batches(budget, recipes.rows([r for r in rows if r not in (RAW_INPUT, UNTRAINED)]))


def with_budget_batches(budget, row_recipes):
    """``{row: Recipe}`` of `row_recipes` (``{row: Recipe}``) with the budget's samples per class
    and class mining (`recipes.with_batches`)."""
    return {
        row: recipes.with_batches(recipe, budget["samples_per_class"], budget["class_mining"])
        for row, recipe in row_recipes.items()
    }


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


def rows_without_training(budget):
    """The reference rows of a bench: the raw pixels (on the Reality Check protocol, only
    where the images are used as they are, "none" augmentation: cropped photographs' pixels
    would not fit in memory) and the untrained networks."""
    raw = budget["augmentation"] == "none" and budget["protocol"] != STANDARD_PROTOCOL
    return [RAW_INPUT, UNTRAINED] if raw else [UNTRAINED]


def recipe_of(budget, row, params=None):
    """The `Recipe` `run` trains `row` with: the row's, with its `params`
    (`recipes.with_params`) and the budget's batches (`recipes.with_batches`)."""
    if row == UNTRAINED:  # the same protocol with zero epochs (no loss is ever called)
        return recipes.Recipe(make_loss=lambda: None, name=UNTRAINED)
    recipe = recipes.with_params(recipes.rows([row])[row], params)
    return recipes.with_batches(recipe, budget["samples_per_class"], budget["class_mining"])


def run(
    budget, row, params, seed, machine=Machine(), on_iteration=None, validation_only=False, on_fold=None, metrics=None
):
    """One experiment; returns ``{"run": {"concatenated": {metric: value}, "separated":
    {...}}, "histories": [fold histories], "best_epochs": [...], "seconds": ...}`` (with
    ``validation_only``: ``"validation"``, each fold model's best validation accuracies,
    in place of ``"run"``). The result depends only on `budget`, `row`, `params` and
    `seed` (and the device's arithmetic). The budget's protocol decides what trains: the
    Reality Check's fold models, measured on `evaluation.METRICS`, or the standard
    protocol's one model (``concatenated`` and ``separated`` are then its values, of
    `metrics`: names as `evaluation.accuracy` takes them, default `evaluation.METRICS`).
    With ``machine.models_dir``, a trained experiment keeps its models and logs in
    `models_folder` (``fold<k>/models``: PML's ``trunk_best<epoch>.pth`` and
    ``embedder_best<epoch>.pth``, the models it measured; standard: ``model/models``, the
    last epoch's), which appears only once the experiment is complete (a failure after
    training leaves the models in a ``.partial-*`` folder beside it)."""
    started = time.perf_counter()
    standard = budget["protocol"] == STANDARD_PROTOCOL
    if standard and (row == RAW_INPUT or validation_only):
        raise BudgetError("--protocol", "standard: raw input rows and validation runs are the Reality Check's")
    if not standard and metrics not in (None, METRICS):
        raise ValueError(f"metrics {metrics}: the Reality Check protocol measures {', '.join(METRICS)}")
    data = None if standard else dataset_of(budget, machine)
    transforms = None if standard else transforms_of(budget, data)
    if row == RAW_INPUT:
        raw = raw_input_accuracy(data, transforms[1] if transforms else None)
        seconds = time.perf_counter() - started
        return {"run": {"concatenated": raw, "separated": raw}, "histories": [], "best_epochs": [], "seconds": seconds}
    recipe, epochs = recipe_of(budget, row, params), 0 if row == UNTRAINED else budget["epochs"]
    channels = STANDARD_CHANNELS if standard else data.channels
    make_trunk, make_embedder = model_factories(budget, channels)
    final = partial = None
    if machine.models_dir is not None and epochs > 0 and not validation_only:
        final = models_folder(machine.models_dir, budget, row, params, seed)
        partial = _start_partial_folder(final)
    config = dataclasses.replace(
        TrainingConfig.from_budget(budget, machine.device, machine.loader_workers), epochs=epochs
    )
    common = dict(
        make_embedder=make_embedder,
        seed=seed,
        on_iteration=on_iteration,
        folder=None if partial is None else str(partial),
    )
    if standard:
        splits = standard_splits(budget, machine, image_transforms(budget, channels))
        result = run_standard_protocol(splits, recipe, make_trunk, config, metrics=metrics or METRICS, **common)
    else:
        result = run_protocol(
            data,
            recipe,
            make_trunk,
            config,
            transforms=transforms,
            validation_only=validation_only,
            on_fold=on_fold,
            **common,
        )
    if partial is not None:
        record = {"row": row, "seed": seed, "params": params, "budget": budget, "channels": channels}
        (partial / "experiment.json").write_text(json.dumps(record, indent=2, sort_keys=True, default=str) + "\n")
        if final.exists():  # the same experiment, run again because it was never recorded as finished
            shutil.rmtree(final)
        partial.rename(final)
    outcome = {"histories": result.histories, "best_epochs": result.best_epochs}
    if validation_only:
        outcome["validation"] = result.per_model
    else:
        outcome["run"] = {"concatenated": result.concatenated, "separated": result.separated}
    outcome["seconds"] = time.perf_counter() - started
    return outcome


def load_models(folder, device="cpu"):
    """The models `run` kept in `folder` (a `models_folder`): ``[(trunk, embedder)]``, in
    fold order, each at its best epoch (the models the experiment measured; the standard
    protocol's one model at its last epoch), in eval mode on `device`. Needs no pretrained
    weights: the architecture comes from the folder's ``experiment.json``, the weights from
    its files."""
    folder = Path(folder)
    record = json.loads((folder / "experiment.json").read_text())
    make_trunk, make_embedder = model_factories(record["budget"], record["channels"], load_weights=False)
    standard = record["budget"].get("protocol") == STANDARD_PROTOCOL
    folds = sorted(folder.glob("fold*"), key=lambda path: int(path.name.removeprefix("fold")))
    models = []
    for model_folder in [folder / STANDARD_MODEL] if standard else folds:
        pair = {"trunk": make_trunk(), "embedder": make_embedder() if make_embedder else torch.nn.Identity()}
        # As PML's hooks load the best models after training (`load_latest_saved_models`).
        _, suffix = c_f.latest_version(str(model_folder / "models"), "trunk_*.pth", best=not standard)
        c_f.load_dict_of_models(pair, suffix, str(model_folder / "models"), device, assert_success=True)
        models.append((pair["trunk"].to(device).eval(), pair["embedder"].to(device).eval()))
    return models


def load_test_set(folder, data_root=None, cache_dir=None):
    """The test set of the experiment saved in `folder` (a `models_folder`) exactly as `run`
    evaluated its models: the test classes of the budget's data set, in the same order,
    through the same evaluation transform; items ``(image tensor, label)``, ``labels`` an
    array (the standard protocol's: its query split, retrieved among `load_reference_set`
    on in-shop). A ``folder:`` data set is read from the path the bench recorded, the
    papers' from `data_root`, the glyphs from `cache_dir`. Every image is checked as the
    bench does."""
    budget, machine = _saved_budget(folder, data_root, cache_dir)
    if budget.get("protocol") == STANDARD_PROTOCOL:
        return _saved_standard_splits(budget, machine).query
    data = dataset_of(budget, machine)
    _, test_set = test_set_and_folds(data, budget["num_folds"], transforms_of(budget, data))
    return test_set


def load_reference_set(folder, data_root=None, cache_dir=None):
    """What `load_test_set`'s items were retrieved among when it is another set, in the same
    form: in-shop's gallery on the standard protocol. None where each test item is retrieved
    among the other test items (every other data set and protocol), without loading them."""
    budget, machine = _saved_budget(folder, data_root, cache_dir)
    if budget.get("protocol") != STANDARD_PROTOCOL:
        return None
    return _saved_standard_splits(budget, machine).reference


def _saved_budget(folder, data_root, cache_dir):
    """``(budget, Machine)`` of the experiment saved in `folder`; refuses a papers' data set
    without `data_root`."""
    budget = json.loads((Path(folder) / "experiment.json").read_text())["budget"]
    if needs_data_root(budget["dataset"]) and data_root is None:
        raise data_root_missing(budget["dataset"])
    return budget, Machine(data_root=data_root, cache_dir=cache_dir)


def _saved_standard_splits(budget, machine):
    return standard_splits(budget, machine, image_transforms(budget, STANDARD_CHANNELS))
