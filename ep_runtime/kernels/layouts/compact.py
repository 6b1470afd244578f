"""The compact layout: the expert-major placement (:mod:`.expert_major`), read in place.

Nothing is copied into an expert batch: the batch is the receive buffer, one row per (token,
source rank) where it landed (``dispatch_tokens[s, t]``: DeepEP's and NCCL's layout), and each
expert's rows are listed by ``row_gather``. Receive kernels built for a runtime that serves only
this layout hold no expert-row copy (``COPIES`` False); the row copy itself stays for what a
receiver copies into the receive buffer (a landing receiver's own rows, never sent).
"""

import functools
from types import SimpleNamespace

from ep_runtime.kernels.cuda_api import cuda
from ep_runtime.kernels.layouts.expanded import make_row_copy
from ep_runtime.kernels.layouts.expert_major import make_placement


@cuda.jit(device=True)
def _gather_rows(d_tokens, row_gather, row_offsets, L, expert_x, status, lo, hi, block, blocks):
    """Nothing: the rows are read where they landed."""


@functools.lru_cache(maxsize=None)
def make_layout(threads: int) -> SimpleNamespace:
    """The compact layout for blocks of ``threads`` threads (:mod:`ep_runtime.kernels.layouts`)."""
    copy = make_row_copy(threads)
    return SimpleNamespace(**vars(make_placement(threads)), COPIES=False, copy_in_pairs=copy.copy_in_pairs,
                           copy_to_rows=copy.copy_to_rows, gather_rows=_gather_rows)
