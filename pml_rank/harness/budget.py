"""The default training budget of `pml-rank bench`, importable without torch (the
command line's --help shows it)."""

DEFAULTS = dict(dataset="glyphs", epochs=4, iterations_per_epoch=25, batch_size=32, seeds=3,
                embedding_size=64, lr=1e-3, num_folds=4, device="cpu")
