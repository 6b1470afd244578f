"""PyTorch autograd for dispatch and combine: :class:`FusedDispatch` and :class:`FusedCombine`.

An optional module (PyTorch: ``pip install -e ".[torch]"``). It follows the shape of Megatron-LM's ``fused_a2a``
(a dispatch and a combine as ``torch.autograd.Function``, the backward of each being the other
direction of the exchange with the routing of the forward; ``get_buffer`` / ``get_hidden_bytes``),
adapted to this runtime, whose combine applies the router weights that travelled with dispatch.

The math (one MoE layer; token ``t`` of a rank picks experts ``e_1..e_K`` with weights ``w_tk``;
row ``i`` of the expert-major batch is the copy of token ``t(i)`` for slot ``k(i)``)::

    dispatch   X[i]   = x[t(i)]                         (a copy per (token, expert) pair)
    combine    out[t] = sum_k w_tk * Y[i(t, k)]         (Y: the expert outputs, row-aligned with X)

    backward of dispatch   dL/dx[t]    = sum_k dL/dX[i(t, k)]           (unweighted: a sum over copies)
    backward of combine    dL/dY[i]    = w_{t(i)k(i)} * dL/dout[t(i)]
                           dL/dw_tk    = < Y[i(t, k)], dL/dout[t] >     (float32 dot product over hidden)

Router weights flow through :class:`FusedCombine` (its ``topk_weights`` input, the same tensor
given to the dispatch); through :class:`FusedDispatch` they only travel, so it returns no
gradient for them.

What the backward costs (a combine needs a dispatch with the forward's routing before it;
``combine_async(weights=None)`` sums a token's rows unweighted)::

    FusedCombine.backward   1 dispatch of dL/dout (the rows dL/dout[t(i)]) with the forward's
                            routing, kept by the forward combine (``keep_routing``: no routing
                            sent again), then, if topk_weights needs a gradient, its T x K values
                            home (``slot_values``: a float a slot)
    FusedDispatch.backward  1 unweighted combine of dL/dX on that dispatch, still open; a dispatch
                            of zeros first only when the combine's backward did not run

i.e. 1 dispatch + 1 combine per layer, plus ``T x K`` floats when the router weights need a
gradient. The weight gradient of row ``i`` is a float32 scalar computed where ``Y[i]`` lives;
``EPRuntime.slot_values_async`` puts it into its (token, slot) at home, exactly.

Copies and zero copy (``nvshmem``: CUDA tensors on this rank's GPU; ``sim``: CPU tensors, seen by
the simulated kernels as NumPy views of the same memory; the same rules on both):

- not copied: ``tokens``, ``topk_weights``, int32 ``topk_ids``, ``expert_out`` (the runtime's
  kernels read the tensors' memory), the combine output (the kernel writes into a tensor this
  module allocates and returns);
- copied: a non-contiguous input (``.contiguous()``), int64 ``topk_ids`` (converted to int32),
  and every dispatch output (``expert_x``, ``row_weight``, ``tokens_per_expert``, the handle's
  ``row_offsets`` and ``row_src_k``): the runtime's batch is a view of its buffers that the next
  dispatch overwrites, and the backward itself dispatches, while autograd keeps ``expert_x`` for
  the expert's backward.

Collective: every rank calls forward and backward of each function the same number of times in
the same order, with the same ``requires_grad`` flags (a rank with no tokens too: its loss must
still depend on the layer's output). On ``nvshmem`` the runtime's kernels run on
``session.stream``; each call orders it after the caller's current torch stream and the torch
stream after it (stream waits, no host synchronization, except the row count below). Device
errors surface at ``runtime.synchronize()``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace

import numpy as np

from ep_runtime.core.errors import EPInputError, MissingDependencyError

try:
    import torch
except ImportError as exc:  # pragma: no cover - exercised only without torch
    raise MissingDependencyError(
        "ep_runtime.integrations.torch needs PyTorch: pip install -e \".[torch]\" (on a CPU-only machine add "
        "--extra-index-url https://download.pytorch.org/whl/cpu for the CPU build)") from exc

from ep_runtime.core.config import EPConfig
from ep_runtime.core.runtime import EPRuntime
from ep_runtime.shmem.session import Session

#: Bytes of one token element on the wire (the runtime moves bf16).
WIRE_BYTES = 2

_BF16 = torch.bfloat16


# -- buffers ------------------------------------------------------------------------------------
_BUFFERS: dict[int, EPRuntime] = {}


def get_hidden_bytes(x: torch.Tensor) -> int:
    """Bytes of one token row of ``x`` ``[..., hidden]`` on the wire (bf16): ``hidden * 2``."""
    return x.shape[-1] * WIRE_BYTES


def get_buffer(session: Session, hidden_bytes: int, n_experts: int, top_k: int, max_tokens_per_rank: int,
               pad_multiple: int = 1, debug: bool = False, **config) -> EPRuntime:
    """The cached :class:`~ep_runtime.core.runtime.EPRuntime` of ``session``, built or re-built to fit.

    Collective, with the same arguments on every rank (``max_tokens_per_rank`` included: it is a
    bound on every rank's batch, not this rank's token count).

    Parameters
    ----------
    session : the SHMEM session of the expert-parallel group: ``session_for(group, heap_bytes)``
        (:func:`ep_runtime.shmem.session_for`, one per process, opened over a ``torch.distributed``
        group or an mpi4py communicator) or ``open_session``. Its symmetric heap must hold
        ``BufferLayout(cfg).symmetric_bytes`` of the largest buffer requested.
    hidden_bytes : bytes of one token row on the wire, :func:`get_hidden_bytes` (``hidden * 2``).
    n_experts, top_k, max_tokens_per_rank, pad_multiple, ``**config`` : the
        :class:`~ep_runtime.core.config.EPConfig` fields (``n_ranks`` is the session's).
        ``pad_multiple``: each expert's segment starts at a multiple of it (HybridEP's option
        of the same name; padding rows are zero with ``row_src_k == -1``).
        ``combine_dtype="float32"`` works as well: this module combines bf16 expert outputs in
        the expanded layout, whose partials the runtime then keeps in float32 (only the combine
        output is rounded; see docs/formats.md, "Combine precision").
    debug : the runtime's debug mode (always on for the simulator).

    The cached runtime is returned when its config equals the request and its
    ``max_tokens_per_rank`` is at least the requested one. Otherwise it is closed and a new one
    is built: with ``max_tokens_per_rank`` the larger of the two when only that differs (a
    buffer grows, never shrinks), else exactly as requested. :func:`close_buffers` frees them.
    """
    if not isinstance(session, Session):
        raise EPInputError(f"get_buffer: session must be an ep_runtime Session (open_session(...)); got "
                           f"{type(session).__name__}. For a torch.distributed group pass its session: "
                           f"ep_runtime.shmem.session_for(group, heap_bytes).")
    if hidden_bytes <= 0 or hidden_bytes % WIRE_BYTES:
        raise EPInputError(f"get_buffer: hidden_bytes={hidden_bytes} must be a positive multiple of {WIRE_BYTES} "
                           f"(tokens travel as bf16); use get_hidden_bytes(x).")
    want = EPConfig(n_ranks=session.n_ranks, n_experts=n_experts, top_k=top_k, hidden=hidden_bytes // WIRE_BYTES,
                    max_tokens_per_rank=max_tokens_per_rank, pad_multiple=pad_multiple, **config)
    debug = debug or session.backend == "sim"
    rt = _BUFFERS.get(id(session))
    if rt is not None and rt.session is session:
        have = rt.cfg
        same_shape = replace(have, max_tokens_per_rank=want.max_tokens_per_rank) == want and rt.debug == debug
        if same_shape and have.max_tokens_per_rank >= want.max_tokens_per_rank:
            return rt
        if same_shape:
            want = replace(want, max_tokens_per_rank=max(have.max_tokens_per_rank, want.max_tokens_per_rank))
        rt.close()
    rt = _BUFFERS[id(session)] = EPRuntime(want, session, debug=debug)
    return rt


def close_buffers(session: Session | None = None) -> None:
    """Close the cached runtime of ``session`` (of every session if ``None``). Collective; call it
    before closing the session."""
    for key in [id(session)] if session is not None else list(_BUFFERS):
        rt = _BUFFERS.pop(key, None)
        if rt is not None:
            _close(rt)


def _close(rt: EPRuntime) -> None:
    """Close ``rt`` (collective) and drop what this module keeps for it."""
    _KEPT_POOL.pop(rt._owner, None)
    _OPEN_BACKWARD.pop(id(rt), None)
    rt.close()


# -- tensors in and out of the runtime -------------------------------------------------------------
class _Bridge:
    """Torch tensors to the runtime's arrays and back, sharing memory, and stream order.

    ``sim``: CPU tensors as NumPy views (bf16 as its uint16 bits). ``nvshmem``: CUDA tensors are
    passed as they are (the runtime imports them through DLPack without a copy); the runtime's
    CuPy views come back through DLPack.
    """

    def __init__(self, runtime: EPRuntime):
        self.runtime = runtime
        self.sim = runtime.session.backend == "sim"
        if self.sim:
            self.device = torch.device("cpu")
        else:
            self.device = torch.device("cuda", getattr(runtime.session, "device_index", torch.cuda.current_device()))

    def check(self, t, call: str, name: str, dtypes: tuple, shape: tuple) -> None:
        if not isinstance(t, torch.Tensor):
            raise EPInputError(f"{call}: {name} must be a torch.Tensor; got {type(t).__name__}.")
        if t.device != self.device:
            raise EPInputError(f"{call}: {name} is on {t.device} but this rank's runtime "
                               f"({self.runtime.session.backend}) works on {self.device}; move it there "
                               f"(tensor.to('{self.device}')).")
        if t.dtype not in dtypes:
            raise EPInputError(f"{call}: {name} must have dtype {' or '.join(map(str, dtypes))}; got {t.dtype} "
                               f"(convert it with .to(...)).")
        if t.dim() != len(shape) or any(w is not None and w != s for w, s in zip(shape, t.shape)):
            want = "[" + ", ".join("*" if w is None else str(w) for w in shape) + "]"
            raise EPInputError(f"{call}: {name} must have shape {want}; got {list(t.shape)}.")

    def to_rt(self, t: torch.Tensor):
        """``t`` (contiguous) as an array of the runtime's backend, same memory."""
        t = t.detach()
        if not self.sim:
            return t
        if t.dtype == _BF16:
            return t.view(torch.int16).numpy().view(np.uint16)
        return t.numpy()

    def from_rt(self, arr) -> torch.Tensor:
        """A runtime array as a tensor, same memory (uint16 bits come back as bf16)."""
        bits = np.dtype(arr.dtype) == np.uint16
        if self.sim:
            t = torch.from_numpy(arr.view(np.int16) if bits else arr)
        else:
            import cupy

            t = torch.from_dlpack(arr.view(cupy.int16) if bits else arr)
        return t.view(_BF16) if bits else t

    def runtime_calls(self):
        """Context for runtime calls: the runtime's stream waits for the torch stream before, the
        torch stream for the runtime's after (no host synchronization)."""
        return contextlib.nullcontext() if self.sim else _StreamOrder(self.runtime.session.stream.ptr, self.device)


class _StreamOrder:
    """Runtime calls on a GPU: this rank's device current for CuPy (backward runs on autograd's
    device threads, where the session's thread-local CuPy state is absent) and the two streams
    ordered both ways."""

    def __init__(self, stream_ptr: int, device):
        import cupy

        self.cupy_device = cupy.cuda.Device(device.index)
        self.theirs = torch.cuda.ExternalStream(stream_ptr, device=device)
        self.ours = torch.cuda.current_stream(device)

    def __enter__(self):
        self.cupy_device.__enter__()
        self.theirs.wait_stream(self.ours)
        return self

    def __exit__(self, *exc):
        self.ours.wait_stream(self.theirs)
        self.cupy_device.__exit__(*exc)
        return False


#: id(runtime) -> (handle, topk_ids, layout): a backward dispatch (a combine's backward, with the
#: forward's routing) whose combine is still to come, so the dispatch's backward combines there
#: instead of dispatching again. Any dispatch or combine of these modules ends it.
_OPEN_BACKWARD: dict = {}


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` view the same elements (storage, offset, shape, strides)."""
    return (a.untyped_storage()._cdata == b.untyped_storage()._cdata and a.storage_offset() == b.storage_offset()
            and a.shape == b.shape and a.stride() == b.stride())


def _dispatch(bridge: _Bridge, tokens, topk_ids=None, topk_weights=None, layout: str = "expanded", routing=None):
    """One collective dispatch of contiguous tensors in ``layout``; the runtime's batch (views).
    With a kept ``routing`` (:func:`_keep`) instead of ``topk_ids`` / ``topk_weights``, the
    dispatch reuses it (no routing sent) and gives the kept routing back to the runtime's pool."""
    rt = bridge.runtime
    _OPEN_BACKWARD.pop(id(rt), None)
    with bridge.runtime_calls():
        if routing is not None:
            handle = rt.dispatch_async(bridge.to_rt(tokens), routing=routing)
            pool = _KEPT_POOL.setdefault(rt._owner, [])
            if not any(k is routing for k in pool):  # (a retained graph's second backward reuses it)
                pool.append(routing)  # its restore precedes any reuse of its memory in stream order
        else:
            handle = rt.dispatch_async(bridge.to_rt(tokens), bridge.to_rt(topk_ids), bridge.to_rt(topk_weights))
        return rt.dispatch_wait(handle, layout=layout)


#: runtime (its owner id: unique, unlike id()) -> kept routings a backward has dispatched with
#: (:func:`_dispatch`): their memory is reused by the next :func:`_keep` (one per layer in flight,
#: then steady); dropped when the runtime is closed here (:func:`_close`).
_KEPT_POOL: dict = {}


def _keep(bridge: _Bridge, rt_handle):
    """The routing of the runtime's current dispatch (``rt_handle``), kept for the backward's
    dispatch (``EPRuntime.keep_routing``, into pooled memory where there is some)."""
    rt = bridge.runtime
    pool = _KEPT_POOL.get(rt._owner)
    with bridge.runtime_calls():
        return rt.keep_routing(rt_handle, into=pool.pop() if pool else None)


def _combine(bridge: _Bridge, expert_out, handle, n_tokens: int, weights="dispatch") -> torch.Tensor:
    """One collective combine of contiguous bf16 rows into a new ``[n_tokens, hidden]`` bf16
    tensor (``weights``: as ``EPRuntime.combine_async`` takes them)."""
    rt = bridge.runtime
    _OPEN_BACKWARD.pop(id(rt), None)
    out = torch.empty(n_tokens, rt.cfg.hidden, dtype=_BF16, device=bridge.device)
    with bridge.runtime_calls():
        rt.combine_wait(rt.combine_async(bridge.to_rt(expert_out), handle, weights=weights), out=bridge.to_rt(out))
    return out


def _rows(view: torch.Tensor, n_rows: int, valid, fill) -> torch.Tensor:
    """A copy of the first ``n_rows`` rows of a batch view; rows where ``valid`` is False get
    ``fill`` (they are past the batch's end and hold stale data)."""
    if valid is None:
        return view[:n_rows].clone()
    mask = valid[:, None] if view.dim() == 2 else valid
    return torch.where(mask, view[:n_rows], torch.full((), fill, dtype=view.dtype, device=view.device))


# -- autograd functions ---------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class DispatchContext:
    """What a :class:`FusedDispatch` hands to its :class:`FusedCombine` (and keeps for backward).

    Attributes
    ----------
    runtime : the runtime that dispatched.
    rt_handle : the runtime's :class:`~ep_runtime.core.handles.DispatchHandle` (for the forward combine).
    n_tokens : this rank's tokens ``T``.
    n_rows : rows of ``expert_x`` (``num_permuted_tokens``, or the batch's ``row_offsets[L]``).
    row_offsets : [L + 1] int32, segment ``e`` is rows ``[row_offsets[e], row_offsets[e + 1])``.
    row_weight : [n_rows] float32, the router weight of each row (0 on padding and past the end).
    row_src_k : [n_rows] int32, the top-k slot each row came from (-1 on padding and past the end).
    row_valid : [n_rows] bool, rows before ``row_offsets[L]`` (``None`` when ``n_rows`` is exact).
    topk_ids : [T, top_k] int32, the routing (the backward dispatches with it again).
    weights : the ``topk_weights`` tensor dispatched (kept to recognize it in the combine).
    weights_version : its version counter at the dispatch.
    """

    runtime: EPRuntime
    rt_handle: object
    n_tokens: int
    n_rows: int
    row_offsets: torch.Tensor
    row_weight: torch.Tensor
    row_src_k: torch.Tensor
    row_valid: torch.Tensor | None
    topk_ids: torch.Tensor
    weights: torch.Tensor
    weights_version: int

    def is_dispatched_weights(self, w: torch.Tensor) -> bool:
        """Whether ``w`` is the dispatched ``topk_weights`` (or a view of the same elements, e.g.
        ``.detach()``), unmodified since. Compares storages, not data pointers: every empty
        tensor has data pointer 0."""
        ref = self.weights
        return (w.untyped_storage()._cdata == ref.untyped_storage()._cdata
                and w.storage_offset() == ref.storage_offset() and w.shape == ref.shape
                and w.stride() == ref.stride() and w._version == self.weights_version)


class FusedDispatch(torch.autograd.Function):
    """Dispatch as an autograd function: tokens to the expert-major batch of their experts' ranks.

    ``FusedDispatch.apply(tokens, topk_ids, topk_weights, runtime, num_permuted_tokens=None)``

    Parameters
    ----------
    tokens : [T, hidden] bfloat16 (T may be 0).
    topk_ids : [T, top_k] int32 (int64 is converted, a copy), global expert ids, distinct per token.
    topk_weights : [T, top_k] float32; they travel with the tokens and are applied by
        :class:`FusedCombine` (no gradient flows to them through this function).
    runtime : an :class:`~ep_runtime.core.runtime.EPRuntime` (:func:`get_buffer`).
    num_permuted_tokens : int, optional
        Rows of ``expert_x`` (HybridEP's option): at least the rows this rank receives (padding
        included), at most the buffer's capacity. Given, no host synchronization sizes the output
        and rows past the batch's end are zero; the debug mode checks it is large enough.
        ``None``: exactly ``row_offsets[L]`` rows, read on the host (a synchronization on GPUs).

    Returns
    -------
    expert_x : [n_rows, hidden] bfloat16, expert-major rows (differentiable).
    row_weight : [n_rows] float32, each row's router weight (0 on padding).
    tokens_per_expert : [L] int32, real rows per local expert.
    handle : :class:`DispatchContext`, for :class:`FusedCombine`.

    Backward: ``dL/dtokens[t] = sum_k dL/dexpert_x[i(t, k)]``, an unweighted combine of the row
    gradients with the forward's routing: 1 combine (``weights=None``) on the dispatch
    :class:`FusedCombine`'s backward left open, when it was this module's last call on the
    runtime (a layer whose router weights need no gradient: 1 dispatch + 1 combine per layer in
    all); otherwise 1 dispatch of zeros with the forward's routing, then that combine.
    """

    @staticmethod
    def forward(ctx, tokens, topk_ids, topk_weights, runtime, num_permuted_tokens=None):
        bridge, cfg, c = _Bridge(runtime), runtime.cfg, "FusedDispatch"
        bridge.check(tokens, c, "tokens", (_BF16,), (None, cfg.hidden))
        T = tokens.shape[0]
        bridge.check(topk_ids, c, "topk_ids", (torch.int32, torch.int64), (T, cfg.top_k))
        bridge.check(topk_weights, c, "topk_weights", (torch.float32,), (T, cfg.top_k))
        if num_permuted_tokens is not None and not 0 <= num_permuted_tokens <= cfg.recv_rows_capacity:
            raise EPInputError(f"{c}: num_permuted_tokens={num_permuted_tokens} must be in [0, "
                               f"{cfg.recv_rows_capacity}] (the buffer's row capacity).")
        ids = topk_ids.to(torch.int32).contiguous()
        batch = _dispatch(bridge, tokens.contiguous(), ids, topk_weights.contiguous())
        offsets = bridge.from_rt(batch.row_offsets).clone()
        counts = bridge.from_rt(batch.expert_counts).clone()
        if num_permuted_tokens is None:
            n_rows, valid = int(offsets[-1]), None
        else:
            n_rows = num_permuted_tokens
            if runtime.debug and int(offsets[-1]) > n_rows:
                raise EPInputError(f"{c}: rank {runtime.rank} received {int(offsets[-1])} rows (padding included) "
                                   f"but num_permuted_tokens={n_rows}; pass a bound at least that large.")
            valid = torch.arange(n_rows, device=bridge.device) < offsets[-1]
        expert_x = _rows(bridge.from_rt(batch.x), n_rows, valid, 0)
        row_weight = _rows(bridge.from_rt(batch.weight), n_rows, valid, 0)
        row_src_k = _rows(bridge.from_rt(batch.src_k), n_rows, valid, -1)
        handle = DispatchContext(runtime, batch.handle, T, n_rows, offsets, row_weight, row_src_k, valid, ids,
                                 topk_weights.detach(), topk_weights._version)
        ctx.mark_non_differentiable(row_weight, counts)
        ctx.save_for_backward(ids)
        ctx.runtime = runtime
        return expert_x, row_weight, counts, handle

    @staticmethod
    def backward(ctx, grad_expert_x, _grad_row_weight, _grad_counts, _grad_handle):
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None
        (ids,) = ctx.saved_tensors
        bridge, cfg = _Bridge(ctx.runtime), ctx.runtime.cfg
        T = ids.shape[0]
        grad_rows = grad_expert_x.to(_BF16).contiguous()
        opened = _OPEN_BACKWARD.get(id(ctx.runtime))
        if opened is not None and _same_tensor(opened[1], ids) and opened[2] == "expanded":  # still open
            return _combine(bridge, grad_rows, opened[0], T, weights=None), None, None, None, None
        zeros = torch.zeros(T, cfg.hidden, dtype=_BF16, device=bridge.device)
        ones = torch.ones(T, cfg.top_k, dtype=torch.float32, device=bridge.device)
        batch = _dispatch(bridge, zeros, ids, ones)  # opens a combine with the forward's routing
        return _combine(bridge, grad_rows, batch.handle, T, weights=None), None, None, None, None


class FusedCombine(torch.autograd.Function):
    """Weighted combine as an autograd function: each token's ``sum_k w_tk * expert_out[i(t, k)]``.

    ``FusedCombine.apply(expert_out, topk_weights, handle)``

    Parameters
    ----------
    expert_out : [handle.n_rows, hidden] bfloat16, row-aligned with the dispatch's ``expert_x``.
    topk_weights : [T, top_k] float32, the tensor given to the dispatch, unmodified (the kernel
        applies the copy that travelled with it; checked by identity and version).
    handle : the :class:`DispatchContext` of the runtime's latest dispatch.

    Returns ``out`` [T, hidden] bfloat16 (written by the kernel in place, no copy).

    Backward (1 dispatch of ``dL/dout`` with the forward's routing, which the forward keeps when
    an input needs a gradient (``EPRuntime.keep_routing``: the backward sends no routing), then,
    if ``topk_weights`` needs a gradient, the per-row weight gradients home as ``T x K`` floats
    (``EPRuntime.slot_values``); the dispatch stays open for :class:`FusedDispatch`'s backward to
    combine on):

    - ``dL/dexpert_out[i] = w_{t(i)k(i)} * dL/dout[t(i)]`` (float32 product, rounded to bf16);
    - ``dL/dw_tk = < expert_out[i(t, k)], dL/dout[t] >`` (float32 over hidden, on the expert's rank).
    """

    @staticmethod
    def forward(ctx, expert_out, topk_weights, handle):
        c = "FusedCombine"
        if not isinstance(handle, DispatchContext):
            raise EPInputError(f"{c}: handle must be the DispatchContext returned by FusedDispatch; got "
                               f"{type(handle).__name__}.")
        rt = handle.runtime
        bridge, cfg = _Bridge(rt), rt.cfg
        bridge.check(expert_out, c, "expert_out", (_BF16,), (handle.n_rows, cfg.hidden))
        bridge.check(topk_weights, c, "topk_weights", (torch.float32,), (handle.n_tokens, cfg.top_k))
        if not handle.is_dispatched_weights(topk_weights):
            raise EPInputError(f"{c}: topk_weights is not the tensor given to the dispatch of this handle (or it "
                               f"was modified since): the kernel applies the weights that travelled with the "
                               f"dispatch, so pass that same tensor.")
        ctx.kept = _keep(bridge, handle.rt_handle) if any(ctx.needs_input_grad[:2]) else None
        out = _combine(bridge, expert_out.contiguous(), handle.rt_handle, handle.n_tokens)
        ctx.save_for_backward(expert_out, handle.topk_ids)
        ctx.handle = handle
        return out

    @staticmethod
    def backward(ctx, grad_out):
        expert_out, ids = ctx.saved_tensors
        h = ctx.handle
        bridge = _Bridge(h.runtime)
        batch = _dispatch(bridge, grad_out.to(_BF16).contiguous(), routing=ctx.kept)  # the forward's routing
        g = _rows(bridge.from_rt(batch.x), h.n_rows, h.row_valid, 0).float()  # dL/dout[t(i)] per row
        grad_expert_out = (h.row_weight[:, None] * g).to(_BF16) if ctx.needs_input_grad[0] else None
        grad_weights = None
        if ctx.needs_input_grad[1]:
            per_row = (expert_out.float() * g).sum(dim=1)
            grad_weights = slot_values_home(bridge, per_row, batch.handle, h.n_tokens)
        _OPEN_BACKWARD[id(h.runtime)] = (batch.handle, ids, "expanded")  # FusedDispatch's backward combines here
        return grad_expert_out, grad_weights, None


def slot_values_home(bridge: _Bridge, row_values: torch.Tensor, rt_handle, n_tokens: int) -> torch.Tensor:
    """``[n_tokens, top_k]`` float32 at home: ``row_values[i]`` (float32, ``>=`` the batch's
    rows, row-aligned with the batch of ``rt_handle``, the runtime's current dispatch) at the
    (token, slot) row i came from, 0.0 where a slot made no row. ``T x K`` floats
    (``EPRuntime.slot_values_async``); the dispatch stays open for its combine."""
    rt = bridge.runtime
    out = torch.empty(n_tokens, rt.cfg.top_k, dtype=torch.float32, device=bridge.device)
    with bridge.runtime_calls():
        rt.slot_values_wait(rt.slot_values_async(bridge.to_rt(row_values.float().contiguous()), rt_handle),
                            out=bridge.to_rt(out))
    return out


def fused_dispatch(tokens, topk_ids, topk_weights, runtime: EPRuntime, num_permuted_tokens: int | None = None):
    """:class:`FusedDispatch`: ``(expert_x, row_weight, tokens_per_expert, handle)``."""
    return FusedDispatch.apply(tokens, topk_ids, topk_weights, runtime, num_permuted_tokens)


def fused_combine(expert_out, topk_weights, handle: DispatchContext):
    """:class:`FusedCombine`: ``out`` [T, hidden] bfloat16."""
    return FusedCombine.apply(expert_out, topk_weights, handle)


__all__ = ["FusedDispatch", "FusedCombine", "DispatchContext", "fused_dispatch", "fused_combine", "get_buffer",
           "get_hidden_bytes", "close_buffers", "slot_values_home"]
