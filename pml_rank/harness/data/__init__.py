"""Data for pml-rank's evaluation: the embedded glyph data set (no download) and the
small CNN trunk trained on it."""

from .glyphs import GlyphDataset, load_glyphs
from .small_cnn import SmallCNN

__all__ = ["GlyphDataset", "SmallCNN", "load_glyphs"]
