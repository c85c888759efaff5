"""The machinery behind ``examples/``: each example script declares a paper's table (the
paper's numbers, cited), the training setup the paper describes and the runs that
reproduce its rows; `Script.main` trains, evaluates and prints our numbers beside the
paper's. The scripts ship with the source, not the installed package: run them from a
clone, ``python examples/auc_cub200.py --help``.

Training and evaluation are `pml_rank.harness.evaluation`'s: `train_model` (PML's
`MetricLossOnly` trainer, hooks and record-keeper) and `compute_embeddings` for the papers'
standard protocol (train on the training classes, measure the test classes once), and
`run_protocol` for the Reality Check protocol (4-fold cross-validation, concatenated and
separated embeddings, mean and 95% confidence interval over runs).

Losses and miners are named as `pml_rank.harness.components` reads them (``"AUCLoss"``,
``"pml:BatchHardMiner"``), so a script fails with a clear message, before any training,
when a component it needs is not installed.
"""

import dataclasses
import json
import sys
import tempfile
from pathlib import Path

import torch
from tqdm import tqdm

from . import arguments, datasets, outputs, recipes, runner
from .backbones import BACKBONES, WeightsNotFoundError, build_models, require_weights
from .budget import BudgetError, resolve
from .components import MissingComponentError, component_class
from .data.real import DATASETS, DataSetNotFoundError, ImageReadError
from .data.tiny_layouts import make_all
from .evaluation import (
    METRICS,
    SHORT_NAMES,
    Recipe,
    TrainingConfig,
    accuracy,
    compute_embeddings,
    summarize,
    train_model,
)
from .recipes import hard_negative_classes, m_per_class
from .text_table import format_text_table

# --------------------------------------------------------------------------- declarations


@dataclasses.dataclass(frozen=True)
class PaperTable:
    """A table as the paper prints it, in percent. ``rows`` maps the paper's row label to
    one number per metric (None where the paper has none)."""

    source: str  # "Gajić et al., CVPR-W 2022, supplementary, table 1"
    metrics: tuple  # the papers' column names: "R@1", "NMI", "P@1", "RP", "MAP@R"
    rows: dict


def paper_rows(text):
    """Rows of a paper table written as in the paper, one per line: ``label | 58.19 |
    86.36``; a cell may be ``68.13 ± 0.31`` (mean and confidence interval), or ``-`` / ``x``
    where the paper has no number (``x``: the run diverged)."""
    rows = {}
    for line in text.strip().splitlines():
        label, *cells = [c.strip() for c in line.split("|")]
        rows[label] = tuple(_paper_cell(c) for c in cells)
    return rows


class PaperNumber(float):
    """A number as the paper prints it: compares as a float, prints as written ("90.0")."""

    def __new__(cls, text):
        number = super().__new__(cls, text.strip().rstrip("?"))
        number.text = text.strip()
        return number

    def __str__(self):
        return self.text


def _paper_cell(cell):
    if cell == "x":
        return "x (diverged)"
    if cell in ("-", "—"):
        return None
    if "±" in cell:
        mean, ci = cell.split("±")
        return (PaperNumber(mean), PaperNumber(ci))
    return PaperNumber(cell)


@dataclasses.dataclass(frozen=True)
class Run:
    """One model (one row of ours). ``loss``, ``miner``: a registered name (``"AUCLoss"``)
    or a PML one (``"pml:BatchHardMiner"``). ``sampler``: ``"m_per_class"`` (PML's
    `MPerClassSampler`, the setup's samples per class) or ``"hard_negative_class"``
    (pml-rank's `HardNegativeClassSampler`, mining N-pair batches with the model, as
    `pml-rank bench` builds it).
    ``paper_row``: the paper's row it reproduces, or None."""

    label: str
    loss: str = ""
    loss_kwargs: dict = dataclasses.field(default_factory=dict)
    miner: str | None = None
    miner_kwargs: dict = dataclasses.field(default_factory=dict)
    sampler: str = "m_per_class"
    paper_row: str | None = None
    untrained: bool = False  # the "Pretrained" row: no training at all


@dataclasses.dataclass(frozen=True)
class Setup:
    """The training setup a paper describes for one data set. What the paper leaves open
    is our choice, and ``notes`` says so."""

    backbone: str  # a key of pml_rank.harness.backbones.BACKBONES
    embedding_size: int
    batch_size: int
    samples_per_class: int
    optimizer: str  # "adam" or "rmsprop"
    lr: float
    epochs: int
    protocol: str = "standard"  # or "reality-check"
    image_size: int = 224  # training crop and test centre crop
    resize: int = 256
    augmentation: str = "crop-flip"  # or "random-resized-crop" (Reality Check)
    embedder_lr_factor: float = 1.0
    weight_decay: float = 0.0
    lr_drop: tuple | None = None  # (after this epoch, multiply the learning rate by)
    freeze_batchnorm: bool = False
    patience: int | None = None  # Reality Check: stop a fold after this many epochs without progress
    repeats: int = 1  # Reality Check: repeated runs for the confidence interval
    notes: str = ""


@dataclasses.dataclass(frozen=True)
class Variant:
    """One data set of a script: the paper's table, the setup and the runs."""

    dataset: str  # a key of pml_rank.harness.data.real.DATASETS
    table: PaperTable
    setup: Setup
    runs: tuple
    hardware: str


# Settings of --smoke: the tiny layouts, a tiny random-init CNN, one iteration.
SMOKE_SETUP = dict(
    backbone="tiny",
    embedding_size=16,
    image_size=16,
    resize=18,
    batch_size=8,
    samples_per_class=4,
    epochs=1,
    repeats=1,
    patience=None,
    lr=0.01,
)
SMOKE_ITERATIONS = 1


@dataclasses.dataclass(frozen=True)
class Script:
    name: str
    title: str
    variants: dict  # {dataset name: Variant}, the first is the default
    smoke_rows: tuple | None = None  # rows --smoke runs (default: all), to keep it to seconds

    # ---- the command line

    def parser(self):
        p = arguments.ArgumentParser(prog=f"{self.name}.py", description=self.title)
        p.add_argument(
            "--dataset",
            choices=list(self.variants),
            default=next(iter(self.variants)),
            help="which table (data set) to reproduce (default: %(default)s)",
        )
        p.add_argument(
            "--data-root",
            help="folder holding the data sets, one folder each (examples/README.md: "
            "Real data sets and the papers' tables); with --smoke, default: tiny generated copies",
        )
        p.add_argument(
            "--smoke",
            action="store_true",
            help="seconds-long check of the whole pipeline: tiny copies of the data "
            "layouts, a tiny random-init CNN, one iteration; the numbers mean nothing",
        )
        p.add_argument("--epochs", type=arguments.positive_int, help="override the paper's number of epochs, >= 1")
        p.add_argument(
            "--batch-size",
            type=arguments.positive_int,
            help="override the paper's batch size; a multiple of the setup's samples per class",
        )
        p.add_argument(
            "--image-size",
            type=arguments.positive_int,
            help="override the training crop / test centre crop (the images are first resized to 256/224 of it)",
        )
        p.add_argument(
            "--repeats",
            type=arguments.positive_int,
            help="Reality Check: repeated runs for the confidence interval, >= 1",
        )
        p.add_argument("--only", nargs="+", metavar="LABEL", help="run only these rows (our labels)")
        p.add_argument("--random-init", action="store_true", help="no ImageNet weights (not the papers' setting)")
        p.add_argument(
            "--device",
            type=arguments.device,
            default=arguments.default_device(),
            help=f"torch device: {arguments.DEVICE_HELP} (default here: %(default)s)",
        )
        p.add_argument(
            "--seed",
            type=arguments.non_negative_int,
            default=0,
            help="seed of the training runs, >= 0 (default %(default)s)",
        )
        p.add_argument(
            "--out",
            default="pml-rank-results",
            help="folder for the JSON and PNG results, created if missing and checked writable "
            "before any work (default: %(default)s)",
        )
        return p

    def main(self, argv=None):
        parser = self.parser()
        args = parser.parse_args(argv)
        variant = self.variants[args.dataset]
        setup = effective_setup(variant.setup, args)
        if setup.batch_size % setup.samples_per_class or setup.batch_size < 2 * setup.samples_per_class:
            parser.error(
                f"argument --batch-size: {setup.batch_size} must be a multiple of the "
                f"{setup.samples_per_class} samples per class and hold two classes or more"
            )
        try:
            outputs.prepare_output_dir(args.out)
        except outputs.OutputError as error:
            parser.error(f"argument {error}")
        try:
            with tempfile.TemporaryDirectory(prefix="pml-rank-smoke-") as scratch:
                if args.smoke and args.data_root is None:
                    args.data_root = make_all(scratch, size=SMOKE_SETUP["image_size"], only=[variant.dataset])
                if args.data_root is None:
                    raise DataSetNotFoundError(f"--data-root is required (or --smoke).\n{variant_data_help(variant)}")
                args.models_dir = models_dir(self, variant, args)
                result, budget = run_variant(self, variant, args)
        except (
            MissingComponentError,
            DataSetNotFoundError,
            WeightsNotFoundError,
            ImageReadError,
            datasets.DataError,
            BudgetError,
        ) as error:
            print(f"{self.name}: {error}", file=sys.stderr)
            return 2
        print(format_result(self, variant, result, args))
        path = write_result(self, variant, result, args, budget)
        print(f"written: {path} and {path.with_suffix('.png').name}")
        return 0


def variant_data_help(variant):
    layout = DATASETS[variant.dataset].layout
    return f"{layout.download}\nExpected layout:\n" + "\n".join(
        f"    {line}" for line in layout.tree.format(root="<data-root>").splitlines()
    )


# --------------------------------------------------------------------------- components


def make_recipe(run, setup):
    """The `pml_rank.harness.evaluation.Recipe` of a run: its loss, miner and sampler factories.
    The samplers are `pml-rank bench`'s (`pml_rank.harness.bench.m_per_class`,
    `pml_rank.harness.bench.hard_negative_classes`)."""

    return Recipe(
        make_loss=lambda: None if run.untrained else component_class("losses", run.loss)(**run.loss_kwargs),
        make_miner=(lambda: component_class("miners", run.miner)(**run.miner_kwargs)) if run.miner else None,
        make_sampler=hard_negative_classes
        if run.sampler == "hard_negative_class"
        else m_per_class(setup.samples_per_class),
        name=run.label,
    )


# --------------------------------------------------------------------------- data and models


def image_transforms(setup):
    """``(train, eval)`` transforms of a setup (`datasets.image_transforms`)."""
    return datasets.image_transforms(dataclasses.asdict(setup), channels=3)


def standard_training(setup, iterations_per_epoch, device="cpu"):
    """The `TrainingConfig` of a setup on the papers' standard protocol (one model trained
    on the training classes): the paper's optimizer, weight decay, learning rate (times
    ``embedder_lr_factor`` for the embedding layer) and drop."""
    return TrainingConfig(
        epochs=setup.epochs,
        batch_size=setup.batch_size,
        iterations_per_epoch=iterations_per_epoch,
        optimizer=setup.optimizer,
        lr=setup.lr,
        weight_decay=setup.weight_decay,
        momentum=0.0,
        lr_schedule="constant",
        patience=None,
        freeze_batchnorm=setup.freeze_batchnorm,
        amp=False,
        embedding_size=setup.embedding_size,
        num_folds=1,
        device=device,
        embedder_lr_factor=setup.embedder_lr_factor,
        lr_drop=setup.lr_drop,
    )


# --------------------------------------------------------------------------- running


def models_dir(script, variant, args):
    """Where the trained weights of a run go, saved before any evaluation:
    ``<out>/models-<script>-<dataset>[-smoke]/``."""
    return Path(args.out) / f"models-{script.name}-{variant.dataset}{'-smoke' if args.smoke else ''}"


def _file_name(label):
    return "".join(c if c.isalnum() or c in "-_.=" else "_" for c in label).strip("_") or "run"


def save_weights(folder, run, trained):
    """Saves a trained run's trunk and embedder (``torch.save`` of their state dicts)
    to ``<folder>/<run label>.pt`` atomically, so that a failure while evaluating loses
    no training; returns the path."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{_file_name(run.label)}.pt"
    with outputs.atomic_write(path, "wb") as f:
        torch.save(
            {
                "label": run.label,
                "loss": run.loss,
                "loss_kwargs": run.loss_kwargs,
                "trunk": trained.trunk.state_dict(),
                "embedder": trained.embedder.state_dict(),
            },
            f,
        )
    return path


def effective_setup(setup, args):
    """The paper's setup with the command line's overrides (and --smoke's tiny settings)."""
    changes = dict(SMOKE_SETUP) if args.smoke else {}
    if args.epochs is not None:
        changes["epochs"] = args.epochs
    if args.batch_size is not None:
        changes["batch_size"] = args.batch_size
    if args.image_size is not None:
        changes.update(image_size=args.image_size, resize=round(args.image_size * 256 / 224))
    if args.repeats is not None:
        changes["repeats"] = args.repeats
    return dataclasses.replace(setup, **changes)


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


def run_variant(script, variant, args):
    """Trains and measures every run of a variant; returns ``(results, budget)``: results
    ``{run label: {metric: value in %}}`` (Reality Check: ``{label: {"concatenated":
    {metric: (mean, ci)}, "separated": ...}}``) and the runner's budget (Reality Check;
    None on the standard protocol)."""
    setup = effective_setup(variant.setup, args)
    runs = selected_runs(script, variant, args)
    for run in runs:  # fail before any training when a component is missing
        if not run.untrained:
            component_class("losses", run.loss)
            if run.miner:
                component_class("miners", run.miner)
    pretrained = not (args.smoke or args.random_init)
    if pretrained:
        require_weights(setup.backbone)  # before loading any data
    if setup.protocol == "reality-check":
        return _run_reality_check(variant, setup, runs, args, pretrained)
    return _run_standard(variant, setup, runs, args, pretrained), None


def _iterations(setup, num_items, smoke):
    if smoke:
        return SMOKE_ITERATIONS
    return max(num_items // setup.batch_size, 1)


def _run_standard(variant, setup, runs, args, pretrained):

    spec = DATASETS[variant.dataset]
    train_transform, eval_transform = image_transforms(setup)
    train_set = spec.load(args.data_root, spec.train_split, train_transform)
    query_set = spec.load(args.data_root, spec.query_split, eval_transform)
    reference_set = (
        None
        if spec.reference_split == spec.query_split
        else spec.load(args.data_root, spec.reference_split, eval_transform)
    )
    iterations = _iterations(setup, len(train_set), args.smoke)
    config = standard_training(setup, iterations, args.device)
    results = {}
    total = iterations * setup.epochs * sum(not r.untrained for r in runs)
    with tqdm(total=total, desc=f"{variant.dataset} training", unit="it") as bar:
        for run in runs:
            torch.manual_seed(args.seed)
            models = build_models(setup.backbone, setup.embedding_size, pretrained)
            recipe, miner, sampler = make_recipe(run, setup), None, None
            if not run.untrained:
                miner = recipe.make_miner() if recipe.make_miner else None
                sampler = recipe.make_sampler(
                    train_set,
                    batch_size=setup.batch_size,
                    device=args.device,
                    iterations_per_epoch=iterations,
                    model=torch.nn.Sequential(models["trunk"], models["embedder"]),
                    seed=args.seed,
                )
            trained = train_model(
                recipe.make_loss(),
                train_set,
                dataclasses.replace(config, epochs=0) if run.untrained else config,
                trunk=models["trunk"],
                embedder=models["embedder"],
                miner=miner,
                sampler=sampler,
                seed=args.seed,
                on_iteration=lambda trainer: bar.update(1),
            )
            if not run.untrained:
                save_weights(args.models_dir, run, trained)
            query, query_labels = compute_embeddings(
                trained.trunk, query_set, trained.embedder, args.device, normalize=True
            )
            reference = reference_labels = None
            if reference_set is not None:
                reference, reference_labels = compute_embeddings(
                    trained.trunk, reference_set, trained.embedder, args.device, normalize=True
                )
            measured = accuracy(
                query,
                query_labels,
                reference,
                reference_labels,
                metrics=variant.table.metrics,
                device=torch.device(args.device),
            )
            results[run.label] = {m: 100 * v for m, v in measured.items()}
    return results


def reality_check_budget(dataset, setup, pretrained, iterations_per_epoch=None):
    """The runner's budget of a Reality Check setup: the reality-check preset with every
    field of the setup in its place. Raises `BudgetError` for a field the runner cannot
    honour (an embedding layer learning rate factor, a learning rate drop): refused, never
    ignored."""
    if setup.embedder_lr_factor != 1.0:
        raise BudgetError("embedder_lr_factor", f"{setup.embedder_lr_factor}: the Reality Check runner has none")
    if setup.lr_drop is not None:
        raise BudgetError("lr_drop", f"{setup.lr_drop}: the Reality Check runner has no learning rate drop")
    return resolve(
        dataset,
        "reality-check",
        trunk="small-cnn" if setup.backbone == "tiny" else setup.backbone,
        random_init=not pretrained,
        embedding_size=setup.embedding_size,
        epochs=setup.epochs,
        iterations_per_epoch=iterations_per_epoch,
        batch_size=setup.batch_size,
        optimizer=setup.optimizer,
        lr=setup.lr,
        weight_decay=setup.weight_decay,
        patience=setup.patience,
        image_size=setup.image_size,
        resize=setup.resize,
        augmentation=setup.augmentation,
        freeze_batchnorm=setup.freeze_batchnorm,
    )


def check_runs_match_rows(runs, setup):
    """Raises `MissingComponentError` for a run whose miner, sampler or samples per class
    differ from the runner's row of its loss (`recipes`): the runner trains the row."""
    for run in runs:
        if run.untrained:
            continue
        recipe = recipes.rows([run.loss])[run.loss]
        miner = type(recipe.make_miner()).__name__ if recipe.make_miner else None
        if (run.miner or None) and (run.miner.removeprefix("pml:") != miner) or (not run.miner and miner):
            raise MissingComponentError(f"{run.label}: miner {run.miner} differs from the row's ({miner})")
        mines = recipe.make_sampler is recipes.hard_negative_classes
        if mines != (run.sampler == "hard_negative_class"):
            raise MissingComponentError(f"{run.label}: sampler {run.sampler} differs from the row's ({recipe.batches})")
        if recipe.per_class not in (None, 2) and recipe.per_class != setup.samples_per_class:
            raise MissingComponentError(
                f"{run.label}: {setup.samples_per_class} samples per class, the row takes {recipe.per_class}"
            )


def _run_reality_check(variant, setup, runs, args, pretrained):
    """The Reality Check rows through the experiment runner (`runner.run`, what `pml-rank
    bench` runs); returns ``(results, budget)``, the budget the runner trained with."""
    check_runs_match_rows(runs, setup)
    budget = reality_check_budget(variant.dataset, setup, pretrained)
    # The fold models of every trained run are kept in models_dir (`runner.models_folder`).
    machine = runner.Machine(data_root=args.data_root, device=args.device, models_dir=str(args.models_dir))
    row_recipes = recipes.rows([r.loss for r in runs if not r.untrained])
    runner.check_rows(budget, row_recipes)
    data = runner.check(budget, row_recipes, machine)
    # A fold trains on 3 of the 4 partitions of the training half.
    iterations = _iterations(setup, len(data) // 2 * 3 // 4, args.smoke)
    budget = reality_check_budget(variant.dataset, setup, pretrained, iterations)
    results = {}
    trained_runs = sum(not r.untrained for r in runs)
    with tqdm(
        total=iterations * setup.epochs * budget["num_folds"] * setup.repeats * trained_runs,
        desc=f"{variant.dataset} {budget['num_folds']}-fold training",
        unit="it",
    ) as bar:
        for run in runs:
            outcomes = [
                runner.run(
                    budget,
                    runner.UNTRAINED if run.untrained else run.loss,
                    run.loss_kwargs,
                    args.seed + repeat,
                    machine,
                    on_iteration=lambda trainer: bar.update(1),
                )["run"]
                for repeat in range(1 if run.untrained else setup.repeats)
            ]
            summary = summarize(outcomes)
            results[run.label] = {
                kind: {
                    short: tuple(100 * v for v in summary[kind][metric])
                    for metric, short in SHORT_NAMES.items()
                    if metric in METRICS
                }
                for kind in ("concatenated", "separated")
            }
    return results, budget


# --------------------------------------------------------------------------- output


def _cell(value):
    if value is None:
        return "—"
    if isinstance(value, tuple):
        mean, ci = value
        return f"{mean:.2f} ± {ci:.2f}" if ci == ci else f"{mean:.2f}"  # nan CI with one run
    return f"{value:.2f}"


def _paper_cell_text(value):
    if value is None:
        return "—"
    if isinstance(value, tuple):
        return f"{value[0]} ± {value[1]}"
    return str(value)


def format_result(script, variant, result, args):
    """Our numbers beside the paper's: every paper row (ours filled in where we ran it)
    and every row of ours without a paper counterpart."""
    table, setup = variant.table, effective_setup(variant.setup, args)
    reality_check = setup.protocol == "reality-check"
    ours_by_paper_row = {
        r.paper_row: r.label for r in selected_runs(script, variant, args) if r.paper_row and r.label in result
    }
    header = ["row"]
    kinds = ("concatenated", "separated") if reality_check else (None,)
    for kind in kinds:
        for metric in table.metrics:
            prefix = f"{kind[:6]}. " if kind else ""
            header += [f"{prefix}{metric} ours", f"{prefix}{metric} paper"]
    rows = []

    def ours_for(label, index, kind):
        if label is None:
            return None
        values = result[label][kind] if kind else result[label]
        return values.get(table.metrics[index])

    for paper_row, numbers in table.rows.items():
        label = ours_by_paper_row.get(paper_row)
        cells = [paper_row + (f"  [ours: {label}]" if label else "")]
        for k, kind in enumerate(kinds):
            paper_numbers = numbers[k * len(table.metrics) : (k + 1) * len(table.metrics)] if reality_check else numbers
            for i, paper_value in enumerate(paper_numbers):
                cells += [_cell(ours_for(label, i, kind)), _paper_cell_text(paper_value)]
        rows.append(cells)
    for label in result:
        if label in ours_by_paper_row.values():
            continue
        cells = [f"{label}  [ours only]"]
        for kind in kinds:
            for i in range(len(table.metrics)):
                cells += [_cell(ours_for(label, i, kind)), "—"]
        rows.append(cells)
    lines = [
        f"{script.title}",
        f"{table.source}; in %. Paper numbers are the authors' (cited), "
        "'ours' is this run" + (" (--smoke: meaningless numbers)" if args.smoke else "") + ".",
    ]
    notes = []
    if BACKBONES.get(setup.backbone) and BACKBONES[setup.backbone].note:
        notes.append(BACKBONES[setup.backbone].note)
    if variant.setup.notes:
        notes.append(variant.setup.notes)
    lines.append(
        f"Ours: {setup.backbone} + {setup.embedding_size}-d embedding, {setup.image_size}-px crops, "
        f"batch {setup.batch_size} ({setup.samples_per_class} per class), {setup.optimizer} "
        f"lr {setup.lr:g}, {setup.epochs} epochs" + (f", {setup.repeats} repeats" if reality_check else "")
    )
    lines += [f"Note: {n}" for n in notes]
    lines.append(format_text_table(header, rows))
    return "\n".join(lines)


def write_result(script, variant, result, args, budget=None):
    """Writes ``reproduce-<script>-<dataset>.json`` (ours, the paper's rows, and what ours
    trained with: the runner's `budget` on the Reality Check protocol, else the setup) and a
    PNG beside it; returns the JSON path."""
    setup = effective_setup(variant.setup, args)
    path = Path(args.out) / f"reproduce-{script.name}-{variant.dataset}{'-smoke' if args.smoke else ''}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "script": script.name,
        "dataset": variant.dataset,
        "paper": variant.table.source,
        "metrics": list(variant.table.metrics),
        "paper_rows": variant.table.rows,
        "ours": result,
        **({"setup": dataclasses.asdict(setup)} if budget is None else {"budget": budget, "repeats": setup.repeats}),
        "smoke": args.smoke,
        "seed": args.seed,
    }
    outputs.write_text(path, json.dumps(payload, indent=2, default=str))
    plot_result(script, variant, result, args, path.with_suffix(".png"))
    return path


def plot_result(script, variant, result, args, path):
    """Bar chart, one panel per metric: each of our rows beside the paper's number for
    the row it reproduces (Reality Check: concatenated embeddings, with the 95% CI)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = variant.table
    reality_check = variant.setup.protocol == "reality-check"
    paper_row_of = {r.label: r.paper_row for r in selected_runs(script, variant, args)}
    labels = list(result)
    fig, axes = plt.subplots(
        1, len(table.metrics), figsize=(3 + 2.2 * len(table.metrics), 0.5 * len(labels) + 2), squeeze=False, sharey=True
    )
    for i, (metric, ax) in enumerate(zip(table.metrics, axes[0])):
        ours = [result[label]["concatenated" if reality_check else metric] for label in labels]
        ours = [v[metric] if reality_check else v for v in ours]
        paper = [table.rows.get(paper_row_of.get(label), ())[i : i + 1] for label in labels]
        paper = [p[0] if p and p[0] is not None and not isinstance(p[0], str) else None for p in paper]
        positions = range(len(labels))

        def bars(values, offset, name, color, ax=ax, positions=positions):
            means = [(v[0] if isinstance(v, tuple) else v) if v is not None else 0 for v in values]
            errors = [v[1] if isinstance(v, tuple) and v[1] == v[1] else 0 for v in values]
            ax.barh([p + offset for p in positions], means, height=0.38, xerr=errors, label=name, color=color)

        bars(ours, -0.2, "ours", "tab:blue")
        bars(paper, 0.2, "paper", "tab:gray")
        ax.set_title(metric + (" (concatenated)" if reality_check else ""))
        ax.set_xlim(0, 100)
        ax.set_yticks(list(positions), labels, fontsize=8)
    axes[0][0].invert_yaxis()
    axes[0][-1].legend(loc="lower right", fontsize=8)
    fig.suptitle(f"{table.source}" + ("  [--smoke: meaningless numbers]" if args.smoke else ""), fontsize=9)
    fig.tight_layout()
    try:
        outputs.save_figure(fig, path, dpi=110)
    finally:
        plt.close(fig)
