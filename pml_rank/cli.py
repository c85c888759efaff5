"""The `pml-rank` command."""

import argparse
import importlib
import importlib.util
import sys

from . import __version__
from .harness.budget import DEFAULTS

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

    rows = [(c.name, KINDS[c.kind].singular, c.distribution, f"{c.cls.__module__}.{c.cls.__qualname__}")
            for c in registry.components()]
    print(format_text_table(("name", "kind", "distribution", "class"), rows, align="llll"))
    return 0


def _cmd_speed(args):
    import datetime
    import os
    import shlex

    speed = _harness("speed")
    from .plugins import registry

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    started = datetime.datetime.now(datetime.timezone.utc)
    load_start = os.getloadavg() if hasattr(os, "getloadavg") else None
    names = args.losses or sorted(registry.losses())
    known = set(registry.losses()) | set(speed.CASES)
    unknown = [n for n in names if n not in known]
    if unknown:
        print(f"pml-rank speed: unknown loss {', '.join(unknown)}; "
              f"registered: {', '.join(sorted(registry.losses()))}; "
              f"other cases: {', '.join(sorted(set(speed.CASES) - set(registry.losses())))}", file=sys.stderr)
        return 2
    results, underflow = [], []
    for name in names:
        sizes = args.sizes or speed.case_for(name).default_sizes or speed.DEFAULT_BATCH_SIZES
        result = speed.measure(name, sizes=sizes, dim=args.dim, repeats=args.repeats,
                               device=args.device, seed=args.seed, runs=args.runs)
        results.append(result)
        print(speed.format_table(result))
        path = speed.write_json(result, f"{args.out}/speed-{name}.json")
        print(f"written: {path}\n")
    if args.underflow:
        for name in names:
            size = max(args.sizes or speed.case_for(name).default_sizes or speed.DEFAULT_BATCH_SIZES)
            underflow.append(speed.measure_underflow(name, size=size, dim=args.dim, repeats=args.repeats,
                                                     device=args.device, seed=args.seed, runs=args.runs))
        print("No slow path: each loss on underflow-provoking inputs / on its usual inputs "
              f"(median of per-round ratios, min-max)\n{speed.format_underflow(underflow)}\n")
    if args.report:
        command = "pml-rank " + " ".join(shlex.quote(a) for a in args.argv)
        for path in speed.write_report(results, underflow, args.report, command, started, load_start):
            print(f"written: {path}")
    return 0


def _cmd_bench(args):
    import torch

    bench = _harness("bench")

    torch.set_num_threads(args.threads)
    try:
        contenders = bench.recipes(args.losses or None)
    except KeyError as error:
        print(f"pml-rank bench: {error.args[0]}", file=sys.stderr)
        return 2
    result = bench.run_bench(list(contenders), dataset=args.dataset, epochs=args.epochs,
                             iterations_per_epoch=args.iterations, batch_size=args.batch_size,
                             seeds=args.seeds, embedding_size=args.embedding_size, lr=args.lr,
                             device=args.device, cache_dir=args.cache_dir, num_classes=args.classes)
    print(bench.format_table(result))
    for path in bench.write_all(result, args.out):
        print(f"written: {path}")
    return 0


def build_parser():
    parser = argparse.ArgumentParser(
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
    p.add_argument("--sizes", type=int, nargs="+",
                   help="batch sizes (sequence lengths for sequence losses); default 512 1024 2048")
    p.add_argument("--dim", type=int, default=512, help="embedding dimension (default 512)")
    p.add_argument("--repeats", type=int, default=5,
                   help="interleaved rounds per run, each timing every contender once (default 5)")
    p.add_argument("--runs", type=int, default=1,
                   help="repeat the whole measurement this many times; ratios pool every round (default 1)")
    p.add_argument("--underflow", action="store_true",
                   help="also time each loss on inputs that drive exp/sigmoid arguments out of float range "
                        "against its usual inputs (the no-slow-path case), at the largest size")
    p.add_argument("--threads", type=int,
                   help="torch CPU threads for the measurement (default: torch's). On a machine shared with "
                        "other work, 1 keeps a descheduled worker thread from stalling every parallel op")
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="pml-rank-results", help="folder for the per-loss JSON results")
    p.add_argument("--report", metavar="PATH",
                   help="also write PATH.json and PATH.md: every table with its spread, the command, "
                        "date and machine (e.g. examples/results/speed)")
    p.set_defaults(run=_cmd_speed)

    p = commands.add_parser(
        "bench",
        help="every registered loss and PML's baselines under the Reality Check protocol "
             "on the embedded glyph data set",
    )
    p.add_argument("losses", nargs="*",
                   help="registered loss names and pml:<name> baselines (default: all registered "
                        "losses and pml:ContrastiveLoss pml:TripletMarginLoss pml:FastAPLoss pml:NPairsLoss)")
    p.add_argument("--dataset", default=DEFAULTS["dataset"], help="data set (default: glyphs, no download)")
    p.add_argument("--epochs", type=int, default=DEFAULTS["epochs"], help="epochs per model (default %(default)s)")
    p.add_argument("--iterations", type=int, default=DEFAULTS["iterations_per_epoch"],
                   help="iterations per epoch (default %(default)s)")
    p.add_argument("--batch-size", type=int, default=DEFAULTS["batch_size"], help="default %(default)s")
    p.add_argument("--seeds", type=int, default=DEFAULTS["seeds"],
                   help="repeated runs for the confidence intervals (default %(default)s)")
    p.add_argument("--embedding-size", type=int, default=DEFAULTS["embedding_size"], help="default %(default)s")
    p.add_argument("--lr", type=float, default=DEFAULTS["lr"], help="Adam learning rate (default %(default)s)")
    p.add_argument("--classes", type=int, help="use only the first N classes (quick runs)")
    p.add_argument("--device", default=DEFAULTS["device"])
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (default 1: the small CNN's steps are too short to gain "
                        "from more, and lose much when other processes compete for the cores)")
    p.add_argument("--cache-dir", help="where the generated data set is cached (default ~/.cache/pml-rank)")
    p.add_argument("--out", default="pml-rank-results", help="folder for bench.csv, bench.json, bench.png")
    p.set_defaults(run=_cmd_bench)

    return parser


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.argv = argv  # the command as given, for reports that name it
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
