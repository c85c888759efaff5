"""Every image of a `folder:PATH` data set is checked before any work: bad files refused by
the command line in one line naming them, 16-bit images scaled to 8 bits, odd entries
(nested, hidden, loose, broken links) handled as the README says, checks remembered."""

import io
import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from pml_rank.harness import images
from pml_rank.harness.data import real, tiny_layouts
from pml_rank.harness.datasets import DataError, ImageFolder

TINY = ["--trunk", "small-cnn", "--image-size", "16", "--epochs", "1", "--iterations", "1",
        "--batch-size", "8", "--seeds", "1", "--workers", "1", "--untuned"]  # fmt: skip


def _pixels(seed, size=24):
    return np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)


def write_colour_folder(root, classes=4, per_class=3):
    """Class folders ``c0``, ``c1``, ... of colour images (JPEG and PNG), so the first image
    read is a colour one."""
    for c in range(classes):
        (root / f"c{c}").mkdir(parents=True)
        for i in range(per_class):
            Image.fromarray(_pixels(c * 100 + i)).save(root / f"c{c}" / f"{i}.{'jpg' if i % 2 else 'png'}")
    return root


def _jpeg_bytes():
    data = io.BytesIO()
    Image.fromarray(_pixels(7, size=64)).save(data, "JPEG")
    return data.getvalue()


def _png_corrupt_inside():
    """A PNG whose middle byte is flipped: its header and IEND ending are intact, only a full
    decode finds the damage."""
    data = io.BytesIO()
    Image.fromarray(_pixels(8, size=64)).save(data, "PNG")
    spoiled = bytearray(data.getvalue())
    spoiled[len(spoiled) // 2] ^= 0xFF
    return bytes(spoiled)


BAD_FILES = {
    "truncated.jpg": lambda path: path.write_bytes(_jpeg_bytes()[: len(_jpeg_bytes()) // 2]),
    "empty.jpg": lambda path: path.write_bytes(b""),
    "text.png": lambda path: path.write_text("this is not an image\n"),
    "corrupt-inside.png": lambda path: path.write_bytes(_png_corrupt_inside()),
    "dangling.png": lambda path: path.symlink_to(path.parent / "deleted.png"),
}


def _bench(args, tmp_path):
    """The installed ``pml-rank`` script, as a user runs it: ``(status, stderr)``."""
    script = Path(sys.executable).with_name("pml-rank")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "pml_rank.cli"]
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    done = subprocess.run([*command, "bench", *args], capture_output=True, text=True, env=env, timeout=600)
    return done.returncode, done.stderr


@pytest.mark.parametrize("name", BAD_FILES)
def test_a_bad_file_after_colour_images_is_refused_in_one_line_before_any_job(name, tmp_path, run_cli):
    """Through `cli.main` in this process (the script itself refuses a bad image below)."""
    folder = write_colour_folder(tmp_path / "photos")
    bad = folder / "c3" / name  # the last class: read after many colour images
    BAD_FILES[name](bad)
    out = tmp_path / "out"
    status, _, err = run_cli(
        ["bench", "pml:TripletMarginLoss", "--dataset", f"folder:{folder}", *TINY, "--cache-dir",
         tmp_path / "cache", "--out", out]
    )  # fmt: skip
    assert status == 2, err
    assert len(err.strip().splitlines()) == 1 and str(bad) in err and "Traceback" not in err, err
    assert not (out / "bench.json").exists() and not (out / "bench.db").exists()


@pytest.mark.slow
def test_a_bad_paper_image_is_refused_in_one_line_before_any_job(tmp_path):
    root = tiny_layouts.make_all(tmp_path / "data", size=24, only=["cub200"])
    bad = Path(real.load("cub200", root, "test").paths[-1])
    bad.write_bytes(_png_corrupt_inside())  # intact start and end, as the archives' names say .jpg
    out = tmp_path / "out"
    status, err = _bench(
        ["pml:TripletMarginLoss", "--dataset", "cub200", "--data-root", str(root), *TINY, "--cache-dir",
         str(tmp_path / "cache"), "--out", str(out)],
        tmp_path,
    )  # fmt: skip
    assert status == 2, err
    assert len(err.strip().splitlines()) == 1 and str(bad) in err and "Traceback" not in err, err
    assert not (out / "bench.json").exists()


def test_every_bad_file_is_found_by_the_checking_processes(tmp_path, monkeypatch):
    folder = write_colour_folder(tmp_path / "photos", classes=3, per_class=40)
    bad = sorted((folder / "c2").iterdir())[-1]
    BAD_FILES["truncated.jpg"](bad)
    monkeypatch.setattr(images, "POOL_THRESHOLD", 0)
    with pytest.raises(DataError) as error:
        ImageFolder(folder)
    assert str(bad) in str(error.value) and "\n" not in str(error.value)


GRADIENT = np.linspace(0, 65535, 32 * 256).round().astype(np.uint16).reshape(32, 256)
# 0-65535 to the nearest of 0-255: 257 levels of 16 bits make one of 8 (65535 = 255 x 257).
GRADIENT_8_BIT = (GRADIENT.astype(np.int64) + 128) // 257


@pytest.mark.parametrize(
    "pixels, suffix, stored_as",
    [(GRADIENT, "png", ("I;16", "I")), (GRADIENT.astype(np.int32), "tif", ("I",))],
    ids=["16-bit PNG", "32-bit integer TIFF"],
)
def test_an_integer_image_loads_as_an_8_bit_gradient(pixels, suffix, stored_as, tmp_path):
    for c in range(2):
        (tmp_path / f"c{c}").mkdir()
        for i in range(2):
            Image.fromarray(pixels).save(tmp_path / f"c{c}" / f"{i}.{suffix}")
    with Image.open(tmp_path / "c0" / f"0.{suffix}") as stored:
        assert stored.mode in stored_as  # more than 8 bits on disk (Pillow mode I: 32-bit integers)
    data = ImageFolder(tmp_path)
    image, _ = data[0]
    assert data.channels == 1 and image.mode == "L"
    np.testing.assert_array_equal(np.asarray(image), GRADIENT_8_BIT)
    rgb = np.asarray(images.open_8bit(tmp_path / "c0" / f"0.{suffix}", "RGB"))
    assert (rgb == np.asarray(image)[..., None]).all()  # papers' loaders read RGB


def test_nested_images_join_their_class_hidden_and_loose_ones_are_left_out_with_a_line(tmp_path, caplog):
    folder = write_colour_folder(tmp_path / "photos", classes=2, per_class=2)
    (folder / "c0" / "2024" / "june").mkdir(parents=True)
    Image.fromarray(_pixels(50)).save(folder / "c0" / "2024" / "june" / "nested.png")
    (folder / ".ipynb_checkpoints").mkdir()
    for i in range(3):
        Image.fromarray(_pixels(60 + i)).save(folder / ".ipynb_checkpoints" / f"{i}.png")
    (folder / "c1" / ".thumbs").mkdir()
    Image.fromarray(_pixels(70)).save(folder / "c1" / ".thumbs" / "t.png")
    Image.fromarray(_pixels(75)).save(folder / "c0" / ".x.jpg", "JPEG")  # a hidden file in a class folder
    Image.fromarray(_pixels(80)).save(folder / "stray.png")
    (folder / "c1" / "notes.txt").write_text("taken in June")
    with caplog.at_level(logging.WARNING):
        data = ImageFolder(folder)
    assert data.classes == ["c0", "c1"]  # no ".ipynb_checkpoints" class
    assert folder / "c0" / "2024" / "june" / "nested.png" in data.paths
    assert list(data.labels) == [0, 0, 0, 1, 1]
    lines = data.ignored
    assert any("ignored 5 image(s) in hidden" in line for line in lines)  # 3 + 1 + 1
    assert any("ignored 1 image(s) directly in the folder" in line and "stray.png" in line for line in lines)
    assert any("ignored 1 file(s) without an image suffix" in line and "notes.txt" in line for line in lines)
    assert len(lines) == 3 and all(line in caplog.text for line in lines)


def test_a_clean_folder_prints_nothing(tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        data = ImageFolder(write_colour_folder(tmp_path / "photos"))
    assert data.ignored == [] and caplog.text == ""


def test_a_rerun_decodes_only_the_files_that_changed(tmp_path, monkeypatch):
    folder = write_colour_folder(tmp_path / "photos")
    decoded = []
    real_decode = images._decoded_mode
    monkeypatch.setattr(images, "_decoded_mode", lambda path: decoded.append(path) or real_decode(path))
    cache = tmp_path / "cache"
    first = ImageFolder(folder, cache_dir=cache)
    assert sorted(decoded) == sorted(map(str, first.paths))
    decoded.clear()
    again = ImageFolder(folder, cache_dir=cache)
    assert decoded == [] and again.channels == first.channels == 3
    changed = first.paths[5]
    Image.fromarray(_pixels(99, size=30)).save(changed)  # another size: checked again
    ImageFolder(folder, cache_dir=cache)
    assert decoded == [str(changed)]
    decoded.clear()
    BAD_FILES["truncated.jpg"](changed)
    for _ in range(2):  # a bad file is never remembered as checked
        with pytest.raises(DataError, match=str(changed)):
            ImageFolder(folder, cache_dir=cache)
    assert decoded == [str(changed)] * 2


def test_an_unwritable_cache_only_costs_the_checks(tmp_path, caplog):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    with caplog.at_level(logging.WARNING):
        data = ImageFolder(write_colour_folder(tmp_path / "photos"), cache_dir=blocker)
    assert len(data) == 12 and "image check cache" in caplog.text


AUGMENTATIONS = [
    {"augmentation": "crop-flip", "image_size": 16, "resize": 20},
    {"augmentation": "random-resized-crop", "image_size": 16, "resize": 20},
    {"augmentation": "none", "image_size": 16, "resize": 20},
]


@pytest.mark.parametrize("budget", AUGMENTATIONS, ids=lambda b: b["augmentation"])
@pytest.mark.parametrize("mode", ["RGB", "L"])
def test_images_come_in_8_bits_and_normalised_are_torchvisions_normalised_images(budget, mode):
    """The loaders hand uint8 images; normalised (by the trunk, on its device) they are the
    bits torchvision's ToTensor then Normalize give, ImageNet's statistics (their means for one
    channel), for the training transform (its random draws repeated) and the evaluation one."""
    import torch
    from torchvision import transforms

    from pml_rank.harness.datasets import NormalizedImages, image_transforms

    channels = 3 if mode == "RGB" else 1
    pixels = _pixels(7, size=30)
    image = Image.fromarray(pixels if channels == 3 else pixels[..., 0], mode)
    mean, std = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)) if channels == 3 else ((0.449,), (0.226,))
    as_floats = [transforms.ToTensor(), transforms.Normalize(mean, std)]
    normalised = NormalizedImages(channels).normalized
    for transform in image_transforms(budget, channels):
        torch.manual_seed(3)
        eight_bits = transform(image)
        torch.manual_seed(3)
        expected = transforms.Compose(transform.transforms[:-1] + as_floats)(image)
        assert eight_bits.dtype == torch.uint8 and eight_bits.shape == (channels, 16, 16)
        batch = normalised(torch.stack([eight_bits, eight_bits]))
        assert batch.dtype == torch.float32
        assert torch.equal(batch[1], expected)


def test_a_trunk_reads_8_bit_images_as_their_normalised_floats_and_other_inputs_as_they_are():
    """Every trunk the runner builds (the small CNN, an ImageNet trunk, on colour or grayscale
    images) computes on a batch of 8-bit images what it computes on the batch normalised; a
    float batch (the glyphs') goes in unchanged. On another device the statistics are copied
    there once."""
    import torch

    from pml_rank.harness.budget import resolve
    from pml_rank.harness.datasets import NormalizedImages
    from pml_rank.harness.experiment import model_factories

    generator = torch.Generator().manual_seed(0)
    for trunk_name, channels in (("small-cnn", 3), ("small-cnn", 1), ("resnet50", 3), ("resnet50", 1)):
        budget = resolve("glyphs", trunk=trunk_name, random_init=True, embedding_size=8)
        torch.manual_seed(0)
        trunk = model_factories(budget, channels)[0]().eval()
        images = torch.randint(0, 256, (2, channels, 32, 32), dtype=torch.uint8, generator=generator)
        floats = NormalizedImages(channels).normalized(images)
        assert not torch.equal(floats, images.float() / 255)
        with torch.no_grad():
            assert torch.equal(trunk(images), trunk(floats)), (trunk_name, channels)
            unnormalised = images.float() / 255
            assert not torch.equal(trunk(unnormalised), trunk(floats))  # a float batch is taken as it is
    normalized = NormalizedImages(3)
    images = torch.randint(0, 256, (2, 3, 4, 4), dtype=torch.uint8, generator=generator)
    on_meta = normalized.normalized(images.to("meta"))
    assert on_meta.is_meta and on_meta.dtype == torch.float32 and on_meta.shape == images.shape
    assert set(normalized._statistics) == {torch.device("cpu"), torch.device("meta")}
    assert normalized.normalized(on_meta) is on_meta


def test_8_bit_images_on_another_device_are_divided_by_tensors_of_that_device():
    """torch's CUDA division by a number from the CPU multiplies by its reciprocal: 255 so,
    one bit off the CPU's division (torchvision's) for about half the 256 values. Every division
    that normalises images on another device (here torch's meta device) takes a tensor of that
    device, which a GPU divides as the CPU does."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from pml_rank.harness.datasets import NormalizedImages

    class Divisions(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.divisors = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket in (torch.ops.aten.div, torch.ops.aten.div_):
                self.divisors.append(args[1])
            return func(*args, **(kwargs or {}))

    images = torch.zeros((2, 3, 4, 4), dtype=torch.uint8, device="meta")
    with Divisions() as seen:
        NormalizedImages(3).normalized(images)
    assert len(seen.divisors) == 2 and all(torch.is_tensor(d) and d.is_meta for d in seen.divisors)


@pytest.mark.cuda
def test_8_bit_images_normalised_on_a_gpu_are_the_cpus_bits():
    """Every 8-bit value of every channel, normalised on the GPU, is what it is on the CPU (there
    torchvision's ToTensor then Normalize, tested above)."""
    import torch

    from pml_rank.harness.datasets import NormalizedImages

    for channels in (3, 1):
        images = torch.arange(256, dtype=torch.uint8).reshape(1, 1, 16, 16).repeat(2, channels, 1, 1)
        normalized = NormalizedImages(channels).normalized
        assert torch.equal(normalized(images.cuda()).cpu(), normalized(images))
