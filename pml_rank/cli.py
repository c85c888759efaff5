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
    speed = _harness("speed")
    from .plugins import registry

    names = args.losses or sorted(registry.losses())
    unknown = [n for n in names if n not in registry.losses()]
    if unknown:
        print(f"pml-rank speed: unknown loss {', '.join(unknown)}; "
              f"registered: {', '.join(sorted(registry.losses()))}", file=sys.stderr)
        return 2
    for name in names:
        sizes = args.sizes or speed.case_for(name).default_sizes or speed.DEFAULT_BATCH_SIZES
        result = speed.measure(name, sizes=sizes, dim=args.dim, repeats=args.repeats,
                               device=args.device, seed=args.seed)
        print(speed.format_table(result))
        path = speed.write_json(result, f"{args.out}/speed-{name}.json")
        print(f"written: {path}\n")
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

    import torch

    from .harness.budget import SHIPPED_PARAMS

    bench = _harness("bench")

    torch.set_num_threads(args.threads)
    try:
        contenders = bench.recipes(args.losses or None)
        params, source = _bench_params(args)
    except (KeyError, FileNotFoundError) as error:
        print(f"pml-rank bench: {error.args[0]}", file=sys.stderr)
        return 2
    try:
        result = bench.run_bench(list(contenders), dataset=args.dataset, epochs=args.epochs,
                                 iterations_per_epoch=args.iterations, batch_size=args.batch_size,
                                 seeds=args.seeds, embedding_size=args.embedding_size, lr=args.lr,
                                 device=args.device, cache_dir=args.cache_dir, num_classes=args.classes,
                                 params=params, params_source=source, threads=args.threads,
                                 workers=args.workers or os.cpu_count() or 1,
                                 store=os.path.join(args.out, bench.STORE_FILE))
    except bench.StoreMismatchError as error:
        print(f"pml-rank bench: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"\npml-rank bench: interrupted; finished runs are kept in {args.out}/{bench.STORE_FILE} "
              "and the same command resumes", file=sys.stderr)
        return 130
    if source:
        differences = bench.tuned_budget_differences(args.params or SHIPPED_PARAMS, result.config)
        if differences:
            print(f"note: the parameters in {source} were tuned with another budget ({'; '.join(differences)})",
                  file=sys.stderr)
    if result.resumed:
        print(f"resumed: {result.resumed} finished run(s) read from {args.out}/{bench.STORE_FILE}")
    print(bench.format_table(result))
    for path in bench.write_all(result, args.out):
        print(f"written: {path}")
    return 0


def _cmd_tune(args):
    import os
    import shlex

    tune = _harness("tune")
    bench = _harness("bench")
    try:
        losses = list(bench.recipes(args.losses or None))
    except KeyError as error:
        print(f"pml-rank tune: {error.args[0]}", file=sys.stderr)
        return 2
    spaces = tune.search_spaces()
    missing = [name for name in losses if name not in spaces]
    if missing and args.losses:
        print(f"pml-rank tune: no search space declared for {', '.join(missing)} (a plugin declares one with "
              "the pml_rank_search_spaces hook)", file=sys.stderr)
        return 2
    losses = [name for name in losses if name in spaces]
    config = tune.budget_config(dataset=args.dataset, epochs=args.epochs, iterations_per_epoch=args.iterations,
                                batch_size=args.batch_size, embedding_size=args.embedding_size, lr=args.lr,
                                num_classes=args.classes, seed=args.seed)
    storage = args.storage or tune.default_storage(args.out)
    command = "pml-rank tune " + " ".join(shlex.quote(a) for a in sys.argv[1:] if a != "tune") \
        if sys.argv[1:2] == ["tune"] else None
    if command and args.storage:
        command = command.replace(args.storage, tune.redact(args.storage))
    workers = args.workers or os.cpu_count() or 1
    try:
        result = tune.tune(losses, args.trials, config, storage, args.out, workers=workers, cache_dir=args.cache_dir,
                           threads=args.threads, device=args.device, heartbeat=args.heartbeat,
                           prune=not args.no_prune, command=command)
    except RuntimeError as error:
        print(error, file=sys.stderr)
        return 1
    print(tune.format_table(result.entries))
    print(f"written: {os.path.join(args.out, tune.TUNED_FILE)} ({result.seconds:.0f} s); "
          f"storage {tune.redact(storage)}")
    if result.interrupted:
        print("pml-rank tune: interrupted; finished trials are kept and the same command resumes", file=sys.stderr)
        return 130
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
    p.add_argument("--repeats", type=int, default=5, help="timed runs per contender (median)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="pml-rank-results", help="folder for the JSON results")
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
    p.add_argument("--out", default="pml-rank-results",
                   help="folder for bench.csv, bench.json, bench.png and the store of finished runs "
                        "(bench-runs.jsonl: rerunning the same command resumes)")
    p.add_argument("--params", metavar="FILE",
                   help="tuned parameters (pml-rank tune's tuned.json); default: the file shipped for the "
                        "default glyph budget")
    p.add_argument("--untuned", action="store_true", help="train every loss with its paper's defaults")
    p.add_argument("--workers", type=int,
                   help="processes running (row, seed) jobs in parallel, results identical to a serial run "
                        "(default: the number of cores)")
    p.set_defaults(run=_cmd_bench)

    p = commands.add_parser(
        "tune",
        help="Reality Check hyperparameter search (Optuna, 4-fold cross-validation on the training classes)",
        description="Searches each loss's declared space with a seeded TPE sampler; the objective is the mean "
                    "over the folds of each fold model's best-epoch validation MAP@R on the training half of the "
                    "classes. One study per (loss, data set, budget); rerunning resumes.")
    p.add_argument("losses", nargs="*", help="loss names as in bench (default: every contender with a space)")
    p.add_argument("--trials", type=int, default=20,
                   help="finished trials each study should hold (default %(default)s); a rerun resumes to N")
    p.add_argument("--workers", type=int, help="local worker processes on the storage (default: the number of cores)")
    p.add_argument("--storage", metavar="URL",
                   help="SQLAlchemy URL of the Optuna storage, e.g. postgresql+psycopg://user:pw@host/db "
                        "(default: sqlite:///OUT/tune.db)")
    p.add_argument("--out", default="pml-rank-tune", help="folder for tuned.json and the PNGs (default %(default)s)")
    p.add_argument("--dataset", default=DEFAULTS["dataset"], help="data set (default: glyphs, no download)")
    p.add_argument("--epochs", type=int, default=DEFAULTS["epochs"], help="epochs per model (default %(default)s)")
    p.add_argument("--iterations", type=int, default=DEFAULTS["iterations_per_epoch"],
                   help="iterations per epoch (default %(default)s)")
    p.add_argument("--batch-size", type=int, default=DEFAULTS["batch_size"], help="default %(default)s")
    p.add_argument("--embedding-size", type=int, default=DEFAULTS["embedding_size"], help="default %(default)s")
    p.add_argument("--lr", type=float, default=DEFAULTS["lr"], help="Adam learning rate (default %(default)s)")
    p.add_argument("--classes", type=int, help="use only the first N classes (quick runs)")
    p.add_argument("--device", default=DEFAULTS["device"])
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads per worker (default 1)")
    p.add_argument("--cache-dir", help="where the generated data set is cached (default ~/.cache/pml-rank)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampler and of the fold models (default 0)")
    p.add_argument("--heartbeat", type=float, default=20.0,
                   help="seconds between a running trial's heartbeats; a trial silent for twice this is "
                        "failed and retried (default %(default)s)")
    p.add_argument("--no-prune", action="store_true",
                   help="no median pruning between folds (default: prune after the second fold)")
    p.set_defaults(run=_cmd_tune)

    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
