"""The rows of `pml-rank bench` and `pml-rank tune`, as `evaluation.Recipe`s by row name.

Registered losses (pml-rank's and any plugin's, by their registry name) get their paper's
miner and sampler from `PAPER_RECIPES`; any other registered loss trains with PML's
`MPerClassSampler` (4 per class) and no miner, like the Reality Check paper's embedding
losses. PML's own losses are ``pml:<Name>`` rows (`baselines.BASELINES`: the Reality Check's
baselines with their miners, search spaces and loss optimizers).

A row trains with a flat ``params`` dict (tuned.json, the bench's jobs): plain keys go to
the loss's constructor, ``miner_<name>`` keys to its miner's, ``loss_lr`` sets the
learning rate of the loss's own optimizer (losses with parameters: proxies, class weights).
"""

import dataclasses
import functools
import math

from ..plugins import registry
from ..samplers import HardNegativeClassSampler
from . import baselines
from .budget import DEFAULT_BASELINES, NUM_FOLDS, BudgetError, class_count, fold_training_classes, minimum_classes
from .evaluation import Recipe
from .evaluation.training import default_sampler


def m_per_class(m):
    """Sampler factory: PML's `MPerClassSampler`, `m` samples of each class per batch."""

    def make(train_set, batch_size, **_):
        return default_sampler(train_set.labels, batch_size, m_per_class=m)

    return make


def hard_negative_classes(train_set, batch_size, model, device, iterations_per_epoch, seed, **_):
    """N-pair batches (N classes x 2) by hard negative class mining with the network being
    trained (`pml_rank.samplers.HardNegativeClassSampler`)."""
    sampler = HardNegativeClassSampler(
        train_set.labels, classes_per_batch=batch_size // 2, batches_per_epoch=iterations_per_epoch, seed=seed
    )
    sampler.attach(model, train_set, device=device)
    return sampler


def batch_hard_miner():
    from pytorch_metric_learning import miners

    return miners.BatchHardMiner()


# The paper's miner and sampler for pml-rank's own losses. Losses not named here train
# with 4 samples per class and no miner.
PAPER_RECIPES = {
    "AUCLoss": dict(make_miner=batch_hard_miner, batches="m=4 per class, BatchHardMiner", per_class=4),
    "FastAPLoss": dict(batches="m=4 per class", per_class=4),
    "NPairsMCLoss": dict(
        make_sampler=hard_negative_classes, batches="N classes x 2, hard negative classes", per_class=2
    ),
    "NPairsOVOLoss": dict(
        make_sampler=hard_negative_classes, batches="N classes x 2, hard negative classes", per_class=2
    ),
    "RaMBOAPLoss": dict(batches="m=4 per class, score memory", per_class=4),
    "RaMBORecallLoss": dict(batches="m=4 per class, score memory", per_class=4),
}
DEFAULT_RECIPE = dict(batches="m=4 per class", per_class=4)


def _registered(name, cls):
    return Recipe(make_loss=cls, name=name, **PAPER_RECIPES.get(name, DEFAULT_RECIPE))


def _baseline(row, params=None):
    spec = baselines.get(row)
    _, miner_kwargs, loss_lr = baselines.split_params(row, params)  # checks them before any work

    def make_loss(num_classes=None, embedding_size=None):
        return baselines.build(row, params, num_classes, embedding_size)[0]

    def make_miner():
        from pytorch_metric_learning import miners

        return getattr(miners, spec.miner)(**miner_kwargs)

    return Recipe(
        make_loss=make_loss,
        make_miner=make_miner if spec.miner else None,
        make_sampler=m_per_class(spec.per_class),
        name=row,
        batches=spec.batches,
        per_class=spec.per_class,
        loss_needs=spec.needs,
        loss_lr=loss_lr,
        loss_weight_decay=spec.loss_weight_decay,
    )


def available():
    """Every row name: registered losses, then PML's baselines."""
    return [*sorted(registry.losses()), *baselines.BASELINES]


# Registered losses that are another loss's ablation (SupAP is ROADMAP without its calibration):
# benched on request, so that the default bench stays within its time.
ABLATIONS = ("SupAPLoss",)


def default_rows():
    """The rows of `pml-rank bench` without arguments: every registered loss but the
    ablations, then the default baselines."""
    return [*(name for name in sorted(registry.losses()) if name not in ABLATIONS), *DEFAULT_BASELINES]


def rows(names=None):
    """``{row name: Recipe}`` for `names` (default: `default_rows`), in that order. Raises
    KeyError naming the unknown rows and the available ones."""
    names = default_rows() if names is None else list(names)
    losses = registry.losses()
    unknown = [n for n in names if n not in losses and n not in baselines.BASELINES]
    if unknown:
        raise KeyError(f"unknown loss {', '.join(unknown)}; available: {', '.join(available())}")
    return {n: _registered(n, losses[n]) if n in losses else _baseline(n) for n in names}


def with_params(recipe, params):
    """`recipe` built with the row's flat `params` (see the module's docstring)."""
    if recipe.name in baselines.BASELINES:
        return _baseline(recipe.name, params)
    params = dict(params or {})
    loss_lr = params.pop("loss_lr", None)
    miner_params = {k[len("miner_") :]: params.pop(k) for k in list(params) if k.startswith("miner_")}
    changes = dict(make_loss=functools.partial(recipe.make_loss, **params))
    if miner_params:
        if recipe.make_miner is None:
            raise ValueError(f"{recipe.name}: has no miner, got {', '.join('miner_' + k for k in miner_params)}")
        changes["make_miner"] = functools.partial(recipe.make_miner, **miner_params)
    if loss_lr is not None:
        changes["loss_lr"] = float(loss_lr)
    return dataclasses.replace(recipe, **changes)


def with_batches(recipe, samples_per_class=None, class_mining=True):
    """`recipe` with the batches a budget asks for: without `class_mining`, a row that mines
    hard negative classes (the N-pair rows) draws them at random, 2 per class (PML's
    `MPerClassSampler`); `samples_per_class` gives every other row PML's sampler with that
    many of each class (None: the row's own)."""
    if recipe.make_sampler is hard_negative_classes:
        if class_mining:
            return recipe
        return dataclasses.replace(recipe, make_sampler=m_per_class(2), batches="N classes x 2, random classes")
    if samples_per_class is None:
        return recipe
    return dataclasses.replace(
        recipe,
        make_sampler=m_per_class(samples_per_class),
        per_class=samples_per_class,
        batches=f"m={samples_per_class} per class",
    )


def search_spaces():
    """``{row name: space(trial) -> params}``: the plugins' spaces and the baselines'."""
    return {**registry.search_spaces(), **{row: spec.space for row, spec in baselines.BASELINES.items()}}


def default_params(row):
    """The params of a row's paper defaults, as its search space names them: what the
    first trial of a study tries. Registered losses: {} (their constructors' defaults)."""
    if row in baselines.BASELINES:
        spec = baselines.BASELINES[row]
        return {**spec.defaults, **{f"miner_{k}": v for k, v in spec.miner_defaults.items()}}
    return {}


def _rows_by_per_class(row_recipes):
    groups = {}
    for name, recipe in row_recipes.items():
        if recipe.per_class:
            groups.setdefault(recipe.per_class, []).append(name)
    return dict(sorted(groups.items(), reverse=True))


def _group_name(per_class):
    return "the N-pair rows" if per_class == 2 else f"the m={per_class} rows"


def largest_batch_size(per_class_values, num_classes, num_folds=NUM_FOLDS):
    """The largest batch size that rows of these samples per class can fill with every fold
    model of `num_classes` classes, or None when there is none."""
    step = math.lcm(*per_class_values)
    fitting = [
        batch
        for batch in range(step, step * (num_classes + 1), step)
        if all(batch >= 2 * m and minimum_classes(m, batch, num_folds) <= num_classes for m in per_class_values)
    ]
    return max(fitting, default=None)


def check_budget(row_recipes, batch_size, num_classes=None, num_folds=NUM_FOLDS):
    """Raises `BudgetError` when `batch_size` or `num_classes` (None or "all": not known yet)
    cannot make the batches of the rows `row_recipes` (``{name: Recipe}``): the batch size
    must be a multiple of each row's samples per class and hold two classes or more, and
    every fold model must train on at least as many classes as a batch holds."""
    num_classes = class_count(num_classes)
    groups = _rows_by_per_class(row_recipes)
    if any(batch_size % m or batch_size < 2 * m for m in groups):
        needs = [
            f"{'even' if m == 2 else f'a multiple of {m}'} and at least {2 * m} for {_group_name(m)} "
            f"({', '.join(names)})"
            for m, names in groups.items()
        ]
        raise BudgetError("--batch-size", f"{batch_size} does not fit the chosen rows: it must be {'; '.join(needs)}")
    if num_classes is None:
        return
    minimum = {m: minimum_classes(m, batch_size, num_folds) for m in groups}
    if groups and num_classes < max(minimum.values()):
        needs = [
            f"{minimum[m]} for {_group_name(m)} ({', '.join(names)}), {batch_size // m} classes per batch"
            for m, names in groups.items()
        ]
        fitting = largest_batch_size(list(groups), num_classes, num_folds)
        advice = f"; --batch-size {fitting} fits {num_classes} classes" if fitting else ""
        raise BudgetError(
            "--classes",
            f"{num_classes} classes are too few at batch size {batch_size}: half of "
            f"the classes are for training and each of the {num_folds} fold models "
            f"trains on {fold_training_classes(num_classes, num_folds)} of them; "
            f"the minimum is {'; '.join(needs)}{advice}",
        )


def describe(names=None):
    """``[(row, miner, batches, optimizer)]`` for `pml-rank bench --list`."""
    lines = []
    for name, recipe in rows(names or available()).items():
        spec = baselines.BASELINES.get(name)
        miner = spec.miner if spec is not None else ("BatchHardMiner" if recipe.make_miner else "")
        learns = spec.loss_parameters if spec is not None else ""
        optimizer = f"trunk's; {learns}: their own (loss_lr)" if learns else "trunk's"
        lines.append((name, miner or "-", recipe.batches, optimizer))
    return lines
