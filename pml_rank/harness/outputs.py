"""Result files written safely: the output folder is created and proven writable before
any work, and every file is written under a temporary name in the same folder and then
renamed over the old one (`os.replace`), so a failure (a full disk, an interrupt) never
leaves a half-written file, nor a temporary one, beside the previous result.

Imports no torch.
"""

import contextlib
import os
import secrets
from pathlib import Path


class OutputError(OSError):
    """The output folder cannot be created or written; the message names it and why."""


def _reason(error):
    return error.strerror or str(error)


def prepare_output_dir(path, option="--out"):
    """Creates the folder `path` (and its parents) and proves it writable by writing,
    syncing and deleting a small file in it. Returns it as a `Path`; raises
    `OutputError` naming `option` and the folder otherwise (a path that is a file, a
    read-only folder, a full disk)."""
    path = Path(path).expanduser()
    if path.exists() and not path.is_dir():
        raise OutputError(f"{option} {path}: exists and is not a folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise OutputError(f"{option} {path}: cannot create the folder ({_reason(error)})") from None
    probe = path / f".pml-rank-write-test-{os.getpid()}-{secrets.token_hex(4)}.tmp"
    try:
        with open(probe, "xb") as f:
            f.write(b"pml-rank")
            f.flush()
            os.fsync(f.fileno())
    except OSError as error:
        raise OutputError(f"{option} {path}: the folder is not writable ({_reason(error)})") from None
    finally:
        with contextlib.suppress(OSError):
            probe.unlink()
    return path


def temporary_name(path):
    """A fresh hidden name beside `path` ending in ``.tmp``."""
    path = Path(path)
    return path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")


@contextlib.contextmanager
def atomic_write(path, mode="w", **open_kwargs):
    """``with atomic_write(path) as f: f.write(...)``: `f` is a temporary file beside
    `path`, renamed to `path` when the block ends without an error and deleted when it
    raises. `mode` is ``"w"`` (text, UTF-8 unless `open_kwargs` say otherwise) or
    ``"wb"``. The parent folder must exist."""
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_write: mode must be 'w' or 'wb', got {mode!r}")
    if mode == "w":
        open_kwargs.setdefault("encoding", "utf-8")
    path = Path(path)
    tmp = temporary_name(path)
    try:
        with open(tmp, mode.replace("w", "x"), **open_kwargs) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def write_text(path, text):
    """Writes `text` (UTF-8) to `path` atomically; returns `path` as a `Path`."""
    with atomic_write(path, "w") as f:
        f.write(text)
    return Path(path)


def write_bytes(path, data):
    """Writes `data` to `path` atomically; returns `path` as a `Path`."""
    with atomic_write(path, "wb") as f:
        f.write(data)
    return Path(path)


def save_figure(fig, path, **savefig_kwargs):
    """``fig.savefig`` to `path` atomically (the format from the file's suffix)."""
    path = Path(path)
    savefig_kwargs.setdefault("format", path.suffix.lstrip(".") or "png")
    with atomic_write(path, "wb") as f:
        fig.savefig(f, **savefig_kwargs)
    return path
