"""`EmbeddingLoaders`: one set of loader processes serving many embedding passes, each the
batches PML's tester would have read."""

import collections
import dataclasses
import multiprocessing
import os

import pytest
import torch
from loader_probes import PidStamped, RecordingTrunk
from pytorch_metric_learning.utils import common_functions as c_f

from pml_rank.harness.budget import resolve
from pml_rank.harness.evaluation import Recipe, TrainingConfig, run_protocol
from pml_rank.harness.evaluation.loaders import concatenated, embedding_loaders
from pml_rank.losses import SmoothAPLoss


def _passes(loaders_or_none, order):
    """The batches of a pass over each data set of `order`, from the loaders or PML's own loader."""
    if loaders_or_none is None:
        return [list(c_f.get_eval_dataloader(dataset, 16, 0, None)) for dataset in order]
    return [list(loaders_or_none.pass_over(dataset)) for dataset in order]


@pytest.mark.slow  # starts loader processes
def test_passes_give_pmls_batches_from_one_set_of_processes_and_draw_as_pmls_loader():
    a, b = PidStamped(classes=5, per_class=7), PidStamped(classes=3, per_class=5, seed=1)  # 35 and 15 items
    order = [a, b, a]
    with embedding_loaders([a, b], 16, workers=2) as loaders:
        torch.manual_seed(0)
        pooled = _passes(loaders, order)
        after_pooled = torch.rand(4)
        assert loaders.pass_over(PidStamped()) is None  # not one of its data sets
    assert not multiprocessing.active_children()
    torch.manual_seed(0)
    expected = _passes(None, order)
    # Torch's generator is where PML's loader (one a pass) leaves it: what follows draws the same.
    assert torch.equal(torch.rand(4), after_pooled)
    pids = set()
    for pooled_pass, expected_pass in zip(pooled, expected, strict=True):
        assert len(pooled_pass) == len(expected_pass)  # 3, 1, 3 batches: the last ones short
        for (x, labels), (expected_x, expected_labels) in zip(pooled_pass, expected_pass):
            assert torch.equal(x[:, :-1], expected_x[:, :-1]) and torch.equal(labels, expected_labels)
            assert len(set(x[:, -1].long().tolist())) == 2  # each batch read by both processes
            pids.update(x[:, -1].long().tolist())
    assert len(pids) == 2 and os.getpid() not in pids


Point = collections.namedtuple("Point", "x y")


@pytest.mark.parametrize(
    "make_item",
    [
        lambda k: (torch.full((2, 3), float(k)), k),  # an image and its label, as the tester reads
        lambda k: (torch.full((1, 2, 3), k, dtype=torch.uint8), k),  # an 8-bit image, as `image_transforms` gives
        lambda k: {"image": torch.full((3,), k / 7), "name": f"item{k}", "labels": (k, k % 2)},
        lambda k: Point(torch.tensor([k, -k]), [f"a{k}", f"b{k}"]),
        lambda k: f"path/{k}.jpg",
    ],
)
@pytest.mark.parametrize("cuts", [[5], [1, 4], [2, 1, 2], [1, 1, 1, 1, 1]])
def test_batches_read_in_pieces_are_put_together_as_torch_collates_them_at_once(make_item, cuts):
    items = [make_item(k) for k in range(sum(cuts))]
    starts = [sum(cuts[:i]) for i in range(len(cuts))]
    pieces = [torch.utils.data.default_collate(items[a : a + n]) for a, n in zip(starts, cuts)]

    def same(a, b):
        if torch.is_tensor(a):
            return torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
        if isinstance(a, dict):
            return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
        if isinstance(a, (list, tuple)):
            return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
        return a == b

    assert same(concatenated(pieces), torch.utils.data.default_collate(items))
    # Toward a device (here torch's meta device, which keeps shapes and dtypes): the tensors of
    # more than one dimension (the images, 8-bit or not) are put together there, the rest (labels)
    # as on the CPU.
    moved, expected = concatenated(pieces, torch.device("meta")), torch.utils.data.default_collate(items)

    def on_meta(a, b):
        if torch.is_tensor(a):
            if b.dim() > 1:
                return a.is_meta and a.shape == b.shape and a.dtype == b.dtype
            return same(a, b)
        if isinstance(a, dict):
            return a.keys() == b.keys() and all(on_meta(a[k], b[k]) for k in a)
        if isinstance(a, (list, tuple)):
            return type(a) is type(b) and len(a) == len(b) and all(on_meta(x, y) for x, y in zip(a, b))
        return a == b

    assert on_meta(moved, expected)


def test_without_loader_processes_there_are_no_loaders():
    with embedding_loaders([PidStamped()], 16, workers=0) as loaders:
        assert loaders is None


@pytest.mark.slow  # starts loader processes
def test_an_experiments_embedding_passes_share_one_set_of_loader_processes():
    """Two fold models of two epochs each: 4 validations and 2 test passes of 2 batches or
    more, for which PML's tester started 2 processes each (12), read by 2; the fold models'
    training, for which PML's trainer started 2 for each model and each pass over its sampler,
    by 2 others; the results are those of loading in the calling process."""
    # 8 training classes in 2 folds of 4 (160 items to validate on), 8 test classes (320 items)
    dataset = PidStamped(classes=16, per_class=40)
    budget = dict(resolve("glyphs"), epochs=2, iterations_per_epoch=3, batch_size=16, num_folds=2)
    results, records = [], []
    for workers in (2, 0):
        record = {"train": set(), "eval": set()}
        config = dataclasses.replace(TrainingConfig.from_budget(budget), loader_workers=workers)
        result = run_protocol(dataset, Recipe(make_loss=SmoothAPLoss), lambda: RecordingTrunk(record), config, seed=3)
        results.append(result)
        records.append(record)
        assert not multiprocessing.active_children()
    (with_workers, in_process), (record, _) = results, records
    assert len(record["eval"]) == 2 and not record["eval"] & (record["train"] | {os.getpid()})
    assert len(record["train"]) == 2  # and 2 read every fold model's training batches
    assert with_workers.histories == in_process.histories
    assert (with_workers.concatenated, with_workers.separated) == (in_process.concatenated, in_process.separated)


@pytest.mark.cuda
@pytest.mark.slow  # starts loader processes
def test_on_cuda_images_from_loader_processes_are_those_read_in_the_calling_process(tmp_path):
    """On a GPU the training batches come from the loader processes' pinned memory without
    waiting, and each embedding pass in pieces from all of them: the trunk trains on the same
    images as with PML's loader in the calling process, and embeds a data set alike."""
    from loader_probes import FlatTrunk, write_image_folder

    from pml_rank.harness.datasets import ImageFolder, image_transforms
    from pml_rank.harness.evaluation import test_set_and_folds
    from pml_rank.harness.evaluation.training import EMBEDDING_BATCH, compute_embeddings

    images = ImageFolder(write_image_folder(tmp_path / "images", classes=8), cache_dir=tmp_path)
    transforms = image_transforms({"augmentation": "random-resized-crop", "image_size": 8, "resize": 12}, 3)
    budget = dict(resolve("glyphs"), epochs=2, iterations_per_epoch=2, batch_size=8, num_folds=2)
    trunks = []

    def make_trunk():
        trunks.append(FlatTrunk())
        return trunks[-1]

    for workers in (3, 0):
        config = dataclasses.replace(TrainingConfig.from_budget(budget), loader_workers=workers, device="cuda")
        result = run_protocol(images, Recipe(make_loss=SmoothAPLoss), make_trunk, config, transforms=transforms)
        assert [[e["epoch"] for e in history] for history in result.histories] == [[1, 2]] * 2
    assert [len(trunk.seen) for trunk in trunks] == [4] * 4
    for a, b in zip(trunks[:2], trunks[2:]):
        assert all(x.is_cuda and torch.equal(x, y) for x, y in zip(a.seen, b.seen, strict=True))
    _, test_set = test_set_and_folds(images, 2, transforms)
    trunk = trunks[0].eval()
    with embedding_loaders([test_set], EMBEDDING_BATCH, 3, "cuda") as loaders:  # pieces put together there
        pooled, pooled_labels = compute_embeddings(trunk, test_set, None, "cuda", loader_workers=3, loaders=loaders)
    alone, labels = compute_embeddings(trunk, test_set, None, "cuda")
    assert len(alone) == len(test_set) and torch.equal(pooled, alone) and (pooled_labels == labels).all()


@pytest.mark.slow  # starts loader processes
def test_an_experiment_on_images_trains_as_in_the_calling_process_with_one_set_of_training_loader_processes(
    tmp_path,
):
    """Images with random crops and flips, a trunk with dropout (torch's generator draws at
    every step), one batch a pass of the sampler: each fold model's 4 steps read 4 passes,
    chained in the loader processes, and train as those of PML's loader in the calling process."""
    from loader_probes import FlatTrunk, write_image_folder

    from pml_rank.harness.datasets import ImageFolder, image_transforms

    images = ImageFolder(write_image_folder(tmp_path / "images", classes=8), cache_dir=tmp_path)
    augmentation = {"augmentation": "random-resized-crop", "image_size": 8, "resize": 12}
    # 4 training classes in 2 folds: a fold model trains on 12 images, one batch of 8 a pass.
    budget = dict(resolve("glyphs"), epochs=2, iterations_per_epoch=2, batch_size=8, num_folds=2)
    results, trunks = [], []

    def make_trunk():
        trunks.append(FlatTrunk(dropout=0.5))
        return trunks[-1]

    for workers in (2, 0):
        config = dataclasses.replace(TrainingConfig.from_budget(budget), loader_workers=workers)
        transforms = image_transforms(augmentation, 3)
        results.append(run_protocol(images, Recipe(make_loss=SmoothAPLoss), make_trunk, config, transforms=transforms))
        assert not multiprocessing.active_children()
    with_workers, in_process = results
    assert [len(trunk.seen) for trunk in trunks] == [4] * 4
    for a, b in zip(trunks[:2], trunks[2:]):
        assert all(torch.equal(x, y) for x, y in zip(a.seen, b.seen, strict=True))
        assert all(torch.equal(w, b.state_dict()[name]) for name, w in a.state_dict().items())
    assert with_workers.histories == in_process.histories
    assert (with_workers.concatenated, with_workers.separated) == (in_process.concatenated, in_process.separated)
