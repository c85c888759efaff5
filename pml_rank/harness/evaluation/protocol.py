"""The Reality Check protocol end to end: class-disjoint split, one model per
cross-validation fold (trained on three partitions of the training classes, its best
epoch chosen on the fourth), accuracy of the concatenated and separated test embeddings,
and means with 95% confidence intervals over repeated runs."""

import dataclasses
import time
from collections.abc import Callable

import torch

from .metrics import METRICS, accuracy, concatenated_and_separated, mean_and_ci
from .splits import LabelledSubset, class_disjoint_split, cross_validation_folds
from .training import compute_embeddings, seed_everything, train_model


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
    """

    make_loss: Callable
    make_miner: Callable | None = None
    make_sampler: Callable | None = None
    name: str = ""
    batches: str = ""
    per_class: int | None = None


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


def test_set_and_folds(dataset, num_folds=4):
    """``(folds, test_set)`` of the protocol for a dataset with a ``labels`` attribute:
    `folds` is a list of ``(train_set, val_set)`` pairs over the first half of the
    classes, `test_set` holds the second half. All are `LabelledSubset`s of `dataset`."""
    train_idx, test_idx = class_disjoint_split(dataset.labels)
    training = LabelledSubset(dataset, train_idx)
    folds = [
        (LabelledSubset(dataset, train_idx[tr]), LabelledSubset(dataset, train_idx[va]))
        for tr, va in cross_validation_folds(training.labels, num_folds)
    ]
    return folds, LabelledSubset(dataset, test_idx)


test_set_and_folds.__test__ = False  # not a test, though pytest would collect it by its name


def train_fold_model(
    recipe,
    make_trunk,
    train_set,
    val_set,
    fold_seed,
    *,
    make_embedder=None,
    epochs,
    batch_size,
    iterations_per_epoch=None,
    device="cpu",
    **training,
):
    """One fold's model: seeds everything with `fold_seed`, builds ``make_trunk()`` (and
    ``make_embedder()``, default the identity), the recipe's sampler (given the network, for
    samplers that mine with it) and trains with `training.train_model`, validating on
    `val_set` every epoch; `training` holds `train_model`'s other keywords. Returns its
    `TrainResult`."""
    seed_everything(fold_seed)
    trunk = make_trunk()
    embedder = make_embedder() if make_embedder is not None else torch.nn.Identity()
    sampler = None
    if recipe.make_sampler is not None and epochs > 0:
        sampler = recipe.make_sampler(
            train_set,
            batch_size=batch_size,
            model=torch.nn.Sequential(trunk, embedder).to(device),
            device=device,
            iterations_per_epoch=iterations_per_epoch or max(len(train_set) // batch_size, 1),
            seed=fold_seed,
        )
    return train_model(
        recipe.make_loss(),
        train_set,
        trunk=trunk,
        embedder=embedder,
        miner=recipe.make_miner() if recipe.make_miner is not None else None,
        sampler=sampler,
        val_set=val_set,
        epochs=epochs,
        batch_size=batch_size,
        iterations_per_epoch=iterations_per_epoch,
        device=device,
        **training,
    )


def run_protocol(
    dataset,
    recipe,
    make_trunk,
    *,
    make_embedder=None,
    num_folds=4,
    seed=0,
    epochs=8,
    batch_size=64,
    iterations_per_epoch=None,
    make_optimizer=None,
    lr=1e-3,
    device="cpu",
    patience=None,
    folder=None,
    on_iteration=None,
    make_lr_scheduler=None,
    freeze_trunk_batchnorm=False,
    quiet=True,
):
    """One run of the protocol with one `Recipe`; returns a `ProtocolResult`.

    Trains `num_folds` models (``make_trunk()``, ``make_embedder()``, fresh for each fold,
    seeded with ``seed * 1000 + fold``) with `training.train_model` and the shared budget
    (`epochs`, `batch_size`, `iterations_per_epoch`, `make_optimizer`, `lr`,
    `make_lr_scheduler`, `freeze_trunk_batchnorm`: see `train_model`), then measures
    the test classes. ``epochs=0`` gives the untrained networks' accuracy. `folder`, when
    given, keeps each fold's record-keeper logs and models in ``<folder>/fold<k>``.
    """
    started = time.perf_counter()
    folds, test_set = test_set_and_folds(dataset, num_folds)
    test_embeddings, histories, best_epochs = [], [], []
    labels = None
    for k, (train_set, val_set) in enumerate(folds):
        result = train_fold_model(
            recipe,
            make_trunk,
            train_set,
            val_set,
            seed * 1000 + k,
            make_embedder=make_embedder,
            epochs=epochs,
            batch_size=batch_size,
            iterations_per_epoch=iterations_per_epoch,
            make_optimizer=make_optimizer,
            lr=lr,
            device=device,
            folder=None if folder is None else f"{folder}/fold{k}",
            patience=patience,
            on_iteration=on_iteration,
            make_lr_scheduler=make_lr_scheduler,
            freeze_trunk_batchnorm=freeze_trunk_batchnorm,
            quiet=quiet,
        )
        embeddings, labels = compute_embeddings(result.trunk, test_set, result.embedder, device)
        test_embeddings.append(embeddings)
        histories.append(result.history)
        best_epochs.append(result.best_epoch)
    scores = concatenated_and_separated(test_embeddings, labels)
    return ProtocolResult(
        scores["concatenated"],
        scores["separated"],
        scores["per_model"],
        histories,
        best_epochs,
        time.perf_counter() - started,
    )


def raw_input_accuracy(dataset):
    """Accuracy on the protocol's test classes of the flattened, L2-normalised inputs
    (the "raw input" row: what retrieval gives without any network)."""
    _, test_set = test_set_and_folds(dataset, num_folds=2)
    inputs = torch.stack([test_set[i][0].reshape(-1).float() for i in range(len(test_set))])
    return accuracy(torch.nn.functional.normalize(inputs, dim=1), test_set.labels)


def summarize(results):
    """Mean and 95% confidence interval over repeated runs: ``{"concatenated": {metric:
    (mean, half_width)}, "separated": {...}}`` from a list of `ProtocolResult`s (or of
    dicts with the same two keys)."""
    summary = {}
    for kind in ("concatenated", "separated"):
        values = [r[kind] if isinstance(r, dict) else getattr(r, kind) for r in results]
        summary[kind] = {name: mean_and_ci([v[name] for v in values]) for name in METRICS}
    return summary
