"""PML's own losses as `pml:` rows (placeholder with today's four rows; the Reality Check's
full table replaces it)."""

import dataclasses
from collections.abc import Callable


@dataclasses.dataclass(frozen=True)
class Baseline:
    row: str
    loss: str
    space: Callable
    defaults: dict = dataclasses.field(default_factory=dict)
    miner: str | None = None
    per_class: int = 4
    needs: tuple = ()
    batches: str = "m=4 per class"


def _contrastive_space(trial):
    return {
        "pos_margin": trial.suggest_float("pos_margin", -0.2, 2.0),
        "neg_margin": trial.suggest_float("neg_margin", -0.2, 2.0),
    }


BASELINES = {
    b.row: b
    for b in (
        Baseline("pml:ContrastiveLoss", "ContrastiveLoss", _contrastive_space, {"pos_margin": 0.0, "neg_margin": 1.0}),
        Baseline(
            "pml:TripletMarginLoss",
            "TripletMarginLoss",
            lambda t: {"margin": t.suggest_float("margin", -0.2, 2.0)},
            {"margin": 0.05},
        ),
        Baseline(
            "pml:FastAPLoss",
            "FastAPLoss",
            lambda t: {"num_bins": t.suggest_int("num_bins", 2, 100, log=True)},
            {"num_bins": 10},
        ),
        Baseline("pml:NPairsLoss", "NPairsLoss", lambda t: {}, per_class=2, batches="N classes x 2"),
    )
}


def build_loss(row, num_classes=None, embedding_size=None, **params):
    from pytorch_metric_learning import losses

    spec = BASELINES[row]
    given = {"num_classes": num_classes, "embedding_size": embedding_size}
    return getattr(losses, spec.loss)(**{**spec.defaults, **params, **{k: given[k] for k in spec.needs}})


def build_miner(row, params):
    from pytorch_metric_learning import miners

    return getattr(miners, BASELINES[row].miner)(**params)
