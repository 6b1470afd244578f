"""DeepEP's low-latency calls on ep_runtime: what ``Buffer.low_latency_dispatch``,
``low_latency_combine``, ``clean_low_latency_buffer``, ``get_low_latency_rdma_size_hint`` and
``get_next_low_latency_combine_buffer`` run (arguments as DeepEP v1.2.1's).

A dispatch runs a runtime's batched layout (:mod:`ep_runtime.kernels.layouts.batched`): the
kernels write DeepEP's ``[num_local_experts, num_max_dispatch_tokens_per_rank * num_ranks,
hidden]`` rows, the per-expert counts, each slot's source token and each (expert, source rank)'s
slot range, and the FP8 scales column-major per expert (float32, or UE8M0 packed four to an
int32). The layer adds no copy: what it returns are views of the runtime's buffers, the same
memory every call. Nothing reads the device from the host, so one CUDA graph serves every step.

Two buffers alternate, as DeepEP's two low-latency buffers do: each dispatch takes the next of
two runtimes of its row format (:data:`LOW_LATENCY_BUFFERS`), so two micro-batches (vLLM's
dual-batch overlap) each hold a dispatch until their combine; a third dispatch reuses the first
buffer (its received rows overwritten, as DeepEP's), and the first handle's combine then sends its
routing again first (``_open_dispatch``).

The combine applies ``topk_weights`` given at the combine, which DeepEP's dispatch never sees, at
home, as DeepEP's does: the runtimes are built with ``EPConfig.combine_weights="home"``, so each
expert rank sends every (token, expert) row home unweighted (into the home's row of that top-k
slot) and the home rank's ``combine_wait`` sums ``topk_weights[t, k] * row`` over the token's
routed slots in slot order (float32 from 0, then bf16): no exchange besides the combine's own
(:mod:`ep_runtime.kernels.combine_home`). The slots summed are the dispatch's routing (-1 and
repeated ids sum nothing); the weights are copied into a buffer of the runtime (the same memory
every call, read by the receive).

``return_recv_hook``: the call enqueues the send and returns a hook that enqueues the receive
(``dispatch_wait``, ``combine_wait``); the returned tensors hold the data once the hook has run
on the stream. ``async_finish``: as in normal mode (:mod:`~ep_runtime.integrations.deep_ep.streams`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ep_runtime.core.config import EPConfig
from ep_runtime.core.errors import EPInputError
from ep_runtime.core.layout import BufferLayout
from ep_runtime.integrations.deep_ep.handle import StatefulTuple
from ep_runtime.integrations.deep_ep.runtimes import RuntimeCache, RuntimeEntry
from ep_runtime.integrations.deep_ep.streams import CommCall
from ep_runtime.integrations.torch import _Bridge

_BF16, _FP8 = torch.bfloat16, torch.float8_e4m3fn
#: Runtimes of one row format that alternate between dispatches (DeepEP's two low-latency buffers).
LOW_LATENCY_BUFFERS = 2
#: The routing width ``get_low_latency_rdma_size_hint`` sizes for (its arguments have no top-k).
HINT_TOP_K = 16


def token_format(use_fp8: bool, round_scale: bool, use_ue8m0: bool) -> tuple[str, str]:
    """``(token_dtype, scales)`` of a dispatch's FP8 flags: bf16; E4M3 with float32 scales;
    with ``round_scale`` power-of-two (UE8M0) scales, as float32 or (``use_ue8m0``) packed."""
    if use_ue8m0 and not round_scale:
        raise EPInputError("low_latency_dispatch: use_ue8m0=True needs round_scale=True (as DeepEP's: UE8M0 scales "
                           "are powers of two).")
    if not use_fp8:
        return "bfloat16", "column"
    if not round_scale:
        return "fp8_e4m3", "column"
    return "fp8_e4m3_ue8m0", "packed" if use_ue8m0 else "column"


@dataclass(eq=False)
class LowLatencyState:
    """The layer's part of a low-latency handle.

    Attributes
    ----------
    owner : the ``Buffer`` that dispatched.
    entry : the runtime entry that dispatched (one of a format's two).
    rt_handle : the runtime's dispatch handle.
    views : the batch's runtime arrays (``EPRuntime.batched_views``).
    ids : ``[T, top_k]`` int32, the dispatch's routing as the runtime took it (a second combine
        of the dispatch sends it again).
    n_tokens, hidden, num_max, n_experts : the dispatch's sizes.
    """

    owner: object
    entry: RuntimeEntry
    rt_handle: object
    views: dict
    ids: torch.Tensor
    n_tokens: int
    hidden: int
    num_max: int
    n_experts: int


class LowLatencyHandle(StatefulTuple):
    """DeepEP's low-latency handle, ``(recv_src_info, recv_layout_range,
    num_max_dispatch_tokens_per_rank, hidden, num_experts)``, plus :attr:`state`:
    ``recv_src_info`` ``[L, M]`` int32 each slot's token index on its source rank,
    ``recv_layout_range`` ``[L, R]`` int64 each source's first slot ``<< 32 |`` its count."""

    state: LowLatencyState


class LowLatency:
    """The low-latency runtimes of one ``Buffer`` (see the module docstring), built on first use
    in the session of the buffer's ``cache``, each for exactly its ``num_max_dispatch_tokens_per_rank``."""

    def __init__(self, cache: RuntimeCache, owner):
        self.cache, self.owner = cache, owner
        self.entries: dict[tuple, RuntimeEntry] = {}
        self.combine_buffers: dict[int, torch.Tensor] = {}
        self.weight_buffers: dict[int, torch.Tensor] = {}  # each runtime's combine weights [num_max, top_k]
        self.calls = 0  # dispatches so far: the next takes buffer calls % LOW_LATENCY_BUFFERS

    # -- runtimes --------------------------------------------------------------------------------
    def entry(self, token_dtype: str, hidden: int, n_experts: int, top_k: int, num_max: int, index) -> RuntimeEntry:
        """The runtime of buffer ``index`` for these rows, built (collective: every argument equal
        on every rank) when none holds ``top_k`` slots; its combine applies the weights at home."""
        key = (token_dtype, hidden, n_experts, num_max, index)
        entry = self.entries.get(key)
        if entry is not None and entry.cfg.top_k >= top_k:
            return entry
        if entry is not None:
            entry.runtime.close()
            self.combine_buffers.pop(id(entry), None)
            self.weight_buffers.pop(id(entry), None)
        from ep_runtime.core.runtime import EPRuntime

        cfg = low_latency_config(self.cache.n_ranks, n_experts, top_k, hidden, num_max, token_dtype)
        runtime = EPRuntime(cfg, self.cache.open_session(cfg))
        entry = self.entries[key] = RuntimeEntry(runtime, _Bridge(runtime))
        return entry

    def close(self) -> None:
        """Close every low-latency runtime (collective)."""
        for entry in self.entries.values():
            entry.runtime.close()
        self.entries.clear()
        self.combine_buffers.clear()
        self.weight_buffers.clear()

    def clean(self, num_max: int, hidden: int, n_experts: int) -> None:
        """``clean_low_latency_buffer``: reset the runtimes of these sizes (collective): they are
        idle and a new epoch starts (earlier handles no longer combine). The runtimes count calls
        by epochs compared with ``>=``, never by flags reset to zero, so a normal-mode call in
        between leaves nothing to clean; this exists for DeepEP's callers."""
        for (_, h, e, m, _), entry in self.entries.items():
            if (h, e, m) == (hidden, n_experts, num_max):
                entry.runtime.reset()

    @staticmethod
    def size_hint(num_max: int, hidden: int, n_ranks: int, n_experts: int) -> int:
        """Symmetric bytes of the low-latency runtimes of these sizes: the two buffers of each
        row format ``hidden`` allows (bf16; FP8 at a multiple of 128; packed UE8M0 at 512),
        routing :data:`HINT_TOP_K` wide (at most ``n_experts``)."""
        top_k = min(HINT_TOP_K, n_experts)
        formats = ["bfloat16"] + (["fp8_e4m3", "fp8_e4m3_ue8m0"] if hidden % 128 == 0 else [])
        return LOW_LATENCY_BUFFERS * sum(
            BufferLayout(low_latency_config(n_ranks, n_experts, top_k, hidden, num_max, f)).symmetric_bytes
            for f in formats)

    # -- dispatch ---------------------------------------------------------------------------------
    def dispatch(self, x, topk_idx, num_max: int, n_experts: int, stats, use_fp8: bool, round_scale: bool,
                 use_ue8m0: bool, async_finish: bool, return_recv_hook: bool):
        """``low_latency_dispatch``'s ``(recv_x, recv_count, handle, event, hook)``. Collective."""
        c = "low_latency_dispatch"
        token_dtype, scales = token_format(use_fp8, round_scale, use_ue8m0)
        T, H = _check_dispatch(x, topk_idx, num_max, n_experts, self.cache.n_ranks)
        L = n_experts // self.cache.n_ranks
        if stats is not None:
            _check(c, "cumulative_local_expert_recv_stats", stats, (torch.int32,), (L,))
        index = self.calls % LOW_LATENCY_BUFFERS
        entry = self.entry(token_dtype, H, n_experts, topk_idx.shape[1], num_max, index)
        self.calls += 1
        rt, bridge = entry.runtime, entry.bridge
        bridge.check(x, c, "x", (_BF16,), (T, H))
        ids = _padded_ids(topk_idx, rt.cfg.top_k)
        weights = torch.zeros(ids.shape, dtype=torch.float32, device=ids.device)  # (the combine brings them)
        with CommCall(self.cache.session, bridge.device, None, async_finish and not return_recv_hook) as call:
            rt_handle = rt.dispatch_async(bridge.to_rt(x.contiguous()), bridge.to_rt(ids), bridge.to_rt(weights))
            views = rt.batched_views(scales)

            def receive():
                rt.dispatch_wait(rt_handle, layout="batched", scales=scales)
                if stats is not None:
                    stats.add_(bridge.from_rt(views["counts"]))

            if not return_recv_hook:
                receive()
            t = bridge.from_rt
            recv_x = t(views["x"])
            if token_dtype != "bfloat16":
                recv_x = (recv_x.view(_FP8), t(views["scales"]))
            count = t(views["counts"])
            state = LowLatencyState(self.owner, entry, rt_handle, views, ids, T, H, num_max, n_experts)
            entry.open = (state, rt_handle)
            handle = LowLatencyHandle((t(views["src_token"]), t(views["layout_range"]), num_max, H, n_experts), state)
            event = call.finish((recv_x, count), (x, topk_idx))
        return recv_x, count, handle, event, self._hook(receive, bridge) if return_recv_hook else _no_hook

    # -- combine ----------------------------------------------------------------------------------
    def combine(self, x, topk_idx, topk_weights, handle, zero_copy: bool, async_finish: bool,
                return_recv_hook: bool, out):
        """``low_latency_combine``'s ``(combined_x, event, hook)``. Collective."""
        c = "low_latency_combine"
        state = self.state_of(handle, c)
        entry = state.entry
        rt, bridge = entry.runtime, entry.bridge
        L, M, T, H = rt.cfg.n_local_experts, rt.cfg.n_ranks * state.num_max, state.n_tokens, state.hidden
        _check(c, "x", x, (_BF16,), (L, M, H))
        _check(c, "topk_idx", topk_idx, (torch.int64, torch.int32), (T, None))
        _check(c, "topk_weights", topk_weights, (torch.float32,), (T, topk_idx.shape[1]))
        if topk_idx.shape[1] > rt.cfg.top_k:
            raise EPInputError(f"{c}: topk_idx has {topk_idx.shape[1]} slots, the dispatch of this handle "
                               f"{rt.cfg.top_k}; pass the dispatch's routing.")
        if out is None:
            out = torch.empty(T, H, dtype=_BF16, device=bridge.device)
        _check(c, "out", out, (_BF16,), (T, H))
        rows = self.combine_buffer(state) if zero_copy else x.contiguous()
        weights = self.weight_buffer(state)[:T]
        with CommCall(self.cache.session, bridge.device, None, async_finish and not return_recv_hook) as call:
            # the weights into the runtime's buffer (on the communication stream, before the
            # receive reads them at home), slots past the caller's top-k zero (never routed)
            weights[:, :topk_weights.shape[1]].copy_(topk_weights)
            weights[:, topk_weights.shape[1]:].zero_()
            pending = rt.combine_async(bridge.to_rt(rows), self._open_dispatch(state), layout="batched",
                                       weights=bridge.to_rt(weights))
            entry.open = None

            def receive():
                rt.combine_wait(pending, out=bridge.to_rt(out))

            if not return_recv_hook:
                receive()
            event = call.finish((out,), (x, topk_idx, topk_weights))
        return out, event, self._hook(receive, bridge) if return_recv_hook else _no_hook

    @staticmethod
    def _open_dispatch(state: LowLatencyState):
        """The runtime handle of ``state``'s dispatch when it is still its runtime's open call;
        else (a second combine of one dispatch, as DeepEP allows) the routing dispatched again
        with zero rows, which places every (token, expert) at the same slot. That dispatch
        overwrites the buffer's received rows with zeros; the caller's combine input is read."""
        entry = state.entry
        if entry.open is not None and entry.open[0] is state:
            return entry.open[1]
        rt, bridge = entry.runtime, entry.bridge
        zeros = torch.zeros(state.n_tokens, state.hidden, dtype=_BF16, device=bridge.device)
        weights = torch.zeros(state.ids.shape, dtype=torch.float32, device=bridge.device)
        rt_handle = rt.dispatch_async(bridge.to_rt(zeros), bridge.to_rt(state.ids), bridge.to_rt(weights))
        rt.dispatch_wait(rt_handle, layout="batched", scales="column")
        return rt_handle

    def combine_buffer(self, state: LowLatencyState) -> torch.Tensor:
        """``get_next_low_latency_combine_buffer``: the ``[L, M, hidden]`` bf16 rows the combine of
        ``state``'s runtime reads with ``zero_copy`` (one per runtime, made at its first use)."""
        entry = state.entry
        key = id(entry)
        if key not in self.combine_buffers:
            cfg = entry.cfg
            self.combine_buffers[key] = torch.zeros(cfg.n_local_experts, cfg.n_ranks * state.num_max, state.hidden,
                                                    dtype=_BF16, device=entry.bridge.device)
        return self.combine_buffers[key]

    def weight_buffer(self, state: LowLatencyState) -> torch.Tensor:
        """The ``[num_max, top_k]`` float32 weights the combine of ``state``'s runtime reads at
        home (one per runtime, made at its first use)."""
        entry = state.entry
        key = id(entry)
        if key not in self.weight_buffers:
            self.weight_buffers[key] = torch.zeros(state.num_max, entry.cfg.top_k, dtype=torch.float32,
                                                   device=entry.bridge.device)
        return self.weight_buffers[key]

    def state_of(self, handle, call: str) -> LowLatencyState:
        if not isinstance(handle, LowLatencyHandle):
            raise EPInputError(f"{call}: handle must be the handle low_latency_dispatch returned; got "
                               f"{type(handle).__name__}.")
        if handle.state.owner is not self.owner:
            raise EPInputError(f"{call}: the handle came from another Buffer; pass a handle of this one.")
        return handle.state

    def _hook(self, receive, bridge: _Bridge):
        """The receive hook: ``receive`` enqueued on the runtime's stream, ordered after the
        caller's current stream and before its later work."""
        session = self.cache.session

        def hook():
            with CommCall(session, bridge.device, None, False) as call:
                receive()
                call.finish(())

        return hook


def low_latency_config(n_ranks: int, n_experts: int, top_k: int, hidden: int, num_max: int,
                       token_dtype: str) -> EPConfig:
    """The config of a low-latency runtime: the batched layout only, its combine weighting at home."""
    return EPConfig(n_ranks=n_ranks, n_experts=n_experts, top_k=top_k, hidden=hidden, max_tokens_per_rank=num_max,
                    token_dtype=token_dtype, layouts=("batched",), combine_weights="home")


def _no_hook():
    """The hook of a call without ``return_recv_hook`` (DeepEP returns a callable that does nothing)."""


def _padded_ids(topk_idx: torch.Tensor, width: int) -> torch.Tensor:
    """``topk_idx`` as the runtime's int32 ``[T, width]`` (masked slots appended; contiguous)."""
    ids = topk_idx.to(torch.int32)
    if width > ids.shape[1]:
        ids = torch.nn.functional.pad(ids, (0, width - ids.shape[1]), value=-1)
    return ids.contiguous()


def _check_dispatch(x, topk_idx, num_max: int, n_experts: int, n_ranks: int) -> tuple[int, int]:
    """Check ``low_latency_dispatch``'s arguments (before anything collective); ``(T, hidden)``."""
    c = "low_latency_dispatch"
    _check(c, "x", x, (_BF16,), (None, None))
    T, H = x.shape
    _check(c, "topk_idx", topk_idx, (torch.int64, torch.int32), (T, None))
    for name, value in (("num_max_dispatch_tokens_per_rank", num_max), ("num_experts", n_experts)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise EPInputError(f"{c}: {name}={value!r} must be an int >= 1.")
    if T > num_max:
        raise EPInputError(f"{c}: x has {T} tokens, more than num_max_dispatch_tokens_per_rank={num_max}; pass at "
                           f"most that many (the same num_max_dispatch_tokens_per_rank on every rank).")
    if n_experts % n_ranks:
        raise EPInputError(f"{c}: num_experts={n_experts} is not a multiple of the {n_ranks} ranks; each rank holds "
                           f"num_experts / num_ranks experts.")
    if topk_idx.shape[1] > n_experts:
        raise EPInputError(f"{c}: topk_idx has {topk_idx.shape[1]} slots for {n_experts} experts; pass at most "
                           f"num_experts (ids distinct per token, -1 for a masked slot).")
    return T, H


def _check(call: str, name: str, t, dtypes: tuple, shape: tuple) -> None:
    if not isinstance(t, torch.Tensor):
        raise EPInputError(f"{call}: {name} must be a torch.Tensor; got {type(t).__name__}.")
    if t.dtype not in dtypes:
        raise EPInputError(f"{call}: {name} must have dtype {' or '.join(map(str, dtypes))}; got {t.dtype}.")
    if t.dim() != len(shape) or any(w is not None and w != s for w, s in zip(shape, t.shape)):
        want = "[" + ", ".join("*" if w is None else str(w) for w in shape) + "]"
        raise EPInputError(f"{call}: {name} must have shape {want}; got {list(t.shape)}.")

