"""The machinery behind ``examples/``: each example script declares a paper's table (the
paper's numbers, cited), the paper's training setup as a budget (what it changes in the
reality-check preset, keys of `pml_rank.harness.budget.SETTINGS`) and the runs that
reproduce its rows (the runner's rows, as `pml-rank bench` names them); `Script.main`
trains and measures them through the experiment runner (`pml_rank.harness.runner.run`) and
prints our numbers beside the paper's. The scripts ship with the source, not the installed
package: run them from a clone, ``python examples/auc_cub200.py --help``.

The setup's ``protocol`` says how: "reality-check" (4-fold cross-validation, concatenated
and separated embeddings, mean and 95% confidence interval over runs) or "standard" (the
older papers': one model trained on the data set's training split, measured on its test
split). A row that is not installed, or a setting the runner cannot honour, is refused
before any training.

    tables.py    the papers' tables (`PaperTable`, `paper_rows`)
    scripts.py   what a script declares (`Run`, `Setup`, `Variant`) and its command line (`Script`)
    running.py   each run's budget and the runner's runs
    output.py    our numbers beside the paper's, the JSON and the PNG
"""

from .scripts import Run, Script, Setup, Variant
from .tables import PaperTable, paper_rows

__all__ = ["PaperTable", "Run", "Script", "Setup", "Variant", "paper_rows"]
