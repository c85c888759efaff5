"""HardNegativeClassSampler: N-pair batches by hard negative class mining."""

import logging
import warnings

import pytest
import torch
from pytorch_metric_learning import trainers

import pml_rank
from pml_rank.harness.references.npairs import greedy_hard_negative_classes as reference_greedy
from pml_rank.losses import NPairsMCLoss
from pml_rank.samplers import HardNegativeClassSampler
from pml_rank.samplers.hard_negative_class import NoModelAttachedWarning, greedy_hard_negative_classes

# Random batches (no model) are what several tests want; the warning has its own tests.
pytestmark = pytest.mark.filterwarnings("ignore::pml_rank.samplers.hard_negative_class.NoModelAttachedWarning")


def batches(sampler, epochs=1):
    indices = [i for _ in range(epochs) for i in sampler]
    size = 2 * sampler.classes_per_batch
    assert len(indices) == epochs * len(sampler) and len(indices) % size == 0
    return [indices[start : start + size] for start in range(0, len(indices), size)]


def assert_n_pair_batches(sampler, labels, epochs=1):
    for batch in batches(sampler, epochs):
        assert len(set(batch)) == len(batch)  # two distinct examples
        classes = [labels[i] for i in batch]
        assert classes[0::2] == classes[1::2]  # the two examples of a class are adjacent
        assert len(set(classes)) == sampler.classes_per_batch


def uneven_labels(seed=0, num_classes=10):
    generator = torch.Generator().manual_seed(seed)
    sizes = torch.randint(2, 7, (num_classes,), generator=generator)
    labels = torch.repeat_interleave(torch.arange(num_classes) * 7 + 3, sizes)
    return labels[torch.randperm(len(labels), generator=generator)].tolist()


def identity_dataset(vectors):
    """A dataset whose items embed (through the identity model) to the given vectors."""
    return torch.utils.data.TensorDataset(vectors, torch.zeros(len(vectors)))


def attached(sampler, vectors):
    sampler.attach(torch.nn.Identity(), identity_dataset(vectors))
    return sampler


def test_an_epoch_without_a_model_warns_once_how_to_attach_one():
    sampler = HardNegativeClassSampler(uneven_labels(), classes_per_batch=4, batches_per_epoch=3)
    iterator = iter(sampler)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        [next(iterator) for _ in range(len(sampler))]  # the last batch, not yet the epoch's end
    with pytest.warns(NoModelAttachedWarning) as caught:
        assert list(iterator) == []
        batches(sampler, epochs=3)
    assert len(caught) == 1
    message = str(caught[0].message)
    assert message.startswith("HardNegativeClassSampler: an epoch ended without a model attached")
    assert "sampler.attach(model, dataset, device=...)" in message and "before trainer.train()" in message


def test_no_warning_with_a_model_attached():
    labels = uneven_labels(2)
    vectors = torch.randn(len(labels), 5, generator=torch.Generator().manual_seed(2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        batches(attached(HardNegativeClassSampler(labels, 3, batches_per_epoch=4), vectors), epochs=2)
        sampler = HardNegativeClassSampler(labels, 3, batches_per_epoch=4, embed_fn=lambda indices: vectors[indices])
        batches(sampler, epochs=2)


def test_random_batches_before_a_model_is_attached():
    labels = uneven_labels()
    sampler = HardNegativeClassSampler(labels, classes_per_batch=4, batches_per_epoch=12)
    assert len(sampler) == 12 * 8
    assert_n_pair_batches(sampler, labels, epochs=2)
    assert sampler.embedded_examples == 0 and sampler.mined_batches == 24


@pytest.mark.parametrize("examples_per_class", [1, 2])
def test_mined_batches_hold_n_classes_with_two_examples_each(examples_per_class):
    labels = uneven_labels(1)
    vectors = torch.randn(len(labels), 5, generator=torch.Generator().manual_seed(1))
    sampler = attached(
        HardNegativeClassSampler(
            labels, 3, candidate_classes=7, batches_per_epoch=10, examples_per_class=examples_per_class
        ),
        vectors,
    )
    assert_n_pair_batches(sampler, labels, epochs=2)
    assert sampler.embedded_examples > 0


def test_the_two_examples_of_a_class_are_any_two_distinct_ones():
    labels = [0, 0, 0, 1, 1, 1, 2, 2]
    pairs = {
        tuple(batch[2 * k : 2 * k + 2])
        for batch in batches(HardNegativeClassSampler(labels, 2, batches_per_epoch=300))
        for k in range(2)
    }
    assert {pair for pair in pairs if labels[pair[0]] == 0} == {(a, b) for a in range(3) for b in range(3) if a != b}


def test_a_dataloader_with_batch_size_2n_yields_the_batches():
    labels = uneven_labels(2)
    dataset = torch.utils.data.TensorDataset(torch.arange(len(labels)), torch.tensor(labels))
    sampler = HardNegativeClassSampler(labels, 5, seed=3)
    loader = torch.utils.data.DataLoader(dataset, batch_size=10, sampler=sampler, drop_last=True)
    assert len(loader) == sampler.batches_per_epoch == len(labels) // 10
    assert [indices.tolist() for indices, _ in loader] == batches(HardNegativeClassSampler(labels, 5, seed=3))


def test_greedy_step_adds_the_most_violating_class_as_the_reference_does():
    generator = torch.Generator().manual_seed(0)
    for trial in range(10):
        class_embeddings = torch.randn(15, 4, generator=generator)
        selected = greedy_hard_negative_classes(class_embeddings @ class_embeddings.T, 6, trial)
        assert selected.tolist() == reference_greedy(class_embeddings, 6, int(selected[0]))


def test_ties_are_broken_at_random_and_reproducibly():
    tied = torch.zeros(10, 10)
    picks = {tuple(greedy_hard_negative_classes(tied, 4, s).tolist()) for s in range(30)}
    assert len(picks) > 20 and all(len(set(p)) == 4 for p in picks)
    # Ties among the most violating classes only: class 9 is never the most violating.
    ranked = torch.ones(10, 10)
    ranked[:, 9] = ranked[9, :] = 0
    for s in range(30):
        chosen = greedy_hard_negative_classes(ranked, 4, s).tolist()
        assert 9 not in chosen[1:]
    again = [greedy_hard_negative_classes(tied, 4, 5).tolist() for _ in range(2)]
    assert again[0] == again[1]


def mutual_hard_negatives(num_hard=4, num_easy=12, examples=3):
    """Class vectors: hard classes 3·u + small noise, mutually similar (inner product
    about 9); easy classes u + 2·e_k, similar to hard ones (3) more than to each other (1).
    Every greedy run therefore gathers all hard classes: from a hard start they follow
    each other; from an easy start a hard class comes next, then the others."""
    dim = 1 + 3 + num_easy
    generator = torch.Generator().manual_seed(0)
    class_vectors = torch.zeros(num_hard + num_easy, dim)
    class_vectors[:, 0] = 1
    class_vectors[:num_hard, 0] = 3
    class_vectors[:num_hard, 1:4] = 0.1 * torch.randn(num_hard, 3, generator=generator)
    class_vectors[num_hard:, 4:] = 2 * torch.eye(num_easy)
    labels = torch.arange(num_hard + num_easy).repeat_interleave(examples)
    return labels.tolist(), class_vectors[labels], set(range(num_hard))


def test_mutual_hard_negative_classes_are_chosen_together():
    labels, vectors, hard = mutual_hard_negatives()
    n = len(hard) + 1
    sampler = attached(HardNegativeClassSampler(labels, n, candidate_classes=16, batches_per_epoch=40), vectors)
    starts_in_hard = 0
    for batch in batches(sampler):
        classes = [labels[i] for i in batch[0::2]]  # in selection order
        assert hard <= set(classes)
        if classes[0] in hard:
            assert set(classes[: len(hard)]) == hard
            starts_in_hard += 1
        else:
            assert classes[1] in hard
    assert 0 < starts_in_hard < 40
    # Without a model, all the hard classes hardly ever land in one batch.
    random_sampler = HardNegativeClassSampler(labels, n, batches_per_epoch=40)
    assert sum(hard <= {labels[i] for i in batch} for batch in batches(random_sampler)) < 5


def test_seeded_sampler_is_reproducible_and_epochs_differ():
    labels = uneven_labels(3)
    vectors = torch.randn(len(labels), 6, generator=torch.Generator().manual_seed(3))

    def run(seed, epochs=2, attach=True):
        sampler = HardNegativeClassSampler(labels, 4, candidate_classes=8, seed=seed)
        if attach:
            attached(sampler, vectors)
        return [list(sampler) for _ in range(epochs)]

    for attach in (False, True):
        first = run(7, attach=attach)
        assert first == run(7, attach=attach)
        assert first[0] != first[1] and first != run(8, attach=attach)
    # set_epoch replays an epoch.
    sampler = HardNegativeClassSampler(labels, 4, seed=7)
    epochs = [list(sampler) for _ in range(3)]
    sampler.set_epoch(1)
    assert list(sampler) == epochs[1]


class RecordingModel(torch.nn.Module):
    """Records, at each call, whether gradients are on and which submodules train."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(3, 3)
        self.norm = torch.nn.BatchNorm1d(3)
        self.calls = []

    def forward(self, x):
        self.calls.append((torch.is_grad_enabled(), self.training, self.linear.training, self.norm.training))
        return self.norm(self.linear(x))


def test_embeds_without_gradients_in_eval_mode_and_restores_each_mode():
    labels = uneven_labels(4)
    model = RecordingModel().train()
    model.norm.eval()  # frozen batch norm must stay frozen
    sampler = HardNegativeClassSampler(labels, 3, refresh_every=1)
    sampler.attach(model, identity_dataset(torch.randn(len(labels), 3)), batch_size=4)
    for _ in sampler:
        assert torch.is_grad_enabled()  # nothing leaks to the consumer between batches
        assert (model.training, model.linear.training, model.norm.training) == (True, True, False)
    assert model.calls and set(model.calls) == {(False, False, False, False)}


def test_refresh_every_bounds_the_embedding_work():
    labels = uneven_labels(5, num_classes=12)
    vectors = torch.randn(len(labels), 4)
    every_batch = attached(
        HardNegativeClassSampler(
            labels, 3, candidate_classes=6, batches_per_epoch=5, examples_per_class=2, refresh_every=1
        ),
        vectors,
    )
    list(every_batch)
    assert every_batch.embedded_examples == 5 * 6 * 2
    once_per_epoch = attached(
        HardNegativeClassSampler(labels, 3, candidate_classes=6, batches_per_epoch=5, examples_per_class=2), vectors
    )
    list(once_per_epoch)
    assert once_per_epoch.embedded_examples <= 12 * 2 < 5 * 6 * 2
    assert once_per_epoch.mined_batches == 5 and once_per_epoch.mining_seconds > 0
    assert {"mining_seconds", "mined_batches", "embedded_examples"} <= set(once_per_epoch._record_these)


def test_embed_fn_maps_indices_to_embeddings():
    labels, vectors, hard = mutual_hard_negatives()
    calls = []

    def embed(indices):
        calls.append(torch.is_grad_enabled())
        return vectors[indices]

    sampler = HardNegativeClassSampler(labels, len(hard) + 1, candidate_classes=16, embed_fn=embed)
    for batch in batches(sampler):
        assert hard <= {labels[i] for i in batch}
    assert calls and not any(calls)


def test_non_finite_embeddings_are_an_error_naming_the_sampler():
    labels = uneven_labels(6)
    vectors = torch.randn(len(labels), 3)
    vectors[:, 1] = float("nan")
    sampler = attached(HardNegativeClassSampler(labels, 3), vectors)
    with pytest.raises(ValueError, match="HardNegativeClassSampler: embeddings contains"):
        list(sampler)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(classes_per_batch=11), r"classes_per_batch=11 must be between 2 and the number of classes \(10\)"),
        (dict(classes_per_batch=1), r"classes_per_batch=1 must be between 2"),
        (
            dict(candidate_classes=3),
            r"candidate_classes=3 must be between classes_per_batch \(4\) and the number of classes \(10\)",
        ),
        (dict(candidate_classes=12), r"candidate_classes=12"),
        (dict(examples_per_class=3), r"examples_per_class=3 must be 1 or 2"),
        (dict(batches_per_epoch=0), r"batches_per_epoch=0 must be at least 1"),
        (dict(refresh_every=0), r"refresh_every=0 must be at least 1"),
    ],
)
def test_bad_parameters_are_errors_with_the_numbers(kwargs, message):
    labels = [c for c in range(10) for _ in range(2 + c % 3)]
    kwargs = {"classes_per_batch": 4, **kwargs}
    with pytest.raises(ValueError, match="HardNegativeClassSampler: " + message):
        HardNegativeClassSampler(labels, **kwargs)


def test_classes_with_fewer_than_two_examples_are_named():
    labels = [0, 0, 1, 2, 2, 3, 4, 4]
    with pytest.raises(ValueError, match=r"2 of 5 classes have fewer: label 1 \(1 example\), label 3 \(1 example\)"):
        HardNegativeClassSampler(labels, 2)


def test_registered_as_a_sampler():
    assert pml_rank.registry.samplers()["HardNegativeClassSampler"] is HardNegativeClassSampler


# PML's own progress bar formats the loss tensor with requires_grad.
@pytest.mark.filterwarnings("ignore:Converting a tensor with requires_grad")
def test_trains_inside_pml_metric_loss_only_attached_by_the_hook(caplog):
    caplog.set_level(logging.WARNING)
    torch.manual_seed(0)
    num_classes, per_class, n = 12, 6, 4
    labels = torch.arange(num_classes).repeat_interleave(per_class)
    inputs = torch.randn(num_classes, 8)[labels] + 0.3 * torch.randn(len(labels), 8)
    dataset = torch.utils.data.TensorDataset(inputs, labels)
    trunk = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
    seen = []

    class Recording(NPairsMCLoss):
        def compute_loss(self, embeddings, labels, *args):
            seen.append(labels.tolist())
            return super().compute_loss(embeddings, labels, *args)

    sampler = HardNegativeClassSampler(labels, n, seed=0)
    trainer = trainers.MetricLossOnly(
        models={"trunk": trunk},
        optimizers={"trunk_optimizer": torch.optim.SGD(trunk.parameters(), lr=0.01)},
        batch_size=2 * n,
        loss_funcs={"metric_loss": Recording()},
        dataset=dataset,
        sampler=sampler,
        dataloader_num_workers=0,
        data_device=torch.device("cpu"),
        end_of_iteration_hook=sampler.end_of_iteration_hook,
    )
    trainer.train(num_epochs=2)
    assert len(seen) == 2 * sampler.batches_per_epoch
    for batch_labels in seen:
        assert len(batch_labels) == 2 * n and len(set(batch_labels)) == n
    assert sampler._attached_trainer is trainer and sampler.embedded_examples > 0
    assert trunk.training


@pytest.mark.filterwarnings("ignore:Converting a tensor with requires_grad")
@pytest.mark.parametrize("attach", [False, True])
def test_in_a_pml_trainer_attach_before_train_or_be_warned(attach):
    """The sampler built by name, as a config pipeline builds it: without attach() the
    trainer's epochs end with a warning, once; sampler.attach(...) before train() mines."""
    torch.manual_seed(0)
    labels = torch.arange(8).repeat_interleave(4)
    dataset = torch.utils.data.TensorDataset(torch.randn(8, 6)[labels] + 0.3 * torch.randn(len(labels), 6), labels)
    trunk = torch.nn.Linear(6, 4)
    sampler = pml_rank.registry.samplers()["HardNegativeClassSampler"](labels, classes_per_batch=4)
    trainer = trainers.MetricLossOnly(
        models={"trunk": trunk},
        optimizers={"trunk_optimizer": torch.optim.SGD(trunk.parameters(), lr=0.01)},
        batch_size=8,
        loss_funcs={"metric_loss": NPairsMCLoss()},
        dataset=dataset,
        sampler=sampler,
        dataloader_num_workers=0,
    )
    if attach:
        sampler.attach(trunk, dataset, device=torch.device("cpu"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train(num_epochs=3)
    assert len([w for w in caught if w.category is NoModelAttachedWarning]) == (0 if attach else 1)
    assert (sampler.embedded_examples > 0) == attach


@pytest.mark.parametrize("with_model", [False, True])
def test_ranks_get_disjoint_shards_of_the_same_global_batches(with_model):
    labels, vectors, _ = mutual_hard_negatives()
    world = 3

    def make(**kwargs):
        sampler = HardNegativeClassSampler(labels, 6, candidate_classes=12, batches_per_epoch=5, seed=4, **kwargs)
        return attached(sampler, vectors) if with_model else sampler

    full = [i for i in make()]
    shards = [list(make(num_replicas=world, rank=rank)) for rank in range(world)]
    assert all(len(shard) == len(full) // world == len(make(num_replicas=world, rank=0)) for shard in shards)
    per_rank = 2 * 6 // world
    for b in range(5):
        pieces = [shard[b * per_rank : (b + 1) * per_rank] for shard in shards]
        assert sum(pieces, []) == full[b * 12 : (b + 1) * 12]  # together: the global batch
        for piece in pieces:  # each: whole pairs
            classes = [labels[i] for i in piece]
            assert classes[0::2] == classes[1::2]


def test_shards_must_divide_the_classes():
    with pytest.raises(ValueError, match="classes_per_batch=6 must be a multiple of num_replicas=4"):
        HardNegativeClassSampler(uneven_labels(), 6, num_replicas=4, rank=0)


@pytest.mark.parametrize("num_replicas, batch_size", [(1, 10), (1, 4), (2, 8)])
def test_a_trainer_batch_size_that_cuts_across_pairs_is_rejected(num_replicas, batch_size):
    labels = torch.arange(12).repeat_interleave(4)
    dataset = torch.utils.data.TensorDataset(torch.randn(len(labels), 8), labels)
    trunk = torch.nn.Linear(8, 8)
    sampler = HardNegativeClassSampler(labels, 4, seed=0, num_replicas=num_replicas, rank=0)

    def trainer(size):
        return trainers.MetricLossOnly(
            models={"trunk": trunk},
            optimizers={},
            batch_size=size,
            loss_funcs={"metric_loss": NPairsMCLoss()},
            dataset=dataset,
            sampler=sampler,
            dataloader_num_workers=0,
            data_device=torch.device("cpu"),
        )

    expected = 8 // num_replicas
    with pytest.raises(
        ValueError,
        match=rf"HardNegativeClassSampler: the trainer's batch_size is {batch_size}, "
        rf"but its batches hold .* = {expected} samples; use batch_size={expected}",
    ):
        sampler.attach_trainer(trainer(batch_size))
    good = trainer(expected)
    sampler.end_of_iteration_hook(good)
    assert sampler._attached_trainer is good
