"""The evaluation protocols end to end. The Reality Check's (`run_protocol`): class-disjoint
split, one model per cross-validation fold (trained on three partitions of the training
classes, its best epoch chosen on the fourth), accuracy of the concatenated and separated
test embeddings, and means with 95% confidence intervals over repeated runs. The older
papers' standard protocol (`run_standard_protocol`): one model trained on a data set's
training split, measured on its test split."""

import dataclasses
import time
import typing
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from pytorch_metric_learning.utils import common_functions as c_f

from ..budget import NUM_FOLDS
from ..datasets import NormalizedImages, Transformed
from .loaders import embedding_loaders, training_loaders
from .metrics import METRICS, accuracy, concatenated_and_separated, mean_and_ci
from .splits import LabelledSubset, class_disjoint_split, cross_validation_folds
from .training import EMBEDDING_BATCH, compute_embeddings, seed_everything, train_model


@dataclasses.dataclass
class Recipe:
    """Everything that makes one contender, apart from the data and the shared budget.

    Each field is a factory so every fold gets fresh objects:
        make_loss: ``() -> loss``.
        make_miner: ``() -> miner`` or None.
        make_sampler: called as ``make_sampler(train_set, batch_size=..., model=...,
            device=..., iterations_per_epoch=..., seed=...)``, returns a `Sampler` (or
            `BatchSampler`); None for the default (`training.default_sampler`). `model`
            is ``embedder ∘ trunk``, for samplers that mine with the current network.
            Accept ``**kwargs``: more keywords may be passed in later versions.
        name: label in tables and plots.
        batches: how batches are made, in words, for tables ("8 classes x 4", ...).
        per_class: samples of each class in a batch when the sampler fixes it (4 for
            PML's `MPerClassSampler` with m=4, 2 for N-pair batches), so a batch size
            and a number of classes can be checked before any training; None: unknown.
        loss_needs: keywords `make_loss` takes from the data and the model:
            "num_classes" (1 + the largest training label: proxies, class weights) and
            "embedding_size".
        loss_lr: learning rate of the loss's own parameters; None: the trunk's.
        loss_weight_decay: their weight decay; None: the trunk optimizer's.
    """

    make_loss: Callable
    make_miner: Callable | None = None
    make_sampler: Callable | None = None
    name: str = ""
    batches: str = ""
    per_class: int | None = None
    loss_needs: tuple = ()
    loss_lr: float | None = None
    loss_weight_decay: float | None = None


@dataclasses.dataclass
class ProtocolResult:
    """One run of the protocol (one seed): ``concatenated`` and ``separated`` map each of
    `METRICS` to a value in [0, 1]; ``per_model`` holds each fold model's accuracy,
    ``histories`` each fold's training history (see `TrainResult`)."""

    concatenated: dict
    separated: dict
    per_model: list
    histories: list
    best_epochs: list
    seconds: float


def test_set_and_folds(dataset, num_folds=NUM_FOLDS, transforms=None):
    """``(folds, test_set)`` of the protocol for a dataset with a ``labels`` attribute:
    `folds` is a list of ``(train_set, val_set)`` pairs over the first half of the
    classes, `test_set` holds the second half. All are `LabelledSubset`s of `dataset`, or,
    with ``transforms=(train, eval)``, subsets applying the training transform to the
    training sets and the evaluation one to the validation and test sets."""
    train_idx, test_idx = class_disjoint_split(dataset.labels)
    training = LabelledSubset(dataset, train_idx)
    train_transform, eval_transform = transforms or (None, None)

    def subset(indices, transform):
        part = LabelledSubset(dataset, indices)
        return part if transform is None else Transformed(part, transform)

    folds = [
        (subset(train_idx[tr], train_transform), subset(train_idx[va], eval_transform))
        for tr, va in cross_validation_folds(training.labels, num_folds)
    ]
    return folds, subset(test_idx, eval_transform)


test_set_and_folds.__test__ = False  # not a test, though pytest would collect it by its name


def train_fold_model(recipe, make_trunk, train_set, val_set, fold_seed, config, *, make_embedder=None, **training):
    """One fold's model: seeds everything with `fold_seed`, builds ``make_trunk()`` (and
    ``make_embedder()``, default the identity), the recipe's loss (with the
    ``recipe.loss_needs`` of the config's embedding size and the fold's number of training
    classes: its class weights are the fold's classes alone, which the trainer maps to
    0 .. n - 1), its sampler (given the network, for samplers that mine with it) and trains
    with `training.train_model` and `config` (a `TrainingConfig`), validating on `val_set`
    every epoch; `training` holds `train_model`'s other keywords (``folder``,
    ``on_iteration``, ``loaders``, ``training_loaders``). Returns its `TrainResult`."""
    seed_everything(fold_seed)
    trunk = make_trunk()
    embedder = make_embedder() if make_embedder is not None else torch.nn.Identity()
    sampler = None
    if recipe.make_sampler is not None and config.epochs > 0:
        sampler = recipe.make_sampler(
            train_set,
            batch_size=config.batch_size,
            model=torch.nn.Sequential(trunk, embedder).to(config.device),
            device=config.device,
            iterations_per_epoch=config.iterations_per_epoch,
            seed=fold_seed,
        )
    given = {"num_classes": len(np.unique(np.asarray(train_set.labels))), "embedding_size": config.embedding_size}
    return train_model(
        recipe.make_loss(**{k: given[k] for k in recipe.loss_needs}),
        train_set,
        config,
        trunk=trunk,
        embedder=embedder,
        miner=recipe.make_miner() if recipe.make_miner is not None else None,
        sampler=sampler,
        val_set=val_set,
        loss_lr=recipe.loss_lr,
        loss_weight_decay=recipe.loss_weight_decay,
        **training,
    )


def run_protocol(
    dataset,
    recipe,
    make_trunk,
    config,
    *,
    make_embedder=None,
    seed=0,
    folder=None,
    on_iteration=None,
    transforms=None,
    validation_only=False,
    on_fold=None,
):
    """One run of the protocol with one `Recipe` and a `TrainingConfig`; returns a
    `ProtocolResult`.

    Trains ``config.num_folds`` models (``make_trunk()``, ``make_embedder()``, fresh for
    each fold, seeded with ``seed * 1000 + fold``) with `training.train_model`, then
    measures the test classes. ``config.epochs`` 0 gives the untrained networks' accuracy.
    `folder`, when given, keeps each fold's record-keeper logs and models in
    ``<folder>/fold<k>``. `transforms`: ``(train, eval)`` image transforms (see
    `test_set_and_folds`). With ``config.loader_workers``, one set of loader processes
    (`loaders.EmbeddingLoaders`) reads every validation and test pass of the run, and one
    (`loaders.TrainingLoaders`) every fold model's training batches.

    ``validation_only=True`` is the tuning objective: the test classes are never embedded;
    ``concatenated`` and ``separated`` are then empty and ``per_model`` holds each fold
    model's best validation accuracy. ``on_fold(k, best validation accuracies so far)`` is
    called after each fold (it may raise to stop, e.g. `optuna.TrialPruned`).
    """
    started = time.perf_counter()
    folds, test_set = test_set_and_folds(dataset, config.num_folds, transforms)
    test_embeddings, histories, best_epochs, best_validation = [], [], [], []
    labels = None
    # One set of loader processes embeds every fold's validation set and the test set, one
    # reads every fold model's training batches.
    embedded = [val_set for _, val_set in folds] + ([] if validation_only else [test_set])
    pin_memory = torch.device(config.device).type == "cuda"
    with (
        embedding_loaders(embedded, EMBEDDING_BATCH, config.loader_workers, config.device) as loaders,
        training_loaders([train_set for train_set, _ in folds], config.loader_workers, pin_memory) as training,
    ):
        for k, (train_set, val_set) in enumerate(folds):
            result = train_fold_model(
                recipe,
                make_trunk,
                train_set,
                val_set,
                seed * 1000 + k,
                config,
                make_embedder=make_embedder,
                folder=None if folder is None else f"{folder}/fold{k}",
                on_iteration=on_iteration,
                loaders=loaders,
                training_loaders=training,
            )
            histories.append(result.history)
            best_epochs.append(result.best_epoch)
            best = next((e for e in result.history if e["epoch"] == result.best_epoch), {})
            best_validation.append({m: best[m] for m in METRICS if m in best})
            if on_fold is not None:
                on_fold(k, best_validation)
            if not validation_only:
                embeddings, labels = compute_embeddings(
                    result.trunk,
                    test_set,
                    result.embedder,
                    config.device,
                    loader_workers=config.loader_workers,
                    loaders=loaders,
                )
                test_embeddings.append(embeddings)
    if validation_only:
        return ProtocolResult({}, {}, best_validation, histories, best_epochs, time.perf_counter() - started)
    scores = concatenated_and_separated(test_embeddings, labels, device=config.device)
    return ProtocolResult(
        scores["concatenated"],
        scores["separated"],
        scores["per_model"],
        histories,
        best_epochs,
        time.perf_counter() - started,
    )


class StandardSplits(typing.NamedTuple):
    """A data set's own splits for the standard protocol: the model trains on ``train``;
    each item of ``query`` is retrieved among ``reference`` (None: among the other queries,
    leave-one-out)."""

    train: object
    query: object
    reference: object = None


# Where the standard protocol keeps its one model, in its folder (the Reality Check's: fold<k>).
STANDARD_MODEL = "model"


def run_standard_protocol(
    splits, recipe, make_trunk, config, *, make_embedder=None, seed=0, folder=None, on_iteration=None, metrics=METRICS
):
    """One run of the older papers' protocol with one `Recipe` and a `TrainingConfig`;
    returns a `ProtocolResult`.

    Trains one model (``make_trunk()``, ``make_embedder()``, seeded with `seed`) on
    ``splits.train`` (`StandardSplits`) for all ``config.epochs``: there is no validation
    set, the last epoch is measured, as the papers report. Then retrieves each embedded,
    L2-normalised query among the references and measures `metrics` (names as
    `metrics.accuracy` takes them: ``"R@8"``, ``"NMI"``, ...). One model: ``concatenated``
    and ``separated`` are the same values. `folder`, when given, keeps the model's
    record-keeper logs in ``<folder>/model`` and its weights, saved before any evaluation, in
    ``<folder>/model/models`` (PML's ``trunk_<epoch>.pth`` and ``embedder_<epoch>.pth``).
    ``config.epochs`` 0 measures the untrained networks."""
    started = time.perf_counter()
    model_folder = None if folder is None else f"{folder}/{STANDARD_MODEL}"
    result = train_fold_model(
        recipe,
        make_trunk,
        splits.train,
        None,
        seed,
        config,
        make_embedder=make_embedder,
        folder=model_folder,
        on_iteration=on_iteration,
    )
    if model_folder is not None and config.epochs > 0:
        models = {"trunk": result.trunk, "embedder": result.embedder}
        Path(model_folder, "models").mkdir(parents=True, exist_ok=True)
        c_f.save_dict_of_models(models, config.epochs, f"{model_folder}/models", assert_success=True)

    embedded = [splits.query] + ([] if splits.reference is None else [splits.reference])
    with embedding_loaders(embedded, EMBEDDING_BATCH, config.loader_workers, config.device) as loaders:

        def embed(dataset):
            return compute_embeddings(
                result.trunk,
                dataset,
                result.embedder,
                config.device,
                normalize=True,
                loader_workers=config.loader_workers,
                loaders=loaders,
            )

        query, query_labels = embed(splits.query)
        reference, reference_labels = (None, None) if splits.reference is None else embed(splits.reference)
    scores = accuracy(query, query_labels, reference, reference_labels, metrics=metrics, device=config.device)
    seconds = time.perf_counter() - started
    return ProtocolResult(scores, scores, [scores], [result.history], [result.best_epoch], seconds)


def raw_input_accuracy(dataset, transform=None, device=None):
    """Accuracy on the protocol's test classes of the flattened, L2-normalised inputs
    (the "raw input" row: what retrieval gives without any network), 8-bit images normalised
    as the trunks normalise them; `transform` turns a data set's images into tensors (its
    evaluation transform). The neighbours are searched for `device` (`metrics.accuracy`; None:
    a GPU where torch sees one)."""
    _, test_set = test_set_and_folds(dataset, num_folds=2, transforms=(transform, transform) if transform else None)
    images = torch.stack([test_set[i][0] for i in range(len(test_set))])
    if images.dtype == torch.uint8:
        images = NormalizedImages(images.shape[1]).normalized(images)
    inputs = images.reshape(len(images), -1).float()
    return accuracy(torch.nn.functional.normalize(inputs, dim=1), test_set.labels, device=device)


def summarize(results):
    """Mean and 95% confidence interval over repeated runs: ``{"concatenated": {metric:
    (mean, half_width)}, "separated": {...}}`` from a list of `ProtocolResult`s (or of
    dicts with the same two keys)."""
    summary = {}
    for kind in ("concatenated", "separated"):
        values = [r[kind] if isinstance(r, dict) else getattr(r, kind) for r in results]
        summary[kind] = {name: mean_and_ci([v[name] for v in values]) for name in METRICS}
    return summary
