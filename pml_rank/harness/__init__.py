"""The harness: what measures and compares pml-rank's losses, kept apart from the library.

    evaluation/   the Reality Check and standard protocols (splits, folds, metrics, training with PML)
    data/         the embedded glyph data set, the real data sets' loaders, the small CNN
    references/   straightforward losses written from the papers' formulas
    bench.py      `pml-rank bench`
    speed.py      `pml-rank speed`
    tune.py       `pml-rank tune`: the Reality Check hyperparameter search with Optuna
    backbones.py, reproduce/     the papers' trunks and tables, run by examples/ through the runner

Its dependencies (faiss, record-keeper, matplotlib, torchvision, ...) come with the
``harness`` extra: ``pip install 'pml-rank[harness]'``.
"""

# What the ``harness`` extra installs, by import name: checked by the command line before
# any work, so a missing one is named at once rather than after minutes of training.
REQUIRED_MODULES = ("faiss", "record_keeper", "matplotlib", "torchvision", "PIL", "scipy", "tqdm", "optuna")
