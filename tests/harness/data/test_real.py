"""Loaders of the real data sets, on tiny copies of their on-disk layouts."""

import os

import pytest
import torch
from PIL import Image
from torchvision import transforms

from pml_rank.harness.data import real, tiny_layouts

to_tensor = transforms.ToTensor()


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    return tiny_layouts.make_all(tmp_path_factory.mktemp("data"))


def _classes(dataset):
    return sorted(set(dataset.labels))


def test_cub_standard_split_is_first_100_classes_then_last_100(data_root):
    train = real.load("cub200", data_root, "train")
    test = real.load("cub200", data_root, "test")
    assert _classes(train) == [c for c in tiny_layouts.CUB_CLASSES if c <= 100]
    assert _classes(test) == [c for c in tiny_layouts.CUB_CLASSES if c > 100]
    assert len(train) + len(test) == 3 * len(tiny_layouts.CUB_CLASSES)


def test_images_come_out_rgb_even_when_stored_grayscale(data_root):
    dataset = real.load("cub200", data_root, "train", transform=to_tensor)
    with Image.open(dataset.paths[1]) as stored:
        assert stored.mode == "L"  # the tiny layout stores image 2 in grayscale
    image, label = dataset[1]
    assert image.shape == (3, 32, 32)
    assert label == dataset.labels[1]


def test_cub_cropped_uses_the_bounding_box_of_each_image(data_root):
    base = os.path.join(data_root, "CUB_200_2011")
    with open(os.path.join(base, "images.txt")) as f:
        image_id, first_path = f.readline().split()
    with open(os.path.join(base, "bounding_boxes.txt")) as f:
        box = dict((line.split()[0], [float(v) for v in line.split()[1:]]) for line in f)[image_id]
    x, y, width, height = box
    cropped = real.load("cub200-cropped", data_root, "train")
    assert cropped.paths[0].endswith(first_path)
    image, _ = cropped[0]
    assert image.size == (round(width), round(height))
    with Image.open(cropped.paths[0]) as full:
        expected = full.convert("RGB").crop((x, y, x + width, y + height))
    assert image.tobytes() == expected.tobytes()


def test_cars_split_is_first_98_classes_then_last_98_across_both_folders(data_root):
    train = real.load("cars196", data_root, "train")
    test = real.load("cars196", data_root, "test")
    assert _classes(train) == [c for c in tiny_layouts.CARS_CLASSES if c <= 98]
    assert _classes(test) == [c for c in tiny_layouts.CARS_CLASSES if c > 98]
    # PML maps a "/" in a class name to "-" in its folder name
    slashed = [p for p, l in zip(test.paths, test.labels) if l == tiny_layouts.CARS_SLASHED_CLASS]
    assert slashed and all("Ram C-V Cargo Van" in p for p in slashed)
    assert test[0][0].mode == "RGB"


def test_sop_reads_the_ebay_lists_written_as_in_the_real_archive(tmp_path):
    # The real files' first lines, written here by hand (not by tiny_layouts).
    base = tmp_path / "Stanford_Online_Products"
    train = (
        "image_id class_id super_class_id path\n1 1 1 bicycle_final/111085122871_0.JPG\n"
        "2 1 1 bicycle_final/111085122871_1.JPG\n3 2 1 bicycle_final/111265328556_0.JPG\n"
    )
    test = "image_id class_id super_class_id path\n59552 11319 1 bicycle_final/111085122871_2.JPG\n"
    (base / "bicycle_final").mkdir(parents=True)
    (base / "Ebay_train.txt").write_text(train)
    (base / "Ebay_test.txt").write_text(test)
    for name in ("111085122871_0", "111085122871_1", "111265328556_0", "111085122871_2"):
        Image.new("RGB", (8, 8)).save(base / "bicycle_final" / f"{name}.JPG")
    loaded = real.load("sop", tmp_path, "train")
    assert loaded.labels == [1, 1, 2]
    assert loaded.paths[2] == str(base / "bicycle_final" / "111265328556_0.JPG")
    assert real.load("sop", tmp_path, "test").labels == [11319]


def test_sop_split_from_tiny_layout(data_root):
    assert _classes(real.load("sop", data_root, "train")) == list(tiny_layouts.SOP_TRAIN_CLASSES)
    assert _classes(real.load("sop", data_root, "test")) == list(tiny_layouts.SOP_TEST_CLASSES)


def test_inshop_reads_the_partition_file_written_as_in_the_real_archive(tmp_path):
    base = tmp_path / "InShop"
    rows = [
        ("img/WOMEN/Dresses/id_00000002/02_1_front.jpg", "id_00000002", "train"),
        ("img/WOMEN/Dresses/id_00000002/02_2_side.jpg", "id_00000002", "train"),
        ("img/WOMEN/Skirts/id_00000040/02_1_front.jpg", "id_00000040", "query"),
        ("img/WOMEN/Skirts/id_00000040/02_2_side.jpg", "id_00000040", "gallery"),
    ]
    # The real file pads the image names with spaces to a fixed column.
    lines = ["52712", "image_name item_id evaluation_status"]
    lines += [f"{path:<63}{item} {status}   " for path, item, status in rows]
    base.mkdir()
    (base / "list_eval_partition.txt").write_text("\n".join(lines) + "\n")
    for path, _, _ in rows:
        (base / path).parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (8, 8)).save(base / path)
    train = real.load("inshop", tmp_path, "train")
    assert train.labels == [2, 2]
    assert real.load("inshop", tmp_path, "query").labels == [40]
    gallery = real.load("inshop", tmp_path, "gallery")
    assert gallery.paths == [str(base / rows[3][0])]


def test_inshop_query_and_gallery_share_items_disjoint_from_training(data_root):
    train = real.load("inshop", data_root, "train")
    query = real.load("inshop", data_root, "query")
    gallery = real.load("inshop", data_root, "gallery")
    assert _classes(train) == list(tiny_layouts.INSHOP_TRAIN_ITEMS)
    assert _classes(query) == _classes(gallery) == list(tiny_layouts.INSHOP_TEST_ITEMS)
    assert not set(query.paths) & set(gallery.paths)
    image, label = query[0]
    assert image.mode == "RGB" and label == query.labels[0]


def test_a_split_that_does_not_exist_is_refused(data_root):
    with pytest.raises(ValueError, match="query"):
        real.load("inshop", data_root, "test")
    with pytest.raises(ValueError, match="cub200"):
        real.load("cub", data_root, "train")


@pytest.mark.parametrize(
    "name, folder, what",
    [
        ("cub200", "CUB_200_2011", "CUB_200_2011.tgz"),
        ("cars196", "cars196", "stanford-car-dataset-by-classes-folder"),
        ("sop", "Stanford_Online_Products", "Stanford_Online_Products.zip"),
        ("inshop", "InShop", "list_eval_partition.txt"),
    ],
)
def test_missing_data_set_says_what_to_download_and_where(tmp_path, name, folder, what):
    with pytest.raises(real.DataSetNotFoundError) as error:
        real.load(name, tmp_path, "train")
    message = str(error.value)
    assert what in message
    assert os.path.join(str(tmp_path), folder) in message  # the expected place
    assert "never downloads" in message


def test_cub_cropped_without_bounding_boxes_names_that_file(tmp_path):
    tiny_layouts.make_cub(tmp_path)
    os.remove(tmp_path / "CUB_200_2011" / "bounding_boxes.txt")
    assert len(real.load("cub200", tmp_path, "train")) > 0
    with pytest.raises(real.DataSetNotFoundError, match="bounding_boxes.txt"):
        real.load("cub200-cropped", tmp_path, "train")


def test_a_partly_extracted_data_set_names_the_missing_images(tmp_path):
    tiny_layouts.make_sop(tmp_path)
    dataset = real.load("sop", tmp_path, "test")
    os.remove(dataset.paths[4])
    with pytest.raises(real.DataSetNotFoundError) as error:
        real.load("sop", tmp_path, "test")
    assert dataset.paths[4] in str(error.value)


def test_loaders_feed_a_pml_sampler_and_dataloader(data_root):
    from pytorch_metric_learning.samplers import MPerClassSampler

    dataset = real.load(
        "sop", data_root, "train", transform=transforms.Compose([transforms.Resize(16), transforms.ToTensor()])
    )
    sampler = MPerClassSampler(dataset.labels, m=2, batch_size=8, length_before_new_iter=16)
    images, labels = next(iter(torch.utils.data.DataLoader(dataset, batch_size=8, sampler=sampler)))
    assert images.shape == (8, 3, 16, 16)
    assert all((labels == label).sum() == 2 for label in labels)


def _truncate(path):
    data = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(data[: len(data) // 2])


SPOILS = {
    "truncated": _truncate,
    "empty": lambda path: open(path, "wb").close(),
    "not an image": lambda path: open(path, "wb").write(b"<html>404 Not Found</html>" * 10),
}


@pytest.mark.parametrize("spoil", SPOILS)
def test_an_image_that_cannot_be_read_is_named_when_the_data_set_loads(spoil, tmp_path):
    tiny_layouts.make_cub(tmp_path)
    bad = real.load("cub200", tmp_path, "train").paths[3]
    SPOILS[spoil](bad)
    with pytest.raises(real.ImageReadError) as error:
        real.load("cub200", tmp_path, "train")
    assert bad in str(error.value) and "1 of" in str(error.value)


def test_an_image_spoiled_after_loading_is_named_when_read(tmp_path):
    tiny_layouts.make_sop(tmp_path)
    dataset = real.load("sop", tmp_path, "train")
    _truncate(dataset.paths[2])
    with pytest.raises(real.ImageReadError, match=dataset.paths[2]):
        dataset[2]


def test_a_complete_image_with_trailing_bytes_is_accepted(tmp_path):
    tiny_layouts.make_cub(tmp_path)
    path = real.load("cub200", tmp_path, "train").paths[0]
    with open(path, "ab") as f:
        f.write(b"\0" * 4096)  # padding after the end-of-image marker, as some cameras write
    assert real.load("cub200", tmp_path, "train")[0][0].size
