"""DeepEP's dense received rows, as the runtime's dense layout writes them in its kernels.

DeepEP's normal dispatch returns one row per received (token, source rank), source-major and
then in token order (``rank_prefix_matrix[s][rank]`` ends source ``s``'s block), with each row's
``recv_topk_idx`` (the slot's local expert, or -1 where the slot's expert is on another rank)
and ``recv_topk_weights`` (0 where -1). The runtime's dense layout
(``EPRuntime.dispatch_wait(h, layout="dense")``, :class:`ep_runtime.core.handles.DenseBatch`)
is exactly that, written by ``dispatch_dense``, with the map from each dense row to its
receive-buffer slot (``s * C + t``, ``C`` = ``max_tokens_per_rank``) and the per-source counts;
its combine reads DeepEP's combine input through the kernels' map back. This module hands the
caller its own copies of those rows (DeepEP's outputs outlive the next dispatch; the runtime's
batch does not):

- :func:`dense_rows`: a dispatch's rows, routing and counts (the only place a dispatch reads the
  device from the host: through the ``read_host`` it is given, once, unless the caller fixed the
  row count);
- :func:`dense_x`: a cached dispatch's rows (its handle's row count, no host read).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, eq=False)
class DenseViews:
    """The runtime's dense batch of one dispatch as torch views (valid until the runtime's next
    ``dispatch_wait``): ``x`` ``[R C, hidden]`` (bf16, or E4M3 codes as uint8), ``scales``
    (FP8: ``[R C, hidden / 128]``; None in bf16), ``topk_idx`` / ``topk_weights`` ``[R C,
    top_k]`` int32 / float32, ``slot`` ``[R C]`` int32, ``source_rows`` ``[R]`` int32,
    ``expert_counts`` ``[L]`` int32, and the runtime's handle of the call (``rt_handle``)."""

    rt_handle: object
    x: torch.Tensor
    scales: torch.Tensor | None
    topk_idx: torch.Tensor
    topk_weights: torch.Tensor
    slot: torch.Tensor
    source_rows: torch.Tensor
    expert_counts: torch.Tensor


@dataclass(frozen=True, eq=False)
class DenseRows:
    """What :func:`dense_rows` returns (torch tensors on the runtime's device, the caller's own).

    Attributes
    ----------
    x : ``[N, hidden]`` the received rows (bfloat16, or ``float8_e4m3fn`` codes in FP8), DeepEP's
        order; rows past ``num_recv`` (``num_worst_tokens`` calls) are zero.
    scales : FP8 only: ``[N, hidden / 128]`` the rows' block scales (float32, or uint8 UE8M0
        codes), else None.
    topk_idx, topk_weights : ``[N, K]`` int64 / float32: each row's slots as DeepEP gives them
        (the local expert, or -1 and 0 where the slot's expert is elsewhere, masked, or the row is
        past ``num_recv``); None when not asked for.
    source : ``[N]`` int64, the receive-buffer slot (``s * C + t``) of each dense row; -1 past
        ``num_recv``.
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


def dense_rows(batch: DenseViews, top_k: int | None, rows: int | None, alignment: int, read_host) -> DenseRows:
    """DeepEP's dense rows of one dispatch from the runtime's dense batch.

    Parameters
    ----------
    batch : the dense batch as torch views (:class:`DenseViews`).
    top_k : the caller's slots per token ``K`` (``recv_topk_idx`` is ``[N, K]``: the first K of
        the runtime's, whose extra slots are masked), or None for a dispatch without top-k (no
        ``topk_idx`` / ``topk_weights`` are made).
    rows : ``N`` fixed by the caller (``num_worst_tokens``: no host read), or None: ``N`` is the
        rows received, read on the host with the counts.
    alignment : DeepEP's ``expert_alignment``: each count is rounded up to a multiple of it.
    read_host : ``f(tensor) -> list``: the one device-to-host read (a synchronization on GPUs).

    Rows received past a caller's ``N`` are dropped (the caller promised they do not come; the
    layer checks it in debug mode).
    """
    per_source = batch.source_rows.long()
    counts = batch.expert_counts.long()
    counts = (counts + alignment - 1) // alignment * alignment
    num_recv = None
    if rows is None:
        host = read_host(torch.cat([per_source.sum().view(1), counts]))
        num_recv, counts_list, rows = host[0], host[1:], host[0]
    else:
        counts_list = []
    source = _rows_of(batch.slot, rows, -1).long()
    x, scales = dense_x(batch, source)
    topk_idx = topk_weights = None
    if top_k is not None:
        topk_idx = _rows_of(batch.topk_idx[:, :top_k], rows, -1).long()
        topk_weights = _rows_of(batch.topk_weights[:, :top_k], rows, 0)
    return DenseRows(x, scales, topk_idx, topk_weights, source, per_source, counts_list, num_recv)


def dense_x(batch: DenseViews, source: torch.Tensor):
    """``(x, scales)``: the caller's copy of the first ``N`` dense rows (``source``, ``[N]``: each
    row's slot, -1 past the rows received, where the copy is zero) and their FP8 scales (None
    in bf16). A cached dispatch's rows come from here, with its handle's ``source``: the same
    routing gives the same dense rows on any runtime."""
    rows = source.shape[0]
    missing = (source < 0)[:, None]
    x = _rows_of(batch.x, rows, 0).masked_fill_(missing, 0)
    if batch.scales is None:
        return x, None
    return x, _rows_of(batch.scales, rows, 0).masked_fill_(missing, 0)


def _rows_of(t: torch.Tensor, rows: int, fill) -> torch.Tensor:
    """A new tensor of the first ``rows`` rows of ``t``, rows past ``t``'s own filled with ``fill``
    (a caller's ``num_worst_tokens`` may exceed the runtime's dense capacity)."""
    if rows <= t.shape[0]:
        return t[:rows].clone()
    out = torch.full((rows, *t.shape[1:]), fill, dtype=t.dtype, device=t.device)
    out[:t.shape[0]] = t
    return out
