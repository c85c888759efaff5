"""The default training budget of `pml-rank bench`, importable without torch (the
command line's --help shows it)."""

from pathlib import Path

# 8 epochs x 75 iterations: what 2 cores train for 11 contenders x 3 seeds x 4 folds in
# about 10 minutes (examples/README.md, "Choosing the budget"); Adam at 3e-3 gets further
# in those 600 steps than at 1e-3 for every loss measured.
DEFAULTS = dict(dataset="glyphs", epochs=8, iterations_per_epoch=75, batch_size=32, seeds=3,
                embedding_size=64, lr=3e-3, num_folds=4, device="cpu")

# The tuned parameters `pml-rank bench` uses by default (`--untuned`: the papers' defaults),
# made by the `pml-rank tune` run recorded inside the file.
SHIPPED_PARAMS = Path(__file__).with_name("tuned_glyphs.json")
