"""Typed, frozen handles that tie each wait to its async call, and the expert batch.

A handle records the runtime that issued it (``owner``) and the call number (``call``).
The runtime accepts a handle exactly once, only for the call in flight, and only on the
runtime that issued it; anything else raises :class:`~ep_runtime.core.errors.EPStateError`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


def from_fields(cls, values: dict):
    """``cls(**values)`` for a frozen dataclass of this module, without its generated
    ``__init__`` (which sets each field through ``object.__setattr__``: for a batch of ten
    fields, a noticeable share of a runtime call's host budget). ``values`` must name every
    field; the result compares equal to ``cls(**values)`` and is as frozen."""
    obj = object.__new__(cls)
    obj.__dict__.update(values)
    return obj


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
class SlotValuesHandle:
    """Returned by ``slot_values_async``; passed to ``slot_values_wait``."""

    owner: int
    call: int
    n_tokens: int


@dataclass(frozen=True, eq=False)
class KeptRouting:
    """Returned by ``keep_routing``: a dispatch's routing, kept for ``dispatch_async(tokens,
    routing=kept)`` (this rank's copies of every rank's routing tables; device arrays owned by
    this object). Compared by identity.

    Attributes
    ----------
    owner, call : the runtime and the dispatch call it was kept from.
    n_tokens : that dispatch's ``tokens`` rows (a reusing dispatch passes as many).
    epoch : the runtime's reset count when kept (a ``reset()`` retires it).
    ids, weights, ranks : [n_ranks, max_tokens_per_rank, top_k] int32 / float32 / int32 (ranks
        [0, 0, 0] for the route-first receivers, which rank for themselves); source s's rows
        ``t < counts[s, L]`` are defined.
    counts : [n_ranks, n_local_experts + 1] int32, each source's tokens per local expert (the
        ``wait`` and ``land`` receivers) and its token count (last column).
    restore : the prepared launch that copies them back for a reusing call.
    generation, memory : this routing's number among those kept in its arrays, and the arrays'
        latest (a one-element list shared by every KeptRouting of those arrays: a
        ``keep_routing(into=...)`` advances it, retiring the routing kept there before).
    """

    owner: int
    call: int
    n_tokens: int
    epoch: int
    ids: Any
    weights: Any
    counts: Any
    ranks: Any
    restore: Any
    generation: int
    memory: list


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
    scales : quantized token formats only (else None): the rows' block scales, float32 or UE8M0
        uint8 codes, ``[capacity, hidden / 128]`` or, with ``dispatch_wait(scales="column")``,
        ``[hidden / 128, capacity]`` (0 on padding rows); ``x`` then holds uint8 E4M3 codes.
        NVFP4: uint8 E4M3 codes ``[capacity, hidden / 16]`` (or ``[hidden / 16, capacity]``),
        and ``x`` ``[capacity, hidden / 2]`` uint8, two E2M1 codes a byte (element 2i in the low
        nibble).
    global_scales : NVFP4 only (else None): ``[capacity]`` float32, the global scale of each
        row's source tensor (its rank's ``token_global_scale``; 0 on padding rows): row r decodes
        to ``e2m1(code) * e4m3(scale) * global_scales[r]``.
    """

    x: Any
    row_offsets: Any
    expert_counts: Any
    src_rank: Any
    src_token: Any
    src_k: Any
    weight: Any
    handle: DispatchHandle
    scales: Any = None
    global_scales: Any = None


@dataclass(frozen=True)
class CompactBatch:
    """This rank's received tokens without the expansion copy (``dispatch_wait(layout="compact")``).

    ``x`` is the receive buffer of the call: one row per (source rank, token slot), the rows
    where the tokens landed. The rest lists, per local expert, which rows to gather, in the
    expanded batch's order (local expert, then source rank, then source token), so a GEMM that
    gathers ``x[gather[row_offsets[e]:row_offsets[e + 1]]]`` sees exactly expert e's segment of
    the expanded batch, and writes its outputs in the expanded order that
    ``combine_async(layout="expanded")`` takes.

    Attributes
    ----------
    x : [n_ranks * max_tokens_per_rank, hidden] uint16 (bf16 bits); row ``s * T + t`` is token
        t of rank s if that token has an expert on this rank and ``t < recv_tokens[s]`` (other
        rows are stale). A view of the symmetric receive buffer, the same memory every call
        (so a CUDA graph that captured one call's batch reads every replay's rows): read it
        (in stream order) before ``combine_async`` or the next ``dispatch_async``, whichever
        comes first (either lets peers write their next call's rows into it).
    recv_tokens : [n_ranks] int32, tokens each source rank dispatched in this call (written by
        dispatch_wait; the same memory every call).
    row_offsets, expert_counts, src_rank, src_token, src_k, weight : as :class:`ExpertBatch`
        (valid until the next ``dispatch_wait``; in a placing runtime until the next
        ``dispatch_async``, as ``gather``).
    gather : [capacity] int32, the ``x`` row of each batch row (``src_rank * T + src_token``;
        -1 on padding rows).
    handle : the :class:`DispatchHandle` of the call, for ``combine_async``.
    scales : quantized token formats only (else None): ``[n_ranks * T, hidden / 128]`` block
        scales of the rows of ``x`` (float32 or UE8M0 uint8 codes), a strided view of the
        messages; ``x`` is then ``[n_ranks * T, hidden]`` uint8 E4M3 codes, also strided.
        NVFP4: ``[n_ranks * T, hidden / 16]`` uint8 E4M3 codes, ``x`` ``[n_ranks * T, hidden /
        2]`` uint8 packed E2M1 codes.
    global_scales : NVFP4 only (else None): ``[n_ranks * T]`` float32, each received row's
        source tensor's global scale (row ``s * T + t``: rank s's), a strided view of the
        messages.
    """

    x: Any
    recv_tokens: Any
    row_offsets: Any
    expert_counts: Any
    gather: Any
    src_rank: Any
    src_token: Any
    src_k: Any
    weight: Any
    handle: DispatchHandle
    scales: Any = None
    global_scales: Any = None


@dataclass(frozen=True)
class DenseBatch:
    """This rank's received tokens as DeepEP's dense rows (``dispatch_wait(layout="dense")``),
    written by the kernels (device arrays, views into runtime buffers, the same memory every
    call; valid until the next ``dispatch_wait``).

    One row per received (token, source rank): source rank ascending, then the source's token
    order, only the tokens with an expert on this rank (DeepEP's normal-mode ``recv_x``). Row
    ``i < num_recv`` (``num_recv = source_rows.sum()``) is token ``slot[i] % T`` of rank
    ``slot[i] // T`` (T = ``max_tokens_per_rank``); rows ``[source_end[s - 1], source_end[s])``
    came from rank s, with ``source_end`` the cumulative sum of ``source_rows``.

    Attributes
    ----------
    x : [n_ranks * T, hidden] uint16 (bf16 bits); a quantized format's codes (uint8 E4M3
        ``[N, hidden]``, NVFP4 packed E2M1 ``[N, hidden / 2]``). Rows past ``num_recv`` are
        stale.
    topk_idx : [n_ranks * T, top_k] int32, per row and slot the slot's local expert (``id -
        rank * n_local_experts``), or -1 where its expert is on another rank or the slot is
        masked (and on every slot of a row past ``num_recv``).
    topk_weights : [n_ranks * T, top_k] float32, the slot's router weight, 0 where ``topk_idx``
        is -1.
    slot : [n_ranks * T] int32, the receive-buffer slot ``src * T + t`` of each row (-1 past
        ``num_recv``).
    slot_row : [n_ranks, T] int32, the dense row of token t of rank src (-1 where it did not
        come here): what ``combine_async(layout="dense")`` reads its input through.
    source_rows : [n_ranks] int32, the rows received from each rank.
    row_offsets, expert_counts : as :class:`ExpertBatch` (the expert-major placement's:
        DeepEP's per-expert counts are ``expert_counts``).
    handle : the :class:`DispatchHandle` of the call, for ``combine_async``.
    scales : quantized token formats only (else None): ``[n_ranks * T, S]`` the rows' block
        scales, row-major (float32, UE8M0 uint8 codes, or NVFP4's E4M3 codes).
    global_scales : NVFP4 only (else None): ``[n_ranks * T]`` float32, each row's source tensor's
        global scale.
    """

    x: Any
    topk_idx: Any
    topk_weights: Any
    slot: Any
    slot_row: Any
    source_rows: Any
    row_offsets: Any
    expert_counts: Any
    handle: DispatchHandle
    scales: Any = None
    global_scales: Any = None


@dataclass(frozen=True)
class BatchedBatch:
    """This rank's received rows as DeepEP's low-latency batch (``dispatch_wait(layout="batched")``),
    written by the kernels (device arrays, views into runtime buffers, the same memory every
    call: one CUDA graph serves every step; valid until the next ``dispatch_wait``).

    Local expert e's rows are ``x[e, :counts[e]]``: source rank ascending, then the source's
    token order; rows from rank s are slots ``[range[e, s] >> 32, + (range[e, s] & 0xFFFFFFFF))``.
    M = ``n_ranks * max_tokens_per_rank``.

    Attributes
    ----------
    x : [L, M, hidden] uint16 (bf16 bits), or uint8 E4M3 codes in an FP8 format; slots past
        ``counts[e]`` are stale.
    counts : [L] int32, each local expert's rows (DeepEP's ``recv_count``).
    src_token : [L, M] int32, each slot's token index on its source rank (DeepEP's
        ``recv_src_info``); stale past the count.
    layout_range : [L, n_ranks] int64, per (expert, source rank) the first slot ``<< 32 |`` the
        count (DeepEP's ``recv_layout_range``).
    row_weight : [L, M] float32, each slot's router weight (as dispatched); stale past the count.
    row_offsets, expert_counts : the expert-major placement's (as :class:`ExpertBatch`).
    handle : the :class:`DispatchHandle` of the call, for ``combine_async``.
    scales : FP8 formats only (else None), column-major in the last two dimensions:
        ``scales="column"``: [L, M, hidden / 128] float32 (UE8M0 codes decoded to powers of two);
        ``scales="packed"`` (UE8M0 only): [L, M, hidden / 512] int32, four codes per int32, the
        lowest byte the first block.
    """

    x: Any
    counts: Any
    src_token: Any
    layout_range: Any
    row_weight: Any
    row_offsets: Any
    expert_counts: Any
    handle: DispatchHandle
    scales: Any = None
