import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import tiny_bench

from pml_rank.harness.data import load_glyphs


@pytest.fixture(scope="session")
def glyph_cache(tmp_path_factory):
    """The default glyph set, generated once per test session."""
    folder = tmp_path_factory.getbasetemp() / "glyph-cache"
    load_glyphs(cache_dir=folder)
    return folder


@pytest.fixture(scope="session")
def serial_bench(tmp_path_factory, glyph_cache):
    """The --out folder of `tiny_bench`'s bench run by one `pml-rank` process on a SQLite storage of
    its own (bench.db there): what every run of that bench on a shared storage must give."""
    out = tmp_path_factory.mktemp("serial")
    storage = f"sqlite:///{out / 'bench.db'}"
    command = [str(Path(sys.executable).with_name("pml-rank")), "bench", *tiny_bench.ARGUMENTS, "--workers", "1",
               "--storage", storage, "--out", str(out), "--cache-dir", str(glyph_cache)]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    return out


def _freeze_when(process, condition, what, deadline=600):
    """Stops `process`'s group with SIGSTOP once `condition()` returns a true value, and returns
    that value read again while the group is frozen: what the test saw cannot change before it
    acts, however fast or slow the machine. A read that fails while frozen (the process held a
    write lock) lets the group go on and tries again. Fails the test if the process ends first."""
    stop = time.monotonic() + deadline
    while time.monotonic() < stop:
        if process.poll() is not None:
            pytest.fail(f"the process ended before {what}")
        if condition():
            os.killpg(process.pid, signal.SIGSTOP)
            try:
                seen = condition()
            except Exception:
                seen = None
            if seen:
                return seen
            os.killpg(process.pid, signal.SIGCONT)
        time.sleep(0.02)
    pytest.fail(f"never: {what}")


@pytest.fixture
def freeze_when():
    """`_freeze_when`: the one way multi-process tests catch a process in the state they need."""
    return _freeze_when


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pg_bin(name):
    found = shutil.which(name)
    if found:
        return found
    candidates = sorted(Path("/usr/lib/postgresql").glob(f"*/bin/{name}"))
    return str(candidates[-1]) if candidates else None


class PostgresServer:
    """A PostgreSQL server of our own on 127.0.0.1 and a free port, in `root`, that a test may
    stop and start again (`stop`, `start`). As root, initdb and the server run as the
    `postgres` user (initdb refuses root). Skips the test when it cannot run one."""

    def __init__(self, root):
        root.mkdir(parents=True, exist_ok=True)
        pytest.importorskip("psycopg", reason="the postgres extra (psycopg) is not installed")
        initdb, self.pg_ctl = _pg_bin("initdb"), _pg_bin("pg_ctl")
        if not (initdb and self.pg_ctl):
            pytest.skip("no PostgreSQL binaries (initdb, pg_ctl) on this machine")
        self.prefix = []
        if os.geteuid() == 0:
            runuser = shutil.which("runuser")
            try:
                import pwd

                user = pwd.getpwnam("postgres")
            except KeyError:
                user = None
            if runuser is None or user is None:
                pytest.skip("running as root, and no `postgres` user or runuser to start PostgreSQL as")
            self.prefix = [runuser, "-u", "postgres", "--"]
        self.root, self.data, self.log = root, root / "data", root / "server.log"
        if self.prefix:
            os.chmod(root, 0o755)
            for parent in [root, *root.parents]:  # postgres must reach its folder
                if parent == Path("/"):
                    break
                mode = parent.stat().st_mode
                if not mode & 0o001:
                    os.chmod(parent, mode | 0o001)
            os.chown(root, user.pw_uid, user.pw_gid)
        self.port = _free_port()
        subprocess.run(
            [*self.prefix, initdb, "-D", str(self.data), "-U", "pmlrank", "--auth=trust", "-E", "UTF8"],
            check=True,
            capture_output=True,
        )
        self.url = f"postgresql+psycopg://pmlrank:secret-password@127.0.0.1:{self.port}/postgres"

    def start(self):
        options = f"-h 127.0.0.1 -p {self.port} -k {self.root}"
        return subprocess.run(
            [*self.prefix, self.pg_ctl, "-D", str(self.data), "-l", str(self.log), "-w", "-o", options, "start"],
            capture_output=True,
            text=True,
        )

    def stop(self, mode="immediate"):
        subprocess.run([*self.prefix, self.pg_ctl, "-D", str(self.data), "-m", mode, "-w", "stop"], capture_output=True)

    def new_database(self, name):
        """The URL of a new, empty database `name` on the server."""
        from sqlalchemy import create_engine, text

        engine = create_engine(self.url, isolation_level="AUTOCOMMIT")
        try:
            with engine.connect() as connection:
                connection.execute(text(f"CREATE DATABASE {name}"))
        finally:
            engine.dispose()
        return self.url.rsplit("/", 1)[0] + "/" + name


def started_postgres(root):
    server = PostgresServer(root)
    started = server.start()
    if started.returncode != 0:
        log = server.log.read_text() if server.log.exists() else ""
        pytest.skip(f"PostgreSQL did not start: {started.stderr} {log}")
    return server


def _server_folder():
    # Outside pytest's base folder, which any pytest session starting on the machine makes
    # private again (mode 0700), out of the `postgres` user's reach.
    return Path(tempfile.mkdtemp(prefix="pml-rank-postgres-"))


@pytest.fixture(scope="session")
def postgres_url():
    """The URL of a PostgreSQL server's `postgres` database, shared by the session's tests."""
    root = _server_folder()
    try:
        server = started_postgres(root)
        try:
            yield server.url
        finally:
            server.stop()
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def postgres_server():
    """A PostgreSQL server of the test's own (`PostgresServer`), which it may stop and start."""
    root = _server_folder()
    try:
        server = started_postgres(root)
        try:
            yield server
        finally:
            server.stop()
    finally:
        shutil.rmtree(root, ignore_errors=True)
