"""The Reality Check's baselines (Musgrave et al., ECCV 2020) as ``pml:`` rows of
`pml-rank bench` and `pml-rank tune`: PML's losses (one with PML's miner), each with the
search space of the paper's Bayesian optimisation.

A row trains with one flat ``params`` dict, the form tuned.json and the bench's store keep:

    plain keys    the loss's constructor keywords (the row's `Baseline.defaults` names them all)
    miner_<key>   the miner's constructor keyword <key>
    loss_lr       the learning rate of the optimizer of the loss's own parameters (proxies,
                  class weights, β), which PML's trainers take as
                  ``optimizers["metric_loss_optimizer"]``; absent: the trunk's learning rate

Untuned, a row takes PML 2.9's constructor defaults, as powerful-benchmarker's configs did
(they name the class and no keyword: config_loss_and_miners/default.yaml); only what
defines the row is set (the margin rows' learnable β, SoftTriple's 10 centres per class).

Search spaces are the paper's CUB-200 ranges at batch 32, read from powerful-benchmarker's
optimisation plots (`PLOTS`: cub_<loss>.html hold every trial's parameters and each axis'
bounds and scale; FastAP was a grid, cub_fast_ap.png). The loss optimizer's learning rate
was searched log-uniformly on [1e-6, 1] (src/powerful_benchmarker/configs/config_optimizers/
with_metric_loss_optimizer_bayes_opt.yaml). `Baseline.paper_cub200` holds the paper's best
CUB-200 values (docs/papers/mlrc.md there). Two of the paper's loss terms are regularisers
in PML 2.9 (`Regularizer`); their weights keep the paper's meaning, except SoftTriple's,
doubled because PML 2.9 halved the term. examples/README.md's "Reality Check baselines"
table is `markdown_table()`.

Importing this module imports neither torch nor PML; `build` does.
"""

import dataclasses
import importlib
import math
import types
from collections.abc import Callable, Mapping

from ...search_spaces import pnp_space

MINER_PREFIX = "miner_"
LOSS_LR = "loss_lr"
# What a constructor may take from the data and the model rather than from `params`.
NEEDS = ("num_classes", "embedding_size")
# KevinMusgrave/powerful-benchmarker, branch metric-learning (222790a), where the plots are.
PLOTS = "pb:docs/papers/mlrc_plots/"


class UnknownRowError(KeyError):
    """A row name that is not in `BASELINES`."""

    def __str__(self):  # KeyError would quote the whole message
        return str(self.args[0])


@dataclasses.dataclass(frozen=True)
class Regularizer:
    """A PML regulariser a row attaches to its loss when the weight ``<kind>_reg_weight``
    (one of the row's parameters) is above 0; at 0 the loss has none, as PML's default.

    kind: "embedding" or "weight" (PML's ``embedding_regularizer`` / ``weight_regularizer``).
    name: the class in `module`.
    takes: loss keywords its constructor takes too.
    """

    kind: str
    name: str
    takes: tuple = ()
    module: str = "pytorch_metric_learning.regularizers"

    @property
    def weight_key(self):
        return f"{self.kind}_reg_weight"


@dataclasses.dataclass(frozen=True)
class Baseline:
    """One row.

    row: the name on the command line and in tables (``pml:<Loss>`` or a variant of it).
    loss: PML's loss class (in ``pytorch_metric_learning.losses``).
    defaults: every constructor keyword `params` may set, at its untuned value.
    space: ``space(trial) -> params`` for an Optuna trial (names as in `params`).
    batches: how batches are made, in words, for tables.
    per_class: samples of each class in a batch (PML's `MPerClassSampler`).
    miner: the class in ``pytorch_metric_learning.miners`` (used as the trainer's
        ``tuple_miner``), or None; miner_defaults: its keywords, as `defaults`.
    needs: which of `NEEDS` the loss's constructor takes from the data and the model.
    loss_parameters: what the loss learns, in words ("" when nothing): such a loss gets an
        optimizer of its own, and accepts ``loss_lr``.
    loss_weight_decay: weight decay of that optimizer; None: the trunk optimizer's.
    regularizer: a `Regularizer`, or None.
    source: where the search space comes from.
    note: what a table should say besides.
    paper_cub200: the paper's best `params` on CUB-200 (empty for the rows beyond it).
    implementation: ``"module:Class"`` built instead of PML's `loss` class (a subclass that
        fixes a numerical fault), or "".
    """

    row: str
    loss: str
    defaults: Mapping
    space: Callable
    batches: str
    per_class: int = 4
    miner: str | None = None
    miner_defaults: Mapping = dataclasses.field(default_factory=dict)
    needs: tuple = ()
    loss_parameters: str = ""
    loss_weight_decay: float | None = None
    regularizer: Regularizer | None = None
    source: str = ""
    note: str = ""
    paper_cub200: Mapping = dataclasses.field(default_factory=dict)
    implementation: str = ""

    def __post_init__(self):
        for name in ("defaults", "miner_defaults", "paper_cub200"):
            object.__setattr__(self, name, types.MappingProxyType(dict(getattr(self, name))))
        unknown = set(self.needs) - set(NEEDS)
        if unknown:
            raise ValueError(f"{self.row}: needs {sorted(unknown)}; a row can need only {NEEDS}")

    @property
    def parameter_names(self):
        """Every key `params` may hold for this row."""
        names = list(self.defaults)
        names += [MINER_PREFIX + key for key in self.miner_defaults]
        if self.loss_parameters:
            names.append(LOSS_LR)
        return names


# ----------------------------------------------------------------------------- spaces


def _loss_lr(trial):
    return trial.suggest_float(LOSS_LR, 1e-6, 1.0, log=True)


def _contrastive_space(trial):
    # The best CUB pos_margin sits on the lower bound: below 0 it acts as 0 (the paper's FAQ).
    return {
        "pos_margin": trial.suggest_float("pos_margin", -0.2, 2.0),
        "neg_margin": trial.suggest_float("neg_margin", -0.2, 2.0),
    }


def _triplet_space(trial):
    return {"margin": trial.suggest_float("margin", -0.2, 2.0)}


def _ntxent_space(trial):
    return {"temperature": trial.suggest_float("temperature", 1e-4, 100.0, log=True)}


def _proxy_nca_space(trial):
    return {"softmax_scale": trial.suggest_float("softmax_scale", 0.01, 100.0), LOSS_LR: _loss_lr(trial)}


def _margin_space(trial):
    return {
        "margin": trial.suggest_float("margin", -0.2, 2.0),
        "beta": trial.suggest_float("beta", -0.2, 2.0),  # β's initial value
        LOSS_LR: _loss_lr(trial),
    }


def _normalized_softmax_space(trial):
    return {"temperature": trial.suggest_float("temperature", 0.01, 100.0, log=True), LOSS_LR: _loss_lr(trial)}


def _cosface_space(trial):
    return {
        "margin": trial.suggest_float("margin", 0.0, 1.0),
        "scale": trial.suggest_float("scale", 0.01, 200.0),
        LOSS_LR: _loss_lr(trial),
    }


def _arcface_space(trial):
    return {
        "margin": trial.suggest_float("margin", 0.0, 90.0),  # degrees, as PML takes it
        "scale": trial.suggest_float("scale", 0.01, 200.0),
        LOSS_LR: _loss_lr(trial),
    }


def _fastap_space(trial):
    return {"num_bins": trial.suggest_int("num_bins", 2, 32)}


def _snr_space(trial):
    return {
        "pos_margin": trial.suggest_float("pos_margin", 0.0, 2.0),
        "neg_margin": trial.suggest_float("neg_margin", 0.0, 2.0),
        "embedding_reg_weight": trial.suggest_float("embedding_reg_weight", 0.0, 1.0),
    }


def _multi_similarity_space(trial):
    return {
        "alpha": trial.suggest_float("alpha", 0.001, 100.0),
        "beta": trial.suggest_float("beta", 0.01, 100.0),
        "base": trial.suggest_float("base", 0.0, 1.0),
    }


def _multi_similarity_with_miner_space(trial):
    return {
        "alpha": trial.suggest_float("alpha", 0.01, 100.0),
        "beta": trial.suggest_float("beta", 0.01, 100.0),
        "base": trial.suggest_float("base", 0.0, 1.0),
        "miner_epsilon": trial.suggest_float("miner_epsilon", 0.0, 1.0),
    }


def _soft_triple_space(trial):
    return {
        "la": trial.suggest_float("la", 0.01, 100.0),
        "gamma": trial.suggest_float("gamma", 1e-4, 100.0),  # PML scales the centres' softmax by 1/gamma
        "margin": trial.suggest_float("margin", 0.0, 1.0),
        # The paper's reg_weight on [0, 1]; PML 2.9's regulariser is half the old term.
        "weight_reg_weight": trial.suggest_float("weight_reg_weight", 0.0, 2.0),
        LOSS_LR: _loss_lr(trial),
    }


def _smooth_ap_space(trial):
    # Not in the paper: log-uniform over two decades either side of Smooth-AP's τ = 0.01.
    return {"temperature": trial.suggest_float("temperature", 1e-4, 1.0, log=True)}


def _nothing_to_tune(trial):
    return {}


# ----------------------------------------------------------------------------- rows

_M4 = "m=4 per class"
_CLASS_WEIGHTS = ("num_classes", "embedding_size")
_MARGIN_NOTE = "β's optimizer without weight decay, as the paper's runs (named margin_no_weight_decay)"

_ROWS = (
    Baseline(
        row="pml:ContrastiveLoss",
        loss="ContrastiveLoss",
        defaults={"pos_margin": 0.0, "neg_margin": 1.0},
        space=_contrastive_space,
        batches=_M4,
        source=PLOTS + "cub_contrastive.html",
        paper_cub200={"pos_margin": -0.2, "neg_margin": 0.3841},
    ),
    Baseline(
        row="pml:TripletMarginLoss",
        loss="TripletMarginLoss",
        defaults={"margin": 0.05},
        space=_triplet_space,
        batches=_M4,
        source=PLOTS + "cub_triplet.html",
        paper_cub200={"margin": 0.0961},
    ),
    Baseline(
        row="pml:NTXentLoss",
        loss="NTXentLoss",
        defaults={"temperature": 0.07},
        space=_ntxent_space,
        batches=_M4,
        source=PLOTS + "cub_ntxent.html",
        paper_cub200={"temperature": 0.0091},
        note="Cars-196 and SOP: [1e-5, 100] log",
    ),
    Baseline(
        row="pml:ProxyNCALoss",
        loss="ProxyNCALoss",
        defaults={"softmax_scale": 1.0},
        space=_proxy_nca_space,
        batches=_M4,
        needs=_CLASS_WEIGHTS,
        loss_parameters="a proxy per class",
        source=PLOTS + "cub_proxy_nca.html",
        implementation="pml_rank.harness.baselines.proxy_nca:LogSpaceProxyNCALoss",
        note="PML's class gives NaN gradients once softmax_scale passes about 40; this row takes log p in log space",
        paper_cub200={"softmax_scale": 13.98, LOSS_LR: 6.04e-3},
    ),
    Baseline(
        row="pml:MarginLoss",
        loss="MarginLoss",
        defaults={"margin": 0.2, "beta": 1.2, "learn_beta": True},
        space=_margin_space,
        batches=_M4,
        loss_parameters="β",
        loss_weight_decay=0.0,
        source=PLOTS + "cub_margin_no_weight_decay.html",
        paper_cub200={"margin": 0.0878, "beta": 0.7838, LOSS_LR: 1.31e-3},
        note=_MARGIN_NOTE,
    ),
    Baseline(
        row="pml:MarginLoss-per-class",
        loss="MarginLoss",
        defaults={"margin": 0.2, "beta": 1.2, "learn_beta": True},
        space=_margin_space,
        batches=_M4,
        needs=("num_classes",),
        loss_parameters="a β per class",
        loss_weight_decay=0.0,
        source=PLOTS + "cub_margin_param_per_class_no_weight_decay.html",
        paper_cub200={"margin": 0.0779, "beta": 0.9796, LOSS_LR: 2.65e-4},
        note=_MARGIN_NOTE,
    ),
    Baseline(
        row="pml:NormalizedSoftmaxLoss",
        loss="NormalizedSoftmaxLoss",
        defaults={"temperature": 0.05},
        space=_normalized_softmax_space,
        batches=_M4,
        needs=_CLASS_WEIGHTS,
        loss_parameters="class weights",
        source=PLOTS + "cub_normalized_softmax.html",
        paper_cub200={"temperature": 0.1087, LOSS_LR: 4.46e-3},
    ),
    Baseline(
        row="pml:CosFaceLoss",
        loss="CosFaceLoss",
        defaults={"margin": 0.35, "scale": 64.0},
        space=_cosface_space,
        batches=_M4,
        needs=_CLASS_WEIGHTS,
        loss_parameters="class weights",
        source=PLOTS + "cub_cosface.html",
        paper_cub200={"margin": 0.6182, "scale": 100.0, LOSS_LR: 2.53e-3},
    ),
    Baseline(
        row="pml:ArcFaceLoss",
        loss="ArcFaceLoss",
        defaults={"margin": 28.6, "scale": 64.0},
        space=_arcface_space,
        batches=_M4,
        needs=_CLASS_WEIGHTS,
        loss_parameters="class weights",
        source=PLOTS + "cub_arcface.html",
        paper_cub200={"margin": 23.22, "scale": 100.0, LOSS_LR: 5.13e-3},
        note="margin in degrees; SOP: scale [0.01, 300]",
    ),
    Baseline(
        row="pml:FastAPLoss",
        loss="FastAPLoss",
        defaults={"num_bins": 10},
        space=_fastap_space,
        batches=_M4,
        source=PLOTS + "cub_fast_ap.png",
        paper_cub200={"num_bins": 17},
        note="the paper tried every num_bins from 2 to 32 (a grid)",
    ),
    Baseline(
        row="pml:SignalToNoiseRatioContrastiveLoss",
        loss="SignalToNoiseRatioContrastiveLoss",
        defaults={"pos_margin": 0.0, "neg_margin": 1.0, "embedding_reg_weight": 0.0},
        space=_snr_space,
        batches=_M4,
        regularizer=Regularizer(
            "embedding", "NormalizedZeroMeanRegularizer", module="pml_rank.harness.baselines.zero_mean"
        ),
        source=PLOTS + "cub_snr_contrastive.html",
        paper_cub200={"pos_margin": 0.3264, "neg_margin": 0.8446, "embedding_reg_weight": 0.1382},
        note="embedding_reg_weight is the paper's regularizer_weight (PML <= 0.9.86's term, on normalised embeddings)",
    ),
    Baseline(
        row="pml:MultiSimilarityLoss",
        loss="MultiSimilarityLoss",
        defaults={"alpha": 2.0, "beta": 50.0, "base": 0.5},
        space=_multi_similarity_space,
        batches=_M4,
        source=PLOTS + "cub_multi_similarity.html",
        paper_cub200={"alpha": 0.01, "beta": 50.60, "base": 0.56},
        note="Cars-196 and SOP: alpha [0.01, 100]",
    ),
    Baseline(
        row="pml:MultiSimilarityLoss+MultiSimilarityMiner",
        loss="MultiSimilarityLoss",
        defaults={"alpha": 2.0, "beta": 50.0, "base": 0.5},
        space=_multi_similarity_with_miner_space,
        batches=_M4 + ", MultiSimilarityMiner",
        miner="MultiSimilarityMiner",
        miner_defaults={"epsilon": 0.1},
        source=PLOTS + "cub_multi_similarity_with_ms_miner.html",
        paper_cub200={"alpha": 17.97, "beta": 75.66, "base": 0.77, "miner_epsilon": 0.39},
        note="SOP: beta [0.01, 200]",
    ),
    Baseline(
        row="pml:SoftTripleLoss",
        loss="SoftTripleLoss",
        defaults={"centers_per_class": 10, "la": 20.0, "gamma": 0.1, "margin": 0.01, "weight_reg_weight": 0.0},
        space=_soft_triple_space,
        batches=_M4,
        needs=_CLASS_WEIGHTS,
        loss_parameters="10 centres per class",
        regularizer=Regularizer("weight", "SparseCentersRegularizer", takes=("num_classes", "centers_per_class")),
        source=PLOTS + "cub_soft_triple.html",
        paper_cub200={"la": 78.02, "gamma": 58.95, "margin": 0.4307, "weight_reg_weight": 2 * 0.3754, LOSS_LR: 5.37e-5},
        note=(
            "weight_reg_weight = 2 x the paper's reg_weight (PML 2.9's SparseCentersRegularizer "
            "halves the term); Cars-196 and SOP: gamma [0.01, 100]; SOP: la [0.01, 200], no regulariser"
        ),
    ),
    Baseline(
        row="pml:SmoothAPLoss",
        loss="SmoothAPLoss",
        defaults={"temperature": 0.01},
        space=_smooth_ap_space,
        batches=_M4,
        source="not in the paper; Brown et al. (ECCV 2020) use temperature 0.01",
        note="PML's grouping is exact only when a batch holds as many classes as samples per class",
    ),
    Baseline(
        row="pml:NPairsLoss",
        loss="NPairsLoss",
        defaults={},
        space=_nothing_to_tune,
        batches="N classes x 2",
        per_class=2,
        source="not in the paper; PML's NPairsLoss has nothing to tune",
    ),
    Baseline(
        row="pml:PNPLoss",
        loss="PNPLoss",
        defaults={"b": 2.0, "alpha": 4.0, "anneal": 0.01, "variant": "Dq"},
        space=pnp_space,
        batches=_M4,
        source="not in the paper; the authors' recommended variant, Dq, with its τ and α",
        note="the authors' recommended run (Dq, alpha 4; PML's defaults: O, alpha 1); same function as pml-rank's",
    ),
)

# Every row, in display order (the paper's tables, then the rows beyond the paper).
BASELINES = {baseline.row: baseline for baseline in _ROWS}


def get(row):
    """The `Baseline` of `row`; `UnknownRowError` (a KeyError) naming the rows otherwise."""
    try:
        return BASELINES[row]
    except (KeyError, TypeError):
        raise UnknownRowError(f"unknown baseline {row!r}; the baselines are {', '.join(BASELINES)}") from None


def search_space(row):
    """``space(trial) -> params`` of `row`."""
    return get(row).space


def split_params(row, params=None):
    """``(loss keywords, miner keywords, loss_lr or None)`` of `row` from the flat `params`
    (see the module's docstring), each on top of the row's defaults. Checks without
    building anything: ValueError names the row, the parameter and the value for a key the
    row does not take, a non-finite number, or a ``loss_lr`` that is not a positive number
    or belongs to a loss with no parameters."""
    baseline = get(row)
    params = {} if params is None else params
    if not isinstance(params, Mapping):
        raise ValueError(f"{row}: params must be a mapping of parameter names to values, got {params!r}")
    loss_kwargs, miner_kwargs, loss_lr = dict(baseline.defaults), dict(baseline.miner_defaults), None
    for key, value in params.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{row}: parameter {key} = {value!r} is not a finite number")
        if key == LOSS_LR and baseline.loss_parameters:
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise ValueError(f"{row}: parameter {LOSS_LR} = {value!r} must be a positive learning rate")
            loss_lr = float(value)
        elif key.startswith(MINER_PREFIX) and key[len(MINER_PREFIX) :] in baseline.miner_defaults:
            miner_kwargs[key[len(MINER_PREFIX) :]] = value
        elif key in baseline.defaults:
            loss_kwargs[key] = value
        else:
            raise ValueError(f"{row}: unknown parameter {key} = {value!r}; {_takes(baseline)}")
    return loss_kwargs, miner_kwargs, loss_lr


def _takes(baseline):
    names = baseline.parameter_names
    takes = f"it takes {', '.join(names)}" if names else "it takes no parameters"
    if not baseline.loss_parameters:
        takes += f" ({LOSS_LR} only for losses with parameters of their own)"
    if baseline.needs:
        takes += f"; {' and '.join(baseline.needs)} come from the data and the model, not from params"
    return takes


def build(row, params=None, num_classes=None, embedding_size=None):
    """``(loss, miner or None, loss_lr or None)`` of `row`, PML objects built with the
    row's defaults updated by `params` (`split_params` checks them first). `num_classes`
    and `embedding_size` are passed to the constructors that need them (`Baseline.needs`);
    a class-weight loss expects labels 0 .. num_classes - 1. ``loss_lr`` None means the
    loss's optimizer, if it has parameters, takes the trunk's learning rate."""
    baseline = get(row)
    loss_kwargs, miner_kwargs, loss_lr = split_params(row, params)
    given = {"num_classes": num_classes, "embedding_size": embedding_size}
    missing = [name for name in baseline.needs if given[name] is None]
    if missing:
        raise ValueError(f"{row}: {baseline.loss} needs {' and '.join(missing)}; pass them to build()")
    loss_kwargs.update({name: given[name] for name in baseline.needs})
    if baseline.regularizer is not None:
        regularizer = baseline.regularizer
        if loss_kwargs[regularizer.weight_key] > 0:
            cls = getattr(importlib.import_module(regularizer.module), regularizer.name)
            made = cls(**{key: loss_kwargs[key] for key in regularizer.takes})
            loss_kwargs[f"{regularizer.kind}_regularizer"] = made
        else:
            del loss_kwargs[regularizer.weight_key]
    module, name = (baseline.implementation or f"pytorch_metric_learning.losses:{baseline.loss}").split(":")
    loss = getattr(importlib.import_module(module), name)(**loss_kwargs)
    miner = None
    if baseline.miner is not None:
        miner = getattr(importlib.import_module("pytorch_metric_learning.miners"), baseline.miner)(**miner_kwargs)
    return loss, miner, loss_lr


# ----------------------------------------------------------------------------- tables


@dataclasses.dataclass(frozen=True)
class Range:
    """One suggestion of a search space: `name` on [`low`, `high`] (``integer``: whole
    numbers; ``log``: log-uniform), or one of `choices`."""

    name: str
    low: float | None = None
    high: float | None = None
    log: bool = False
    integer: bool = False
    choices: tuple | None = None

    def __str__(self):
        if self.choices is not None:
            return f"{self.name} in {{{', '.join(map(str, self.choices))}}}"
        kind = ", ".join(word for word, on in (("integers", self.integer), ("log", self.log)) if on)
        return f"{self.name} [{_number(self.low)}, {_number(self.high)}]" + (f" {kind}" if kind else "")


class RecordingTrial:
    """Stands in for an Optuna trial to read a search space (any ``space(trial)``): records
    each suggestion as a `Range` in ``ranges`` and answers the value `values` holds for its
    name, else the low end or the first choice."""

    def __init__(self, values=None):
        self.values, self.ranges = dict(values or {}), []

    @property
    def suggested(self):
        """The names suggested so far, in order."""
        return [suggestion.name for suggestion in self.ranges]

    def _answer(self, suggestion, default):
        self.ranges.append(suggestion)
        return self.values.get(suggestion.name, default)

    def suggest_float(self, name, low, high, *, step=None, log=False):
        return self._answer(Range(name, low, high, log=log), low)

    def suggest_int(self, name, low, high, *, step=1, log=False):
        return self._answer(Range(name, low, high, log=log, integer=True), low)

    def suggest_categorical(self, name, choices):
        return self._answer(Range(name, choices=tuple(choices)), choices[0])


def space_ranges(row):
    """The `Range` of each parameter `row`'s space suggests (at the low end of the earlier ones)."""
    trial = RecordingTrial()
    search_space(row)(trial)
    return trial.ranges


def _number(value):
    return f"{value:g}"


def _params_text(params):
    return ", ".join(
        f"{key}={_number(value)}" if isinstance(value, float) else f"{key}={value}" for key, value in params
    )


def markdown_table():
    """The "Reality Check baselines" table of examples/README.md."""
    lines = [
        "| row | loss | miner | batches | own parameters (optimizer) | defaults | search space "
        "| paper's best on CUB-200 | source | notes |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for baseline in BASELINES.values():
        optimizer = "none"
        if baseline.loss_parameters:
            decay = baseline.loss_weight_decay
            optimizer = f"{baseline.loss_parameters} (own, lr `{LOSS_LR}`"
            optimizer += ")" if decay is None else f", weight decay {_number(decay)})"
        defaults = [*baseline.defaults.items(), *((MINER_PREFIX + k, v) for k, v in baseline.miner_defaults.items())]
        cells = [
            f"`{baseline.row}`",
            baseline.loss
            + (f" ({baseline.implementation.split(':')[1]})" if baseline.implementation else "")
            + (f" + {baseline.regularizer.name}" if baseline.regularizer else ""),
            baseline.miner or "none",
            baseline.batches,
            optimizer,
            _params_text(defaults) or "none",
            "; ".join(map(str, space_ranges(baseline.row))) or "nothing to tune",
            _params_text(baseline.paper_cub200.items()) or "",
            baseline.source,
            baseline.note,
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
