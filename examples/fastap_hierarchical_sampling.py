"""FastAP with category-based minibatch sampling and large-batch training (Cakir et al.,
"Deep Metric Learning to Rank", CVPR 2019, sections "Minibatch Sampling" and
"Large-Batch Training").

The paper draws each minibatch from a few categories (super-classes, e.g. "chairs" and
"lamps" in Stanford Online Products), then several classes within each category, then
several samples per class: classes of the same category are the hard negatives. PML's
`samplers.HierarchicalSampler` does exactly that, so we use it (as a DataLoader
`batch_sampler`: it yields whole batches). Each batch is trained with
`pml_rank.large_batch.large_batch_backward`, which embeds it `--chunk-size` samples at a
time.

The data is synthetic: categories are clusters, classes are sub-clusters within them,
so same-category classes are close and hard to tell apart. The script trains twice, with
category-based batches and with PML's `MPerClassSampler` (classes drawn from anywhere),
and reports Precision@1 on held-out classes, written to `<out>/fastap_sampling.json` and
`<out>/fastap_sampling.png`.

    python examples/fastap_hierarchical_sampling.py            # a minute or two on a CPU
    python examples/fastap_hierarchical_sampling.py --smoke    # seconds, tiny data
"""

import argparse
import json

import torch
from pytorch_metric_learning import samplers
from pytorch_metric_learning.utils.accuracy_calculator import AccuracyCalculator
from tqdm import tqdm

from pml_rank.harness import outputs
from pml_rank.large_batch import large_batch_backward
from pml_rank.losses import FastAPLoss


def synthetic_hierarchy(categories, classes_per_category, per_class, dim, seed):
    """Samples, class labels and category labels: category centres far apart, class
    centres near their category's centre, samples near their class centre."""
    generator = torch.Generator().manual_seed(seed)
    category_centres = 3.0 * torch.randn(categories, dim, generator=generator)
    class_centres = category_centres.repeat_interleave(classes_per_category, 0) + 1.0 * torch.randn(
        categories * classes_per_category, dim, generator=generator
    )
    class_labels = torch.arange(len(class_centres)).repeat_interleave(per_class)
    data = class_centres[class_labels] + 0.8 * torch.randn(len(class_labels), dim, generator=generator)
    category_labels = class_labels // classes_per_category
    return data, class_labels, category_labels


def split_by_class(data, class_labels, category_labels, train_fraction=0.5):
    """Class-disjoint split: the first half of each category's classes trains."""
    classes_per_category = int((category_labels == 0).sum() // (class_labels == 0).sum())
    train = (class_labels % classes_per_category) < int(classes_per_category * train_fraction)
    return ((data[train], class_labels[train], category_labels[train]), (data[~train], class_labels[~train]))


def hierarchical_batches(class_labels, category_labels, args):
    """The paper's sampling: `--categories-per-batch` categories, classes within them,
    `--per-class` samples of each class."""
    return samplers.HierarchicalSampler(
        torch.stack([class_labels, category_labels], 1),
        batch_size=args.batch_size,
        samples_per_class=args.per_class,
        batches_per_super_tuple=args.batches_per_pair,
        super_classes_per_batch=args.categories_per_batch,
        inner_label=0,
        outer_label=1,
    )


def random_class_batches(class_labels, category_labels, args, num_batches):
    """The baseline: `--per-class` samples of classes drawn from any category."""
    sampler = samplers.MPerClassSampler(
        class_labels, m=args.per_class, batch_size=args.batch_size, length_before_new_iter=num_batches * args.batch_size
    )
    return torch.utils.data.BatchSampler(sampler, args.batch_size, drop_last=True)


def same_category_negative_share(batch_sampler, class_labels, category_labels):
    """Share of a batch's negative pairs whose two classes belong to one category."""
    shares = []
    for batch in batch_sampler:
        batch = torch.as_tensor(batch)
        cls, cat = class_labels[batch], category_labels[batch]
        negative = cls[:, None] != cls[None, :]
        shares.append(((cat[:, None] == cat[None, :]) & negative).sum() / negative.sum())
    return float(torch.stack(shares).mean())


def train(batch_sampler, train_set, args, seed):
    data, class_labels, _ = train_set
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(data.shape[1], 64), torch.nn.ReLU(), torch.nn.Linear(64, args.embedding_size)
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    loss_func = FastAPLoss(num_bins=args.num_bins)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(data, class_labels), batch_sampler=batch_sampler
    )
    losses = []
    for _ in tqdm(range(args.epochs), desc="epochs", leave=False):
        for batch_data, batch_labels in loader:
            optimizer.zero_grad()
            loss = large_batch_backward(model, loss_func, batch_data, batch_labels, args.chunk_size)
            optimizer.step()
            losses.append(float(loss))
    return model, losses


def precision_at_1(model, test_set):
    data, labels = test_set
    with torch.no_grad():
        embeddings = torch.nn.functional.normalize(model(data), dim=1)
    calculator = AccuracyCalculator(include=("precision_at_1",), k=1)
    return calculator.get_accuracy(embeddings, labels)["precision_at_1"]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny data and one epoch: runs in seconds")
    parser.add_argument("--categories", type=int, default=8)
    parser.add_argument("--classes-per-category", type=int, default=20)
    parser.add_argument("--per-class", type=int, default=8, help="samples per class in a batch")
    parser.add_argument("--categories-per-batch", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument(
        "--batches-per-pair", type=int, default=2, help="batches drawn for each pair of categories per epoch"
    )
    parser.add_argument("--chunk-size", type=int, default=64, help="samples embedded with a graph at a time")
    parser.add_argument("--num-bins", type=int, default=10)
    parser.add_argument("--embedding-size", type=int, default=16)
    parser.add_argument("--dim", type=int, default=32, help="input dimension of the synthetic data")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="pml-rank-results")
    args = parser.parse_args(argv)
    if args.smoke:
        args.categories, args.classes_per_category, args.per_class = 4, 6, 4
        args.batch_size, args.batches_per_pair, args.chunk_size, args.epochs = 32, 1, 8, 1
    return args


def main(argv=None):
    args = parse_args(argv)
    out = outputs.prepare_output_dir(args.out)  # before any work
    data, class_labels, category_labels = synthetic_hierarchy(
        args.categories, args.classes_per_category, 2 * args.per_class, args.dim, args.seed
    )
    train_set, test_set = split_by_class(data, class_labels, category_labels)
    _, train_classes, train_categories = train_set

    hierarchical = hierarchical_batches(train_classes, train_categories, args)
    contenders = {
        "category-based (HierarchicalSampler)": hierarchical,
        "random classes (MPerClassSampler)": random_class_batches(
            train_classes, train_categories, args, num_batches=len(hierarchical)
        ),
    }
    results = {"args": vars(args)}
    curves = {}
    for name, batch_sampler in contenders.items():
        model, losses = train(batch_sampler, train_set, args, seed=args.seed)
        results[name] = {
            "same_category_negative_share": same_category_negative_share(
                batch_sampler, train_classes, train_categories
            ),
            "test_precision_at_1": precision_at_1(model, test_set),
            "final_loss": losses[-1],
        }
        curves[name] = losses
        print(f"{name}: {results[name]}")

    outputs.write_text(out / "fastap_sampling.json", json.dumps(results, indent=2))
    _plot(curves, results, out / "fastap_sampling.png")
    print(f"written: {out / 'fastap_sampling.json'}, {out / 'fastap_sampling.png'}")
    return results


def _plot(curves, results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, losses in curves.items():
        ax.plot(losses, label=f"{name}, test P@1 {results[name]['test_precision_at_1']:.3f}")
    ax.set_xlabel("step")
    ax.set_ylabel("FastAP loss (1 - mAP)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    outputs.save_figure(fig, path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
