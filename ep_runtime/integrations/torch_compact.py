"""PyTorch autograd for the compact layout: :class:`FusedDispatchCompact` and
:class:`FusedCombineCompact` (an optional module, as :mod:`ep_runtime.integrations.torch`).

The compact layout moves one row per (token, destination rank), as DeepEP and NCCL do: the
dispatch leaves the received tokens where they landed, ``x [R * T, hidden]`` (row ``s * T + t``
is token ``t`` of rank ``s`` when it came here; the others are zero), with a ``gather`` index
per expert-major row; the caller's experts read ``x[gather]`` and write back, per received
token, its partial (the sum over this rank's experts of weight x output) into ``rows [R * T,
hidden]``; the combine sums each token's partials over the ranks it went to. Both directions
are sums of rows, so each backward is the other direction once::

    dispatch   x_r[s T + t]  = tokens_s[t]          (for every rank r token t of s went to)
    combine    out_s[t]      = sum_r rows_r[s T + t]

    backward of dispatch   dL/dtokens_s[t]   = sum_r dL/dx_r[s T + t]      (1 combine)
    backward of combine    dL/drows_r[s T + t] = dL/dout_s[t]              (1 dispatch)

The dispatch's backward combines on the dispatch the combine's backward opened (1 dispatch + 1
combine per layer), or opens one itself (a dispatch of zeros with the forward's routing) when
something else used the runtime in between. The router weights travel with the dispatch as
``row_weight`` (each expert-major row's); they are not differentiable here: a caller that trains
the router through the compact layout applies the weights it wants as ordinary tensors.
Collective and stream-ordered like :mod:`ep_runtime.integrations.torch`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ep_runtime.core.errors import EPInputError
from ep_runtime.core.runtime import EPRuntime
from ep_runtime.integrations.torch import _BF16, _OPEN_BACKWARD, _Bridge, _dispatch, _keep, _same_tensor


@dataclass(frozen=True, eq=False)
class CompactContext:
    """What :class:`FusedDispatchCompact` hands to :class:`FusedCombineCompact`.

    Attributes
    ----------
    runtime : the runtime that dispatched.
    rt_handle : the runtime's dispatch handle.
    n_tokens : this rank's tokens ``T``.
    received : [R * max_tokens_per_rank] bool, the rows of ``x`` holding a token that came here.
    topk_ids, topk_weights : the routing dispatched (the combine's backward dispatches with it).
    """

    runtime: EPRuntime
    rt_handle: object
    n_tokens: int
    received: torch.Tensor
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor


def _dispatch_compact(bridge: _Bridge, tokens, topk_ids=None, topk_weights=None, routing=None):
    """One collective dispatch in the compact layout (with a kept ``routing``, reusing it);
    the runtime's batch (views)."""
    return _dispatch(bridge, tokens, topk_ids, topk_weights, layout="compact", routing=routing)


def _combine_compact(bridge: _Bridge, rows, rt_handle, n_tokens: int) -> torch.Tensor:
    """One collective compact combine of ``rows`` [R * T, hidden] into a new ``[n_tokens, hidden]``."""
    rt = bridge.runtime
    _OPEN_BACKWARD.pop(id(rt), None)
    out = torch.empty(n_tokens, rt.cfg.hidden, dtype=_BF16, device=bridge.device)
    with bridge.runtime_calls():
        rt.combine_wait(rt.combine_async(bridge.to_rt(rows), rt_handle, layout="compact"), out=bridge.to_rt(out))
    return out


def _received_rows(bridge: _Bridge, batch, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, received)``: a copy of the batch's receive rows with the rows of tokens that did
    not come here zeroed (they hold stale data), and the bool mask of the others."""
    n = int(bridge.from_rt(batch.row_offsets)[-1])
    gather = bridge.from_rt(batch.gather)[:n].long()
    received = torch.zeros(slots, dtype=torch.bool, device=bridge.device)
    received[gather[gather >= 0]] = True
    x = bridge.from_rt(batch.x)
    return torch.where(received[:, None], x, torch.zeros((), dtype=x.dtype, device=x.device)), received


class FusedDispatchCompact(torch.autograd.Function):
    """Dispatch in the compact layout, as an autograd function.

    ``FusedDispatchCompact.apply(tokens, topk_ids, topk_weights, runtime)``

    Parameters
    ----------
    tokens : [T, hidden] bfloat16. topk_ids : [T, top_k] int32 or int64 (-1 masks a slot).
    topk_weights : [T, top_k] float32 (they travel; no gradient flows to them here).
    runtime : an :class:`~ep_runtime.core.runtime.EPRuntime` in bf16 that serves the compact layout.

    Returns
    -------
    x : [R * max_tokens_per_rank, hidden] bfloat16, differentiable: row ``s * T + t`` is token
        ``t`` of rank ``s`` where it came here, zero elsewhere (a copy).
    gather : [rows] int64, the ``x`` row of each expert-major row (-1 on padding rows).
    row_weight : [rows] float32, each expert-major row's router weight (0 on padding).
    row_offsets : [L + 1] int32, expert ``e``'s rows are ``[row_offsets[e], row_offsets[e + 1])``.
    handle : :class:`CompactContext`, for :class:`FusedCombineCompact`.

    The number of rows is read on the host (a synchronization on GPUs).
    """

    @staticmethod
    def forward(ctx, tokens, topk_ids, topk_weights, runtime):
        bridge, cfg, c = _Bridge(runtime), runtime.cfg, "FusedDispatchCompact"
        if cfg.token_format.quantized or "compact" not in cfg.layouts:
            raise EPInputError(f"{c}: the runtime must move bf16 tokens and serve the compact layout; it has "
                               f"token_dtype={cfg.token_dtype!r}, layouts={cfg.layouts}.")
        bridge.check(tokens, c, "tokens", (_BF16,), (None, cfg.hidden))
        T = tokens.shape[0]
        bridge.check(topk_ids, c, "topk_ids", (torch.int32, torch.int64), (T, cfg.top_k))
        bridge.check(topk_weights, c, "topk_weights", (torch.float32,), (T, cfg.top_k))
        ids, weights = topk_ids.to(torch.int32).contiguous(), topk_weights.detach().contiguous()
        batch = _dispatch_compact(bridge, tokens.contiguous(), ids, weights)
        x, received = _received_rows(bridge, batch, cfg.n_ranks * cfg.max_tokens_per_rank)
        offsets = bridge.from_rt(batch.row_offsets).clone()
        n = int(offsets[-1])
        gather = bridge.from_rt(batch.gather)[:n].long().clone()
        row_weight = bridge.from_rt(batch.weight)[:n].clone()
        handle = CompactContext(runtime, batch.handle, T, received, ids, weights)
        ctx.mark_non_differentiable(gather, row_weight, offsets)
        ctx.save_for_backward(ids)
        ctx.runtime = runtime
        return x, gather, row_weight, offsets, handle

    @staticmethod
    def backward(ctx, grad_x, _grad_gather, _grad_row_weight, _grad_offsets, _grad_handle):
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        (ids,) = ctx.saved_tensors
        bridge, cfg = _Bridge(ctx.runtime), ctx.runtime.cfg
        T = ids.shape[0]
        rows = grad_x.to(_BF16).contiguous()
        opened = _OPEN_BACKWARD.get(id(ctx.runtime))
        if opened is not None and _same_tensor(opened[1], ids) and opened[2] == "compact":
            return _combine_compact(bridge, rows, opened[0], T), None, None, None
        zeros = torch.zeros(T, cfg.hidden, dtype=_BF16, device=bridge.device)
        ones = torch.ones(T, cfg.top_k, dtype=torch.float32, device=bridge.device)
        batch = _dispatch_compact(bridge, zeros, ids, ones)  # opens a combine with the forward's routing
        return _combine_compact(bridge, rows, batch.handle, T), None, None, None


class FusedCombineCompact(torch.autograd.Function):
    """Combine in the compact layout, as an autograd function: ``out_s[t] = sum_r rows_r[s T + t]``.

    ``FusedCombineCompact.apply(rows, handle)``

    Parameters
    ----------
    rows : [R * max_tokens_per_rank, hidden] bfloat16, row ``s * T + t`` this rank's partial for
        token ``t`` of rank ``s`` (weighted and summed over this rank's experts by the caller);
        rows of tokens that did not come here are not read.
    handle : the :class:`CompactContext` of the runtime's latest dispatch.

    Returns ``out`` [T, hidden] bfloat16. Backward: 1 dispatch of ``dL/dout`` with the forward's
    routing (kept by the forward: no routing sent again); its rows are ``dL/drows`` (zero where no token came), and it stays open for the
    dispatch's backward to combine on.
    """

    @staticmethod
    def forward(ctx, rows, handle):
        c = "FusedCombineCompact"
        if not isinstance(handle, CompactContext):
            raise EPInputError(f"{c}: handle must be the CompactContext returned by FusedDispatchCompact; got "
                               f"{type(handle).__name__}.")
        bridge, cfg = _Bridge(handle.runtime), handle.runtime.cfg
        bridge.check(rows, c, "rows", (_BF16,), (cfg.n_ranks * cfg.max_tokens_per_rank, cfg.hidden))
        ctx.kept = _keep(bridge, handle.rt_handle) if ctx.needs_input_grad[0] else None
        out = _combine_compact(bridge, rows.contiguous(), handle.rt_handle, handle.n_tokens)
        ctx.handle = handle
        return out

    @staticmethod
    def backward(ctx, grad_out):
        h = ctx.handle
        bridge = _Bridge(h.runtime)
        batch = _dispatch_compact(bridge, grad_out.to(_BF16).contiguous(), routing=ctx.kept)  # the forward's routing
        rows = torch.where(h.received[:, None], bridge.from_rt(batch.x),
                           torch.zeros((), dtype=_BF16, device=bridge.device))
        _OPEN_BACKWARD[id(h.runtime)] = (batch.handle, h.topk_ids, "compact")
        return rows, None


def fused_dispatch_compact(tokens, topk_ids, topk_weights, runtime: EPRuntime):
    """:class:`FusedDispatchCompact`: ``(x, gather, row_weight, row_offsets, handle)``."""
    return FusedDispatchCompact.apply(tokens, topk_ids, topk_weights, runtime)


def fused_combine_compact(rows, handle: CompactContext):
    """:class:`FusedCombineCompact`: ``out`` [T, hidden] bfloat16."""
    return FusedCombineCompact.apply(rows, handle)


__all__ = ["CompactContext", "FusedDispatchCompact", "FusedCombineCompact", "fused_dispatch_compact",
           "fused_combine_compact"]
