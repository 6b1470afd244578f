"""Megatron-core's ``fused_a2a`` interface on ep_runtime (``megatron.core.transformer.moe.fused_a2a``).

The names, argument lists and return values of Megatron-core 0.16's module, so its flex token
dispatcher runs on ep_runtime (:func:`install` points an installed Megatron-core at them):

- DeepEP's pair, :class:`FusedDispatch` / :class:`FusedCombine` (``fused_dispatch``,
  ``fused_combine``, :func:`get_buffer`, :func:`get_hidden_bytes`): top-k indices and
  probabilities in, one row per (token, destination rank) out, as DeepEP's ``recv_x``. It runs
  on the runtime's compact layout (:mod:`ep_runtime.integrations.torch_compact`).
- HybridEP's pair, :class:`HybridEPDispatch` / :class:`HybridEPCombine` (``hybrid_ep_dispatch``,
  ``hybrid_ep_combine``, :func:`init_hybrid_ep_buffer`): a dense routing map and probabilities
  in, the expert-major batch out (one row per (token, local expert), each expert's segment
  padded to ``pad_multiple``). It runs on the expanded layout.

In both, the caller's experts apply the probabilities (Megatron multiplies them into the expert
activations) and the combine sums rows unweighted; the probabilities that travelled with the
dispatch are differentiable, and their gradient goes home in the dispatch's backward.

Shapes, with ``T`` this rank's tokens, ``K`` the slots per token, ``R`` the group's ranks,
``C = max_tokens_per_rank`` (the buffer's token capacity, the same on every rank), ``L`` local
experts::

    FusedDispatch   x [T, H] bf16, token_indices [T, K] int (-1: masked), token_probs [T, K] f32
                    -> recv_x [R * C, H] bf16 (row s * C + t: token t of rank s, zero if it did
                       not come here), recv_token_indices [R * C, K] int64 (local expert id or
                       -1), recv_token_probs [R * C, K] f32, tokens_per_expert [L] int64 (CPU),
                       handle
    FusedCombine    x [R * C, H] bf16 (this rank's per-token sums) -> out [T, H] bf16, None
    HybridEPDispatch  x [T, H] bf16, routing_map [T, E] bool, probs [T, E] f32
                    -> hidden [rows, H] bf16, probs [rows] f32, None, tokens_per_expert [L]
                       int64, handle
    HybridEPCombine x [rows, H] bf16 -> out [T, H] bf16

What a training step costs (per layer): forward 1 dispatch + 1 combine; backward 1 dispatch of
``dL/dout`` (the combine's backward, left open) and 1 combine of the row gradients on it (the
dispatch's backward), plus, when the probabilities need a gradient (training the router), their
``T x K`` values home on that same dispatch, before its combine (``EPRuntime.slot_values``: a
float a slot). DeepEP and HybridEP move those values inside the backward combine.

Buffers: one runtime per (group, kind), built at the first call of its kind with
``max_tokens_per_rank`` the largest ``T`` over the group's ranks at that call (one host
gather), or the ``seq_len`` of :func:`init_hybrid_ep_buffer`, or ``max_tokens_per_rank`` of
:func:`get_buffer`; a later call with more tokens raises :class:`~ep_runtime.core.errors.EPInputError`
before anything is sent (size the buffer up front). Sessions: :func:`use_session` binds a
session a job already opened to its group; otherwise the group's session comes from
:func:`ep_runtime.shmem.session_for`.

Collective and stream-ordered as :mod:`ep_runtime.integrations.torch`: every rank of the group calls each
function the same number of times in the same order. ``async_finish`` and
``allocate_on_comm_stream`` are accepted and need nothing here: the runtime's kernels are
ordered after the caller's stream and the caller's stream after them, without host waits.
``num_sms_dispatch_api`` / ``num_sms_combine_api`` are accepted and not used (the execution
plan sizes the grids).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from ep_runtime.core.config import EPConfig
from ep_runtime.core.errors import EPInputError
from ep_runtime.core.layout import BufferLayout
from ep_runtime.core.runtime import EPRuntime
from ep_runtime.integrations.torch import (_BF16, _OPEN_BACKWARD, _Bridge, _close, _combine, _dispatch, _keep, _rows,
                                           _same_tensor, slot_values_home)
from ep_runtime.integrations.torch_compact import _combine_compact, _dispatch_compact, _received_rows

#: Megatron-core's module these functions stand in for (:func:`install`).
MEGATRON_MODULES = ("megatron.core.transformer.moe.fused_a2a", "megatron.core.transformer.moe.token_dispatcher")


# -- sessions and buffers -----------------------------------------------------------------------------
_SESSIONS: dict = {}   # id(group) -> (group, session)
_RUNTIMES: dict = {}   # (id(group), kind) -> EPRuntime
_HYBRID: dict = {}     # id(group) -> init_hybrid_ep_buffer's sizes


def use_session(session, group=None) -> None:
    """Bind an open ep_runtime session (:func:`~ep_runtime.shmem.open_session`) to ``group``
    (a ``torch.distributed`` ProcessGroup; ``None``: the default group), for the functions of
    this module that take that group. Not collective. The session must span the same ranks
    in the same order."""
    _SESSIONS[_group_key(group)] = (group, session)


def _group_key(group) -> int:
    if group is None:
        import torch.distributed as dist

        group = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
    return id(group)


def _session_of(group, heap_bytes: int):
    bound = _SESSIONS.get(_group_key(group))
    if bound is not None:
        return bound[1]
    from ep_runtime.shmem import DEFAULT_SESSION_HEAP_BYTES, session_for

    return session_for(group, max(heap_bytes, DEFAULT_SESSION_HEAP_BYTES))


def _largest_over_group(group, *values: int) -> tuple[int, ...]:
    """Each of ``values``' largest over the group's ranks (a host collective: through the bound
    session, or the group's own bootstrap)."""
    bound = _SESSIONS.get(_group_key(group))
    if bound is not None:
        gathered = bound[1].allgather_object(tuple(int(v) for v in values))
    else:
        from ep_runtime.shmem.bootstrap import bootstrap_group

        gathered = bootstrap_group(group).allgather_object(tuple(int(v) for v in values))
    return tuple(max(g[i] for g in gathered) for i in range(len(values)))


def get_hidden_bytes(x: torch.Tensor) -> int:
    """Bytes of one row of ``x`` [T, hidden] as Megatron counts them: ``hidden * max(element size, 2)``."""
    return x.size(1) * max(x.element_size(), 2)


def get_buffer(group, hidden_bytes: int, n_experts: int | None = None, top_k: int | None = None,
               max_tokens_per_rank: int | None = None) -> EPRuntime | None:
    """The runtime of ``group`` for :class:`FusedDispatch` (the compact layout), Megatron's
    ``get_buffer(group, hidden_bytes)``. Collective when it builds one.

    With only Megatron's two arguments it returns the runtime built by an earlier dispatch
    (``None`` before the first: the runtime needs the expert count, ``top_k`` and the token
    capacity, which the first :class:`FusedDispatch` call brings). Given ``n_experts``,
    ``top_k`` and ``max_tokens_per_rank`` it builds (or grows) the runtime now, so the first
    dispatch needs no host gather and any later ``T`` up to ``max_tokens_per_rank`` fits.
    """
    if hidden_bytes <= 0 or hidden_bytes % 2:
        raise EPInputError(f"get_buffer: hidden_bytes={hidden_bytes} must be a positive even number of bytes "
                           f"(get_hidden_bytes(x)).")
    if n_experts is None:
        return _RUNTIMES.get((_group_key(group), "deepep"))
    if top_k is None or max_tokens_per_rank is None:
        raise EPInputError("get_buffer: pass n_experts, top_k and max_tokens_per_rank together (or none of them).")
    return _runtime(group, "deepep", hidden_bytes // 2, n_experts, top_k, max_tokens_per_rank, 1, agreed=True)


def _runtime(group, kind: str, hidden: int, n_experts: int, top_k: int | None, tokens: int, pad_multiple: int,
             agreed: bool = False) -> EPRuntime:
    """The cached runtime of (group, kind), built when absent or when its shape differs.
    ``tokens`` is this rank's T and ``top_k`` this rank's slots per token (``None``: keep the
    cached runtime's); unless ``agreed`` (the caller passes bounds equal on every rank), a build
    takes the largest of each over the group."""
    key = (_group_key(group), kind)
    rt = _RUNTIMES.get(key)
    layouts = ("compact",) if kind == "deepep" else ("expanded",)
    if rt is not None:
        c = rt.cfg
        if (c.hidden, c.n_experts, c.pad_multiple) == (hidden, n_experts, pad_multiple) and top_k in (None, c.top_k):
            if tokens > c.max_tokens_per_rank:
                raise EPInputError(
                    f"{kind}: this rank has {tokens} tokens but the buffer holds {c.max_tokens_per_rank} per rank "
                    f"(set by the first call). Size it for the largest batch before the first call: "
                    f"ep_runtime.integrations.megatron.get_buffer(group, hidden_bytes, n_experts, top_k, max_tokens_per_rank) "
                    f"or init_hybrid_ep_buffer(..., seq_len=...).")
            return rt
        tokens, top_k = max(tokens, c.max_tokens_per_rank), top_k or c.top_k
        rt.close()
        del _RUNTIMES[key]
    hybrid = _HYBRID.get(key[0]) if kind == "hybridep" else None
    tokens = max(tokens, hybrid["seq_len"] if hybrid else 0, 1)
    if not agreed:
        tokens, top_k = _largest_over_group(group, tokens, top_k or 1)
    top_k = max(1, min(top_k, n_experts))
    session = None if key[0] not in _SESSIONS else _SESSIONS[key[0]][1]
    n_ranks = session.n_ranks if session is not None else _group_size(group)
    cfg = EPConfig(n_ranks=n_ranks, n_experts=n_experts, top_k=top_k, hidden=hidden, max_tokens_per_rank=tokens,
                   pad_multiple=pad_multiple, layouts=layouts)
    # every rank builds the same config, so the heap of a session opened here is the same everywhere;
    # twice the first buffer's bytes (at least the default heap) leaves room for it to grow
    session = session or _session_of(group, 2 * BufferLayout(cfg).symmetric_bytes)
    rt = _RUNTIMES[key] = EPRuntime(cfg, session)
    return rt


def _group_size(group) -> int:
    from ep_runtime.shmem.bootstrap import bootstrap_group

    return bootstrap_group(group).size


def close_buffers() -> None:
    """Close every runtime of this module. Collective; call it before closing the sessions."""
    for key in list(_RUNTIMES):
        _close(_RUNTIMES.pop(key))
    _HYBRID.clear()


# -- DeepEP's pair: the compact layout ----------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class DeepEPHandle:
    """What :class:`FusedDispatch` hands to :class:`FusedCombine` (Megatron keeps it opaque)."""

    runtime: EPRuntime
    rt_handle: object
    n_tokens: int
    received: torch.Tensor       # [R * C] bool, rows of recv_x holding a token that came here
    recv_slots: torch.Tensor     # [R * C, K] bool, the (row, slot) pairs served here
    topk_ids: torch.Tensor       # [T, K] int32, the routing (the backward dispatches with it)
    topk_weights: torch.Tensor   # [T, K] float32


def _recv_slots(bridge: _Bridge, batch, cfg: EPConfig, rows: int):
    """``(indices, probs)`` [rows, K]: per received row and slot, the local expert and its probability
    (-1 and 0 where the slot's expert is elsewhere), from the batch's expert-major row lists."""
    n = int(bridge.from_rt(batch.row_offsets)[-1])
    offsets = bridge.from_rt(batch.row_offsets).long()
    gather = bridge.from_rt(batch.gather)[:n].long()
    src_k = bridge.from_rt(batch.src_k)[:n].long()
    weight = bridge.from_rt(batch.weight)[:n]
    expert = torch.repeat_interleave(torch.arange(cfg.n_local_experts, device=bridge.device), offsets.diff(), output_size=n)
    real = gather >= 0
    flat = (gather * cfg.top_k + src_k)[real]
    indices = torch.full((rows * cfg.top_k,), -1, dtype=torch.int64, device=bridge.device)
    probs = torch.zeros(rows * cfg.top_k, dtype=torch.float32, device=bridge.device)
    indices[flat] = expert[real]
    probs[flat] = weight[real]
    return indices.view(rows, cfg.top_k), probs.view(rows, cfg.top_k)


class FusedDispatch(torch.autograd.Function):
    """Megatron's ``FusedDispatch`` (DeepEP's dispatch) on the compact layout.

    ``FusedDispatch.apply(x, token_indices, token_probs, num_experts, group, async_finish=False,
    allocate_on_comm_stream=False)`` -> ``(recv_x, recv_token_indices, recv_token_probs,
    tokens_per_expert, handle)``, shapes in the module docstring. ``recv_x`` and
    ``recv_token_probs`` are differentiable. ``tokens_per_expert`` is read on the host (a
    synchronization on GPUs, as DeepEP's).

    Backward: ``dL/dx[t] = sum over the ranks it went to of dL/drecv_x[s C + t]`` (1 combine, on
    the dispatch :class:`FusedCombine`'s backward left open), and ``dL/dtoken_probs[t, k]`` from
    ``dL/drecv_token_probs`` on the rank of slot k's expert (1 dispatch + 1 combine, only when
    the probabilities need a gradient).
    """

    @staticmethod
    def forward(ctx, x, token_indices, token_probs, num_experts, group, async_finish=False,
                allocate_on_comm_stream=False):
        c = "FusedDispatch"
        if not isinstance(x, torch.Tensor) or x.dim() != 2:
            raise EPInputError(f"{c}: x must be a [T, hidden] bfloat16 tensor; got {getattr(x, 'shape', type(x))}.")
        if token_indices.dim() != 2 or token_indices.shape[0] != x.shape[0]:
            raise EPInputError(f"{c}: token_indices must be [T, top_k] with T={x.shape[0]}; got "
                               f"{list(token_indices.shape)}.")
        rt = _runtime(group, "deepep", x.shape[1], int(num_experts), token_indices.shape[1], x.shape[0], 1)
        bridge, cfg = _Bridge(rt), rt.cfg
        bridge.check(x, c, "x", (_BF16,), (None, cfg.hidden))
        bridge.check(token_indices, c, "token_indices", (torch.int32, torch.int64), (x.shape[0], cfg.top_k))
        bridge.check(token_probs, c, "token_probs", (torch.float32,), (x.shape[0], cfg.top_k))
        ids, weights = token_indices.to(torch.int32).contiguous(), token_probs.detach().contiguous()
        batch = _dispatch_compact(bridge, x.contiguous(), ids, weights)
        rows = cfg.n_ranks * cfg.max_tokens_per_rank
        recv_x, received = _received_rows(bridge, batch, rows)
        indices, probs = _recv_slots(bridge, batch, cfg, rows)
        counts = bridge.from_rt(batch.expert_counts).to(device="cpu", dtype=torch.int64)
        handle = DeepEPHandle(rt, batch.handle, x.shape[0], received, indices >= 0, ids, weights)
        ctx.mark_non_differentiable(indices, counts)
        ctx.handle = handle
        return recv_x, indices, probs, counts, handle

    @staticmethod
    def backward(ctx, grad_recv_x, _grad_indices, grad_recv_probs, _grad_counts, _grad_handle):
        h = ctx.handle
        bridge, cfg, T = _Bridge(h.runtime), h.runtime.cfg, h.n_tokens
        want_probs = ctx.needs_input_grad[2] and grad_recv_probs is not None
        grad_x = grad_probs = None
        if not (ctx.needs_input_grad[0] or want_probs):
            return grad_x, None, grad_probs, None, None, None, None
        rt_handle = _open_or_redispatch(bridge, h, "compact")
        if want_probs:  # the slot values first: the combine ends the dispatch
            values = torch.where(h.recv_slots, grad_recv_probs.float(), 0.0)
            grad_probs = slot_values_home(bridge, _compact_row_values(bridge, values), rt_handle, T)
        if ctx.needs_input_grad[0]:
            rows = (torch.zeros(cfg.n_ranks * cfg.max_tokens_per_rank, cfg.hidden, dtype=_BF16, device=bridge.device)
                    if grad_recv_x is None else grad_recv_x.to(_BF16).contiguous())
            grad_x = _combine_compact(bridge, rows, rt_handle, T)
        return grad_x, None, grad_probs, None, None, None, None


def _compact_row_values(bridge: _Bridge, values: torch.Tensor) -> torch.Tensor:
    """float32 [capacity]: ``values[gather[i], src_k[i]]`` (``values`` [R * C, K], per received row
    and slot) for each row i of the runtime's current compact batch, 0 on padding rows."""
    rt = bridge.runtime
    gather = bridge.from_rt(rt.buffers["row_gather"]).long()
    src_k = bridge.from_rt(rt.buffers["row_src_k"]).long()
    picked = values[gather.clamp(min=0), src_k.clamp(min=0)]
    return torch.where((gather >= 0) & (src_k >= 0), picked, 0.0)


def _open_or_redispatch(bridge: _Bridge, h, layout: str):
    """A dispatch handle with the forward's routing ready for a combine: the one the combine's
    backward left open, else a new dispatch of zeros (unit weights)."""
    rt, cfg = h.runtime, h.runtime.cfg
    opened = _OPEN_BACKWARD.pop(id(rt), None)
    if opened is not None and _same_tensor(opened[1], h.topk_ids) and opened[2] == layout:
        return opened[0]
    zeros = torch.zeros(h.n_tokens, cfg.hidden, dtype=_BF16, device=bridge.device)
    ones = torch.ones(h.n_tokens, cfg.top_k, dtype=torch.float32, device=bridge.device)
    if layout == "compact":
        return _dispatch_compact(bridge, zeros, h.topk_ids, ones).handle
    return _dispatch(bridge, zeros, h.topk_ids, ones).handle


class FusedCombine(torch.autograd.Function):
    """Megatron's ``FusedCombine`` (DeepEP's combine) on the compact layout: ``out[t] = sum over
    the ranks token t went to of x[s C + t]`` there, unweighted.

    ``FusedCombine.apply(x, group, handle, async_finish=False, allocate_on_comm_stream=False)``
    -> ``(out [T, H] bf16, None)``. Backward: 1 dispatch of ``dL/dout`` with the forward's
    routing (kept by the forward when ``x`` needs a gradient: no routing sent again), left open
    for :class:`FusedDispatch`'s backward.
    """

    @staticmethod
    def forward(ctx, x, group, handle, async_finish=False, allocate_on_comm_stream=False):
        c = "FusedCombine"
        if not isinstance(handle, DeepEPHandle):
            raise EPInputError(f"{c}: handle must be the one FusedDispatch returned; got {type(handle).__name__}.")
        bridge, cfg = _Bridge(handle.runtime), handle.runtime.cfg
        bridge.check(x, c, "x", (_BF16,), (cfg.n_ranks * cfg.max_tokens_per_rank, cfg.hidden))
        ctx.kept = _keep(bridge, handle.rt_handle) if ctx.needs_input_grad[0] else None
        out = _combine_compact(bridge, x.contiguous(), handle.rt_handle, handle.n_tokens)
        ctx.handle = handle
        return out, None

    @staticmethod
    def backward(ctx, grad_out, _grad_none=None):
        h = ctx.handle
        bridge = _Bridge(h.runtime)
        batch = _dispatch_compact(bridge, grad_out.to(_BF16).contiguous(), routing=ctx.kept)  # the forward's routing
        rows = torch.where(h.received[:, None], bridge.from_rt(batch.x), torch.zeros((), dtype=_BF16,
                                                                                      device=bridge.device))
        _OPEN_BACKWARD[id(h.runtime)] = (batch.handle, h.topk_ids, "compact")
        return rows, None, None, None, None


def fused_dispatch(x, token_indices, token_probs, num_experts, group, async_finish=False,
                   allocate_on_comm_stream=False):
    """Megatron's ``fused_dispatch``: :class:`FusedDispatch`."""
    return FusedDispatch.apply(x.contiguous(), token_indices, token_probs, num_experts, group, async_finish,
                               allocate_on_comm_stream)


def fused_combine(x, group, handle, async_finish=False, allocate_on_comm_stream=False):
    """Megatron's ``fused_combine``: :class:`FusedCombine`, ``(out, None)``."""
    return FusedCombine.apply(x, group, handle, async_finish, allocate_on_comm_stream)


def set_deepep_num_sms(num_sms) -> None:
    """Megatron's ``set_deepep_num_sms``: accepted; the execution plan sizes the grids."""


# -- HybridEP's pair: the expanded layout -------------------------------------------------------------
def init_hybrid_ep_buffer(group, hidden_dim: int, seq_len: int, num_local_experts: int, num_sms_dispatch_api: int,
                          num_sms_combine_api: int, fp8_dispatch: bool) -> None:
    """Megatron's ``init_hybrid_ep_buffer``: records the group's sizes (``seq_len``: the most tokens
    any rank dispatches); the runtime is built at the first :class:`HybridEPDispatch`, which knows
    ``top_k`` (from the routing map) and ``pad_multiple``. Not collective. ``fp8_dispatch=True``
    is refused, as Megatron-core 0.16 refuses it."""
    if fp8_dispatch:
        raise EPInputError("init_hybrid_ep_buffer: fp8_dispatch=True is not supported by Megatron-core's HybridEP "
                           "path; use ep_runtime.EPRuntime with token_dtype='fp8_e4m3' directly.")
    _HYBRID[_group_key(group)] = {"hidden": hidden_dim, "seq_len": seq_len, "num_local_experts": num_local_experts}


def reset_hybrid_ep_buffer() -> None:
    """Megatron's ``reset_hybrid_ep_buffer``: forget the recorded sizes (the runtimes stay until
    :func:`close_buffers`)."""
    _HYBRID.clear()


@dataclass(frozen=True, eq=False)
class HybridEPHandle:
    """What :class:`HybridEPDispatch` hands to :class:`HybridEPCombine`."""

    runtime: EPRuntime
    rt_handle: object
    n_tokens: int
    n_rows: int
    row_valid: torch.Tensor | None   # [rows] bool, rows before the batch's end (None: n_rows is exact)
    row_src_k: torch.Tensor          # [rows] int32, the slot each row came from (-1: padding)
    topk_ids: torch.Tensor           # [T, K] int32
    n_experts: int


def _routing_map_to_ids(routing_map: torch.Tensor, top_k: int) -> torch.Tensor:
    """``[T, top_k]`` int32: each token's experts in increasing order, -1 after the last."""
    flags = routing_map.to(torch.int8)
    order = torch.sort(flags, dim=1, descending=True, stable=True)
    ids = order.indices[:, :top_k].to(torch.int32)
    return torch.where(order.values[:, :top_k] > 0, ids, torch.full_like(ids, -1))


class HybridEPDispatch(torch.autograd.Function):
    """Megatron's ``HybridEPDispatch`` on the expanded layout.

    ``HybridEPDispatch.apply(x, routing_map, probs, group, num_local_experts, num_sms_dispatch_api=24,
    num_sms_combine_api=24, num_permuted_tokens=None, pad_multiple=None)`` -> ``(hidden,
    row_probs, None, tokens_per_expert, handle)``: ``hidden`` [rows, H] bf16 expert-major
    (each expert's segment starting at a multiple of ``pad_multiple``, padding rows zero),
    ``row_probs`` [rows] float32 (each row's probability; differentiable), tokens_per_expert
    [L] int64 (padded counts when ``pad_multiple`` is given). ``rows`` is
    ``num_permuted_tokens`` when given (no host synchronization; rows past the batch's end are
    zero), else the batch's rows, read on the host.

    ``top_k`` is the most experts any token of any rank has in the first call's routing map (one
    host gather; the buffer keeps it); a later token with more raises in debug mode.

    Backward: ``dL/dx`` in 1 combine (on the dispatch :class:`HybridEPCombine`'s backward left
    open) and ``dL/dprobs`` [T, E] (zero off the routing map) in 1 dispatch + 1 combine, when
    ``probs`` needs a gradient.
    """

    @staticmethod
    def forward(ctx, x, routing_map, probs, group, num_local_experts, num_sms_dispatch_api=24,
                num_sms_combine_api=24, num_permuted_tokens=None, pad_multiple=None):
        c = "HybridEPDispatch"
        if not isinstance(x, torch.Tensor) or x.dim() != 2:
            raise EPInputError(f"{c}: x must be a [T, hidden] bfloat16 tensor; got {getattr(x, 'shape', type(x))}.")
        T = x.shape[0]
        if routing_map.dim() != 2 or routing_map.shape[0] != T or probs.shape != routing_map.shape:
            raise EPInputError(f"{c}: routing_map and probs must both be [T, n_experts] with T={T}; got "
                               f"{list(routing_map.shape)} and {list(probs.shape)}.")
        E = routing_map.shape[1]
        top_k = None  # the cached runtime's; the first build takes the most experts of a token over the group
        if (_group_key(group), "hybridep") not in _RUNTIMES:
            top_k = int(routing_map.sum(dim=1).max()) if T else 0
        rt = _runtime(group, "hybridep", x.shape[1], E, top_k, T, pad_multiple or 1)
        bridge, cfg = _Bridge(rt), rt.cfg
        if E != num_local_experts * cfg.n_ranks:
            raise EPInputError(f"{c}: routing_map has {E} experts but num_local_experts={num_local_experts} on "
                               f"{cfg.n_ranks} ranks gives {num_local_experts * cfg.n_ranks}.")
        bridge.check(x, c, "x", (_BF16,), (None, cfg.hidden))
        bridge.check(routing_map, c, "routing_map", (torch.bool,), (T, E))
        bridge.check(probs, c, "probs", (torch.float32,), (T, E))
        if rt.debug and T and int(routing_map.sum(dim=1).max()) > cfg.top_k:
            raise EPInputError(f"{c}: a token has {int(routing_map.sum(dim=1).max())} experts in routing_map but "
                               f"the buffer was built for {cfg.top_k} (the most in the first call).")
        ids = _routing_map_to_ids(routing_map, cfg.top_k)
        weights = torch.where(ids >= 0, probs.detach().gather(1, ids.clamp(min=0).long()), 0.0).contiguous()
        if num_permuted_tokens is not None and not 0 <= int(num_permuted_tokens) <= cfg.recv_rows_capacity:
            raise EPInputError(f"{c}: num_permuted_tokens={int(num_permuted_tokens)} must be in [0, "
                               f"{cfg.recv_rows_capacity}] (the buffer's row capacity).")
        batch = _dispatch(bridge, x.contiguous(), ids, weights)
        offsets = bridge.from_rt(batch.row_offsets)
        if num_permuted_tokens is None:
            n_rows, valid = int(offsets[-1]), None
        else:
            n_rows = int(num_permuted_tokens)
            valid = torch.arange(n_rows, device=bridge.device) < offsets[-1]
        hidden = _rows(bridge.from_rt(batch.x), n_rows, valid, 0)
        row_probs = _rows(bridge.from_rt(batch.weight), n_rows, valid, 0)
        src_k = _rows(bridge.from_rt(batch.src_k), n_rows, valid, -1)
        counts = (offsets.diff() if pad_multiple else bridge.from_rt(batch.expert_counts)).to(torch.int64)
        handle = HybridEPHandle(rt, batch.handle, T, n_rows, valid, src_k, ids, E)
        ctx.mark_non_differentiable(counts)
        ctx.handle = handle
        return hidden, row_probs, None, counts, handle

    @staticmethod
    def backward(ctx, grad_x, grad_probs, _grad_scaling, _grad_counts, _grad_handle):
        h = ctx.handle
        bridge, cfg, T = _Bridge(h.runtime), h.runtime.cfg, h.n_tokens
        want_probs = ctx.needs_input_grad[2] and grad_probs is not None
        grad_tokens = grad_dense = None
        if not (ctx.needs_input_grad[0] or want_probs):
            return grad_tokens, None, grad_dense, None, None, None, None, None, None
        rt_handle = _open_or_redispatch(bridge, h, "expanded")
        if want_probs:  # the slot values first: the combine ends the dispatch
            values = torch.where(h.row_src_k >= 0, grad_probs.float(), 0.0)  # [n_rows], one per row
            home = slot_values_home(bridge, values, rt_handle, T)
            grad_dense = torch.zeros(T, h.n_experts, dtype=torch.float32, device=bridge.device)
            grad_dense.scatter_add_(1, h.topk_ids.clamp(min=0).long(), torch.where(h.topk_ids >= 0, home, 0.0))
        if ctx.needs_input_grad[0]:
            rows = (torch.zeros(h.n_rows, cfg.hidden, dtype=_BF16, device=bridge.device) if grad_x is None
                    else grad_x.to(_BF16).contiguous())
            grad_tokens = _combine(bridge, rows, rt_handle, T, weights=None)
        return grad_tokens, None, grad_dense, None, None, None, None, None, None


class HybridEPCombine(torch.autograd.Function):
    """Megatron's ``HybridEPCombine`` on the expanded layout: ``out[t] = sum of the rows of token t``
    over every rank, unweighted (the experts applied the probabilities).

    ``HybridEPCombine.apply(x, handle, num_permuted_tokens=None, pad_multiple=None)`` -> ``out``
    [T, H] bf16. Backward: 1 dispatch of ``dL/dout`` with the forward's routing (kept by the
    forward: no routing sent again), its rows (zero on padding) the gradient of ``x``; left open
    for :class:`HybridEPDispatch`'s backward.
    """

    @staticmethod
    def forward(ctx, x, handle, num_permuted_tokens=None, pad_multiple=None):
        c = "HybridEPCombine"
        if not isinstance(handle, HybridEPHandle):
            raise EPInputError(f"{c}: handle must be the one HybridEPDispatch returned; got {type(handle).__name__}.")
        bridge, cfg = _Bridge(handle.runtime), handle.runtime.cfg
        bridge.check(x, c, "x", (_BF16,), (handle.n_rows, cfg.hidden))
        ctx.handle = handle
        ctx.kept = _keep(bridge, handle.rt_handle) if ctx.needs_input_grad[0] else None
        return _combine(bridge, x.contiguous(), handle.rt_handle, handle.n_tokens, weights=None)

    @staticmethod
    def backward(ctx, grad_out):
        h = ctx.handle
        bridge = _Bridge(h.runtime)
        batch = _dispatch(bridge, grad_out.to(_BF16).contiguous(), routing=ctx.kept)  # the forward's routing
        grad_rows = _rows(bridge.from_rt(batch.x), h.n_rows, h.row_valid, 0)
        _OPEN_BACKWARD[id(h.runtime)] = (batch.handle, h.topk_ids, "expanded")
        return grad_rows, None, None, None


def hybrid_ep_dispatch(x, routing_map, probs, group, num_local_experts, num_sms_dispatch_api=24,
                       num_sms_combine_api=24, num_permuted_tokens=None, pad_multiple=None):
    """Megatron's ``hybrid_ep_dispatch``: :class:`HybridEPDispatch`."""
    return HybridEPDispatch.apply(x, routing_map, probs, group, num_local_experts, num_sms_dispatch_api,
                                  num_sms_combine_api, num_permuted_tokens, pad_multiple)


def hybrid_ep_combine(x, handle, num_permuted_tokens, pad_multiple):
    """Megatron's ``hybrid_ep_combine``: :class:`HybridEPCombine`."""
    return HybridEPCombine.apply(x, handle, num_permuted_tokens, pad_multiple)


# -- pointing Megatron-core at these functions -----------------------------------------------------------
_EXPORTS = {
    "get_hidden_bytes": get_hidden_bytes, "get_buffer": get_buffer, "FusedDispatch": FusedDispatch,
    "FusedCombine": FusedCombine, "fused_dispatch": fused_dispatch, "fused_combine": fused_combine,
    "set_deepep_num_sms": set_deepep_num_sms, "init_hybrid_ep_buffer": init_hybrid_ep_buffer,
    "reset_hybrid_ep_buffer": reset_hybrid_ep_buffer, "HybridEPDispatch": HybridEPDispatch,
    "HybridEPCombine": HybridEPCombine, "hybrid_ep_dispatch": hybrid_ep_dispatch,
    "hybrid_ep_combine": hybrid_ep_combine, "HAVE_DEEP_EP": True, "HAVE_HYBRIDEP": True,
}


def install() -> list[str]:
    """Point an installed Megatron-core's ``fused_a2a`` (and the names its token dispatcher
    imported from it) at this module, so ``moe_token_dispatcher_type="flex"`` with
    ``moe_flex_dispatcher_backend`` ``"deepep"`` or ``"hybridep"`` runs on ep_runtime. Call it
    after importing Megatron-core and before building the model. Returns the names replaced,
    as ``module.name``. Raises :class:`~ep_runtime.core.errors.EPInputError` if Megatron-core is not
    importable."""
    import importlib

    replaced = []
    for name in MEGATRON_MODULES:
        try:
            module = sys.modules.get(name) or importlib.import_module(name)
        except ImportError as exc:
            raise EPInputError(f"install: cannot import {name} ({exc}); install Megatron-core first: "
                               "pip install -e \".[megatron]\" (megatron-core 0.16.1).") from exc
        for attr, value in _EXPORTS.items():
            if hasattr(module, attr) or name.endswith("fused_a2a"):
                setattr(module, attr, value)
                replaced.append(f"{name}.{attr}")
    return replaced


__all__ = ["DeepEPHandle", "FusedCombine", "FusedDispatch", "HybridEPCombine", "HybridEPDispatch", "HybridEPHandle",
           "close_buffers", "fused_combine", "fused_dispatch", "get_buffer", "get_hidden_bytes", "hybrid_ep_combine",
           "hybrid_ep_dispatch", "init_hybrid_ep_buffer", "install", "reset_hybrid_ep_buffer", "set_deepep_num_sms",
           "use_session"]
