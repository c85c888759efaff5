"""FastAPLoss against PML's FastAPLoss and the loop-over-bins reference from the paper."""

import importlib.util
import json
import sys
import warnings
from pathlib import Path

import pytest
import torch
from pytorch_metric_learning import losses as pml_losses
from pytorch_metric_learning.utils import loss_and_miner_utils as lmu
from pytorch_metric_learning.utils.distributed import DistributedLossWrapper, get_indices_tuple

import pml_rank
from pml_rank import _device_policy
from pml_rank.harness.references import fastap as reference
from pml_rank.harness.speed import peak_memory
from pml_rank.losses import FastAPLoss


def batch(n=48, dim=16, classes=10, seed=0, dtype=torch.float64):
    generator = torch.Generator().manual_seed(seed)
    embeddings = torch.randn(n, dim, generator=generator, dtype=dtype).requires_grad_()
    labels = torch.randint(0, classes, (n,), generator=generator)
    return embeddings, labels


def assert_away_from_bin_edges(embeddings, num_bins, ref_emb=None, margin=1e-6):
    """The histograms are piecewise linear in the distances; their gradient is compared
    only where every distance lies strictly inside a bin."""
    q = torch.nn.functional.normalize(embeddings.detach(), dim=1)
    r = q if ref_emb is None else torch.nn.functional.normalize(ref_emb.detach(), dim=1)
    position = (2 - 2 * q @ r.T) * num_bins / 4
    if ref_emb is None:
        position.fill_diagonal_(0.5)
    assert ((position - position.round()).abs() > margin).all()


@pytest.mark.parametrize("num_bins", [1, 3, 10, 37])
def test_value_and_gradient_equal_reference_and_pml(num_bins):
    embeddings, labels = batch(seed=num_bins)
    assert_away_from_bin_edges(embeddings, num_bins)
    ours = FastAPLoss(num_bins)(embeddings, labels)
    (ours_grad,) = torch.autograd.grad(ours, embeddings)
    ref = reference.fast_ap_loss(embeddings, labels, num_bins=num_bins)
    (ref_grad,) = torch.autograd.grad(ref, embeddings)
    pml = pml_losses.FastAPLoss(num_bins)(embeddings, labels)
    (pml_grad,) = torch.autograd.grad(pml, embeddings)

    assert ours.dtype == torch.float64
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ours, pml, rtol=1e-12, atol=1e-12)
    assert ref_grad.abs().max() > 1e-4  # the comparison below is not trivially zero
    torch.testing.assert_close(ours_grad, ref_grad, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(ours_grad, pml_grad, rtol=1e-9, atol=1e-12)


def test_float32_matches_pml():
    embeddings, labels = batch(n=256, dim=32, classes=40, dtype=torch.float32)
    ours = FastAPLoss()(embeddings, labels)
    pml = pml_losses.FastAPLoss()(embeddings, labels)
    torch.testing.assert_close(ours, pml, rtol=1e-5, atol=1e-6)
    (ours_grad,) = torch.autograd.grad(ours, embeddings)
    (pml_grad,) = torch.autograd.grad(pml, embeddings)
    torch.testing.assert_close(ours_grad, pml_grad, rtol=1e-3, atol=1e-6)


def test_value_on_bin_edges_equals_pml_and_reference():
    # One-hot vectors: every distance is 0, 2 or 4, each exactly a bin centre for even
    # num_bins (weight 1 there, 0 on both neighbours).
    eye = torch.eye(4, dtype=torch.float64)
    embeddings = torch.cat([eye, eye, -eye[:2]]).requires_grad_()
    labels = torch.tensor([0, 1, 2, 3, 0, 2, 1, 3, 1, 2])
    for num_bins in (2, 4, 10):
        ours = FastAPLoss(num_bins)(embeddings, labels)
        torch.testing.assert_close(ours, pml_losses.FastAPLoss(num_bins)(embeddings, labels))
        torch.testing.assert_close(ours, reference.fast_ap_loss(embeddings, labels, num_bins=num_bins))


def test_perfect_and_reversed_rankings():
    # Positives on top of the query, negatives antipodal: AP = 1.
    e = torch.tensor([[1.0, 0.0]])
    perfect = torch.cat([e, e, e, -e, -e, -e])
    assert FastAPLoss()(perfect, torch.tensor([0, 0, 0, 1, 1, 1])).item() == pytest.approx(0.0, abs=1e-6)
    # Queries 0 and 1 each have one positive at distance 4, behind two negatives
    # (query 0: at distance 4 too, a tie in the last bin; query 1: at distance 0):
    # AP = 1 * 1 / 3 for both. Queries 2 and 3 have no positive.
    reversed_ = torch.cat([e, -e, -e, -e])
    loss = FastAPLoss()(reversed_, torch.tensor([0, 0, 1, 2]))
    assert loss.item() == pytest.approx(1 - 1 / 3, abs=1e-6)


def test_queries_without_positives_are_left_out():
    embeddings, labels = batch(n=30)
    labels = torch.arange(30) // 2
    labels[:7] = torch.arange(100, 107)  # seven singletons, and their former partners
    loss_func = FastAPLoss()
    loss_dict = loss_func.compute_loss(embeddings, labels, None, embeddings, labels)
    queries = loss_dict["loss"]["indices"]
    expected = [i for i in range(30) if (labels == labels[i]).sum() > 1]
    assert queries.tolist() == expected
    torch.testing.assert_close(loss_func(embeddings, labels), reference.fast_ap_loss(embeddings, labels))
    torch.testing.assert_close(loss_func(embeddings, labels), pml_losses.FastAPLoss()(embeddings, labels))


def test_no_positive_anywhere_gives_zero_losses():
    embeddings, labels = batch(n=12)
    labels = torch.arange(12)
    loss_func = FastAPLoss()
    assert loss_func.compute_loss(embeddings, labels, None, embeddings, labels) == loss_func.zero_losses()
    assert loss_func(embeddings, labels).item() == 0
    assert pml_losses.FastAPLoss()(embeddings, labels).item() == 0


def test_ref_emb_matches_reference_value_and_gradients():
    embeddings, labels = batch(n=20, seed=1)
    ref_emb, ref_labels = batch(n=35, seed=2)
    assert_away_from_bin_edges(embeddings, 10, ref_emb)
    ours = FastAPLoss()(embeddings, labels, ref_emb=ref_emb, ref_labels=ref_labels)
    ref = reference.fast_ap_loss(embeddings, labels, ref_emb, ref_labels)
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)
    for mine, theirs in zip(
        torch.autograd.grad(ours, (embeddings, ref_emb)), torch.autograd.grad(ref, (embeddings, ref_emb))
    ):
        torch.testing.assert_close(mine, theirs, rtol=1e-9, atol=1e-12)


def test_ref_emb_without_gradient_and_same_tensor_as_ref():
    embeddings, labels = batch(n=20, seed=3)
    ref_emb, ref_labels = batch(n=25, seed=4)
    ours = FastAPLoss()(embeddings, labels, ref_emb=ref_emb.detach(), ref_labels=ref_labels)
    ref = reference.fast_ap_loss(embeddings, labels, ref_emb.detach(), ref_labels)
    torch.testing.assert_close(torch.autograd.grad(ours, embeddings), torch.autograd.grad(ref, embeddings))
    # Passing the batch itself as the reference set is the same as passing nothing.
    torch.testing.assert_close(
        FastAPLoss()(embeddings, labels, ref_emb=embeddings, ref_labels=labels), FastAPLoss()(embeddings, labels)
    )


def test_all_pairs_indices_tuple_is_the_same_as_none():
    embeddings, labels = batch(seed=5)
    all_pairs = lmu.get_all_pairs_indices(labels)
    torch.testing.assert_close(FastAPLoss()(embeddings, labels, all_pairs), FastAPLoss()(embeddings, labels))


def test_mined_pairs_form_each_querys_retrieval_list():
    embeddings, labels = batch(seed=6)
    a1, p, a2, n = lmu.get_all_pairs_indices(labels)
    keep_pos = torch.arange(len(a1)) % 2 == 0
    keep_neg = torch.arange(len(a2)) % 3 == 0
    mined = (a1[keep_pos], p[keep_pos], a2[keep_neg], n[keep_neg])
    positive = torch.zeros(len(labels), len(labels), dtype=torch.bool)
    positive[mined[0], mined[1]] = True
    retrieved = positive.clone()
    retrieved[mined[2], mined[3]] = True
    ours = FastAPLoss()(embeddings, labels, mined)
    ref = reference.fast_ap_loss(embeddings, labels, positive=positive, retrieved=retrieved)
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(
        torch.autograd.grad(ours, embeddings), torch.autograd.grad(ref, embeddings), rtol=1e-9, atol=1e-12
    )


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_is_finite_and_close_to_float32(dtype):
    embeddings, labels = batch(n=300, dim=32, classes=30, dtype=torch.float32)
    low = embeddings.detach().to(dtype).requires_grad_()
    loss = FastAPLoss()(low, labels)
    (grad,) = torch.autograd.grad(loss, low)
    assert loss.dtype == torch.float32 and grad.dtype == dtype
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    same_input_in_float32 = low.detach().float()
    torch.testing.assert_close(loss, FastAPLoss()(same_input_in_float32, labels))


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_embeddings_are_a_value_error(value):
    embeddings, labels = batch(n=6)
    embeddings = embeddings.detach().clone()
    embeddings[3, 2] = value
    with pytest.raises(ValueError, match="FastAPLoss: embeddings contains 1 NaN/Inf"):
        FastAPLoss()(embeddings, labels)


@pytest.mark.parametrize("num_bins", [0, -3])
def test_bad_num_bins(num_bins):
    with pytest.raises(ValueError, match="FastAPLoss: num_bins must be a positive integer"):
        FastAPLoss(num_bins)


@pytest.mark.parametrize("num_bins", [2.5, "10", True, None])
def test_num_bins_of_another_type(num_bins):
    with pytest.raises(TypeError, match="FastAPLoss: num_bins must be an integer, got"):
        FastAPLoss(num_bins)


def test_labels_are_required():
    with pytest.raises(ValueError, match="labels are required"):
        FastAPLoss()(torch.randn(4, 3))


def test_peak_memory_is_a_few_matrices_whatever_num_bins():
    n = 1024
    embeddings, labels = batch(n=n, dim=8, classes=256, dtype=torch.float32)
    matrix = n * n * 4
    peaks = [peak_memory(FastAPLoss(num_bins), (embeddings, labels), torch.device("cpu")) for num_bins in (5, 100)]
    assert max(peaks) < 6 * matrix
    # 95 more bins cost only per-query histograms (n x bins), not 95 more n x n pulses.
    assert peaks[1] - peaks[0] < 2 * matrix


def test_peak_memory_on_an_accelerator_is_under_five_matrices(monkeypatch):
    """Under the accelerator's policy the whole matrix is one chunk, so each temporary of
    the histogram pass is an N x N matrix at once (6.7 matrices before the slots were
    computed in place); the issue's bound is 4 times the similarity product's own peak."""
    monkeypatch.setattr(_device_policy, "sized_for", lambda device: "memory")
    n = 512
    embeddings, labels = batch(n=n, dim=8, classes=128, dtype=torch.float32)
    peak = peak_memory(FastAPLoss(), (embeddings, labels), torch.device("cpu"))
    assert peak < 5 * n * n * 4, f"{peak / (n * n * 4):.2f} matrices"


def test_inside_distributed_loss_wrapper_single_process():
    embeddings, labels = batch(seed=7)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "non-distributed setting"
        wrapped = DistributedLossWrapper(FastAPLoss())(embeddings, labels)
    torch.testing.assert_close(wrapped, FastAPLoss()(embeddings, labels))


def test_registered_and_never_replacing_pmls_fast_ap():
    assert pml_rank.registry.losses()["FastAPLoss"] is FastAPLoss
    pml_fast_ap = pml_losses.FastAPLoss
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = pml_rank.install()
    for dotted in report["installed"]:  # leave PML's namespaces as they were
        module, name = dotted.rsplit(".", 1)
        delattr(sys.modules[module], name)
    assert "pytorch_metric_learning.losses.FastAPLoss" in report["clashes"]
    assert pml_losses.FastAPLoss is pml_fast_ap


def _example():
    path = Path(__file__).resolve().parents[2] / "examples" / "fastap_hierarchical_sampling.py"
    spec = importlib.util.spec_from_file_location("fastap_hierarchical_sampling", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_hierarchical_sampler_draws_categories_then_classes_then_samples():
    example = _example()
    args = example.parse_args(["--smoke"])
    data, classes, categories = example.synthetic_hierarchy(
        args.categories, args.classes_per_category, 2 * args.per_class, args.dim, seed=0
    )
    batches = list(example.hierarchical_batches(classes, categories, args))
    pairs = args.categories * (args.categories - 1) // 2
    assert len(batches) == pairs * args.batches_per_pair
    seen_pairs = set()
    for batch in batches:
        batch = torch.as_tensor(batch)
        assert len(batch) == args.batch_size
        batch_categories = categories[batch].unique()
        assert len(batch_categories) == args.categories_per_batch
        seen_pairs.add(tuple(batch_categories.tolist()))
        assert (classes[batch].bincount()[classes[batch].unique()] == args.per_class).all()
    assert len(seen_pairs) == pairs  # every pair of categories gets its batches


def test_example_smoke_run(tmp_path):
    results = _example().main(["--smoke", "--out", str(tmp_path)])
    assert (tmp_path / "fastap_sampling.png").stat().st_size > 0
    saved = json.loads((tmp_path / "fastap_sampling.json").read_text())
    hierarchical = saved["category-based (HierarchicalSampler)"]
    random_classes = saved["random classes (MPerClassSampler)"]
    # Category-based batches are made of hard (same-category) negatives.
    assert hierarchical["same_category_negative_share"] > random_classes["same_category_negative_share"]
    for result in (hierarchical, random_classes):
        assert 0 <= result["test_precision_at_1"] <= 1 and 0 <= result["final_loss"] <= 1
    assert results["args"]["smoke"] is True


def test_efficient_distributed_call_never_retrieves_the_query_itself():
    # What DistributedLossWrapper(efficient=True) does on each of 2 processes, minus the
    # all_gather: the process's queries against the gathered batch (its own part first)
    # with PML's all-pairs indices_tuple that leaves out self-comparisons.
    embeddings, labels = batch(n=24, classes=6, seed=11)
    for rank in range(2):
        mine, theirs = slice(rank * 12, (rank + 1) * 12), slice((1 - rank) * 12, (2 - rank) * 12)
        local = embeddings.detach()[mine].clone().requires_grad_()
        gathered = torch.cat([local, embeddings.detach()[theirs]])
        gathered_labels = torch.cat([labels[mine], labels[theirs]])
        indices_tuple = get_indices_tuple(labels[mine], gathered_labels)
        ours = FastAPLoss()(local, labels[mine], indices_tuple, gathered, gathered_labels)

        positive = labels[mine][:, None] == gathered_labels[None, :]
        retrieved = torch.ones_like(positive)
        positive[:, :12].fill_diagonal_(False)
        retrieved[:, :12].fill_diagonal_(False)
        expected = reference.fast_ap_loss(
            local, labels[mine], gathered, gathered_labels, positive=positive, retrieved=retrieved
        )
        torch.testing.assert_close(ours, expected)
        torch.testing.assert_close(torch.autograd.grad(ours, local), torch.autograd.grad(expected, local))
