"""The runtime's four calls on torch tensors, each half on its own: serving, and overlap with compute.

``dispatch_async`` / ``dispatch_wait`` / ``combine_async`` / ``combine_wait`` as
:class:`~ep_runtime.core.runtime.EPRuntime` has them, taking and returning torch tensors, in every
token format (bf16; FP8 E4M3 codes with float32 or UE8M0 block scales; NVFP4's packed E2M1
codes with E4M3 block scales and a float32 global scale; quantized in the kernel or given
pre-quantized) and both layouts. Not differentiable (the autograd functions are
:mod:`ep_runtime.integrations.torch` and :mod:`ep_runtime.integrations.torch_compact`).

Stream order (``nvshmem``; on ``sim`` every call completes before it returns): each ``*_async``
makes the runtime's stream wait for the caller's current torch stream and returns without the
torch stream waiting for anything, so work the caller enqueues next (shared experts, attention
of another micro-batch) runs while the tokens are in flight; each ``*_wait`` ends with the torch
stream waiting for the runtime's. No host synchronization anywhere. The tensors a call reads are
recorded on the runtime's stream, so the caching allocator does not reuse their memory while the
kernels may still read it; they must stay unmodified until the matching ``*_wait`` returns.

A typical MoE forward with shared experts::

    pending = dispatch_async(x, topk_ids, topk_weights, runtime)
    shared = shared_experts(x)                  # overlaps the dispatch
    batch = dispatch_wait(pending)              # batch.x [rows, H], batch.expert_counts [L] (device)
    y = experts(batch)                          # expert-major rows
    out = combine_wait(combine_async(y, batch)) + shared

What ``dispatch_wait`` returns (:class:`Batch`) are views of the runtime's buffers, valid as the
runtime's are (until the next ``dispatch_wait``; a compact batch's ``x`` until the next
``combine_async`` or ``dispatch_async``): copy what must live longer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ep_runtime.core.errors import EPInputError
from ep_runtime.core.handles import CompactBatch
from ep_runtime.core.runtime import EPRuntime
from ep_runtime.integrations.torch import _Bridge

#: torch dtype of the runtime's FP8 codes (E4M3).
FP8_CODES = torch.float8_e4m3fn
#: torch dtype of the runtime's NVFP4 codes: two E2M1 codes a byte, element 2i in the low nibble
#: (torch's packing of ``float4_e2m1fn_x2``).
NVFP4_CODES = torch.float4_e2m1fn_x2


def _codes_dtype(runtime: EPRuntime) -> torch.dtype | None:
    """The torch dtype :func:`dispatch_wait` views the batch's codes as (None: bf16 rows)."""
    fmt = runtime.cfg.token_format
    if not fmt.quantized:
        return None
    return NVFP4_CODES if fmt.elements_per_item == 2 else FP8_CODES


@dataclass(frozen=True, eq=False)
class PendingDispatch:
    """What :func:`dispatch_async` returns: pass it to :func:`dispatch_wait`."""

    runtime: EPRuntime
    rt_handle: object
    n_tokens: int


@dataclass(frozen=True, eq=False)
class Batch:
    """This rank's received tokens (:func:`dispatch_wait`), torch views of the runtime's batch.

    Attributes
    ----------
    layout : ``"expanded"`` or ``"compact"``.
    x : expanded: ``[capacity, hidden]``, rows ``[0, row_offsets[L])`` defined, expert-major;
        compact: ``[n_ranks * max_tokens_per_rank, hidden]``, row ``s * T + t`` token t of rank
        s where it came here. bfloat16; ``float8_e4m3fn`` codes in an FP8 format; NVFP4:
        ``float4_e2m1fn_x2``, ``[rows, hidden / 2]`` (two codes a byte).
    scales : quantized formats: the block scales, float32 (``fp8_e4m3``) or uint8 UE8M0 codes
        (``fp8_e4m3_ue8m0``), ``[rows, hidden / 128]``; NVFP4: uint8 E4M3 codes, ``[rows,
        hidden / 16]`` (``scales="column"``: transposed, ``[hidden / block, capacity]``); None in
        bf16.
    global_scales : NVFP4 only (else None): ``[rows]`` float32, each row's source tensor's global
        scale (its rank's ``token_global_scale``): a row decodes to ``e2m1(code) * e4m3(scale) *
        global_scales[row]``.
    row_offsets : [L + 1] int32 (device): expert e's rows are ``[row_offsets[e], row_offsets[e + 1])``.
    expert_counts : [L] int32 (device): real rows per local expert (the expert load).
    src_rank, src_token, src_k : [capacity] int32: where each expert-major row came from.
    weight : [capacity] float32: each expert-major row's router weight.
    gather : compact only: [capacity] int32, the ``x`` row of each expert-major row.
    recv_tokens : compact only: [n_ranks] int32, tokens each rank dispatched.
    """

    runtime: EPRuntime
    rt_handle: object
    n_tokens: int
    layout: str
    x: torch.Tensor
    scales: torch.Tensor | None
    row_offsets: torch.Tensor
    expert_counts: torch.Tensor
    src_rank: torch.Tensor
    src_token: torch.Tensor
    src_k: torch.Tensor
    weight: torch.Tensor
    gather: torch.Tensor | None = None
    recv_tokens: torch.Tensor | None = None
    global_scales: torch.Tensor | None = None


@dataclass(frozen=True, eq=False)
class PendingCombine:
    """What :func:`combine_async` returns: pass it to :func:`combine_wait`."""

    runtime: EPRuntime
    rt_handle: object
    n_tokens: int


def _runtime_waits_for_torch(bridge: _Bridge, *tensors) -> None:
    """The runtime's stream after the torch stream's work so far; ``tensors`` recorded on it."""
    if bridge.sim:
        return
    theirs = torch.cuda.ExternalStream(bridge.runtime.session.stream.ptr, device=bridge.device)
    theirs.wait_stream(torch.cuda.current_stream(bridge.device))
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type == "cuda":
            t.record_stream(theirs)


def _torch_waits_for_runtime(bridge: _Bridge) -> None:
    if not bridge.sim:
        theirs = torch.cuda.ExternalStream(bridge.runtime.session.stream.ptr, device=bridge.device)
        torch.cuda.current_stream(bridge.device).wait_stream(theirs)


def _calls(bridge: _Bridge):
    """This rank's device current for CuPy around a runtime call (autograd and other threads
    lack the session's thread-local CuPy state)."""
    if bridge.sim:
        import contextlib

        return contextlib.nullcontext()
    import cupy

    return cupy.cuda.Device(bridge.device.index)


def _contiguous(t):
    return t if t is None or t.is_contiguous() else t.contiguous()


def dispatch_async(tokens: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, runtime: EPRuntime,
                   token_scales: torch.Tensor | None = None, n_tokens: torch.Tensor | None = None,
                   token_global_scale: torch.Tensor | None = None) -> PendingDispatch:
    """Start a dispatch (collective). Arguments as :meth:`EPRuntime.dispatch_async`, as tensors on
    this rank's device: ``tokens`` [T, hidden] bfloat16, or pre-quantized codes with
    ``token_scales`` (FP8: ``float8_e4m3fn`` or uint8 [T, hidden]; NVFP4: ``float4_e2m1fn_x2``
    or uint8 [T, hidden / 2], scales uint8 or ``float8_e4m3fn`` E4M3 codes [T, hidden / 16]);
    ``topk_ids`` [T, top_k] int32 (int64 is converted, a copy; -1 masks a slot);
    ``topk_weights`` [T, top_k] float32; ``n_tokens`` optional [1] int32 (valid leading rows,
    read on the device); ``token_global_scale`` NVFP4 only, [1] float32 (required with
    pre-quantized codes; None with bf16 tokens: the rule's, computed on the stream)."""
    bridge = _Bridge(runtime)
    if not isinstance(tokens, torch.Tensor):
        raise EPInputError(f"dispatch_async: tokens must be a torch.Tensor; got {type(tokens).__name__}.")
    if tokens.dtype in (FP8_CODES, NVFP4_CODES):
        tokens = tokens.view(torch.uint8)
    if isinstance(token_scales, torch.Tensor) and token_scales.dtype == FP8_CODES:  # NVFP4's E4M3 scale codes
        token_scales = token_scales.view(torch.uint8)
    if isinstance(topk_ids, torch.Tensor) and topk_ids.dtype == torch.int64:
        topk_ids = topk_ids.to(torch.int32)
    inputs = [_contiguous(t) for t in (tokens, topk_ids, topk_weights, token_scales, n_tokens, token_global_scale)]
    _runtime_waits_for_torch(bridge, *inputs)
    with _calls(bridge):
        x, ids, w, scales, count, g = (None if t is None else bridge.to_rt(t) for t in inputs)
        handle = runtime.dispatch_async(x, ids, w, n_tokens=count, token_scales=scales, token_global_scale=g)
    return PendingDispatch(runtime, handle, handle.n_tokens)


def dispatch_wait(pending: PendingDispatch, layout: str = "expanded", scales: str = "row") -> Batch:
    """Complete the dispatch (collective): this rank's :class:`Batch` in ``layout`` (one the
    runtime serves). The torch stream waits for it; no host synchronization."""
    if not isinstance(pending, PendingDispatch):
        raise EPInputError(f"dispatch_wait: expected the PendingDispatch of dispatch_async; got "
                           f"{type(pending).__name__}.")
    if layout not in ("expanded", "compact"):
        raise EPInputError(f"dispatch_wait: layout={layout!r}; torch_async serves 'expanded' and 'compact'. DeepEP's "
                           f"dense rows (layout 'dense') come through ep_runtime.deep_ep.Buffer.dispatch, its "
                           f"low-latency rows (layout 'batched') through Buffer.low_latency_dispatch.")
    rt = pending.runtime
    bridge = _Bridge(rt)
    with _calls(bridge):  # (reads nothing of the torch stream's: the runtime's stream does not wait for it)
        b = rt.dispatch_wait(pending.rt_handle, layout=layout, scales=scales)
    _torch_waits_for_runtime(bridge)
    t = bridge.from_rt
    x, codes = t(b.x), _codes_dtype(rt)
    if codes is not None:
        x = x.view(codes)
    compact = isinstance(b, CompactBatch)
    return Batch(rt, b.handle, pending.n_tokens, layout, x, None if b.scales is None else t(b.scales),
                 t(b.row_offsets), t(b.expert_counts), t(b.src_rank), t(b.src_token), t(b.src_k), t(b.weight),
                 t(b.gather) if compact else None, t(b.recv_tokens) if compact else None,
                 None if b.global_scales is None else t(b.global_scales))


def combine_async(expert_out: torch.Tensor, batch: Batch, layout: str = "expanded", weights="dispatch") -> PendingCombine:
    """Start the combine of ``batch`` (collective), as :meth:`EPRuntime.combine_async`.
    ``layout="expanded"`` (after either layout's dispatch): ``expert_out`` ``[>= rows, hidden]``
    bfloat16, the expert outputs in expert-major row order (a gathering GEMM over a compact batch
    writes them so too), weighted by ``weights`` (the dispatched weights, None, or a float32
    [rows] tensor). ``layout="compact"`` (after a compact dispatch): ``[n_ranks *
    max_tokens_per_rank, hidden]`` bfloat16 (float32 with ``combine_dtype="float32"``), this
    rank's per-token sums, already weighted."""
    if not isinstance(batch, Batch):
        raise EPInputError(f"combine_async: expected the Batch of dispatch_wait; got {type(batch).__name__}.")
    rt = batch.runtime
    bridge = _Bridge(rt)
    expert_out = _contiguous(expert_out)
    w = _contiguous(weights) if isinstance(weights, torch.Tensor) else weights
    _runtime_waits_for_torch(bridge, expert_out, w)
    with _calls(bridge):
        handle = rt.combine_async(bridge.to_rt(expert_out), batch.rt_handle, layout=layout,
                                  weights=bridge.to_rt(w) if isinstance(w, torch.Tensor) else w)
    return PendingCombine(rt, handle, batch.n_tokens)


def combine_wait(pending: PendingCombine, out: torch.Tensor | None = None) -> torch.Tensor:
    """Complete the combine (collective): ``out`` [T, hidden] bfloat16 (allocated when None), each
    token's sum over the ranks it went to. The torch stream waits for it."""
    if not isinstance(pending, PendingCombine):
        raise EPInputError(f"combine_wait: expected the PendingCombine of combine_async; got "
                           f"{type(pending).__name__}.")
    rt = pending.runtime
    bridge = _Bridge(rt)
    if out is None:
        out = torch.empty(pending.n_tokens, rt.cfg.hidden, dtype=torch.bfloat16, device=bridge.device)
    bridge.check(out, "combine_wait", "out", (torch.bfloat16,), (pending.n_tokens, rt.cfg.hidden))
    _runtime_waits_for_torch(bridge, out)
    with _calls(bridge):
        rt.combine_wait(pending.rt_handle, out=bridge.to_rt(out))
    _torch_waits_for_runtime(bridge)
    return out


__all__ = ["FP8_CODES", "NVFP4_CODES", "Batch", "PendingCombine", "PendingDispatch", "combine_async", "combine_wait",
           "dispatch_async", "dispatch_wait"]
