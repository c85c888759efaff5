"""The four retrieval benchmarks of the papers, read from a local folder with the papers'
standard splits. Nothing is ever downloaded: when files are missing, `DataSetNotFoundError`
says what to download and where to put it.

One ``data_root`` holds every data set, each in the folder its archive extracts to::

    <data_root>/CUB_200_2011/            images.txt, image_class_labels.txt, bounding_boxes.txt, images/
    <data_root>/cars196/                 names.csv, anno_train.csv, anno_test.csv, car_data/car_data/
    <data_root>/Stanford_Online_Products/ Ebay_train.txt, Ebay_test.txt, <category>_final/
    <data_root>/InShop/                  list_eval_partition.txt, img/

CUB-200-2011, Cars-196 and Stanford Online Products are PML's own dataset classes
(`pytorch_metric_learning.datasets`, which also fix the splits: CUB classes 1-100 train /
101-200 test, Cars 1-98 / 99-196, SOP the Ebay_train / Ebay_test lists); pml-rank adds the
layout check, a full decode of every image before any training, RGB conversion (CUB and
Cars contain grayscale images) and CUB's bounding-box crops. In-shop Clothes is
pml-rank's own, on PML's `BaseDataset`: the ``train`` / ``query`` / ``gallery`` partition
of ``list_eval_partition.txt``.
"""

import dataclasses
import os

from pytorch_metric_learning import datasets as pml_datasets
from pytorch_metric_learning.datasets.base_dataset import BaseDataset

from ..images import ImageReadError, image_modes, open_8bit


class DataSetNotFoundError(FileNotFoundError):
    """A data set's files are not where pml-rank looks for them. The message says what to
    download and the directory layout to extract it to."""


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where one data set lives under ``data_root`` and how a user gets it there."""

    title: str
    folder: str  # under data_root
    required: tuple  # files under folder that must exist
    download: str  # where to get it and how to unpack it
    tree: str  # the expected layout, shown in the error

    def directory(self, data_root):
        return os.path.join(os.fspath(data_root), self.folder)

    def check(self, data_root, extra=()):
        """Raise `DataSetNotFoundError` unless every required file (and ``extra``) exists."""
        base = self.directory(data_root)
        missing = [os.path.join(base, f) for f in (*self.required, *extra) if not os.path.exists(os.path.join(base, f))]
        if missing:
            raise DataSetNotFoundError(self.explain(data_root, missing))

    def explain(self, data_root, missing):
        listed = "\n".join(f"    {path}" for path in missing[:5])
        if len(missing) > 5:
            listed += f"\n    ... and {len(missing) - 5} more"
        tree = "\n".join(f"    {line}" for line in self.tree.format(root=os.fspath(data_root)).splitlines())
        return (
            f"{self.title} not found under --data-root {os.fspath(data_root)!r}. Missing:\n{listed}\n"
            f"{self.download}\nExpected layout:\n{tree}\n"
            "pml-rank never downloads data sets; place the files there and run again."
        )


CUB_LAYOUT = Layout(
    title="CUB-200-2011",
    folder="CUB_200_2011",
    required=("images.txt", "image_class_labels.txt", "images"),
    download=(
        "Download CUB_200_2011.tgz (1.1 GB) from https://data.caltech.edu/records/65de6-vp158 "
        "and extract it inside --data-root (tar xzf CUB_200_2011.tgz -C <data-root>)."
    ),
    tree=(
        "{root}/CUB_200_2011/images.txt               <image_id> <class_folder>/<file>.jpg\n"
        "{root}/CUB_200_2011/image_class_labels.txt   <image_id> <class_id 1..200>\n"
        "{root}/CUB_200_2011/bounding_boxes.txt       <image_id> <x> <y> <width> <height> (cropped variant)\n"
        "{root}/CUB_200_2011/images/001.Black_footed_Albatross/Black_Footed_Albatross_0001_796111.jpg ..."
    ),
)

CARS_LAYOUT = Layout(
    title="Cars-196",
    folder="cars196",
    required=("names.csv", "anno_train.csv", "anno_test.csv", os.path.join("car_data", "car_data")),
    download=(
        "Download the Kaggle archive 'jutrera/stanford-car-dataset-by-classes-folder' "
        "(https://www.kaggle.com/datasets/jutrera/stanford-car-dataset-by-classes-folder, the "
        "layout PML's Cars196 reads) and unzip it into <data-root>/cars196."
    ),
    tree=(
        "{root}/cars196/names.csv        one class name per line (line k = class k)\n"
        "{root}/cars196/anno_train.csv   <file>.jpg,<x1>,<y1>,<x2>,<y2>,<class 1..196>\n"
        "{root}/cars196/anno_test.csv    same format\n"
        "{root}/cars196/car_data/car_data/train/<class name, '/' as '-'>/<file>.jpg\n"
        "{root}/cars196/car_data/car_data/test/<class name, '/' as '-'>/<file>.jpg"
    ),
)

SOP_LAYOUT = Layout(
    title="Stanford Online Products",
    folder="Stanford_Online_Products",
    required=("Ebay_train.txt", "Ebay_test.txt"),
    download=(
        "Download Stanford_Online_Products.zip (2.9 GB) from "
        "https://cvgl.stanford.edu/projects/lifted_struct/ (or the Google Drive link in "
        "github.com/rksltnl/Deep-Metric-Learning-CVPR16) and unzip it inside --data-root."
    ),
    tree=(
        "{root}/Stanford_Online_Products/Ebay_train.txt   header 'image_id class_id super_class_id path', "
        "then one image per line\n"
        "{root}/Stanford_Online_Products/Ebay_test.txt    same format\n"
        "{root}/Stanford_Online_Products/bicycle_final/111085122871_0.JPG ... (12 <category>_final folders)"
    ),
)

INSHOP_LAYOUT = Layout(
    title="In-shop Clothes Retrieval (DeepFashion)",
    folder="InShop",
    required=("list_eval_partition.txt", "img"),
    download=(
        "Download the In-shop Clothes Retrieval Benchmark of DeepFashion "
        "(https://mmlab.ie.cuhk.edu.hk/projects/DeepFashion/InShopRetrieval.html): put "
        "Eval/list_eval_partition.txt into <data-root>/InShop/ and unzip Img/img.zip there "
        "(it creates img/)."
    ),
    tree=(
        "{root}/InShop/list_eval_partition.txt   line 1: image count, line 2: 'image_name item_id "
        "evaluation_status', then '<img/...jpg> <id_XXXXXXXX> <train|query|gallery>'\n"
        "{root}/InShop/img/WOMEN/Dresses/id_00000002/02_1_front.jpg ..."
    ),
)


def _check_images(layout, data_root, paths, cache_dir):
    """The lists name every image: report the absent ones (a partial extraction), then
    decode every image in full (`images.image_modes`) and report the first that cannot be
    read (truncated, empty, unreadable), before any training."""
    missing = [p for p in paths if not os.path.isfile(p)]
    if missing:
        raise DataSetNotFoundError(layout.explain(data_root, missing))
    _, problems = image_modes(paths, cache_dir, desc=f"checking {layout.title}")
    if problems:
        raise ImageReadError(
            f"{layout.title}: {len(problems)} of {len(paths)} images cannot be read (re-extract the archive); "
            f"the first: {problems[0]}"
        )


class _RGBItems:
    """`__getitem__` for PML datasets: RGB images, optional crop box, transforms."""

    boxes = None  # {index: (left, upper, right, lower)} when images are cropped

    def __getitem__(self, idx):
        image = open_8bit(self.paths[idx], "RGB")
        if self.boxes is not None:
            image = image.crop(self.boxes[idx])
        label = self.labels[idx]
        if self.transform is not None:
            image = self.transform(image)
        if self.target_transform is not None:
            label = self.target_transform(label)
        return image, label


class CUB200(_RGBItems, pml_datasets.CUB):
    """CUB-200-2011 through PML's `CUB` (classes 1-100 train, 101-200 test).

    ``cropped=True`` crops each image to its bird's box from ``bounding_boxes.txt``, the
    "CUB-200-2011 cropped" setting of the AUC paper's table 2.
    """

    layout = CUB_LAYOUT

    def __init__(self, root, split="train", transform=None, target_transform=None, cropped=False, cache_dir=None):
        self.layout.check(root, extra=("bounding_boxes.txt",) if cropped else ())
        self.cropped = cropped
        super().__init__(root, split=split, transform=transform, target_transform=target_transform, download=False)
        _check_images(self.layout, root, self.paths, cache_dir)
        if cropped:
            self.boxes = self._read_boxes(root)

    def _read_boxes(self, root):
        base = self.layout.directory(root)
        with open(os.path.join(base, "images.txt")) as f:
            id_of_path = {
                os.path.join(base, "images", path): int(image_id)
                for image_id, path in (line.split() for line in f if line.strip())
            }
        with open(os.path.join(base, "bounding_boxes.txt")) as f:
            box_of_id = {}
            for line in f:
                if line.strip():
                    image_id, x, y, width, height = line.split()
                    x, y, width, height = map(float, (x, y, width, height))
                    box_of_id[int(image_id)] = (x, y, x + width, y + height)
        return [box_of_id[id_of_path[path]] for path in self.paths]


class Cars196(_RGBItems, pml_datasets.Cars196):
    """Cars-196 through PML's `Cars196` (classes 1-98 train, 99-196 test), Kaggle layout."""

    layout = CARS_LAYOUT

    def __init__(self, root, split="train", transform=None, target_transform=None, cache_dir=None):
        self.layout.check(root)
        super().__init__(
            self.layout.directory(root),
            split=split,
            transform=transform,
            target_transform=target_transform,
            download=False,
        )
        _check_images(self.layout, root, self.paths, cache_dir)


class StanfordOnlineProducts(_RGBItems, pml_datasets.StanfordOnlineProducts):
    """Stanford Online Products through PML's class: the Ebay_train / Ebay_test lists."""

    layout = SOP_LAYOUT

    def __init__(self, root, split="train", transform=None, target_transform=None, cache_dir=None):
        self.layout.check(root)
        super().__init__(root, split=split, transform=transform, target_transform=target_transform, download=False)
        _check_images(self.layout, root, self.paths, cache_dir)


class InShop(_RGBItems, BaseDataset):
    """In-shop Clothes Retrieval: the train / query / gallery partition of
    ``list_eval_partition.txt``. Labels are the item numbers (``id_00000002`` -> 2), shared
    by query and gallery: retrieve each query among the gallery."""

    layout = INSHOP_LAYOUT

    def __init__(self, root, split="train", transform=None, target_transform=None, cache_dir=None):
        self.layout.check(root)
        super().__init__(
            self.layout.directory(root),
            split=split,
            transform=transform,
            target_transform=target_transform,
            download=False,
        )
        _check_images(self.layout, root, self.paths, cache_dir)

    def get_available_splits(self):
        return ["train", "query", "gallery", "all"]

    def generate_split(self):
        self.paths, self.labels = [], []
        with open(os.path.join(self.root, "list_eval_partition.txt")) as f:
            lines = f.read().splitlines()[2:]  # an image count, then the column names
        for line in lines:
            if not line.strip():
                continue
            path, item_id, status = line.split()
            if status == self.split or self.split == "all":
                self.paths.append(os.path.join(self.root, path))
                self.labels.append(int(item_id.removeprefix("id_")))

    def download_and_remove(self):
        raise DataSetNotFoundError(self.layout.explain(os.path.dirname(self.root), [self.root]))


@dataclasses.dataclass(frozen=True)
class DataSetSpec:
    """How the examples load a data set: its class, the training split and the evaluation
    splits (``query`` against ``reference``; the same split means leave-one-out retrieval)."""

    name: str
    cls: type
    train_split: str
    query_split: str
    reference_split: str
    options: dict = dataclasses.field(default_factory=dict)

    @property
    def layout(self):
        return self.cls.layout

    def load(self, data_root, split, transform=None, cache_dir=None):
        return self.cls(data_root, split=split, transform=transform, cache_dir=cache_dir, **self.options)


DATASETS = {
    spec.name: spec
    for spec in (
        DataSetSpec("cub200", CUB200, "train", "test", "test"),
        DataSetSpec("cub200-cropped", CUB200, "train", "test", "test", {"cropped": True}),
        DataSetSpec("cars196", Cars196, "train", "test", "test"),
        DataSetSpec("sop", StanfordOnlineProducts, "train", "test", "test"),
        DataSetSpec("inshop", InShop, "train", "query", "gallery"),
    )
}


def load(name, data_root, split, transform=None, cache_dir=None):
    """``load("cub200", "/data", "train")``: one split of a data set named in `DATASETS`.
    Every image is decoded once first (`ImageReadError` names the first bad one);
    `cache_dir` remembers the images found good, so the next load only stats them."""
    if name not in DATASETS:
        raise ValueError(f"pml-rank: unknown data set {name!r}; known: {', '.join(DATASETS)}")
    return DATASETS[name].load(data_root, split, transform, cache_dir)
