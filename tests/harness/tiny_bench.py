"""The tiny bench test_workers.py and test_storage.py run in `pml-rank bench` processes on shared
storages: one row, 5 jobs (raw input, untrained x 2 seeds, the row x 2 seeds) of seconds each;
and whether a process holds a shared SQLite file's write lock."""

import sqlite3
from pathlib import Path

from pml_rank import cli

ROW = "pml:TripletMarginLoss"
ARGUMENTS = [ROW, "--classes", "24", "--epochs", "2", "--iterations", "8", "--batch-size", "16", "--seeds", "2",
             "--untuned"]  # fmt: skip
# The budget these arguments give, as the command line resolves it.
BUDGET = cli._budget(cli.build_parser().parse_args(["bench", *ARGUMENTS]))


def write_locked(path):
    """Whether a process holds the SQLite file's write lock (False before the file exists: a
    check never makes it). A process frozen (SIGSTOP) while it holds the lock keeps every
    other process's writes out, and its commit keeps readers out too."""
    if not Path(path).is_file():
        return False
    connection = sqlite3.connect(path, timeout=0.1, isolation_level=None)
    try:
        connection.execute("BEGIN IMMEDIATE")
        connection.execute("ROLLBACK")
        return False
    except sqlite3.OperationalError:
        return True
    finally:
        connection.close()
