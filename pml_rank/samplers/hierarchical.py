"""PML's `HierarchicalSampler` as the batch sampler PML's trainers accept."""

import torch
from pytorch_metric_learning import samplers as pml_samplers


class HierarchicalBatchSampler(pml_samplers.HierarchicalSampler, torch.utils.data.BatchSampler):
    """PML's ``HierarchicalSampler`` (FastAP's category batches, Cakir et al. 2019) that is
    also a ``torch.utils.data.BatchSampler``.

    PML's trainers hand a ``BatchSampler`` to their DataLoader as ``batch_sampler`` and any
    other sampler as ``sampler``; PML's class yields whole batches but is a plain
    ``Sampler``, so ``MetricLossOnly(..., sampler=HierarchicalSampler(...))`` fails. This
    class only changes that type: arguments, batches and length are PML's. Its ``labels``
    are (class, category) rows; give the trainer a dataset with the same labels: the trainer
    hands its loss column ``label_hierarchy_level`` (default 0), the classes::

        sampler = HierarchicalBatchSampler(labels, batch_size=32, samples_per_class=4)
        trainer = MetricLossOnly(..., batch_size=32, sampler=sampler)
    """
