"""The tiny bench test_workers.py and test_storage.py run in `pml-rank bench` processes on shared
storages: one row, 5 jobs (raw input, untrained x 2 seeds, the row x 2 seeds) of seconds each."""

from pml_rank import cli

ROW = "pml:TripletMarginLoss"
ARGUMENTS = [ROW, "--classes", "24", "--epochs", "2", "--iterations", "8", "--batch-size", "16", "--seeds", "2",
             "--untuned"]  # fmt: skip
# The budget these arguments give, as the command line resolves it.
BUDGET = cli._budget(cli.build_parser().parse_args(["bench", *ARGUMENTS]))
