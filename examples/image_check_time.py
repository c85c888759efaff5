"""How long `folder:PATH` takes to check its images before the first job, at SOP scale:
writes N small JPEG and PNG files (default 120,000, as many as Stanford Online Products
has) in 1,000 class folders, then times loading the folder data set with an empty check
cache (every file decoded in full, in one process per CPU) and again (the cache: each file
only stat'ed).

    python examples/image_check_time.py [--images 120000] [--size 32] [--folder DIR]
"""

import argparse
import os
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

from pml_rank.harness.datasets import ImageFolder


def write_images(root, count, size, classes=1000):
    """`count` random images, alternately JPEG and PNG, spread over `classes` folders."""
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, (64, size, size, 3), dtype=np.uint8)
    for index in range(count):
        folder = root / f"class{index % classes:04d}"
        if index < classes:
            folder.mkdir(parents=True, exist_ok=True)
        image = Image.fromarray(pixels[index % len(pixels)])
        image.save(folder / f"{index:06d}.{'jpg' if index % 2 else 'png'}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=120_000)
    parser.add_argument("--size", type=int, default=32, help="side of each image in pixels")
    parser.add_argument("--folder", help="write the images here (default: a temporary folder)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(args.folder) if args.folder else Path(scratch) / "images"
        started = time.perf_counter()
        write_images(root, args.images, args.size)
        print(f"wrote {args.images} images of {args.size}x{args.size} px in {time.perf_counter() - started:.0f} s")
        cache = Path(scratch) / "cache"
        for run in ("first run (empty cache)", "rerun (cache)"):
            started = time.perf_counter()
            data = ImageFolder(root, cache_dir=cache)
            seconds = time.perf_counter() - started
            print(f"{run}: {len(data)} images checked in {seconds:.1f} s on {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
