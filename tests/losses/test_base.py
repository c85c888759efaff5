import pytest
import torch
from aten_counts import OperationNames
from loss_checks import assert_same_loss_and_gradients, seeded
from pytorch_metric_learning.reducers import MeanReducer, MultipleReducers

from pml_rank._checks import check_embeddings
from pml_rank.losses import NPairsMCLoss
from pml_rank.losses.base import RankLossBase, SumOfReducers


class _Toy(RankLossBase):
    def compute_loss(self, embeddings, labels, indices_tuple, ref_emb, ref_labels):
        return {"loss": {"losses": embeddings.sum(), "indices": None, "reduction_type": "already_reduced"}}


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_embeddings_are_rejected_naming_loss_and_position(value):
    embeddings = torch.zeros(4, 3)
    embeddings[2, 1] = value
    with pytest.raises(
        ValueError, match=rf"_Toy: embeddings contains 1 NaN/Inf value\(s\), first at index \(2, 1\): {value}"
    ):
        _Toy()(embeddings, torch.arange(4))


def test_non_finite_ref_emb_is_rejected():
    ref = torch.zeros(3, 3)
    ref[0, 0] = float("nan")
    with pytest.raises(ValueError, match="_Toy: ref_emb"):
        _Toy()(torch.zeros(2, 3), torch.arange(2), ref_emb=ref, ref_labels=torch.arange(3))


def test_embeddings_and_ref_emb_are_checked_with_one_read_back(monkeypatch):
    """One read-back for both (on a GPU, one wait), their largest magnitudes in their own
    dtypes; a float64 one beyond float32's range read again alone."""
    embeddings, large = torch.ones(2, 3), torch.full((4, 3), 30000.0, dtype=torch.float16)
    lists, tolist = [], torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda tensor: lists.append(tensor) or tolist(tensor))
    with OperationNames() as counted:
        check_embeddings("Named", embeddings=embeddings, ref_emb=torch.ones(4, 3))
    assert counted.names["aten::_local_scalar_dense"] + len(lists) == 1
    check_embeddings("Named", embeddings=embeddings, ref_emb=large)  # finite, though its sum is not
    large[1, 1] = float("inf")
    with pytest.raises(ValueError, match=r"Named: ref_emb contains 1 NaN/Inf value\(s\), first at index \(1, 1\)"):
        check_embeddings("Named", embeddings=embeddings, ref_emb=large)
    huge = torch.full((2, 3), -1e300, dtype=torch.float64)  # finite, beyond float32's range
    assert check_embeddings("Named", embeddings=embeddings, ref_emb=huge) == {"embeddings": 1.0, "ref_emb": 1e300}
    assert check_embeddings("Named", embeddings=torch.tensor([[1.0, -3.0]]), ref_emb=None) == {"embeddings": 3.0}
    with OperationNames() as counted:  # the batch as its own references: checked once
        check_embeddings("Named", embeddings=embeddings, ref_emb=embeddings)
    assert counted.names["aten::aminmax"] == 1


def test_integer_embeddings_are_a_type_error():
    with pytest.raises(TypeError, match="Named: embeddings must be a floating-point tensor, got torch.int64"):
        check_embeddings("Named", embeddings=torch.zeros(2, 2, dtype=torch.long))


def test_finite_input_passes_through():
    assert _Toy()(torch.ones(2, 3), torch.arange(2)).item() == 6


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_finite_values_whose_sum_overflows_pass_the_check(dtype):
    # The check first sums the tensor; an overflowing sum falls back to the element-wise check.
    large = torch.full((4, 3), torch.finfo(dtype).max / 2, dtype=dtype)
    assert not torch.isfinite(large.sum())
    check_embeddings("Named", embeddings=large)
    large[3, 2] = float("nan")
    with pytest.raises(ValueError, match=r"Named: embeddings contains 1 NaN/Inf value\(s\), first at index \(3, 2\)"):
        check_embeddings("Named", embeddings=large)


def test_half_precision_is_computed_in_float32_and_the_gradient_keeps_the_input_dtype():
    seen = []

    class _Spy(_Toy):
        def compute_loss(self, embeddings, labels, indices_tuple, ref_emb, ref_labels):
            seen.append((embeddings.dtype, ref_emb is embeddings))
            gram = (embeddings @ ref_emb.T).sum()  # 1.08e6: beyond float16's 65504
            return {"loss": {"losses": gram, "indices": None, "reduction_type": "already_reduced"}}

    for dtype in (torch.float16, torch.bfloat16):
        embeddings = torch.full((2, 3), 300.0, dtype=dtype, requires_grad=True)
        loss = _Spy()(embeddings, torch.arange(2))
        assert loss.dtype == torch.float32 and torch.isfinite(loss)
        loss.backward()
        assert embeddings.grad.dtype == dtype
    assert seen == [(torch.float32, True), (torch.float32, True)]


def test_a_loss_that_overflows_on_finite_input_is_an_error_naming_the_scale():
    class _Gram(_Toy):
        def compute_loss(self, embeddings, labels, indices_tuple, ref_emb, ref_labels):
            gram = (embeddings @ ref_emb.T).sum()
            return {"loss": {"losses": gram, "indices": None, "reduction_type": "already_reduced"}}

    embeddings = torch.full((2, 3), 1e20)
    with pytest.raises(ValueError, match=r"_Gram: the loss overflowed to inf .* largest norm is 1\.73e\+20"):
        _Gram()(embeddings, torch.arange(2))
    assert torch.isfinite(_Gram()(embeddings / 1e20, torch.arange(2)))


def test_several_sub_losses_are_summed_without_pmls_buffer():
    """Where PML builds a MultipleReducers itself (N-pair's own L2 regularizer, a reducer
    given for every sub-loss), the rank losses take `SumOfReducers`: PML's sum, value and
    gradients, in fewer operations; a MultipleReducers given by the user stays as given."""
    embeddings, labels = seeded(32, seed=2), torch.arange(32) // 4
    given = MultipleReducers({"loss": MeanReducer()})
    assert NPairsMCLoss(reducer=given).reducer is given
    for reducer in (None, MeanReducer()):
        ours = NPairsMCLoss(reducer=reducer)
        assert type(ours.reducer) is SumOfReducers and set(ours.reducer.reducers) == {"loss", "embedding_reg_loss"}
        pmls = NPairsMCLoss(reducer=MultipleReducers(dict(ours.reducer.reducers)))
        counts = []
        for loss in (ours, pmls):
            with OperationNames() as operations:
                loss(embeddings, labels).backward(retain_graph=True)
            counts.append(sum(operations.names.values()))
        assert_same_loss_and_gradients(ours(embeddings, labels), pmls(embeddings, labels), (embeddings,))
        assert counts[0] < counts[1] - 5, counts


def test_unit_rows_are_f_normalize_with_its_gradient():
    """`base.normalized`: F.normalize's rows and, by hand, its gradient (gradcheck in
    float64; equal to autograd's through F.normalize, rows whose norm is clamped, a zero
    row and one below eps, included); a distance that normalises otherwise keeps its own
    normalisation."""
    from pytorch_metric_learning.distances import CosineSimilarity, LpDistance

    from pml_rank.losses.base import _UnitRows, normalized

    x = torch.randn(6, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    assert torch.autograd.gradcheck(lambda t: _UnitRows.apply(t, 1e-12), (x.clone().requires_grad_(),))
    x[1] = 0
    x[2] *= 1e-13
    x.requires_grad_()
    torch.testing.assert_close(normalized(CosineSimilarity(), x), torch.nn.functional.normalize(x, dim=1))
    grad = torch.randn(6, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    (ours,) = torch.autograd.grad(normalized(CosineSimilarity(), x), x, grad)
    (theirs,) = torch.autograd.grad(torch.nn.functional.normalize(x, dim=1), x, grad)
    torch.testing.assert_close(ours, theirs)
    l1 = LpDistance(p=1)
    assert torch.equal(normalized(l1, x), torch.nn.functional.normalize(x, p=1, dim=1))


class _Bounded(_Toy):
    finite_for_bounded_scores = True


def _loss_read_backs(loss, embeddings, monkeypatch, autocast=None):
    """How many times `loss` reads its own value back: its calls of `Tensor.item` (the input
    check reads with `float` and `tolist`)."""
    reads, item = [], torch.Tensor.item
    monkeypatch.setattr(torch.Tensor, "item", lambda t: reads.append(t.dim()) or item(t))
    with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
        loss(embeddings, torch.arange(len(embeddings)))
    monkeypatch.undo()
    return len(reads)


def test_the_loss_is_read_back_to_be_checked_only_where_the_embeddings_could_make_it_overflow(monkeypatch):
    """A loss that says `finite_for_bounded_scores` is read back only where the scores could
    exceed 2^20 (2^10 for a float16 product): never for normalised rows (cosine similarity),
    for raw dot products or distances by the embeddings' largest magnitude m (dim (2m)^2), and
    always with an embedding regularizer on raw rows, another distance, or a loss that does
    not say so."""
    from pytorch_metric_learning.distances import CosineSimilarity, DotProductSimilarity, LpDistance, SNRDistance
    from pytorch_metric_learning.regularizers import LpRegularizer

    dim = 4
    at_the_bound = (2.0**20 / dim) ** 0.5 / 2  # dim (2m)^2 = 2^20
    rows = torch.full((3, dim), at_the_bound)
    raw = DotProductSimilarity(normalize_embeddings=False)
    assert _loss_read_backs(_Bounded(distance=CosineSimilarity()), rows * 1e30, monkeypatch) == 0
    assert _loss_read_backs(_Bounded(distance=raw), rows, monkeypatch) == 0
    assert _loss_read_backs(_Bounded(distance=raw), rows * 1.01, monkeypatch) == 1
    assert _loss_read_backs(_Bounded(distance=LpDistance(normalize_embeddings=False, power=2)), rows, monkeypatch) == 0
    assert _loss_read_backs(_Bounded(distance=LpDistance(p=1)), rows, monkeypatch) == 1
    assert _loss_read_backs(_Bounded(distance=SNRDistance()), rows / 1e6, monkeypatch) == 1
    regularized = _Bounded(distance=CosineSimilarity(), embedding_regularizer=LpRegularizer())
    assert _loss_read_backs(regularized, rows, monkeypatch) == 0
    assert _loss_read_backs(regularized, rows * 2, monkeypatch) == 1
    assert _loss_read_backs(_Toy(distance=CosineSimilarity()), rows, monkeypatch) == 1
    # A float16 product under autocast: 2^10; bfloat16 has float32's range.
    small = rows * 2**-5  # dim (2m)^2 = 2^10
    assert _loss_read_backs(_Bounded(distance=raw), small, monkeypatch, autocast=torch.bfloat16) == 0
    assert _loss_read_backs(_Bounded(distance=raw), small, monkeypatch, autocast=torch.float16) == 0
    assert _loss_read_backs(_Bounded(distance=raw), small * 1.01, monkeypatch, autocast=torch.float16) == 1
    assert _loss_read_backs(_Bounded(distance=raw), small * 1.01, monkeypatch, autocast=torch.bfloat16) == 0


def test_every_loss_that_skips_the_check_is_finite_with_scores_at_the_bound():
    """What `finite_for_bounded_scores` promises, held for every registered loss that says it:
    raw dot products of rows whose scores reach 2^20 (the same rows normalised, for a loss that
    takes its own distance alone), ties and all, give a finite loss and a finite gradient."""
    from pytorch_metric_learning.distances import DotProductSimilarity

    from pml_rank.plugins import registry

    checked = []
    dim = 8
    largest = (2.0**20 / dim) ** 0.5 / 2
    for name, loss_class in sorted(registry.losses().items()):
        if not getattr(loss_class, "finite_for_bounded_scores", False):
            continue
        signs = torch.randint(0, 2, (32, dim), generator=torch.Generator().manual_seed(1)) * 2 - 1
        embeddings = (signs * largest).float().requires_grad_()
        try:
            loss = loss_class(distance=DotProductSimilarity(normalize_embeddings=False))
            value = loss(embeddings, torch.arange(32) // 4)
        except AssertionError:  # PML's check of a loss that takes its own distance alone (FastAP's unit rows)
            loss = loss_class()
            value = loss(embeddings, torch.arange(32) // 4)
        value.backward()
        assert torch.isfinite(value) and torch.isfinite(embeddings.grad).all(), name
        checked.append(name)
    assert len(checked) >= 10, checked
