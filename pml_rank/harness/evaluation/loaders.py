"""One set of loader processes for every embedding pass of an experiment.

PML's tester builds a new `DataLoader` for every pass over a data set (every validation after
an epoch, the test pass), which starts its ``dataloader_num_workers`` processes and ends them
after the pass: with 4 processes, 0.17 s a pass on this 2-core CPU for 96 images that take
0.05 s to decode, and far longer where starting a process is slow (a sandboxed GPU machine).
`EmbeddingLoaders` starts them once, at the first pass, over every data set the experiment
embeds; each pass gives PML's tester the batches its own loader would have given.
"""

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


class EmbeddingLoaders:
    """Loader processes (`workers` > 0 of them) that live until `close` and serve the passes
    over `datasets` in order, `batch_size` items a batch, collated by torch's default, as
    PML's evaluation loader (``c_f.get_eval_dataloader``) would. The processes start at
    the first pass; they hold the data sets as they were then."""

    def __init__(self, datasets, batch_size, workers):
        self.datasets, self.batch_size = list(datasets), int(batch_size)
        self._current = _CurrentPass()
        self._loader = torch.utils.data.DataLoader(
            _Keyed(self.datasets), batch_sampler=self._current, num_workers=workers, persistent_workers=True
        )
        self._passes = 0

    def pass_over(self, dataset):
        """One pass over `dataset` (one of `datasets`, the same object): an iterable of its
        batches with the ``dataset`` attribute PML's tester reads; None for another data set."""
        which = next((k for k, held in enumerate(self.datasets) if held is dataset), None)
        return None if which is None else _Pass(self, which)

    def _iterate(self, which):
        size, count = self.batch_size, len(self.datasets[which])
        self._current.batches = [[(which, i) for i in range(s, min(s + size, count))] for s in range(0, count, size)]
        if self._passes:
            # A new DataLoader iterator draws its processes' base seed from torch's generator;
            # the persistent one draws it once. Drawing it for every later pass leaves the
            # generator where PML's loader, one a pass, left it: the training that follows
            # draws the same numbers.
            torch.empty((), dtype=torch.int64).random_()
        self._passes += 1
        return iter(self._loader)

    def close(self):
        """Ends the processes (they end with the loader's last reference)."""
        self._loader = None


class _Pass:
    def __init__(self, loaders, which):
        self.loaders, self.which, self.dataset = loaders, which, loaders.datasets[which]

    def __len__(self):
        return math.ceil(len(self.dataset) / self.loaders.batch_size)

    def __iter__(self):
        return self.loaders._iterate(self.which)


@contextlib.contextmanager
def embedding_loaders(datasets, batch_size, workers):
    """`EmbeddingLoaders` over `datasets` inside the block, closed after it; None without
    loader processes (`workers` 0: PML's loader reads in the calling process, which costs
    nothing to start)."""
    if not workers:
        yield None
        return
    loaders = EmbeddingLoaders(datasets, batch_size, workers)
    try:
        yield loaders
    finally:
        loaders.close()
