"""The positive pairs by label (`base.label_pairs`) on a GPU in two Triton kernels, instead of
a [queries, references] boolean matrix of label comparisons and a `nonzero` over it, then a
`bincount` of the pairs' queries: at batch 8192 the matrix is 64 MB written and read back
(0.3 ms on an H200, a third of the float16 similarity product), and the `nonzero`, the
`bincount` and the read-back of the counts' extremes each make the host wait.

1. `_label_counts_kernel`: each query's number of references with its label (its own column left
   out where the batch is its own reference set), comparing labels in registers.
2. The counts' running total; the total and the fewest and most pairs of a query, read back in
   one transfer (the callers need the extremes anyway, `query_panels.queries_in_range`).
3. `_label_pairs_kernel`: each query's pairs written at its place in row-major order, as
   `nonzero` orders them.

The torch paths of `base.label_pairs` stay the reference: the tests hold these kernels equal to
them (in Triton's interpreter on the CPU, on CUDA under the `cuda` marker).
"""

import torch

from .. import _triton
from .._triton import triton

if triton is not None:
    import triton.language as tl

LABEL_DTYPES = (torch.int64, torch.int32)
# Queries per program of the counts kernel, references per step of both kernels: 40-48
# registers a thread for sm_80 and sm_90 with Triton 3.6-3.8 (16 queries spilled 4 bytes with
# the H200's Triton 3.6).
QUERIES_PER_BLOCK = 8
REFERENCES_PER_STEP = 256


def applies(labels, ref_labels):
    """Whether the kernels find the pairs of these labels: integer label vectors where Triton
    runs (`_triton.runs_on`), neither empty."""
    return all(
        _triton.runs_on(t, LABEL_DTYPES) and t.dim() == 1 and t.numel() > 0 and t.is_contiguous()
        for t in (labels, ref_labels)
    )


def label_pairs_and_counts(labels, ref_labels, skip_own):
    """``(queries, references, per_query, (fewest, most))``: the positive pairs by label as
    int64 index tensors in row-major order ((q, q) left out with `skip_own`), each query's
    number of pairs (int64, as `bincount` counts them) and its extremes, read back with the
    pairs' total in one transfer."""
    per_query = torch.empty(len(labels), dtype=torch.int64, device=labels.device)
    with _triton.on_device(labels.device):
        _label_counts_kernel[(triton.cdiv(len(labels), QUERIES_PER_BLOCK),)](
            labels, ref_labels, per_query, len(labels), len(ref_labels),
            SKIP_OWN=skip_own, BLOCK_Q=QUERIES_PER_BLOCK, BLOCK_J=REFERENCES_PER_STEP,
        )  # fmt: skip
    ends = per_query.cumsum(0)
    total, fewest, most = torch.cat([ends[-1:], torch.stack(torch.aminmax(per_query))]).tolist()
    queries, references = (torch.empty(total, dtype=torch.int64, device=labels.device) for _ in range(2))
    if total:
        with _triton.on_device(labels.device):
            _label_pairs_kernel[(len(labels),)](
                labels, ref_labels, per_query, ends, queries, references, len(ref_labels),
                SKIP_OWN=skip_own, BLOCK_J=REFERENCES_PER_STEP,
            )  # fmt: skip
    return queries, references, per_query, (fewest, most)


if triton is not None:

    @triton.jit
    def _label_counts_kernel(labels, ref_labels, per_query, queries, references, SKIP_OWN: tl.constexpr,
                             BLOCK_Q: tl.constexpr, BLOCK_J: tl.constexpr):  # fmt: skip
        q = tl.program_id(0) * BLOCK_Q + tl.arange(0, BLOCK_Q)
        in_queries = q < queries
        label = tl.load(labels + q, mask=in_queries, other=0)
        same = tl.zeros([BLOCK_Q], dtype=tl.int32)
        for first in range(0, references, BLOCK_J):
            j = first + tl.arange(0, BLOCK_J)
            inside = j < references
            ref_label = tl.load(ref_labels + j, mask=inside, other=0)
            matches = (ref_label[None, :] == label[:, None]) & inside[None, :]
            if SKIP_OWN:
                matches = matches & (j[None, :] != q[:, None])
            same += tl.sum(matches.to(tl.int32), axis=1)
        tl.store(per_query + q, same.to(tl.int64), mask=in_queries)

    @triton.jit
    def _label_pairs_kernel(labels, ref_labels, per_query, ends, queries, references_out, references,
                            SKIP_OWN: tl.constexpr, BLOCK_J: tl.constexpr):  # fmt: skip
        q = tl.program_id(0)
        label = tl.load(labels + q)
        # The query's first pair: its running total less its own count.
        place = tl.load(ends + q) - tl.load(per_query + q)
        for first in range(0, references, BLOCK_J):
            j = first + tl.arange(0, BLOCK_J)
            matches = (tl.load(ref_labels + j, mask=j < references, other=0) == label) & (j < references)
            if SKIP_OWN:
                matches = matches & (j != q)
            matched = matches.to(tl.int32)
            at = place + tl.cumsum(matched, axis=0) - matched
            tl.store(queries + at, tl.zeros([BLOCK_J], dtype=tl.int64) + q, mask=matches)
            tl.store(references_out + at, j.to(tl.int64), mask=matches)
            place += tl.sum(matched, axis=0).to(tl.int64)
