"""The Reality Check baselines (`pml_rank.harness.baselines`): every row builds and trains
on a small batch with its defaults, with values drawn from its space by Optuna and at the
corners of its space; parameters reach the PML objects; the loss optimizer's `loss_lr`;
the paper's regularisers against their PML <= 0.9.86 formulas; clear errors."""

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from pytorch_metric_learning import losses, miners

from pml_rank.harness import baselines
from pml_rank.harness.baselines import BASELINES, LOSS_LR, UnknownRowError, build, search_space, split_params
from pml_rank.harness.budget import SHIPPED_PARAMS

optuna = pytest.importorskip("optuna")

ROWS = list(BASELINES)
NUM_CLASSES, PER_CLASS, EMBEDDING_SIZE = 8, 4, 16
README = Path(__file__).parents[2] / "examples" / "README.md"


def batch(seed=0, dtype=torch.float32):
    generator = torch.Generator().manual_seed(seed)
    embeddings = torch.randn(NUM_CLASSES * PER_CLASS, EMBEDDING_SIZE, generator=generator, dtype=dtype)
    labels = torch.arange(NUM_CLASSES).repeat_interleave(PER_CLASS)
    return embeddings.requires_grad_(), labels


def built(row, params=None):
    return build(row, params, num_classes=NUM_CLASSES, embedding_size=EMBEDDING_SIZE)


def loss_value(loss, miner, embeddings, labels):
    indices = miner(embeddings, labels) if miner is not None else None
    return loss(embeddings, labels, indices)


def train_step(row, params=None, seed=0):
    """Builds `row` and computes its loss on one batch; returns (loss value, embeddings, loss object)."""
    loss, miner, _ = built(row, params)
    embeddings, labels = batch(seed)
    value = loss_value(loss, miner, embeddings, labels)
    value.backward()
    return value, embeddings, loss


def assert_finite_with_gradient(row, value, embeddings, loss):
    assert value.dim() == 0 and torch.isfinite(value), f"{row}: loss {value}"
    assert embeddings.grad is not None and torch.isfinite(embeddings.grad).all(), row
    for name, parameter in loss.named_parameters():
        assert parameter.grad is not None and torch.isfinite(parameter.grad).all(), f"{row}: {name}"


@pytest.fixture(autouse=True, scope="module")
def quiet_optuna():
    optuna.logging.set_verbosity(optuna.logging.WARNING)


# ----------------------------------------------------------------------------- the rows


def test_rows_are_the_papers_and_three_more_in_order():
    paper = [
        "ContrastiveLoss",
        "TripletMarginLoss",
        "NTXentLoss",
        "ProxyNCALoss",
        "MarginLoss",
        "MarginLoss",
        "NormalizedSoftmaxLoss",
        "CosFaceLoss",
        "ArcFaceLoss",
        "FastAPLoss",
        "SignalToNoiseRatioContrastiveLoss",
        "MultiSimilarityLoss",
        "MultiSimilarityLoss",
        "SoftTripleLoss",
    ]
    assert [b.loss for b in BASELINES.values()] == [*paper, "SmoothAPLoss", "NPairsLoss", "PNPLoss"]
    assert [b.miner for b in BASELINES.values()].count("MultiSimilarityMiner") == 1
    for row, baseline in BASELINES.items():
        assert baseline.row == row
        assert re.fullmatch(r"pml:[A-Za-z]+[A-Za-z+-]*", row), row  # one shell word, no quoting
        assert row.startswith(f"pml:{baseline.loss}")
        assert baseline.per_class == (2 if baseline.loss == "NPairsLoss" else 4)
        assert isinstance(getattr(losses, baseline.loss), type)
        assert baseline.miner is None or isinstance(getattr(miners, baseline.miner), type)
        assert baseline.source and baseline.batches


def test_the_old_bench_rows_keep_their_names():
    # tuned_glyphs.json and existing bench stores are keyed by these names.
    shipped = json.loads(SHIPPED_PARAMS.read_text())
    for row in [name for name in shipped if name.startswith("pml:")]:
        assert row in BASELINES
        build(row, shipped[row]["params"])  # their tuned values are valid parameters of the rows


@pytest.mark.slow
def test_import_needs_neither_torch_nor_pml():
    code = (
        "import sys\n"
        "from pml_rank.harness import baselines\n"
        "baselines.split_params('pml:ArcFaceLoss', {'margin': 20.0, 'loss_lr': 0.01})\n"
        "baselines.markdown_table()\n"
        "print(sorted(m for m in ('torch', 'pytorch_metric_learning', 'optuna') if m in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_readme_table_is_generated():
    assert baselines.markdown_table() in README.read_text()


def test_a_recording_trial_answers_the_values_it_holds_and_records_every_suggestion():
    def space(trial):
        params = {"memory": trial.suggest_int("memory", 0, 4), "lr": trial.suggest_float("lr", 1e-4, 1.0, log=True)}
        if params["memory"] > 0:  # asked only for some values
            params["variant"] = trial.suggest_categorical("variant", ["rows", "extend"])
        return params

    lowest = baselines.RecordingTrial()
    assert space(lowest) == {"memory": 0, "lr": 1e-4} and lowest.suggested == ["memory", "lr"]
    given = baselines.RecordingTrial({"memory": 3, "variant": "extend"})
    assert space(given) == {"memory": 3, "lr": 1e-4, "variant": "extend"}
    assert [str(r) for r in given.ranges] == [
        "memory [0, 4] integers",
        "lr [0.0001, 1] log",
        "variant in {rows, extend}",
    ]


# ----------------------------------------------------------------------------- building and training


@pytest.mark.parametrize("row", ROWS)
def test_defaults_build_and_give_a_nonzero_gradient(row):
    baseline = BASELINES[row]
    loss, miner, loss_lr = built(row)
    assert isinstance(loss, getattr(losses, baseline.loss))
    assert (miner is None) == (baseline.miner is None)
    assert loss_lr is None
    value, embeddings, loss = train_step(row)
    assert_finite_with_gradient(row, value, embeddings, loss)
    assert embeddings.grad.abs().sum() > 0


@pytest.mark.parametrize("row", ROWS)
def test_values_drawn_by_optuna_build_and_train(row):
    space = search_space(row)
    names = set(BASELINES[row].parameter_names)
    for seed in range(4):
        study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=seed))
        trial = study.ask()
        params = space(trial)
        assert params == trial.params  # what Optuna stores (best_params) is what build takes
        assert set(params) <= names
        value, embeddings, loss = train_step(row, params, seed=seed)
        assert_finite_with_gradient(row, value, embeddings, loss)


@pytest.mark.parametrize("row", ROWS)
@pytest.mark.parametrize("end", ["low", "high"])
def test_corners_of_the_space_build_and_train(row, end):
    params = {r.name: getattr(r, end) for r in baselines.space_ranges(row)}
    value, embeddings, loss = train_step(row, params)
    assert_finite_with_gradient(row, value, embeddings, loss)


@pytest.mark.parametrize("row", [row for row in ROWS if BASELINES[row].paper_cub200])
def test_the_papers_best_values_lie_in_the_space_and_train(row):
    best = dict(BASELINES[row].paper_cub200)
    ranges = {r.name: r for r in baselines.space_ranges(row)}
    assert set(best) == set(ranges)
    for name, value in best.items():
        assert ranges[name].low <= value <= ranges[name].high, (name, value)
    value, embeddings, loss = train_step(row, best)
    assert_finite_with_gradient(row, value, embeddings, loss)


# ----------------------------------------------------------------------------- parameters reach the objects


def test_params_update_the_defaults():
    loss, miner, _ = built("pml:MultiSimilarityLoss+MultiSimilarityMiner", {"alpha": 3.0, "miner_epsilon": 0.3})
    assert (loss.alpha, loss.beta, loss.base, miner.epsilon) == (3.0, 50.0, 0.5, 0.3)
    loss, _, _ = built("pml:ArcFaceLoss", {"margin": 45.0})
    assert loss.margin == pytest.approx(math.pi / 4)  # PML takes degrees
    assert loss.scale == 64.0 and loss.W.shape == (EMBEDDING_SIZE, NUM_CLASSES)
    loss, _, _ = built("pml:SoftTripleLoss", {"gamma": 0.5})
    assert (loss.la, loss.gamma, loss.margin, loss.centers_per_class) == (20.0, 2.0, 0.01, 10)
    assert loss.fc.shape == (EMBEDDING_SIZE, NUM_CLASSES * 10)
    loss, _, _ = built("pml:FastAPLoss", {"num_bins": 17})
    assert loss.num_bins == 17


def test_margin_rows_learn_one_beta_or_one_per_class():
    one, _, _ = built("pml:MarginLoss", {"beta": 0.7})
    per_class, _, _ = build("pml:MarginLoss-per-class", {"beta": 0.7}, num_classes=NUM_CLASSES)
    assert [tuple(p.shape) for p in one.parameters()] == [(1,)]
    assert [tuple(p.shape) for p in per_class.parameters()] == [(NUM_CLASSES,)]
    assert torch.allclose(per_class.beta, torch.full((NUM_CLASSES,), 0.7))
    assert BASELINES["pml:MarginLoss"].loss_weight_decay == 0.0


@pytest.mark.parametrize("row", ROWS)
def test_loss_lr_only_for_losses_with_parameters(row):
    baseline = BASELINES[row]
    loss, _, loss_lr = built(row)
    assert bool(list(loss.parameters())) == bool(baseline.loss_parameters)
    assert (LOSS_LR in baseline.parameter_names) == bool(baseline.loss_parameters)
    if not baseline.loss_parameters:
        with pytest.raises(ValueError, match=rf"{re.escape(row)}: unknown parameter loss_lr = 0.01;.*only for losses"):
            built(row, {LOSS_LR: 0.01})
        return
    assert loss_lr is None  # absent: the trunk's learning rate
    loss, _, loss_lr = built(row, {LOSS_LR: 0.01})
    assert loss_lr == 0.01
    # The loss's parameters train with their own optimizer, as PML's metric_loss_optimizer.
    optimizer = torch.optim.RMSprop(loss.parameters(), lr=loss_lr, weight_decay=baseline.loss_weight_decay or 0.0)
    before = [p.detach().clone() for p in loss.parameters()]
    embeddings, labels = batch()
    loss(embeddings, labels).backward()
    optimizer.step()
    assert any(not torch.equal(old, new) for old, new in zip(before, loss.parameters()))
    for bad in (0, -1e-3, "1e-3", True, float("nan")):
        with pytest.raises(ValueError, match=rf"{re.escape(row)}: parameter loss_lr = "):
            built(row, {LOSS_LR: bad})


# ----------------------------------------------------------------------------- the paper's regularisers


def test_snr_regulariser_is_the_papers_term():
    # PML <= 0.9.86: loss + regularizer_weight * mean_i |sum_j e_ij| of the normalised embeddings.
    weight = 0.37
    embeddings, labels = batch(dtype=torch.float64)
    plain, _, _ = built("pml:SignalToNoiseRatioContrastiveLoss", {"embedding_reg_weight": 0.0})
    regularised, _, _ = built("pml:SignalToNoiseRatioContrastiveLoss", {"embedding_reg_weight": weight})
    assert plain.embedding_regularizer is None
    term = F.normalize(embeddings, dim=1).sum(dim=1).abs().mean()
    assert torch.allclose(regularised(embeddings, labels), plain(embeddings, labels) + weight * term)


def test_soft_triple_regulariser_is_the_papers_term_at_twice_the_weight():
    # PML <= 0.9.86: loss + reg_weight * mean over same-class centre pairs of
    # sqrt(2 + 1e-5 - 2 cos(c_i, c_k)); PML 2.9's SparseCentersRegularizer halves that mean.
    reg_weight = 0.3
    embeddings, labels = batch(dtype=torch.float64)
    torch.manual_seed(5)
    plain, _, _ = built("pml:SoftTripleLoss")
    torch.manual_seed(5)
    regularised, _, _ = built("pml:SoftTripleLoss", {"weight_reg_weight": 2 * reg_weight})
    assert plain.weight_regularizer is None and torch.equal(plain.fc, regularised.fc)
    centres = F.normalize(regularised.fc.detach().double().t(), dim=1).view(NUM_CLASSES, 10, EMBEDDING_SIZE)
    pairs = torch.triu_indices(10, 10, offset=1)
    cosines = torch.einsum("cid,cjd->cij", centres, centres)[:, pairs[0], pairs[1]]
    term = torch.sqrt(2.0 + 1e-5 - 2.0 * cosines).mean()
    difference = regularised(embeddings, labels) - plain(embeddings, labels)
    assert difference.item() == pytest.approx(reg_weight * term.item(), rel=1e-5)


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize("row", ["pml:Nope", "MultiSimilarityLoss", "pml:marginloss", None])
def test_unknown_row(row):
    for call in (lambda: build(row), lambda: search_space(row), lambda: split_params(row, {})):
        with pytest.raises(UnknownRowError) as raised:
            call()
        assert isinstance(raised.value, KeyError)
        message = str(raised.value)
        assert message.startswith(f"unknown baseline {row!r}; the baselines are pml:ContrastiveLoss, ")
        assert "pml:MultiSimilarityLoss+MultiSimilarityMiner" in message


@pytest.mark.parametrize(
    "row, params, expected",
    [
        ("pml:ContrastiveLoss", {"margin": 0.1}, "unknown parameter margin = 0.1; it takes pos_margin, neg_margin"),
        ("pml:MultiSimilarityLoss", {"miner_epsilon": 0.1}, "unknown parameter miner_epsilon = 0.1"),
        ("pml:MultiSimilarityLoss+MultiSimilarityMiner", {"miner_eps": 0.1}, "unknown parameter miner_eps = 0.1"),
        ("pml:ArcFaceLoss", {"num_classes": 9}, "num_classes and embedding_size come from the data"),
        ("pml:NPairsLoss", {"temperature": 1.0}, "it takes no parameters"),
        ("pml:TripletMarginLoss", {"margin": float("nan")}, "parameter margin = nan is not a finite number"),
        ("pml:TripletMarginLoss", [("margin", 0.1)], "params must be a mapping"),
    ],
)
def test_bad_params_are_named_before_any_work(row, params, expected):
    with pytest.raises(ValueError, match=re.escape(f"{row}: ")) as raised:
        split_params(row, params)
    assert expected in str(raised.value)
    with pytest.raises(ValueError, match=re.escape(expected)):
        built(row, params)


def test_what_the_data_must_give():
    with pytest.raises(ValueError, match=r"pml:ArcFaceLoss: ArcFaceLoss needs num_classes and embedding_size"):
        build("pml:ArcFaceLoss")
    with pytest.raises(ValueError, match=r"pml:MarginLoss-per-class: MarginLoss needs num_classes;"):
        build("pml:MarginLoss-per-class", embedding_size=EMBEDDING_SIZE)
    loss, _, _ = build("pml:ContrastiveLoss")  # needs nothing
    assert isinstance(loss, losses.ContrastiveLoss)
