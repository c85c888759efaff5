"""AUCLoss (AUC-BH, Gajić et al. 2022) against Algorithm 1 written out, plus its table and training."""

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch
from pytorch_metric_learning import miners
from pytorch_metric_learning.distances import LpDistance
from pytorch_metric_learning.utils import loss_and_miner_utils as lmu
from pytorch_metric_learning.utils.distributed import DistributedLossWrapper

from pml_rank import registry
from pml_rank.harness import speed
from pml_rank.harness.references.auc import auc_bh_loss
from pml_rank.losses import AUCLoss
from pml_rank.losses.auc import default_slope, exact_roc_area, relaxed_roc_area, slope_table, thresholds

ROOT = Path(__file__).resolve().parents[2]


def clustered_batch(seed, noise, classes=32, per_class=4, dim=64, dtype=torch.float64):
    """Embeddings scattered around random unit class centres: small noise separates the
    classes, large noise makes them overlap."""
    generator = torch.Generator().manual_seed(seed)
    centres = torch.nn.functional.normalize(torch.randn(classes, dim, generator=generator), dim=1)
    labels = torch.arange(classes).repeat_interleave(per_class)
    embeddings = centres[labels] + noise * torch.randn(len(labels), dim, generator=generator) / math.sqrt(dim)
    return embeddings.to(dtype).requires_grad_(), labels


def random_batch(seed, size=24, dim=6, classes=5, dtype=torch.float64):
    generator = torch.Generator().manual_seed(seed)
    embeddings = torch.randn(size, dim, generator=generator, dtype=dtype).requires_grad_()
    return embeddings, torch.randint(classes, (size,), generator=generator)


def value_and_grad(fn, *tensors):
    value = fn()
    return value.detach(), torch.autograd.grad(value, tensors)


# Small steps and slopes keep the sigmoids overlapping, so every similarity gets a gradient.
SETTINGS = [
    dict(step=0.1, slope=5.0),
    dict(step=0.05, slope=30.0),
    dict(step=0.01, slope=200.0),
    dict(step=0.25, slope=8.0, t_min=-0.5, t_max=1.0),
]


@pytest.mark.parametrize("settings", SETTINGS)
@pytest.mark.parametrize("seed", [0, 1])
def test_value_and_gradient_equal_algorithm_1(settings, seed):
    embeddings, labels = random_batch(seed)
    ours = value_and_grad(lambda: AUCLoss(**settings)(embeddings, labels), embeddings)
    reference = value_and_grad(lambda: auc_bh_loss(embeddings, labels, **settings), embeddings)
    torch.testing.assert_close(ours, reference)


def test_ref_emb_and_ref_labels_equal_algorithm_1():
    embeddings, labels = random_batch(2, size=10)
    ref_emb, ref_labels = random_batch(3, size=30)
    settings = dict(step=0.05, slope=20.0)
    ours = value_and_grad(
        lambda: AUCLoss(**settings)(embeddings, labels, ref_emb=ref_emb, ref_labels=ref_labels), embeddings, ref_emb
    )
    reference = value_and_grad(
        lambda: auc_bh_loss(embeddings, labels, ref_emb=ref_emb, ref_labels=ref_labels, **settings), embeddings, ref_emb
    )
    torch.testing.assert_close(ours, reference)
    assert ours[1][1].abs().sum() > 0  # the reference set gets gradients too


@pytest.mark.parametrize("use_ref", [False, True])
def test_batch_hard_miner_triplets_give_the_same_loss_and_gradient(use_ref):
    embeddings, labels = random_batch(4, size=40, classes=6)
    ref_emb, ref_labels = random_batch(5, size=30, classes=6) if use_ref else (None, None)
    loss = AUCLoss(step=0.05, slope=20.0)
    triplets = miners.BatchHardMiner()(embeddings, labels, ref_emb, ref_labels)
    tensors = (embeddings,) if ref_emb is None else (embeddings, ref_emb)
    internal = value_and_grad(lambda: loss(embeddings, labels, None, ref_emb, ref_labels), *tensors)
    mined = value_and_grad(lambda: loss(embeddings, labels, triplets, ref_emb, ref_labels), *tensors)
    torch.testing.assert_close(mined, internal)


def test_all_pairs_as_indices_tuple_give_the_internal_loss():
    """DistributedLossWrapper(efficient=True) passes every pair as an indices_tuple."""
    embeddings, labels = random_batch(6, size=30)
    loss = AUCLoss(step=0.05, slope=20.0)
    pairs = lmu.get_all_pairs_indices(labels)
    torch.testing.assert_close(
        value_and_grad(lambda: loss(embeddings, labels, pairs), embeddings),
        value_and_grad(lambda: loss(embeddings, labels), embeddings),
    )


def test_mined_pairs_restrict_the_candidates():
    """With a subset of pairs, each anchor's hardest pair is chosen among those only."""
    embeddings, labels = random_batch(7, size=30)
    a1, p, a2, n = lmu.get_all_pairs_indices(labels)
    keep_pos, keep_neg = torch.arange(len(a1)) % 2 == 0, torch.arange(len(a2)) % 3 == 0
    subset = (a1[keep_pos], p[keep_pos], a2[keep_neg], n[keep_neg])
    loss = AUCLoss(step=0.05, slope=20.0)
    anchors, positives, negatives = loss.hardest_triplets(embeddings, labels, subset, embeddings, labels)
    similarity = torch.nn.functional.normalize(embeddings, dim=1) @ torch.nn.functional.normalize(embeddings, dim=1).T
    for anchor, positive, negative in zip(anchors.tolist(), positives.tolist(), negatives.tolist()):
        candidates_pos = subset[1][subset[0] == anchor]
        candidates_neg = subset[3][subset[2] == anchor]
        assert similarity[anchor, positive] == similarity[anchor, candidates_pos].min()
        assert similarity[anchor, negative] == similarity[anchor, candidates_neg].max()
    expected = {a for a in range(30) if (subset[0] == a).any() and (subset[2] == a).any()}
    assert set(anchors.tolist()) == expected


def test_anchors_without_positive_or_negative_are_left_out():
    embeddings, labels = random_batch(8, size=12)
    labels = torch.tensor([0, 0, 0, 1, 1, 2, 3, 4, 4, 5, 6, 6])  # classes 2, 3, 5 are singletons
    loss = AUCLoss(step=0.05, slope=20.0)
    ours = value_and_grad(lambda: loss(embeddings, labels), embeddings)
    assert loss.num_anchors == 9
    torch.testing.assert_close(
        ours, value_and_grad(lambda: auc_bh_loss(embeddings, labels, step=0.05, slope=20.0), embeddings)
    )
    assert ours[1][0].abs().sum() > 0


@pytest.mark.parametrize(
    "labels", [torch.arange(6), torch.zeros(6, dtype=torch.long)], ids=["no positives", "no negatives"]
)
def test_batch_with_no_usable_anchor_gives_zero_loss(labels):
    embeddings = torch.randn(6, 4, requires_grad=True)
    loss_func = AUCLoss()
    loss = loss_func(embeddings, labels)
    assert loss.item() == 0 and loss_func.num_anchors == 0
    assert auc_bh_loss(embeddings, labels, step=0.01, slope=1.0) is None
    loss.backward()  # PML's zero loss stays usable in a training loop


def test_labels_or_indices_tuple_required():
    with pytest.raises(ValueError, match="AUCLoss: labels are required"):
        AUCLoss()(torch.randn(4, 3))


@pytest.mark.parametrize("noise, low, high", [(1.3, 0.2, 0.8), (0.9, 0.95, 1.0)], ids=["overlapping", "separated"])
@pytest.mark.parametrize("seed", range(4))
def test_default_relaxation_is_within_001_of_the_exact_area(noise, low, high, seed):
    embeddings, labels = clustered_batch(seed, noise)
    loss_func = AUCLoss()
    relaxed = 1 - loss_func(embeddings, labels).item()
    anchors, positives, negatives = loss_func.hardest_triplets(embeddings, labels, None, embeddings, labels)
    normalized = torch.nn.functional.normalize(embeddings.detach(), dim=1)
    exact = exact_roc_area(
        (normalized[anchors] * normalized[positives]).sum(1), (normalized[anchors] * normalized[negatives]).sum(1)
    ).item()
    assert low < exact < high  # the batch is in the regime the test claims
    assert abs(relaxed - exact) < 0.01


def test_default_slope_comes_from_the_shipped_table():
    table = slope_table()
    assert len(table["steps"]) == len(table["slopes"]) >= 3
    assert table["steps"] == sorted(table["steps"]) and all(s > 0 for s in table["slopes"])
    for step, slope in zip(table["steps"], table["slopes"]):
        assert AUCLoss(step=step).slope == pytest.approx(slope)
    assert AUCLoss().step in table["steps"]
    assert AUCLoss(slope=7.5).slope == 7.5


def test_slope_between_table_steps_is_interpolated():
    table = slope_table()
    (s0, s1), (k0, k1) = table["steps"][:2], table["slopes"][:2]
    between = default_slope(math.sqrt(s0 * s1))
    assert between == pytest.approx(math.sqrt(k0 * k1))


@pytest.mark.parametrize("step", [1e-5, 1.5])
def test_step_outside_the_table_asks_for_a_slope(step):
    with pytest.raises(ValueError, match=rf"AUCLoss: no tabulated slope for step={step}.*Pass slope="):
        AUCLoss(step=step, t_min=-1.5, t_max=1.5)
    AUCLoss(step=step, slope=10.0, t_min=-1.5, t_max=1.5)


def test_thresholds_run_from_t_min_to_t_max_inclusive():
    """Algorithm 1's line 5 stops at t_max - Δs (left ends); line 11 adds Δs, so the
    sigmoids are evaluated at t_max too, as the paper's text says (S + 1 thresholds)."""
    grid = thresholds(0.25, -0.5, 1.0, dtype=torch.float64)
    torch.testing.assert_close(grid, torch.tensor([-0.5, -0.25, 0.0, 0.25, 0.5, 0.75, 1.0], dtype=torch.float64))


def test_pairs_inside_the_last_interval_count():
    """HNS and HPS both above t_max - Δs: the last interval [t_max - Δs, t_max] holds
    the whole ROC curve; a steep slope makes them a tie inside it, counted half."""
    area = relaxed_roc_area(torch.tensor([0.998]), torch.tensor([0.992]), thresholds(0.01), slope=1e5)
    assert area.item() == pytest.approx(0.5)


def test_steep_relaxation_of_well_spread_scores_is_the_exact_area():
    generator = torch.Generator().manual_seed(9)
    hps, hns = (
        torch.rand(50, generator=generator, dtype=torch.float64),
        torch.rand(60, generator=generator, dtype=torch.float64),
    )
    hps, hns = (hps * 1.8 - 0.9), (hns * 1.8 - 0.9)
    hps, hns = hps[(hps * 1000 % 1 - 0.5).abs() < 0.3], hns[(hns * 1000 % 1 - 0.5).abs() < 0.3]  # off the grid
    area = relaxed_roc_area(hps, hns, thresholds(0.001, dtype=torch.float64), slope=1e6)
    assert area.item() == pytest.approx(exact_roc_area(hps, hns).item(), abs=1e-9)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(step=0), "step must be a finite number > 0, got 0"),
        (
            dict(step=0.03),
            r"\(t_max - t_min\) / step must be a whole number of at least 1, got \(1.0 - -1.0\) / 0.03 = 66.6667",
        ),
        (dict(t_min=1.0, t_max=-1.0), "t_min must be below t_max"),
        (dict(t_min=float("nan")), "t_min must be a finite number, got nan"),
        (dict(slope=-2.0), "slope must be a finite number > 0, got -2.0"),
        (dict(slope=float("inf")), "slope must be a finite number > 0, got inf"),
        (dict(distance=LpDistance()), "the distance must be a similarity.*LpDistance"),
    ],
)
def test_bad_parameters_are_rejected_by_name(kwargs, message):
    with pytest.raises(ValueError, match=rf"AUCLoss: {message}"):
        AUCLoss(**kwargs)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_embeddings_are_rejected(value):
    embeddings = torch.randn(8, 4)
    embeddings[3, 2] = value
    with pytest.raises(ValueError, match=r"AUCLoss: embeddings contains 1 NaN/Inf"):
        AUCLoss()(embeddings, torch.arange(8) // 2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_gives_finite_loss_and_gradient_near_float32(dtype):
    embeddings, labels = clustered_batch(10, noise=1.3, dtype=torch.float32)
    half = embeddings.detach().to(dtype).requires_grad_()
    loss = AUCLoss()(half, labels)
    loss.backward()
    assert loss.dtype == torch.float32 and torch.isfinite(loss)  # computed in float32
    assert half.grad.dtype == dtype
    assert torch.isfinite(half.grad).all() and half.grad.abs().sum() > 0
    assert abs(loss.item() - AUCLoss()(embeddings, labels).item()) < 0.05


def test_works_inside_distributed_loss_wrapper():
    embeddings, labels = random_batch(11, size=20)
    wrapped = DistributedLossWrapper(AUCLoss(step=0.05, slope=20.0))
    with pytest.warns(UserWarning, match="non-distributed"):
        value = wrapped(embeddings, labels)
    assert value.item() == pytest.approx(auc_bh_loss(embeddings, labels, step=0.05, slope=20.0).item())


def test_records_statistics():
    embeddings, labels = random_batch(12, size=20)
    loss = AUCLoss(step=0.05, slope=20.0, collect_stats=True)
    loss(embeddings, labels)
    anchors, positives, negatives = loss.hardest_triplets(embeddings, labels, None, embeddings, labels)
    normalized = torch.nn.functional.normalize(embeddings.detach(), dim=1)
    assert loss.num_anchors == len(anchors)
    assert loss.mean_hardest_pos_sim == pytest.approx(
        (normalized[anchors] * normalized[positives]).sum(1).mean().item()
    )
    assert loss.mean_hardest_neg_sim == pytest.approx(
        (normalized[anchors] * normalized[negatives]).sum(1).mean().item()
    )
    assert {"num_anchors", "mean_hardest_pos_sim", "mean_hardest_neg_sim"} <= set(loss._record_these_stats)
    assert {"step", "slope", "t_min", "t_max"} <= set(loss._record_these)


def test_registered_as_a_plugin_component():
    assert registry.losses()["AUCLoss"] is AUCLoss


def test_speed_case_times_ours_the_reference_and_the_floor():
    result = speed.measure("AUCLoss", sizes=(16,), dim=4, repeats=1, warmup=0, progress=False)
    assert set(result["rows"][0]["seconds"]) == {"ours", "reference", "floor"}


def test_slope_table_script_smoke(tmp_path):
    spec = importlib.util.spec_from_file_location("auc_slope_table", ROOT / "examples" / "auc_slope_table.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path / "slopes.json"
    script.main(["--smoke", "--out", str(out)])
    table = json.loads(out.read_text())
    assert len(table["steps"]) == len(table["slopes"]) > 0 and all(s > 0 for s in table["slopes"])
    assert (tmp_path / "auc_slope_table.png").stat().st_size > 0


def map_at_r(model, features, labels):
    from pytorch_metric_learning.utils.accuracy_calculator import AccuracyCalculator

    with torch.no_grad():
        embeddings = model(features)
    calculator = AccuracyCalculator(include=("mean_average_precision_at_r",), k="max_bin_count")
    return calculator.get_accuracy(embeddings, labels)["mean_average_precision_at_r"]


def digit_pairs(images, digits, generator, per_class=16):
    """Two digit images side by side, class ``10 * left + right``: 100 classes."""
    features, labels = [], []
    for left in range(10):
        for right in range(10):
            pick = [(digits == d).nonzero().squeeze(1) for d in (left, right)]
            chosen = [p[torch.randint(len(p), (per_class,), generator=generator)] for p in pick]
            features.append(torch.cat([images[chosen[0]], images[chosen[1]]], dim=1))
            labels += [10 * left + right] * per_class
    return torch.cat(features), torch.tensor(labels)


def test_training_with_batch_hard_miner_raises_map_at_r_on_held_out_classes(one_thread):
    """AUCLoss + BatchHardMiner in PML's MetricLossOnly on scikit-learn's digits.

    Classes are pairs of digits side by side; training sees the 50 pairs with an even
    digit sum made from one half of the images, evaluation the 50 pairs with an odd sum
    made from the other half (held-out classes and held-out images), against the same
    network untrained. (Training on digits 0-4 and evaluating on 5-9 lowers MAP@R for
    every loss we tried, PML's included: five classes teach nothing that transfers.)
    """
    from pytorch_metric_learning import samplers, trainers
    from sklearn.datasets import load_digits

    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    digits = load_digits()
    images, targets = torch.tensor(digits.data, dtype=torch.float32) / 16, torch.tensor(digits.target)
    half = len(images) // 2
    train_x, train_y = digit_pairs(images[:half], targets[:half], generator)
    test_x, test_y = digit_pairs(images[half:], targets[half:], generator)
    train, held_out = (train_y // 10 + train_y % 10) % 2 == 0, (test_y // 10 + test_y % 10) % 2 == 1
    train_x, train_y, test_x, test_y = train_x[train], train_y[train], test_x[held_out], test_y[held_out]

    model = torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.ReLU(), torch.nn.Linear(128, 32))
    before = map_at_r(model, test_x, test_y)
    dataset = torch.utils.data.TensorDataset(train_x, train_y)
    trainer = trainers.MetricLossOnly(
        models={"trunk": model, "embedder": torch.nn.Identity()},
        optimizers={"trunk_optimizer": torch.optim.Adam(model.parameters(), lr=1e-3)},
        batch_size=128,
        loss_funcs={"metric_loss": AUCLoss()},
        mining_funcs={"tuple_miner": miners.BatchHardMiner()},
        dataset=dataset,
        sampler=samplers.MPerClassSampler(train_y, m=4, length_before_new_iter=len(dataset) * 8),
        dataloader_num_workers=0,
        data_device=torch.device("cpu"),
    )
    trainer.train(num_epochs=4)
    model.eval()
    after = map_at_r(model, test_x, test_y)
    assert after > before + 0.2, (before, after)
