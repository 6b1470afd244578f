"""`EPRuntime`: owns the buffers of one expert-parallel layer and sequences its four kernels.

``dispatch_async`` / ``dispatch_wait`` and ``combine_async`` / ``combine_wait`` are MAX's
split: each async call returns as soon as its kernel is enqueued (sends issued), so the
caller can overlap compute; each wait call enqueues the kernel that completes the exchange.
All four are **collective** (every rank makes the same calls in the same order) and enqueue
on the session's stream (``session.stream``); none synchronizes the host on the GPU, and all
per-call state (call numbers, counts) lives in device memory, so the four calls can be
captured in a CUDA graph. Errors detected on the device (a wait past its timeout, too many
rows) are raised by :meth:`EPRuntime.synchronize` (and by every call on the simulator, which
runs synchronously), after which the runtime refuses calls until :meth:`reset`.

How rows move is the runtime's execution plan (:attr:`EPRuntime.plan`, :mod:`ep_runtime.core.plan`),
chosen once at construction from the config, the session's topology and any overrides.
"""

from __future__ import annotations

import itertools
from enum import Enum

import numpy as np

from ep_runtime.core import arrays
from ep_runtime.core.builds import combine_wait_with, kernel_builds
from ep_runtime.core.call_memo import CallMemo, PreparedCall
from ep_runtime.core.config import LAYOUTS, EPConfig
from ep_runtime.core.errors import EPConfigError, EPInputError, EPStateError
from ep_runtime.core.handles import (CombineHandle, CompactBatch, DispatchHandle, ExpertBatch, KeptRouting, SlotValuesHandle,
                      from_fields)
from ep_runtime.core.kernel_args import KERNEL_ARGS, WORD_ARRAYS, build_args, region_view
from ep_runtime.core.layout import PEER_REGIONS, SYNC_CALLS, BufferLayout, partial_dtype, token_word
from ep_runtime.core.plan import ExpandedCopy, Plan, Receiver, Topology, Transport, agree, check_plan, choose_plan, merged_overrides
from ep_runtime.shmem.session import Session
from ep_runtime.core.status import error_from_status

_owner_ids = itertools.count(1)

#: The layouts of dispatch_wait's result and of combine_async's input.
DISPATCH_LAYOUTS = LAYOUTS
#: The layouts of an FP8 expert batch's scales: [rows, S] or [S, rows].
SCALE_LAYOUTS = ("row", "column")

#: int64 scalar arguments 0 and 1, one object each: the fast launch path rewrites an argument
#: only when its object changes (ep_runtime.shmem.fast_launch).
_INT64 = (np.int64(0), np.int64(1))


class _State(Enum):
    IDLE = "idle"                    # next: dispatch_async
    DISPATCH_SENT = "dispatch sent"  # next: dispatch_wait
    DISPATCHED = "dispatched"        # next: combine_async (or dispatch_async, skipping combine, or slot_values_async)
    SLOTS_SENT = "slot values sent"  # next: slot_values_wait (then DISPATCHED again)
    COMBINE_SENT = "combine sent"    # next: combine_wait


#: Position of each state within one call, to tell a reused handle from a premature one.
_STEP = {_State.DISPATCH_SENT: 1, _State.DISPATCHED: 2, _State.SLOTS_SENT: 2, _State.COMBINE_SENT: 3, _State.IDLE: 4}


class EPRuntime:
    """Buffers, counters and kernels of one expert-parallel layer on one rank.

    Parameters
    ----------
    cfg : EPConfig
        Must be identical on every rank (checked here, collectively). Its ``layouts`` are the
        dispatch layouts this runtime serves.
    session : Session
        The SHMEM session (``nvshmem`` or ``sim``) of this rank; its heap must hold
        ``BufferLayout(cfg, plan).symmetric_bytes``.
    debug : bool or None
        Check routing on the device before each dispatch (ids in ``[-1, n_experts)`` and
        distinct per token, weights finite; one small kernel, no host synchronization) and
        synchronize after each call so device errors are raised by the call that caused them.
        None (default): on for the simulator, off on GPUs. Off, the kernels still never let a
        bad id reach an address: dispatch_async drops an id outside ``[-1, n_experts)`` and
        records it (raised by the next :meth:`synchronize`), and a repeated id counts once.
    plan : None, dict, str or Plan
        The execution plan: None (the plan :func:`~ep_runtime.core.plan.choose_plan` picks), plan
        fields to override (``{"receiver": "land"}`` or ``"receiver=land,pdl=0"``), or a whole
        :class:`~ep_runtime.core.plan.Plan`. ``EP_RUNTIME_PLAN`` may add overrides for experiments.
        Invalid fields and combinations raise :class:`~ep_runtime.core.errors.EPConfigError` naming
        the rule; every rank must end with the same plan (checked, collectively).

    Construction and :meth:`close` are collective. Use as a context manager.

    Attributes
    ----------
    plan : Plan
        How this runtime moves rows (``rt.plan.describe()`` prints it with its reasons).
    layout : BufferLayout
        The regions the plan allocates.
    """

    def __init__(self, cfg: EPConfig, session: Session, debug: bool | None = None, plan=None):
        if cfg.n_ranks != session.n_ranks:
            raise EPConfigError(f"EPConfig.n_ranks={cfg.n_ranks} but the session has {session.n_ranks} ranks; "
                                f"build the config with n_ranks={session.n_ranks}.")
        _check_same_config_everywhere(cfg, session)
        self.cfg, self.session = cfg, session
        self.rank = session.rank
        self.debug = session.backend == "sim" if debug is None else bool(debug)
        self._owner = next(_owner_ids)
        self.plan = _resolve_plan(cfg, Topology.of(session), plan)
        agree(self.plan, session)
        self.layout = BufferLayout(cfg, self.plan)
        self._word = token_word(cfg.hidden)
        self._timeout_ns = np.int64(round(cfg.wait_timeout_s * 1e9))
        self._sym = session.alloc_symmetric("ep_runtime.symmetric", (self.layout.symmetric_bytes,), np.uint8)
        self._local = session.alloc_local("ep_runtime.local", (self.layout.local_bytes,), np.uint8)
        self.buffers = {}
        for r in self.layout.regions:
            block = self._sym if r.symmetric else self._local
            view = block[r.offset:r.offset + r.nbytes].view(r.dtype).reshape(r.shape)
            session.fill(view, r.init)
            self.buffers[r.name] = view
        self._fmt = cfg.token_format
        regions = dict(self.buffers)
        for name, (dtype, ndim) in self.layout.absent().items():  # empty stand-ins, allocated once (graph-safe)
            regions[name] = session.alloc_local(f"unused {name}", (0,) * ndim, dtype)
        self._arg = {name: session.as_kernel_arg(v.view(self._word) if name in WORD_ARRAYS else v)
                     for name, v in regions.items()}
        for name in {n for args in KERNEL_ARGS.values() for n in args if ":" in n}:
            self._arg[name] = session.as_kernel_arg(region_view(regions[name.partition(":")[0]], name))
        self._arg["peer_bases"] = session.as_kernel_arg(session.to_device(self._peer_bases()))
        self._partial = partial_dtype(cfg)  # uint16 (bf16 bits) or float32
        self._f32_partials = self._partial == np.float32
        builds = kernel_builds(cfg, self.plan)
        self._kernels = {name: kernel for name, kernel, _ in builds}
        for name, kernel, types in builds:  # compile now, not inside a timed wait
            session.precompile(kernel, types)
        # stand-ins for the combine_wait arrays a call does not use (allocated once: graph-safe)
        self._no_out = session.alloc_local("unused out", (0, 0), np.uint16)
        self._no_partials = session.alloc_local("unused out_partials", (0, 0, 0), np.uint16)
        self._no_aux = session.alloc_local("unused aux", (0, 0), np.float32)
        # combine_wait's own_rows: the compact expert_out of the last combine_async (this rank's
        # partials are read there, not copied), or this empty stand-in after an expanded one
        self._no_own = session.alloc_local("unused own_rows", (0, 0), np.uint16)
        self._own_rows = self._no_own
        self._no_valid = session.alloc_local("unused valid_tokens", (1,), np.int32)
        self._no_scales = session.alloc_local("unused token_scales", (0, 0), np.uint8)
        # combine_async(weights=None): a weight of 1 per expanded row (allocated here, not inside a graph capture)
        self._unit_weights = session.alloc_local("unit row weights", (cfg.recv_rows_capacity,), np.float32, fill=1.0)
        self._no_tokens = session.alloc_local("unused tokens", (0, cfg.hidden), np.uint16)
        self._batch_views = _batch_views(cfg, self.buffers)
        self._pad_multiple = np.int64(cfg.pad_multiple)
        self._wait_scalars = dict(pad_multiple=self._pad_multiple, timeout_ns=self._timeout_ns)
        self._fixed = self._prepare_receive()
        self._land: tuple = ()  # the last dispatch_async's dispatch_land launches (they read its tokens)
        self._memo = CallMemo()  # the launches prepared from the caller's last arrays, per call
        self._calls = 0
        self._state = _State.IDLE
        self._slots_call = -1  # the dispatch call whose slot values went home last
        self._kept_call = 0  # the last dispatch_async reused a kept routing (1) or sent its own (0)
        self._epoch = 0  # reset() count: a kept routing of an earlier epoch is refused
        self._failed: Exception | None = None
        self._closed = False
        session.barrier()

    def _prepare_receive(self) -> dict:
        """The launches of dispatch_wait whose arguments are all the runtime's own, prepared once:
        ``"compact"`` (and the placement before ``dispatch_copy``), ``"expanded"`` where the
        receive kernel copies too (a route-first dispatch_wait on the whole grid), and
        ``("dispatch_copy", scales)``, and with the hierarchical transport ``"dispatch_relay"``
        and ``"combine_relay"``. A landing plan's receive launches read each call's tokens:
        they are prepared with dispatch_async's."""
        plan, fixed = self.plan, {}
        if plan.receiver is not Receiver.LAND:
            fixed["compact"] = self._prepare("dispatch_wait", copy_rows=_INT64[0], grid=plan.dispatch_wait_grid,
                                             **self._wait_scalars)
            if plan.expanded_copy is ExpandedCopy.IN_WAIT:
                fixed["expanded"] = self._prepare("dispatch_wait", copy_rows=np.int64(plan.placing_blocks),
                                                  **self._wait_scalars)
        if plan.transport is Transport.HIERARCHICAL:  # the proxies' forwarding, before the receiver and combine_wait
            for reuse in (0, 1):  # after a dispatch with its routing, and with a kept one
                fixed["dispatch_relay", reuse] = self._prepare("dispatch_relay", timeout_ns=self._timeout_ns,
                                                               reuse_routing=_INT64[reuse])
            fixed["combine_relay"] = self._prepare("combine_relay", timeout_ns=self._timeout_ns)
        if plan.expanded_copy is ExpandedCopy.DISPATCH_COPY:
            for scales in SCALE_LAYOUTS:
                fixed["dispatch_copy", scales] = self._prepare("dispatch_copy",
                                                               scales_col_major=_INT64[scales == "column"])
        return fixed

    # -- dispatch -----------------------------------------------------------------------------
    def dispatch_async(self, tokens, topk_ids=None, topk_weights=None, n_tokens=None, token_scales=None,
                       routing: KeptRouting | None = None) -> DispatchHandle:
        """Start sending this rank's tokens to the ranks of their experts. Collective.

        Parameters
        ----------
        tokens : [T, hidden] bfloat16 (or uint16 bits), T <= max_tokens_per_rank (T may be 0).
            In an FP8 token format (``EPConfig.token_dtype``) bf16 tokens are quantized inside
            the kernel (per 128-element block, :mod:`ep_runtime.core.formats`); or pass the codes,
            [T, hidden] uint8 (E4M3 bits), with ``token_scales``.
        topk_ids : [T, top_k] int32, global expert ids in ``[0, n_experts)``, distinct per
            token; -1 masks a slot (nothing is sent for it and its weight is ignored; a token
            whose slots are all -1 combines to a zero row). An id outside ``[-1, n_experts)``
            is dropped like -1 and raised by the next :meth:`synchronize`; a repeated id counts
            once, with its first slot's weight (``debug=True`` rejects both before sending)
        topk_weights : [T, top_k] float32
        n_tokens : optional [1] int32 device array (CuPy/DLPack on GPUs, NumPy on ``sim``):
            the number of valid leading rows, read **on the device** when the kernel runs
            (clamped to [0, T]). With it, one CUDA graph captured with capacity-sized inputs
            serves every batch size: update the inputs and ``n_tokens`` in place, replay.
            (pplx's ``bound_m``.) :meth:`combine_wait` then writes only the first
            ``n_tokens`` rows of its ``[T, hidden]`` output.
        token_scales : FP8 token formats, pre-quantized input only: [T, hidden / 128] float32
            (``fp8_e4m3``) or uint8 UE8M0 codes (``fp8_e4m3_ue8m0``), block j of token t
            scaling elements 128 j .. 128 j + 127 (MAX's input scales).
        routing : a :class:`KeptRouting` of this runtime (:meth:`keep_routing`), instead of
            ``topk_ids``, ``topk_weights`` and ``n_tokens``: dispatch ``tokens`` (as many rows
            as that dispatch had, e.g. a backward's gradients) with that dispatch's routing,
            weights and token count, sending no routing (every rank restores its own copies of
            the tables first). The batch is placed exactly as that dispatch's was. Every rank
            passes a routing kept from the same call.

        The inputs must stay unmodified until :meth:`dispatch_wait` of this call has run on
        the stream. Returns the handle for :meth:`dispatch_wait`.
        """
        self._require(_State.IDLE, _State.DISPATCHED, call="dispatch_async")
        inputs = (tokens, topk_ids, topk_weights, n_tokens, token_scales)
        if routing is not None:
            self._check_kept(routing, topk_ids, topk_weights, n_tokens)
        elif topk_ids is None or topk_weights is None:
            raise EPInputError("dispatch_async: pass topk_ids and topk_weights (the routing), or routing= a "
                               "KeptRouting (keep_routing(handle)) to reuse an earlier dispatch's.")
        call = self._memo.get_or_prepare("dispatch_async", (routing,), inputs,
                                         lambda: self._prepare_dispatch_async(*inputs, routing))
        if self.debug and routing is None:
            self._check_routing(*call.checked)
        self._land = call.land
        self._kept_call = int(routing is not None)  # the relay of a kept routing's call forwards no routing
        if routing is not None:
            self._run(routing.restore)
        self._run(call)
        handle = from_fields(DispatchHandle, {"owner": self._owner, "call": self._calls, "n_tokens": call.n_tokens})
        self._calls += 1
        self._state = _State.DISPATCH_SENT
        return handle

    def _prepare_dispatch_async(self, tokens, topk_ids, topk_weights, n_tokens, token_scales,
                                routing: KeptRouting | None = None) -> PreparedCall:
        """Check and convert dispatch_async's arguments (raising EPInputError before any
        launch); the launch, with T and the routing check's arguments (and, for a landing plan,
        the receive launches that read this call's tokens). With a kept ``routing`` the routing
        arguments are its own arrays for this rank: its ids and weights, its token count."""
        cfg, be, c, fmt = self.cfg, self.session.backend, "dispatch_async", self._fmt
        tokens = arrays.to_backend(tokens, be, c, "tokens")
        if routing is not None:
            T = tokens.shape[0] if getattr(tokens, "ndim", 0) == 2 else -1
            if T != routing.n_tokens:
                raise EPInputError(f"{c}: tokens has shape {tuple(tokens.shape)} but the kept routing (call "
                                   f"{routing.call}) dispatched {routing.n_tokens} rows; pass [{routing.n_tokens}, "
                                   f"hidden={cfg.hidden}] tokens (rows past its token count are not sent).")
            me, L = self.rank, cfg.n_local_experts
            topk_ids, topk_weights = routing.ids[me, :T], routing.weights[me, :T]
            n_tokens = routing.counts[me, L:L + 1]
        topk_ids = arrays.to_backend(topk_ids, be, c, "topk_ids")
        topk_weights = arrays.to_backend(topk_weights, be, c, "topk_weights")
        fp8_in = token_scales is not None
        if fp8_in and not fmt.quantized:
            raise EPInputError(f"{c}: token_scales given but EPConfig.token_dtype is {cfg.token_dtype!r}, which has "
                               f"no scales; pass bf16 tokens alone, or build the runtime with token_dtype='fp8_e4m3' "
                               f"or 'fp8_e4m3_ue8m0'.")
        if fp8_in:
            arrays.check_array(tokens, c, "tokens", np.uint8, (None, cfg.hidden),
                               f"Pre-quantized tokens are [T, hidden={cfg.hidden}] uint8 E4M3 codes (view a "
                               f"float8_e4m3fn array as uint8), with T <= {cfg.max_tokens_per_rank}.")
        else:
            arrays.check_array(tokens, c, "tokens", np.uint16, (None, cfg.hidden),
                               f"Expected [T, hidden={cfg.hidden}] bfloat16 with T <= {cfg.max_tokens_per_rank}"
                               + (" (or uint8 E4M3 codes with token_scales)." if fmt.quantized else "."))
        T = tokens.shape[0]
        if T > cfg.max_tokens_per_rank:
            raise EPInputError(
                f"{c}: tokens has {T} rows but EPConfig.max_tokens_per_rank is {cfg.max_tokens_per_rank}; "
                f"split the batch or build the runtime with a larger max_tokens_per_rank.")
        arrays.check_array(topk_ids, c, "topk_ids", np.int32, (T, cfg.top_k),
                           f"Expected [T={T}, top_k={cfg.top_k}] int32 (convert with .astype(int32)).")
        arrays.check_array(topk_weights, c, "topk_weights", np.float32, (T, cfg.top_k),
                           f"Expected [T={T}, top_k={cfg.top_k}] float32.")
        scales = self._no_scales
        if fp8_in:
            token_scales = arrays.to_backend(token_scales, be, c, "token_scales")
            S = fmt.scale_count(cfg.hidden)
            arrays.check_array(token_scales, c, "token_scales", fmt.scale_dtype, (T, S),
                               f"Expected [T={T}, hidden / 128 = {S}] {fmt.scale_dtype.name} ({cfg.token_dtype}: "
                               f"one scale per 128-element block).")
            scales = token_scales.view(np.uint8)
        valid = self._valid_tokens(n_tokens, c)
        call = self._prepare("dispatch_async", tokens=tokens, topk_ids=topk_ids, topk_weights=topk_weights, **valid,
                             token_scales=scales, prequantized=_INT64[fp8_in], timeout_ns=self._timeout_ns,
                             reuse_routing=_INT64[routing is not None])
        land = ()
        if self.plan.receiver is Receiver.LAND:  # places only, or places and copies (bf16 expanded)
            own = tokens if not fmt.quantized else self._no_tokens  # bf16: this rank's own rows, never sent
            land = tuple(self._prepare("dispatch_land", tokens=own, copy_rows=_INT64[copy], **self._wait_scalars)
                         for copy in (0, 1))
        return PreparedCall(call.kernel, call.args, n_tokens=T, checked=(topk_ids, topk_weights, valid),
                            grid=self.plan.dispatch_async_grid, land=land)

    def _valid_tokens(self, n_tokens, call) -> dict:
        """The ``valid_tokens`` / ``use_valid`` kernel arguments for ``n_tokens`` (see dispatch_async)."""
        if n_tokens is None:
            return {"valid_tokens": self._no_valid, "use_valid": _INT64[0]}
        n_tokens = arrays.to_backend(n_tokens, self.session.backend, call, "n_tokens")
        arrays.check_array(n_tokens, call, "n_tokens", np.int32, (1,),
                           "Pass a one-element int32 device array holding the number of valid rows.")
        return {"valid_tokens": n_tokens, "use_valid": _INT64[1]}

    def check_routing(self, topk_ids, topk_weights) -> None:
        """Enqueue the device-side routing check (debug mode runs it before every dispatch).

        Checks expert ids in ``[-1, n_experts)`` (-1: a masked slot) and distinct per token
        (masked slots aside), and the weights of unmasked slots finite (and non-negative unless
        ``EPConfig.allow_negative_weights``; a masked slot's weight is ignored, NaN included). Not collective; enqueued on the
        stream; a violation is raised as :class:`~ep_runtime.core.errors.EPInputError` by the next
        :meth:`synchronize` and blocks this rank's next dispatch (see docs/failure_modes.md).
        ``topk_ids`` [T, top_k] int32, ``topk_weights`` [T, top_k] float32.
        """
        cfg, be, c = self.cfg, self.session.backend, "check_routing"
        topk_ids = arrays.to_backend(topk_ids, be, c, "topk_ids")
        topk_weights = arrays.to_backend(topk_weights, be, c, "topk_weights")
        T = topk_ids.shape[0]
        arrays.check_array(topk_ids, c, "topk_ids", np.int32, (None, cfg.top_k), f"Expected [T, top_k={cfg.top_k}].")
        arrays.check_array(topk_weights, c, "topk_weights", np.float32, (T, cfg.top_k), f"Expected [T={T}, top_k].")
        self._check_routing(topk_ids, topk_weights, self._valid_tokens(None, c))

    def _check_routing(self, topk_ids, topk_weights, valid: dict) -> None:
        self._run(self._prepare("validate_routing", topk_ids=topk_ids, topk_weights=topk_weights, **valid,
                                n_experts=np.int64(self.cfg.n_experts),
                                allow_negative=np.int64(self.cfg.allow_negative_weights)))

    def dispatch_wait(self, handle: DispatchHandle, layout: str = "expanded", scales: str = "row"):
        """Complete the dispatch of ``handle``: wait for every rank's tokens and place them.
        Collective; enqueued on the stream.

        ``layout`` must be one the runtime serves (``EPConfig.layouts``).

        ``layout="expanded"`` (default) returns an :class:`ExpertBatch`: one row per (token,
        local expert), expert-major, in a local buffer (the receive kernel places every row and
        the copy lays them out: ``plan.expanded_copy`` says which kernel copies). Its views are
        valid until the next ``dispatch_wait``.

        ``layout="compact"`` returns a :class:`CompactBatch`: no expansion copy (one kernel).
        The received rows stay where they landed, one per (token, source rank), and the batch
        gives per local expert the rows to gather (``gather``) and their weights, in the same
        expert-major order as the expanded batch. Its ``x`` is the receive buffer itself, the
        same memory every call (one CUDA graph serves every step): read it (in stream order)
        before ``combine_async`` or the next ``dispatch_async``, whichever comes first.

        FP8 token formats: ``x`` holds E4M3 codes (uint8) and ``scales`` their block scales;
        in the expanded layout ``scales="row"`` gives ``[C, S]`` and ``scales="column"``
        ``[S, C]`` (column-major, what TMA-based FP8 GEMMs read), S = hidden / 128.
        """
        self._require(_State.DISPATCH_SENT, call="dispatch_wait", handle=handle, handle_type=DispatchHandle)
        if layout not in self.plan.layouts:
            raise EPInputError(f"dispatch_wait: layout={layout!r}, but this runtime serves {self.plan.layouts} "
                               f"(EPConfig.layouts); pass one of them, or build the runtime with layouts "
                               f"including {layout!r}." if layout in DISPATCH_LAYOUTS else
                               f"dispatch_wait: layout={layout!r}; expected one of {self.plan.layouts}.")
        if scales not in SCALE_LAYOUTS:
            raise EPInputError(f"dispatch_wait: scales={scales!r}; expected one of {SCALE_LAYOUTS} (row-major "
                               f"[rows, hidden / 128] or column-major [hidden / 128, rows]).")
        land = self.plan.receiver is Receiver.LAND
        if self.plan.transport is Transport.HIERARCHICAL:  # this node's share of the other nodes' calls, first
            self._run(self._fixed["dispatch_relay", self._kept_call])
        if layout == "compact":
            self._run(self._land[0] if land else self._fixed["compact"])
            self._state = _State.DISPATCHED
            return from_fields(CompactBatch, {**self._batch_views["compact"], "handle": handle})
        copy = self.plan.expanded_copy
        if copy is ExpandedCopy.IN_LAND:  # placed and copied as the rows land
            self._run(self._land[1])
        elif copy is ExpandedCopy.IN_WAIT:  # placement and copy in one launch
            self._run(self._fixed["expanded"])
        else:  # placed, then the rows (and FP8 scales) laid out
            self._run(self._land[0] if land else self._fixed["compact"])
            self._run(self._fixed["dispatch_copy", scales])
        self._state = _State.DISPATCHED
        return from_fields(ExpertBatch, {**self._batch_views["expanded", scales], "handle": handle})

    def dispatch(self, tokens, topk_ids, topk_weights, layout: str = "expanded", token_scales=None,
                 scales: str = "row"):
        """``dispatch_async`` then ``dispatch_wait``, then :meth:`synchronize`. Collective."""
        batch = self.dispatch_wait(self.dispatch_async(tokens, topk_ids, topk_weights, token_scales=token_scales),
                                   layout=layout, scales=scales)
        self.synchronize()
        return batch

    # -- kept routing -------------------------------------------------------------------------
    def keep_routing(self, handle: DispatchHandle, into: KeptRouting | None = None) -> KeptRouting:
        """Keep the routing of the dispatch of ``handle`` for later dispatches of other tokens
        (``dispatch_async(tokens, routing=kept)``: a backward's dispatch of its gradients with
        its forward's routing, sending no routing). Not collective; enqueued on the stream (one
        small kernel, no host synchronization; graph-safe).

        Call it after ``dispatch_wait`` of ``handle`` and before the next ``dispatch_async``
        (the runtime's routing regions alternate by call, so later dispatches overwrite them).
        It copies this rank's tables of that call: every rank's routing rows (ids, weights),
        counts and, for the ``wait`` and ``land`` receivers, ranks (``[n_ranks,
        max_tokens_per_rank, top_k]`` int32 and float32 apiece, plus ``[n_ranks, L + 1]``).

        ``into``: a :class:`KeptRouting` of this runtime to overwrite (its memory reused, as a
        CUDA graph needs; the routing it held is gone, so use only the one returned); None
        allocates one. A ``reset()`` retires every kept routing.
        """
        self._require(_State.DISPATCHED, _State.IDLE, call="keep_routing", handle=handle, handle_type=DispatchHandle)
        if into is not None:
            if not isinstance(into, KeptRouting) or into.owner != self._owner:
                raise EPInputError("keep_routing: into must be a KeptRouting this runtime returned (or None to "
                                   "allocate one).")
            arrays_ = (into.ids, into.weights, into.counts, into.ranks)
        else:
            cfg, alloc = self.cfg, self.session.alloc_local
            R, T, K, L = cfg.n_ranks, cfg.max_tokens_per_rank, cfg.top_k, cfg.n_local_experts
            ranked = self.layout.has("dispatch_ranks")
            arrays_ = (alloc("kept_ids", (R, T, K), np.int32, fill=None),
                       alloc("kept_weights", (R, T, K), np.float32, fill=None),
                       alloc("kept_counts", (R, L + 1), np.int32, fill=None),
                       alloc("kept_ranks", (R, T, K) if ranked else (0, 0, 0), np.int32, fill=None))
        ids, weights, counts, ranks = arrays_
        kept = dict(kept_ids=ids, kept_weights=weights, kept_counts=counts, kept_ranks=ranks)
        self._run(self._prepare("routing_copy", restore=_INT64[0], **kept))
        restore = into.restore if into is not None else self._prepare("routing_copy", restore=_INT64[1], **kept)
        memory = into.memory if into is not None else [0]
        memory[0] += 1  # the routing kept in these arrays before (into) is retired
        return from_fields(KeptRouting, {"owner": self._owner, "call": handle.call, "n_tokens": handle.n_tokens,
                                         "epoch": self._epoch, "ids": ids, "weights": weights, "counts": counts,
                                         "ranks": ranks, "restore": restore, "generation": memory[0],
                                         "memory": memory})

    def _check_kept(self, routing, topk_ids, topk_weights, n_tokens) -> None:
        """Refuse a ``routing=`` dispatch whose kept routing is not this runtime's current one,
        or that also passes routing arguments."""
        if not isinstance(routing, KeptRouting):
            raise EPInputError(f"dispatch_async: routing must be a KeptRouting (keep_routing(handle)); got "
                               f"{type(routing).__name__}.")
        if topk_ids is not None or topk_weights is not None or n_tokens is not None:
            raise EPInputError("dispatch_async: routing= reuses a kept routing's ids, weights and token count; pass "
                               "topk_ids, topk_weights and n_tokens only without it.")
        if routing.owner != self._owner:
            raise EPStateError(f"rank {self.rank}: dispatch_async got a routing kept by another EPRuntime; keep it "
                               f"with this runtime's keep_routing.")
        if routing.epoch != self._epoch:
            raise EPStateError(f"rank {self.rank}: dispatch_async got a routing kept (call {routing.call}) before "
                               f"reset(); reset() retires kept routings: dispatch with topk_ids again.")
        if routing.generation != routing.memory[0]:
            raise EPStateError(f"rank {self.rank}: dispatch_async got a routing kept (call {routing.call}) in arrays "
                               f"a later keep_routing(into=...) overwrote; pass the KeptRouting that call returned.")

    # -- combine ------------------------------------------------------------------------------
    def combine_async(self, expert_out, handle: DispatchHandle, layout: str = "expanded",
                      weights="dispatch") -> CombineHandle:
        """Start sending the expert outputs of the batch of ``handle`` home. Collective.

        Parameters
        ----------
        expert_out : in one of two layouts:

            - ``layout="expanded"`` (default): bfloat16 (or uint16 bits) ``[rows, hidden]``,
              row-aligned with the expert batch (``rows >= row_offsets[L]``; e.g. the batch's
              full capacity), whichever layout dispatch_wait returned (a GEMM that gathers a
              compact batch's rows by ``gather`` writes its outputs in this order). Each
              token's partial is the sum over its local experts, ascending, of router weight x
              output (float32, from 0), rounded to bf16 unless ``EPConfig.combine_dtype`` is
              ``"float32"``.
            - ``layout="compact"``: ``[n_ranks * max_tokens_per_rank, hidden]``, row
              ``s * max_tokens_per_rank + t`` holding this rank's partial for token t of rank
              s, already weighted and summed over this rank's experts by the caller (the
              compact batch's row order). Rows of tokens that did not come here are not read.
              Its dtype is the partials': bfloat16 (or uint16 bits), or float32 when
              ``EPConfig.combine_dtype`` is ``"float32"`` (the caller's float32 sums, sent
              unrounded).

            Must stay unmodified until :meth:`combine_wait` has run on the stream.
        handle : the dispatch's handle (``batch.handle``).
        weights : what each expanded row is multiplied by before its token's rows are summed:
            ``"dispatch"`` (default) the router weight that came with the dispatch (the batch's
            ``weight``); None, no weight (each partial is the plain sum of the token's rows, as
            Megatron's HybridEP and DeepEP combine: the caller applied the weights, or a
            backward sums gradients); or a float32 ``[rows]`` array row-aligned with the batch
            (explicit weights; ``rows >= row_offsets[L]``, padding rows are not read), which
            must stay unmodified until :meth:`combine_wait` has run. The expanded layout only:
            compact rows come weighted.
        """
        self._require(_State.DISPATCHED, call="combine_async", handle=handle, handle_type=DispatchHandle)
        if layout not in DISPATCH_LAYOUTS:
            raise EPInputError(f"combine_async: layout={layout!r}; expected one of {DISPATCH_LAYOUTS}.")
        mode = "dispatch" if isinstance(weights, str) and weights == "dispatch" else \
            "none" if weights is None else "array"
        if mode != "dispatch" and layout == "compact":
            raise EPInputError("combine_async: weights= applies to the expanded layout only; compact rows are the "
                               "caller's partials, already weighted (leave weights='dispatch').")
        if isinstance(weights, str) and weights != "dispatch":
            raise EPInputError(f"combine_async: weights={weights!r}; expected 'dispatch', None or a float32 [rows] "
                               f"array.")
        call = self._memo.get_or_prepare("combine_async", (layout, mode), (expert_out, weights if mode == "array"
                                                                            else None),
                                         lambda: self._prepare_combine_async(expert_out, layout, mode, weights))
        if self.debug and layout != "compact":
            needed = int(self.session.to_host(self.buffers["row_offsets"])[-1])
            if call.n_tokens < needed:
                raise EPInputError(f"combine_async: expert_out has {call.n_tokens} rows but the expert batch has "
                                   f"{needed}; pass one output row per batch row.")
        self._run(call)
        self._own_rows = call.checked[0]
        self._state = _State.COMBINE_SENT
        return from_fields(CombineHandle, {"owner": self._owner, "call": handle.call, "n_tokens": handle.n_tokens})

    def _prepare_combine_async(self, expert_out, layout, mode="dispatch", weights=None) -> PreparedCall:
        """Check and convert combine_async's ``expert_out`` and ``weights`` (``mode``: "dispatch",
        "none" or "array"; raising EPInputError before any launch); the launch, with
        ``n_tokens`` = its rows (the debug-mode row check)."""
        c, cfg = "combine_async", self.cfg
        expert_out = arrays.to_backend(expert_out, self.session.backend, c, "expert_out")
        if layout == "compact":
            rows = cfg.n_ranks * cfg.max_tokens_per_rank
            self._check_partial_dtype(expert_out, c, "expert_out", "the compact layout's rows")
            arrays.check_array(expert_out, c, "expert_out", self._partial, (rows, cfg.hidden),
                               f"The compact layout has one row per (source rank, token slot): "
                               f"[n_ranks * max_tokens_per_rank = {rows}, hidden = {cfg.hidden}].")
            call = self._prepare("combine_async_rows", expert_out=expert_out)
            own = expert_out  # combine_wait reads this rank's own rows here
        else:
            arrays.check_array(expert_out, c, "expert_out", np.uint16, (None, cfg.hidden),
                               f"Expected [rows, hidden={cfg.hidden}], row-aligned with the expert batch.")
            row_weights = {}
            if mode == "none":
                row_weights = {"row_weight": self._unit_weights}
            elif mode == "array":
                weights = arrays.to_backend(weights, self.session.backend, c, "weights")
                arrays.check_array(weights, c, "weights", np.float32, (expert_out.shape[0],),
                                   f"Expected float32 [rows = {expert_out.shape[0]}], one weight per expert_out row.")
                row_weights = {"row_weight": weights}
            call = self._prepare("combine_async", expert_out=expert_out, **row_weights)
            own = self._no_own
        return PreparedCall(call.kernel, call.args, n_tokens=expert_out.shape[0], checked=(own,),
                            grid=self.plan.combine_async_grid(layout))

    def combine_wait(self, handle: CombineHandle, out=None, epilogue=None, aux=None, reduce: bool = True):
        """Complete the combine of ``handle``. Collective; enqueued on the stream.

        Returns ``out`` [T, hidden] uint16 (bf16 bits): for each token, the sum over the ranks
        it went to (rank order, float32) of their partials, through ``epilogue`` (a Numba
        device function ``f(value, token, col, aux) -> float32``, e.g. a residual add reading
        ``aux``, a [T, hidden] float32 array) and rounded to bf16. With ``reduce=False`` returns
        the per-rank partials ``[n_ranks, T, hidden]`` instead (zero where the token did not
        go), in the partials' dtype: uint16 bf16 bits, or float32 when
        ``EPConfig.combine_dtype`` is ``"float32"``.
        """
        self._require(_State.COMBINE_SENT, call="combine_wait", handle=handle, handle_type=CombineHandle)
        if not reduce and self.plan.transport is Transport.HIERARCHICAL:
            raise EPInputError("combine_wait: reduce=False returns each rank's partial, but the hierarchical "
                               "transport sums each other node's partials on that node; use reduce=True, or a "
                               "runtime with plan transport=puts.")
        if out is None:  # every element is written by the kernel (rows < n_tokens with n_tokens)
            shape = (handle.n_tokens, self.cfg.hidden) if reduce else (self.cfg.n_ranks, handle.n_tokens,
                                                                       self.cfg.hidden)
            out = self.session.alloc_local("combine_out", shape, np.uint16 if reduce else self._partial, fill=None)
        own = self._own_rows
        call = self._memo.get_or_prepare("combine_wait", (handle.n_tokens, bool(reduce), epilogue), (out, aux, own),
                                         lambda: self._prepare_combine_wait(handle.n_tokens, out, aux, epilogue,
                                                                            reduce, own))
        if "combine_relay" in self._fixed:  # the other nodes' partials of this node's proxies, summed and sent
            self._run(self._fixed["combine_relay"])
        self._run(call)
        self._state = _State.IDLE
        return call.checked[0]

    def _prepare_combine_wait(self, T, out, aux, epilogue, reduce, own) -> PreparedCall:
        """Check and convert combine_wait's ``out`` and ``aux`` for ``T`` tokens (raising
        EPInputError before any launch); the launch, with ``checked = (out,)`` as returned.
        ``own``: the last combine_async's compact expert_out (checked there), or the empty
        stand-in."""
        cfg, s = self.cfg, self.session
        shape = (T, cfg.hidden) if reduce else (cfg.n_ranks, T, cfg.hidden)
        dtype = np.uint16 if reduce else self._partial
        out = arrays.to_backend(out, s.backend, "combine_wait", "out")
        if not reduce:
            self._check_partial_dtype(out, "combine_wait", "out", "reduce=False's partials")
        arrays.check_array(out, "combine_wait", "out", dtype, shape, "Pass None to allocate it.")
        unused = self._no_partials if reduce else self._no_out
        if aux is None:
            aux = self._no_aux
        else:
            aux = arrays.to_backend(aux, s.backend, "combine_wait", "aux")
            arrays.check_array(aux, "combine_wait", "aux", np.float32, (T, cfg.hidden),
                               f"aux is the epilogue's [T={T}, hidden={cfg.hidden}] float32 input.")
        call = self._prepare("combine_wait", epilogue=epilogue, out=out if reduce else unused,
                             out_partials=unused if reduce else out, mode=_INT64[0 if reduce else 1],
                             timeout_ns=self._timeout_ns, aux=aux, own_rows=own)
        return PreparedCall(call.kernel, call.args, n_tokens=T, checked=(out,))

    def combine(self, expert_out, handle: DispatchHandle, layout: str = "expanded", weights="dispatch", **kwargs):
        """``combine_async`` then ``combine_wait``, then :meth:`synchronize`. Collective."""
        out = self.combine_wait(self.combine_async(expert_out, handle, layout=layout, weights=weights), **kwargs)
        self.synchronize()
        return out

    # -- slot values home (the router weights' gradient) ---------------------------------------
    def slot_values_async(self, values, handle: DispatchHandle) -> SlotValuesHandle:
        """Start sending one float32 per expert-batch row home, to the (token, top-k slot) the row
        came from. Collective; enqueued on the stream; at most once per dispatch, between
        ``dispatch_wait`` and ``combine_async`` (the runtime stays dispatched: the combine of the
        same batch may follow ``slot_values_wait``).

        What a backward returns for the router weights: ``values[i]`` = the dot product of row
        i's expert output with the gradient of its token's combine output, ``T x K`` floats a
        rank where a combine would move ``T x K`` rows of ``hidden`` values.

        Parameters
        ----------
        values : float32 ``[rows]``, row-aligned with the batch of ``handle`` (either layout's
            rows: ``batch.src_rank`` / ``src_token`` / ``src_k`` say where each came from),
            ``rows >= row_offsets[L]`` (e.g. the batch's capacity, ``EPConfig.recv_rows_capacity``;
            padding rows are not read; a shorter array is a device error that
            :meth:`synchronize` raises, and nothing is sent). Must stay unmodified until
            :meth:`slot_values_wait` has run on the stream.
        handle : the dispatch's handle (``batch.handle``).
        """
        self._require(_State.DISPATCHED, call="slot_values_async", handle=handle, handle_type=DispatchHandle)
        if self._slots_call == handle.call:
            raise EPStateError(f"rank {self.rank}: slot_values_async: the slot values of call {handle.call} already "
                               f"went home; it runs at most once per dispatch.")
        values = arrays.to_backend(values, self.session.backend, "slot_values_async", "values")
        arrays.check_array(values, "slot_values_async", "values", np.float32, (None,),
                           "Expected float32 [rows], one value per expert-batch row (row-aligned with the batch).")
        self._run(self._prepare("slot_values_async", row_values=values))
        self._slots_call = handle.call
        self._state = _State.SLOTS_SENT
        return from_fields(SlotValuesHandle, {"owner": self._owner, "call": handle.call, "n_tokens": handle.n_tokens})

    def slot_values_wait(self, handle: SlotValuesHandle, out=None):
        """Complete :meth:`slot_values_async`. Collective; enqueued on the stream.

        Returns ``out`` float32 ``[T, top_k]`` (allocated when None): for each of this rank's
        tokens and top-k slots, the value of the expert row the slot went to; 0.0 for a masked
        (-1) or dropped slot and a repeated id's later slots (they made no row). The runtime is
        dispatched again: ``combine_async`` of the same batch may follow.
        """
        self._require(_State.SLOTS_SENT, call="slot_values_wait", handle=handle, handle_type=SlotValuesHandle)
        shape = (handle.n_tokens, self.cfg.top_k)
        if out is None:
            out = self.session.alloc_local("slot_values_out", shape, np.float32, fill=None)
        out = arrays.to_backend(out, self.session.backend, "slot_values_wait", "out")
        arrays.check_array(out, "slot_values_wait", "out", np.float32, shape, "Pass None to allocate it.")
        self._run(self._prepare("slot_values_wait", slot_out=out, timeout_ns=self._timeout_ns))
        self._state = _State.DISPATCHED
        return out

    def slot_values(self, values, handle: DispatchHandle, out=None):
        """``slot_values_async`` then ``slot_values_wait``, then :meth:`synchronize`. Collective."""
        out = self.slot_values_wait(self.slot_values_async(values, handle), out=out)
        self.synchronize()
        return out

    def _check_partial_dtype(self, x, call: str, name: str, what: str) -> None:
        """Refuse ``x`` (a backend array) unless it has the partials' dtype (uint16 bf16 bits, or
        float32 with ``combine_dtype="float32"``), naming the mode and both ways out."""
        got = np.dtype(x.dtype)
        if got == self._partial:
            return
        got = "bfloat16 (uint16 bits)" if got == np.uint16 else got.name
        if self._f32_partials:
            raise EPInputError(
                f"{call}: {name} has dtype {got}, but EPConfig.combine_dtype is 'float32', so {what} are float32 "
                f"partials (sent unrounded); pass float32 (e.g. your float32 weighted sums before any bf16 "
                f"rounding), or build the runtime with combine_dtype='bfloat16' to send bf16.")
        raise EPInputError(
            f"{call}: {name} has dtype {got}, but EPConfig.combine_dtype is 'bfloat16', so {what} are bf16 "
            f"partials; pass bfloat16 (or its uint16 bits), e.g. x.astype(ml_dtypes.bfloat16), or build the "
            f"runtime with combine_dtype='float32' (hidden a multiple of 4) to send float32 partials unrounded.")

    # -- errors and lifetime -------------------------------------------------------------------
    def synchronize(self) -> None:
        """Wait for this rank's stream and raise any error a kernel recorded (not collective)."""
        self.session.synchronize()
        self._raise_device_error()

    def reset(self) -> None:
        """Collective: wait for every rank's kernels, clear the error record, counters and
        signals on every rank, and make the runtime usable again (call numbers restart at 0)."""
        self.session.synchronize()
        self.session.barrier()
        for r in self.layout.regions:
            self.session.fill(self.buffers[r.name], r.init)
        self.session.synchronize()
        self.session.barrier()
        self._calls, self._state, self._failed, self._slots_call = 0, _State.IDLE, None, -1
        self._epoch += 1

    def close(self) -> None:
        """Collective: free the symmetric buffers. Idempotent; the session stays open."""
        if self._closed:
            return
        self._closed = True
        self.session.synchronize()
        self.session.barrier()
        self.buffers.clear()
        self._arg.clear()
        self._batch_views.clear()
        self._fixed.clear()
        self._memo.clear()
        self.session.free_symmetric(self._sym)
        self._sym = self._local = self._no_out = self._no_partials = self._no_aux = self._no_valid = None
        self._no_own = self._own_rows = self._no_scales = self._no_tokens = self._unit_weights = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    @property
    def calls(self) -> int:
        """Dispatch calls issued so far (host count; the device keeps its own)."""
        return self._calls

    def device_calls(self) -> int:
        """The device's count of completed dispatch calls (synchronizes)."""
        return int(self.session.to_host(self.buffers["dispatch_async_sync"])[SYNC_CALLS])

    # -- internals ------------------------------------------------------------------------------
    def _require(self, *states, call, handle=None, handle_type=None):
        """Raise EPStateError unless the runtime is open, has not failed, is in one of
        ``states``, and ``handle`` (if given) is a ``handle_type`` of this runtime's current call."""
        if (self._state in states and self._failed is None and not self._closed
                and (handle is None or (isinstance(handle, handle_type) and handle.owner == self._owner
                                        and handle.call == self._calls - 1))):
            return  # the common case, in a few hundred ns; the checks below say what is wrong
        if self._closed:
            raise EPStateError(f"rank {self.rank}: {call} on a closed runtime; build a new EPRuntime.")
        if self._failed is not None:
            raise EPStateError(f"rank {self.rank}: {call} refused: the runtime failed earlier "
                               f"({type(self._failed).__name__}: {self._failed}). Call reset() on every "
                               f"rank (collective) or close() it.")
        if handle is not None:
            if not isinstance(handle, handle_type):
                raise EPStateError(f"rank {self.rank}: {call} needs a {handle_type.__name__}; got "
                                   f"{type(handle).__name__}.")
            if handle.owner != self._owner:
                raise EPStateError(f"rank {self.rank}: {call} got a handle from another EPRuntime; pass the "
                                   f"handle this runtime returned.")
            used = self._state not in states and _STEP[self._state] > min(_STEP[x] for x in states)
            if handle.call != self._calls - 1 or used:
                raise EPStateError(f"rank {self.rank}: {call} got the handle of call {handle.call}, which "
                                   f"{'already went through ' + call if used else 'is finished'} (current call "
                                   f"{self._calls - 1}, state '{self._state.value}'); each handle is used once, "
                                   f"in order dispatch_async -> dispatch_wait -> combine_async -> combine_wait.")
        if self._state not in states:
            nxt = {_State.IDLE: "dispatch_async", _State.DISPATCH_SENT: "dispatch_wait",
                   _State.DISPATCHED: "combine_async, slot_values_async or dispatch_async",
                   _State.SLOTS_SENT: "slot_values_wait", _State.COMBINE_SENT: "combine_wait"}[self._state]
            raise EPStateError(f"rank {self.rank}: {call} called out of order: the runtime is in state "
                               f"'{self._state.value}' and expects {nxt} next.")

    def _peer_bases(self) -> np.ndarray:
        """The ``peer_bases`` kernel argument, [len(PEER_REGIONS), R] uint64: the address of each
        of ``PEER_REGIONS`` on every PE as mapped here (zeros where the plan puts instead, or
        does not allocate the region)."""
        table = np.zeros((len(PEER_REGIONS), self.cfg.n_ranks), np.uint64)
        if self.plan.transport is Transport.STORES:
            bases = self.session.peer_addresses(self._sym)
            if bases is None:
                raise EPConfigError(f"rank {self.rank}: the plan stores into peers, but some PE's heap is not mapped "
                                    f"here; use transport=puts.")
        elif self.plan.node_stores:
            bases = self.session.node_peer_addresses(self._sym)  # 0 for the other nodes' PEs
            if bases is None:
                raise EPConfigError(f"rank {self.rank}: the plan stores within its node, but some PE of this node "
                                    f"has no mapping here; use node_stores=0.")
        else:
            return table
        for row, name in enumerate(PEER_REGIONS):
            if self.layout.has(name):
                table[row] = [base + self.layout.region(name).offset if base else 0 for base in bases]
        return table

    def _prepare(self, name, epilogue=None, grid=0, **values) -> PreparedCall:
        """The launch of kernel ``name`` with the region arrays and the given ``values`` (the
        caller's arrays as backend arrays, scalars as int64), on ``grid`` blocks (0: the plan's
        whole grid)."""
        if epilogue is None:
            kernel = self._kernels[name]
        else:  # combine_wait with a caller's epilogue, built on first use
            kernel = self._kernels.get((name, epilogue))
            if kernel is None:
                kernel = self._kernels[(name, epilogue)] = combine_wait_with(self.cfg, self.plan, epilogue)
        values = {k: arrays.word_view(v, self._word, name, k) if k in WORD_ARRAYS else v
                  for k, v in values.items()}  # backend arrays: the session makes kernel args
        return PreparedCall(kernel, build_args(name, self._arg, values), grid=grid)

    def _run(self, call: PreparedCall) -> None:
        """Enqueue a prepared launch on the session stream (and, in debug mode, synchronize and
        raise what the device recorded)."""
        self.session.launch(call.kernel, call.grid or self.plan.grid, self.plan.threads, call.args)
        if self.debug:
            self.synchronize()

    def _raise_device_error(self):
        err = error_from_status(self.session.to_host(self.buffers["status"]), self.cfg.wait_timeout_s)
        if err is not None:
            self._failed = err
            raise err


def _batch_views(cfg: EPConfig, b: dict) -> dict:
    """The views dispatch_wait returns (less the handle), made once: ``("expanded", scales)``
    for each scale layout, and ``"compact"`` (the receive buffer has one group, so the compact
    batch is the same memory every call). In an FP8 token format the compact ``x`` and
    ``scales`` are strided views of the messages (codes, then scale bytes)."""
    fmt, R, T, H = cfg.token_format, cfg.n_ranks, cfg.max_tokens_per_rank, cfg.hidden
    rows = {k: b[f"row_{k}"] for k in ("src_rank", "src_token", "src_k", "weight")}
    meta = dict(row_offsets=b["row_offsets"], expert_counts=b["expert_counts"], **rows)
    views = {}
    for scales in SCALE_LAYOUTS if "expert_x" in b else ():  # (the expanded layout served)
        batch_scales = None
        if fmt.quantized:
            C, S = cfg.recv_rows_capacity, fmt.scale_count(H)
            batch_scales = b["expert_scales"].reshape((S, C) if scales == "column" else (C, S))
        views["expanded", scales] = dict(x=b["expert_x"], scales=batch_scales, **meta)
    recv = b["dispatch_tokens"]
    if fmt.quantized:
        msg8 = recv.reshape(R * T, -1).view(np.uint8)
        pb, sb = fmt.payload_bytes(H), fmt.scale_bytes(H)
        x, recv_scales = msg8[:, :pb], msg8[:, pb:pb + sb].view(fmt.scale_dtype)
    else:
        x, recv_scales = recv.reshape(R * T, H), None
    views["compact"] = dict(x=x, scales=recv_scales, recv_tokens=b["recv_tokens"], gather=b["row_gather"], **meta)
    return views


def _check_same_config_everywhere(cfg: EPConfig, session: Session) -> None:
    mine = cfg.as_dict()
    for rank, theirs in enumerate(session.allgather_object(mine)):
        if theirs != mine:
            diff = {k: (mine[k], theirs[k]) for k in mine if mine[k] != theirs.get(k)}
            raise EPConfigError(f"rank {session.rank}: EPConfig differs from rank {rank}'s "
                                f"(field: (this rank, rank {rank})): {diff}; every rank must build the same "
                                f"config.")


def _resolve_plan(cfg: EPConfig, topology: Topology, plan) -> Plan:
    """The runtime's plan from ``EPRuntime(plan=...)``: None, a dict or a ``key=value`` string of
    overrides (with ``EP_RUNTIME_PLAN``'s), or a whole Plan (checked against ``cfg`` and the
    topology; ``EP_RUNTIME_PLAN`` may not change it)."""
    if isinstance(plan, Plan):
        if merged_overrides({}):
            raise EPConfigError("EPRuntime(plan=Plan(...)) with EP_RUNTIME_PLAN set: a whole plan takes no overrides; "
                                "unset EP_RUNTIME_PLAN, or pass the overrides as a dict.")
        check_plan(plan, cfg, topology)
        return plan
    if isinstance(plan, str):
        from ep_runtime.core.plan import parse_overrides

        plan = parse_overrides(plan, "EPRuntime(plan=...)")
    if plan is not None and not isinstance(plan, dict):
        raise EPConfigError(f"EPRuntime(plan={plan!r}): expected None, a dict of plan fields, a 'key=value,...' "
                            f"string or an ep_runtime.core.plan.Plan.")
    return choose_plan(cfg, topology, merged_overrides(plan))
