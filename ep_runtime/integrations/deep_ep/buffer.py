"""``deep_ep.Buffer``: DeepEP v1.2.1's buffer on ep_runtime, normal and low-latency modes.

The public Python API of ``deep_ep/buffer.py`` at DeepEP's tag v1.2.1, for one node: the
constructor's arguments, ``get_dispatch_layout``, ``dispatch`` (bf16 or ``(fp8, scales)``
tokens, top-k with -1, ``expert_alignment``, ``num_worst_tokens``, a cached ``handle``),
``combine`` (``topk_weights``, ``bias``), the configs, ``set_num_sms``, ``capture``,
``get_comm_stream`` and ``destroy``, with DeepEP's return tuples, shapes, dtypes and row order;
and the low-latency calls (``low_latency_dispatch`` / ``low_latency_combine``, hooks, the
cleaning, size hint and zero-copy buffer: :mod:`~ep_runtime.integrations.deep_ep.low_latency`).
What DeepEP's API offers and the layer does not do (internode RDMA normal mode, LogFMT, raw
buffer access) raises :class:`~ep_runtime.integrations.deep_ep.errors.DeepEPUnsupportedError`.

Every call is collective over the buffer's group, as DeepEP's: every rank makes the same calls
in the same order (a rank with no tokens too), with the same shapes of routing (top-k width,
expert count, hidden, token format). Calls run on the runtime's stream
(:mod:`~ep_runtime.integrations.deep_ep.streams`). Host reads: a dispatch that returns counts
reads the device once (DeepEP's one synchronization), one with ``num_worst_tokens``, a cached
dispatch and a combine never. docs/deep_ep.md has the differences from DeepEP that remain.
"""

from __future__ import annotations

import torch

from ep_runtime.core.errors import EPInputError, EPStateError
from ep_runtime.integrations.deep_ep import exchange
from ep_runtime.integrations.deep_ep.config import Config, default_config
from ep_runtime.integrations.deep_ep.errors import unsupported
from ep_runtime.integrations.deep_ep.handle import DispatchHandle, HandleState
from ep_runtime.integrations.deep_ep.layout import dispatch_layout, routing_from_ranks, routing_from_topk
from ep_runtime.integrations.deep_ep.low_latency import LowLatency
from ep_runtime.integrations.deep_ep.runtimes import RuntimeCache, RuntimeKey
from ep_runtime.integrations.deep_ep.streams import CommCall
from ep_runtime.integrations.deep_ep.utils import EventHandle, EventOverlap

_BF16, _FP8 = torch.bfloat16, torch.float8_e4m3fn
#: Elements per FP8 block scale (the runtime's FP8 token formats).
FP8_BLOCK = 128
#: The layer's token formats of ``(fp8, scales)`` tokens, by the scales' dtype: float32 scales
#: ``[T, hidden / 128]``, or UE8M0 exponents packed four to an int32 ``[T, hidden / 512]``.
FP8_FORMATS = {torch.float32: "fp8_e4m3", torch.int32: "fp8_e4m3_ue8m0"}


class Buffer:
    """DeepEP's ``Buffer`` in normal mode, within one node, on ep_runtime.

    ``Buffer(group, num_nvl_bytes=0, num_rdma_bytes=0, low_latency_mode=False,
    num_qps_per_rank=24, allow_nvlink_for_low_latency_mode=True, allow_mnnvl=False,
    explicitly_destroy=False, comm=None)`` as DeepEP's, plus two keywords of the layer:

    - ``max_tokens_per_rank``: the fewest tokens per rank the buffers hold (they also hold the
      largest batch of the first dispatch; a larger batch later raises, docs/deep_ep.md);
    - ``debug``: the runtime's debug mode (None: on for the simulator, off on GPUs), in which the
      layer also checks ``is_token_in_rank`` against ``topk_idx`` and ``num_worst_tokens``
      against the rows received;
    - ``session``: an ep_runtime session this process already opened over the group's ranks (one
      process holds one: e.g. a benchmark's), used instead of opening one at the first dispatch.

    ``num_nvl_bytes`` is the least symmetric heap the layer's session opens with (it opens at
    the first dispatch, collectively, with room for its runtimes). ``low_latency_mode=True``
    allows the low-latency calls, and ``num_rdma_bytes`` (DeepEP's low-latency buffer,
    :meth:`get_low_latency_rdma_size_hint`) then counts toward that heap too; without it
    ``num_rdma_bytes > 0`` (DeepEP's internode normal mode) raises
    :class:`DeepEPUnsupportedError`. ``num_qps_per_rank``, ``allow_nvlink_for_low_latency_mode``
    and ``allow_mnnvl`` concern DeepEP's RDMA transport and are accepted (one node, NVLink).

    Attributes: ``rank``, ``group`` (the group, or ``comm``), ``group_size``,
    ``num_nvl_bytes``, ``num_rdma_bytes``, ``low_latency_mode``, ``explicitly_destroy``, as
    DeepEP's; ``num_sms`` (class attribute, 20).
    """

    num_sms: int = 20

    def __init__(self, group, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0, low_latency_mode: bool = False,
                 num_qps_per_rank: int = 24, allow_nvlink_for_low_latency_mode: bool = True, allow_mnnvl: bool = False,
                 explicitly_destroy: bool = False, comm=None, *, max_tokens_per_rank: int | None = None,
                 debug: bool | None = None, session=None) -> None:
        for name, value in (("num_nvl_bytes", num_nvl_bytes), ("num_rdma_bytes", num_rdma_bytes),
                            ("max_tokens_per_rank", max_tokens_per_rank or 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise EPInputError(f"Buffer: {name}={value!r} must be an int >= 0.")
        if num_rdma_bytes > 0 and not low_latency_mode:
            raise unsupported("Buffer", f"num_rdma_bytes={num_rdma_bytes} asks for DeepEP's internode (RDMA) buffer",
                              "The layer runs DeepEP's intranode normal mode (one node, NVLink), which needs none: "
                              "pass num_rdma_bytes=0 (what Config.get_rdma_buffer_size_hint gives for a group of at "
                              "most 8 ranks)")
        if group is None and comm is None and session is None:
            raise EPInputError("Buffer: pass group= (a torch.distributed ProcessGroup) or comm= (an mpi4py "
                               "communicator); either must be provided.")
        self.group = group if group is not None else comm
        heap_floor = max(num_nvl_bytes, num_rdma_bytes)
        self._cache = RuntimeCache(self.group, heap_floor, max_tokens_per_rank or 0, "Buffer", "max_tokens_per_rank",
                                   session)
        self._low_latency = LowLatency(self._cache, self)
        self.rank, self.group_size = self._cache.rank, self._cache.n_ranks
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
        self.low_latency_mode, self.explicitly_destroy = bool(low_latency_mode), bool(explicitly_destroy)
        self._debug = debug
        self._unknown_cache: dict = {}
        self._destroyed = False

    # -- lifetime and configuration ------------------------------------------------------------
    def destroy(self) -> None:
        """Free the buffer's runtimes (collective); needs ``explicitly_destroy=True``, as DeepEP's.
        The process's session stays open (one per process). Later calls raise."""
        if not self.explicitly_destroy:
            raise EPStateError("Buffer.destroy: the `explicitly_destroy` flag must be set (Buffer(..., "
                               "explicitly_destroy=True)); without it the runtimes live as long as the process.")
        self._low_latency.close()
        self._cache.close()
        self._destroyed = True

    @staticmethod
    def is_sm90_compiled() -> bool:
        """True: the layer's FP8 (E4M3) dispatch runs wherever the layer runs."""
        return True

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """Set ``Buffer.num_sms`` (even, as DeepEP requires), which the configs carry; the
        runtime's execution plan sizes the grids."""
        if isinstance(new_num_sms, bool) or not isinstance(new_num_sms, int) or new_num_sms <= 0 or new_num_sms % 2:
            raise EPInputError(f"Buffer.set_num_sms: new_num_sms={new_num_sms!r} must be a positive even int (the "
                               f"SM count must be even).")
        Buffer.num_sms = new_num_sms

    @staticmethod
    def capture() -> EventOverlap:
        """An event on the current stream (``EventOverlap(EventHandle())``), e.g. a ``previous_event``."""
        return EventOverlap(EventHandle())

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        """The dispatch config for ``num_ranks`` ranks: ``Config(Buffer.num_sms)`` with DeepEP's
        field defaults (the layer does not tune per group size; any size from 1 to 64)."""
        return default_config(Buffer.num_sms, num_ranks, "Buffer.get_dispatch_config")

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        """The combine config for ``num_ranks`` ranks, as :meth:`get_dispatch_config`."""
        return default_config(Buffer.num_sms, num_ranks, "Buffer.get_combine_config")

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                       num_experts: int) -> int:
        """Symmetric heap bytes the low-latency calls of these sizes use: the two alternating
        runtimes of each row format ``hidden`` allows (:mod:`.low_latency`); pass it as
        ``num_rdma_bytes``."""
        return LowLatency.size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts)

    def get_comm_stream(self):
        """The communication stream: the runtime's CUDA stream (from the first dispatch, which
        opens the session). Without CUDA (the simulator) there are no streams:
        ``torch.cpu.current_stream()``."""
        if not torch.cuda.is_available():
            return torch.cpu.current_stream()
        session = self._cache.session
        if session is None:
            raise EPStateError("Buffer.get_comm_stream: the layer's communication stream is its runtimes' stream, "
                               "which exists from the first dispatch (it opens the session); call it after one.")
        device = torch.device("cuda", session.device_index)
        return torch.cuda.ExternalStream(session.stream.ptr, device=device)

    def get_local_buffer_tensor(self, dtype, size=None, offset: int = 0, use_rdma_buffer: bool = False):
        raise unsupported("Buffer.get_local_buffer_tensor", "raw access to DeepEP's NVLink or RDMA buffer",
                          "The layer's buffers are its runtimes' (layouts in docs/protocol.md); read results "
                          "through dispatch and combine")

    # -- dispatch layout ----------------------------------------------------------------------
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int, previous_event: EventOverlap | None = None,
                            async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """``(num_tokens_per_rank [R] int32, None, num_tokens_per_expert [E] int32,
        is_token_in_rank [T, R] bool, event)`` of ``topk_idx`` ``[T, K]`` int64 (-1: no
        selection); ``None``: DeepEP's ``num_tokens_per_rdma_rank``, absent within a node. Device
        ops on the current stream after ``previous_event``; no host read; not collective."""
        self._check_alive("get_dispatch_layout")
        _check_streams("get_dispatch_layout", previous_event, async_finish, allocate_on_comm_stream)
        _check_tensor("get_dispatch_layout", "topk_idx", topk_idx, (torch.int64,), (None, None))
        if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts <= 0 \
                or num_experts % self.group_size:
            raise EPInputError(f"get_dispatch_layout: num_experts={num_experts!r} must be a positive multiple of the "
                               f"group's {self.group_size} ranks.")
        if previous_event is not None and previous_event.event is not None:
            previous_event.event.current_stream_wait()
        per_rank, per_expert, in_rank = dispatch_layout(topk_idx, num_experts, self.group_size)
        return per_rank, None, per_expert, in_rank, EventOverlap(EventHandle() if async_finish else None)

    # -- dispatch -------------------------------------------------------------------------------
    def dispatch(self, x, handle: tuple | None = None, num_tokens_per_rank: torch.Tensor | None = None,
                 num_tokens_per_rdma_rank: torch.Tensor | None = None, is_token_in_rank: torch.Tensor | None = None,
                 num_tokens_per_expert: torch.Tensor | None = None, topk_idx: torch.Tensor | None = None,
                 topk_weights: torch.Tensor | None = None, expert_alignment: int = 1, num_worst_tokens: int = 0,
                 config: Config | None = None, previous_event: EventOverlap | None = None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False):
        """DeepEP's dispatch. Collective.

        Parameters
        ----------
        x : ``[T, hidden]`` bfloat16, or ``(codes, scales)``: ``[T, hidden]`` float8_e4m3fn and
            ``[T, hidden / 128]`` float32 scales, or ``[T, hidden / 512]`` int32 (UE8M0 exponents,
            four a word); ``hidden`` a multiple of 128 in FP8. Scales may be column-major.
        handle : a handle of an earlier dispatch of this buffer: a cached dispatch of ``x`` with
            its routing (no top-k, no layout arguments, no host read).
        num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert : ``get_dispatch_layout``'s
            ``[R]`` int32, ``[T, R]`` bool, ``[E]`` int32 (required without ``handle``).
            ``num_tokens_per_rdma_rank`` must be None (within one node).
        topk_idx, topk_weights : ``[T, K]`` int64 (-1: no selection) and float32, or both None:
            then the tokens go where ``is_token_in_rank`` says and no top-k comes back.
        expert_alignment : each count of the returned list rounded up to a multiple of it.
        num_worst_tokens : ``N`` rows returned (at least the rows received): no host read and an
            empty list; rows past those received are zero with ``recv_topk_idx`` -1.
        config, previous_event, async_finish, allocate_on_comm_stream : as DeepEP's (``config``
            is checked and sets the width of the handle's channel matrices).

        Returns
        -------
        ``(recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle,
        event)``: ``recv_x`` ``[N, hidden]`` like ``x`` (a tuple in FP8), one row per received
        (token, source), source rank then token order; ``recv_topk_idx`` ``[N, K]`` int64, the
        slot's local expert or -1; ``recv_topk_weights`` ``[N, K]`` float32 (0 where -1); the
        list of ``L`` aligned per-expert counts; the handle; the event. A cached dispatch returns
        ``(recv_x, None, None, None, None, event)``.
        """
        self._check_alive("dispatch")
        c = "dispatch"
        _check_config(c, config)
        _check_streams(c, previous_event, async_finish, allocate_on_comm_stream)
        if num_tokens_per_rdma_rank is not None:
            raise unsupported(c, "num_tokens_per_rdma_rank is DeepEP's internode (RDMA) layout",
                              "Within one node get_dispatch_layout returns None for it: pass None")
        tokens, scales, token_dtype = _tokens(x)
        if handle is not None:
            return self._cached_dispatch(handle, tokens, scales, token_dtype, topk_idx, topk_weights, previous_event,
                                         async_finish)
        T, H = tokens.shape
        R = self.group_size
        if num_tokens_per_rank is None or is_token_in_rank is None or num_tokens_per_expert is None:
            raise EPInputError(f"{c}: without a handle, pass num_tokens_per_rank, is_token_in_rank and "
                               f"num_tokens_per_expert (Buffer.get_dispatch_layout's results).")
        _check_tensor(c, "num_tokens_per_rank", num_tokens_per_rank, (torch.int32,), (R,))
        _check_tensor(c, "is_token_in_rank", is_token_in_rank, (torch.bool,), (T, R))
        _check_tensor(c, "num_tokens_per_expert", num_tokens_per_expert, (torch.int32,), (None,))
        E = num_tokens_per_expert.shape[0]
        if E == 0 or E % R:
            raise EPInputError(f"{c}: num_tokens_per_expert has {E} experts; expected a positive multiple of the "
                               f"group's {R} ranks.")
        for name, value, low in (("expert_alignment", expert_alignment, 1), ("num_worst_tokens", num_worst_tokens, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise EPInputError(f"{c}: {name}={value!r} must be an int >= {low}.")
        if (topk_idx is None) != (topk_weights is None):
            raise EPInputError(f"{c}: pass topk_idx and topk_weights together, or neither.")
        if topk_idx is not None:
            _check_tensor(c, "topk_idx", topk_idx, (torch.int64,), (T, None))
            _check_tensor(c, "topk_weights", topk_weights, (torch.float32,), (T, topk_idx.shape[1]))
            routing = routing_from_topk(topk_idx, topk_weights, E)
        elif num_worst_tokens:
            raise EPInputError(f"{c}: num_worst_tokens={num_worst_tokens} needs topk_idx and topk_weights (DeepEP's "
                               f"worst-case dispatch is a forward with top-k).")
        else:
            routing = routing_from_ranks(is_token_in_rank, E)
        key = RuntimeKey(H, E, token_dtype)
        self._cache.entry(key, routing.ids.shape[1], T)  # built (collectively) before the call is ordered on its stream
        with CommCall(self._cache.session, tokens.device, previous_event, async_finish) as call:
            if topk_idx is not None:
                dense, entry = exchange.dispatch(self._cache, key, tokens, scales, routing, topk_idx.shape[1],
                                                 num_worst_tokens or None, expert_alignment)
                self._debug_checks(entry, dense, topk_idx, E, is_token_in_rank, num_worst_tokens)
                counts = dense.counts
            else:
                num_recv, counts = self._counts_from_layout(num_tokens_per_rank, num_tokens_per_expert,
                                                            expert_alignment)
                dense, entry = exchange.dispatch(self._cache, key, tokens, scales, routing, None, num_recv,
                                                 expert_alignment)
            cfg = entry.cfg
            handle = self._handle(dense, routing, cfg.max_tokens_per_rank, is_token_in_rank, T, H,
                                  config or self.get_dispatch_config(R))
            recv_x = _recv_tokens(dense.x, dense.scales, token_dtype)
            outputs = (dense.x, dense.scales, dense.topk_idx, dense.topk_weights, *handle)
            event = call.finish(outputs, (tokens, scales, topk_idx, topk_weights, is_token_in_rank))
        return recv_x, dense.topk_idx, dense.topk_weights, counts, handle, event

    def _cached_dispatch(self, handle, tokens, scales, token_dtype, topk_idx, topk_weights, previous_event,
                         async_finish):
        """A dispatch with ``handle``: its routing, its rows (see :meth:`dispatch`)."""
        c = "dispatch"
        if topk_idx is not None or topk_weights is not None:
            raise EPInputError(f"{c}: a cached dispatch (handle=...) reuses the handle's routing; pass no topk_idx or "
                               f"topk_weights.")
        state = self._state_of(handle, c)
        if tokens.shape[0] != state.n_tokens:
            raise EPInputError(f"{c}: x has {tokens.shape[0]} tokens but the handle's dispatch had {state.n_tokens}; "
                               f"a cached dispatch sends as many tokens as the dispatch that made the handle.")
        key = RuntimeKey(tokens.shape[1], state.routing.n_experts, token_dtype)
        self._cache.entry(key, state.routing.ids.shape[1], state.n_tokens)
        with CommCall(self._cache.session, tokens.device, previous_event, async_finish) as call:
            rows, rows_scales = exchange.cached_dispatch(self._cache, key, tokens, scales, state)
            event = call.finish((rows, rows_scales), (tokens, scales))
        return _recv_tokens(rows, rows_scales, token_dtype), None, None, None, None, event

    # -- combine ------------------------------------------------------------------------------
    def combine(self, x: torch.Tensor, handle: tuple, topk_weights: torch.Tensor | None = None, bias=None,
                config: Config | None = None, previous_event: EventOverlap | None = None, async_finish: bool = False,
                allocate_on_comm_stream: bool = False):
        """DeepEP's combine: ``(combined_x, combined_topk_weights, event)``. Collective; no host read.

        ``x`` ``[N, hidden]`` bfloat16, row-aligned with the dispatch of ``handle``: each token's
        rows summed over the ranks it went to (unweighted), in float32, plus ``bias`` (a
        ``[T, hidden]`` bfloat16 tensor or a pair of them), rounded once to ``[T, hidden]``
        bfloat16. ``topk_weights`` ``[N, K]`` float32: ``combined_topk_weights`` ``[T, K]`` is
        each slot's float32 sum over those ranks (None without it).
        """
        self._check_alive("combine")
        c = "combine"
        _check_config(c, config)
        _check_streams(c, previous_event, async_finish, allocate_on_comm_stream)
        state = self._state_of(handle, c)
        _check_tensor(c, "x", x, (_BF16,), (state.n_rows, None))
        T, H = state.n_tokens, x.shape[1]
        if topk_weights is not None:
            _check_tensor(c, "topk_weights", topk_weights, (torch.float32,), (state.n_rows, None))
        biases = bias if isinstance(bias, tuple) else (bias,) if bias is not None else ()
        if len(biases) > 2:
            raise EPInputError(f"{c}: bias is a tensor or a pair of tensors; got {len(biases)}.")
        for b in biases:
            _check_tensor(c, "bias", b, (_BF16,), (T, H))
        x = x.contiguous()
        with CommCall(self._cache.session, x.device, previous_event, async_finish) as call:
            aux = None
            for b in biases:
                aux = b.float() if aux is None else aux + b.float()
            out, entry = exchange.combine(self._cache, state, x, aux)
            weights = None
            if topk_weights is not None:
                weights = exchange.combine_weights(self._cache, entry, state, topk_weights.contiguous())
            event = call.finish((out, weights), (x, topk_weights, *biases))
        return out, weights, event

    # -- what the layer does not do --------------------------------------------------------------
    def internode_dispatch(self, *args, **kwargs):
        raise unsupported("Buffer.internode_dispatch", "DeepEP's internode (RDMA) normal mode",
                          "The layer runs within one node: call dispatch")

    def internode_combine(self, *args, **kwargs):
        raise unsupported("Buffer.internode_combine", "DeepEP's internode (RDMA) normal mode",
                          "The layer runs within one node: call combine")

    # -- low-latency mode ------------------------------------------------------------------------
    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """Reset the low-latency runtimes of these sizes (collective; earlier handles no longer
        combine). Nothing needs it after a normal-mode call (:meth:`LowLatency.clean`)."""
        self._check_low_latency("clean_low_latency_buffer")
        self._low_latency.clean(num_max_dispatch_tokens_per_rank, hidden, num_experts)

    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, num_max_dispatch_tokens_per_rank: int,
                             num_experts: int, cumulative_local_expert_recv_stats: torch.Tensor | None = None,
                             dispatch_wait_recv_cost_stats: torch.Tensor | None = None, use_fp8: bool = True,
                             round_scale: bool = False, use_ue8m0: bool = False, async_finish: bool = False,
                             return_recv_hook: bool = False):
        """DeepEP's low-latency dispatch: ``(recv_x, recv_count, handle, event, hook)``. Collective;
        no host read.

        ``x`` ``[T, hidden]`` bf16, T at most ``num_max_dispatch_tokens_per_rank`` (M / R below);
        ``topk_idx`` ``[T, K]`` int64 (or int32), -1 masked. ``recv_x`` ``[L, M, hidden]`` bf16, or
        with ``use_fp8`` ``(codes [L, M, hidden] float8_e4m3fn, scales)``: ``[L, M, hidden / 128]``
        float32 (powers of two with ``round_scale``), or with ``use_ue8m0`` ``[L, M, hidden / 512]``
        int32 of four UE8M0 codes; the scales column-major in the last two dimensions. Local expert
        e's rows are ``recv_x[e, :recv_count[e]]``, source rank ascending then token order.
        ``cumulative_local_expert_recv_stats`` ``[L]`` int32 gets ``recv_count`` added. The tensors
        are the same memory every call of the buffer they came from (two alternate)."""
        self._check_low_latency("low_latency_dispatch")
        if dispatch_wait_recv_cost_stats is not None:
            raise unsupported("low_latency_dispatch", "dispatch_wait_recv_cost_stats (per-peer receive wait times)",
                              "The layer does not time its waits per peer: pass None")
        _check_hook(return_recv_hook, async_finish, "low_latency_dispatch")
        return self._low_latency.dispatch(x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                                          cumulative_local_expert_recv_stats, use_fp8, round_scale, use_ue8m0,
                                          async_finish, return_recv_hook)

    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                            handle: tuple, use_logfmt: bool = False, zero_copy: bool = False,
                            async_finish: bool = False, return_recv_hook: bool = False, out: torch.Tensor | None = None,
                            combine_wait_recv_cost_stats: torch.Tensor | None = None):
        """DeepEP's low-latency combine: ``(combined_x, event, hook)``. Collective; no host read.

        ``x`` ``[L, M, hidden]`` bf16, each slot's expert output (with ``zero_copy``, the rows are
        read from :meth:`get_next_low_latency_combine_buffer` instead); ``topk_idx`` and
        ``topk_weights`` ``[T, K]`` the dispatch's routing and the weights to apply. ``combined_x``
        (``out`` when given) ``[T, hidden]`` bf16: each token's sum over its slots of weight x
        output (docs/deep_ep.md, "Low-latency mode", has the order of the sums)."""
        self._check_low_latency("low_latency_combine")
        if use_logfmt:
            raise unsupported("low_latency_combine", "use_logfmt=True (DeepEP's 10-bit LogFMT combine)",
                              "The layer combines bf16 rows: pass use_logfmt=False")
        if combine_wait_recv_cost_stats is not None:
            raise unsupported("low_latency_combine", "combine_wait_recv_cost_stats (per-peer receive wait times)",
                              "The layer does not time its waits per peer: pass None")
        _check_hook(return_recv_hook, async_finish, "low_latency_combine")
        return self._low_latency.combine(x, topk_idx, topk_weights, handle, zero_copy, async_finish,
                                         return_recv_hook, out)

    def get_next_low_latency_combine_buffer(self, handle: tuple) -> torch.Tensor:
        """The ``[L, M, hidden]`` bf16 rows that ``low_latency_combine(..., handle, zero_copy=True)``
        reads: write the expert outputs there and skip the copy."""
        self._check_low_latency("get_next_low_latency_combine_buffer")
        state = self._low_latency.state_of(handle, "get_next_low_latency_combine_buffer")
        return self._low_latency.combine_buffer(state)

    def low_latency_update_mask_buffer(self, *args, **kwargs):
        raise unsupported("Buffer.low_latency_update_mask_buffer", "DeepEP's rank masking (after v1.2.1)",
                          "The layer's low-latency mode has no mask buffer: every rank takes part in every call")

    def low_latency_query_mask_buffer(self, *args, **kwargs):
        raise unsupported("Buffer.low_latency_query_mask_buffer", "DeepEP's rank masking (after v1.2.1)",
                          "The layer's low-latency mode has no mask buffer: every rank takes part in every call")

    def low_latency_clean_mask_buffer(self, *args, **kwargs):
        raise unsupported("Buffer.low_latency_clean_mask_buffer", "DeepEP's rank masking (after v1.2.1)",
                          "The layer's low-latency mode has no mask buffer: every rank takes part in every call")

    # -- internals -----------------------------------------------------------------------------
    def _check_low_latency(self, call: str) -> None:
        self._check_alive(call)
        if not self.low_latency_mode:
            raise EPStateError(f"Buffer.{call}: the buffer was built without low_latency_mode; build it with "
                               f"Buffer(group, num_rdma_bytes=Buffer.get_low_latency_rdma_size_hint(...), "
                               f"low_latency_mode=True).")

    def _check_alive(self, call: str) -> None:
        if self._destroyed:
            raise EPStateError(f"Buffer.{call}: the buffer was destroyed; build a new Buffer.")

    def _state_of(self, handle, call: str) -> HandleState:
        if not isinstance(handle, DispatchHandle):
            raise EPInputError(f"{call}: handle must be the handle a dispatch of this Buffer returned; got "
                               f"{type(handle).__name__}.")
        if handle.state.owner is not self:
            raise EPInputError(f"{call}: the handle came from another Buffer; pass a handle of this one.")
        return handle.state

    def _counts_from_layout(self, per_rank: torch.Tensor, per_expert: torch.Tensor, alignment: int):
        """A dispatch without top-k: the rows this rank receives and its aligned per-expert counts,
        from every rank's layout (DeepEP's notify step: one gather, one host read)."""
        R, rank = self.group_size, self.rank
        L = per_expert.shape[0] // R
        table = self._cache.gather_values(torch.cat([per_rank.long(), per_expert.long()]))
        counts = table[:, R + rank * L:R + (rank + 1) * L].sum(0)
        counts = (counts + alignment - 1) // alignment * alignment
        return int(table[:, rank].sum()), counts.tolist()

    def _handle(self, dense, routing, capacity: int, is_token_in_rank, T: int, H: int, config: Config):
        """DeepEP's 6-tuple (see :class:`DispatchHandle`) with the layer's state."""
        R, dev = self.group_size, dense.source.device
        prefix = torch.full((R, R), -1, dtype=torch.int32, device=dev)
        prefix[:, self.rank] = dense.per_source.cumsum(0).to(torch.int32)
        src_idx = torch.where(dense.source >= 0, dense.source % capacity, -1).to(torch.int32)
        channels = (R, max(config.num_channels, 1))
        items = (prefix, self._unknown(channels, dev), self._unknown(channels, dev), src_idx, is_token_in_rank,
                 self._unknown((T, R), dev))
        return DispatchHandle(items, HandleState(self, routing, dense.source, capacity, T, H))

    def _unknown(self, shape: tuple, device) -> torch.Tensor:
        """A ``shape`` int32 tensor of -1 (made once per shape and device, shared read-only by handles)."""
        key = (shape, str(device))
        if key not in self._unknown_cache:
            self._unknown_cache[key] = torch.full(shape, -1, dtype=torch.int32, device=device)
        return self._unknown_cache[key]

    def _debug_checks(self, entry, dense, topk_idx, n_experts: int, is_token_in_rank, num_worst_tokens: int) -> None:
        """Debug mode: ``is_token_in_rank`` is the layout of ``topk_idx`` (the layer routes by
        ``topk_idx``), and ``num_worst_tokens`` holds the rows received (host reads)."""
        if not (entry.runtime.debug if self._debug is None else self._debug):
            return
        want = dispatch_layout(topk_idx, n_experts, self.group_size)[2]
        if not torch.equal(want, is_token_in_rank):
            raise EPInputError("dispatch: is_token_in_rank differs from the layout of topk_idx; the layer sends each "
                               "token to the ranks of its top-k experts: pass get_dispatch_layout(topk_idx, ...)'s.")
        received = int(dense.per_source.sum())
        if num_worst_tokens and received > num_worst_tokens:
            raise EPInputError(f"dispatch: num_worst_tokens={num_worst_tokens} but this rank received {received} rows; "
                               f"pass at least the worst case (e.g. num_tokens * num_ranks).")


def _tokens(x):
    """``(tokens, scales, token_dtype)`` of dispatch's ``x``: bf16 tokens (contiguous), or FP8
    codes as uint8 and their scales as uint8 or float32 (contiguous), with the runtime format."""
    if not isinstance(x, tuple):
        _check_tensor("dispatch", "x", x, (_BF16,), (None, None))
        return x.contiguous(), None, "bfloat16"
    if len(x) != 2:
        raise EPInputError(f"dispatch: x is a bf16 tensor or a pair (fp8 codes, scales); got a tuple of {len(x)}.")
    codes, scales = x
    _check_tensor("dispatch", "x[0]", codes, (_FP8,), (None, None))
    T, H = codes.shape
    fmt = FP8_FORMATS.get(getattr(scales, "dtype", None))
    per_word = 4 if fmt == "fp8_e4m3_ue8m0" else 1
    width = H // FP8_BLOCK // per_word
    if (fmt is None or not isinstance(scales, torch.Tensor) or H % (FP8_BLOCK * per_word)
            or tuple(scales.shape) != (T, width)):
        raise unsupported("dispatch", f"FP8 tokens [{T}, {H}] with scales "
                          f"{list(getattr(scales, 'shape', []))} {getattr(scales, 'dtype', type(scales).__name__)}",
                          f"The layer moves E4M3 codes with one float32 scale per {FP8_BLOCK} elements ([T, hidden / "
                          f"128] float32) or UE8M0 exponents packed four to an int32 ([T, hidden / 512] int32), "
                          f"hidden a multiple of {FP8_BLOCK} (of 512 for packed exponents)")
    codes, scales = _row_major(codes), _row_major(scales)
    return codes.view(torch.uint8), scales.view(torch.uint8) if per_word > 1 else scales, fmt


def _row_major(t: torch.Tensor) -> torch.Tensor:
    """``t`` C-contiguous with row-major strides (an empty tensor counts as contiguous whatever
    its strides, which a byte view refuses: a fresh one then)."""
    return t.contiguous() if t.numel() else torch.empty(t.shape, dtype=t.dtype, device=t.device)


def _recv_tokens(rows: torch.Tensor, scales: torch.Tensor | None, token_dtype: str):
    """Dispatch's ``recv_x`` in the caller's format: bf16 rows, or ``(codes, scales)``."""
    if scales is None:
        return rows
    codes = rows.view(_FP8)
    return (codes, scales.view(torch.int32) if token_dtype == "fp8_e4m3_ue8m0" else scales)


def _check_tensor(call: str, name: str, t, dtypes: tuple, shape: tuple) -> None:
    if not isinstance(t, torch.Tensor):
        raise EPInputError(f"{call}: {name} must be a torch.Tensor; got {type(t).__name__}.")
    if t.dtype not in dtypes:
        raise EPInputError(f"{call}: {name} must have dtype {' or '.join(map(str, dtypes))}; got {t.dtype}.")
    if t.dim() != len(shape) or any(w is not None and w != s for w, s in zip(shape, t.shape)):
        want = "[" + ", ".join("*" if w is None else str(w) for w in shape) + "]"
        raise EPInputError(f"{call}: {name} must have shape {want}; got {list(t.shape)}.")


def _check_config(call: str, config) -> None:
    if config is not None and not isinstance(config, Config):
        raise EPInputError(f"{call}: config must be a deep_ep.Config or None; got {type(config).__name__}.")


def _check_streams(call: str, previous_event, async_finish: bool, allocate_on_comm_stream: bool) -> None:
    if previous_event is not None and not isinstance(previous_event, EventOverlap):
        raise EPInputError(f"{call}: previous_event must be an EventOverlap (Buffer.capture()) or None; got "
                           f"{type(previous_event).__name__}.")
    if allocate_on_comm_stream and (previous_event is None or not async_finish):
        raise EPInputError(f"{call}: allocate_on_comm_stream=True needs previous_event and async_finish=True (as "
                           f"DeepEP's).")


def _check_hook(return_recv_hook: bool, async_finish: bool, call: str) -> None:
    if return_recv_hook and async_finish:
        raise EPInputError(f"{call}: async_finish and return_recv_hook exclude each other (as DeepEP's): the hook "
                           f"receives on the caller's stream; pass one of them.")
