"""The embedded glyph data set: deterministic, cached, one class per distinct character."""

import numpy as np
import pytest
import torch

from pml_rank.harness.data import GlyphDataset, SmallCNN, glyphs, load_glyphs

LATIN_CAPITALS = tuple(range(0x41, 0x5B))


def test_generation_is_deterministic():
    first = glyphs.generate(variants=1, code_points=LATIN_CAPITALS)
    second = glyphs.generate(variants=1, code_points=LATIN_CAPITALS)
    assert first.images.tobytes() == second.images.tobytes()
    assert first.labels.tobytes() == second.labels.tobytes()
    assert first.characters == second.characters and first.fonts == second.fonts
    # A different seed draws different jitter and a different class order.
    other = glyphs.generate(variants=1, code_points=LATIN_CAPITALS, seed=1)
    assert other.images.tobytes() != first.images.tobytes()


def test_structure_of_the_data_set():
    data = glyphs.generate(variants=2, code_points=LATIN_CAPITALS)
    assert sorted(data.characters) == [chr(c) for c in LATIN_CAPITALS]
    per_class = len(glyphs.FONT_FILES) * 2
    assert data.images.shape == (26 * per_class, 32, 32) and data.images.dtype == np.uint8
    assert np.bincount(data.labels).tolist() == [per_class] * 26
    # Every face draws every character: no empty image.
    assert (data.images.reshape(len(data), -1).max(axis=1) > 0).all()
    image, label = data[per_class]
    assert image.shape == (1, 32, 32) and image.dtype == torch.float32
    assert 0 <= image.min() and image.max() <= 1 and label == 1


def test_homoglyphs_are_one_class():
    # Latin A, Greek Alpha and Cyrillic A draw the same picture: only the first is kept.
    data = glyphs.generate(variants=1, code_points=(0x41, 0x391, 0x410, 0x42, 0x3B1))
    assert sorted(data.characters) == ["A", "B", "\u03b1"]


def test_cache_is_written_once_and_read_back(tmp_path, monkeypatch):
    first = load_glyphs(cache_dir=tmp_path / "a", variants=1, code_points=LATIN_CAPITALS)
    folders = list((tmp_path / "a").iterdir())
    assert len(folders) == 1
    files = {p.name: p.read_bytes() for p in folders[0].iterdir()}
    assert set(files) == {"images.npy", "labels.npy", "meta.json"}

    def must_not_generate(**kwargs):
        raise AssertionError("the cache was not used")

    monkeypatch.setattr(glyphs, "generate", must_not_generate)
    again = load_glyphs(cache_dir=tmp_path / "a", variants=1, code_points=LATIN_CAPITALS)
    assert again.images.tobytes() == first.images.tobytes()
    assert again.characters == first.characters and again.fonts == first.fonts
    monkeypatch.undo()
    # A second cache, built from scratch, holds the same bytes.
    load_glyphs(cache_dir=tmp_path / "b", variants=1, code_points=LATIN_CAPITALS)
    (other,) = list((tmp_path / "b").iterdir())
    assert other.name == folders[0].name
    assert {p.name: p.read_bytes() for p in other.iterdir()} == files
    # Other parameters, another cache entry.
    load_glyphs(cache_dir=tmp_path / "a", variants=1, seed=3, code_points=LATIN_CAPITALS)
    assert len(list((tmp_path / "a").iterdir())) == 2


def test_num_classes_keeps_the_first_labels(tmp_path):
    full = load_glyphs(cache_dir=tmp_path, variants=1, code_points=LATIN_CAPITALS)
    part = load_glyphs(cache_dir=tmp_path, variants=1, code_points=LATIN_CAPITALS, num_classes=5)
    assert isinstance(part, GlyphDataset)
    assert part.characters == full.characters[:5]
    assert np.array_equal(part.images, full.images[full.labels < 5])
    with pytest.raises(ValueError, match="num_classes"):
        load_glyphs(cache_dir=tmp_path, variants=1, code_points=LATIN_CAPITALS, num_classes=1)


def test_small_cnn_embeds_glyph_batches():
    data = glyphs.generate(variants=1, code_points=LATIN_CAPITALS[:3])
    batch = torch.stack([data[i][0] for i in range(8)])
    model = SmallCNN(embedding_size=24)
    assert model(batch).shape == (8, 24)


def _cache_folder(cache_dir):
    (folder,) = list(cache_dir.iterdir())
    return folder


def _damage_truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


DAMAGES = {
    "images.npy truncated": ("images.npy", _damage_truncate),
    "images.npy empty": ("images.npy", lambda p: p.write_bytes(b"")),
    "labels.npy truncated": ("labels.npy", _damage_truncate),
    "meta.json empty": ("meta.json", lambda p: p.write_text("")),
    "meta.json of another data set": ("meta.json", lambda p: p.write_text('{"characters": ["A"], "fonts": []}')),
}


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_damaged_cache_is_reported_in_one_line_and_regenerated(damage, tmp_path, caplog):
    first = load_glyphs(cache_dir=tmp_path, variants=1, code_points=LATIN_CAPITALS)
    folder = _cache_folder(tmp_path)
    name, spoil = DAMAGES[damage]
    spoil(folder / name)
    with caplog.at_level("WARNING"):
        again = load_glyphs(cache_dir=tmp_path, variants=1, code_points=LATIN_CAPITALS)
    assert again.images.tobytes() == first.images.tobytes() and again.characters == first.characters
    (record,) = [r for r in caplog.records if r.levelname == "WARNING"]
    message = record.getMessage()
    assert str(folder) in message and "damaged" in message and "\n" not in message
    # Healed: the next load reads the cache without generating or warning.
    caplog.clear()
    with caplog.at_level("WARNING"):
        healed = load_glyphs(cache_dir=tmp_path, variants=1, code_points=LATIN_CAPITALS)
    assert healed.labels.tolist() == first.labels.tolist() and not caplog.records


def test_an_unwritable_cache_dir_falls_back_to_memory_with_a_warning(tmp_path, caplog):
    a_file = tmp_path / "not-a-folder"
    a_file.write_text("")
    with caplog.at_level("WARNING"):
        data = load_glyphs(cache_dir=a_file / "cache", variants=1, code_points=LATIN_CAPITALS)
    assert sorted(data.characters) == [chr(c) for c in LATIN_CAPITALS]
    (record,) = [r for r in caplog.records if r.levelname == "WARNING"]
    assert "cannot write the glyph cache" in record.getMessage() and "in memory" in record.getMessage()


def test_a_full_disk_leaves_no_temporary_file(tmp_path, monkeypatch, caplog):
    import errno

    real_save = np.save
    calls = []

    def save_then_run_out_of_space(file, array, *args, **kwargs):
        calls.append(file)
        if len(calls) == 2:  # labels.npy: half written, then the disk is full
            file.write(b"\x93NUMPY")
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(file, array, *args, **kwargs)

    monkeypatch.setattr(np, "save", save_then_run_out_of_space)
    with caplog.at_level("WARNING"):
        data = load_glyphs(cache_dir=tmp_path, variants=1, code_points=LATIN_CAPITALS)
    assert len(data) == len(LATIN_CAPITALS) * len(glyphs.FONT_FILES)
    assert any("No space left" in r.getMessage() for r in caplog.records)
    folder = _cache_folder(tmp_path)
    assert not [p.name for p in folder.iterdir() if p.name.endswith(".tmp")]
    assert not (folder / "labels.npy").exists()
    monkeypatch.undo()
    # The next run completes the cache.
    again = load_glyphs(cache_dir=tmp_path, variants=1, code_points=LATIN_CAPITALS)
    assert again.images.tobytes() == data.images.tobytes()
    assert {p.name for p in folder.iterdir()} == set(glyphs.CACHE_FILES)
