"""``deep_ep.HybridEPBuffer``: DeepEP's HybridEP buffer (its ``hybrid-ep`` branch) on ep_runtime,
for the calls Megatron-core makes: ``dispatch_with_permute`` and ``combine_with_unpermute``.

``dispatch_with_permute`` sends each token to the ranks of the experts of its routing map row
and returns the rows expert-major (each expert's segment padded to ``pad_multiple``), with each
row's probability and the per-expert row counts; ``combine_with_unpermute`` sums each token's
rows (unweighted: the experts applied the probabilities) and, given per-row values, returns
them to their (token, expert) (a backward's probability gradients). Both arguments of
Megatron-core 0.16.1 and of ``core_v0.19.0`` are taken (``num_blocks_permute``,
``num_blocks_unpermute``, ``num_sms_preprocessing_api``, ``fuse_permute_dispatch``,
``fuse_unpermute_combine``), and the handle's last item is HybridEP's ``overflow_flag``.

The routing's width follows each call's routing map: a blocking call (``non_blocking=False``)
gathers every rank's most experts of a token, token count and per-expert counts (its one read of
the device, as HybridEP's own blocking call) and widens the runtime when a token has more
experts than before, so nothing is cut. A ``non_blocking`` call reads nothing from the device:
it routes with the width it has (set by the first call, which gathers once), and a token with
more experts than that is not sent in full: the handle's ``overflow_flag`` says so (as HybridEP
reports rows dropped past ``num_permuted_tokens``), and debug mode raises.

Collective over the group, as HybridEP's: every rank makes the same calls in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ep_runtime.core.errors import EPInputError
from ep_runtime.integrations.deep_ep.buffer import _check_tensor
from ep_runtime.integrations.deep_ep.errors import unsupported
from ep_runtime.integrations.deep_ep.exchange import open_dispatch, run_dispatch
from ep_runtime.integrations.deep_ep.handle import Routing, StatefulTuple
from ep_runtime.integrations.deep_ep.layout import routing_from_map
from ep_runtime.integrations.deep_ep.runtimes import RuntimeCache, RuntimeEntry, RuntimeKey
from ep_runtime.integrations.deep_ep.streams import CommCall

_BF16 = torch.bfloat16


@dataclass(eq=False)
class HybridState:
    """The layer's part of a :class:`HybridEPHandle`.

    Attributes
    ----------
    owner : the HybridEPBuffer that dispatched.
    routing : the dispatch's routing (``[T, width]`` ids and probabilities).
    key : the runtime it ran on.
    n_rows : rows of ``dispatched_token`` (``num_permuted_tokens`` or the batch's).
    exact : whether ``n_rows`` is the batch's rows (known after a blocking call).
    tokens_per_expert : what the dispatch returned as such (host in blocking calls, else device).
    """

    owner: object
    routing: Routing
    key: RuntimeKey
    n_rows: int
    exact: bool
    tokens_per_expert: torch.Tensor


class HybridEPHandle(StatefulTuple):
    """HybridEP's handle: ``(sparse_to_dense_map, rdma_to_attn_map, attn_to_rdma_map,
    num_dispatched_tokens_tensor, local_expert_routing_map, dense_chunk_layout,
    dense_to_expert_map, tokens_per_expert, num_of_tokens_per_rank, config, overflow_flag)``.
    The layer has none of HybridEP's maps or its config (None there); ``tokens_per_expert`` is
    ``[L]`` int32 on the device (unpadded), ``num_of_tokens_per_rank`` this rank's ``T``,
    ``overflow_flag`` ``[1]`` int32 on the device (nonzero: rows past ``num_permuted_tokens``,
    or a token's experts past the routing's width, were not sent). :attr:`state` is the layer's."""

    state: HybridState


class HybridEPBuffer:
    """HybridEP's buffer on ep_runtime, within one node.

    ``HybridEPBuffer(group, hidden_dim, max_num_of_tokens_per_rank, num_local_experts,
    use_fp8=False, num_sms_dispatch_api=None, num_sms_combine_api=None,
    num_sms_preprocessing_api=None, num_blocks_permute=None, num_blocks_unpermute=None,
    load_cached_kernels=False, use_shared_buffer=True, enable_custom_allgather=False,
    num_of_hybrid_ep_ranks_per_nvlink_domain=None, use_mnnvl=None)`` as HybridEP's, plus the
    layer's ``debug`` and ``session`` keywords (as ``deep_ep.Buffer``'s).
    ``max_num_of_tokens_per_rank`` is the fewest tokens per rank the buffers hold (blocking calls
    grow them as HybridEP reallocates). The SM and block counts, kernel caching and custom
    all-gather are HybridEP's tuning and are accepted; the execution plan sizes the grids.
    ``use_fp8=True`` and an NVLink domain smaller than the group (internode) raise
    :class:`~ep_runtime.integrations.deep_ep.errors.DeepEPUnsupportedError`.
    """

    def __init__(self, group, hidden_dim: int, max_num_of_tokens_per_rank: int, num_local_experts: int,
                 use_fp8: bool = False, num_sms_dispatch_api: int | None = None, num_sms_combine_api: int | None = None,
                 num_sms_preprocessing_api: int | None = None, num_blocks_permute: int | None = None,
                 num_blocks_unpermute: int | None = None, load_cached_kernels: bool = False,
                 use_shared_buffer: bool = True, enable_custom_allgather: bool = False,
                 num_of_hybrid_ep_ranks_per_nvlink_domain: int | None = None, use_mnnvl: bool | None = None, *,
                 debug: bool | None = None, session=None):
        if use_fp8:
            raise unsupported("HybridEPBuffer", "use_fp8=True (FP8 HybridEP dispatch)",
                              "Dispatch bf16 (Megatron-core's HybridEP path does), or FP8 through deep_ep.Buffer")
        for name, value in (("hidden_dim", hidden_dim), ("max_num_of_tokens_per_rank", max_num_of_tokens_per_rank),
                            ("num_local_experts", num_local_experts)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise EPInputError(f"HybridEPBuffer: {name}={value!r} must be a positive int.")
        self._cache = RuntimeCache(group, 0, max_num_of_tokens_per_rank, "HybridEPBuffer", "max_num_of_tokens_per_rank",
                                   session)
        self.group, self.rank, self.group_size = group, self._cache.rank, self._cache.n_ranks
        domain = num_of_hybrid_ep_ranks_per_nvlink_domain
        if domain is not None and domain != self.group_size:
            raise unsupported("HybridEPBuffer", f"num_of_hybrid_ep_ranks_per_nvlink_domain={domain} for a group of "
                              f"{self.group_size} ranks (HybridEP across NVLink domains, over RDMA)",
                              "The layer runs within one node: leave it None")
        self.num_of_hybrid_ep_ranks_per_nvlink_domain, self.num_of_nodes = self.group_size, 1
        self.local_rank, self.node_rank = self.rank, 0
        self.hidden_dim, self.num_local_experts = hidden_dim, num_local_experts
        self._debug = debug
        self._rows_buffers: dict = {}

    # -- dispatch -------------------------------------------------------------------------------
    def dispatch_with_permute(self, *, hidden: torch.Tensor, topk_idx: torch.Tensor | None = None,
                              topk_weights: torch.Tensor | None = None, num_of_experts_per_rank: int | None = None,
                              num_of_experts: int | None = None, use_fp8: bool | None = None,
                              routing_map: torch.Tensor | None = None, probs: torch.Tensor | None = None,
                              scaling_factor: torch.Tensor | None = None, num_permuted_tokens=None,
                              pad_multiple: int | None = None, handle: tuple | None = None, non_blocking: bool = False,
                              fuse_permute_dispatch: bool = False, num_dispatched_tokens: int | None = None,
                              use_host_meta: bool | None = None):
        """HybridEP's dispatch with permute: ``(dispatched_token [rows, H] bf16, dispatched_probs
        [rows] float32 or None, None, tokens_per_expert [L] int64, handle)``. Collective.

        The routing: ``routing_map`` ``[T, E]`` bool with ``probs`` ``[T, E]`` float32 (or None),
        or ``topk_idx`` ``[T, K]`` (-1: none) with ``topk_weights`` and ``num_of_experts``; or a
        ``handle`` (a cached dispatch of ``hidden`` with that dispatch's routing and rows).
        ``rows``: ``num_permuted_tokens`` when given (rows past the batch are zero; batch rows past
        it are not sent, and ``overflow_flag`` is set), else the batch's, each expert's segment
        padded to ``pad_multiple``. ``tokens_per_expert``: the padded counts, on the host after a
        blocking call's one read, on the device with ``non_blocking=True`` (which needs
        ``num_permuted_tokens``, a multiple of ``pad_multiple``). ``use_host_meta`` is the
        deprecated spelling of ``not non_blocking``; ``num_dispatched_tokens`` is deprecated and
        unused, as in HybridEP.
        """
        c = "HybridEPBuffer.dispatch_with_permute"
        if use_host_meta is not None:
            non_blocking = not use_host_meta
        if use_fp8 or scaling_factor is not None:
            raise unsupported(c, "FP8 tokens (use_fp8 / scaling_factor)", "Dispatch bf16 hidden states")
        _check_tensor(c, "hidden", hidden, (_BF16,), (None, self.hidden_dim))
        pad = _pad_multiple(c, pad_multiple)
        rows = None if num_permuted_tokens is None else int(num_permuted_tokens)
        if non_blocking and (rows is None or rows < 0 or rows % pad):
            raise EPInputError(f"{c}: non_blocking=True needs num_permuted_tokens >= 0, a multiple of pad_multiple="
                               f"{pad}; got {num_permuted_tokens!r}.")
        hidden = hidden.contiguous()
        if handle is not None:
            return self._cached_dispatch(c, hidden, handle, rows)
        routing_map, probs = _routing_map(c, hidden.shape[0], routing_map, probs, topk_idx, topk_weights,
                                          num_of_experts)
        E = routing_map.shape[1]
        L = num_of_experts_per_rank if num_of_experts_per_rank is not None else self.num_local_experts
        if L * self.group_size != E:
            raise EPInputError(f"{c}: the routing has {E} experts but num_of_experts_per_rank={L} on "
                               f"{self.group_size} ranks gives {L * self.group_size}.")
        T, H = hidden.shape
        if non_blocking:
            width, counts, tokens, agreed = self._routing_width(routing_map), None, T, False
        else:
            width, counts, tokens = self._gather_routing(routing_map, pad)
            agreed = True
        key = RuntimeKey(H, E, layout="expanded", pad_multiple=pad)
        entry = self._cache.entry(key, width, tokens, tokens_agreed=agreed)
        width = entry.cfg.top_k
        routing = routing_from_map(routing_map, probs, width)
        with CommCall(self._cache.session, hidden.device, None, False) as call:
            batch = run_dispatch(entry, hidden, None, routing)
            n_batch = batch.row_offsets[-1]  # the batch's rows: on the device; on the host after a blocking call
            overflow = torch.zeros(1, dtype=torch.int32, device=hidden.device)
            if counts is not None:
                n_real = int(counts.sum())
                n_rows = n_real if rows is None else rows
                tokens_per_expert = counts
                overflow.fill_(n_real > n_rows)
            else:
                n_real, n_rows = n_batch, rows
                tokens_per_expert = batch.row_offsets.diff().long()
                overflow |= (n_batch > n_rows).int() | (routing_map.sum(1) > width).any().int()
            self._debug_checks(c, entry, routing_map, width, n_batch, n_rows, counts)
            exact = counts is not None and n_rows == n_real
            dispatched = _rows(batch.x, n_rows, None if exact else n_real)
            dispatched_probs = None if probs is None else _rows(batch.weight, n_rows, None if exact else n_real)
            items = (None, None, None, None, None, None, None, batch.expert_counts.clone(), T, None, overflow)
            state = HybridState(self, routing, key, n_rows, exact, tokens_per_expert)
            call.finish((dispatched, dispatched_probs, overflow))
        return dispatched, dispatched_probs, None, tokens_per_expert, HybridEPHandle(items, state)

    def _cached_dispatch(self, c: str, hidden, handle, rows: int | None):
        """A dispatch of ``hidden`` with ``handle``'s routing and rows (a backward's gradients)."""
        state = self._state_of(c, handle)
        if hidden.shape[0] != state.routing.ids.shape[0]:
            raise EPInputError(f"{c}: hidden has {hidden.shape[0]} tokens but the handle's dispatch had "
                               f"{state.routing.ids.shape[0]}.")
        if rows is not None and rows != state.n_rows:
            raise EPInputError(f"{c}: num_permuted_tokens={rows} but the handle's dispatch returned {state.n_rows} "
                               f"rows.")
        entry = self._cache.entry(state.key, state.routing.ids.shape[1], hidden.shape[0])
        with CommCall(self._cache.session, hidden.device, None, False) as call:
            batch = run_dispatch(entry, hidden, None, state.routing)
            dispatched = _rows(batch.x, state.n_rows, None if state.exact else batch.row_offsets[-1])
            call.finish((dispatched,))
        return dispatched, None, None, state.tokens_per_expert, handle

    # -- combine --------------------------------------------------------------------------------
    def combine_with_unpermute(self, *, hidden: torch.Tensor, probs: torch.Tensor | None = None,
                               handle: tuple | None = None, pad_multiple: int | None = None,
                               fuse_unpermute_combine: bool = False, num_dispatched_tokens: int | None = None):
        """HybridEP's combine with unpermute: ``(combined_token [T, H] bf16, combined_probs [T, E]
        float32 or None)``. Collective; no host read. ``hidden`` ``[rows, H]`` bf16 row-aligned
        with the handle's dispatch: each token's rows summed over every rank, unweighted.
        ``probs`` ``[rows]`` float32: each row's value put back at its (token, expert) (zero
        elsewhere), exactly."""
        c = "HybridEPBuffer.combine_with_unpermute"
        if handle is None:
            raise EPInputError(f"{c}: the handle is necessary (the one dispatch_with_permute returned).")
        state = self._state_of(c, handle)
        if _pad_multiple(c, pad_multiple) != state.key.pad_multiple:
            raise EPInputError(f"{c}: pad_multiple={pad_multiple} but the handle's dispatch used "
                               f"{state.key.pad_multiple}.")
        _check_tensor(c, "hidden", hidden, (_BF16,), (state.n_rows, state.key.hidden))
        if probs is not None:
            _check_tensor(c, "probs", probs, (torch.float32,), (state.n_rows,))
        T = state.routing.ids.shape[0]
        with CommCall(self._cache.session, hidden.device, None, False) as call:
            entry, rt_handle = open_dispatch(self._cache, state.routing, state.key, T)
            rt, to_rt = entry.runtime, entry.bridge.to_rt
            combined_probs = None
            if probs is not None:
                values = self._full_rows(entry, "probs", probs.contiguous(), state)
                slot = torch.empty(T, entry.cfg.top_k, dtype=torch.float32, device=hidden.device)
                rt.slot_values_wait(rt.slot_values_async(to_rt(values), rt_handle), out=to_rt(slot))
                ids, E = state.routing.ids, state.key.n_experts
                combined_probs = torch.zeros(T, E + 1, dtype=torch.float32, device=hidden.device)  # E: masked slots
                combined_probs.scatter_(1, torch.where(ids >= 0, ids, E).long(), slot[:, :ids.shape[1]])
                combined_probs = combined_probs[:, :E].contiguous()
            rows = self._full_rows(entry, "hidden", hidden.contiguous(), state)
            out = torch.empty(T, state.key.hidden, dtype=_BF16, device=hidden.device)
            entry.open = None
            rt.combine_wait(rt.combine_async(to_rt(rows), rt_handle, weights=None), out=to_rt(out))
            call.finish((out, combined_probs))
        return out, combined_probs

    # -- what the layer does not do ---------------------------------------------------------------
    def dispatch(self, *args, **kwargs):
        raise unsupported("HybridEPBuffer.dispatch", "HybridEP's dispatch without permute",
                          "Call dispatch_with_permute (Megatron-core's path)")

    def combine(self, *args, **kwargs):
        raise unsupported("HybridEPBuffer.combine", "HybridEP's combine without unpermute",
                          "Call combine_with_unpermute (Megatron-core's path)")

    # -- internals -------------------------------------------------------------------------------
    def _state_of(self, c: str, handle) -> HybridState:
        if not isinstance(handle, HybridEPHandle) or handle.state.owner is not self:
            raise EPInputError(f"{c}: handle must be one this HybridEPBuffer's dispatch_with_permute returned; got "
                               f"{type(handle).__name__}.")
        return handle.state

    def _routing_width(self, routing_map: torch.Tensor) -> int:
        """A non-blocking call's routing width: the runtime's, or at its first call (which builds
        it, collectively) every rank's most experts of a token, gathered (one read)."""
        for key, entry in self._cache.entries.items():
            if key.layout == "expanded" and key.n_experts == routing_map.shape[1]:
                return entry.cfg.top_k
        most = routing_map.sum(1).max() if routing_map.shape[0] else torch.zeros((), dtype=torch.int64)
        return max(1, int(self._cache.gather_values(most.view(1).long().to(routing_map.device))[:, 0].max()))

    def _gather_routing(self, routing_map: torch.Tensor, pad: int):
        """A blocking call's agreement (one read, collective): the routing width (every rank's most
        experts of a token), the most tokens of a rank, and this rank's padded per-expert counts
        (host int64 ``[L]``, HybridEP's ``tokens_per_expert``)."""
        T, E = routing_map.shape
        L = E // self.group_size
        mine = torch.cat([torch.tensor([T], device=routing_map.device),
                          routing_map.sum(1).max().view(1) if T else torch.zeros(1, dtype=torch.int64,
                                                                                   device=routing_map.device),
                          routing_map.sum(0)]).long()
        table = self._cache.gather_values(mine)
        counts = table[:, 2 + self.rank * L:2 + (self.rank + 1) * L].sum(0)
        return max(1, int(table[:, 1].max())), (counts + pad - 1) // pad * pad, int(table[:, 0].max())

    def _full_rows(self, entry: RuntimeEntry, name: str, rows: torch.Tensor, state: HybridState) -> torch.Tensor:
        """``rows`` as the runtime reads them: as they are when they are exactly the batch's, else
        in a buffer of the batch's capacity, zero past them (rows dropped at the dispatch add nothing)."""
        if state.exact:
            return rows
        cap = entry.cfg.recv_rows_capacity
        shape = (cap,) + tuple(rows.shape[1:])
        key = (name, shape, rows.dtype)
        held = self._rows_buffers.get(key)
        if held is None:
            held = self._rows_buffers[key] = [torch.zeros(shape, dtype=rows.dtype, device=rows.device), 0]
        buf, written = held
        n = min(rows.shape[0], cap)
        if written > n:
            buf[n:written].zero_()
        buf[:n] = rows[:n]
        held[1] = n
        return buf

    def _debug_checks(self, c, entry, routing_map, width, n_batch, n_rows, counts) -> None:
        """Debug mode (host reads): a non-blocking call's routing fits its width and rows; a
        blocking call's counts are the batch's."""
        if not (entry.runtime.debug if self._debug is None else self._debug):
            return
        most = int(routing_map.sum(1).max()) if routing_map.shape[0] else 0
        if most > width:
            raise EPInputError(f"{c}: a token has {most} experts in routing_map but this non-blocking call routes "
                               f"{width} (the width of the first call); make a blocking call (non_blocking=False) "
                               f"first with the widest routing, so the layer widens its buffers.")
        if counts is not None and int(n_batch) != int(counts.sum()):
            raise EPInputError(f"{c}: the batch has {int(n_batch)} rows but the gathered counts give "
                               f"{int(counts.sum())}: the ranks' routing maps changed during the call.")
        if counts is None and int(n_batch) > n_rows:
            raise EPInputError(f"{c}: the batch has {int(n_batch)} rows but num_permuted_tokens={n_rows}; rows past "
                               f"it would not be sent (overflow_flag).")


def _rows(view: torch.Tensor, n_rows: int, n_batch) -> torch.Tensor:
    """A copy of the first ``n_rows`` rows of a batch view (the next dispatch overwrites it), zero
    past ``n_batch`` (the batch's rows: an int or a device scalar; None: ``n_rows`` is the batch's)."""
    if n_batch is None:
        return view[:n_rows].clone()
    n = min(n_rows, view.shape[0])
    out = torch.zeros((n_rows,) + tuple(view.shape[1:]), dtype=view.dtype, device=view.device)
    live = torch.arange(n, device=view.device) < n_batch
    out[:n] = torch.where(live.view(-1, *([1] * (view.dim() - 1))), view[:n], torch.zeros((), dtype=view.dtype,
                                                                                             device=view.device))
    return out


def _routing_map(c: str, T: int, routing_map, probs, topk_idx, topk_weights, num_of_experts):
    """``(routing_map [T, E] bool, probs [T, E] float32 or None)`` of either routing form."""
    if routing_map is None:
        if topk_idx is None or num_of_experts is None:
            raise EPInputError(f"{c}: pass routing_map (with probs), or topk_idx (with topk_weights) and "
                               f"num_of_experts, or a handle.")
        _check_tensor(c, "topk_idx", topk_idx, (torch.int32, torch.int64), (T, None))
        live = topk_idx >= 0
        routing_map = torch.zeros(T, num_of_experts + 1, dtype=torch.bool, device=topk_idx.device)
        routing_map.scatter_(1, torch.where(live, topk_idx, num_of_experts).long(), True)
        routing_map = routing_map[:, :num_of_experts]
        if topk_weights is not None:
            _check_tensor(c, "topk_weights", topk_weights, (torch.float32,), tuple(topk_idx.shape))
            probs = torch.zeros(T, num_of_experts + 1, dtype=torch.float32, device=topk_idx.device)
            probs.scatter_(1, torch.where(live, topk_idx, num_of_experts).long(), topk_weights)
            probs = probs[:, :num_of_experts]
    _check_tensor(c, "routing_map", routing_map, (torch.bool,), (T, None))
    if probs is not None:
        _check_tensor(c, "probs", probs, (torch.float32,), tuple(routing_map.shape))
        probs = probs.detach()
    return routing_map, probs


def _pad_multiple(c: str, pad_multiple) -> int:
    if pad_multiple is None or pad_multiple == 0:
        return 1
    if isinstance(pad_multiple, bool) or not isinstance(pad_multiple, int) or pad_multiple < 0:
        raise EPInputError(f"{c}: pad_multiple={pad_multiple!r} must be a positive int or None.")
    return pad_multiple
