"""`HierarchicalBatchSampler`: PML's HierarchicalSampler in the type PML's trainers need, so
FastAP's category batches reach `MetricLossOnly` through its `sampler` argument."""

import torch
from pytorch_metric_learning import samplers as pml_samplers
from pytorch_metric_learning import trainers

from pml_rank.losses import FastAPLoss
from pml_rank.samplers import HierarchicalBatchSampler


class _RecordingFastAP(FastAPLoss):
    def __init__(self):
        super().__init__()
        self.batches = []

    def forward(self, embeddings, labels, *args, **kwargs):
        self.batches.append(labels.clone())
        return super().forward(embeddings, labels, *args, **kwargs)


def _category_data(classes=16, per_class=8, classes_per_category=4):
    torch.manual_seed(0)
    class_labels = torch.arange(classes).repeat_interleave(per_class)
    labels = torch.stack([class_labels, class_labels // classes_per_category], dim=1)
    data = torch.randn(len(labels), 8)
    return torch.utils.data.TensorDataset(data, labels), labels


def _trainer(sampler, dataset, loss, batch_size):
    model = torch.nn.Linear(8, 4)
    return trainers.MetricLossOnly(
        models={"trunk": model},
        optimizers={"trunk_optimizer": torch.optim.SGD(model.parameters(), lr=0.1)},
        batch_size=batch_size,
        loss_funcs={"metric_loss": loss},
        dataset=dataset,
        sampler=sampler,
        dataloader_num_workers=0,
    )


def test_pmls_trainer_trains_on_exactly_the_samplers_batches():
    dataset, labels = _category_data()
    batch_size, samples_per_class = 16, 4
    sampler = HierarchicalBatchSampler(labels, batch_size=batch_size, samples_per_class=samples_per_class)
    assert isinstance(sampler, pml_samplers.HierarchicalSampler)
    loss = _RecordingFastAP()
    trainer = _trainer(sampler, dataset, loss, batch_size)
    trainer.train(num_epochs=1)
    assert trainer.iterations_per_epoch == len(sampler) == len(loss.batches)
    category_of = dict(labels.tolist())
    for batch in loss.batches:  # the classes only (the trainer's default label_hierarchy_level=0)
        assert batch.shape == (batch_size,)
        counts = torch.bincount(batch)
        assert set(counts[counts > 0].tolist()) == {samples_per_class}
        assert len({category_of[c] for c in batch.tolist()}) == sampler.super_classes_per_batch
