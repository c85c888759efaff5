"""PML's SmoothAPLoss against pml-rank's on MPerClassSampler-like batches.

PML 2.9's `SmoothAPLoss` takes ``batch // number of classes`` (the samples per class) as
the number of classes and groups consecutive rows by that count, so it computes
Smooth-AP only when a batch holds as many classes as samples per class. pml-rank's
`SmoothAPLoss` (default ``include_query=True``, the authors' convention, which PML
follows too) computes it for any layout; tests/losses/test_smooth_ap.py checks it
against a loop written from the paper on these very batches.

    python examples/smooth_ap_vs_pml.py [--seed 0] [--dim 64]

Each batch: ``classes x per_class`` rows from N(0, 1) in float64, the four batches drawn
in turn from one generator seeded by --seed; labels 0,0,..,1,1,.. (class by class, as
PML's grouping expects).
"""

import argparse
import warnings

import torch

LAYOUTS = [(4, 4), (8, 4), (4, 8), (16, 4)]  # (classes, samples per class)


def batches(dim=64, seed=0):
    """[(classes, per_class, embeddings, labels)] for each layout of LAYOUTS, drawn in
    turn from one generator."""
    generator = torch.Generator().manual_seed(seed)
    return [
        (
            classes,
            per_class,
            torch.randn(classes * per_class, dim, generator=generator, dtype=torch.float64),
            torch.arange(classes * per_class) // per_class,
        )
        for classes, per_class in LAYOUTS
    ]


def rows(dim=64, seed=0):
    """[(classes, per_class, PML's loss, ours)] for each layout of LAYOUTS."""
    from pytorch_metric_learning import losses as pml_losses

    from pml_rank.losses import SmoothAPLoss

    table = []
    for classes, per_class, embeddings, labels in batches(dim, seed):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # PML builds its masks on the CPU in float32
            pml = pml_losses.SmoothAPLoss()(embeddings, labels).item()
        ours = SmoothAPLoss()(embeddings, labels).item()
        table.append((classes, per_class, pml, ours))
    return table


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dim", type=int, default=64)
    args = parser.parse_args(argv)
    print(f"Smooth-AP loss, tau 0.01, seed {args.seed}, dim {args.dim}, float64")
    print("| classes x per class | PML 2.9 SmoothAPLoss | pml-rank SmoothAPLoss |")
    print("| --- | ---: | ---: |")
    for classes, per_class, pml, ours in rows(args.dim, args.seed):
        print(f"| {classes} x {per_class} | {pml:.5f} | {ours:.5f} |")


if __name__ == "__main__":
    main()
