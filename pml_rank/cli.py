"""The `pml-rank` command."""

import importlib
import importlib.util
import sys

from . import __version__
from .harness.budget import (
    DATASET_NAMES,
    DEFAULTS,
    LR_SCHEDULES,
    SPEED_DEFAULT_SIZES,
    SPEED_DEFAULT_SIZES_PER_LOSS,
    minimum_classes,
)

# Everything that imports torch is imported inside the commands, so that --help and
# argument errors answer at once.


def _harness(module):
    """The harness module `module`, or exit 2 naming what is missing and the extra that installs it."""
    from .harness import REQUIRED_MODULES

    missing = [name for name in REQUIRED_MODULES if importlib.util.find_spec(name) is None]
    if missing:
        print(f"pml-rank: the harness needs {', '.join(missing)}: pip install 'pml-rank[harness]'", file=sys.stderr)
        sys.exit(2)
    return importlib.import_module(f".harness.{module}", __package__)


def _cmd_list(args):
    from .harness.text_table import format_text_table
    from .plugins import KINDS, registry

    rows = [
        (c.name, KINDS[c.kind].singular, c.distribution, f"{c.cls.__module__}.{c.cls.__qualname__}")
        for c in registry.components()
    ]
    print(format_text_table(("name", "kind", "distribution", "class"), rows, align="llll"))
    return 0


class UsageError(Exception):
    """A command line that parsed but cannot run (an unknown loss, a batch size the chosen
    rows cannot use, an output folder that cannot be written): `main` prints it in one
    line and returns 2, before any work."""


def _prepare_out(path):
    from .harness.outputs import OutputError, prepare_output_dir

    try:
        return prepare_output_dir(path)
    except OutputError as error:
        raise UsageError(f"argument {error}") from None


def _cmd_speed(args):
    speed = _harness("speed")
    from .plugins import registry

    names = args.losses or sorted(registry.losses())
    known = set(registry.losses()) | set(speed.CASES)
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
        return _speed_runs(speed, names, args, out)
    finally:
        torch.set_num_threads(threads)


def _speed_runs(speed, names, args, out):
    import datetime
    import os
    import shlex

    started = datetime.datetime.now(datetime.timezone.utc)
    load_start = os.getloadavg() if hasattr(os, "getloadavg") else None
    results, underflow = [], []
    for name in names:
        sizes = args.sizes or speed.case_for(name).default_sizes or speed.DEFAULT_BATCH_SIZES
        result = speed.measure(
            name, sizes=sizes, dim=args.dim, repeats=args.repeats, device=args.device, seed=args.seed, runs=args.runs
        )
        results.append(result)
        print(speed.format_table(result))
        path = speed.write_json(result, out / f"speed-{name}.json")
        print(f"written: {path}\n")
    if args.underflow:
        for name in names:
            size = max(args.sizes or speed.case_for(name).default_sizes or speed.DEFAULT_BATCH_SIZES)
            underflow.append(
                speed.measure_underflow(
                    name,
                    size=size,
                    dim=args.dim,
                    repeats=args.repeats,
                    device=args.device,
                    seed=args.seed,
                    runs=args.runs,
                )
            )
        print(
            "No slow path: each loss on underflow-provoking inputs / on its usual inputs "
            f"(median of per-round ratios, min-max)\n{speed.format_underflow(underflow)}\n"
        )
    if args.report:
        command = "pml-rank " + " ".join(shlex.quote(a) for a in args.argv)
        for path in speed.write_report(results, underflow, args.report, command, started, load_start):
            print(f"written: {path}")
    return 0


def _bench_params(args):
    """``(params, source)`` for the bench: --params FILE, the shipped tuned file, or none (--untuned)."""
    from pathlib import Path

    from .harness.budget import SHIPPED_PARAMS

    bench = _harness("bench")
    if args.untuned:
        return {}, None
    path = Path(args.params) if args.params else SHIPPED_PARAMS
    if not path.exists():
        if args.params:
            raise FileNotFoundError(f"--params: no such file: {path}")
        return {}, None
    return bench.load_params(path), f"tuned ({path.name})"


def _cmd_bench(args):
    import os

    from .harness.budget import SHIPPED_PARAMS

    bench = _harness("bench")

    try:
        contenders = bench.recipes(args.losses or None)
    except KeyError as error:
        raise UsageError(f"argument losses: {error.args[0]}") from None
    try:
        params, source = _bench_params(args)
    except FileNotFoundError as error:
        raise UsageError(f"argument {error.args[0]}") from None
    try:
        bench.check_budget(contenders, args.batch_size, args.classes)
    except bench.BudgetError as error:
        raise UsageError(str(error)) from None
    out = _prepare_out(args.out)
    try:
        result = bench.run_bench(
            list(contenders),
            dataset=args.dataset,
            epochs=args.epochs,
            iterations_per_epoch=args.iterations,
            batch_size=args.batch_size,
            seeds=args.seeds,
            embedding_size=args.embedding_size,
            lr=args.lr,
            lr_schedule=args.lr_schedule,
            device=args.device,
            cache_dir=args.cache_dir,
            num_classes=args.classes,
            params=params,
            params_source=source,
            threads=args.threads,
            workers=args.workers or os.cpu_count() or 1,
            store=os.path.join(out, bench.STORE_FILE),
        )
    except bench.BudgetError as error:  # what needs the data: more classes than it has
        raise UsageError(str(error)) from None
    except bench.StoreMismatchError as error:
        print(f"pml-rank bench: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(
            f"\npml-rank bench: interrupted; finished runs are kept in {out}/{bench.STORE_FILE} "
            "and the same command resumes",
            file=sys.stderr,
        )
        return 130
    if source:
        differences = bench.tuned_budget_differences(args.params or SHIPPED_PARAMS, result.config)
        if differences:
            print(
                f"note: the parameters in {source} were tuned with another budget ({'; '.join(differences)})",
                file=sys.stderr,
            )
    if result.resumed:
        print(f"resumed: {result.resumed} finished run(s) read from {out}/{bench.STORE_FILE}")
    print(bench.format_table(result))
    for path in bench.write_all(result, out):
        print(f"written: {path}")
    return 0


def _cmd_tune(args):
    import os
    import shlex

    tune = _harness("tune")
    bench = _harness("bench")
    try:
        contenders = bench.recipes(args.losses or None)
    except KeyError as error:
        raise UsageError(f"argument losses: {error.args[0]}") from None
    spaces = tune.search_spaces()
    missing = [name for name in contenders if name not in spaces]
    if missing and args.losses:
        raise UsageError(
            f"argument losses: no search space declared for {', '.join(missing)} (a plugin declares "
            "one with the pml_rank_search_spaces hook)"
        )
    contenders = {name: recipe for name, recipe in contenders.items() if name in spaces}
    try:
        bench.check_budget(contenders, args.batch_size, args.classes)
    except bench.BudgetError as error:
        raise UsageError(str(error)) from None
    losses = list(contenders)
    args.out = str(_prepare_out(args.out))
    config = tune.budget_config(
        dataset=args.dataset,
        epochs=args.epochs,
        iterations_per_epoch=args.iterations,
        batch_size=args.batch_size,
        embedding_size=args.embedding_size,
        lr=args.lr,
        lr_schedule=args.lr_schedule,
        num_classes=args.classes,
        seed=args.seed,
    )
    storage = args.storage or tune.default_storage(args.out)
    command = (
        "pml-rank tune " + " ".join(shlex.quote(a) for a in sys.argv[1:] if a != "tune")
        if sys.argv[1:2] == ["tune"]
        else None
    )
    if command and args.storage:
        command = command.replace(args.storage, tune.redact(args.storage))
    workers = args.workers or os.cpu_count() or 1
    try:
        result = tune.tune(
            losses,
            args.trials,
            config,
            storage,
            args.out,
            workers=workers,
            cache_dir=args.cache_dir,
            threads=args.threads,
            device=args.device,
            heartbeat=args.heartbeat,
            prune=not args.no_prune,
            command=command,
        )
    except tune.StorageError as error:
        raise UsageError(f"argument --storage: {error}") from None
    except RuntimeError as error:
        print(error, file=sys.stderr)
        return 1
    print(tune.format_table(result.entries))
    print(
        f"written: {os.path.join(args.out, tune.TUNED_FILE)} ({result.seconds:.0f} s); storage {tune.redact(storage)}"
    )
    if result.interrupted:
        print("pml-rank tune: interrupted; finished trials are kept and the same command resumes", file=sys.stderr)
        return 130
    return 0


OUT_HELP = "folder for the results, created if missing and checked writable before any work (default: %(default)s)"


def add_budget_arguments(parser):
    """Adds the training budget options of `pml-rank bench` to `parser` (an argparse
    parser): --dataset --epochs --iterations --batch-size --classes --embedding-size --lr --lr-schedule
    --threads --cache-dir --device, with bench's defaults and types that reject a bad
    value at parse time (one line naming the option, exit status 2). Checks that depend
    on the chosen rows (the batch size against samples per class, the number of classes)
    are `pml_rank.harness.bench.check_budget`'s, to call after parsing and before any
    work. Imports no torch unless --device names something other than cpu."""
    from .harness import arguments

    parser.add_argument(
        "--dataset",
        default=DEFAULTS["dataset"],
        choices=DATASET_NAMES,
        help="data set (default: %(default)s, generated locally, no download)",
    )
    parser.add_argument(
        "--epochs",
        type=arguments.positive_int,
        default=DEFAULTS["epochs"],
        help="epochs per fold model, >= 1 (default %(default)s)",
    )
    parser.add_argument(
        "--iterations",
        type=arguments.positive_int,
        default=DEFAULTS["iterations_per_epoch"],
        help="iterations per epoch, >= 1 (default %(default)s)",
    )
    parser.add_argument(
        "--batch-size",
        type=arguments.positive_int,
        default=DEFAULTS["batch_size"],
        help="batch size (default %(default)s); a multiple of 4 and >= 8 for the m=4 rows, "
        "even and >= 4 for the N-pair rows",
    )
    parser.add_argument(
        "--classes",
        type=arguments.class_count,
        default=DEFAULTS["num_classes"],
        metavar="N",
        help="use the first N classes of the data set, or 'all' (default %(default)s). Half are for "
        f"training, split over {DEFAULTS['num_folds']} folds: at batch size "
        f"{DEFAULTS['batch_size']} the m=4 rows need N >= "
        f"{minimum_classes(4, DEFAULTS['batch_size'])} and the N-pair rows N >= "
        f"{minimum_classes(2, DEFAULTS['batch_size'])}",
    )
    parser.add_argument(
        "--embedding-size",
        type=arguments.positive_int,
        default=DEFAULTS["embedding_size"],
        help="embedding dimension, >= 1 (default %(default)s)",
    )
    parser.add_argument(
        "--lr",
        type=arguments.positive_float,
        default=DEFAULTS["lr"],
        help="Adam learning rate, a finite number > 0 (default %(default)s)",
    )
    parser.add_argument(
        "--lr-schedule",
        choices=LR_SCHEDULES,
        default=DEFAULTS["lr_schedule"],
        help="cosine: anneal the learning rate to zero over the epochs; constant: keep it (default %(default)s)",
    )
    parser.add_argument(
        "--threads",
        type=arguments.positive_int,
        default=DEFAULTS["threads"],
        help="torch CPU threads, >= 1 (default %(default)s: the small CNN's steps are too "
        "short to gain from more, and lose much when other processes compete for "
        "the cores)",
    )
    parser.add_argument(
        "--cache-dir",
        metavar="DIR",
        help="where the generated data set is cached (default: $PML_RANK_CACHE when set, else ~/.cache/pml-rank)",
    )
    parser.add_argument(
        "--device",
        type=arguments.device,
        default=DEFAULTS["device"],
        help=f"torch device: {arguments.DEVICE_HELP} (default %(default)s)",
    )
    return parser


def build_parser():
    from .harness.arguments import (
        DEVICE_HELP,
        ArgumentParser,
        at_least,
        device,
        non_negative_int,
        positive_float,
        positive_int,
    )

    parser = ArgumentParser(
        prog="pml-rank",
        description="Rank- and AUC-based losses for pytorch-metric-learning.",
    )
    parser.add_argument("--version", action="version", version=f"pml-rank {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    p = commands.add_parser("list", help="every discovered component, its kind and distribution")
    p.set_defaults(run=_cmd_list)

    p = commands.add_parser(
        "speed",
        help="forward+backward time and peak memory against PML and the paper's reference",
    )
    p.add_argument("losses", nargs="*", help="registered loss names (default: all)")
    per_loss = "; ".join(
        f"{name}: {' '.join(map(str, sizes))} (scores in one sequence)"
        for name, sizes in SPEED_DEFAULT_SIZES_PER_LOSS.items()
    )
    p.add_argument(
        "--sizes",
        type=at_least(2),
        nargs="+",
        metavar="N",
        help=f"batch sizes (scores per sequence for sequence losses), each >= 2; default "
        f"{' '.join(map(str, SPEED_DEFAULT_SIZES))}, except {per_loss}",
    )
    p.add_argument("--dim", type=positive_int, default=512, help="embedding dimension, >= 1 (default %(default)s)")
    p.add_argument(
        "--repeats",
        type=positive_int,
        default=5,
        help="interleaved rounds per run and size, each timing every contender once, >= 1; "
        "the table shows the median of the per-round ratios (default %(default)s)",
    )
    p.add_argument("--device", type=device, default="cpu", help=f"torch device: {DEVICE_HELP} (default %(default)s)")
    p.add_argument(
        "--seed", type=non_negative_int, default=0, help="seed of the random inputs, >= 0 (default %(default)s)"
    )
    p.add_argument("--out", default="pml-rank-results", help=OUT_HELP + "; writes speed-<loss>.json")
    p.add_argument(
        "--runs",
        type=positive_int,
        default=1,
        help="repeat the whole measurement this many times, >= 1; ratios pool every round (default %(default)s)",
    )
    p.add_argument(
        "--underflow",
        action="store_true",
        help="also time each loss on inputs that drive exp/sigmoid arguments out of float range "
        "against its usual inputs (the no-slow-path case), at the largest size (default: off)",
    )
    p.add_argument(
        "--threads",
        type=positive_int,
        help="torch CPU threads for the measurement, >= 1 (default: torch's). On a machine shared "
        "with other work, 1 keeps a descheduled worker thread from stalling every parallel op",
    )
    p.add_argument(
        "--report",
        metavar="PATH",
        help="also write PATH.json and PATH.md: every table with its spread, the command, "
        "date and machine, e.g. examples/results/speed (default: none)",
    )
    p.set_defaults(run=_cmd_speed)

    p = commands.add_parser(
        "bench",
        help="every registered loss and PML's baselines under the Reality Check protocol "
        "on the embedded glyph data set",
    )
    p.add_argument(
        "losses",
        nargs="*",
        help="registered loss names and pml:<name> baselines (default: all registered "
        "losses and pml:ContrastiveLoss pml:TripletMarginLoss pml:FastAPLoss pml:NPairsLoss)",
    )
    add_budget_arguments(p)
    p.add_argument(
        "--seeds",
        type=positive_int,
        default=DEFAULTS["seeds"],
        help="repeated runs (seeds 0 to N-1) for the 95%% confidence intervals, >= 1; "
        "1 gives no interval (default %(default)s)",
    )
    p.add_argument(
        "--out",
        default="pml-rank-results",
        help=OUT_HELP + "; writes bench.csv, bench.json, bench.png and bench-runs.jsonl, the store "
        "of finished runs (rerunning the same command resumes)",
    )
    p.add_argument(
        "--params",
        metavar="FILE",
        help="tuned parameters (pml-rank tune's tuned.json); default: the file shipped for the default glyph budget",
    )
    p.add_argument("--untuned", action="store_true", help="train every loss with its paper's defaults")
    p.add_argument(
        "--workers",
        type=positive_int,
        help="processes running (row, seed) jobs in parallel, results identical to a serial run "
        "(default: the number of cores)",
    )
    p.set_defaults(run=_cmd_bench)

    p = commands.add_parser(
        "tune",
        help="Reality Check hyperparameter search (Optuna, 4-fold cross-validation on the training classes)",
        description="Searches each loss's declared space with a seeded TPE sampler; the objective is the mean "
        "over the folds of each fold model's best-epoch validation MAP@R on the training half of the "
        "classes. One study per (loss, data set, budget); rerunning resumes.",
    )
    p.add_argument("losses", nargs="*", help="loss names as in bench (default: every contender with a space)")
    p.add_argument(
        "--trials",
        type=positive_int,
        default=20,
        help="finished trials each study should hold, >= 1 (default %(default)s); a rerun resumes to N",
    )
    p.add_argument(
        "--workers", type=positive_int, help="local worker processes on the storage (default: the number of cores)"
    )
    p.add_argument(
        "--storage",
        metavar="URL",
        help="SQLAlchemy URL of the Optuna storage, e.g. postgresql+psycopg://user:pw@host/db "
        "(default: sqlite:///OUT/tune.db)",
    )
    p.add_argument("--out", default="pml-rank-tune", help=OUT_HELP + "; writes tuned.json and tune-<loss>.png")
    add_budget_arguments(p)
    p.add_argument(
        "--seed", type=non_negative_int, default=0, help="seed of the sampler and of the fold models (default 0)"
    )
    p.add_argument(
        "--heartbeat",
        type=positive_float,
        default=20.0,
        help="seconds between a running trial's heartbeats; a trial silent for twice this is "
        "failed and retried (default %(default)s)",
    )
    p.add_argument(
        "--no-prune", action="store_true", help="no median pruning between folds (default: prune after the second fold)"
    )
    p.set_defaults(run=_cmd_tune)

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
