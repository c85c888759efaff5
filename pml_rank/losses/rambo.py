"""RaMBO losses for in-batch retrieval (Rolínek et al., *Optimizing Rank-Based Metrics
with Blackbox Differentiation*, CVPR 2020): the recall loss (eq. 16-20) and the AP loss
(eq. 21-22), with margin (eq. 14-15) and score memory (sec. 4.3).

Each query (embedding) ranks every reference by similarity: the batch itself without
the query, or `ref_emb` when given. The score memory of the last `memory_size` batches
takes part in one of two ways (`memory_variant`, see `RaMBORecallLoss`). Ranks come
from `pml_rank.ranking` and are differentiated by Algorithm 1.

Defaults are the paper's CUB-200 values: λ = 0.2 and margin 0.02 (Table 9), a memory of
3 batches (appendix A). λ means the same whatever multiplies the loss (world size in
`DistributedLossWrapper`, trainers' loss weights): see `pml_rank.ranking`.
"""

from collections import deque

import torch
from pytorch_metric_learning.distances import CosineSimilarity
from pytorch_metric_learning.utils import common_functions as c_f

from ..ranking import LossScale, _check_lambda, blackbox_ranks_of_positives, precision_at_positives, shift_by_margin
from .base import RankLossBase, pair_masks, reference_is_batch


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

    def check_width(self, tensor, what):
        """Raise ValueError when `tensor`'s second dimension differs from the stored batches'."""
        if self.batches and self.batches[0][0].shape[1] != tensor.shape[1]:
            raise ValueError(
                f"{self.owner}: {what} {tensor.shape[1]} differs from the {self.batches[0][0].shape[1]} "
                "stored in the memory; call reset_memory() first"
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


class _RaMBOLoss(RankLossBase):
    def __init__(self, lambda_val: float, margin: float, memory_size: int, memory_variant: str, **kwargs):
        super().__init__(**kwargs)
        owner = type(self).__name__
        _check_lambda(owner, lambda_val)
        if not 0 <= margin < float("inf"):
            raise ValueError(f"{owner}: margin must be a finite number >= 0, got {margin!r}")
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

    def get_default_distance(self):
        return CosineSimilarity()

    def reset_memory(self):
        self.memory.reset()

    def forward(self, embeddings, labels=None, indices_tuple=None, ref_emb=None, ref_labels=None):
        # The scale probe sits on the final loss, after the reducer and any regularizer.
        self._loss_scale = LossScale()
        loss = super().forward(embeddings, labels, indices_tuple, ref_emb, ref_labels)
        return self._loss_scale.attach(loss) if torch.is_tensor(loss) else loss

    def compute_loss(self, embeddings, labels, indices_tuple, ref_emb, ref_labels):
        c_f.labels_required(labels)
        exclude_self = indices_tuple is None and reference_is_batch(labels, ref_labels)
        pairs = None if indices_tuple is None else (indices_tuple, len(ref_emb))
        if self.memory_variant == "extend":
            all_refs, all_ref_labels = self.references_with_memory(ref_emb, ref_labels)
            self.memory.append(ref_emb, ref_labels)
            scores, positives, columns = self.similarities(
                embeddings, labels, all_refs, all_ref_labels, exclude_self, pairs
            )
        else:
            scores, positives, columns = self.similarities(embeddings, labels, ref_emb, ref_labels, exclude_self, pairs)
            stored = self.memory.stored() if len(self.memory) else None
            if stored is not None:
                self.memory.check_width(scores, "score row length")
            self.memory.append(scores, positives)
        self.num_pos_pairs = int(torch.count_nonzero(positives))  # sum() copies bool to int64 first
        if self.num_pos_pairs == 0:
            return self.zero_losses()
        if self.memory_variant == "extend":
            return self.losses_per_query(scores, positives, exclude_self, columns)
        if stored is not None:
            scores = torch.cat([scores, stored[0].to(scores)])
            positives = torch.cat([positives, stored[1].to(positives.device)])
        loss = self.mean_over_rows(scores, positives)
        return {"loss": {"losses": loss, "indices": None, "reduction_type": "already_reduced"}}

    def references_with_memory(self, ref_emb, ref_labels):
        """The references followed by the stored ones (detached); reads the memory only."""
        if not len(self.memory):
            return ref_emb, ref_labels
        self.memory.check_width(ref_emb, "embedding size")
        stored_emb, stored_labels = self.memory.stored()
        return torch.cat([ref_emb, stored_emb.to(ref_emb)]), torch.cat([ref_labels, stored_labels.to(ref_labels)])

    def similarities(self, embeddings, labels, ref_emb, ref_labels, exclude_self, pairs=None):
        """Scores [queries, ranked references], the positive mask and, when `pairs` is
        given, the reference index of each column (otherwise None). Without `pairs` every
        reference is ranked, except the query itself when the batch is its own reference
        set (see `without_self`). `pairs` = (indices_tuple, n): the tuple's pairs are the
        positives and negatives among the first n references (the rest, the memory's,
        count by label); references in no pair are left out of the query's ranking."""
        matrix = self.distance(embeddings, ref_emb)
        scores = matrix if self.distance.is_inverted else -matrix
        if pairs is None:
            positives, _ = pair_masks(labels, ref_labels)
            if exclude_self:
                scores, positives = without_self(scores), without_self(positives)
            return scores, positives, None
        indices_tuple, given = pairs
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


def without_self(matrix):
    """Drops entry (i, i) of every row of a [queries, references] matrix whose first
    columns are the queries themselves. Strided views instead of a boolean mask: in
    the flattened square block, the entries between two diagonal entries are one
    view row."""
    queries = len(matrix)
    square, rest = matrix[:, :queries], matrix[:, queries:]
    off_diagonal = square.flatten()[1:].view(queries - 1, queries + 1)[:, :-1].reshape(queries, queries - 1)
    return torch.cat([off_diagonal, rest], dim=1) if rest.shape[1] else off_diagonal


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
        memory_variant: how the memory takes part (sec. 4.3 leaves it open):

            - "extend" (the paper's text): the memory holds the previous batches'
              embeddings and labels; each current query ranks its references followed
              by the stored ones. Batches may change size.
            - "rows" (the authors' code, ``BatchMemoryRecallLoss``): the memory holds
              the previous batches' score rows (each previous query against its own
              batch) and positive masks; they are appended below the current rows as
              extra queries, every row is ranked on its own, and the loss is the mean
              of ℓ over the positive pairs of all rows, with r taken as (r / n) times
              the number of rows (n: the row length), as the authors denormalise it
              (also with an empty memory). Every batch must give rows of the same
              length (a changed length needs ``reset_memory()``).

    Per-pair losses go through PML's reducer (MeanReducer by default, the paper's mean
    over positive pairs), with indices (query, reference). With ``memory_variant="rows"``
    the loss is that mean itself ("already_reduced"): stored rows have no indices in
    the current batch.
    """

    def __init__(
        self,
        lambda_val: float = 0.2,
        margin: float = 0.02,
        weighting: str = "log",
        memory_size: int = 3,
        memory_variant: str = "extend",
        **kwargs,
    ):
        super().__init__(lambda_val, margin, memory_size, memory_variant, **kwargs)
        if weighting not in ("log", "loglog"):
            raise ValueError(f"RaMBORecallLoss: weighting must be 'log' or 'loglog', got {weighting!r}")
        self.weighting = weighting
        self.add_to_recordable_attributes(list_of_names=["mean_negatives_above"], is_stat=True)

    def losses_of_pairs(self, scores, positives, r_scale=1.0):
        """ℓ per positive pair, with its (row, column) index; r is multiplied by `r_scale`."""
        shifted = shift_by_margin(scores, positives, self.margin)
        (rows, columns), ranks, among_positives = blackbox_ranks_of_positives(
            shifted, positives, self.lambda_val, self._loss_scale
        )
        # r = rank among all − rank among positives (eq. 17), as counts.
        negatives_above = (ranks * scores.shape[-1] - among_positives.to(scores.dtype)) * r_scale
        self.mean_negatives_above = float(negatives_above.detach().mean())
        losses = torch.log1p(negatives_above)
        if self.weighting == "loglog":
            losses = torch.log1p(losses)
        return losses, rows, columns

    def losses_per_query(self, scores, positives, exclude_self, references=None):
        losses, queries, columns = self.losses_of_pairs(scores, positives)
        if references is not None:  # columns of the pairs an indices_tuple gave
            indices = (queries, references[queries, columns])
        else:
            indices = (queries, reference_index(queries, columns, exclude_self))
        return {"loss": {"losses": losses, "indices": indices, "reduction_type": "pos_pair"}}

    def mean_over_rows(self, scores, positives):
        return self.losses_of_pairs(scores, positives, r_scale=len(scores) / scores.shape[-1])[0].mean()


class RaMBOAPLoss(_RaMBOLoss):
    """AP loss for in-batch retrieval (eq. 21-22): per query, 1 − the mean precision at
    its positives; queries without a positive are left out.

    Args:
        lambda_val, margin, memory_size: as for `RaMBORecallLoss`. The defaults are the
            retrieval values (Table 9, CUB-200, and appendix A); the paper used the AP
            loss for detection with λ = 0.5, margin 0.15 and τ = 7 on classifier scores
            (see `pml_rank.ranking.map_loss`), not on cosine similarities.
        memory_variant: "extend" or "rows", as for `RaMBORecallLoss`. With "rows" the
            loss is 1 − AP averaged over all rows with a positive, current and stored
            (precision is a ratio of ranks, so no denormalisation enters). The authors'
            code has this memory for the recall loss; this applies the same construction.

    Per-query losses go through PML's reducer ("element" reduction, indices = queries);
    with ``memory_variant="rows"`` the loss is the mean itself ("already_reduced").
    """

    def __init__(
        self,
        lambda_val: float = 0.2,
        margin: float = 0.02,
        memory_size: int = 3,
        memory_variant: str = "extend",
        **kwargs,
    ):
        super().__init__(lambda_val, margin, memory_size, memory_variant, **kwargs)

    def losses_per_query(self, scores, positives, exclude_self, references=None):
        precision, has_positive = precision_at_positives(
            scores, positives, self.lambda_val, self.margin, self._loss_scale
        )
        queries = has_positive.nonzero(as_tuple=True)[0]
        return {"loss": {"losses": 1 - precision[queries], "indices": queries, "reduction_type": "element"}}

    def mean_over_rows(self, scores, positives):
        precision, has_positive = precision_at_positives(
            scores, positives, self.lambda_val, self.margin, self._loss_scale
        )
        return 1 - precision[has_positive].mean()
