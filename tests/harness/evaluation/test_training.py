"""Training one model with PML's trainer (`train_model`): what the loader does around it."""

import copy
import dataclasses
import multiprocessing
import os

import pytest
import torch
from loader_probes import PidStamped, RecordingTrunk

from pml_rank.harness.budget import resolve
from pml_rank.harness.evaluation import TrainingConfig
from pml_rank.harness.evaluation.training import train_model
from pml_rank.losses import SmoothAPLoss


@pytest.mark.slow  # starts loader processes
def test_the_loaders_processes_live_through_every_pass_and_epoch():
    dataset, trunk = PidStamped(), RecordingTrunk()
    budget = dict(resolve("glyphs"), epochs=2, iterations_per_epoch=5, batch_size=16)
    config = dataclasses.replace(TrainingConfig.from_budget(budget), loader_workers=2)
    train_model(SmoothAPLoss(), dataset, config, trunk=trunk, seed=0)
    # They end with the training, not whenever the garbage collector frees the trainer.
    assert not multiprocessing.active_children()
    # 10 batches of 16 over 64 samples: 2.5 passes over the sampler, for each of which PML's
    # loader started processes anew; here read as one stream by the same 2.
    assert len(trunk.loader_pids["train"]) == 2 and os.getpid() not in trunk.loader_pids["train"]


@pytest.mark.slow  # starts loader processes
def test_every_epochs_validation_reads_from_one_set_of_loader_processes():
    trunk = RecordingTrunk()
    budget = dict(resolve("glyphs"), epochs=3, iterations_per_epoch=2, batch_size=16)
    config = dataclasses.replace(TrainingConfig.from_budget(budget), loader_workers=2)
    val_set = PidStamped(per_class=20, first_label=8, seed=1)  # 160 items: 2 batches of the tester's
    result = train_model(SmoothAPLoss(), PidStamped(), config, trunk=trunk, val_set=val_set, seed=0)
    assert len(result.history) == 3 and all("precision_at_1" in entry for entry in result.history)
    # PML's tester started 2 processes for each of the 3 validations; they end with the training.
    validation_pids = trunk.loader_pids["eval"]
    assert len(validation_pids) == 2 and not validation_pids & (trunk.loader_pids["train"] | {os.getpid()})
    assert not multiprocessing.active_children()


def test_a_training_without_a_kept_folder_reloads_its_best_epoch_from_memory(tmp_path):
    from pml_rank.harness.data import SmallCNN, load_glyphs
    from pml_rank.harness.evaluation import test_set_and_folds

    glyphs = load_glyphs(cache_dir=tmp_path / "cache", num_classes=16)
    (train_set, val_set), *_ = test_set_and_folds(glyphs, 2)[0]
    budget = dict(resolve("glyphs"), epochs=3, iterations_per_epoch=4, batch_size=16)
    results = []
    for folder in (tmp_path / "kept", None):
        torch.manual_seed(0)
        result = train_model(
            SmoothAPLoss(),
            train_set,
            TrainingConfig.from_budget(budget),
            trunk=SmallCNN(),
            val_set=val_set,
            seed=0,
            folder=folder,
        )
        results.append(result)
    kept, in_memory = results
    assert (tmp_path / "kept" / "models").exists() and kept.best_epoch == in_memory.best_epoch
    for a, b in zip(kept.trunk.state_dict().values(), in_memory.trunk.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_the_best_epochs_weights_come_back_and_a_latest_epochs_are_not_kept():
    from types import SimpleNamespace

    from pml_rank.harness.evaluation.training import BestModelsInMemory

    trunk = torch.nn.Linear(3, 2)
    trainer = SimpleNamespace(models={"trunk": trunk}, epoch=3)
    hooks = BestModelsInMemory(record_keeper=None)
    best = {key: value.clone() for key, value in trunk.state_dict().items()}
    hooks.save_models(trainer, "unused", "best1")
    with torch.no_grad():
        trunk.weight.add_(1.0)
    hooks.save_models(trainer, "unused", 2, 1)  # the latest epoch's: not read back, not kept
    hooks.load_latest_saved_models(trainer, "unused", best=True)
    for key, value in trunk.state_dict().items():
        torch.testing.assert_close(value, best[key], rtol=0, atol=0)


def _augmented_training(folder, tmp_path, workers, seed):
    from loader_probes import FlatTrunk

    from pml_rank.harness.datasets import ImageFolder, Transformed, image_transforms
    from pml_rank.harness.evaluation.splits import LabelledSubset

    images = ImageFolder(folder, cache_dir=tmp_path / "cache")
    augmentation = {"augmentation": "random-resized-crop", "image_size": 8, "resize": 12}
    train_set = Transformed(LabelledSubset(images, range(len(images))), image_transforms(augmentation, 3)[0])
    # 24 images, 3 batches of 8 a pass of the sampler: 6 iterations read 2 passes.
    budget = dict(resolve("glyphs"), epochs=2, iterations_per_epoch=3, batch_size=8)
    config = dataclasses.replace(TrainingConfig.from_budget(budget), loader_workers=workers)
    torch.manual_seed(seed)
    trunk = FlatTrunk()
    train_model(SmoothAPLoss(), train_set, config, trunk=trunk, seed=seed)
    assert not multiprocessing.active_children()
    return trunk


@pytest.mark.slow  # starts loader processes
def test_an_images_augmentation_depends_on_the_seed_and_its_place_in_training_not_on_the_loader_processes(
    tmp_path,
):
    from loader_probes import write_image_folder

    folder = write_image_folder(tmp_path / "images")
    in_process, with_workers, other_seed = (
        _augmented_training(folder, tmp_path, workers, seed) for workers, seed in ((0, 0), (2, 0), (0, 1))
    )
    assert len(in_process.seen) == len(with_workers.seen) == 6
    for a, b in zip(in_process.seen, with_workers.seen):
        assert torch.equal(a, b)
    for name, weights in in_process.state_dict().items():
        assert torch.equal(weights, with_workers.state_dict()[name])
    # Another seed crops the same images elsewhere: no batch of its training is one of seed 0's.
    assert not any(torch.equal(a, b) for a in in_process.seen for b in other_seed.seen)


def test_a_keyed_item_draws_its_augmentation_from_its_seed_alone(tmp_path):
    from loader_probes import write_image_folder

    from pml_rank.harness.datasets import ImageFolder, Transformed, image_transforms

    images = ImageFolder(write_image_folder(tmp_path / "images", classes=2, per_class=2), cache_dir=tmp_path)
    augmentation = {"augmentation": "crop-flip", "image_size": 8, "resize": 12}
    train_set = Transformed(images, image_transforms(augmentation, 3)[0])
    torch.manual_seed(0)
    first = train_set[(1, 5)][0]
    after = torch.rand(3)
    torch.manual_seed(0)
    torch.rand(100)  # the process's generator elsewhere
    assert torch.equal(train_set[(1, 5)][0], first)
    torch.manual_seed(0)
    assert torch.equal(torch.rand(3), after)  # the process's generator left as it was
    assert not any(torch.equal(train_set[(1, seed)][0], first) for seed in range(6, 10))


@pytest.mark.parametrize("optimizer", ["adam", "sgd", "rmsprop"])
def test_on_a_gpu_adam_and_sgd_take_the_fused_step_and_on_the_cpu_the_foreach_one(optimizer):
    """The fused step launches one kernel where the default launches one per operation (on
    CUDA, tests/test_cuda.py); the CPU takes the foreach step (the same bits as its
    per-parameter default: the next test)."""
    config = dataclasses.replace(TrainingConfig.from_budget(resolve("glyphs")), optimizer=optimizer, momentum=0.0)
    parameters = list(torch.nn.Linear(3, 2).parameters())
    flags = {}
    for device in ("cpu", "cuda"):
        made = dataclasses.replace(config, device=device).make_optimizer(parameters, 1e-3)
        assert type(made).__name__.lower() == optimizer
        flags[device] = (bool(made.defaults.get("fused")), bool(made.defaults.get("foreach")))
    fused_on_cuda = optimizer != "rmsprop"
    assert flags == {"cpu": (False, True), "cuda": (fused_on_cuda, not fused_on_cuda)}


@pytest.mark.parametrize("optimizer", ["adam", "sgd", "rmsprop"])
@pytest.mark.parametrize("weight_decay", [0.0, 1e-3])
def test_the_cpu_optimizer_steps_the_same_bits_as_torchs_per_parameter_default(optimizer, weight_decay):
    """The committed tables were made with torch's per-parameter step on the CPU: the
    foreach one `make_optimizer` gives must not move a parameter by one bit."""
    config = TrainingConfig.from_budget(resolve("glyphs"))
    config = dataclasses.replace(config, optimizer=optimizer, weight_decay=weight_decay, momentum=0.9)
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Conv2d(1, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.Flatten(), torch.nn.Linear(4 * 36, 5)
    )
    nets = [net, copy.deepcopy(net)]
    made = config.make_optimizer(nets[0].parameters(), 3e-3)
    default = type(made)(nets[1].parameters(), **{**made.defaults, "foreach": False})
    assert made.defaults["foreach"] and not default.defaults["foreach"]
    for _ in range(25):
        images = torch.randn(6, 1, 8, 8)
        for model, step in zip(nets, (made, default)):
            step.zero_grad()
            model(images).square().mean().backward()
            step.step()
    for (name, a), b in zip(nets[0].state_dict().items(), nets[1].state_dict().values()):
        assert torch.equal(a, b), name


def test_the_trainers_zero_grad_clears_every_gradient_pmls_clears_and_sees_a_parameter_added_before_training():
    """`MetricLossOnly.zero_grad` keeps a list of the parameters instead of asking every model
    and optimizer at each step, as PML's does: the same gradients cleared, a loss's parameters
    in an optimizer but in no model among them, and a list made anew for each training."""
    from pytorch_metric_learning import losses

    from pml_rank.harness.evaluation.training import MetricLossOnly

    trunk, embedder = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU()), torch.nn.Linear(3, 2)
    loss = losses.ProxyAnchorLoss(num_classes=3, embedding_size=2)
    optimizers = {
        "trunk_optimizer": torch.optim.SGD(trunk.parameters(), lr=0.1),
        "metric_loss_optimizer": torch.optim.SGD(loss.parameters(), lr=0.1),
    }
    dataset = torch.utils.data.TensorDataset(torch.randn(8, 4), torch.arange(8) % 3)
    dataset.labels = (torch.arange(8) % 3).tolist()
    trainer = MetricLossOnly(
        models={"trunk": trunk, "embedder": embedder},
        optimizers=optimizers,
        batch_size=4,
        loss_funcs={"metric_loss": loss},
        dataset=dataset,
    )
    cleared = [*trunk.parameters(), *embedder.parameters(), *loss.parameters()]
    for _ in range(2):  # the list made at the first call serves the second
        for parameter in cleared:
            parameter.grad = torch.ones_like(parameter)
        trainer.zero_grad()
        assert all(parameter.grad is None for parameter in cleared)
    embedder.extra = torch.nn.Parameter(torch.ones(1))  # a parameter added between two trainings
    embedder.extra.grad = torch.ones(1)
    trainer.train(num_epochs=0)  # a training that takes no step makes the list anew
    trainer.zero_grad()
    assert embedder.extra.grad is None
