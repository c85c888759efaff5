"""Every study's first trial is the loss's paper defaults, so tuning never returns parameters
that measured worse than them; tuned.json and the bench say when the defaults won."""

import pytest

optuna = pytest.importorskip("optuna")

from pml_rank.harness import recipes, tune  # noqa: E402
from pml_rank.harness.storage import close_storage, open_storage  # noqa: E402
from pml_rank.losses import AUCLoss, RaMBORecallLoss  # noqa: E402


def test_paper_defaults_are_the_constructors_values_for_every_suggested_parameter():
    spaces = tune.search_spaces()
    rambo = tune.paper_defaults("RaMBORecallLoss", spaces["RaMBORecallLoss"])
    built = RaMBORecallLoss()
    # memory_variant is suggested only with a memory: asked with the defaults, the space names it.
    assert rambo == {
        name: getattr(built, name) for name in ("lambda_val", "margin", "memory_size", "weighting", "memory_variant")
    }
    assert tune.paper_defaults("AUCLoss", spaces["AUCLoss"]) == {"step": 0.005, "slope": pytest.approx(AUCLoss().slope)}
    for row in recipes.available():
        if row in spaces:
            values = tune.paper_defaults(row, spaces[row])
            recipe = recipes.with_params(recipes.rows([row])[row], values)
            recipe.make_loss(**{k: {"num_classes": 8, "embedding_size": 16}[k] for k in recipe.loss_needs})


def test_the_first_trial_of_a_study_is_the_paper_defaults_and_tuned_json_says_when_they_won(tmp_path):
    url = f"sqlite:///{tmp_path / 't.db'}"
    storage = open_storage(url)
    try:
        budget = tune.study_budget(epochs=1)
        study = tune.open_study("FastAPLoss", budget, storage)
        (waiting,) = study.get_trials(deepcopy=False)
        assert waiting.state.name == "WAITING" and waiting.system_attrs["fixed_params"] == {"num_bins": 10}
        tune.open_study("FastAPLoss", budget, storage)  # reopened: enqueued once
        assert len(study.get_trials(deepcopy=False)) == 1

        def objective(trial):
            params = tune.search_spaces()["FastAPLoss"](trial)
            trial.set_user_attr("params", params)
            return 1.0 if params["num_bins"] == 10 else 0.5

        study.optimize(objective, n_trials=3)
        entry = tune.summarize_study(study)
        assert entry["params"] == {"num_bins": 10} and entry["defaults_won"] and entry["best_trial"] == 0
    finally:
        close_storage(storage)
