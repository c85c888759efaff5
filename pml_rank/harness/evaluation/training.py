"""Training and embedding with PML's own trainer, tester, hooks and record-keeper logging.

`train_model` trains one model the way a PML user would: `trainers.MetricLossOnly` with
the loss, miner and sampler given, `logging_presets.HookContainer` hooks that log every
loss, miner and optimizer statistic with record-keeper, test on a validation set after
every epoch with `testers.GlobalEmbeddingSpaceTester`, save the models and keep the best
epoch by MAP@R. The rest of the package only adds seeding, a quiet mode and a summary.
"""

import contextlib
import dataclasses
import functools
import logging
import random
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import tqdm as tqdm_module
from pytorch_metric_learning import samplers, testers, trainers
from pytorch_metric_learning.testers import base_tester
from pytorch_metric_learning.trainers import base_trainer
from pytorch_metric_learning.utils import common_functions as c_f
from pytorch_metric_learning.utils import logging_presets
from pytorch_metric_learning.utils.accuracy_calculator import AccuracyCalculator

from ..budget import DEFAULTS
from .metrics import METRICS

VALIDATION_SPLIT = "val"


@dataclasses.dataclass
class TrainResult:
    """What `train_model` returns.

    ``trunk`` and ``embedder`` hold the best epoch's weights (the last epoch's without a
    validation set). ``history`` has one entry per epoch: ``epoch``, ``loss`` (mean
    training loss over the epoch) and, with a validation set, each of `METRICS`.
    """

    trunk: torch.nn.Module
    embedder: torch.nn.Module
    best_epoch: int
    history: list
    seconds: float
    folder: str | None = None


def seed_everything(seed):
    """Seeds Python, numpy (PML's samplers draw from numpy's global generator) and torch."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def make_record_keeper(folder):
    """A record-keeper `RecordKeeper` writing CSV and SQLite records under `folder`, the
    one PML's ``logging_presets.get_record_keeper`` builds, without its tensorboard
    requirement (tensorboard is used when installed), and with a database that commits
    without a disk sync (`UnsyncedRecords`)."""
    import record_keeper
    from record_keeper.db_utils import DBManager

    class UnsyncedRecords(DBManager):
        """record-keeper's SQLite database with ``synchronous=OFF``: it opens, commits and
        closes the database for every statement (about 230 for one bench model), and a
        synced commit took about 11 ms on a virtual disk against 0.3 ms unsynced, a fifth
        of the bench's training time. The same records; an operating-system crash, not a
        process crash, could lose the last of them."""

        def open(self):
            super().open()
            self.conn.execute("PRAGMA synchronous=OFF")

    try:
        from torch.utils.tensorboard import SummaryWriter

        tensorboard_writer = SummaryWriter(log_dir=str(Path(folder) / "tensorboard"))
    except ModuleNotFoundError:
        tensorboard_writer = None
    record_writer = record_keeper.RecordWriter(
        folder=str(Path(folder) / "records"),
        global_db_path=None,
        experiment_name=None,
        is_new_experiment=True,
        save_lists=False,
    )
    record_writer.local_db = UnsyncedRecords(record_writer.local_db.db_path)
    return record_keeper.RecordKeeper(
        tensorboard_writer=tensorboard_writer,
        record_writer=record_writer,
        attributes_to_search_for=c_f.list_of_recordable_attributes_list_names(),
    )


class _SilentTqdm:
    """Stands in for the ``tqdm`` module inside PML's trainer and tester: same bars,
    disabled, so a caller's own progress bar stays readable."""

    @staticmethod
    def tqdm(*args, **kwargs):
        kwargs["disable"] = True
        return tqdm_module.tqdm(*args, **kwargs)


@contextlib.contextmanager
def quiet_pml(quiet=True):
    """Silences PML's per-epoch progress bars and its log messages inside the block."""
    if not quiet:
        yield
        return
    saved_level = c_f.LOGGER.level
    # ERROR, not WARNING: the trainer warns that a parameterless embedder is "missing".
    c_f.LOGGER.setLevel(logging.ERROR)
    base_trainer.tqdm, base_tester.tqdm = _SilentTqdm, _SilentTqdm
    try:
        with warnings.catch_warnings():
            # The silenced bar's description formats the loss tensor with "%f".
            warnings.filterwarnings("ignore", message="Converting a tensor with requires_grad")
            yield
    finally:
        base_trainer.tqdm, base_tester.tqdm = tqdm_module, tqdm_module
        c_f.LOGGER.setLevel(saved_level)


def make_tester(device="cpu", batch_size=256, end_of_testing_hook=None, normalize_embeddings=True, loader_workers=0):
    """PML's `GlobalEmbeddingSpaceTester` computing `METRICS` with k = "max_bin_count"."""
    return testers.GlobalEmbeddingSpaceTester(
        normalize_embeddings=normalize_embeddings,
        batch_size=batch_size,
        dataloader_num_workers=loader_workers,
        data_device=torch.device(device),
        end_of_testing_hook=end_of_testing_hook,
        accuracy_calculator=AccuracyCalculator(include=METRICS, k="max_bin_count"),
    )


def compute_embeddings(trunk, dataset, embedder=None, device="cpu", batch_size=256, normalize=False, loader_workers=0):
    """``(embeddings, labels)`` of every item of `dataset` (in order) through
    ``embedder(trunk(x))``, computed by PML's tester in eval mode. Returns float tensors
    of shape (N, dim) and an int64 numpy array of shape (N,)."""
    with quiet_pml():
        tester = make_tester(device, batch_size, normalize_embeddings=normalize, loader_workers=loader_workers)
        embeddings, labels = tester.get_all_embeddings(dataset, trunk.to(device), embedder)
    return embeddings.cpu(), labels.cpu().numpy().reshape(-1).astype(np.int64)


def lr_scheduler_factory(name, epochs):
    """`train_model`'s ``make_lr_scheduler`` for a schedule of `budget.LR_SCHEDULES`:
    "cosine" anneals the learning rate to zero over `epochs` epochs (the last epoch trains
    at about 2% of it for 10 epochs), "constant" (None) keeps it."""
    if name == "constant":
        return None
    if name == "cosine":
        return lambda optimizer: torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=epochs)
    raise ValueError(f"unknown learning-rate schedule {name!r}; available: cosine, constant")


def optimizer_factory(name="adam", weight_decay=0.0, momentum=0.0):
    """`train_model`'s ``make_optimizer(parameters, lr)`` for an optimizer of
    `budget.OPTIMIZERS`: Adam, RMSprop (the Reality Check's) or SGD, with `weight_decay` and
    (RMSprop, SGD) `momentum`."""
    if name == "adam":
        return lambda params, lr: torch.optim.Adam(params, lr=lr, weight_decay=weight_decay)
    if name == "rmsprop":
        return lambda params, lr: torch.optim.RMSprop(params, lr=lr, weight_decay=weight_decay, momentum=momentum)
    if name == "sgd":
        return lambda params, lr: torch.optim.SGD(params, lr=lr, weight_decay=weight_decay, momentum=momentum)
    raise ValueError(f"unknown optimizer {name!r}; available: adam, rmsprop, sgd")


class MixedPrecisionTrainer(trainers.MetricLossOnly):
    """PML's `MetricLossOnly` with automatic mixed precision: the forward pass and the loss
    under `torch.autocast` (float16 on CUDA, bfloat16 on the CPU), the backward pass
    through a `torch.amp.GradScaler` (CUDA; the CPU's bfloat16 needs none)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        device_type = self.data_device.type
        self.autocast = functools.partial(
            torch.autocast, device_type, dtype=torch.float16 if device_type == "cuda" else torch.bfloat16
        )
        self.scaler = torch.amp.GradScaler(device_type, enabled=device_type == "cuda")

    def calculate_loss(self, curr_batch):
        with self.autocast():
            super().calculate_loss(curr_batch)

    def backward(self):
        self.scaler.scale(self.losses["total_loss"]).backward()

    def step_optimizers(self):
        for k, v in self.optimizers.items():
            if c_f.regex_replace("_optimizer$", "", k) not in self.freeze_these:
                self.scaler.step(v)
        self.scaler.update()


def default_sampler(labels, batch_size, m_per_class=4):
    """PML's `MPerClassSampler`: `batch_size // m_per_class` classes with `m_per_class`
    samples each, one pass over roughly the data set per epoch (the Reality Check
    protocol's batch construction)."""
    labels = np.asarray(labels)
    length = max(len(labels) - len(labels) % batch_size, batch_size)
    return samplers.MPerClassSampler(labels, m=m_per_class, batch_size=batch_size, length_before_new_iter=length)


def train_model(
    loss_func,
    train_set,
    *,
    trunk,
    embedder=None,
    miner=None,
    sampler=None,
    val_set=None,
    epochs=DEFAULTS["epochs"],
    batch_size=DEFAULTS["batch_size"],
    iterations_per_epoch=None,
    make_optimizer: Callable | None = None,
    lr=DEFAULTS["lr"],
    loss_lr=None,
    loss_weight_decay=None,
    device="cpu",
    folder=None,
    patience=None,
    seed=None,
    log_freq=10,
    on_iteration: Callable | None = None,
    make_lr_scheduler: Callable | None = None,
    freeze_trunk_batchnorm=False,
    amp=False,
    loader_workers=0,
    quiet=True,
):
    """Trains `trunk` (and `embedder`) with PML's `MetricLossOnly` trainer and returns a
    `TrainResult`.

    Args:
        loss_func: a PML loss (`BaseMetricLossFunction`), ours or PML's.
        train_set: a dataset of ``(input, label)`` items with a ``labels`` attribute; the
            loss sees its labels mapped in order to 0 .. n - 1 (PML's ``set_min_label_to_zero``).
        trunk, embedder: the models; `embedder` defaults to the identity.
        miner: an optional PML miner, passed to the trainer as its tuple miner.
        sampler: a `Sampler` or `BatchSampler`; default `default_sampler` (4 per class).
        val_set: when given, PML's tester measures `METRICS` on it after every epoch
            (queries against the rest of `val_set`) and the best epoch by MAP@R is kept.
        epochs: number of epochs; 0 returns the models untouched (the untrained row).
        iterations_per_epoch: default ``len(train_set) // batch_size``.
        make_optimizer: ``f(parameters, lr) -> torch.optim.Optimizer``; default Adam.
            Losses with parameters of their own get an optimizer too (PML's
            ``metric_loss_optimizer``), at `loss_lr` (default `lr`) with `loss_weight_decay`
            (default: `make_optimizer`'s).
        folder: where record-keeper writes its records and the hooks save the models;
            default a temporary folder, deleted afterwards.
        patience: stop after this many epochs without a better validation MAP@R.
        seed: seeds Python, numpy and torch first (`seed_everything`) when given.
        log_freq: record-keeper logs the trainer's statistics every `log_freq` iterations.
        on_iteration: called as ``on_iteration(trainer)`` after every iteration (progress).
        make_lr_scheduler: ``f(optimizer) -> torch.optim.lr_scheduler.LRScheduler``, stepped
            by PML's trainer at the end of every epoch, one for each model's optimizer.
        freeze_trunk_batchnorm: PML's trainer option: the trunk's BatchNorm layers stay in
            eval mode (fixed statistics), the Reality Check setting.
        amp: automatic mixed precision (`MixedPrecisionTrainer`).
        loader_workers: data-loading processes of the trainer and the validation tester.
        quiet: silence PML's own progress bars and INFO logs.
    """
    if seed is not None:
        seed_everything(seed)
    embedder = torch.nn.Identity() if embedder is None else embedder
    trunk, embedder = trunk.to(device), embedder.to(device)
    make_optimizer = make_optimizer or optimizer_factory()
    if epochs == 0:
        return TrainResult(trunk.eval(), embedder.eval(), 0, [], 0.0, folder)
    labels = np.asarray(train_set.labels)
    sampler = default_sampler(labels, batch_size) if sampler is None else sampler
    iterations_per_epoch = iterations_per_epoch or max(len(labels) // batch_size, 1)

    models = {"trunk": trunk}
    optimizers = {"trunk_optimizer": make_optimizer(trunk.parameters(), lr)}
    # PML warns about a model without an optimizer; a parameterless embedder needs neither.
    if any(True for _ in embedder.parameters()):
        models["embedder"] = embedder
        optimizers["embedder_optimizer"] = make_optimizer(embedder.parameters(), lr)
    if any(True for _ in loss_func.parameters()):
        group = {"params": list(loss_func.to(device).parameters())}
        if loss_weight_decay is not None:
            group["weight_decay"] = loss_weight_decay
        optimizers["metric_loss_optimizer"] = make_optimizer([group], loss_lr or lr)
    lr_schedulers = {}
    if make_lr_scheduler is not None:
        lr_schedulers = {
            f"{name[: -len('_optimizer')]}_scheduler_by_epoch": make_lr_scheduler(optimizer)
            for name, optimizer in optimizers.items()
        }

    started = time.perf_counter()
    with contextlib.ExitStack() as stack:
        if folder is None:
            folder = stack.enter_context(tempfile.TemporaryDirectory(prefix="pml-rank-train-"))
            kept_folder = None
        else:
            kept_folder = str(folder)
        stack.enter_context(quiet_pml(quiet))
        record_keeper = make_record_keeper(folder)
        hooks = logging_presets.get_hook_container(
            record_keeper, log_freq=log_freq, validation_split_name=VALIDATION_SPLIT
        )
        model_folder = str(Path(folder) / "models")
        epoch_losses = []

        def end_of_iteration(trainer):
            hooks.end_of_iteration_hook(trainer)
            loss = trainer.losses["total_loss"]
            epoch_losses.append(float(loss.detach()) if torch.is_tensor(loss) else float(loss))
            if on_iteration is not None:
                on_iteration(trainer)

        history = []
        if val_set is not None:
            tester = make_tester(device, end_of_testing_hook=hooks.end_of_testing_hook, loader_workers=loader_workers)
            validate = hooks.end_of_epoch_hook(tester, {VALIDATION_SPLIT: val_set}, model_folder, patience=patience)
        else:
            tester, validate = None, None

        def end_of_epoch(trainer):
            entry = {"epoch": trainer.epoch, "loss": float(np.mean(epoch_losses)) if epoch_losses else 0.0}
            epoch_losses.clear()
            keep_going = True
            if validate is not None:
                keep_going = validate(trainer)
                accuracies = tester.all_accuracies[VALIDATION_SPLIT]
                entry.update({name: float(accuracies[f"{name}_level0"]) for name in METRICS})
            history.append(entry)
            return keep_going

        trainer = (MixedPrecisionTrainer if amp else trainers.MetricLossOnly)(
            models=models,
            optimizers=optimizers,
            lr_schedulers=lr_schedulers,
            freeze_trunk_batchnorm=freeze_trunk_batchnorm,
            batch_size=batch_size,
            loss_funcs={"metric_loss": loss_func},
            mining_funcs={} if miner is None else {"tuple_miner": miner},
            dataset=train_set,
            # A fold's classes are not 0 .. n - 1: class-weight losses get n weights, not one
            # per class of the whole data set (the held-out ones would be extra negatives).
            set_min_label_to_zero=True,
            dataset_labels=np.asarray(train_set.labels),
            sampler=sampler,
            iterations_per_epoch=iterations_per_epoch,
            data_device=torch.device(device),
            dataloader_num_workers=loader_workers,
            end_of_iteration_hook=end_of_iteration,
            end_of_epoch_hook=end_of_epoch,
        )
        trainer.train(num_epochs=epochs)
        best_epoch = history[-1]["epoch"] if history else epochs
        if validate is not None:
            best_epoch, _ = hooks.get_best_epoch_and_accuracy(tester, VALIDATION_SPLIT)
            hooks.load_latest_saved_models(trainer, model_folder, torch.device(device), best=True)
            embedder = trainer.models["embedder"]
        record_keeper.save_records()
    return TrainResult(
        trunk.eval(), embedder.eval(), int(best_epoch), history, time.perf_counter() - started, kept_folder
    )
