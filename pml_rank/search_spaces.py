"""The `pml-rank tune` search spaces of pml-rank's own losses, which its plugin (`builtin.py`)
declares through the ``pml_rank_search_spaces`` hook: each ``space(trial) -> params`` asks an
Optuna trial (or anything with its ``suggest_*`` methods) for the loss's keywords. Imports
nothing, so the harness reads a space (the pml:PNPLoss row shares PNPLoss's) without torch."""


def rambo_space(trial, recall):
    params = {
        # λ of the blackbox ranking (normalised ranks, so the papers' values carry over).
        "lambda_val": trial.suggest_float("lambda_val", 0.05, 20.0, log=True),
        "margin": trial.suggest_float("margin", 0.0, 0.2),
        "memory_size": trial.suggest_int("memory_size", 0, 4),
    }
    if recall:
        params["weighting"] = trial.suggest_categorical("weighting", ["log", "loglog"])
    if params["memory_size"] > 0:  # RaMBO's MEMORY_VARIANTS: the paper's text ("extend"), the authors' code ("rows")
        params["memory_variant"] = trial.suggest_categorical("memory_variant", ["extend", "rows"])
    return params


# Threshold spacings that divide AUCLoss's default [-1, 1] into whole intervals (it insists).
AUC_STEPS = [0.005, 0.01, 0.02, 0.025, 0.04, 0.05, 0.1]


def auc_space(trial):
    return {
        "step": trial.suggest_categorical("step", AUC_STEPS),
        "slope": trial.suggest_float("slope", 5.0, 500.0, log=True),
    }


def fastap_space(trial):
    return {"num_bins": trial.suggest_int("num_bins", 2, 100, log=True)}


def npairs_space(trial):
    return {"l2_reg_weight": trial.suggest_float("l2_reg_weight", 1e-5, 0.1, log=True)}


def recall_at_k_space(trial):
    # A decade either side of the paper's τ1 = 0.01 and τ2 = 1; SiMix on or off.
    return {
        "rank_temperature": trial.suggest_float("rank_temperature", 1e-3, 0.1, log=True),
        "recall_temperature": trial.suggest_float("recall_temperature", 0.1, 10.0, log=True),
        "similarity_mixup": trial.suggest_categorical("similarity_mixup", [False, True]),
    }


def smooth_ap_space(trial):
    # A decade either side of the paper's τ = 0.01 on cosine similarities: at 1e-3 only
    # pairs within ~0.01 of each other get a useful gradient, at 0.1 the sigmoid spreads over a
    # fifth of [-1, 1]. Whether the query counts as its own positive is tried both ways.
    return {
        "temperature": trial.suggest_float("temperature", 1e-3, 0.1, log=True),
        "include_query": trial.suggest_categorical("include_query", [True, False]),
    }


def supap_space(trial):
    # τ a decade either side of the paper's 0.01; ρ from a gentle slope to ten times the
    # paper's 100; δ from no sigmoid above the positive to four times the paper's 0.05.
    return {
        "temperature": trial.suggest_float("temperature", 1e-3, 0.1, log=True),
        "rho": trial.suggest_float("rho", 1.0, 1000.0, log=True),
        "delta": trial.suggest_float("delta", 0.0, 0.2),
    }


def roadmap_space(trial):
    # λ over [0, 1] (the paper's 0.5); the calibration's margins around its α = 0.9, β = 0.6.
    return {
        **supap_space(trial),
        "lambda_": trial.suggest_float("lambda_", 0.0, 1.0),
        "pos_margin": trial.suggest_float("pos_margin", 0.5, 1.0),
        "neg_margin": trial.suggest_float("neg_margin", 0.0, 0.9),
    }


def pnp_space(trial):
    """PNP-D_q (the authors' recommended variant): τ (anneal) a decade either side of the
    paper's 0.01 and α from the authors' default 1 to twice their best run's 4. PML's
    PNPLoss, the same function, is searched with it too (the harness's pml:PNPLoss row)."""
    return {
        "anneal": trial.suggest_float("anneal", 1e-3, 0.1, log=True),
        "alpha": trial.suggest_int("alpha", 1, 8),
    }


# The space of each loss, by its registered name.
SEARCH_SPACES = {
    "RaMBORecallLoss": lambda trial: rambo_space(trial, recall=True),
    "RaMBOAPLoss": lambda trial: rambo_space(trial, recall=False),
    "AUCLoss": auc_space,
    "FastAPLoss": fastap_space,
    "NPairsMCLoss": npairs_space,
    "NPairsOVOLoss": npairs_space,
    "RecallAtKSurrogateLoss": recall_at_k_space,
    "SmoothAPLoss": smooth_ap_space,
    "SupAPLoss": supap_space,
    "ROADMAPLoss": roadmap_space,
    "PNPLoss": pnp_space,
}
