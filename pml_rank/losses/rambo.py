"""RaMBO losses for in-batch retrieval (Rolínek et al., *Optimizing Rank-Based Metrics
with Blackbox Differentiation*, CVPR 2020): the recall loss (eq. 16-20) and the AP loss
(eq. 21-22), with margin (eq. 14-15) and score memory (sec. 4.3).

Each query (embedding) ranks every reference by similarity: the batch itself without
the query, or `ref_emb` when given. The score memory of the last `memory_size` batches
takes part in one of two ways (`memory_variant`, see `RaMBORecallLoss`). Ranks come
from `pml_rank.ranking` and are differentiated by Algorithm 1.

Defaults are the paper's CUB-200 values: λ = 0.2 and margin 0.02 (Table 9), a memory of
3 batches (appendix A), kept as the authors' code keeps it ("rows"). λ means the same
whatever multiplies the loss (world size in `DistributedLossWrapper`, trainers' loss
weights): see `pml_rank.ranking`.
"""

import math
import warnings
from collections import deque

import torch
from pytorch_metric_learning.distances import CosineSimilarity, DotProductSimilarity
from pytorch_metric_learning.utils import common_functions as c_f
from torch.autograd.function import once_differentiable

from .. import fused_counts
from .._checks import check_numbers
from ..ranking import (
    LossScale,
    PositiveCounts,
    blackbox_ranks_of_positives,
    positive_counts,
    precision_at_positives,
    true_indices,
)
from . import fused_without_self
from .base import RankLossBase, normalized_with_distance_stats, pair_masks, reference_is_batch, symmetrize_
from .query_panels import true_rows


class ScoreMemory(torch.nn.Module):
    """The last `size` batches (0: none), each a tuple of detached tensors, oldest
    first. A module so that ``state_dict()`` saves it (as extra state) and ``.to()``
    moves it; kept in a deque rather than in buffers, which PML's logging hooks
    would record at every logged iteration."""

    def __init__(self, size, owner):
        super().__init__()
        if size < 0:
            raise ValueError(f"{owner}: memory_size must be an integer >= 0, got {size!r}")
        self.size, self.owner = int(size), owner
        self.batches = deque(maxlen=self.size)

    def __len__(self):
        return len(self.batches)

    def check_width(self, what, width, stored_width):
        """Raise ValueError when the current batch's `width` differs from the stored batches'."""
        if self.batches and width != stored_width:
            raise ValueError(
                f"{self.owner}: {what} {width} differs from the {stored_width} stored in the memory; "
                "call reset_memory() first"
            )

    def append(self, *tensors):
        self.batches.append(tuple(t.detach() for t in tensors))

    def stored(self):
        """Each of the stored tensors concatenated over the batches (oldest first)."""
        return tuple(torch.cat(field) for field in zip(*self.batches))

    def reset(self):
        self.batches.clear()

    def get_extra_state(self):
        return list(self.batches)

    def set_extra_state(self, state):
        self.batches = deque(state, maxlen=self.size)

    def _apply(self, fn, *args, **kwargs):
        self.batches = deque((tuple(fn(t) for t in batch) for batch in self.batches), maxlen=self.size)
        return super()._apply(fn, *args, **kwargs)

    def extra_repr(self):
        return f"size={self.size}, stored_batches={len(self)}"


MEMORY_VARIANTS = ("extend", "rows")


class ZeroRankGradientWarning(UserWarning):
    """A RaMBO loss had something to learn, but Algorithm 1 gave an exactly zero gradient
    ZERO_GRADIENT_CALLS times in a row."""


# Consecutive calls with an exactly zero gradient before the warning: at the papers' λ a
# small batch now and then moves no rank; a network that never moves gives one every call.
ZERO_GRADIENT_CALLS = 5

# The settings (loss, λ, margin, memory) this process has warned about: a loss made anew for
# each model (the bench's fold models) would repeat the same paragraph model after model.
_warned_settings = set()


class _RaMBOLoss(RankLossBase):
    finite_for_bounded_scores = True  # see RankLossBase

    def __init__(self, lambda_val: float, margin: float, memory_size: int, memory_variant: str, **kwargs):
        super().__init__(**kwargs)
        owner = type(self).__name__
        check_numbers(owner, "> 0", lambda_val=lambda_val)
        check_numbers(owner, ">= 0", margin=margin)
        if memory_variant not in MEMORY_VARIANTS:
            raise ValueError(f"{owner}: memory_variant must be 'extend' or 'rows', got {memory_variant!r}")
        self.lambda_val = float(lambda_val)
        self.margin = float(margin)
        self.memory = ScoreMemory(memory_size, owner=owner)
        self.memory_size = self.memory.size
        self.memory_variant = memory_variant
        self.add_to_recordable_attributes(list_of_names=["lambda_val", "margin", "memory_size"], is_stat=False)
        self.add_to_recordable_attributes(list_of_names=["num_pos_pairs"], is_stat=True)
        self._loss_scale = None
        self._watched = None
        self._zero_gradient_calls = 0
        self._warned_zero_gradient = False

    def get_default_distance(self):
        return CosineSimilarity()

    def reset_memory(self):
        self.memory.reset()

    def forward(self, embeddings, labels=None, indices_tuple=None, ref_emb=None, ref_labels=None):
        # The scale probe sits on the final loss, after the reducer and any regularizer.
        self._loss_scale = LossScale()
        self._watched = None
        loss = super().forward(embeddings, labels, indices_tuple, ref_emb, ref_labels)
        if self._watched is not None:
            scores, something_to_learn = self._watched
            self._watched = None
            scores.register_hook(self._zero_gradient_check(self._loss_scale, something_to_learn))
        return self._loss_scale.attach(loss) if torch.is_tensor(loss) else loss

    def watch_gradient(self, scores, something_to_learn):
        """Have the backward pass count the calls whose batch has `something_to_learn` (a
        function returning a bool tensor: a negative ranks above a positive; called only
        when no rank moved, rarely) but in which Algorithm 1, ranking `scores`, moves no
        rank (an exactly zero gradient), and warn after ZERO_GRADIENT_CALLS of them in a
        row: once per loss object, and once per process for its settings."""
        if scores.requires_grad and not self._warned_zero_gradient:
            self._watched = (scores, something_to_learn)

    def _zero_gradient_check(self, loss_scale, something_to_learn):
        # A hook on the ranked scores runs after the ranker's backward, which set ranks_moved.
        def check(_grad):
            if self._warned_zero_gradient or (moved := loss_scale.ranks_moved) is None:
                return
            stuck = not moved and bool(something_to_learn())
            self._zero_gradient_calls = self._zero_gradient_calls + 1 if stuck else 0
            if self._zero_gradient_calls >= ZERO_GRADIENT_CALLS:
                self._warned_zero_gradient = True
                settings = (type(self), self.lambda_val, self.margin, self.memory_size, self.memory_variant)
                if settings in _warned_settings:
                    return
                _warned_settings.add(settings)
                warnings.warn(
                    f"{type(self).__name__}: the loss is positive but its gradient has been exactly zero "
                    f"{ZERO_GRADIENT_CALLS} calls in a row: "
                    f"Algorithm 1's perturbation (lambda_val={self.lambda_val} times the loss's gradient) "
                    "moves no rank: the positives lie further below the negatives than it reaches. "
                    f"Typically all similarities lie within the margin ({self.margin}) of one another, which "
                    "puts every positive below every negative: collapsed embeddings, as from an untrained "
                    "network (cosine similarities 0.996-0.9996). Raise lambda_val (on such embeddings 4 "
                    "moves the recall loss without a score memory; a memory of 3 batches shares the gradient "
                    "among 4 times the pairs and needs about 16) or lower margin (0 moves it). "
                    "Warned once per process for these settings.",
                    ZeroRankGradientWarning,
                    stacklevel=2,
                )

        return check

    def compute_loss(self, embeddings, labels, indices_tuple, ref_emb, ref_labels):
        c_f.labels_required(labels)
        exclude_self = indices_tuple is None and reference_is_batch(labels, ref_labels)
        pairs = None if indices_tuple is None else (indices_tuple, len(ref_emb))
        if self.memory_variant == "rows" and self.memory.size > 0:
            return self.loss_with_stored_rows(embeddings, labels, ref_emb, ref_labels, exclude_self, pairs)
        # "extend", or no memory (then both variants are the paper's loss, through the reducer).
        all_refs, all_ref_labels = self.references_with_memory(ref_emb, ref_labels)
        self.memory.append(ref_emb, ref_labels)
        scores, positives, columns, counts = self.similarities(
            embeddings, labels, all_refs, all_ref_labels, exclude_self, pairs
        )
        indices, counts = positions_and_counts(positives, counts)
        self.num_pos_pairs = counts.total
        if self.num_pos_pairs == 0:
            return self.zero_losses()
        return self.losses_per_query(scores, positives, (indices, counts), exclude_self, columns)

    def loss_with_stored_rows(self, embeddings, labels, ref_emb, ref_labels, exclude_self, pairs=None):
        """The "rows" memory: the current score rows and the stored ones, each ranked on its
        own. A stored row's scores are constants, and so are its ranks: the memory keeps
        only what the loss reads from them (`mean_over_rows`), not the rows."""
        scores, positives, _, counts = self.similarities(embeddings, labels, ref_emb, ref_labels, exclude_self, pairs)
        rows, width = scores.shape
        # The shapes are CPU tensors: read without a kernel (or, moved to a GPU, a wait each).
        shapes = [shape.tolist() for _, shape in self.memory.batches]
        if shapes:
            self.memory.check_width("score row length", width, shapes[0][1])
            stored_values = torch.cat([values for values, _ in self.memory.batches]).to(scores)
        else:
            stored_values = scores.new_zeros(0)
        stored_rows = sum(stored for stored, _ in shapes)
        shape = torch.tensor([rows, width])
        indices, counts = positions_and_counts(positives, counts)
        self.num_pos_pairs = counts.total
        if self.num_pos_pairs == 0:
            self.memory.append(scores.new_zeros(0), shape)
            return self.zero_losses()
        loss, values = self.mean_over_rows(scores, positives, (indices, counts), stored_values, rows + stored_rows)
        self.memory.append(values, shape)
        return {"loss": {"losses": loss, "indices": None, "reduction_type": "already_reduced"}}

    def references_with_memory(self, ref_emb, ref_labels):
        """The references followed by the stored ones (detached); reads the memory only."""
        if not len(self.memory):
            return ref_emb, ref_labels
        self.memory.check_width("embedding size", ref_emb.shape[1], self.memory.batches[0][0].shape[1])
        stored_emb, stored_labels = self.memory.stored()
        return torch.cat([ref_emb, stored_emb.to(ref_emb)]), torch.cat([ref_labels, stored_labels.to(ref_labels)])

    def similarities(self, embeddings, labels, ref_emb, ref_labels, exclude_self, pairs=None):
        """Scores [queries, ranked references], the positive mask, with `pairs` the
        reference index of each column (otherwise None), and the mask's `PositiveCounts`
        where they are at hand (otherwise None). Without `pairs` every reference is ranked,
        except the query itself when the batch is its own reference set (see
        `without_self`); with them, see `similarities_of_pairs`."""
        if pairs is not None:
            return *self.similarities_of_pairs(embeddings, labels, ref_emb, ref_labels, *pairs), None
        # Every pair by label, read back before the similarities are queued (on a GPU the
        # wait is then for the labels' kernel alone).
        positives, counts = positives_by_label(labels, ref_labels, exclude_self)
        if exclude_self and ref_emb is embeddings and is_inner_product(self.distance):
            return self.inner_products_without_self(embeddings), positives, None, counts
        matrix = self.distance(embeddings, ref_emb)
        scores = matrix if self.distance.is_inverted else -matrix
        return (without_self(scores) if exclude_self else scores), positives, None, counts

    def inner_products_without_self(self, embeddings):
        """``without_self`` of the distance's matrix of the batch with itself, an inner
        product of the rows as the distance normalises them (`normalized_with_distance_stats`:
        F.normalize's gradient by hand), with its backward by hand."""
        queries, _ = normalized_with_distance_stats(self.distance, embeddings, embeddings)
        return _SimilaritiesWithoutSelf.apply(queries)

    def similarities_of_pairs(self, embeddings, labels, ref_emb, ref_labels, indices_tuple, given):
        """`similarities` with an `indices_tuple`: its pairs are the positives and negatives
        among the first `given` references (the rest, the memory's, count by label), and
        references in no pair are left out of the query's ranking. A ranking is normalised
        by its length, so every query must keep the same number of references."""
        matrix = self.distance(embeddings, ref_emb)
        scores = matrix if self.distance.is_inverted else -matrix
        positives, negatives = pair_masks(labels, ref_labels, indices_tuple, shape=scores.shape)
        positives[:, given:] = labels.unsqueeze(1) == ref_labels[given:].unsqueeze(0)
        ranked = positives | negatives
        ranked[:, given:] = True
        per_query = ranked.sum(1)
        if bool((per_query != per_query[0]).any()):
            raise ValueError(
                f"{type(self).__name__}: a ranking needs the same number of references for every query, "
                f"but the indices_tuple leaves {int(per_query.min())} to {int(per_query.max())}; take a tuple "
                "of every pair but some fixed number per query (PML's CrossBatchMemory leaves out each "
                "query's own copy) or none"
            )
        columns = ranked.nonzero()[:, 1].view(len(scores), -1)
        return scores.gather(1, columns), positives.gather(1, columns), columns


def positions_and_counts(positives, counts=None):
    """``positives.nonzero(as_tuple=True)`` and `ranking.positive_counts(positives)` (`counts`
    when at hand), what the ranking takes (`positions` below): one wait on a GPU, for the
    counts, which give the positions' number before they are found."""
    counts = positive_counts(positives) if counts is None else counts
    # Where the counting kernels run, strided columns of one tensor, which they read as they
    # are (and the loss's indices need no copy); the plain passes take them contiguous.
    contiguous = not fused_counts.applies(positives, (torch.bool,))
    return true_indices(positives, counts.total, contiguous), counts


def positives_by_label(labels, ref_labels, exclude_self):
    """The boolean [queries, references] mask of equal labels, without each query's own
    column when `exclude_self` (as `without_self` drops it), and its `PositiveCounts`: where
    Triton runs, one kernel makes and counts it (`fused_counts.label_positives`), else torch
    compares and the counts are left to `positions_and_counts` (None)."""
    if all(fused_counts.applies(t, _LABEL_DTYPES) and t.dim() == 1 and t.is_contiguous() for t in (labels, ref_labels)):
        mask, per_sequence, numbers = fused_counts.label_positives(labels, ref_labels, exclude_self)
        return mask, PositiveCounts(per_sequence, *numbers.tolist())
    positives = labels.unsqueeze(1) == ref_labels.unsqueeze(0)
    return (without_self(positives) if exclude_self else positives), None


# The label types `fused_counts.label_positives` reads (PML's labels are int64).
_LABEL_DTYPES = (torch.int64, torch.int32)


def is_inner_product(distance):
    """Whether `distance(x, y)` is the inner products of the (normalised) rows."""
    return type(distance) in (CosineSimilarity, DotProductSimilarity) and distance.power == 1


def without_self(matrix):
    """Drops entry (i, i) of every row of a [queries, references] matrix whose first
    columns are the queries themselves. Strided views instead of a boolean mask: in
    the flattened square block, the entries between two diagonal entries are one
    view row."""
    queries = len(matrix)
    square, rest = matrix[:, :queries], matrix[:, queries:]
    off_diagonal = _off_diagonal(square.flatten()).reshape(queries, queries - 1)
    return torch.cat([off_diagonal, rest], dim=1) if rest.shape[1] else off_diagonal


def _off_diagonal(flat_square):
    """The off-diagonal entries of a flattened n x n matrix, as an (n - 1) x n view."""
    n = math.isqrt(len(flat_square))
    return flat_square[1:].view(n - 1, n + 1)[:, :-1]


class _SimilaritiesWithoutSelf(torch.autograd.Function):
    """``without_self(q @ q.T)``, q the rows of `queries`. The backward pass is one matrix
    product, (G + Gᵀ) @ q, where autograd takes two, and writes G (zero diagonal) once,
    where autograd's slicing backward fills and copies twice; where Triton runs, G + Gᵀ in
    one kernel (`fused_without_self`)."""

    @staticmethod
    def forward(ctx, queries):
        ctx.save_for_backward(queries)
        return without_self(queries @ queries.T)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        (queries,) = ctx.saved_tensors
        if fused_without_self.applies(grad):
            return fused_without_self.symmetric_with_zero_diagonal(grad) @ queries
        return symmetric_with_zero_diagonal(grad) @ queries


def symmetric_with_zero_diagonal(grad):
    """G + Gᵀ [n, n], G the [n, n - 1] `grad` of `without_self`'s output with the diagonal put
    back as zeros."""
    n = len(grad)
    full = grad.new_empty(n, n)
    _off_diagonal(full.view(-1)).copy_(grad.reshape(n - 1, n))
    full.diagonal().zero_()
    return symmetrize_(full)


def reference_index(queries, columns, exclude_self):
    """Column index after `without_self` -> index into the references."""
    return columns + (columns >= queries) if exclude_self else columns


class RaMBORecallLoss(_RaMBOLoss):
    """Recall loss (eq. 20): the mean over positive pairs of ℓ(r) (`weighting="log"`) or
    ℓ(ℓ(r)) (`"loglog"`), ℓ(k) = log(1 + k), where r is the number of negatives ranked
    above the positive after the margin shift (eq. 14, 17).

    Args:
        lambda_val: interpolation strength λ of the blackbox gradient (Table 9: CUB-200
            0.2, In-shop 0.2, Online Products 4).
        margin: α; positives are shifted down and negatives up by α/2 (Table 9: CUB-200
            0.02, In-shop 0.05, Online Products 0.02).
        weighting: "log" (w_K ≈ 1/K) or "loglog" (w_K ≈ 1/(K log K)).
        memory_size: τ, the number of previous batches kept in the score memory
            (appendix A: 3; 0 disables it). Nothing stored receives a gradient.
        memory_variant: how the memory takes part (sec. 4.3 leaves it open; no part
            when memory_size is 0):

            - "rows" (the default; the authors' code, ``BatchMemoryRecallLoss``): the
              previous batches' score rows (each previous query against its own
              batch) are appended below the current rows as extra queries, every row
              is ranked on its own, and the loss is the mean of ℓ over the positive
              pairs of all rows, with r taken as (r / n) times the number of rows (n:
              the row length), as the authors denormalise it (also before the memory
              has filled). A stored row's r values are constants, so the memory keeps
              those, not the rows. Every batch must give rows of the same length (a
              changed length needs ``reset_memory()``; PML's trainers drop the last,
              shorter batch).
            - "extend" (the paper's text): the memory holds the previous batches'
              embeddings and labels; each current query ranks its references followed
              by the stored ones. Batches may change size. Slower (each query ranks
              (τ + 1) times as many references) and, on glyphs, less accurate.

    Per-pair losses go through PML's reducer (MeanReducer by default, the paper's mean
    over positive pairs), with indices (query, reference). With a "rows" memory the
    loss is that mean itself ("already_reduced"): stored rows have no indices in the
    current batch.
    """

    def __init__(
        self,
        lambda_val: float = 0.2,
        margin: float = 0.02,
        weighting: str = "log",
        memory_size: int = 3,
        memory_variant: str = "rows",
        **kwargs,
    ):
        super().__init__(lambda_val, margin, memory_size, memory_variant, **kwargs)
        if weighting not in ("log", "loglog"):
            raise ValueError(f"RaMBORecallLoss: weighting must be 'log' or 'loglog', got {weighting!r}")
        self.weighting = weighting
        self.add_to_recordable_attributes(list_of_names=["mean_negatives_above"], is_stat=True)

    def negatives_above(self, scores, positives, positions):
        """r per positive pair (eq. 17, after the margin shift; differentiable by Algorithm
        1), with its (row, column) index. `positions`: `positions_and_counts(positives)`."""
        (rows, columns), ranks, among_positives = blackbox_ranks_of_positives(
            scores, positives, self.lambda_val, self._loss_scale, *positions, margin=self.margin
        )
        # r = rank among all − rank among positives, as counts (the integers converted by the subtraction).
        negatives_above = ranks * scores.shape[-1] - among_positives
        counts = negatives_above.detach()
        self.watch_gradient(scores, lambda: (counts > 0.5).any())
        return negatives_above, rows, columns

    def weighted(self, negatives_above):
        """ℓ(r) or ℓ(ℓ(r)) (eq. 20)."""
        if self.collect_stats:  # a number read back: on a GPU, a wait
            self.mean_negatives_above = float(negatives_above.detach().mean()) if len(negatives_above) else 0.0
        losses = torch.log1p(negatives_above)
        return torch.log1p(losses) if self.weighting == "loglog" else losses

    def losses_per_query(self, scores, positives, positions, exclude_self, references=None):
        negatives_above, queries, columns = self.negatives_above(scores, positives, positions)
        if references is not None:  # the columns of an indices_tuple's pairs
            indices = (queries, references[queries, columns])
        else:
            indices = (queries, reference_index(queries, columns, exclude_self))
        return {"loss": {"losses": self.weighted(negatives_above), "indices": indices, "reduction_type": "pos_pair"}}

    def mean_over_rows(self, scores, positives, positions, stored_negatives_above, total_rows):
        """The mean of ℓ over the positive pairs of the current and the stored rows, r
        denormalised as the authors do: r / n times the number of rows. Returns it and
        this batch's r (to store)."""
        negatives_above = self.negatives_above(scores, positives, positions)[0]
        scale = total_rows / scores.shape[-1]
        loss = self.weighted(torch.cat([negatives_above, stored_negatives_above]) * scale).mean()
        return loss, negatives_above.detach()


class RaMBOAPLoss(_RaMBOLoss):
    """AP loss for in-batch retrieval (eq. 21-22): per query, 1 − the mean precision at
    its positives; queries without a positive are left out.

    Args:
        lambda_val, margin, memory_size: as for `RaMBORecallLoss`. The defaults are the
            retrieval values (Table 9, CUB-200, and appendix A); the paper used the AP
            loss for detection with λ = 0.5, margin 0.15 and τ = 7 on classifier scores
            (see `pml_rank.ranking.map_loss`), not on cosine similarities.
        memory_variant: "rows" (default) or "extend", as for `RaMBORecallLoss`. With
            "rows" the loss is 1 − AP averaged over all rows with a positive, current
            and stored (precision is a ratio of ranks, so no denormalisation enters).
            The authors' code has this memory for the recall loss; this applies the
            same construction.

    Per-query losses go through PML's reducer ("element" reduction, indices = queries);
    with a "rows" memory the loss is the mean itself ("already_reduced").
    """

    def __init__(
        self,
        lambda_val: float = 0.2,
        margin: float = 0.02,
        memory_size: int = 3,
        memory_variant: str = "rows",
        **kwargs,
    ):
        super().__init__(lambda_val, margin, memory_size, memory_variant, **kwargs)

    def losses_per_query(self, scores, positives, positions, exclude_self, references=None):
        precision, has_positive = self.precision(scores, positives, positions)
        queries = true_rows(has_positive, positions[1].sequences_with_one)
        if len(queries) < len(precision):
            precision = precision[queries]
        return {"loss": {"losses": 1 - precision, "indices": queries, "reduction_type": "element"}}

    def mean_over_rows(self, scores, positives, positions, stored_precisions, total_rows):
        """1 − the mean precision over the current and the stored rows with a positive;
        returns it and this batch's precisions (to store)."""
        precision, has_positive = self.precision(scores, positives, positions)
        if positions[1].sequences_with_one < len(precision):
            precision = precision[true_rows(has_positive, positions[1].sequences_with_one)]
        return 1 - torch.cat([precision, stored_precisions]).mean(), precision.detach()

    def precision(self, scores, positives, positions):
        """Per row: the mean precision at its positives (eq. 21) and whether it has one."""
        precision, has_positive = precision_at_positives(
            scores, positives, self.lambda_val, self.margin, self._loss_scale, *positions
        )
        # Precisions are ratios of counts up to n: below 1, they are at most 1 - 1/n.
        below_one = 1 - 0.5 / scores.shape[-1]
        detached = precision.detach()
        self.watch_gradient(scores, lambda: (detached[has_positive] < below_one).any())
        return precision, has_positive
