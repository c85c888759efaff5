"""Hard negative class mining for N-pair batches (Sohn, NIPS 2016, slide "Hard Negative
class mining")."""

import copy
import time
import warnings
from collections.abc import Callable

import numpy as np
import torch
from pytorch_metric_learning.distances import BaseDistance, DotProductSimilarity
from pytorch_metric_learning.utils import common_functions as c_f

from .._checks import check_embeddings, checked_constructor

# Candidate classes drawn per batch, as a multiple of the classes in a batch, when the
# caller does not say: the slides ask for "a large number" without giving it.
DEFAULT_CANDIDATES_PER_CLASS = 4


class NoModelAttachedWarning(UserWarning):
    """A HardNegativeClassSampler finished an epoch without a model: its batches were random."""


@checked_constructor
class HardNegativeClassSampler(torch.utils.data.Sampler):
    """Yields dataset indices whose consecutive chunks of ``2 * classes_per_batch`` are
    N-pair batches: ``classes_per_batch`` (N) distinct classes, two distinct examples
    of each, the two examples of a class adjacent and the classes in selection order.
    Use it as the ``sampler`` of a DataLoader or of a PML trainer with
    ``batch_size = 2 * classes_per_batch``.

    Each batch is mined as in the slides:

    1. draw ``candidate_classes`` (C) classes at random and represent each class c by
       g_c, the mean embedding of ``examples_per_class`` of its examples, random ones;
    2. start from a random candidate, then repeatedly add the candidate class c with
       the largest violation v(c | S) = max over selected classes s of sim(g_s, g_c),
       ties broken at random, until N classes are selected. sim is ``distance``'s
       similarity (negated for a distance), by default the inner product the N-pair
       loss uses. For anchor s the triplet constraint is sim(f_s, f_s⁺) > sim(f_s, f_c);
       the positive's similarity is unknown with one embedded example per class, so it
       is taken as equal for every selected class and the violation reduces to the
       negative's similarity;
    3. draw two distinct examples of each selected class.

    Embedding costs a forward pass, so class embeddings are cached: a candidate class
    is re-embedded only when its embedding is ``refresh_every`` batches old or older
    (default: one epoch, ``batches_per_epoch``; 1 re-embeds every candidate for every
    batch, the slides' letter). ``mining_seconds`` (time spent building batches,
    embedding included), ``mined_batches`` and ``embedded_examples`` count the cost.

    Until a model is attached, batches hold N classes drawn at random (the first epoch
    that ends so warns, once, `NoModelAttachedWarning`). Attach one with
    :meth:`attach` (a model and the dataset), :meth:`attach_trainer` (a PML trainer;
    its trunk and embedder) or as a PML hook, ``end_of_iteration_hook=sampler.
    end_of_iteration_hook``; or pass ``embed_fn``, a callable mapping a LongTensor of
    dataset indices to their embeddings. Embedding runs under ``torch.no_grad()`` with
    the model in eval mode; every module's mode is restored afterwards (an ``embed_fn``
    gets only ``no_grad``: it owns its model's mode).

    Batches are reproducible for a given ``seed``, epoch and model: each pass draws
    from a generator seeded with (seed, epoch). The epoch advances by one per pass;
    :meth:`set_epoch` sets it, as for ``DistributedSampler``. :meth:`state_dict` and
    :meth:`load_state_dict` save and restore the epoch, the cache and the counters, so
    a run resumed from a checkpoint mines the batches the uninterrupted run would.

    Distributed training: with ``num_replicas`` processes (default: the world size of
    an initialised ``torch.distributed`` group, else 1), every process mines the same
    global batch (same seed, same model weights under DDP) and yields only its own
    ``classes_per_batch / num_replicas`` classes, both examples of each: shards never
    overlap and never split a pair. Use ``batch_size = 2 * classes_per_batch /
    num_replicas`` per process.
    """

    _name = "HardNegativeClassSampler"  # for error messages

    def __init__(
        self,
        labels: list | tuple | np.ndarray | torch.Tensor,
        classes_per_batch: int,
        candidate_classes: int | None = None,
        examples_per_class: int = 1,
        batches_per_epoch: int | None = None,
        refresh_every: int | None = None,
        distance: BaseDistance | None = None,
        embed_fn: Callable | None = None,
        seed: int = 0,
        num_replicas: int | None = None,
        rank: int | None = None,
    ):
        labels = np.asarray(labels.cpu() if torch.is_tensor(labels) else labels)
        if labels.ndim != 1:
            raise ValueError(f"{self._name}: labels must be one-dimensional, got shape {labels.shape}")
        self.class_labels, inverse, counts = np.unique(labels, return_inverse=True, return_counts=True)
        num_classes = len(self.class_labels)
        too_small = [(label, count) for label, count in zip(self.class_labels, counts) if count < 2]
        if too_small:
            listed = ", ".join(f"label {label} ({count} example)" for label, count in too_small[:10])
            more = f" and {len(too_small) - 10} more" if len(too_small) > 10 else ""
            raise ValueError(
                f"{self._name}: every class needs at least two examples; "
                f"{len(too_small)} of {num_classes} classes have fewer: {listed}{more}"
            )
        if not 2 <= classes_per_batch <= num_classes:
            raise ValueError(
                f"{self._name}: classes_per_batch={classes_per_batch} must be between 2 "
                f"and the number of classes ({num_classes})"
            )
        if candidate_classes is None:
            candidate_classes = min(num_classes, DEFAULT_CANDIDATES_PER_CLASS * classes_per_batch)
        if not classes_per_batch <= candidate_classes <= num_classes:
            raise ValueError(
                f"{self._name}: candidate_classes={candidate_classes} must be between "
                f"classes_per_batch ({classes_per_batch}) and the number of classes ({num_classes})"
            )
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        num_replicas = num_replicas or (torch.distributed.get_world_size() if distributed else 1)
        rank = (torch.distributed.get_rank() if distributed else 0) if rank is None else rank
        if classes_per_batch % num_replicas or not 0 <= rank < num_replicas:
            raise ValueError(
                f"{self._name}: classes_per_batch={classes_per_batch} must be a multiple of "
                f"num_replicas={num_replicas}, and rank={rank} in [0, {num_replicas})"
            )
        if examples_per_class not in (1, 2):
            raise ValueError(f"{self._name}: examples_per_class={examples_per_class} must be 1 or 2")
        if batches_per_epoch is None:
            batches_per_epoch = max(1, len(labels) // (2 * classes_per_batch))
        if batches_per_epoch < 1:
            raise ValueError(f"{self._name}: batches_per_epoch={batches_per_epoch} must be at least 1")
        if refresh_every is None:
            refresh_every = batches_per_epoch
        if refresh_every < 1:
            raise ValueError(f"{self._name}: refresh_every={refresh_every} must be at least 1")

        # Class c's examples are by_class[class_starts[c]:class_starts[c] + class_sizes[c]].
        self._by_class = np.argsort(inverse, kind="stable")
        self._class_sizes = counts
        self._class_starts = np.cumsum(counts) - counts
        self.classes_per_batch = classes_per_batch
        self.candidate_classes = candidate_classes
        self.examples_per_class = examples_per_class
        self.batches_per_epoch = batches_per_epoch
        self.refresh_every = refresh_every
        self.distance = DotProductSimilarity(normalize_embeddings=False) if distance is None else distance
        self.seed = seed
        self.num_replicas, self.rank = num_replicas, rank
        self.epoch = 0
        self._embed_fn = embed_fn
        self._eval_modules = []
        self._attached_trainer = None
        self._warned_no_model = False
        self._class_embeddings = None
        # Batch count at which each class was last embedded (never: far in the past).
        self._embedded_at = np.full(num_classes, -(2**62), dtype=np.int64)
        c_f.add_to_recordable_attributes(self, list_of_names=["mining_seconds", "mined_batches", "embedded_examples"])

    def __len__(self):
        return self.batches_per_epoch * 2 * self.classes_per_batch // self.num_replicas

    def set_epoch(self, epoch):
        self.epoch = epoch

    _STATE = ("epoch", "mining_seconds", "mined_batches", "embedded_examples", "_embedded_at", "_class_embeddings")

    def state_dict(self):
        return {name: copy.deepcopy(getattr(self, name)) for name in self._STATE}

    def load_state_dict(self, state):
        for name in self._STATE:
            setattr(self, name, copy.deepcopy(state[name]))

    def __iter__(self):
        # NumPy rather than torch: per-batch work is many tiny operations, and NumPy's
        # per-call overhead is several times lower.
        rng = np.random.default_rng([self.seed, self.epoch])
        self.epoch += 1
        for _ in range(self.batches_per_epoch):
            # Lazily, one batch at a time, so that each batch is mined with the model
            # as it is when the DataLoader asks for it.
            start = time.perf_counter()
            batch = self._mine_batch(rng)
            self.mining_seconds += time.perf_counter() - start
            self.mined_batches += 1
            shard = len(batch) // self.num_replicas
            yield from batch[self.rank * shard : (self.rank + 1) * shard].tolist()
        if self._embed_fn is None and not self._warned_no_model:
            self._warned_no_model = True
            warnings.warn(
                f"{self._name}: an epoch ended without a model attached, so its batches held classes "
                "drawn at random, not mined. In PML's trainers, attach the model being trained before "
                "trainer.train(): sampler.attach(model, dataset, device=...) or sampler.attach_trainer(trainer) "
                "(or pass end_of_iteration_hook=sampler.end_of_iteration_hook). Warned once per sampler.",
                NoModelAttachedWarning,
                stacklevel=2,
            )

    # --- attaching a model -------------------------------------------------------------

    def attach(self, model, dataset, device=None, collate_fn=None, data_getter=None, batch_size=256, modules=None):
        """Mine with ``model`` (a callable mapping a batch of inputs to embeddings) on
        ``dataset``: items are collated with ``collate_fn`` (default: PyTorch's),
        ``data_getter(batch)`` picks the inputs (default: ``batch[0]``) and they are
        moved to ``device`` (default: where a ``torch.nn.Module`` model's parameters are, so
        a model on a GPU gets its inputs there). ``modules`` are put in eval mode while
        embedding (default: ``model`` itself when it is a ``torch.nn.Module``)."""
        if device is None and isinstance(model, torch.nn.Module):
            device = next((p.device for p in model.parameters()), None)
        collate_fn = collate_fn or torch.utils.data.default_collate
        data_getter = data_getter or (lambda batch: batch[0])

        def embed(indices):
            chunks = []
            for chunk in indices.split(batch_size):
                data = data_getter(collate_fn([dataset[i] for i in chunk.tolist()]))
                if device is not None:
                    data = c_f.to_device(data, device=device)
                chunks.append(model(data))
            return torch.cat(chunks)

        if modules is None:
            modules = [model] if isinstance(model, torch.nn.Module) else []
        self._embed_fn = embed
        self._eval_modules = list(modules)

    def attach_trainer(self, trainer, batch_size=256):
        """Mine with a PML trainer's current models (trunk, then embedder) on its
        dataset, with its collate function, data getter, device and dtype. Raises
        ValueError when the trainer's batch size would cut across the mined pairs."""
        expected = 2 * self.classes_per_batch // self.num_replicas
        if getattr(trainer, "batch_size", expected) != expected:
            per_process = f" / num_replicas={self.num_replicas}" if self.num_replicas > 1 else ""
            raise ValueError(
                f"{self._name}: the trainer's batch_size is {trainer.batch_size}, but its batches "
                f"hold 2 * classes_per_batch{per_process} = {expected} samples; "
                f"use batch_size={expected} or classes_per_batch={trainer.batch_size * self.num_replicas // 2}"
            )
        self.attach(
            trainer.compute_embeddings,
            trainer.dataset,
            collate_fn=trainer.collate_fn,
            data_getter=lambda batch: trainer.data_and_label_getter(batch)[0],
            batch_size=batch_size,
            modules=list(trainer.models.values()),
        )
        self._attached_trainer = trainer

    def end_of_iteration_hook(self, trainer):
        """A PML ``end_of_iteration_hook``: attaches ``trainer`` the first time. Batches
        already prefetched by the DataLoader stay random."""
        if self._attached_trainer is not trainer:
            self.attach_trainer(trainer)

    # --- mining --------------------------------------------------------------------------

    def _mine_batch(self, rng):
        num_classes = len(self._class_sizes)
        if self._embed_fn is None:
            chosen = rng.choice(num_classes, self.classes_per_batch, replace=False)
        else:
            candidates = rng.choice(num_classes, self.candidate_classes, replace=False)
            class_embeddings = self._candidate_embeddings(candidates, rng)
            similarities = self.distance(class_embeddings)
            if not self.distance.is_inverted:
                similarities = -similarities
            chosen = candidates[greedy_hard_negative_classes(similarities.cpu().numpy(), self.classes_per_batch, rng)]
        return self._draw(chosen, 2, rng).ravel()

    def _candidate_embeddings(self, candidates, rng):
        """g_c for each candidate, re-embedding the stale ones."""
        batch_number = self.mined_batches
        stale = candidates[self._embedded_at[candidates] <= batch_number - self.refresh_every]
        if len(stale) > 0:
            examples = torch.from_numpy(self._draw(stale, self.examples_per_class, rng).ravel())
            embeddings = self._embed(examples)
            check_embeddings(self._name, embeddings=embeddings)
            if embeddings.ndim != 2 or len(embeddings) != len(examples):
                raise ValueError(
                    f"{self._name}: the model returned shape {tuple(embeddings.shape)} for "
                    f"{len(examples)} examples; expected ({len(examples)}, dim)"
                )
            if self._class_embeddings is None:
                self._class_embeddings = embeddings.new_zeros(len(self._class_sizes), embeddings.shape[1])
            self._class_embeddings[torch.from_numpy(stale).to(embeddings.device)] = embeddings.reshape(
                len(stale), self.examples_per_class, -1
            ).mean(dim=1)
            self._embedded_at[stale] = batch_number
            self.embedded_examples += len(examples)
        return self._class_embeddings[torch.from_numpy(candidates).to(self._class_embeddings.device)]

    def _embed(self, indices):
        modes = [(m, m.training) for module in self._eval_modules for m in module.modules()]
        try:
            for module in self._eval_modules:
                module.eval()
            with torch.no_grad():
                return self._embed_fn(indices)
        finally:
            # Restore each submodule's own flag: train(mode) on the parent would
            # overwrite e.g. a batch-norm layer frozen in eval mode.
            for module, training in modes:
                module.training = training

    def _draw(self, classes, count, rng):
        """(len(classes), count) dataset indices, `count` (1 or 2) distinct examples of
        each class, uniformly: a first one, then one of the others."""
        sizes = self._class_sizes[classes]
        offsets = [rng.integers(sizes)]
        if count == 2:
            offsets.append((offsets[0] + 1 + rng.integers(sizes - 1)) % sizes)
        return self._by_class[self._class_starts[classes][:, None] + np.stack(offsets, axis=1)]


def greedy_hard_negative_classes(similarities, n, rng=None):
    """Step 2 of hard negative class mining on a (C, C) array of similarities between
    candidate classes (row: the selected class, column: the candidate): start from a
    random class, then repeatedly add the unselected class c maximising
    max over selected s of similarities[s, c], ties broken at random. ``rng`` is a
    NumPy Generator or a seed. Returns the selected positions, in selection order."""
    similarities = np.asarray(similarities)
    rng = np.random.default_rng(rng)
    selected = [int(rng.integers(len(similarities)))]
    violation = similarities[selected[0]].astype(np.float64)  # max over the selected, per candidate
    for _ in range(n - 1):
        violation[selected] = -np.inf
        ties = np.flatnonzero(violation == violation.max())
        pick = int(ties[rng.integers(len(ties))] if len(ties) > 1 else ties[0])
        selected.append(pick)
        np.maximum(violation, similarities[pick], out=violation)
    return np.array(selected)
