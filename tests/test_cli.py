"""The `pml-rank` command line at its edges, driven through the real entry point or, where one
start of Python and torch per case is not the point, its function `cli.main` in this process:
every bad argument is refused before any work, in one line naming it, with exit status 2."""

import argparse
import dataclasses
import os
import runpy
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pml_rank import cli
from pml_rank.harness import arguments, budget, workers

ROOT = Path(__file__).resolve().parents[1]
# Nothing is trained when a command returns this fast (a bench trains for minutes). Generous on
# purpose: what matters is the status, the message and that no output appeared.
TIMEOUT = 300  # seconds: a refusal takes a few; only a hang gets near this


def _entry_point():
    """The installed ``pml-rank`` script beside this interpreter, else ``python -m pml_rank.cli``."""
    script = Path(sys.executable).with_name("pml-rank")
    if script.exists():
        return [str(script)]
    found = shutil.which("pml-rank")
    return [found] if found else [sys.executable, "-m", "pml_rank.cli"]


def assert_no_work(tmp_path):
    """No data set was loaded into the cache and no result written to --out, under `tmp_path`."""
    out, cache = tmp_path / "out", tmp_path / "cache"
    assert not cache.exists(), "the data set was loaded"
    if out.exists():
        assert not any(out.iterdir()), f"results were written: {sorted(out.iterdir())}"


def run(command, tmp_path, cwd=None):
    """Runs a command line with its own --out and data cache under `tmp_path`; returns
    ``(status, stderr)`` and checks that no output or data was written (no work was done)."""
    env = dict(os.environ, PML_RANK_CACHE=str(tmp_path / "cache"), PYTHONWARNINGS="ignore")
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=cwd or tmp_path, timeout=TIMEOUT)
    assert_no_work(tmp_path)
    return done.returncode, done.stderr


@pytest.fixture
def run_here(run_cli, tmp_path, monkeypatch):
    """``run_here(argv) -> (status, stderr)``: `run` for `pml-rank argv` through `cli.main`, the
    console script's function, in this process (`run_cli`): one start of Python and torch per
    refusal is not needed where the script itself refuses in the tests around."""
    monkeypatch.setenv("PML_RANK_CACHE", str(tmp_path / "cache"))

    def run_in_process(argv):
        status, _, stderr = run_cli(argv)
        assert_no_work(tmp_path)
        return status, stderr

    return run_in_process


def assert_refused(status, stderr, *names):
    assert status == 2, stderr
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one line, got:\n{stderr}"
    for name in names:
        assert name in lines[0], f"{name!r} not in {lines[0]!r}"


def _cuda_available():
    import torch

    return torch.cuda.is_available()


BAD_ARGUMENTS = [
    (["bench", "--seeds", "0"], ["--seeds"]),
    (["bench", "--threads", "0"], ["--threads"]),
    (["bench", "--dataset", "foo"], ["--dataset", "foo"]),
    (["bench", "--lr", "nan"], ["--lr", "nan"]),
    (["bench", "--lr", "inf"], ["--lr"]),
    (["bench", "--lr", "-0.1"], ["--lr"]),
    (["bench", "--iterations", "0"], ["--iterations"]),
    (["bench", "--epochs", "0"], ["--epochs"]),
    (["bench", "--embedding-size", "0"], ["--embedding-size"]),
    (["bench", "--batch-size", "0"], ["--batch-size"]),
    (["bench", "--classes", "1"], ["--classes"]),
    (["bench", "--epochs", "two"], ["--epochs", "two"]),
    (["bench", "NoSuchLoss"], ["NoSuchLoss"]),
    (["bench", "--preset", "paper"], ["--preset", "paper"]),
    (["bench", "--trunk", "vgg16"], ["--trunk", "vgg16"]),
    (["bench", "--optimizer", "adamw"], ["--optimizer", "adamw"]),
    (["bench", "--weight-decay", "-0.5"], ["--weight-decay", "-0.5"]),
    (["bench", "--momentum", "nan"], ["--momentum", "nan"]),
    (["bench", "--momentum", "0.9"], ["--momentum", "Adam"]),
    (["bench", "--patience", "0"], ["--patience"]),
    (["bench", "--image-size", "8"], ["--image-size", "16"]),
    (["bench", "--augmentation", "mixup"], ["--augmentation", "mixup"]),
    (["bench", "--lr-schedule", "linear"], ["--lr-schedule", "linear"]),
    (["bench", "--devices", ","], ["--devices"]),
    (["bench", "--devices", "cpu,gpu0"], ["--devices", "gpu0"]),
    (["bench", "--loader-workers", "-1"], ["--loader-workers"]),
    (["bench", "--dataset", "folder:/nonexistent"], ["--dataset", "/nonexistent"]),
    (["bench", "--freeze-batchnorm", "maybe"], ["--freeze-batchnorm", "maybe"]),
    (["bench", "--heartbeat", "0"], ["--heartbeat"]),
    (["bench", "--workers", "0"], ["--workers"]),
    (["bench", "--protocol", "standard"], ["--protocol", "standard", "glyphs"]),
    (["bench", "--protocol", "standard", "--dataset", "cub200", "--patience", "5"], ["--patience"]),
    (["bench", "--protocol", "standard", "--dataset", "cub200", "--classes", "8"], ["--classes"]),
    (["bench", "--lr-drop", "35"], ["--lr-drop", "EPOCH:FACTOR"]),
    (["bench", "--lr-drop", "35:0.3"], ["--lr-drop", "constant"]),
    (["bench", "--embedder-lr-factor", "10"], ["--embedder-lr-factor", "small CNN"]),
    (["bench", "--samples-per-class", "1"], ["--samples-per-class"]),
    (["bench", "--samples-per-class", "3", "--batch-size", "32"], ["--batch-size", "3"]),
    (["bench", "--class-mining", "maybe"], ["--class-mining", "maybe"]),
    (["tune", "--trials", "0"], ["--trials"]),
    (["tune", "--preset", "paper"], ["--preset", "paper"]),
    (["tune", "--dataset", "folder:/nonexistent"], ["--dataset", "/nonexistent"]),
    (["tune", "--dataset", "cub200", "--protocol", "standard"], ["--protocol", "reality-check"]),
    (["speed", "--sizes", "0"], ["--sizes"]),
    (["speed", "--sizes", "64", "-3"], ["--sizes"]),
    (["speed", "--repeats", "0"], ["--repeats"]),
    (["speed", "--dim", "0"], ["--dim"]),
    (["speed", "--seed", "-1"], ["--seed"]),
    (["speed", "NoSuchLoss"], ["NoSuchLoss"]),
]


@pytest.mark.parametrize("argv,names", BAD_ARGUMENTS, ids=[" ".join(a) for a, _ in BAD_ARGUMENTS])
def test_bad_argument_is_refused_before_any_work(argv, names, tmp_path, run_here):
    assert_refused(*run_here([*argv, "--out", tmp_path / "out"]), *names)


@pytest.mark.slow
@pytest.mark.parametrize("command", ["bench", "speed"])
def test_a_cuda_device_without_cuda_is_refused(command, tmp_path):
    if _cuda_available():
        pytest.skip("this machine has CUDA")
    status, stderr = run(_entry_point() + [command, "--device", "cuda", "--out", str(tmp_path / "out")], tmp_path)
    assert_refused(status, stderr, "--device", "cuda")


@pytest.mark.parametrize("url", ["nosuchdialect://x/y", "postgresql+psycopg://user:secret@127.0.0.1:1/db"])
def test_a_bench_storage_that_cannot_be_opened_is_refused_before_the_data_are_loaded(url, tmp_path, run_here):
    status, stderr = run_here(["bench", "--storage", url, "--out", tmp_path / "out"])
    assert_refused(status, stderr, "--storage", "cannot open")
    assert "secret" not in stderr


@pytest.mark.slow
def test_an_unknown_device_is_refused(tmp_path):
    status, stderr = run(_entry_point() + ["bench", "--device", "gpu0", "--out", str(tmp_path / "out")], tmp_path)
    assert_refused(status, stderr, "--device", "gpu0")


@pytest.mark.slow
def test_batch_size_refusal_says_what_each_kind_of_row_needs(tmp_path):
    status, stderr = run(_entry_point() + ["bench", "--batch-size", "3", "--out", str(tmp_path / "out")], tmp_path)
    assert_refused(status, stderr, "--batch-size", "multiple of 4", "m=4 rows", "even", "N-pair rows")


def test_batch_size_refusal_depends_on_the_chosen_rows(tmp_path, run_here):
    # 6 is even: the N-pair rows alone take it (and are refused for their too few classes instead).
    status, stderr = run_here(
        ["bench", "pml:NPairsLoss", "--batch-size", "6", "--classes", "2", "--out", tmp_path / "out"]
    )
    assert_refused(status, stderr, "--classes")
    assert "--batch-size" not in stderr
    status, stderr = run_here(
        ["bench", "pml:NPairsLoss", "pml:TripletMarginLoss", "--batch-size", "6", "--out", tmp_path / "out"]
    )
    assert_refused(status, stderr, "--batch-size", "multiple of 4", "pml:TripletMarginLoss")


def test_too_few_classes_names_the_minimum_for_the_chosen_rows(tmp_path, run_here):
    batch = budget.GLYPHS["batch_size"]
    status, stderr = run_here(["bench", "--classes", "9", "--out", tmp_path / "out"])
    assert_refused(
        status,
        stderr,
        "--classes",
        f"{budget.minimum_classes(4, batch)} for the m=4 rows",
        f"{budget.minimum_classes(2, batch)} for the N-pair rows",
    )
    # With the m=4 rows alone, the N-pair minimum is not asked for.
    status, stderr = run_here(["bench", "AUCLoss", "--classes", "9", "--out", tmp_path / "out"])
    assert_refused(status, stderr, "--classes", str(budget.minimum_classes(4, batch)))
    assert "N-pair" not in stderr


def test_minimum_classes_follows_the_protocols_folds():
    from pml_rank.harness.evaluation import class_partitions

    for num_classes in range(8, 60):
        partitions = class_partitions(range(num_classes // 2), 4)
        expected = num_classes // 2 - max(len(p) for p in partitions)
        assert budget.fold_training_classes(num_classes, 4) == expected
    for per_class, batch in [(4, 32), (2, 32), (4, 8), (2, 120)]:
        minimum = budget.minimum_classes(per_class, batch)
        assert budget.fold_training_classes(minimum) >= batch // per_class
        assert budget.fold_training_classes(minimum - 1) < batch // per_class


def test_out_that_is_a_file_is_refused_before_any_work(tmp_path, run_here):
    a_file = tmp_path / "results.txt"
    a_file.write_text("keep me")
    for out in (a_file, a_file / "below"):
        status, stderr = run_here(["bench", "AUCLoss", "--classes", "24", "--out", out])
        assert_refused(status, stderr, "--out", str(out))
    assert a_file.read_text() == "keep me"


@pytest.mark.slow
def test_read_only_out_is_refused_before_any_work(tmp_path):
    folder = tmp_path / "read-only"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        if os.access(folder, os.W_OK):
            pytest.skip("running as root: file modes do not stop writes")
        status, stderr = run(_entry_point() + ["speed", "AUCLoss", "--out", str(folder)], tmp_path)
        assert_refused(status, stderr, "--out", "not writable")
    finally:
        folder.chmod(0o755)


@pytest.mark.slow
def test_example_script_refuses_bad_arguments_before_any_work(tmp_path, monkeypatch, capsys):
    script = ROOT / "examples" / "auc_cub200.py"
    cases = [
        (["--epochs", "0"], ["--epochs"]),
        (["--batch-size", "3"], ["--batch-size"]),
        (["--seed", "-2"], ["--seed"]),
        (["--out", str(tmp_path / "x.txt")], ["--out"]),
    ]
    if not _cuda_available():
        cases.append((["--device", "cuda"], ["--device", "cuda"]))
    (tmp_path / "x.txt").write_text("")
    (argv, names), *others = cases
    assert_refused(*run([sys.executable, str(script), "--smoke", *argv], tmp_path), *names)  # as a user runs it
    # The others through the same main in this process: one start of Python and torch is enough.
    main = runpy.run_path(str(script))["main"]
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PML_RANK_CACHE", str(tmp_path / "cache"))
    for argv, names in others:
        try:
            status = main(["--smoke", *argv])
        except SystemExit as error:
            status = error.code
        assert_refused(status, capsys.readouterr().err, *names)
        assert not (tmp_path / "cache").exists() and not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "argv, name",
    [
        (["--epochs", "0"], "--epochs"),
        (["--device", "gpu0"], "--device"),
        (["--loader-workers", "-1"], "--loader-workers"),
    ],
)
def test_throughput_script_refuses_bad_arguments_before_any_work(argv, name, capsys):
    main = runpy.run_path(str(ROOT / "examples" / "bench_throughput.py"))["main"]
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2 and f"argument {name}" in capsys.readouterr().err


@pytest.mark.slow
def test_help_and_argument_errors_import_no_torch():
    for argv, status in (
        (["--help"], 0),
        (["bench", "--help"], 0),
        (["tune", "--help"], 0),
        (["speed", "--help"], 0),
        (["bench", "--preset", "paper"], 2),
        (["bench", "--dataset", "folder:/nonexistent"], 2),
        (["tune", "--trunk", "vgg16"], 2),
        (["tune", "--image-size", "8"], 2),
    ):
        done = subprocess.run(
            [sys.executable, "-X", "importtime", "-m", "pml_rank.cli", *argv], capture_output=True, text=True
        )
        assert done.returncode == status, done.stderr[-2000:]
        imported = {line.rsplit("|", 1)[-1].strip().split(".")[0] for line in done.stderr.splitlines()}
        assert "torch" not in imported and "torchvision" not in imported, argv


def _subparsers(parser):
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def _options(command):
    return [
        a
        for a in _subparsers(cli.build_parser())[command]._actions
        if a.option_strings and not isinstance(a, argparse._HelpAction)
    ]


def test_each_command_brings_its_options_and_its_handler():
    subparsers = _subparsers(cli.build_parser())
    assert list(subparsers) == [command.name for command in cli.COMMANDS]
    for command in cli.COMMANDS:
        assert subparsers[command.name].get_default("run") == command.run


@pytest.mark.parametrize("command", ["bench", "tune"])
def test_workers_default_to_one_per_core_on_the_cpu_else_per_device(command):
    parser = cli.build_parser()
    glyphs = budget.resolve("glyphs")
    assert cli._workers(parser.parse_args([command]), glyphs) == (os.cpu_count() or 1)
    devices = ["cpu"] * 3
    assert cli._workers(parser.parse_args([command, "--devices", ",".join(devices)]), glyphs) == len(devices)
    given = [command, "--devices", ",".join(devices), "--workers", "5"]
    assert cli._workers(parser.parse_args(given), glyphs) == 5


def test_on_a_gpu_the_small_cnn_shares_it_and_an_imagenet_trunk_has_it_alone():
    per_gpu = workers.PROCESSES_PER_GPU["small-cnn"]
    assert per_gpu > 1
    assert workers.default_processes(["cuda"], "small-cnn", cores=16) == per_gpu
    assert workers.default_processes(["cuda:0", "cuda:1"], "small-cnn", cores=16) == 2 * per_gpu
    assert workers.default_processes(["cuda"], "small-cnn", cores=2) == 2  # never more than the cores
    assert workers.default_processes(["cuda"], "resnet50", cores=16) == 1
    assert workers.default_processes(["cuda:0", "cuda:1"], "resnet50", cores=16) == 2
    assert workers.default_processes(["cpu"], "resnet50", cores=16) == 16


def test_loader_workers_decode_images_for_a_gpu_only():
    assert workers.default_loader_workers("cpu", in_memory=False, processes=1, cores=16) == 0
    assert workers.default_loader_workers("cuda", in_memory=True, processes=4, cores=16) == 0
    assert workers.default_loader_workers("cuda", in_memory=False, processes=1, cores=16) == (
        workers.LOADER_WORKERS_PER_GPU_PROCESS
    )
    assert workers.default_loader_workers("cuda", in_memory=False, processes=8, cores=16) == 1  # the cores left
    assert workers.default_loader_workers("cuda", in_memory=False, processes=2, cores=2) == 0


# The options a preset fills when they are not given (their argparse default is None).
PRESET_FILLED = {setting.key for setting in budget.SETTINGS}


@pytest.mark.slow
def test_a_preset_value_is_written_once_and_help_and_resolve_follow_it(monkeypatch, capsys):
    index = next(i for i, setting in enumerate(budget.SETTINGS) if setting.key == "lr")
    changed = dataclasses.replace(budget.SETTINGS[index], reality_check=2.5e-5, glyphs=0.125)
    monkeypatch.setattr(budget, "SETTINGS", (*budget.SETTINGS[:index], changed, *budget.SETTINGS[index + 1 :]))
    with pytest.raises(SystemExit):
        cli.main(["bench", "--help"])
    printed = " ".join(capsys.readouterr().out.split())
    assert "(glyphs: 0.125; reality-check: 2.5e-05)" in printed
    assert budget.resolve("sop")["lr"] == 2.5e-5 and budget.resolve("glyphs")["lr"] == 0.125


@pytest.mark.parametrize("command", ["bench", "tune", "speed"])
def test_every_option_help_shows_its_default(command):
    for action in _options(command):
        assert action.help, action.option_strings
        if command != "speed" and action.dest in PRESET_FILLED:  # what the presets give it
            assert any(name in action.help for name in ("glyphs", "reality-check", "both presets")), (
                action.option_strings
            )
        else:
            assert "default" in action.help, action.option_strings


@pytest.mark.slow
def test_help_states_the_constraints():
    bench = {a.option_strings[0]: a.help for a in _options("bench")}
    speed = {a.option_strings[0]: a.help for a in _options("speed")}
    assert "$PML_RANK_CACHE" in bench["--cache-dir"]
    assert "writable" in bench["--out"] and "writable" in speed["--out"]
    for name in ("--epochs", "--iterations", "--threads", "--embedding-size", "--seeds"):
        assert ">= 1" in bench[name], name
    assert "cuda" in bench["--device"] and "cuda" in speed["--device"]
    assert ">= 1" in speed["--repeats"] and "median" in speed["--repeats"]
    assert ">= 0" in speed["--seed"]
    for name, sizes in budget.SPEED_DEFAULT_SIZES_PER_LOSS.items():
        assert name in speed["--sizes"] and " ".join(map(str, sizes)) in speed["--sizes"]


def test_add_budget_arguments_leaves_the_budget_to_the_preset_and_checks():
    parser = cli.add_budget_arguments(arguments.ArgumentParser(prog="tune"), "tune")
    args = parser.parse_args([])
    assert all(getattr(args, dest, None) is None for dest in PRESET_FILLED)
    assert args.preset == budget.AUTO_PRESET
    assert args.threads == cli.DEFAULT_THREADS and args.device == "cpu"
    assert args.dataset == "glyphs" and args.cache_dir is None
    # Without options: the glyph budget on the glyphs, the Reality Check on an image data set.
    assert cli._budget(args) == budget.resolve("glyphs", "glyphs")
    assert {k: cli._budget(args)[k] for k in budget.GLYPHS} == budget.GLYPHS
    images = parser.parse_args(["--dataset", "sop"])
    assert cli._budget(images) == budget.resolve("sop", "reality-check")
    assert cli._budget(images)["patience"] == 39 and cli._budget(images)["optimizer"] == "rmsprop"
    # Any option given overrides its preset's value, and only that one.
    given = parser.parse_args(
        ["--preset", "reality-check", "--epochs", "3", "--classes", "all", "--weight-decay", "0", "--amp"]
    )
    expected = dict(budget.resolve("glyphs", "reality-check"), epochs=3, num_classes="all", weight_decay=0.0, amp=True)
    assert cli._budget(given) == expected
    assert (
        cli._budget(parser.parse_args(["--freeze-batchnorm", "no", "--preset", "reality-check"]))["freeze_batchnorm"]
        is False
    )
    assert parser.parse_args(["--classes", "all"]).num_classes == "all"
    assert parser.parse_args(["--classes", "30", "--lr-schedule", "constant"]).lr_schedule == "constant"
    for argv in (
        ["--epochs", "0"],
        ["--lr", "nan"],
        ["--dataset", "foo"],
        ["--threads", "-1"],
        ["--classes", "1"],
        ["--classes", "some"],
        ["--lr-schedule", "linear"],
        ["--preset", "paper"],
        ["--trunk", "vgg16"],
        ["--optimizer", "adamw"],
        ["--weight-decay", "-1"],
        ["--momentum", "inf"],
        ["--patience", "0"],
        ["--image-size", "15"],
        ["--augmentation", "mixup"],
        ["--freeze-batchnorm", "maybe"],
        ["--loader-workers", "-1"],
        ["--heartbeat", "0"],
        ["--workers", "0"],
        ["--dataset", "folder:/nonexistent"],
        ["--protocol", "paper"],
        ["--samples-per-class", "1"],
        ["--class-mining", "maybe"],
        ["--embedder-lr-factor", "0"],
        ["--lr-drop", "0:0.3"],
        ["--lr-drop", "35:-1"],
    ):
        with pytest.raises(SystemExit) as exit_:
            parser.parse_args(argv)
        assert exit_.value.code == 2, argv
