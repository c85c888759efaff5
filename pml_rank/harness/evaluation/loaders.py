"""One set of loader processes for every embedding pass of an experiment, and one for every
fold model's training.

PML's tester builds a new `DataLoader` for every pass over a data set (every validation after
an epoch, the test pass), which starts its ``dataloader_num_workers`` processes and ends them
after the pass: with 4 processes, 0.17 s a pass on this 2-core CPU for 96 images that take
0.05 s to decode, and far longer where starting a process is slow (a sandboxed GPU machine).
`EmbeddingLoaders` starts them once, at the first pass, over every data set the experiment
embeds; each pass gives PML's tester the batches its own loader would have given, each read by
all the processes at once (a validation set is often one batch: one process would read it alone).

PML's trainer likewise starts its loader anew for each model and each pass over its sampler,
and every pass starts with no batch read ahead. `TrainingLoaders` starts its processes once,
for every fold model's training set, and reads each model's passes as one stream.
"""

import collections.abc
import contextlib
import math

import torch


class _Keyed(torch.utils.data.Dataset):
    """The items of several data sets, by the key ``(data set number, index)``."""

    def __init__(self, datasets):
        self.datasets = datasets

    def __len__(self):
        return sum(len(dataset) for dataset in self.datasets)

    def __getitem__(self, key):
        which, index = key
        return self.datasets[which][index]


class _CurrentPass:
    """The batch sampler of `EmbeddingLoaders`' loader: the keys of the pass under way."""

    def __init__(self):
        self.batches = []

    def __iter__(self):
        return iter(self.batches)

    def __len__(self):
        return len(self.batches)


def _draw_as_a_new_iterator():
    """Draws from torch's generator what a new DataLoader iterator draws (its processes'
    base seed): where PML would start one and a persistent set of processes does not, the
    generator is left where PML's loader leaves it, and the training draws the same numbers."""
    torch.empty((), dtype=torch.int64).random_()


def _index_of(datasets, dataset):
    """The index of `dataset` (the same object) in `datasets`; None when it is not there."""
    return next((k for k, held in enumerate(datasets) if held is dataset), None)


class EmbeddingLoaders:
    """Loader processes (`workers` > 0 of them) that live until `close` and serve the passes
    over `datasets` in order, `batch_size` items a batch, collated by torch's default, as
    PML's evaluation loader (``c_f.get_eval_dataloader``) would. Each batch is read in
    `workers` pieces, one a process, and put together here (`concatenated`): PML's loader
    gives a batch to one process, so a 96-image validation set in a batch of 128 took one
    process four times as long as four. With a CUDA `device`, the pieces come in pinned
    memory and their tensors of more than one dimension (the images) are put together on the device,
    the same bits: concatenating 96 images of 224 px on the CPU took 38 ms of a 190-ms
    validation on the H200 machine, and copying them from unpinned memory 9 more
    (examples/bench_throughput.py --trace). The processes start at the first pass; they hold
    the data sets as they were then."""

    def __init__(self, datasets, batch_size, workers, device="cpu"):
        self.datasets, self.batch_size, self.workers = list(datasets), int(batch_size), int(workers)
        # Where the pieces' images are put together: a GPU, or None (the CPU, as they come).
        device = torch.device(device)
        self._gathered_on = device if device.type == "cuda" else None
        self._current = _CurrentPass()
        self._loader = torch.utils.data.DataLoader(
            _Keyed(self.datasets),
            batch_sampler=self._current,
            num_workers=workers,
            persistent_workers=True,
            pin_memory=self._gathered_on is not None,
        )
        self._passes = 0

    def pass_over(self, dataset):
        """One pass over `dataset` (one of `datasets`, the same object): an iterable of its
        batches with the ``dataset`` attribute PML's tester reads; None for another data set."""
        which = _index_of(self.datasets, dataset)
        return None if which is None else _Pass(self, which)

    def _iterate(self, which):
        size, count = self.batch_size, len(self.datasets[which])
        batches = [range(s, min(s + size, count)) for s in range(0, count, size)]
        pieces_of = [[[(which, i) for i in piece] for piece in _split(batch, self.workers)] for batch in batches]
        self._current.batches = [piece for pieces in pieces_of for piece in pieces]
        if self._passes:  # the persistent iterator drew it once, PML's loader once a pass
            _draw_as_a_new_iterator()
        self._passes += 1
        read = iter(self._loader)
        return (concatenated([next(read) for _ in pieces], self._gathered_on) for pieces in pieces_of)

    def close(self):
        """Ends the processes (they end with the loader's last reference)."""
        self._loader = None


def _split(items, parts):
    """`items` (a range) in at most `parts` contiguous pieces of near-equal length, none empty."""
    parts = max(1, min(parts, len(items)))
    bounds = [len(items) * k // parts for k in range(parts + 1)]
    return [items[a:b] for a, b in zip(bounds, bounds[1:])]


def concatenated(pieces, device=None):
    """What torch's `default_collate` gives for all the items of `pieces` (each its collation
    of consecutive items) at once: tensors concatenated, strings listed, and the fields of
    mappings, named tuples and sequences put together each; with `device`, tensors of more than
    one dimension (images, not labels) concatenated there (copied without waiting, from pinned
    memory)."""
    first = pieces[0]
    if torch.is_tensor(first):
        if device is not None and first.dim() > 1:
            pieces = [piece.to(device, non_blocking=True) for piece in pieces]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)
    if len(pieces) == 1 and device is None:
        return first
    if isinstance(first, collections.abc.Mapping):
        return {key: concatenated([piece[key] for piece in pieces], device) for key in first}
    if isinstance(first, tuple) and hasattr(first, "_fields"):
        return type(first)(*(concatenated(list(field), device) for field in zip(*pieces)))
    if isinstance(first, (list, tuple)) and all(isinstance(item, str) for item in first):  # a batch of strings
        return type(first)(item for piece in pieces for item in piece)
    if isinstance(first, collections.abc.Sequence):
        return [concatenated(list(field), device) for field in zip(*pieces)]
    raise TypeError(f"EmbeddingLoaders: cannot put together batches of {type(first).__name__}")


class _Pass:
    def __init__(self, loaders, which):
        self.loaders, self.which, self.dataset = loaders, which, loaders.datasets[which]

    def __len__(self):
        return math.ceil(len(self.dataset) / self.loaders.batch_size)

    def __iter__(self):
        return self.loaders._iterate(self.which)


@contextlib.contextmanager
def embedding_loaders(datasets, batch_size, workers, device="cpu"):
    """`EmbeddingLoaders` over `datasets` (embedded on `device`) inside the block, closed after
    it; None without loader processes (`workers` 0: PML's loader reads in the calling process,
    which costs nothing to start)."""
    if not workers:
        yield None
        return
    loaders = EmbeddingLoaders(datasets, batch_size, workers, device)
    try:
        yield loaders
    finally:
        loaders.close()


class TrainingLoaders:
    """Loader processes (`workers` > 0 of them) that live until `close` and read the training
    batches over `datasets` (each fold model's training set), one `stream` at a time, collated
    by torch's default, in pinned memory with `pin_memory` (for a GPU). The processes start at
    the first stream; they hold the data sets as they were then. A stream asks the sampler for
    its next pass a few batches early: the same batches where a pass depends on nothing the
    steps in between change (PML's samplers draw from numpy's generator, which no step draws
    from; one that mines with the network, as `HardNegativeClassSampler`, depends on the steps)."""

    def __init__(self, datasets, workers, pin_memory=False):
        self.datasets = list(datasets)
        self._current = _CurrentPass()
        self._loader = torch.utils.data.DataLoader(
            _Keyed(self.datasets),
            batch_sampler=self._current,
            num_workers=workers,
            persistent_workers=True,
            pin_memory=pin_memory,
        )
        self._streams = 0

    def stream(self, dataset, batches, count):
        """The first `count` batches of `batches` (a batch sampler over `dataset`, one of
        `datasets`, the same object), its passes one after another, as the trainer's loader
        would have read them; None for another data set."""
        which = _index_of(self.datasets, dataset)
        if which is None:
            return None
        stream = _Stream(batches)
        # The keys know nothing of the stream: the loader's iterator, which holds them, ends
        # its processes as soon as the stream and the loader let go of it, not in a garbage cycle.
        self._current.batches = _keys(which, batches, count, stream.pass_starts)
        if self._streams:  # the first stream's iterator, a new one, draws it itself
            _draw_as_a_new_iterator()
        self._streams += 1
        stream.read = iter(self._loader)
        return stream

    def close(self):
        """Ends the processes (they end with the loader's last reference)."""
        self._loader, self._current.batches = None, []


def _keys(which, batches, count, pass_starts):
    """The keys of `_Keyed` of the first `count` batches of the passes of `batches` over data
    set `which`; adds to `pass_starts` the number of each batch that starts a pass (the first
    pass's excepted)."""
    drawn = 0
    while drawn < count:
        if drawn:
            pass_starts.add(drawn)
        start = drawn
        for batch in batches:
            yield [(which, key) for key in batch]
            drawn += 1
            if drawn == count:
                return
        if drawn == start:  # an empty pass: PML's loader would fail on it too
            return


class _Stream:
    """The batches of one model's training, all it reads, as one iterator that is also its
    loader for PML's trainer (its ``len`` is a pass's)."""

    def __init__(self, batches):
        self.batches, self.read, self._taken = batches, None, 0
        # The numbers of the batches that start a pass of `batches`, but the first.
        self.pass_starts = set()

    def __len__(self):
        return len(self.batches)

    def __iter__(self):
        return self

    def __next__(self):
        batch = next(self.read)
        if self._taken in self.pass_starts:
            # PML's trainer starts a new loader iterator at each pass: drawn here, before the
            # same step.
            _draw_as_a_new_iterator()
        self._taken += 1
        return batch


@contextlib.contextmanager
def training_loaders(datasets, workers, pin_memory=False):
    """`TrainingLoaders` over `datasets` inside the block, closed after it; None without
    loader processes (`workers` 0)."""
    if not workers:
        yield None
        return
    loaders = TrainingLoaders(datasets, workers, pin_memory)
    try:
        yield loaders
    finally:
        loaders.close()
