"""DeepEP's dense received rows, made from the runtime's compact layout with device gathers.

DeepEP's normal dispatch returns one row per received (token, source rank), source-major and
then in token order (``rank_prefix_matrix[s][rank]`` ends source ``s``'s block), with each row's
``recv_topk_idx`` (the slot's local expert, or -1 where the slot's expert is on another rank)
and ``recv_topk_weights`` (0 where -1). The runtime's compact layout
(``EPRuntime.dispatch_wait(h, layout="compact")``, README "Layouts") leaves the same rows where
they landed, row ``s * C + t`` for token ``t`` of source ``s`` (``C`` = ``max_tokens_per_rank``),
and lists per local expert which of them to gather; ascending compact position is exactly
DeepEP's order. This module turns one into the other and back:

- :func:`_dense_from_compact`: a dispatch's dense rows, routing and counts, and the map from
  each dense row to its compact row (the only place a dispatch reads the device from the host:
  through the ``read_host`` it is given, once, unless the caller fixed the row count);
- :func:`_gather_dense`: a cached dispatch's rows through a map made earlier;
- :func:`_compact_from_dense`: a combine's rows back in compact positions;
- :func:`_recoord`: a dense-row map moved to a runtime of another capacity.

These four are the layer's whole dependence on the compact layout. A receiver layout of the
execution plan that writes the dense rows in the kernels (issue #63, deliverable 2) replaces
them: shapes, dtypes, order and the map's meaning stay, the gathers go.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, eq=False)
class DenseRows:
    """What :func:`_dense_from_compact` returns (torch tensors on the runtime's device).

    Attributes
    ----------
    x : ``[N, hidden]`` the received rows (bfloat16, or ``float8_e4m3fn`` codes in FP8), DeepEP's
        order; rows past ``num_recv`` (``num_worst_tokens`` calls) are zero.
    scales : FP8 only: ``[N, hidden / 128]`` the rows' block scales (float32, or uint8 UE8M0
        codes), else None.
    topk_idx, topk_weights : ``[N, K]`` int64 / float32: each row's slots as DeepEP gives them
        (the local expert, or -1 and 0 where the slot's expert is elsewhere, masked, or the row is
        past ``num_recv``); None when not asked for.
    source : ``[N]`` int64, the compact row (``s * C + t``) of each dense row; -1 past ``num_recv``.
    per_source : ``[R]`` int64, rows received from each source rank (device).
    counts : the host list DeepEP returns, per local expert its rows rounded up to the
        alignment (empty when the caller fixed ``N``).
    num_recv : the rows received, on the host (None when the caller fixed ``N``).
    """

    x: torch.Tensor
    scales: torch.Tensor | None
    topk_idx: torch.Tensor | None
    topk_weights: torch.Tensor | None
    source: torch.Tensor
    per_source: torch.Tensor
    counts: list
    num_recv: int | None


def _dense_from_compact(batch, n_ranks: int, capacity: int, top_k: int | None, rows: int | None,
                        alignment: int, read_host) -> DenseRows:
    """DeepEP's dense rows of one dispatch from the runtime's compact batch (torch views).

    The kernel receiver layout of issue #63 replaces this function (see the module docstring).

    Parameters
    ----------
    batch : the compact batch as torch tensors: ``x`` ``[R * C, hidden]`` (and ``scales``),
        ``row_offsets`` ``[L + 1]``, ``expert_counts`` ``[L]``, ``gather``, ``src_k``, ``weight``
        ``[rows capacity]`` (:class:`ep_runtime.integrations.torch_async.Batch`).
    n_ranks, capacity : ``R`` and ``C`` (the runtime's ``max_tokens_per_rank``).
    top_k : the caller's slots per token ``K`` (``recv_topk_idx`` is ``[N, K]``), or None for a
        dispatch without top-k (no ``topk_idx`` / ``topk_weights`` are made).
    rows : ``N`` fixed by the caller (``num_worst_tokens``: no host read), or None: ``N`` is the
        rows received, read on the host with the counts.
    alignment : DeepEP's ``expert_alignment``: each count is rounded up to a multiple of it.
    read_host : ``f(tensor) -> list``: the one device-to-host read (a synchronization on GPUs).

    Rows received past a caller's ``N`` are dropped (the caller promised they do not come; the
    layer checks it in debug mode).
    """
    dev = batch.x.device
    slots = n_ranks * capacity
    n_batch = batch.row_offsets[-1].long()  # expert-major rows of the batch (device scalar)
    cap_rows = batch.gather.shape[0]
    live = (torch.arange(cap_rows, device=dev) < n_batch) & (batch.gather >= 0)
    compact = torch.where(live, batch.gather.long(), slots)  # the compact row of each batch row (dummy: slots)
    received = torch.zeros(slots + 1, dtype=torch.bool, device=dev).scatter_(0, compact, True)[:slots]
    position = torch.cumsum(received, 0) - 1  # each received compact row's dense row
    per_source = received.view(n_ranks, capacity).sum(1)
    counts = batch.expert_counts.long()
    counts = (counts + alignment - 1) // alignment * alignment
    num_recv = None
    if rows is None:
        host = read_host(torch.cat([per_source.sum().view(1), counts]))
        num_recv, counts_list, rows = host[0], host[1:], host[0]
    else:
        counts_list = []
    kept = received & (position < rows)
    source = torch.full((rows + 1,), -1, dtype=torch.int64, device=dev)
    source.scatter_(0, torch.where(kept, position, rows), torch.arange(slots, device=dev))
    source = source[:rows]
    x, scales = _gather_dense(batch.x, batch.scales, source)
    topk_idx = topk_weights = None
    if top_k is not None:
        expert = torch.searchsorted(batch.row_offsets[1:].long(), torch.arange(cap_rows, device=dev), right=True)
        dense_row = position[compact.clamp(max=slots - 1)]
        slot = torch.where(live & (dense_row < rows), dense_row * top_k + batch.src_k.long(), rows * top_k)
        topk_idx = torch.full((rows * top_k + 1,), -1, dtype=torch.int64, device=dev)
        topk_idx = topk_idx.scatter_(0, slot, expert)[:-1].view(rows, top_k)
        topk_weights = torch.zeros(rows * top_k + 1, dtype=torch.float32, device=dev)
        topk_weights = topk_weights.scatter_(0, slot, batch.weight)[:-1].view(rows, top_k)
    return DenseRows(x, scales, topk_idx, topk_weights, source, per_source, counts_list, num_recv)


def _gather_dense(x: torch.Tensor, scales: torch.Tensor | None, source: torch.Tensor):
    """``(x, scales)`` of the dense rows ``source`` (``[N]`` compact rows, -1: a zero row) from
    a compact batch's ``x`` ``[R * C, hidden]`` and ``scales`` (FP8: ``[R * C, S]``; None in
    bf16). A cached dispatch's rows come from here, through the map of the dispatch that made
    its handle; the kernel receiver layout replaces it (see the module docstring)."""
    pick = source.clamp(min=0)
    missing = (source < 0)[:, None]
    rows = x.index_select(0, pick).masked_fill_(missing, 0)
    if scales is None:
        return rows, None
    return rows, scales.index_select(0, pick).masked_fill_(missing, 0)


def _compact_from_dense(rows: torch.Tensor, out: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """Write a combine's dense ``rows`` ``[N, W]`` into their compact positions in ``out``
    ``[R * C + 1, W]`` (``source``: the dispatch's map; rows past ``num_recv`` go to the last,
    unsent row); returns ``out[:R * C]``, what the runtime's compact combine reads (rows of tokens
    that did not come are not read). The kernel receiver layout replaces it (see the module
    docstring)."""
    slots = out.shape[0] - 1
    out.index_copy_(0, torch.where(source >= 0, source, slots), rows)
    return out[:slots]


def _recoord(source: torch.Tensor, capacity: int, new_capacity: int) -> torch.Tensor:
    """A dense-row map ``s * capacity + t`` (-1 kept) in the compact rows of a runtime of
    ``new_capacity`` tokens per rank: ``s * new_capacity + t`` (a handle's dispatch, cached or
    combined on another runtime). Goes with the compact layout (see the module docstring)."""
    if capacity == new_capacity:
        return source
    moved = source // capacity * new_capacity + source % capacity
    return torch.where(source >= 0, moved, source)
