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
