"""How the work of a call is cut, by device: the one policy that the rank losses' panels
(`losses.query_panels`), RaMBO's rank counting (`ranking`) and `losses.base.symmetrize_`
follow.

On the CPU ("cache"), into panels that stay in a core's cache between the passes over
them. On an accelerator ("memory"), cache-sized panels are hundreds of small kernels
(about 200 at batch 8192), each launch costing more than its arithmetic: there a panel
holds as many entries as the call's own [queries, references] matrix (`MEMORY_MATRICES`
of them), a memory budget that grows with the batch, so that a call is a few panels
(about one per positive of a query) whatever the batch size, and its memory a few
similarity matrices. RaMBO's rank counting also writes its 0/1 comparisons in float16
there (`ranking._comparison_dtype`): on an accelerator writing and reading them back is
the cost, on the CPU float16 has no fast arithmetic.
"""

# Entries of one panel's [queries, positives, references] tensor: 4 MB in float32, in
# the CPU's cache between the passes over it, and large enough that Python's per-op
# cost stays small next to the arithmetic (Smooth-AP's function at batch 2048, 1 thread,
# CPU time on a loaded machine: 27 ms with 2^18, 24 with 2^19, 22 with 2^20).
PANEL_ELEMENTS = 1 << 20

# A panel on an accelerator: this many [queries, references] matrices of entries.
MEMORY_MATRICES = 1


def sized_for(device):
    """How work on `device` is cut: "cache" on the CPU, "memory" elsewhere."""
    return "cache" if device.type == "cpu" else "memory"


def work_budget(device, matrix_elements):
    """Entries one panel of work may hold on `device`: `PANEL_ELEMENTS` on the CPU, else
    `MEMORY_MATRICES` times the call's matrix of `matrix_elements`."""
    return PANEL_ELEMENTS if sized_for(device) == "cache" else int(MEMORY_MATRICES * matrix_elements)
