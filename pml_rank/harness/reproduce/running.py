"""Running a script's variant: each run's budget (the reality-check preset, the paper's
setup, the run's own changes, then the command line's) and its rows, trained and measured by
the experiment runner (`runner.run`, what `pml-rank bench` runs) on the setup's protocol."""

from pathlib import Path

from tqdm import tqdm

from .. import recipes, runner
from ..budget import PAPERS_RESIZE_PER_CROP, STANDARD_PROTOCOL, resolve
from ..components import MissingComponentError
from ..evaluation import METRICS, SHORT_NAMES, mean_and_ci, summarize

# Settings of --smoke: the small CNN from random weights (it has no separate embedding layer
# to give a learning rate factor), 16-pixel crops of the tiny layouts, one iteration of one
# epoch, one run.
SMOKE = dict(
    trunk="small-cnn",
    embedding_size=16,
    image_size=16,
    resize=18,
    batch_size=8,
    epochs=1,
    iterations_per_epoch=1,
    seeds=1,
    lr=0.01,
    embedder_lr_factor=1.0,
)
# --smoke's samples per class where a setup gives some: batches of 8 hold 2 classes.
SMOKE_SAMPLES_PER_CLASS = 4


def models_dir(script, variant, args):
    """Where the runner keeps the trained models of a script's runs (`runner.models_folder`),
    saved before any evaluation: ``<out>/models-<script>-<dataset>[-smoke]/``."""
    return Path(args.out) / f"models-{script.name}-{variant.dataset}{'-smoke' if args.smoke else ''}"


def command_line_changes(setup_and_run, args):
    """What the command line changes in a run's budget `setup_and_run` (its setup's values
    and the run's): --smoke's tiny settings, then every option given."""
    changes = dict(SMOKE) if args.smoke else {}
    if args.smoke and setup_and_run.get("samples_per_class") is not None:
        changes["samples_per_class"] = SMOKE_SAMPLES_PER_CLASS
    if args.epochs is not None:
        changes["epochs"] = args.epochs
    if args.batch_size is not None:
        changes["batch_size"] = args.batch_size
    if args.image_size is not None:
        changes.update(image_size=args.image_size, resize=round(args.image_size * PAPERS_RESIZE_PER_CROP))
    if args.repeats is not None:
        changes["seeds"] = args.repeats
    if args.random_init:
        changes["random_init"] = True
    return changes


def run_budget(variant, run, args, iterations_per_epoch=None):
    """The runner's budget of `run`: the reality-check preset with the setup's values, the
    run's and the command line's in their place (`budget.resolve`, which refuses a value the
    runner cannot honour), and `iterations_per_epoch` unless these give one."""
    given = {**variant.setup.budget, **run.budget}
    given.update(command_line_changes(given, args))
    if run.untrained:  # the networks before training: one run
        given["seeds"] = 1
    if "iterations_per_epoch" not in given:
        given["iterations_per_epoch"] = iterations_per_epoch
    return resolve(variant.dataset, "reality-check", **given)


def selected_runs(script, variant, args):
    runs = list(variant.runs)
    if args.smoke and script.smoke_rows and not args.only:
        runs = [r for r in runs if r.label in script.smoke_rows]
    if args.only:
        unknown = set(args.only) - {r.label for r in runs}
        if unknown:
            raise MissingComponentError(f"no row labelled {sorted(unknown)}; rows: {[r.label for r in runs]}")
        runs = [r for r in runs if r.label in args.only]
    return runs


def row_of(run):
    return runner.UNTRAINED if run.untrained else run.loss


def checked_budgets(variant, runs, args, machine):
    """``{run label: budget}``, each checked by the runner before any training (the rows,
    the trunk's weights, the data set, the batches), with the iterations of one pass over a
    model's training items unless the setup gives them."""
    try:
        recipes.rows([run.loss for run in runs if not run.untrained])
    except KeyError as error:
        raise MissingComponentError(f"{variant.dataset}: {error.args[0]}") from None
    budgets = {}
    for run in runs:
        budget = run_budget(variant, run, args)
        row_recipes = runner.recipes_for(budget, [row_of(run)])
        runner.check_rows(budget, row_recipes)
        data = runner.check(budget, row_recipes, machine)
        passes = max(runner.items_per_model(budget, data) // budget["batch_size"], 1)
        budgets[run.label] = run_budget(variant, run, args, passes)
    return budgets


def _iterations(budget):
    """Training iterations of all the models of a run."""
    models = 1 if budget["protocol"] == STANDARD_PROTOCOL else budget["num_folds"]
    return budget["iterations_per_epoch"] * budget["epochs"] * models * budget["seeds"]


def run_variant(script, variant, args):
    """Trains and measures every selected run of a variant through the runner; returns
    ``(results, budgets)``: ``{run label: {metric: value in %}}`` (a mean and its 95% CI
    with several seeds; Reality Check: ``{label: {"concatenated": {metric: (mean, ci)},
    "separated": ...}}``) and ``{run label: the budget the runner trained it with}``."""
    runs = selected_runs(script, variant, args)
    # The models of every trained run are kept in models_dir (`runner.models_folder`).
    machine = runner.Machine(data_root=args.data_root, device=args.device, models_dir=str(args.models_dir))
    budgets = checked_budgets(variant, runs, args, machine)
    standard = variant.setup.protocol == STANDARD_PROTOCOL
    metrics = variant.table.metrics if standard else None
    total = sum(_iterations(budgets[run.label]) for run in runs if not run.untrained)
    results = {}
    with tqdm(total=total, desc=f"{variant.dataset} {variant.setup.protocol} training", unit="it") as bar:
        for run in runs:
            budget = budgets[run.label]
            outcomes = [
                runner.run(
                    budget,
                    row_of(run),
                    run.params,
                    args.seed + repeat,
                    machine,
                    on_iteration=lambda trainer: bar.update(1),
                    metrics=metrics,
                )["run"]
                for repeat in range(budget["seeds"])
            ]
            results[run.label] = standard_result(outcomes) if standard else reality_check_result(outcomes)
    return results, budgets


def standard_result(outcomes):
    """``{metric: value in %}`` of one run, ``{metric: (mean, ci)}`` of several."""
    values = {metric: [100 * o["concatenated"][metric] for o in outcomes] for metric in outcomes[0]["concatenated"]}
    if len(outcomes) == 1:
        return {metric: found[0] for metric, found in values.items()}
    return {metric: mean_and_ci(found) for metric, found in values.items()}


def reality_check_result(outcomes):
    """``{"concatenated": {short metric name: (mean, ci) in %}, "separated": ...}``."""
    summary = summarize(outcomes)
    return {
        kind: {
            short: tuple(100 * v for v in summary[kind][metric])
            for metric, short in SHORT_NAMES.items()
            if metric in METRICS
        }
        for kind in ("concatenated", "separated")
    }
