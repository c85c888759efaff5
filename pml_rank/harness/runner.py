"""The experiment runner: data set x trunk x budget x recipe (row and parameters) x seed ->
the budget's protocol (the Reality Check's fold models, or the standard protocol's one model)
-> metrics. `pml-rank bench` runs many experiments as jobs, `pml-rank tune` scores parameters
with the Reality Check's fold loop on the validation classes only, and the example scripts
call it with the papers' setups.

`run` runs one experiment in the calling process. Its parts, one job a module, are
re-exported here for its callers: what an experiment is made of (`experiment`), the checks
before any training (`checks`), its saved models (`saved_models`).
"""

import json
import shutil
import time

from . import recipes
from .budget import STANDARD_PROTOCOL, BudgetError
from .checks import check as check
from .checks import check_rows as check_rows
from .checks import items_per_model as items_per_model
from .datasets import image_transforms
from .evaluation import METRICS, TrainingConfig, raw_input_accuracy, run_protocol, run_standard_protocol
from .experiment import STANDARD_CHANNELS, Machine, dataset_of, model_factories, standard_splits, transforms_of
from .saved_models import _start_partial_folder, models_folder
from .saved_models import load_models as load_models
from .saved_models import load_reference_set as load_reference_set
from .saved_models import load_test_set as load_test_set

RAW_INPUT = "raw input"
UNTRAINED = "untrained"


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


def rows_without_training(budget):
    """The reference rows of a bench: the raw pixels (on the Reality Check protocol, only
    where the images are used as they are, "none" augmentation: cropped photographs' pixels
    would not fit in memory) and the untrained networks."""
    raw = budget["augmentation"] == "none" and budget["protocol"] != STANDARD_PROTOCOL
    return [RAW_INPUT, UNTRAINED] if raw else [UNTRAINED]


def untrained_budget(budget):
    """The budget of the `UNTRAINED` row: `budget` with no epoch, the same protocol measuring
    the networks as they were initialised."""
    return {**budget, "epochs": 0}


def recipe_of(budget, row, params=None):
    """The `Recipe` `run` trains `row` with: the row's, with its `params`
    (`recipes.with_params`) and the budget's batches (`recipes.with_batches`)."""
    if row == UNTRAINED:  # trained for no epoch (`untrained_budget`): no loss is ever called
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
    `seed` (and the device's arithmetic), not on the number of loader processes: an image's
    random augmentation is drawn from the seed and its place in the training, in whichever
    process decodes it. One exception: a sampler that mines with the network being trained
    (the N-pair rows' hard negative classes) mines the batches that loader processes read
    ahead of the steps with the network of an earlier step. The budget's protocol decides what trains: the
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
        # Searched where the experiment runs: on a GPU machine, a bench on its CPU cores (--device cpu)
        # searches with faiss on the CPU, as a CPU machine does, not on the GPU torch sees.
        raw = raw_input_accuracy(data, transforms[1] if transforms else None, device=machine.device)
        seconds = time.perf_counter() - started
        return {"run": {"concatenated": raw, "separated": raw}, "histories": [], "best_epochs": [], "seconds": seconds}
    if row == UNTRAINED:
        budget = untrained_budget(budget)
    recipe = recipe_of(budget, row, params)
    channels = STANDARD_CHANNELS if standard else data.channels
    make_trunk, make_embedder = model_factories(budget, channels)
    final = partial = None
    if machine.models_dir is not None and budget["epochs"] > 0 and not validation_only:
        final = models_folder(machine.models_dir, budget, row, params, seed)
        partial = _start_partial_folder(final)
    config = TrainingConfig.from_budget(budget, machine.device, machine.loader_workers)
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
