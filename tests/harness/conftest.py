import os
import shutil
import socket
import subprocess
from pathlib import Path

import pytest

from pml_rank.harness.data import load_glyphs


@pytest.fixture(scope="session")
def glyph_cache(tmp_path_factory):
    """The default glyph set, generated once per test session."""
    folder = tmp_path_factory.getbasetemp() / "glyph-cache"
    load_glyphs(cache_dir=folder)
    return folder


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


@pytest.fixture(scope="session")
def postgres_url(tmp_path_factory):
    """A PostgreSQL server of our own on 127.0.0.1 and a free port, stopped afterwards. As root,
    initdb and the server run as the `postgres` user (initdb refuses root)."""
    pytest.importorskip("psycopg", reason="the postgres extra (psycopg) is not installed")
    initdb, pg_ctl = _pg_bin("initdb"), _pg_bin("pg_ctl")
    if not (initdb and pg_ctl):
        pytest.skip("no PostgreSQL binaries (initdb, pg_ctl) on this machine")
    prefix = []
    if os.geteuid() == 0:
        runuser = shutil.which("runuser")
        try:
            import pwd

            user = pwd.getpwnam("postgres")
        except KeyError:
            user = None
        if runuser is None or user is None:
            pytest.skip("running as root, and no `postgres` user or runuser to start PostgreSQL as")
        prefix = [runuser, "-u", "postgres", "--"]
    root = tmp_path_factory.mktemp("postgres")
    data, log = root / "data", root / "server.log"
    if prefix:
        os.chmod(root, 0o755)
        for parent in [root, *root.parents]:  # postgres must reach its folder
            if parent == Path("/"):
                break
            mode = parent.stat().st_mode
            if not mode & 0o001:
                os.chmod(parent, mode | 0o001)
        os.chown(root, user.pw_uid, user.pw_gid)
    port = _free_port()
    subprocess.run(
        [*prefix, initdb, "-D", str(data), "-U", "pmlrank", "--auth=trust", "-E", "UTF8"],
        check=True,
        capture_output=True,
    )
    started = subprocess.run(
        [*prefix, pg_ctl, "-D", str(data), "-l", str(log), "-w", "-o", f"-h 127.0.0.1 -p {port} -k {root}", "start"],
        capture_output=True,
        text=True,
    )
    if started.returncode != 0:
        pytest.skip(f"PostgreSQL did not start: {started.stderr} {log.read_text() if log.exists() else ''}")
    try:
        yield f"postgresql+psycopg://pmlrank:secret-password@127.0.0.1:{port}/postgres"
    finally:
        subprocess.run([*prefix, pg_ctl, "-D", str(data), "-m", "immediate", "-w", "stop"], capture_output=True)
