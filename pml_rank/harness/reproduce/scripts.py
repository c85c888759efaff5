"""What an example script declares (`Run`, `Setup`, `Variant`) and its command line
(`Script.main`)."""

import dataclasses
import sys
import tempfile

from .. import arguments, datasets, outputs
from ..backbones import WeightsNotFoundError
from ..budget import REALITY_CHECK, SETTING_BY_KEY, BudgetError
from ..components import MissingComponentError
from ..data.real import DATASETS, DataSetNotFoundError, ImageReadError
from ..data.tiny_layouts import make_all
from .output import format_result, write_result
from .running import SMOKE, models_dir, run_variant
from .tables import PaperTable


def _refuse_unknown_keys(owner, budget):
    unknown = sorted(set(budget) - set(SETTING_BY_KEY))
    if unknown:
        raise TypeError(f"{owner}: unknown budget keys {', '.join(unknown)}; the keys are pml_rank.harness.budget's")


@dataclasses.dataclass(frozen=True)
class Run:
    """One model (one row of ours), trained by the runner as `pml-rank bench` trains its row.

    ``loss``: the runner's row, a registered loss (``"AUCLoss"``) or a PML baseline
    (``"pml:TripletMarginLoss"``); the row brings its miner and sampler (`pml-rank bench
    --list`). ``params``: the row's parameters, as the runner takes them (loss keywords,
    ``miner_<name>`` for its miner's). ``budget``: what this run changes in its setup's
    budget (``{"class_mining": False}``; not the protocol). ``paper_row``: the paper's row it
    reproduces, or None. ``untrained``: the networks before any training (the "Pretrained"
    row)."""

    label: str
    loss: str = ""
    params: dict = dataclasses.field(default_factory=dict)
    budget: dict = dataclasses.field(default_factory=dict)
    paper_row: str | None = None
    untrained: bool = False

    def __post_init__(self):
        _refuse_unknown_keys(f"run {self.label}", self.budget)
        if "protocol" in self.budget:
            raise TypeError(f"run {self.label}: the protocol is its setup's, one for the whole table")


@dataclasses.dataclass(frozen=True)
class Setup:
    """The training setup a paper describes for one data set: ``budget`` holds what it
    changes in the reality-check preset, keys of `pml_rank.harness.budget.SETTINGS`
    (``protocol``, ``trunk``, ``lr``, ``seeds``: the repeated runs, ...). What the paper
    leaves open is our choice, and ``notes`` says so."""

    budget: dict
    notes: str = ""

    def __post_init__(self):
        _refuse_unknown_keys("setup", self.budget)

    @property
    def protocol(self):
        return self.budget.get("protocol", REALITY_CHECK["protocol"])


@dataclasses.dataclass(frozen=True)
class Variant:
    """One data set of a script: the paper's table, the setup and the runs."""

    dataset: str  # a key of pml_rank.harness.data.real.DATASETS
    table: PaperTable
    setup: Setup
    runs: tuple
    hardware: str


@dataclasses.dataclass(frozen=True)
class Script:
    name: str
    title: str
    variants: dict  # {dataset name: Variant}, the first is the default
    smoke_rows: tuple | None = None  # rows --smoke runs (default: all), to keep it to seconds

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
            "layouts, the small CNN from random weights, one iteration; the numbers mean nothing",
        )
        p.add_argument("--epochs", type=arguments.positive_int, help="override the paper's number of epochs, >= 1")
        p.add_argument(
            "--batch-size",
            type=arguments.positive_int,
            help="override the paper's batch size; a multiple of the samples per class, two classes or more",
        )
        p.add_argument(
            "--image-size",
            type=arguments.positive_int,
            help="override the training crop / test centre crop (the images are first resized to 256/224 of it)",
        )
        p.add_argument(
            "--repeats",
            type=arguments.positive_int,
            help="repeated runs (seeds --seed to --seed + N - 1) for a mean and its 95%% confidence interval, >= 1",
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
        try:
            outputs.prepare_output_dir(args.out)
        except outputs.OutputError as error:
            parser.error(f"argument {error}")
        try:
            with tempfile.TemporaryDirectory(prefix="pml-rank-smoke-") as scratch:
                if args.smoke and args.data_root is None:
                    args.data_root = make_all(scratch, size=SMOKE["image_size"], only=[variant.dataset])
                if args.data_root is None:
                    raise DataSetNotFoundError(f"--data-root is required (or --smoke).\n{variant_data_help(variant)}")
                args.models_dir = models_dir(self, variant, args)
                result, budgets = run_variant(self, variant, args)
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
        print(format_result(self, variant, result, args, budgets))
        path = write_result(self, variant, result, args, budgets)
        print(f"written: {path} and {path.with_suffix('.png').name}")
        return 0


def variant_data_help(variant):
    layout = DATASETS[variant.dataset].layout
    return f"{layout.download}\nExpected layout:\n" + "\n".join(
        f"    {line}" for line in layout.tree.format(root="<data-root>").splitlines()
    )
