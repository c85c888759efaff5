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
from pytorch_metric_learning.distances import LpDistance
from pytorch_metric_learning.testers import base_tester
from pytorch_metric_learning.trainers import base_trainer
from pytorch_metric_learning.utils import common_functions as c_f
from pytorch_metric_learning.utils import logging_presets
from pytorch_metric_learning.utils.accuracy_calculator import AccuracyCalculator
from pytorch_metric_learning.utils.inference import CustomKNN

from ..datasets import Transformed
from .loaders import embedding_loaders
from .loaders import training_loaders as open_training_loaders
from .metrics import METRICS, knn_backend

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


@dataclasses.dataclass(frozen=True)
class TrainingConfig:
    """How one model trains: built once from a resolved budget (`from_budget`, its keys of
    the same names), and read by `train_model`, which builds PML's trainer from it; no layer
    re-defaults a value. `device` and `loader_workers` say where it runs (not part of a result).

    ``iterations_per_epoch``: batches per epoch. ``optimizer``: a name of
    `budget.OPTIMIZERS`, with `weight_decay` and (RMSprop, SGD) `momentum`.
    ``lr_schedule``: a name of `budget.LR_SCHEDULES`. ``patience``: stop after this many
    epochs without a better validation MAP@R (None: never). ``freeze_batchnorm``: the
    trunk's BatchNorm layers stay in eval mode (PML's ``freeze_trunk_batchnorm``).
    ``amp``: mixed precision (`MixedPrecisionTrainer`). ``embedding_size``: for losses that
    need it. ``num_folds``: the Reality Check protocol's cross-validation folds (None on the
    standard protocol). ``embedder_lr_factor``: the embedding layer's learning rate is
    ``lr`` times it. ``lr_drop``: ``(epoch, factor)``, after this epoch multiply the
    learning rate by factor, or None.
    """

    epochs: int
    batch_size: int
    iterations_per_epoch: int
    optimizer: str
    lr: float
    weight_decay: float
    momentum: float
    lr_schedule: str
    patience: int | None
    freeze_batchnorm: bool
    amp: bool
    embedding_size: int
    num_folds: int | None
    embedder_lr_factor: float
    lr_drop: tuple | None
    device: str = "cpu"
    loader_workers: int = 0
    quiet: bool = True
    log_freq: int = 50  # record-keeper logs the trainer's statistics every log_freq iterations (PML's default)

    @classmethod
    def from_budget(cls, budget, device="cpu", loader_workers=0):
        """The configuration of a resolved budget (`budget.resolve`), run on `device`: each
        field from the budget key of its name."""
        return cls(
            epochs=budget["epochs"],
            batch_size=budget["batch_size"],
            iterations_per_epoch=budget["iterations_per_epoch"],
            optimizer=budget["optimizer"],
            lr=budget["lr"],
            weight_decay=budget["weight_decay"],
            momentum=budget["momentum"],
            lr_schedule=budget["lr_schedule"],
            patience=budget["patience"],
            freeze_batchnorm=budget["freeze_batchnorm"],
            amp=budget["amp"],
            embedding_size=budget["embedding_size"],
            num_folds=budget["num_folds"],
            embedder_lr_factor=budget["embedder_lr_factor"],
            lr_drop=budget["lr_drop"],
            device=device,
            loader_workers=loader_workers,
        )

    def make_optimizer(self, parameters, lr):
        """The configured optimizer over `parameters` at `lr`. On a GPU, Adam and SGD take
        torch's fused step: one kernel per optimizer where the default (foreach) step
        launches one per operation (a fifth to a quarter of a glyph training step's
        operations, counted on the CPU), and under a `GradScaler` it skips an overflowed
        step on the device instead of reading the scaler's check back, a wait for the GPU
        (torch has no fused RMSprop). On the CPU, the foreach step: the same bits as torch's
        per-parameter default there, which made the committed tables, in about 0.6 of its
        time (the fused one rounds differently)."""
        on_cuda = torch.device(self.device).type == "cuda"
        fast = {"fused": True} if on_cuda else {"foreach": True}
        if self.optimizer == "adam":
            return torch.optim.Adam(parameters, lr=lr, weight_decay=self.weight_decay, **fast)
        if self.optimizer == "rmsprop":
            return torch.optim.RMSprop(
                parameters, lr=lr, weight_decay=self.weight_decay, momentum=self.momentum, foreach=True
            )
        if self.optimizer == "sgd":
            return torch.optim.SGD(parameters, lr=lr, weight_decay=self.weight_decay, momentum=self.momentum, **fast)
        raise ValueError(f"unknown optimizer {self.optimizer!r}; available: adam, rmsprop, sgd")

    def make_lr_scheduler(self, optimizer):
        """The schedule PML's trainer steps after every epoch, or None: "cosine" anneals the
        learning rate to zero over the epochs (the last of 10 trains at about 2% of it),
        "constant" keeps it; `lr_drop` multiplies it once."""
        if self.lr_drop is not None:
            after_epoch, factor = self.lr_drop
            return torch.optim.lr_scheduler.MultiStepLR(optimizer, [after_epoch], gamma=factor)
        if self.lr_schedule == "cosine":
            return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=self.epochs)
        if self.lr_schedule == "constant":
            return None
        raise ValueError(f"unknown learning-rate schedule {self.lr_schedule!r}; available: cosine, constant")


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


# The tester's batch: 128 small-CNN glyphs embed in 12 ms on a CPU thread where 256 take 20
# (their activations outgrow the cache). In eval mode each image embeds alone: the batch
# changes no digit of the bench.
EMBEDDING_BATCH = 128


# Queries whose distances to every reference are computed at once by the torch k-NN.
KNN_QUERY_BLOCK = 4096


class Tester(testers.GlobalEmbeddingSpaceTester):
    """PML's `GlobalEmbeddingSpaceTester` whose passes over a data set of `loaders` (a
    `loaders.EmbeddingLoaders` of its batch size, or None) read the same batches from its
    processes instead of starting processes of their own."""

    def __init__(self, *args, loaders=None, **kwargs):
        super().__init__(*args, **kwargs)
        if loaders is not None and loaders.batch_size != self.batch_size:
            raise ValueError(f"loaders of batch size {loaders.batch_size} for a tester of batch size {self.batch_size}")
        self.loaders = loaders

    def compute_all_embeddings(self, dataloader, trunk_model, embedder_model):
        pooled = None
        if self.loaders is not None and dataloader.collate_fn is torch.utils.data.default_collate:
            pooled = self.loaders.pass_over(dataloader.dataset)
        return super().compute_all_embeddings(dataloader if pooled is None else pooled, trunk_model, embedder_model)


def make_tester(
    device="cpu",
    batch_size=EMBEDDING_BATCH,
    end_of_testing_hook=None,
    normalize_embeddings=True,
    loader_workers=0,
    loaders=None,
):
    """PML's `GlobalEmbeddingSpaceTester` (`Tester`, reading from `loaders` where given)
    computing `METRICS` with k = "max_bin_count", its neighbours searched where
    `metrics.knn_backend` says: PML's default faiss search, or on a CUDA device without a
    GPU faiss, PML's torch k-NN (`CustomKNN`, squared L2 as faiss's ``IndexFlatL2``) on the GPU."""
    device = torch.device(device)
    knn_func = None
    if knn_backend(device) == "torch":
        knn_func = CustomKNN(LpDistance(normalize_embeddings=False, power=2), batch_size=KNN_QUERY_BLOCK)
    return Tester(
        normalize_embeddings=normalize_embeddings,
        batch_size=batch_size,
        dataloader_num_workers=loader_workers,
        data_device=device,
        end_of_testing_hook=end_of_testing_hook,
        accuracy_calculator=AccuracyCalculator(include=METRICS, k="max_bin_count", device=device, knn_func=knn_func),
        loaders=loaders,
    )


def compute_embeddings(
    trunk,
    dataset,
    embedder=None,
    device="cpu",
    batch_size=EMBEDDING_BATCH,
    normalize=False,
    loader_workers=0,
    loaders=None,
):
    """``(embeddings, labels)`` of every item of `dataset` (in order) through
    ``embedder(trunk(x))``, computed by PML's tester in eval mode, its batches read by
    `loaders` (an `EmbeddingLoaders` holding `dataset`) where given. Returns float tensors
    of shape (N, dim) and an int64 numpy array of shape (N,)."""
    with quiet_pml():
        tester = make_tester(
            device, batch_size, normalize_embeddings=normalize, loader_workers=loader_workers, loaders=loaders
        )
        embeddings, labels = tester.get_all_embeddings(dataset, trunk.to(device), embedder)
    return embeddings.cpu(), labels.cpu().numpy().reshape(-1).astype(np.int64)


class SeededDraws:
    """The batch sampler `batches` with each index as the key ``(index, seed)`` of a
    `datasets.Transformed`: the n-th item drawn has the seed of (`seed`, n). An image's random
    augmentation then depends on its place in the stream of items, not on which loader
    process decodes it, nor on what that process drew before."""

    def __init__(self, batches, seed):
        self.batches, self.seed, self.drawn = batches, seed, 0

    def __len__(self):
        return len(self.batches)

    def __iter__(self):
        for batch in self.batches:
            entropy = [[self.seed, self.drawn + k] for k in range(len(batch))]
            seeds = [int(np.random.SeedSequence(e).generate_state(1, np.uint64)[0]) for e in entropy]
            self.drawn += len(batch)
            yield list(zip(batch, seeds))


def training_batches(dataset, sampler, batch_size, draws_seed):
    """The batches a trainer reads from `dataset`: `sampler`'s, in batches of `batch_size`
    without a short last one (PML's loader's own), or a random order's when `sampler` is None;
    keyed by `SeededDraws` from `draws_seed` for a `datasets.Transformed`."""
    batches = sampler
    if not isinstance(batches, torch.utils.data.BatchSampler):
        items = torch.utils.data.RandomSampler(dataset) if batches is None else batches
        batches = torch.utils.data.BatchSampler(items, int(batch_size), drop_last=True)
    return SeededDraws(batches, draws_seed) if isinstance(dataset, Transformed) else batches


class MetricLossOnly(trainers.MetricLossOnly):
    """PML's `MetricLossOnly` whose data-loading processes (``dataloader_num_workers`` > 0)
    live through the whole training and end with it, with batches in pinned memory for a
    GPU: PML's loader starts and stops its processes at every pass over the sampler (about
    once an epoch; 0.3 s for 4 processes on a CPU here). With `loaders` (a
    `loaders.TrainingLoaders` holding its dataset), its batches come from their processes
    instead, its sampler's passes read as one stream. The batches are PML's; the items of a
    `datasets.Transformed` are drawn by the keys of `SeededDraws` from `draws_seed`. Inside `quiet_pml`, its
    loop runs without the silenced progress bar, whose text read the loss from the device
    after every step, making the CPU wait for the GPU before it could queue the next step."""

    def __init__(self, *args, draws_seed=0, loaders=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.draws_seed, self.loaders, self.batches_to_read = draws_seed, loaders, None
        self._trained_parameters = None

    def zero_grad(self):
        """PML's: every model's and every optimizer's gradients set to None, from a list of
        their parameters made once a training. PML asks each model and each optimizer in turn,
        and a model walks its modules to find them: for ResNet-50, about 1 ms of the host's time
        a step on a GPU machine (torch.profiler, examples/bench_throughput.py --trace), while
        the GPU, whose steps the host can barely queue fast enough, waits."""
        if self._trained_parameters is None:
            found = [p for model in self.models.values() for p in model.parameters()]
            found += [p for o in self.optimizers.values() for group in o.param_groups for p in group["params"]]
            self._trained_parameters = list({id(p): p for p in found}.values())
        for parameter in self._trained_parameters:
            parameter.grad = None

    def train(self, start_epoch=1, num_epochs=1):
        self._trained_parameters = None  # the models' parameters as they are now
        if self.iterations_per_epoch:
            self.batches_to_read = (num_epochs - start_epoch + 1) * self.iterations_per_epoch
        try:
            if base_trainer.tqdm is not _SilentTqdm:
                return super().train(start_epoch, num_epochs)
            self._train_without_bar(start_epoch, num_epochs)
        finally:
            # The loader's processes end here, not whenever the garbage collector frees the
            # trainer (its hooks hold it in a cycle): later, inside another model's training.
            self.dataloader_iter = self.dataloader = None

    def _train_without_bar(self, start_epoch, num_epochs):
        """PML 2.9's `BaseTrainer.train` without the bar."""
        self.initialize_dataloader()
        for epoch in range(start_epoch, num_epochs + 1):
            self.epoch = epoch
            self.set_to_train()
            for iteration in range(self.iterations_per_epoch):
                self.iteration = iteration
                self.forward_and_backward()
                self.end_of_iteration_hook(self)
                self.step_lr_schedulers(end_of_epoch=False)
            self.step_lr_schedulers(end_of_epoch=True)
            self.zero_losses()
            if self.end_of_epoch_hook(self) is False:
                break

    def get_batch(self):
        """PML's batch, copied to a GPU without waiting for it (from the loader's pinned
        memory): PML's forward copies the data, and its losses the labels, with blocking
        copies, each of which makes the CPU wait for every kernel queued before it (the
        previous step's backward and optimizer, this step's forward) before it can queue
        more, where the raw step on data already on the GPU overlaps them."""
        data, labels = super().get_batch()
        if self.data_device.type == "cuda":
            data, labels = (
                x.to(self.data_device, non_blocking=True) if torch.is_tensor(x) else x for x in (data, labels)
            )
        return data, labels

    def initialize_dataloader(self):
        workers = self.dataloader_num_workers
        batches = training_batches(self.dataset, self.sampler, self.batch_size, self.draws_seed)
        stream = None
        if self.loaders is not None and self.batches_to_read and self.collate_fn is None:
            stream = self.loaders.stream(self.dataset, batches, self.batches_to_read)
        if stream is not None:
            self.dataloader = self.dataloader_iter = stream
            return
        self.dataloader = torch.utils.data.DataLoader(
            self.dataset,
            batch_sampler=batches,
            num_workers=workers,
            collate_fn=self.collate_fn,
            pin_memory=self.data_device.type == "cuda",
            persistent_workers=workers > 0,
        )
        if not self.iterations_per_epoch:
            self.iterations_per_epoch = len(self.dataloader)
        self.dataloader_iter = iter(self.dataloader)


class MixedPrecisionTrainer(MetricLossOnly):
    """`MetricLossOnly` with automatic mixed precision: the forward pass and the loss
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


def _optimized(config, trunk, embedder, loss_func, loss_lr, loss_weight_decay):
    """``(models, optimizers, lr_schedulers)`` as PML's trainer takes them."""
    models = {"trunk": trunk}
    optimizers = {"trunk_optimizer": config.make_optimizer(trunk.parameters(), config.lr)}
    # PML warns about a model without an optimizer; a parameterless embedder needs neither.
    if any(True for _ in embedder.parameters()):
        models["embedder"] = embedder
        embedder_lr = config.lr * config.embedder_lr_factor
        optimizers["embedder_optimizer"] = config.make_optimizer(embedder.parameters(), embedder_lr)
    if any(True for _ in loss_func.parameters()):
        group = {"params": list(loss_func.to(config.device).parameters())}
        if loss_weight_decay is not None:
            group["weight_decay"] = loss_weight_decay
        optimizers["metric_loss_optimizer"] = config.make_optimizer([group], loss_lr or config.lr)
    schedulers = {
        f"{name[: -len('_optimizer')]}_scheduler_by_epoch": config.make_lr_scheduler(o)
        for name, o in optimizers.items()
    }
    return models, optimizers, {name: scheduler for name, scheduler in schedulers.items() if scheduler is not None}


class BestModelsInMemory(logging_presets.HookContainer):
    """PML's hooks, with the best epoch's models kept as a copy of their weights where they
    are (on the GPU, say) instead of files, for a training whose folder is thrown away:
    PML's hooks write every epoch's models and the best ones to disk and read the best
    back, about 0.2 s an epoch for ResNet-50 on a CPU, longer than a short epoch's steps
    on a GPU. The same weights are reloaded (a copy, not a file round trip)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.best_weights = None

    def save_models(self, trainer, model_folder, curr_suffix, prev_suffix=None):
        if str(curr_suffix).startswith("best"):  # the latest epoch's models are never read back
            self.best_weights = {
                name: {key: value.detach().clone() for key, value in model.state_dict().items()}
                for name, model in trainer.models.items()
            }

    def load_latest_saved_models(self, trainer, model_folder, device=None, best=False):
        if self.best_weights is None:
            return 1
        for name, model in trainer.models.items():
            model.load_state_dict(self.best_weights[name])
        return trainer.epoch + 1


class _EpochRecorder:
    """PML's hooks plus what `train_model` keeps: every epoch's mean loss and validation
    accuracies (``history``), validating on `val_set` with PML's tester after each epoch."""

    def __init__(self, hooks, config, val_set, model_folder, on_iteration, loaders):
        self.hooks, self.on_iteration, self.history, self.losses = hooks, on_iteration, [], []
        self.tester = self.validate = None
        if val_set is not None:
            self.tester = make_tester(
                config.device,
                end_of_testing_hook=hooks.end_of_testing_hook,
                loader_workers=config.loader_workers,
                loaders=loaders,
            )
            self.validate = hooks.end_of_epoch_hook(
                self.tester, {VALIDATION_SPLIT: val_set}, model_folder, patience=config.patience
            )

    def end_of_iteration(self, trainer):
        self.hooks.end_of_iteration_hook(trainer)
        loss = trainer.losses["total_loss"]
        # Read at the epoch's end: reading it now would make the CPU wait for the GPU at every step.
        self.losses.append(loss.detach() if torch.is_tensor(loss) else loss)
        if self.on_iteration is not None:
            self.on_iteration(trainer)

    def end_of_epoch(self, trainer):
        losses = [float(loss) for loss in self.losses]
        entry = {"epoch": trainer.epoch, "loss": float(np.mean(losses)) if losses else 0.0}
        self.losses.clear()
        keep_going = True
        if self.validate is not None:
            keep_going = self.validate(trainer)
            accuracies = self.tester.all_accuracies[VALIDATION_SPLIT]
            entry.update({name: float(accuracies[f"{name}_level0"]) for name in METRICS})
        self.history.append(entry)
        return keep_going


def _record_keeper_and_hooks(folder, keep_models, config):
    """A record-keeper writing in `folder` and PML's hooks logging to it, which keep the best
    epoch's models in files with `keep_models`, else in memory (`BestModelsInMemory`)."""
    record_keeper = make_record_keeper(folder)
    hooks = (logging_presets.HookContainer if keep_models else BestModelsInMemory)(
        record_keeper, log_freq=config.log_freq, validation_split_name=VALIDATION_SPLIT
    )
    # The best epoch's models are all it reloads: optimizers, schedulers and losses are
    # not saved every epoch (PML's hooks would, for resuming, which a bench job never does).
    hooks.saveable_trainer_objects = ["models"]
    return record_keeper, hooks


def _loaders(stack, config, train_set, val_set, loaders, training_loaders):
    """``(loaders, training_loaders)``: those given, or with ``config.loader_workers``, a
    training's own over `val_set` and `train_set`, closed with `stack`."""
    if loaders is None and val_set is not None:
        loaders = stack.enter_context(
            embedding_loaders([val_set], EMBEDDING_BATCH, config.loader_workers, config.device)
        )
    if training_loaders is None:
        cuda = torch.device(config.device).type == "cuda"
        training_loaders = stack.enter_context(open_training_loaders([train_set], config.loader_workers, cuda))
    return loaders, training_loaders


def train_model(
    loss_func,
    train_set,
    config,
    *,
    trunk,
    embedder=None,
    miner=None,
    sampler=None,
    val_set=None,
    loss_lr=None,
    loss_weight_decay=None,
    folder=None,
    seed=None,
    on_iteration: Callable | None = None,
    loaders=None,
    training_loaders=None,
):
    """Trains `trunk` (and `embedder`) with PML's `MetricLossOnly` trainer as `config` (a
    `TrainingConfig`) says and returns a `TrainResult`.

    Args:
        loss_func: a PML loss (`BaseMetricLossFunction`), ours or PML's.
        train_set: a dataset of ``(input, label)`` items with a ``labels`` attribute; the
            loss sees its labels mapped in order to 0 .. n - 1 (PML's ``set_min_label_to_zero``).
        config: the `TrainingConfig`; ``config.epochs`` 0 returns the models untouched
            (the untrained row).
        trunk, embedder: the models; `embedder` defaults to the identity.
        miner: an optional PML miner, passed to the trainer as its tuple miner.
        sampler: a `Sampler` or `BatchSampler`; default `default_sampler` (4 per class).
        val_set: when given, PML's tester measures `METRICS` on it after every epoch
            (queries against the rest of `val_set`) and the best epoch by MAP@R is kept.
        loss_lr, loss_weight_decay: losses with parameters of their own get an optimizer
            too (PML's ``metric_loss_optimizer``), at `loss_lr` (default the config's lr)
            with `loss_weight_decay` (default the config's).
        folder: where record-keeper writes its records and the hooks save the models;
            default a temporary folder, deleted afterwards.
        seed: seeds Python, numpy and torch first (`seed_everything`) when given; the seed torch
            was last seeded with draws the augmentations (`SeededDraws`).
        on_iteration: called as ``on_iteration(trainer)`` after every iteration (progress).
        loaders: the `loaders.EmbeddingLoaders` (holding `val_set`) that the validations
            read from; default: with ``config.loader_workers``, one of its own over `val_set`,
            whose processes serve every epoch's validation and end with the training.
        training_loaders: the `loaders.TrainingLoaders` (holding `train_set`) that the
            training reads from; default: with ``config.loader_workers``, one of its own.
    """
    if seed is not None:
        seed_everything(seed)
    device = torch.device(config.device)
    embedder = torch.nn.Identity() if embedder is None else embedder
    trunk, embedder = trunk.to(device), embedder.to(device)
    if config.epochs == 0:
        return TrainResult(trunk.eval(), embedder.eval(), 0, [], 0.0, folder)
    labels = np.asarray(train_set.labels)
    sampler = default_sampler(labels, config.batch_size) if sampler is None else sampler
    models, optimizers, lr_schedulers = _optimized(config, trunk, embedder, loss_func, loss_lr, loss_weight_decay)
    started = time.perf_counter()
    with contextlib.ExitStack() as stack:
        kept_folder = None if folder is None else str(folder)
        if folder is None:
            folder = stack.enter_context(tempfile.TemporaryDirectory(prefix="pml-rank-train-"))
        stack.enter_context(quiet_pml(config.quiet))
        record_keeper, hooks = _record_keeper_and_hooks(folder, kept_folder is not None, config)
        model_folder = str(Path(folder) / "models")
        loaders, training_loaders = _loaders(stack, config, train_set, val_set, loaders, training_loaders)
        recorder = _EpochRecorder(hooks, config, val_set, model_folder, on_iteration, loaders)
        trainer = (MixedPrecisionTrainer if config.amp else MetricLossOnly)(
            models=models,
            optimizers=optimizers,
            lr_schedulers=lr_schedulers,
            freeze_trunk_batchnorm=config.freeze_batchnorm,
            batch_size=config.batch_size,
            loss_funcs={"metric_loss": loss_func},
            mining_funcs={} if miner is None else {"tuple_miner": miner},
            dataset=train_set,
            # A fold's classes are not 0 .. n - 1: class-weight losses get n weights, not one
            # per class of the whole data set (the held-out ones would be extra negatives).
            set_min_label_to_zero=True,
            dataset_labels=labels,
            sampler=sampler,
            iterations_per_epoch=config.iterations_per_epoch,
            data_device=device,
            dataloader_num_workers=config.loader_workers,
            end_of_iteration_hook=recorder.end_of_iteration,
            end_of_epoch_hook=recorder.end_of_epoch,
            draws_seed=torch.initial_seed(),  # the fold model's seed, by `seed` or the caller
            loaders=training_loaders,
        )
        trainer.train(num_epochs=config.epochs)
        history = recorder.history
        best_epoch = history[-1]["epoch"] if history else config.epochs
        if recorder.validate is not None:
            best_epoch, _ = hooks.get_best_epoch_and_accuracy(recorder.tester, VALIDATION_SPLIT)
            hooks.load_latest_saved_models(trainer, model_folder, device, best=True)
            embedder = trainer.models["embedder"]
        record_keeper.save_records()
    return TrainResult(
        trunk.eval(), embedder.eval(), int(best_epoch), history, time.perf_counter() - started, kept_folder
    )
