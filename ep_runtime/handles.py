"""Typed, frozen handles that tie each wait to its async call, and the expert batch.

A handle records the runtime that issued it (``owner``) and the call number (``call``).
The runtime accepts a handle exactly once, only for the call in flight, and only on the
runtime that issued it; anything else raises :class:`~ep_runtime.errors.EPStateError`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class DispatchHandle:
    """Returned by ``dispatch_async``; passed to ``dispatch_wait`` and ``combine_async``."""

    owner: int
    call: int
    n_tokens: int


@dataclass(frozen=True)
class CombineHandle:
    """Returned by ``combine_async``; passed to ``combine_wait``."""

    owner: int
    call: int
    n_tokens: int


@dataclass(frozen=True)
class ExpertBatch:
    """This rank's expert-major ragged batch (device arrays, views into runtime buffers).

    Rows are grouped by local expert, then source rank, then source token. Views stay valid
    until the next ``dispatch_wait`` on this runtime.

    Attributes
    ----------
    x : [capacity, hidden] uint16 (bf16 bits); rows ``[0, row_offsets[L])`` are defined.
    row_offsets : [L + 1] int32; segment ``e`` is rows ``[row_offsets[e], row_offsets[e + 1])``,
        each starting at a multiple of ``pad_multiple``.
    expert_counts : [L] int32, real (unpadded) rows per local expert.
    src_rank, src_token, src_k : [capacity] int32, where each row came from (-1: padding).
    weight : [capacity] float32, the router weight of each row (0: padding).
    handle : the :class:`DispatchHandle` of the call, for ``combine_async``.
    """

    x: Any
    row_offsets: Any
    expert_counts: Any
    src_rank: Any
    src_token: Any
    src_k: Any
    weight: Any
    handle: DispatchHandle
