"""Tiny copies of the real data sets' on-disk layouts: the real file and folder names and
metadata formats, a few small generated images per class. The tests load them, and the
example scripts' ``--smoke`` mode trains on them, so every code path that reads a real
data set runs without the real data.

Images are flat colours that depend on the class, with per-image noise, so a smoke run has
something learnable. `make_all(root)` writes all four under one ``data_root``.
"""

import os
import random

import numpy as np
from PIL import Image

from .real import CARS_LAYOUT, CUB_LAYOUT, INSHOP_LAYOUT, SOP_LAYOUT

# Class ids drawn from both halves of each data set's standard split.
CUB_CLASSES = (1, 2, 3, 4, 5, 6, 7, 8, 101, 102, 103, 104, 105, 106, 107, 108)
CARS_CLASSES = (1, 2, 3, 4, 5, 6, 7, 8, 99, 100, 101, 102, 103, 104, 105, 106)
CARS_SLASHED_CLASS = 100  # its name contains "/", which the folder name spells "-"
SOP_TRAIN_CLASSES, SOP_TEST_CLASSES = (1, 2, 3, 4, 5, 6, 7, 8), (9, 10, 11, 12, 13, 14, 15, 16)
SOP_CATEGORIES = ("bicycle", "cabinet", "chair", "coffee_maker")  # <category>_final folders
INSHOP_TRAIN_ITEMS, INSHOP_TEST_ITEMS = (2, 3, 5, 7, 11, 13, 17, 19), (23, 29, 31, 37, 41, 43, 47, 53)


def _image(path, label, rng, size, mode="RGB"):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    base = np.array([(label * 53) % 256, (label * 97) % 256, (label * 151) % 256])
    generator = np.random.default_rng(rng.getrandbits(32))
    # A colour shift per image and noise per pixel: classes of nearby colours overlap a little.
    noise = generator.integers(-50, 51, size=3) + generator.integers(-60, 61, size=(size, size, 3))
    pixels = np.clip(base + noise, 0, 255).astype(np.uint8)
    Image.fromarray(pixels, "RGB").convert(mode).save(path)


def make_cub(data_root, per_class=3, size=32, seed=0):
    """CUB_200_2011/: images.txt, image_class_labels.txt, classes.txt, bounding_boxes.txt,
    train_test_split.txt and images/<class folder>/<file>.jpg. One image is grayscale, as
    some of the real ones are."""
    rng = random.Random(seed)
    base = CUB_LAYOUT.directory(data_root)
    images, labels, boxes, classes, splits = [], [], [], [], []
    image_id = 0
    for class_id in CUB_CLASSES:
        folder = f"{class_id:03d}.Bird_{class_id}"
        classes.append(f"{class_id} {folder}")
        for n in range(per_class):
            image_id += 1
            relative = f"{folder}/Bird_{class_id}_{n:04d}_{100000 + image_id}.jpg"
            mode = "L" if image_id == 2 else "RGB"
            _image(os.path.join(base, "images", relative), class_id, rng, size, mode)
            images.append(f"{image_id} {relative}")
            labels.append(f"{image_id} {class_id}")
            x, y = rng.randint(0, size // 4), rng.randint(0, size // 4)
            boxes.append(f"{image_id} {x}.0 {y}.0 {size // 2}.0 {size // 2 + 1}.0")
            splits.append(f"{image_id} {n % 2}")
    for name, lines in (
        ("images.txt", images),
        ("image_class_labels.txt", labels),
        ("bounding_boxes.txt", boxes),
        ("classes.txt", classes),
        ("train_test_split.txt", splits),
    ):
        _write_lines(os.path.join(base, name), lines)
    return base


def cars_class_name(class_id):
    if class_id == CARS_SLASHED_CLASS:
        return "Ram C/V Cargo Van Minivan 2012"
    return f"Make{class_id} Model{class_id} Sedan 2012"


def make_cars(data_root, per_class=3, size=32, seed=0):
    """cars196/ in the Kaggle layout PML reads: names.csv (196 names), anno_train.csv and
    anno_test.csv (``file,x1,y1,x2,y2,class``), car_data/car_data/{train,test}/<name>/.
    Each class has images in both of the archive's train and test folders, as in the real
    data (the standard split is by class, not by folder)."""
    rng = random.Random(seed)
    base = CARS_LAYOUT.directory(data_root)
    _write_lines(os.path.join(base, "names.csv"), [cars_class_name(k) for k in range(1, 197)])
    rows = {"train": [], "test": []}
    file_number = 0
    for class_id in CARS_CLASSES:
        for n in range(per_class):
            file_number += 1
            folder = "train" if n % 2 == 0 else "test"
            name = f"{file_number:05d}.jpg"
            path = os.path.join(base, "car_data", "car_data", folder, cars_class_name(class_id).replace("/", "-"), name)
            _image(path, class_id, rng, size)
            rows[folder].append(f"{name},1,2,{size - 2},{size - 1},{class_id}")
    for folder, lines in rows.items():
        _write_lines(os.path.join(base, f"anno_{folder}.csv"), lines)
    return base


def make_sop(data_root, per_class=3, size=32, seed=0):
    """Stanford_Online_Products/: Ebay_train.txt and Ebay_test.txt (header
    ``image_id class_id super_class_id path``), Ebay_info.txt, <category>_final/ folders."""
    rng = random.Random(seed)
    base = SOP_LAYOUT.directory(data_root)
    image_id = 0
    info = ["image_id class_id super_class_id path"]
    for split, class_ids in (("train", SOP_TRAIN_CLASSES), ("test", SOP_TEST_CLASSES)):
        lines = ["image_id class_id super_class_id path"]
        for class_id in class_ids:
            super_id = class_id % len(SOP_CATEGORIES) + 1
            for n in range(per_class):
                image_id += 1
                relative = f"{SOP_CATEGORIES[super_id - 1]}_final/{111085122000 + class_id}_{n}.JPG"
                _image(os.path.join(base, relative), class_id, rng, size)
                lines.append(f"{image_id} {class_id} {super_id} {relative}")
        _write_lines(os.path.join(base, f"Ebay_{split}.txt"), lines)
        info += lines[1:]
    _write_lines(os.path.join(base, "Ebay_info.txt"), info)
    return base


def make_inshop(data_root, per_item=4, size=32, seed=0):
    """InShop/: list_eval_partition.txt (image count, column names, then padded
    ``img/... id_XXXXXXXX status`` rows) and img/<MEN|WOMEN>/<category>/id_XXXXXXXX/.
    Test items have their first image in the query set and the others in the gallery."""
    rng = random.Random(seed)
    base = INSHOP_LAYOUT.directory(data_root)
    rows = []
    for items, test in ((INSHOP_TRAIN_ITEMS, False), (INSHOP_TEST_ITEMS, True)):
        for item in items:
            gender, category = ("WOMEN", "Dresses") if item % 2 else ("MEN", "Denim")
            for n in range(per_item):
                relative = f"img/{gender}/{category}/id_{item:08d}/{n + 1:02d}_{n + 1}_front.jpg"
                _image(os.path.join(base, relative), item, rng, size)
                status = ("query" if n == 0 else "gallery") if test else "train"
                rows.append(f"{relative:<70}id_{item:08d} {status}")
    _write_lines(
        os.path.join(base, "list_eval_partition.txt"), [str(len(rows)), "image_name item_id evaluation_status", *rows]
    )
    return base


MAKERS = {"cub200": make_cub, "cub200-cropped": make_cub, "cars196": make_cars, "sop": make_sop, "inshop": make_inshop}


def make_all(data_root, size=32, seed=0, only=None):
    """The tiny layouts (all four, or those of the data set names in ``only``, keys of
    `MAKERS`) under one ``data_root``; returns it."""
    for make in dict.fromkeys(MAKERS[name] for name in (only or MAKERS)):
        make(data_root, size=size, seed=seed)
    return data_root


def _write_lines(path, lines):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
