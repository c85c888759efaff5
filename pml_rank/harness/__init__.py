"""The harness: what measures and compares pml-rank's losses, kept apart from the library.

    budget.py       the option table (`SETTINGS`: each budget key's flag, help and preset
                    values), `resolve`, the protocol's fixed values; imports no torch
    arguments.py    argparse types of the command line and the example scripts
    recipes.py      the rows of a bench or study: a registered loss or a baseline, as a
                    `Recipe` (loss, miner, sampler) by row name; the batch size checks
    baselines/      PML's losses as ``pml:`` rows with the Reality Check's search spaces,
                    and the two classes its rows build (proxy_nca.py, zero_mean.py)
    components.py   components by name (``AUCLoss``, ``pml:TripletMarginLoss``)
    runner.py       one experiment: data set x trunk x budget x row x seed -> fold models
                    -> metrics (`run`); what bench, tune and the paper scripts import
    experiment.py   what an experiment is made of: machine, data set, transforms, networks
    checks.py       every check that can refuse an experiment before any training
    saved_models.py an experiment's saved models: partial folders, reloading them for users
    evaluation/     the Reality Check and standard protocols (splits, folds, metrics,
                    training with PML)
    datasets.py     the data sets by command-line name; images.py: image files checked once
    data/           the embedded glyph data set, the real data sets' loaders, the small CNN
    backbones.py    torchvision trunks with ImageNet weights from the local cache
    storage.py      the Optuna storage bench and tune share (SQLite, PostgreSQL);
                    storage_rules.py: its retry policy, heartbeat and stale-trial rule
    jobs.py         a bench's jobs in that storage; workers.py: worker processes and the
                    one claim loop of bench and tune
    bench.py        `pml-rank bench`; report.py: its table, CSV, JSON and PNG
    tune.py         `pml-rank tune`: the Reality Check hyperparameter search with Optuna
    speed.py        `pml-rank speed`
    outputs.py      result files written atomically; text_table.py: the plain-text tables
    references/     straightforward losses written from the papers' formulas
    reproduce/      the papers' tables and setups, run by examples/ through the runner
    tuned_glyphs.json   the tuned parameters `pml-rank bench` uses on the glyphs

Its dependencies (faiss, record-keeper, matplotlib, torchvision, ...) come with the
``harness`` extra: ``pip install 'pml-rank[harness]'``.
"""

# What the ``harness`` extra installs, by import name: checked by the command line before
# any work, so a missing one is named at once rather than after minutes of training.
REQUIRED_MODULES = ("faiss", "record_keeper", "matplotlib", "torchvision", "PIL", "scipy", "tqdm", "optuna")
