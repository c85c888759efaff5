import pytest

from pml_rank.harness.data import load_glyphs


@pytest.fixture(scope="session")
def glyph_cache(tmp_path_factory):
    """The default glyph set, generated once per test session."""
    folder = tmp_path_factory.getbasetemp() / "glyph-cache"
    load_glyphs(cache_dir=folder)
    return folder
