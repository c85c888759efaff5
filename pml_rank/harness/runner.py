"""The experiment runner: data set x trunk x budget x recipe (row and parameters) x seed ->
the Reality Check's fold models -> metrics. `pml-rank bench` runs many experiments as jobs,
`pml-rank tune` scores parameters with the same fold loop on the validation classes only,
and the example scripts call it with the papers' setups.

`check_rows` and `check` do every check that can fail before any training (the batch size
against the rows and the classes, then the trunk's weights and the data set's files); `run`
runs one experiment in the calling process.
"""

import dataclasses
import json
import os
import shutil
import socket
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from . import backbones, recipes
from .budget import BudgetError, class_count, digest, training_key
from .data import SmallCNN
from .datasets import DataError, data_root_missing, image_transforms, load_dataset, needs_data_root
from .evaluation import TrainingConfig, raw_input_accuracy, run_protocol, test_set_and_folds

RAW_INPUT = "raw input"
UNTRAINED = "untrained"


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


def check_rows(budget, row_recipes):
    """Refuses (`budget.BudgetError`) a batch size that the rows `row_recipes` (``{row:
    Recipe}``, the rows that train) cannot make, and a number of classes too small for them
    when the budget gives one. Reads nothing, so it runs first; `check` does the rest."""
    recipes.check_budget(row_recipes, budget["batch_size"], budget["num_classes"], budget["num_folds"])


def check(budget, row_recipes, machine):
    """Everything else that can refuse an experiment of the rows `row_recipes` (``{row:
    Recipe}``, checked by `check_rows`), before any training: the trunk's weights
    (`backbones.WeightsNotFoundError`), the data set (files, images, classes with fewer
    than 2 images: `datasets.DataError`) and, when the budget takes all its classes, their
    number for the rows (`budget.BudgetError`). Returns the loaded data set."""
    if budget["trunk"] != "small-cnn" and not budget["random_init"]:
        backbones.require_weights(budget["trunk"])
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
    """The reference rows of a bench: the raw pixels (only where the images are used as
    they are, "none" augmentation: cropped photographs' pixels would not fit in memory)
    and the untrained networks."""
    return [RAW_INPUT, UNTRAINED] if budget["augmentation"] == "none" else [UNTRAINED]


def run(budget, row, params, seed, machine=Machine(), on_iteration=None, validation_only=False, on_fold=None):
    """One experiment; returns ``{"run": {"concatenated": {metric: value}, "separated":
    {...}}, "histories": [fold histories], "best_epochs": [...], "seconds": ...}`` (with
    ``validation_only``: ``"validation"``, each fold model's best validation accuracies,
    in place of ``"run"``). The result depends only on `budget`, `row`, `params` and
    `seed` (and the device's arithmetic). With ``machine.models_dir``, a trained experiment
    keeps each fold's models and logs in `models_folder` (``fold<k>/models``: PML's
    ``trunk_best<epoch>.pth`` and ``embedder_best<epoch>.pth``, the models it measured),
    which appears only once the experiment is complete."""
    started = time.perf_counter()
    data = dataset_of(budget, machine)
    transforms = transforms_of(budget, data)
    if row == RAW_INPUT:
        raw = raw_input_accuracy(data, transforms[1] if transforms else None)
        seconds = time.perf_counter() - started
        return {"run": {"concatenated": raw, "separated": raw}, "histories": [], "best_epochs": [], "seconds": seconds}
    if row == UNTRAINED:  # the same protocol with zero epochs (no loss is ever called)
        recipe, epochs = recipes.Recipe(make_loss=lambda: None, name=UNTRAINED), 0
    else:
        recipe, epochs = recipes.with_params(recipes.rows([row])[row], params), budget["epochs"]
    make_trunk, make_embedder = model_factories(budget, data.channels)
    final = partial = None
    if machine.models_dir is not None and epochs > 0 and not validation_only:
        final = models_folder(machine.models_dir, budget, row, params, seed)
        partial = _start_partial_folder(final)
    config = TrainingConfig.from_budget(budget, machine.device, machine.loader_workers)
    result = run_protocol(
        data,
        recipe,
        make_trunk,
        dataclasses.replace(config, epochs=epochs),
        make_embedder=make_embedder,
        seed=seed,
        transforms=transforms,
        on_iteration=on_iteration,
        validation_only=validation_only,
        on_fold=on_fold,
        folder=None if partial is None else str(partial),
    )
    if partial is not None:
        record = {"row": row, "seed": seed, "params": params, "budget": budget, "channels": data.channels}
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
    """The fold models `run` kept in `folder` (a `models_folder`): ``[(trunk, embedder)]``
    in fold order, each at its best epoch (the models the experiment measured), in eval mode
    on `device`. Needs no pretrained weights: the architecture comes from the folder's
    ``experiment.json``, the weights from its files."""
    from pytorch_metric_learning.utils import common_functions as c_f

    folder = Path(folder)
    record = json.loads((folder / "experiment.json").read_text())
    make_trunk, make_embedder = model_factories(record["budget"], record["channels"], load_weights=False)
    models = []
    for fold in sorted(folder.glob("fold*"), key=lambda path: int(path.name.removeprefix("fold"))):
        pair = {"trunk": make_trunk(), "embedder": make_embedder() if make_embedder else torch.nn.Identity()}
        # As PML's hooks load the best models after training (`load_latest_saved_models`).
        _, best = c_f.latest_version(str(fold / "models"), "trunk_*.pth", best=True)
        c_f.load_dict_of_models(pair, best, str(fold / "models"), device, assert_success=True)
        models.append((pair["trunk"].to(device).eval(), pair["embedder"].to(device).eval()))
    return models


def load_test_set(folder, data_root=None, cache_dir=None):
    """The test set of the experiment saved in `folder` (a `models_folder`) exactly as `run`
    evaluated its models: the test classes of the budget's data set, in the same order,
    through the same evaluation transform; items ``(image tensor, label)``, ``labels`` an
    array. A ``folder:`` data set is read from the path the bench recorded, the papers' from
    `data_root`, the glyphs from `cache_dir`. Every image is checked as the bench does."""
    budget = json.loads((Path(folder) / "experiment.json").read_text())["budget"]
    if needs_data_root(budget["dataset"]) and data_root is None:
        raise data_root_missing(budget["dataset"])
    data = dataset_of(budget, Machine(data_root=data_root, cache_dir=cache_dir))
    _, test_set = test_set_and_folds(data, budget["num_folds"], transforms_of(budget, data))
    return test_set
