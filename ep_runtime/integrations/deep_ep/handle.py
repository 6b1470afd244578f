"""The handle a dispatch returns: DeepEP's 6-tuple, carrying the layer's state.

DeepEP's intranode handle is ``(rank_prefix_matrix, channel_prefix_matrix,
recv_channel_prefix_matrix, recv_src_idx, is_token_in_rank, send_head)``; engines keep it
opaque (Megatron-core, vLLM, SGLang pass it back to ``combine`` and cached ``dispatch``) and
DeepEP's tests read ``rank_prefix_matrix[s][rank]``. :class:`DispatchHandle` is that tuple
(unpacking, indexing and ``len`` work as on DeepEP's), with what the layer needs for a cached
dispatch and a combine in :attr:`DispatchHandle.state`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(eq=False)
class Routing:
    """The routing of a non-cached dispatch, kept by its handle: a cached dispatch, and a combine
    whose dispatch is no longer the runtime's current one, run it again. Compared by identity:
    every rank makes the same calls with corresponding handles, so "the routing of this handle
    is the runtime's open dispatch" is decided alike on every rank.

    Attributes
    ----------
    ids : ``[T, width]`` int32 global expert ids, -1 for a masked slot: the caller's ``topk_idx``,
        or, for a dispatch without top-k, one slot per rank (``r * L`` where
        ``is_token_in_rank[t, r]``).
    weights : ``[T, width]`` float32, what travels with them (the caller's ``topk_weights``, or 0).
    n_experts : the experts ``ids`` count.
    """

    ids: torch.Tensor
    weights: torch.Tensor
    n_experts: int


@dataclass(eq=False)
class HandleState:
    """The layer's part of a :class:`DispatchHandle`.

    Attributes
    ----------
    owner : the ``Buffer`` that dispatched (a handle works only there).
    routing : the dispatch's :class:`Routing`.
    source : ``[N]`` int64, the receive-buffer slot ``s * capacity + t`` of each dense row (-1 past
        ``num_recv``; :mod:`~ep_runtime.integrations.deep_ep.dense`).
    capacity : the ``max_tokens_per_rank`` of the runtime that dispatched (``source``'s stride).
    n_tokens, hidden : the dispatch's ``T`` and row width.
    """

    owner: object
    routing: Routing
    source: torch.Tensor
    capacity: int
    n_tokens: int
    hidden: int

    @property
    def n_rows(self) -> int:
        """``N``: the dense rows (``num_recv``, or the ``num_worst_tokens`` of the dispatch)."""
        return self.source.shape[0]


class StatefulTuple(tuple):
    """A tuple (what DeepEP's and HybridEP's callers unpack and index) that carries the layer's
    state of the call that made it in :attr:`state`."""

    state: object

    def __new__(cls, items: tuple, state):
        handle = super().__new__(cls, items)
        handle.state = state
        return handle

    def __getnewargs__(self):
        return tuple(self), self.state


class DispatchHandle(StatefulTuple):
    """DeepEP's intranode handle, ``(rank_prefix_matrix, channel_prefix_matrix,
    recv_channel_prefix_matrix, recv_src_idx, is_token_in_rank, send_head)``, plus
    :attr:`state`.

    - ``rank_prefix_matrix`` ``[R, R]`` int32: column ``rank`` holds, per source ``s``, the rows
      received here from sources ``0..s`` (where source ``s``'s block of ``recv_x`` ends); the
      other columns, what the other ranks received, are -1 (the layer does not exchange them).
    - ``channel_prefix_matrix``, ``recv_channel_prefix_matrix`` ``[R, num_sms / 2]`` and
      ``send_head`` ``[T, R]`` int32: -1 (DeepEP's channel bookkeeping; the layer has no channels).
    - ``recv_src_idx`` ``[N]`` int32: each received row's token index on its source rank (-1
      past ``num_recv``).
    - ``is_token_in_rank`` ``[T, R]`` bool: as passed to the dispatch.
    """

    state: HandleState
