"""Image files of the data sets on disk: `image_modes` decodes every file once, in full,
before any training (in parallel, remembered by path, size and modification time so a
rerun only stats the files), and `open_8bit` gives any image Pillow reads as 8-bit
``L`` or ``RGB``, 16-bit images scaled rather than clipped.

Imports neither torch nor the rest of the harness: where processes are spawned rather than
forked, each checking process imports this module alone.
"""

import os
import sqlite3
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from multiprocessing import get_all_start_methods, get_context

import numpy as np
from PIL import Image

# Modes of single-channel images (Pillow's 16- and 32-bit integer modes included).
GRAYSCALE_MODES = ("1", "L", "I", "I;16", "I;16L", "I;16B", "I;16N", "F")
CACHE_FILE = "image-checks.sqlite3"
# Below this many unchecked files, checking here costs less than starting the processes.
POOL_THRESHOLD = 2000
_CHUNK = 256
_ERRORS = (OSError, SyntaxError, ValueError, Image.DecompressionBombError)


class ImageReadError(OSError):
    """An image of a data set cannot be read (unreadable, empty, truncated, not an image);
    the message names the file."""


def _scaled_to_8bit(image):
    """An integer image (``I;16*``, ``I``) as ``L``: 0-65535 mapped to 0-255, as 16-bit PNG and
    TIFF files hold (Pillow's own conversion clips at 255: a 16-bit photograph turns white)."""
    values = np.asarray(image, dtype=np.int64)
    return Image.fromarray(np.clip((values + 128) // 257, 0, 255).astype(np.uint8), "L")


def open_8bit(path, mode):
    """The image at `path` decoded as `mode` ("L" or "RGB"); raises `ImageReadError` naming it."""
    try:
        with Image.open(path) as image:
            if image.mode == "I" or image.mode.startswith("I;16"):
                image = _scaled_to_8bit(image)
            return image.convert(mode)
    except _ERRORS as error:
        raise ImageReadError(f"cannot read image {path}: {error}") from None


def _decoded_mode(path):
    """``(mode, None)`` once the whole file decodes, else ``(None, why)``."""
    if not os.path.exists(path):
        target = os.readlink(path) if os.path.islink(path) else None
        why = f"broken symbolic link to {target}" if target is not None else "no such file"
        return None, f"cannot read image {path}: {why}"
    try:
        if os.path.getsize(path) == 0:
            return None, f"cannot read image {path}: the file is empty"
        with Image.open(path) as image:
            image.load()  # the whole file: a truncated JPEG is only found here
            return image.mode, None
    except _ERRORS as error:
        return None, f"cannot read image {path}: {getattr(error, 'strerror', None) or error}"


def _decoded_modes(paths):
    return [_decoded_mode(path) for path in paths]


def _signature(path):
    try:
        stat = os.stat(path)
    except OSError:
        return None
    return stat.st_size, stat.st_mtime_ns


class _CheckCache:
    """The files already decoded without error: ``path -> (size, mtime_ns, mode)`` in a
    SQLite file (several processes may share it). A cache that cannot be read or written is
    skipped, with one line."""

    def __init__(self, cache_dir):
        import logging

        import PIL

        self.log, self.pillow, self.connection = logging.getLogger(__name__), PIL.__version__, None
        if cache_dir is None:
            return
        self.file = os.path.join(os.fspath(cache_dir), CACHE_FILE)
        try:
            os.makedirs(cache_dir, exist_ok=True)
            self.connection = sqlite3.connect(self.file, timeout=60)
            self.connection.execute(
                "CREATE TABLE IF NOT EXISTS checked "
                "(path TEXT PRIMARY KEY, size INTEGER, mtime_ns INTEGER, mode TEXT, pillow TEXT)"
            )
        except (OSError, sqlite3.Error) as error:
            self._give_up(error)

    def _give_up(self, error):
        self.log.warning("pml-rank: image check cache %s unusable (%s); checking every image", self.file, error)
        if self.connection is not None:
            self.connection.close()
        self.connection = None

    def modes(self, signatures):
        """``{path: mode}`` of the files of `signatures` (``{path: (size, mtime_ns)}``) that
        were checked as they are now, by this Pillow version."""
        if self.connection is None:
            return {}
        try:
            rows = self.connection.execute(
                "SELECT path, size, mtime_ns, mode FROM checked WHERE pillow = ?", (self.pillow,)
            )
            return {path: mode for path, size, mtime, mode in rows if signatures.get(path) == (size, mtime)}
        except sqlite3.Error as error:
            self._give_up(error)
            return {}

    def remember(self, entries):
        """Records ``(path, (size, mtime_ns), mode)`` entries."""
        if self.connection is None or not entries:
            return
        try:
            with self.connection:
                self.connection.executemany(
                    "INSERT OR REPLACE INTO checked VALUES (?, ?, ?, ?, ?)",
                    [(path, size, mtime, mode, self.pillow) for path, (size, mtime), mode in entries],
                )
        except sqlite3.Error as error:
            self._give_up(error)

    def close(self):
        if self.connection is not None:
            self.connection.close()


def image_modes(paths, cache_dir=None, processes=None, desc="checking images"):
    """``(modes, problems)`` for the image files `paths`: each file's Pillow mode (None for a
    bad one) and, in the order of `paths`, one ``"cannot read image <path>: <why>"`` per file
    that is missing, empty, truncated or not an image. Every file not remembered in
    `cache_dir` (None: no cache) as checked at its current size and modification time is
    decoded in full, in `processes` processes (default: one per CPU) when there are many.
    A progress bar shows on a terminal."""
    from tqdm import tqdm

    paths = [os.fspath(p) for p in paths]
    signatures = {path: _signature(path) for path in paths}
    cache = _CheckCache(cache_dir)
    try:
        known = cache.modes(signatures)
        todo = [path for path in paths if path not in known]
        found = {}
        chunks = [todo[i : i + _CHUNK] for i in range(0, len(todo), _CHUNK)]
        processes = processes or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count())
        pool = None
        if len(todo) >= POOL_THRESHOLD and processes > 1:
            # Forked where the platform can (as torch's DataLoader workers are on Linux): the
            # processes start at once and never re-run the caller's main module.
            method = "fork" if "fork" in get_all_start_methods() else "spawn"
            pool = ProcessPoolExecutor(processes, mp_context=get_context(method))
        results = map(_decoded_modes, chunks) if pool is None else pool.map(_decoded_modes, chunks)
        with tqdm(total=len(todo), desc=desc, unit="image", disable=None if todo else True, leave=False) as bar:
            try:
                for chunk in chunks:
                    found.update(zip(chunk, next(results)))
                    bar.update(len(chunk))
            except BrokenProcessPool:  # a decoder crashed its process on one of these files
                raise ImageReadError(
                    f"cannot read images: the process decoding {len(chunk)} images from {chunk[0]} on died"
                ) from None
            finally:
                if pool is not None:
                    pool.shutdown(cancel_futures=True)
        cache.remember([(p, signatures[p], mode) for p, (mode, _) in found.items() if mode and signatures[p]])
    finally:
        cache.close()
    modes = [known[path] if path in known else found[path][0] for path in paths]
    problems = [found[path][1] for path in paths if path in found and found[path][1] is not None]
    return modes, problems
