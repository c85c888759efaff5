"""RaMBORecallLoss and RaMBOAPLoss: values and gradients against the straightforward
reference, score memory, state_dict, PML integration, DistributedLossWrapper, errors."""

import importlib.util
import socket
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from pytorch_metric_learning import reducers, trainers
from pytorch_metric_learning.utils.distributed import DistributedLossWrapper

import pml_rank
from pml_rank import ranking
from pml_rank.harness import speed
from pml_rank.harness.references import rambo as reference
from pml_rank.losses import RaMBOAPLoss, RaMBORecallLoss, rambo
from pml_rank.losses.rambo import ZERO_GRADIENT_CALLS, ZeroRankGradientWarning

ROOT = Path(__file__).resolve().parents[2]


def batch(size=32, dim=8, per_class=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    embeddings = torch.randn(size, dim, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, max(1, size // per_class), (size,), generator=gen)
    return embeddings, labels


def value_and_grad(fn, embeddings):
    embeddings = embeddings.detach().clone().requires_grad_()
    value = fn(embeddings)
    value.backward()
    return value.detach(), embeddings.grad


def reference_for(loss):
    """The reference function computing `loss` (an instance) from eq. 16-22."""
    if isinstance(loss, RaMBORecallLoss):
        return lambda e, l, **refs: reference.recall_loss(e, l, loss.lambda_val, loss.margin, loss.weighting, **refs)
    return lambda e, l, **refs: reference.ap_retrieval_loss(e, l, loss.lambda_val, loss.margin, **refs)


RECALL_SETTINGS = [
    dict(lambda_val=0.2, margin=0.02, weighting="log"),
    dict(lambda_val=0.2, margin=0.02, weighting="loglog"),
    dict(lambda_val=4.0, margin=0.05, weighting="log"),
    dict(lambda_val=1.0, margin=0.0, weighting="loglog"),
]


@pytest.mark.parametrize("settings", RECALL_SETTINGS)
def test_recall_loss_equals_reference(settings):
    embeddings, labels = batch()
    loss = RaMBORecallLoss(memory_size=0, **settings)
    ours = value_and_grad(lambda e: loss(e, labels), embeddings)
    ref = value_and_grad(lambda e: reference_for(loss)(e, labels), embeddings)
    assert torch.allclose(ours[0], ref[0], atol=1e-12)
    assert torch.allclose(ours[1], ref[1], atol=1e-12)
    assert ours[1].abs().sum() > 0


@pytest.mark.parametrize("settings", [dict(lambda_val=0.2, margin=0.02), dict(lambda_val=3.0, margin=0.1)])
def test_ap_loss_equals_reference(settings):
    embeddings, labels = batch(seed=1)
    loss = RaMBOAPLoss(memory_size=0, **settings)
    ours = value_and_grad(lambda e: loss(e, labels), embeddings)
    ref = value_and_grad(lambda e: reference_for(loss)(e, labels), embeddings)
    assert torch.allclose(ours[0], ref[0], atol=1e-12)
    assert torch.allclose(ours[1], ref[1], atol=1e-12)


@pytest.mark.parametrize("loss_class", [RaMBORecallLoss, RaMBOAPLoss])
def test_counted_ranks_equal_reference(loss_class, monkeypatch):
    """3 positives per row among 127 references: at most log2(127) / 2, so the ranks are
    counted, not sorted (the spy proves it)."""
    calls = []
    counted = ranking._CountedRanks.apply
    monkeypatch.setattr(ranking._CountedRanks, "apply", lambda *args: calls.append(1) or counted(*args))
    embeddings, labels = batch(128, seed=9)[0], torch.arange(128) // 4
    loss = loss_class(memory_size=0, lambda_val=0.5, margin=0.05)
    ours = value_and_grad(lambda e: loss(e, labels), embeddings)
    ref = value_and_grad(lambda e: reference_for(loss)(e, labels), embeddings)
    assert calls
    assert torch.allclose(ours[0], ref[0], atol=1e-12)
    assert torch.allclose(ours[1], ref[1], atol=1e-12)


def test_recall_is_the_log_of_negatives_above_each_positive():
    """Eq. 17 by hand on three points: the positive has one negative above it."""
    embeddings = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.8, 0.6]], dtype=torch.float64)
    labels = torch.tensor([0, 0, 1])
    loss = RaMBORecallLoss(margin=0, memory_size=0)
    # Query 0: its positive (cos 0) is below its negative (cos 0.8): r = 1. Same for
    # query 1 (cos 0 < 0.6). Query 2 has no positive.
    assert loss(embeddings, labels).item() == pytest.approx(torch.log1p(torch.tensor(1.0)).item())


@pytest.mark.parametrize("loss_class", [RaMBORecallLoss, RaMBOAPLoss])
def test_defaults_are_the_papers_cub200_values_with_the_authors_memory(loss_class):
    loss = loss_class()
    assert (loss.lambda_val, loss.margin, loss.memory_size, loss.memory_variant) == (0.2, 0.02, 3, "rows")


@pytest.mark.parametrize("loss_class", [RaMBORecallLoss, RaMBOAPLoss])
def test_ref_emb_is_ranked_without_leaving_anything_out(loss_class):
    embeddings, labels = batch(12, seed=2)
    ref_emb, ref_labels = batch(20, seed=3)
    ref_labels = ref_labels % 3
    labels = labels % 3
    loss = loss_class(memory_size=0)
    ours = value_and_grad(lambda e: loss(e, labels, ref_emb=ref_emb, ref_labels=ref_labels), embeddings)
    ref = value_and_grad(lambda e: reference_for(loss)(e, labels, ref_emb=ref_emb, ref_labels=ref_labels), embeddings)
    assert torch.allclose(ours[0], ref[0], atol=1e-12)
    assert torch.allclose(ours[1], ref[1], atol=1e-12)


@pytest.mark.parametrize("loss_class", [RaMBORecallLoss, RaMBOAPLoss])
def test_memory_equals_one_call_on_the_concatenated_references(loss_class):
    tau = 2
    loss = loss_class(memory_size=tau, memory_variant="extend")
    batches = [batch(size, seed=10 + i) for i, size in enumerate([16, 24, 8, 20])]  # sizes change
    for step, (embeddings, labels) in enumerate(batches):
        embeddings = embeddings.clone().requires_grad_()
        value = loss(embeddings, labels)
        earlier = batches[max(0, step - tau) : step]
        if earlier:
            memory = dict(
                memory_emb=torch.cat([e for e, _ in earlier]), memory_labels=torch.cat([l for _, l in earlier])
            )
        else:
            memory = {}  # the first call: an empty memory
        ref = value_and_grad(lambda e: reference_for(loss)(e, labels, **memory), embeddings)
        value.backward()
        assert torch.allclose(value, ref[0], atol=1e-12)
        assert torch.allclose(embeddings.grad, ref[1], atol=1e-12)
        assert len(loss.memory) == min(step + 1, tau)
    assert not any(t.requires_grad for t in loss.memory.stored())


def rows_variant_reference(loss, embeddings, labels, stored_rows):
    """The authors' memory variant, from its description: the batch's score rows (query
    itself left out) with the stored rows of earlier batches appended below as extra
    queries, each row ranked on its own by Algorithm 1 (ranks / n), r = (rank − rank
    among positives) / n times the number of rows; the mean over all positive pairs."""
    scores, positives = reference.similarities_without_self(embeddings, labels)
    scores = torch.cat([scores] + [s for s, _ in stored_rows])
    positives = torch.cat([positives] + [p for _, p in stored_rows])
    if isinstance(loss, RaMBOAPLoss):
        return reference.average_precision_loss(scores, positives, loss.lambda_val, loss.margin)
    y = reference.shifted(scores, positives, loss.margin)
    n = y.shape[-1]
    ranks = reference.BlackboxRanker.apply(y, loss.lambda_val)
    among = reference.rank_among_positives(y, positives).to(y.dtype) / n
    losses = torch.log1p(((ranks - among) * len(y))[positives])
    if loss.weighting == "loglog":
        losses = torch.log1p(losses)
    return losses.mean()


@pytest.mark.parametrize(
    "loss",
    [
        RaMBORecallLoss(memory_size=2, memory_variant="rows"),
        RaMBORecallLoss(memory_size=2, memory_variant="rows", weighting="loglog", lambda_val=1.0, margin=0.05),
        RaMBOAPLoss(memory_size=2, memory_variant="rows", lambda_val=2.0),
    ],
)
def test_rows_memory_equals_reference(loss):
    tau = 2
    batches = [batch(16, seed=40 + i) for i in range(4)]
    for step, (embeddings, labels) in enumerate(batches):
        earlier = batches[max(0, step - tau) : step]
        stored_rows = [
            tuple(t.detach() for t in reference.similarities_without_self(*previous)) for previous in earlier
        ]
        ours = value_and_grad(lambda e, labels=labels: loss(e, labels), embeddings)
        ref = value_and_grad(
            lambda e, labels=labels, stored=stored_rows: rows_variant_reference(loss, e, labels, stored), embeddings
        )
        assert torch.allclose(ours[0], ref[0], atol=1e-12)
        assert torch.allclose(ours[1], ref[1], atol=1e-12)
        assert ours[1].abs().sum() > 0
        assert len(loss.memory) == min(step + 1, tau)


def test_rows_memory_differs_from_extend_and_needs_equal_row_lengths():
    rows, extend = RaMBORecallLoss(memory_variant="rows"), RaMBORecallLoss(memory_variant="extend")
    for seed in range(2):
        assert rows(*batch(seed=seed)).item() != pytest.approx(extend(*batch(seed=seed)).item())
    with pytest.raises(ValueError, match="RaMBORecallLoss: score row length 23 differs from the 31 stored"):
        rows(*batch(24))
    rows.reset_memory()
    rows(*batch(24))


@pytest.mark.parametrize("loss_class", [RaMBORecallLoss, RaMBOAPLoss])
def test_without_memory_the_variant_plays_no_part(loss_class):
    embeddings, labels = batch(seed=3)
    rows = value_and_grad(lambda e: loss_class(memory_size=0, memory_variant="rows")(e, labels), embeddings)
    extend = value_and_grad(lambda e: loss_class(memory_size=0, memory_variant="extend")(e, labels), embeddings)
    assert torch.equal(rows[0], extend[0]) and torch.equal(rows[1], extend[1])


def test_rows_memory_round_trips_through_state_dict():
    loss = RaMBOAPLoss(memory_size=2, memory_variant="rows")
    for seed in range(3):
        loss(*batch(seed=seed))
    restored = RaMBOAPLoss(memory_size=2, memory_variant="rows")
    restored.load_state_dict(loss.state_dict())
    nxt = batch(seed=7)
    assert restored(*nxt).item() == loss(*nxt).item()


def test_memory_gives_no_gradient_to_earlier_batches():
    loss = RaMBORecallLoss(memory_size=3)
    first = batch(seed=20)[0].requires_grad_()
    loss(first, batch(seed=20)[1])  # stored, never backpropagated
    second, labels = batch(seed=21)
    second.requires_grad_()
    loss(second, labels).backward()
    assert first.grad is None and second.grad.abs().sum() > 0


def test_state_dict_round_trips_the_memory():
    loss = RaMBORecallLoss(memory_size=2)
    for seed in range(3):
        loss(*batch(seed=seed))
    restored = RaMBORecallLoss(memory_size=2)
    restored.load_state_dict(loss.state_dict())
    assert len(restored.memory) == 2
    for restored_tensor, saved_tensor in zip(restored.memory.stored(), loss.memory.stored(), strict=True):
        assert torch.equal(restored_tensor, saved_tensor)
    nxt = batch(seed=7)
    assert restored(*nxt).item() == loss(*nxt).item()


def test_reset_memory_and_memory_size_zero():
    loss = RaMBOAPLoss(memory_size=2)
    loss(*batch())
    loss.reset_memory()
    assert len(loss.memory) == 0
    embeddings, labels = batch(seed=4)
    assert loss(embeddings, labels).item() == pytest.approx(reference_for(loss)(embeddings, labels).item())
    off = RaMBOAPLoss(memory_size=0)
    off(*batch())
    assert len(off.memory) == 0


def test_changing_embedding_size_needs_a_reset():
    loss = RaMBORecallLoss(memory_size=2, memory_variant="extend")
    loss(*batch(dim=8))
    with pytest.raises(ValueError, match="RaMBORecallLoss: embedding size 6 differs from the 8 stored"):
        loss(*batch(dim=6))
    loss.reset_memory()
    loss(*batch(dim=6))


@pytest.mark.parametrize("loss_class", [RaMBORecallLoss, RaMBOAPLoss])
def test_batch_without_positive_pair_returns_zero_loss(loss_class):
    embeddings = torch.randn(6, 4, requires_grad=True)
    loss = loss_class(memory_size=0)(embeddings, torch.arange(6))
    loss.backward()
    assert loss.item() == 0 and torch.equal(embeddings.grad, torch.zeros(6, 4))


@pytest.mark.parametrize("loss_class", [RaMBORecallLoss, RaMBOAPLoss])
def test_nan_embeddings_are_rejected_naming_the_loss(loss_class):
    embeddings, labels = batch()
    embeddings[5, 2] = float("nan")
    with pytest.raises(
        ValueError, match=rf"{loss_class.__name__}: embeddings contains 1 NaN/Inf value\(s\), first at index \(5, 2\)"
    ):
        loss_class()(embeddings, labels)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(lambda_val=0), "RaMBORecallLoss: lambda_val must be a finite number > 0, got 0"),
        (dict(margin=-0.1), "RaMBORecallLoss: margin must be a finite number >= 0, got -0.1"),
        (dict(weighting="sqrt"), "RaMBORecallLoss: weighting must be 'log' or 'loglog', got 'sqrt'"),
        (dict(memory_size=-1), "RaMBORecallLoss: memory_size must be an integer >= 0, got -1"),
        (dict(memory_variant="queue"), "RaMBORecallLoss: memory_variant must be 'extend' or 'rows', got 'queue'"),
    ],
)
def test_bad_parameters_are_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        RaMBORecallLoss(**kwargs)


def test_a_tuple_leaving_queries_different_numbers_of_references_is_rejected():
    embeddings, labels = batch()
    with pytest.raises(ValueError, match="RaMBOAPLoss: a ranking needs the same number of references for every query"):
        RaMBOAPLoss()(embeddings, labels, indices_tuple=(torch.tensor([0]), torch.tensor([1]), torch.tensor([2])))


def every_pair_but_self(labels):
    same = labels[:, None] == labels[None, :]
    return (*torch.where(same & ~torch.eye(len(labels), dtype=torch.bool)), *torch.where(~same))


@pytest.mark.parametrize("memory_variant", ["extend", "rows"])
@pytest.mark.parametrize("loss_class", [RaMBORecallLoss, RaMBOAPLoss])
def test_a_tuple_of_every_pair_but_self_ranks_as_the_batch_does(loss_class, memory_variant):
    """What PML's CrossBatchMemory passes: against the batch given as ref_emb with other
    labels (so not recognised as the batch), the tuple leaves out each query's own entry.
    Two steps with a memory of one batch, so stored references take part."""
    in_batch, with_tuple = (loss_class(memory_size=1, memory_variant=memory_variant) for _ in range(2))
    for step in range(2):
        embeddings, labels = batch(seed=step)
        expected = value_and_grad(lambda e: in_batch(e, labels), embeddings)
        tuple_ = every_pair_but_self(labels)
        got = value_and_grad(lambda e: with_tuple(e, labels, tuple_, e, labels.clone()), embeddings)
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)


def test_a_tuple_gives_the_per_pair_losses_their_reference_indices():
    embeddings, labels = batch()
    loss = RaMBORecallLoss(memory_size=0, reducer=reducers.DoNothingReducer())
    expected = loss(embeddings, labels)["loss"]
    got = loss(embeddings, labels, every_pair_but_self(labels), embeddings, labels.clone())["loss"]
    for a, b in zip(got["indices"], expected["indices"]):
        assert torch.equal(a, b)
    torch.testing.assert_close(got["losses"], expected["losses"])


def test_pml_reducer_sees_per_pair_losses():
    embeddings, labels = batch()
    mean = RaMBORecallLoss(memory_size=0)(embeddings, labels)
    summed_loss = RaMBORecallLoss(memory_size=0, reducer=reducers.SumReducer())
    summed = summed_loss(embeddings, labels)
    assert summed.item() == pytest.approx(mean.item() * summed_loss.num_pos_pairs)


@pytest.mark.parametrize("k", [0.25, 4.0])
@pytest.mark.parametrize("loss_class", [RaMBORecallLoss, RaMBOAPLoss])
def test_loss_weights_scale_the_gradient_not_lambda(loss_class, k):
    embeddings, labels = batch(seed=5)
    loss = loss_class(memory_size=0)
    _, plain = value_and_grad(lambda e: loss(e, labels), embeddings)
    _, weighted = value_and_grad(lambda e: k * loss(e, labels), embeddings)
    assert torch.allclose(weighted, k * plain, atol=1e-12)


def test_registered_and_installed_under_their_names():
    assert pml_rank.registry.losses()["RaMBORecallLoss"] is RaMBORecallLoss
    assert pml_rank.registry.losses()["RaMBOAPLoss"] is RaMBOAPLoss


def test_recall_loss_trains_inside_pml_metric_loss_only():
    """A PML trainer with a loss weight (which must not shift λ) and the memory on:
    the recall loss of the whole data set goes down."""
    gen = torch.Generator().manual_seed(0)
    labels = torch.arange(8).repeat_interleave(16)
    data = (torch.randn(8, 16, generator=gen) * 2)[labels] + torch.randn(len(labels), 16, generator=gen) * 1.5
    dataset = torch.utils.data.TensorDataset(data, labels)
    torch.manual_seed(0)
    trunk = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    evaluate = RaMBORecallLoss(memory_size=0)

    def full_loss():
        with torch.no_grad():
            return evaluate(trunk(data), labels).item()

    before = full_loss()
    trainer = trainers.MetricLossOnly(
        models={"trunk": trunk, "embedder": torch.nn.Identity()},
        optimizers={"trunk_optimizer": torch.optim.Adam(trunk.parameters(), lr=1e-2)},
        batch_size=32,
        loss_funcs={"metric_loss": RaMBORecallLoss(memory_size=3)},
        loss_weights={"metric_loss": 2.0},
        dataset=dataset,
        dataloader_num_workers=0,
    )
    trainer.train(num_epochs=4)
    assert full_loss() < 0.8 * before


# DistributedLossWrapper: λ must mean the same with and without it.


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_wrapper_in_a_single_process_group_changes_nothing():
    embeddings, labels = batch(seed=6)
    plain = value_and_grad(lambda e: RaMBORecallLoss(memory_size=0)(e, labels), embeddings)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        wrapped = value_and_grad(
            lambda e: DistributedLossWrapper(RaMBORecallLoss(memory_size=0))(e, labels), embeddings
        )
    finally:
        dist.destroy_process_group()
    assert torch.equal(plain[0], wrapped[0]) and torch.equal(plain[1], wrapped[1])


def _two_steps(loss, batches, rank=None, world_size=1):
    """Runs two training steps; returns each step's loss and gradient of this process's
    part of the batch."""
    results = []
    for embeddings, labels in batches:
        if rank is not None:
            embeddings, labels = embeddings.chunk(world_size)[rank], labels.chunk(world_size)[rank]
        embeddings = embeddings.clone().requires_grad_()
        value = loss(embeddings, labels)
        value.backward()
        results.append((value.detach(), embeddings.grad))
    return results


LOSS_CLASSES = (RaMBORecallLoss, RaMBOAPLoss)


def _distributed_worker(rank, world_size, port, batches, out):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        for loss_class in LOSS_CLASSES:
            loss = DistributedLossWrapper(loss_class(memory_size=1))
            torch.save(_two_steps(loss, batches, rank, world_size), f"{out}/{loss_class.__name__}-{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_two_processes_equal_one_process_on_the_whole_batch(tmp_path):
    """Each process's gradient, averaged over processes as DDP does, equals one process's
    gradient on the whole batch: λ is not multiplied by the world size. Two steps, so
    the memory takes part too."""
    world_size = 2
    batches = [batch(24, seed=30), batch(24, seed=31)]
    mp.spawn(_distributed_worker, args=(world_size, free_port(), batches, str(tmp_path)), nprocs=world_size, join=True)
    for loss_class in LOSS_CLASSES:
        one_process = _two_steps(loss_class(memory_size=1), batches)
        per_rank = [torch.load(tmp_path / f"{loss_class.__name__}-{rank}.pt") for rank in range(world_size)]
        for step, (value, grad) in enumerate(one_process):
            for rank in range(world_size):
                # PML's wrapper returns world_size × the loss of the gathered batch.
                assert torch.allclose(per_rank[rank][step][0], world_size * value, atol=1e-12)
            averaged = torch.cat([per_rank[rank][step][1] / world_size for rank in range(world_size)])
            assert torch.allclose(averaged, grad, atol=1e-12)
        # The check can fail: one process with λ × world_size gives other gradients.
        doubled = _two_steps(loss_class(memory_size=1, lambda_val=0.2 * world_size), batches)
        assert not torch.allclose(doubled[0][1], one_process[0][1], atol=1e-6)


# `pml-rank speed` wiring and the Table 6 example.


def test_speed_cases_run_with_their_references():
    recall = speed.measure("RaMBORecallLoss", sizes=(16,), dim=8, repeats=1, warmup=0, progress=False)
    ap = speed.measure("RaMBOAPLoss", sizes=(1000,), repeats=1, warmup=0, progress=False)
    assert set(recall["rows"][0]["seconds"]) == {"ours", "reference", "floor"}
    assert set(ap["rows"][0]["seconds"]) == {"ours", "reference", "floor"}
    assert ap["size_name"] == "scores"


def test_table6_example_runs_in_smoke_mode(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("rambo_speed_table6", ROOT / "examples" / "rambo_speed_table6.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    threads = torch.get_num_threads()
    try:
        assert example.main(["--smoke", "--out", str(tmp_path)]) == 0
    finally:
        torch.set_num_threads(threads)
        speed.CASES.pop(example.CASE, None)
    out = capsys.readouterr().out
    assert "paper CPU" in out and "ours / reference" in out
    assert (tmp_path / "rambo_table6.json").exists() and (tmp_path / "rambo_table6.png").exists()


def test_memory_is_invisible_to_pml_logging_hooks_but_saved_by_state_dict(tmp_path):
    """PML's record-keeper hooks record every tensor in a loss's buffers each logged
    iteration; the memory must not be among them (they cannot record an empty one)."""
    from pytorch_metric_learning.utils import logging_presets

    from pml_rank.harness.evaluation.training import make_record_keeper

    class _Trainer:  # just what end_of_iteration_hook reads
        def __init__(self, loss):
            self.iteration = 0
            self.loss_funcs = {"metric_loss": loss}
            self.mining_funcs, self.models, self.optimizers = {}, {}, {}
            self.loss_tracker = type("T", (), {"losses": {"total_loss": 0.5}, "loss_weights": {}})()

        def get_global_iteration(self):
            return 1

    for memory_size, calls in [(0, 1), (2, 3)]:
        loss = RaMBORecallLoss(memory_size=memory_size)
        for seed in range(calls):
            loss(*batch(seed=seed))
        keeper = make_record_keeper(tmp_path / str(memory_size))
        logging_presets.HookContainer(keeper, log_freq=1).end_of_iteration_hook(_Trainer(loss))
        recorded = str(dict(keeper.record_writer.records))
        assert "lambda_val" in recorded and "embeddings" not in recorded
        assert "memory._extra_state" in loss.state_dict()


def test_memory_variants_example_runs_in_smoke_mode(capsys):
    spec = importlib.util.spec_from_file_location(
        "rambo_memory_variants", ROOT / "examples" / "rambo_memory_variants.py"
    )
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    threads = torch.get_num_threads()
    try:
        assert example.main(["--smoke"]) == 0
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert all(f"| {label} |" in out for label in ["floor", "no-memory", "rows", "extend"])


# An exactly zero gradient on a batch with something to learn is reported, once.


@pytest.fixture
def fresh_warnings(monkeypatch):
    """A process that has not warned about any RaMBO setting yet (it warns once per process
    for each)."""
    monkeypatch.setattr(rambo, "_warned_settings", set())


def collapsed_batch(seed, size=32, dim=64):
    """Embeddings around one direction, as from an untrained pooled-ReLU trunk: cosine
    similarities 0.998-0.9998, all within the default margin (0.02) of one another."""
    direction = torch.nn.functional.normalize(torch.randn(dim, generator=torch.Generator().manual_seed(0)), dim=0)
    noise = torch.randn(size, dim, generator=torch.Generator().manual_seed(seed))
    return (direction + 0.03 * noise / dim**0.5).requires_grad_(), torch.arange(size) // 4


def test_collapsed_embeddings_warn_once_that_the_gradient_is_zero(fresh_warnings):
    loss = RaMBORecallLoss()
    similarities = torch.nn.functional.normalize(collapsed_batch(0)[0].detach(), dim=1)
    similarities = (similarities @ similarities.T)[~torch.eye(32, dtype=torch.bool)]
    assert 0.998 < similarities.min() and similarities.max() - similarities.min() < loss.margin
    with pytest.warns(ZeroRankGradientWarning) as caught:
        for seed in range(2 * ZERO_GRADIENT_CALLS):
            embeddings, labels = collapsed_batch(seed)
            value = loss(embeddings, labels)
            value.backward()
            assert value.item() > 0 and not embeddings.grad.any()
            assert len(caught) == (seed + 1 >= ZERO_GRADIENT_CALLS)  # once, after enough calls
    message = str(caught[0].message)
    assert message.startswith("RaMBORecallLoss: the loss is positive but its gradient has been exactly zero 5 calls")
    assert "lambda_val=0.2" in message and "margin (0.02)" in message and "Raise lambda_val" in message


def test_a_new_loss_with_the_same_settings_does_not_warn_again(fresh_warnings):
    """The bench makes a loss for each fold model: the untuned RaMBOAPLoss row printed the
    same paragraph for 10 of its 12 models."""

    def warnings_of(loss):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for seed in range(2 * ZERO_GRADIENT_CALLS):
                loss(*collapsed_batch(seed)).backward()
        return [w for w in caught if issubclass(w.category, ZeroRankGradientWarning)]

    assert len(warnings_of(RaMBORecallLoss())) == 1
    assert len(warnings_of(RaMBORecallLoss())) == 0  # the same settings: said already
    assert len(warnings_of(RaMBORecallLoss(margin=0.015))) == 1  # other settings: other advice


def test_only_zero_gradients_in_a_row_warn(fresh_warnings):
    loss = RaMBORecallLoss(memory_size=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for step in range(3 * ZERO_GRADIENT_CALLS):
            loss.lambda_val = 4.0 if step % ZERO_GRADIENT_CALLS == ZERO_GRADIENT_CALLS - 1 else 0.2
            embeddings, labels = collapsed_batch(step)
            loss(embeddings, labels).backward()
            assert embeddings.grad.any() == (loss.lambda_val == 4.0)
    loss.lambda_val = 0.2
    with pytest.warns(ZeroRankGradientWarning):
        for step in range(ZERO_GRADIENT_CALLS):
            loss(*collapsed_batch(step)).backward()


@pytest.mark.parametrize("kwargs", [dict(lambda_val=4.0, memory_size=0), dict(lambda_val=16.0), dict(margin=0.0)])
def test_what_the_warning_advises_moves_collapsed_embeddings(kwargs):
    """λ = 4 as in the issue (without a memory; the default memory of 3 batches shares the
    gradient among 4 times the pairs and needs about 16), or no margin."""
    loss = RaMBORecallLoss(**kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for seed in range(2 * ZERO_GRADIENT_CALLS):
            embeddings, labels = collapsed_batch(seed)
            loss(embeddings, labels).backward()
            assert embeddings.grad.any()


def test_the_ap_loss_warns_when_its_gradient_stays_zero(fresh_warnings):
    """Random batches of 32 with the default memory: the AP loss's perturbation, shared
    among 4 times the rows, moves no rank from the third call on."""
    loss = RaMBOAPLoss()
    with pytest.warns(ZeroRankGradientWarning, match="RaMBOAPLoss: .* exactly zero 5 calls in a row"):
        for seed in range(2 * ZERO_GRADIENT_CALLS):
            embeddings, labels = batch(seed=seed)
            loss(embeddings.requires_grad_(), labels).backward()


def clustered_batch(seed, size=64, dim=16, per_class=4):
    """Classes around their own centres, as a network in training embeds them."""
    labels = torch.arange(size) // per_class
    centres = torch.randn(size // per_class, dim, generator=torch.Generator().manual_seed(100), dtype=torch.float64)
    noise = torch.randn(size, dim, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return (centres[labels] + noise).requires_grad_(), labels


@pytest.mark.parametrize("loss_class", [RaMBORecallLoss, RaMBOAPLoss])
def test_no_warning_on_ordinary_batches_or_with_nothing_to_learn(loss_class):
    loss = loss_class()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for seed in range(6):
            embeddings, labels = clustered_batch(seed)
            loss(embeddings, labels).backward()
            assert embeddings.grad.abs().sum() > 0
        # One class: no negative, a zero gradient and nothing to warn about.
        one_class = collapsed_batch(9, size=64)[0]
        loss(one_class, torch.zeros(64, dtype=torch.long)).backward()
        assert not one_class.grad.any()
