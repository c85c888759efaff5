"""Class-disjoint splits and deterministic cross-validation folds of the Reality Check
protocol (Musgrave et al., ECCV 2020, section "Hyperparameter search via cross
validation")."""

import numpy as np
import torch


def _as_numpy(labels):
    if isinstance(labels, torch.Tensor):
        labels = labels.cpu().numpy()
    labels = np.asarray(labels)
    if labels.ndim != 1:
        raise ValueError(f"labels must be one-dimensional, got shape {labels.shape}")
    return labels


def class_disjoint_split(labels):
    """Indices ``(train, test)``: the first half of the classes (in sorted label order)
    for training and cross-validation, the second half for testing. With an odd number
    of classes the test half gets the extra class. Each index array is sorted."""
    labels = _as_numpy(labels)
    classes = np.unique(labels)
    if len(classes) < 2:
        raise ValueError(f"class_disjoint_split needs at least 2 classes, got {len(classes)}")
    train_classes = classes[: len(classes) // 2]
    in_train = np.isin(labels, train_classes)
    return np.flatnonzero(in_train), np.flatnonzero(~in_train)


def class_partitions(classes, num_folds=4):
    """Splits a sequence of classes into `num_folds` contiguous partitions of (nearly)
    equal size, in order: with 4 folds, the first 25% of the classes make the first
    partition, the next 25% the second, and so on. Returns a list of lists."""
    classes = list(classes)
    if num_folds < 2 or num_folds > len(classes):
        raise ValueError(f"num_folds must be between 2 and the number of classes ({len(classes)}), got {num_folds}")
    bounds = [len(classes) * k // num_folds for k in range(num_folds + 1)]
    return [classes[start:end] for start, end in zip(bounds, bounds[1:])]


def cross_validation_folds(labels, num_folds=4):
    """The folds over a training set: a list of ``(train, val)`` index arrays, one per
    fold, where fold k validates on the k-th contiguous partition of the sorted classes
    (`class_partitions`) and trains on the others. Every class is validated on exactly
    once; train and val never share a class."""
    labels = _as_numpy(labels)
    partitions = class_partitions(np.unique(labels), num_folds)
    folds = []
    for val_classes in partitions:
        in_val = np.isin(labels, val_classes)
        folds.append((np.flatnonzero(~in_val), np.flatnonzero(in_val)))
    return folds


class LabelledSubset(torch.utils.data.Subset):
    """`torch.utils.data.Subset` that also carries the subset's ``labels`` (a numpy
    array), which PML's samplers and the evaluation code read."""

    def __init__(self, dataset, indices):
        super().__init__(dataset, np.asarray(indices))
        self.labels = _as_numpy(dataset.labels)[self.indices]
