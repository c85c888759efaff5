"""The Reality Check protocol's building blocks against hand-computed cases."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pml_rank.harness.evaluation import (
    METRICS,
    LabelledSubset,
    accuracy,
    class_disjoint_split,
    class_partitions,
    concatenate,
    concatenated_and_separated,
    cross_validation_folds,
    mean_and_ci,
    summarize,
)

# ---- splits ---------------------------------------------------------------------------------


def test_class_disjoint_split_takes_the_first_half_of_the_sorted_classes():
    labels = [5, 5, 1, 1, 3, 3, 9, 9, 7]
    # classes 1 3 5 7 9: train on 1 and 3 (the first half, rounded down), test on 5 7 9.
    train, test = class_disjoint_split(labels)
    assert train.tolist() == [2, 3, 4, 5]
    assert test.tolist() == [0, 1, 6, 7, 8]


def test_class_disjoint_split_accepts_tensors_and_rejects_one_class():
    train, test = class_disjoint_split(torch.tensor([0, 1, 2, 3]))
    assert train.tolist() == [0, 1] and test.tolist() == [2, 3]
    with pytest.raises(ValueError, match="at least 2 classes"):
        class_disjoint_split([4, 4, 4])


def test_class_partitions_are_contiguous_quarters():
    assert class_partitions(range(8)) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    # 10 classes: boundaries at 10*k//4 = 0, 2, 5, 7, 10.
    assert class_partitions(range(10)) == [[0, 1], [2, 3, 4], [5, 6], [7, 8, 9]]
    with pytest.raises(ValueError, match="num_folds"):
        class_partitions(range(3), num_folds=4)


def test_cross_validation_folds_validate_each_partition_once():
    labels = np.array([3, 0, 1, 2, 3, 4, 5, 6, 7, 0])
    folds = cross_validation_folds(labels, num_folds=4)
    expected_val_classes = [{0, 1}, {2, 3}, {4, 5}, {6, 7}]
    for (train, val), val_classes in zip(folds, expected_val_classes):
        assert set(labels[val]) == val_classes
        assert set(labels[train]) == set(range(8)) - val_classes
        assert sorted(train.tolist() + val.tolist()) == list(range(len(labels)))
    # Hand-computed first fold: classes 0 and 1 sit at indices 1, 2 and 9.
    assert folds[0][1].tolist() == [1, 2, 9]


def test_labelled_subset_carries_labels():
    class Data(torch.utils.data.Dataset):
        labels = np.array([7, 8, 9, 10])

        def __len__(self):
            return 4

        def __getitem__(self, i):
            return torch.tensor([float(i)]), int(self.labels[i])

    subset = LabelledSubset(Data(), [3, 1])
    assert subset.labels.tolist() == [10, 8]
    assert subset[0][1] == 10 and len(subset) == 2


# ---- metrics --------------------------------------------------------------------------------


def retrieval(correct_ranks, same_class=10, results=10):
    """One query at 0 on a line and references at distances 1, 2, 3, ...: the references at
    `correct_ranks` (1-based, within the first `results`) share the query's class, the other
    first `results` do not, and the query's remaining same-class references come after."""
    positions, labels = [], []
    for rank in range(1, results + 1):
        positions.append(rank)
        labels.append(0 if rank in correct_ranks else 1)
    for extra in range(same_class - len(correct_ranks)):
        positions.append(results + 1 + extra)
        labels.append(0)
    query = torch.zeros(1, 1)
    reference = torch.tensor(positions, dtype=torch.float32).unsqueeze(1)
    return query, np.array([0]), reference, np.array(labels)


@pytest.mark.parametrize(
    "correct, p_at_1, r_precision, map_at_r",
    [
        # The Reality Check paper's table: 10 results, R = 10.
        ({1}, 1.0, 0.1, 0.1),
        ({1, 10}, 1.0, 0.2, (1 / 1 + 2 / 10) / 10),
        ({1, 2}, 1.0, 0.2, (1 / 1 + 2 / 2) / 10),
        (set(range(1, 11)), 1.0, 1.0, 1.0),
        # A miss first: P@1 0; hits at 2 and 3 give (1/2 + 2/3) / 10.
        ({2, 3}, 0.0, 0.2, (1 / 2 + 2 / 3) / 10),
    ],
)
def test_metrics_reproduce_the_reality_check_worked_table(correct, p_at_1, r_precision, map_at_r):
    query, query_labels, reference, reference_labels = retrieval(correct)
    result = accuracy(query, query_labels, reference, reference_labels)
    assert result["precision_at_1"] == pytest.approx(p_at_1)
    assert result["r_precision"] == pytest.approx(r_precision)
    assert result["mean_average_precision_at_r"] == pytest.approx(map_at_r)


def test_metrics_without_reference_exclude_the_query_itself():
    # Classes on a line: A at 0, 1; B at 10, 11.5; C at 20, 40. Every query's nearest other point
    # is its own class except C's two points: 20's nearest is 11.5 (B), 40's is 20 (C).
    embeddings = torch.tensor([[0.0], [1.0], [10.0], [11.5], [20.0], [40.0]])
    labels = np.array([0, 0, 1, 1, 2, 2])
    result = accuracy(embeddings, labels)
    # R = 1 for every query, so P@1 = RP = MAP@R = 5 correct out of 6.
    for name in METRICS:
        assert result[name] == pytest.approx(5 / 6)


def test_concatenate_normalises_each_part_and_the_whole():
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(5, 3, generator=generator) * 7
    b = torch.randn(5, 4, generator=generator)
    joined = concatenate([a, b])
    assert joined.shape == (5, 7)
    assert torch.allclose(joined.norm(dim=1), torch.ones(5))
    # Both parts had norm 1 before the final normalisation, so each is scaled by 1/sqrt(2).
    assert torch.allclose(joined[:, :3] * math.sqrt(2), F.normalize(a, dim=1), atol=1e-6)


def test_concatenated_and_separated():
    # Two "models" on one dimension each: model 1 separates classes 0 and 1 perfectly, model 2
    # puts every point at the same place but one.
    labels = np.array([0, 0, 1, 1])
    model_1 = torch.tensor([[1.0, 0.1], [1.0, 0.2], [-1.0, 0.1], [-1.0, 0.2]])
    model_2 = torch.tensor([[0.0, 1.0], [1.0, 0.0], [0.1, 1.0], [1.0, 0.1]])
    result = concatenated_and_separated([model_1, model_2], labels)
    per_model = [accuracy(F.normalize(m, dim=1), labels) for m in (model_1, model_2)]
    assert per_model[0]["precision_at_1"] == 1.0
    # Model 2: each point's nearest neighbour is of the other class.
    assert per_model[1]["precision_at_1"] == 0.0
    assert result["per_model"] == per_model
    for name in METRICS:
        assert result["separated"][name] == pytest.approx((per_model[0][name] + per_model[1][name]) / 2)
    assert result["concatenated"] == accuracy(concatenate([model_1, model_2]), labels)


# ---- confidence intervals --------------------------------------------------------------------


def test_mean_and_ci_uses_students_t_closed_forms():
    # Two values: 1 degree of freedom, the Cauchy quantile tan(pi (p - 1/2)); three: (2p-1) / sqrt(2p(1-p)).
    for values, quantile in (
        ([1.0, 3.0], math.tan(math.pi * 0.475)),
        ([1.0, 2.0, 4.0], 0.95 / math.sqrt(2 * 0.975 * 0.025)),
    ):
        sem = np.std(values, ddof=1) / math.sqrt(len(values))
        assert mean_and_ci(values)[1] == pytest.approx(quantile * sem, rel=1e-9)


def test_mean_and_ci_by_hand():
    # 1, 2, 3: mean 2, sample sd 1, standard error 1/sqrt(3), t(0.975, 2) = 0.95 / sqrt(0.04875).
    mean, half_width = mean_and_ci([1.0, 2.0, 3.0])
    assert mean == pytest.approx(2.0)
    assert half_width == pytest.approx(0.95 / math.sqrt(0.04875) / math.sqrt(3))
    mean, half_width = mean_and_ci([0.5])
    assert mean == 0.5 and math.isnan(half_width)
    assert mean_and_ci([0.3, 0.3, 0.3]) == (pytest.approx(0.3), 0.0)
    with pytest.raises(ValueError):
        mean_and_ci([])


def test_summarize_over_runs():
    runs = [{"concatenated": {m: v for m in METRICS}, "separated": {m: v / 2 for m in METRICS}} for v in (0.2, 0.4)]
    summary = summarize(runs)
    for m in METRICS:
        assert summary["concatenated"][m] == pytest.approx(mean_and_ci([0.2, 0.4]))
        assert summary["separated"][m] == pytest.approx(mean_and_ci([0.1, 0.2]))


def test_record_keepers_database_commits_without_a_disk_sync(tmp_path):
    from pml_rank.harness.evaluation.training import make_record_keeper

    database = make_record_keeper(tmp_path).record_writer.local_db
    database.write("losses", {"total_loss": [0.5, 0.25]})
    database.open()
    assert database.conn.execute("PRAGMA synchronous").fetchone()[0] == 0  # OFF
    database.conn.close()
    assert [row["total_loss"] for row in database.query("SELECT total_loss FROM losses")] == [0.5, 0.25]


def test_the_raw_input_row_reads_8_bit_images_normalised_as_the_trunks_read_them(tmp_path):
    """The "raw input" row's retrieval on a folder of images: the flattened images as
    torchvision's ToTensor then Normalize give them, L2-normalised (what it was before the
    loaders handed 8-bit images), on the protocol's test classes."""
    from unittest import mock

    from loader_probes import write_image_folder
    from torchvision import transforms

    from pml_rank.harness.datasets import IMAGENET_MEAN, IMAGENET_STD, ImageFolder, image_transforms
    from pml_rank.harness.evaluation import protocol, raw_input_accuracy, test_set_and_folds

    images = ImageFolder(write_image_folder(tmp_path / "images", classes=8, per_class=5), cache_dir=tmp_path)
    transform = image_transforms({"augmentation": "crop-flip", "image_size": 8, "resize": 12}, 3)[1]
    as_floats = transforms.Compose(
        transform.transforms[:-1] + [transforms.ToTensor(), transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD)]
    )
    _, test_set = test_set_and_folds(images, 2, (as_floats, as_floats))
    expected = F.normalize(torch.stack([test_set[i][0] for i in range(len(test_set))]).flatten(1), dim=1)
    with mock.patch.object(protocol, "accuracy", wraps=accuracy) as measured:
        scores = raw_input_accuracy(images, transform)
    [(inputs, labels), _] = measured.call_args
    assert torch.equal(inputs, expected) and list(labels) == list(test_set.labels)
    assert scores == accuracy(expected, test_set.labels)
