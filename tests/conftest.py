import importlib
import logging
import signal
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

import pml_rank
from pml_rank import _device_policy, cli


def pytest_collection_modifyitems(config, items):
    """Tests marked ``cuda`` skip where torch sees no GPU."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA: torch.cuda.is_available() is False")
    for item in items:
        if item.get_closest_marker("cuda"):
            item.add_marker(skip)


def _interpreted_modules(session):
    """The test modules of the selected tests that wait for an interpreted run of the Triton
    kernels (tests/losses/test_fused_ranks.py's `interpreted_run`)."""
    return {item.module for item in session.items if "interpreted_run" in getattr(item, "fixturenames", ())}


def pytest_collection_finish(session):
    """Starts the interpreted run of the Triton kernels' tests once the suite is collected,
    where a selected test needs it: it takes minutes of one core, beside the other tests."""
    for module in _interpreted_modules(session):
        module.start_interpreted_run()


def pytest_sessionfinish(session):
    for module in _interpreted_modules(session):
        module.stop_interpreted_run()


@pytest.fixture(params=["cache", "memory"])
def either_policy(request, monkeypatch):
    """The test runs twice: under the CPU's device policy and under an accelerator's
    (`_device_policy.sized_for` forced), whose code paths the CPU then runs."""
    monkeypatch.setattr(_device_policy, "sized_for", lambda device: request.param)
    return request.param


@pytest.fixture
def one_thread():
    """One torch thread for the test: training on tiny tensors only waits for a second
    thread when the cores are shared."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def fake_distribution(tmp_path, monkeypatch):
    """Installs throwaway plugin distributions for one test.

    ``fake_distribution("acme-losses", {"acme_plugin": source}, {"acme": "acme_plugin"})``
    writes the modules and a ``.dist-info`` folder with the entry points into a folder
    on ``sys.path``, exactly what ``pip install`` leaves behind, and reloads the
    registry. Everything is undone after the test.
    """
    root = tmp_path / "site-packages"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))
    written_modules = []

    def make(dist_name, modules, entry_points):
        for module, source in modules.items():
            path = root.joinpath(*module.split("."))
            if module in {m.rsplit(".", 1)[0] for m in modules if "." in m}:
                path.mkdir(parents=True, exist_ok=True)
                path = path / "__init__.py"
            else:
                path = path.with_suffix(".py")
                path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(textwrap.dedent(source))
            written_modules.append(module)
        info = root / f"{dist_name.replace('-', '_')}-0.1.dist-info"
        info.mkdir()
        info.joinpath("METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist_name}\nVersion: 0.1\n")
        lines = "".join(f"{name} = {value}\n" for name, value in entry_points.items())
        info.joinpath("entry_points.txt").write_text(f"[pml_rank]\n{lines}")
        importlib.invalidate_caches()
        pml_rank.registry.reload()

    yield make
    for module in written_modules:
        sys.modules.pop(module, None)
    monkeypatch.undo()
    pml_rank.registry.reload()


@pytest.fixture
def start_interruptible():
    """``start(args) -> Popen``: a command in a process group of its own that Ctrl-C
    (SIGINT to the group) interrupts as in a terminal, even when the test session itself
    was started in the background by a shell, whose children inherit SIGINT ignored."""

    def start(args):
        return subprocess.Popen(
            args,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )

    return start


@pytest.fixture
def run_cli(tmp_path, monkeypatch, capsys, caplog):
    """``run_cli(argv) -> (status, stdout, stderr)``: `pml_rank.cli.main`, what the `pml-rank`
    script calls, in this process with `tmp_path` as the working folder; a refusal then costs
    no start of Python and torch. As in a process of its own, a record logged at WARNING or
    above is a line of stderr. The warning filters and torch's threads are restored after."""
    monkeypatch.chdir(tmp_path)

    def run(argv):
        capsys.readouterr()
        caplog.clear()
        threads = torch.get_num_threads()
        try:
            with warnings.catch_warnings():
                status = cli.main([str(a) for a in argv])
        except SystemExit as error:  # argparse's refusals
            status = error.code
        finally:
            torch.set_num_threads(threads)
        printed = capsys.readouterr()
        logged = "".join(f"{r.getMessage()}\n" for r in caplog.records if r.levelno >= logging.WARNING)
        return status, printed.out, printed.err + logged

    return run
