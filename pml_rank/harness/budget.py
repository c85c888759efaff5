"""The default training budget of `pml-rank bench`, importable without torch (the
command line's --help shows it)."""

from pathlib import Path

DEFAULTS = dict(dataset="glyphs", epochs=4, iterations_per_epoch=25, batch_size=32, seeds=3,
                embedding_size=64, lr=1e-3, num_folds=4, device="cpu")

# The tuned parameters `pml-rank bench` uses by default (`--untuned`: the papers' defaults),
# made by the `pml-rank tune` run recorded inside the file.
SHIPPED_PARAMS = Path(__file__).with_name("tuned_glyphs.json")
