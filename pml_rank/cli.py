"""The `pml-rank` command. Each subcommand is one class: its name and help, its options
(`add_arguments`) and its handler (`run`) side by side; `build_parser` asks each class in
`COMMANDS` for its options. bench and tune share `add_budget_arguments`, the options that
define a run, and the helpers below it.

Everything that imports torch is imported inside the handlers, so that --help, argument
errors and `bench --status` answer at once.
"""

import importlib
import importlib.util
import sys
from pathlib import Path

from . import __version__
from .harness.budget import (
    AUTO_PRESET,
    DATASET_NAMES,
    DEFAULT_BASELINES,
    PRESETS,
    SPEED_DEFAULT_SIZES,
    SPEED_DEFAULT_SIZES_PER_LOSS,
    add_setting_options,
    dataset_argument,
    given_settings,
)
from .harness.storage_rules import DEFAULT_HEARTBEAT, DEFAULT_RETRY

# The small CNN's steps are too short to gain from more threads per worker process.
DEFAULT_THREADS = 1

OUT_HELP = "folder for the results, created if missing and checked writable before any work (default: %(default)s)"


class UsageError(Exception):
    """A command line that parsed but cannot run (an unknown loss, a batch size the chosen
    rows cannot use, an output folder that cannot be written): `main` prints it in one
    line and returns 2, before any work."""


def _harness(module):
    """The harness module `module`, or exit 2 naming what is missing and the extra that installs it."""
    from .harness import REQUIRED_MODULES

    missing = [name for name in REQUIRED_MODULES if importlib.util.find_spec(name) is None]
    if missing:
        print(f"pml-rank: the harness needs {', '.join(missing)}: pip install 'pml-rank[harness]'", file=sys.stderr)
        sys.exit(2)
    return importlib.import_module(f".harness.{module}", __package__)


def _prepare_out(path):
    from .harness.outputs import OutputError, prepare_output_dir

    try:
        return prepare_output_dir(path)
    except OutputError as error:
        raise UsageError(f"argument {error}") from None


class Command:
    """One `pml-rank` subcommand: `name`, `help` (the list of commands) and `description`
    (its own --help); `add_arguments(parser)` declares its options, `run(args)` handles a
    parsed command line and returns the exit status."""

    name = ""
    help = ""
    description = None

    def add_arguments(self, parser):
        pass

    def run(self, args):
        raise NotImplementedError


class ListCommand(Command):
    name = "list"
    help = "every discovered component, its kind and distribution"

    def run(self, args):
        from .harness.text_table import format_text_table
        from .plugins import KINDS, registry

        rows = [
            (c.name, KINDS[c.kind].singular, c.distribution, f"{c.cls.__module__}.{c.cls.__qualname__}")
            for c in registry.components()
        ]
        print(format_text_table(("name", "kind", "distribution", "class"), rows, align="llll"))
        return 0


class SpeedCommand(Command):
    name = "speed"
    help = "forward+backward time and peak memory against PML and the paper's reference"

    def add_arguments(self, parser):
        from .harness.arguments import DEVICE_HELP, at_least, device, non_negative_int, positive_int

        parser.add_argument(
            "losses",
            nargs="*",
            help="registered loss names and the other cases `pml-rank speed NAME` lists in its error "
            "(a RaMBO loss with its default score memory, RaMBO's AP loss on a batch; default: all of them)",
        )
        per_loss = "; ".join(
            f"{name}: {' '.join(map(str, sizes))} (scores in one sequence)"
            for name, sizes in SPEED_DEFAULT_SIZES_PER_LOSS.items()
        )
        parser.add_argument(
            "--sizes",
            type=at_least(2),
            nargs="+",
            metavar="N",
            help=f"batch sizes (scores per sequence for sequence losses), each >= 2; default "
            f"{' '.join(map(str, SPEED_DEFAULT_SIZES))}, except {per_loss}",
        )
        parser.add_argument(
            "--dim", type=positive_int, default=512, help="embedding dimension, >= 1 (default %(default)s)"
        )
        parser.add_argument(
            "--repeats",
            type=positive_int,
            default=5,
            help="interleaved rounds per run and size, each timing every contender once, >= 1; "
            "the table shows the median of the per-round ratios (default %(default)s)",
        )
        parser.add_argument(
            "--device", type=device, default="cpu", help=f"torch device: {DEVICE_HELP} (default %(default)s)"
        )
        parser.add_argument(
            "--amp",
            action="store_true",
            help="every contender, the floor included, under torch.autocast: float16 on CUDA, bfloat16 on the "
            "CPU, as mixed-precision training calls a loss (default: float32)",
        )
        parser.add_argument(
            "--seed", type=non_negative_int, default=0, help="seed of the random inputs, >= 0 (default %(default)s)"
        )
        parser.add_argument("--out", default="pml-rank-results", help=OUT_HELP + "; writes speed-<loss>.json")
        parser.add_argument(
            "--runs",
            type=positive_int,
            default=1,
            help="repeat the whole measurement this many times, >= 1; ratios pool every round (default %(default)s)",
        )
        parser.add_argument(
            "--underflow",
            action="store_true",
            help="also time each loss on inputs that drive exp/sigmoid arguments out of float range "
            "against its usual inputs (the no-slow-path case), at the largest size (default: off)",
        )
        parser.add_argument(
            "--threads",
            type=positive_int,
            help="torch CPU threads for the measurement, >= 1 (default: torch's). On a machine shared "
            "with other work, 1 keeps a descheduled worker thread from stalling every parallel op",
        )
        parser.add_argument(
            "--report",
            metavar="PATH",
            help="also write PATH.json and PATH.md: every table with its spread, the command, "
            "date and machine, e.g. examples/results/speed (default: none)",
        )

    def run(self, args):
        speed = _harness("speed")
        from .plugins import registry

        known = set(registry.losses()) | set(speed.CASES)
        names = args.losses or sorted(known)
        unknown = [n for n in names if n not in known]
        if unknown:
            raise UsageError(
                f"argument losses: unknown loss {', '.join(unknown)}; "
                f"registered: {', '.join(sorted(registry.losses()))}; "
                f"other cases: {', '.join(sorted(set(speed.CASES) - set(registry.losses())))}"
            )
        out = _prepare_out(args.out)
        import torch

        threads = torch.get_num_threads()
        torch.set_num_threads(args.threads or threads)
        try:
            return speed.run_command(names, args, out)
        finally:
            torch.set_num_threads(threads)


# ----------------------------------------------------------------------------- bench and tune


def add_budget_arguments(parser, command):
    """Adds the options of `pml-rank bench` or `tune` (`command`) that define a run to
    `parser`: the data set, the preset, every setting of `budget.SETTINGS` (each
    overriding the preset's value), and where and how it runs. Types reject a bad value at
    parse time (one line naming the option, exit status 2). Checks that depend on the rows
    or the data (the batch size against samples per class, the number of classes, the
    files, the weights) run after parsing and before any work. Imports no torch unless
    --device names something other than cpu."""
    from .harness import arguments

    parser.add_argument(
        "--dataset",
        type=dataset_argument,
        default="glyphs",
        metavar="NAME",
        help=f"{', '.join(DATASET_NAMES)} (under --data-root) or folder:PATH (one subfolder of images per "
        "class) (default: %(default)s, generated locally, no download)",
    )
    parser.add_argument(
        "--data-root",
        metavar="DIR",
        help="folder holding cub200, cars196, sop, inshop (README) (default: none; only those data sets need it)",
    )
    parser.add_argument(
        "--preset",
        choices=(AUTO_PRESET, *PRESETS),
        default=AUTO_PRESET,
        help="the budget every other option overrides: glyphs (the default on the glyphs) or reality-check "
        "(the paper's protocol; the default on image data sets) (default: %(default)s)",
    )
    add_setting_options(parser, command)
    parser.add_argument(
        "--threads",
        type=arguments.positive_int,
        default=DEFAULT_THREADS,
        help="torch CPU threads per worker process, >= 1 (default %(default)s: the small CNN's steps are too "
        "short to gain from more, and lose much when other processes compete for the cores)",
    )
    parser.add_argument(
        "--cache-dir",
        metavar="DIR",
        help="where the generated glyphs and the image checks are cached (default: $PML_RANK_CACHE when set, "
        "else ~/.cache/pml-rank)",
    )
    parser.add_argument(
        "--device",
        type=arguments.device,
        default="cpu",
        help=f"torch device: {arguments.DEVICE_HELP} (default %(default)s: the glyphs' small CNN takes steps too "
        "small to fill a GPU, so a GPU machine's cores run its bench faster than its GPU: the default glyph bench "
        "took 130 s on the 16 cores of an H200 machine, about 5 minutes with --device cuda; an ImageNet trunk "
        "wants cuda)",
    )
    parser.add_argument(
        "--devices",
        type=arguments.device_list,
        metavar="D1,D2,...",
        help="one device per local worker, e.g. cuda:0,cuda:1 (--workers defaults to their number)",
    )
    parser.add_argument(
        "--loader-workers",
        type=arguments.non_negative_int,
        help="data-loading processes per worker for image decoding, >= 0 (default: 0 on the CPU and for the "
        f"glyphs; on a GPU, {arguments.LOADER_WORKERS_PER_GPU_PROCESS} per worker within the cores: a ResNet-50 "
        "step at 224 px is 5-6 times faster than "
        "one process prepares its batch). Results do not depend on it (augmentations are seeded by each image's "
        "place in the training), but for the N-pair rows' class mining, which mines the batches read ahead",
    )
    parser.add_argument(
        "--storage",
        metavar="URL",
        help="SQLAlchemy URL of the shared storage, e.g. postgresql+psycopg://user:pw@host/db: every process "
        "and machine on it works on the same jobs (default: a SQLite file in --out)",
    )
    parser.add_argument(
        "--heartbeat",
        type=arguments.positive_float,
        default=DEFAULT_HEARTBEAT,
        help="seconds between a running job's heartbeats; a job silent for twice this is "
        "taken up again by another process (default %(default)s)",
    )
    parser.add_argument(
        "--storage-retry",
        type=arguments.non_negative_float,
        default=DEFAULT_RETRY,
        metavar="SECONDS",
        help="how long a storage call failing on a transient error (a database restarting, a dropped "
        "connection, a locked SQLite file) is retried, with backoff, before the command gives up "
        "(exit 1, finished jobs kept) (default %(default)s)",
    )
    parser.add_argument(
        "--workers",
        type=arguments.positive_int,
        help="local worker processes on the storage (default: on the CPU one per core, or per --devices; on a "
        f"GPU, measured per trunk: {arguments.PROCESSES_PER_GPU['small-cnn']} per GPU for the small CNN, 1.9 times "
        "the jobs per second of one process on "
        "an H200, more gaining nothing as the GPU time-slices their contexts; 1 per GPU for the ImageNet trunks, "
        "whose steps fill it; at most one per core)",
    )
    return parser


def _budget(args):
    """The effective budget of a bench or tune command line: the preset's values with every
    option given in their place."""
    from .harness.budget import BudgetError, resolve

    try:
        budget = resolve(args.dataset, args.preset, **given_settings(args))
    except BudgetError as error:
        raise UsageError(str(error)) from None
    return budget


def _rows(args):
    """``{row: Recipe}`` of the rows the command line names (default: the default rows)."""
    from .harness import recipes

    try:
        return recipes.rows(args.losses or None)
    except KeyError as error:
        raise UsageError(f"argument losses: {error.args[0]}") from None


def _machine(args, budget):
    from .harness.runner import Machine
    from .harness.workers import default_loader_workers

    device = args.devices[0] if args.devices else args.device
    models_dir = str(Path(args.out) / "models") if getattr(args, "save_models", False) else None
    loader_workers = args.loader_workers
    if loader_workers is None:
        loader_workers = default_loader_workers(device, budget["dataset"] == "glyphs", _workers(args, budget))
    return Machine(
        data_root=args.data_root,
        cache_dir=args.cache_dir,
        device=device,
        loader_workers=loader_workers,
        models_dir=models_dir,
    )


def _workers(args, budget):
    """The local worker processes: --workers, else `workers.default_processes`."""
    from .harness.workers import default_processes

    return args.workers or default_processes(args.devices or [args.device], budget["trunk"])


def _refusals():
    """The errors a bench or tune refuses with, before any work: exit 2, one message."""
    from .harness.backbones import WeightsNotFoundError
    from .harness.bench import ParamsError
    from .harness.budget import BudgetError
    from .harness.datasets import DataError
    from .harness.jobs import MismatchError
    from .harness.storage import StorageError

    return (WeightsNotFoundError, ParamsError, DataError, MismatchError, BudgetError, StorageError)


def _refused(error):
    from .harness.storage import StorageError

    if isinstance(error, StorageError):
        return UsageError(f"argument --storage: {error}")
    return UsageError(str(error).strip())


def _warn(budget):
    """Prints what the budget will likely get wrong, before any training."""
    from .harness.budget import budget_warnings

    for line in budget_warnings(budget):
        print(f"pml-rank: warning: {line}", file=sys.stderr)


class BenchCommand(Command):
    name = "bench"
    help = (
        "every registered loss and PML's baselines under the Reality Check protocol, on the embedded "
        "glyphs, the papers' data sets or your own images"
    )

    def add_arguments(self, parser):
        parser.add_argument(
            "losses",
            nargs="*",
            help="registered loss names and pml:<name> baselines (default: all registered losses and "
            f"{' '.join(DEFAULT_BASELINES)}; --list shows every row)",
        )
        parser.add_argument(
            "--list",
            action="store_true",
            help="show every row with its miner, batches and optimizer, and exit (default: run the bench)",
        )
        add_budget_arguments(parser, "bench")
        parser.add_argument(
            "--out",
            default="pml-rank-results",
            help=OUT_HELP + "; writes bench.csv, bench.json, bench.png and bench.db, the storage of the jobs "
            "(rerunning the same command resumes)",
        )
        parser.add_argument(
            "--params",
            metavar="FILE",
            help="tuned parameters (pml-rank tune's tuned.json); default: the file shipped for the default glyph "
            "budget",
        )
        parser.add_argument("--untuned", action="store_true", help="train every loss with its paper's defaults")
        parser.add_argument(
            "--save-models",
            action="store_true",
            help="keep every fold model (the best epoch's trunk and embedder, as PML's hooks save them) and its "
            "record-keeper logs in OUT/models/<row>/<setup>/seed<k>/fold<f>, on the machine that trained it "
            "(default: discard them)",
        )
        parser.add_argument(
            "--status",
            action="store_true",
            help="show the jobs done, running and waiting per row of the storage's bench, and exit "
            "(default: run the bench)",
        )

    def run(self, args):
        if args.status and not args.list:
            return self.status(args)
        bench = _harness("bench")
        from .harness import recipes, report, runner, storage

        if args.list:
            from .harness.text_table import format_text_table

            print(format_text_table(("row", "miner", "batches", "optimizer"), recipes.describe(), align="llll"))
            return 0
        budget = _budget(args)
        row_recipes = runner.with_budget_batches(budget, _rows(args))
        refusals = _refusals()
        try:
            # Refused before the output folder is made or the storage reached.
            runner.check_rows(budget, row_recipes)
            params, source, defaults_won, note = bench.choose_params(args.params, args.untuned, budget)
        except refusals as error:
            raise _refused(error) from None
        out = _prepare_out(args.out)
        url = args.storage or storage.default_url(out, bench.STORE_FILE)
        if note:
            print(f"note: {note}", file=sys.stderr)
        try:
            result = bench.run_bench(
                row_recipes,
                budget,
                url,
                machine=_machine(args, budget),
                seeds=budget["seeds"],
                params=params,
                params_source=source,
                defaults_won=defaults_won,
                workers=_workers(args, budget),
                devices=args.devices,
                threads=args.threads,
                heartbeat=args.heartbeat,
                retry=args.storage_retry,
            )
        except refusals as error:
            raise _refused(error) from None
        except Exception as error:
            unavailable = storage.unavailable_in(error)
            if unavailable is None:
                raise
            print(
                f"pml-rank bench: {unavailable}; finished jobs are kept there and the same command resumes",
                file=sys.stderr,
            )
            return 1
        except KeyboardInterrupt:
            print(
                f"\npml-rank bench: interrupted; finished jobs are kept in {storage.redact(url)} "
                "and the same command resumes",
                file=sys.stderr,
            )
            return 130
        if result.resumed:
            print(f"resumed: {result.resumed} finished job(s) read from {storage.redact(url)}")
        print(report.format_table(result))
        for path in report.write_all(result, out):
            print(f"written: {path}")
        return 0

    def status(self, args):
        """`pml-rank bench --status`: jobs done / running / waiting per row of the storage's
        bench, reading only (no torch, no folder, file, table or study made); exit 1 when the
        storage holds no bench."""
        jobs = _harness("jobs")
        from .harness.storage import StorageError, StorageUnavailable, check_url, default_url, redact
        from .harness.text_table import format_text_table

        url = args.storage or default_url(args.out, jobs.STORE_FILE)
        try:
            check_url(url)
            benches = jobs.stored_status(url, args.storage_retry)
        except StorageError as error:
            raise _refused(error) from None
        except StorageUnavailable as error:
            print(f"pml-rank bench: {error}", file=sys.stderr)
            return 1
        if not benches:
            print(f"pml-rank bench: no bench in this storage ({redact(url)})", file=sys.stderr)
            return 1
        for _, status in benches:
            rows = [(row, c["done"], c["running"], c["waiting"]) for row, c in status.items()]
            rows.append(("all", *(sum(r[i] for r in rows) for i in (1, 2, 3))))
            print(f"bench in {redact(url)}")
            print(format_text_table(("row", "done", "running", "waiting"), rows, align="lrrr"))
        return 0


class TuneCommand(Command):
    name = "tune"
    help = "Reality Check hyperparameter search (Optuna, 4-fold cross-validation on the training classes)"
    description = (
        "Searches each loss's declared space with a seeded TPE sampler, the paper's defaults "
        "first; the objective is the mean over the folds of each fold model's best-epoch validation MAP@R "
        "on the training half of the classes. One study per (loss, data set, budget); rerunning resumes."
    )

    def add_arguments(self, parser):
        from .harness.arguments import non_negative_int

        parser.add_argument("losses", nargs="*", help="loss names as in bench (default: every contender with a space)")
        parser.add_argument("--out", default="pml-rank-tune", help=OUT_HELP + "; writes tuned.json and tune-<loss>.png")
        add_budget_arguments(parser, "tune")
        parser.add_argument(
            "--seed", type=non_negative_int, default=0, help="seed of the sampler and of the fold models (default 0)"
        )
        parser.add_argument(
            "--no-prune",
            action="store_true",
            help="no median pruning between folds (default: prune after the second fold)",
        )

    def run(self, args):
        import os
        import shlex

        tune = _harness("tune")
        from .harness import runner, storage

        row_recipes = _rows(args)
        spaces = tune.search_spaces()
        missing = [name for name in row_recipes if name not in spaces]
        if missing and args.losses:
            raise UsageError(
                f"argument losses: no search space declared for {', '.join(missing)} (a plugin declares "
                "one with the pml_rank_search_spaces hook)"
            )
        budget = _budget(args)
        budget["seed"] = args.seed
        row_recipes = runner.with_budget_batches(
            budget, {name: recipe for name, recipe in row_recipes.items() if name in spaces}
        )
        machine = _machine(args, budget)
        refusals = _refusals()
        try:
            runner.check_rows(budget, row_recipes, validation_only=True)
            runner.check(budget, row_recipes, machine)
        except refusals as error:
            raise _refused(error) from None
        args.out = str(_prepare_out(args.out))
        url = args.storage or storage.default_url(args.out, "tune.db")
        words = [storage.redact(a) if a == args.storage else a for a in args.argv]
        command = "pml-rank " + " ".join(shlex.quote(a) for a in words)
        _warn(budget)
        try:
            result = tune.tune(
                list(row_recipes),
                budget["trials"],
                budget,
                url,
                args.out,
                workers=_workers(args, budget),
                machine=machine,
                devices=args.devices,
                threads=args.threads,
                heartbeat=args.heartbeat,
                prune=not args.no_prune,
                command=command,
                retry=args.storage_retry,
            )
        except storage.StorageError as error:
            raise UsageError(f"argument --storage: {error}") from None
        except RuntimeError as error:
            print(error, file=sys.stderr)
            return 1
        print(tune.format_table(result.entries))
        written = os.path.join(args.out, tune.TUNED_FILE)
        print(f"written: {written} ({result.seconds:.0f} s); storage {storage.redact(url)}")
        if result.interrupted:
            print("pml-rank tune: interrupted; finished trials are kept and the same command resumes", file=sys.stderr)
            return 130
        return 0


# The subcommands, in the order `pml-rank --help` lists them.
COMMANDS = (ListCommand(), SpeedCommand(), BenchCommand(), TuneCommand())


def build_parser():
    """`pml-rank`'s parser: one subcommand per entry of `COMMANDS`, with its options."""
    from .harness.arguments import ArgumentParser

    parser = ArgumentParser(
        prog="pml-rank",
        description="Rank- and AUC-based losses for pytorch-metric-learning.",
    )
    parser.add_argument("--version", action="version", version=f"pml-rank {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        p = subparsers.add_parser(command.name, help=command.help, description=command.description)
        command.add_arguments(p)
        p.set_defaults(run=command.run)
    return parser


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.argv = argv  # the command as given, for reports that name it
    try:
        return args.run(args)
    except UsageError as error:
        print(f"pml-rank {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
