"""The dispatch calls of :class:`~ep_runtime.core.runtime.EPRuntime`: ``dispatch_async`` /
``dispatch_wait`` (and ``dispatch``, the two then a synchronize), the routing check
(``check_routing``) and kept routings (``keep_routing``, then ``dispatch_async(routing=...)``), with
the checks and conversions of their arguments and the batch views ``dispatch_wait`` returns.

Mixed into :class:`~ep_runtime.core.runtime.EPRuntime`: its methods use the regions, plan and
prepared launches the runtime's constructor makes, and its ``_require`` (the call order),
``_prepare`` (a launch's arguments) and ``_run`` (the launch).
"""

from __future__ import annotations

import numpy as np

import functools
from dataclasses import dataclass

from ep_runtime.core import arrays
from ep_runtime.core.call_memo import PreparedCall
from ep_runtime.core.config import LAYOUTS, EPConfig
from ep_runtime.core.errors import EPInputError, EPStateError
from ep_runtime.core.handles import (BatchedBatch, CompactBatch, DenseBatch, DispatchHandle, ExpertBatch, KeptRouting,
                                     from_fields)
from ep_runtime.core.plan import ExpandedCopy, Receiver, Transport
from ep_runtime.core.runtime_state import INT64, State
from ep_runtime.kernels.protocol import BATCHED_SCALES_FLOAT, BATCHED_SCALES_PACKED

#: The layouts of dispatch_wait's result and of combine_async's input.
DISPATCH_LAYOUTS = LAYOUTS
#: The layouts of an FP8 expert batch's scales: [rows, S] or [S, rows].
SCALE_LAYOUTS = ("row", "column")
#: The batched layout's scale layouts: column-major per expert, float32 or UE8M0 packed.
BATCHED_SCALES = {"column": BATCHED_SCALES_FLOAT, "packed": BATCHED_SCALES_PACKED}


@dataclass(frozen=True)
class DispatchLaunch(PreparedCall):
    """dispatch_async's prepared launch, and ``before``: what each call enqueues ahead of it
    (callables; NVFP4: the global scale computed on the stream, or pre-quantized scales staged
    with the caller's global scale)."""

    before: tuple = ()


class DispatchCalls:
    """The dispatch calls of :class:`~ep_runtime.core.runtime.EPRuntime` (a mixin: see the module)."""

    # -- dispatch -----------------------------------------------------------------------------
    def dispatch_async(self, tokens, topk_ids=None, topk_weights=None, n_tokens=None, token_scales=None,
                       routing: KeptRouting | None = None, token_global_scale=None) -> DispatchHandle:
        """Start sending this rank's tokens to the ranks of their experts. Collective.

        Parameters
        ----------
        tokens : [T, hidden] bfloat16 (or uint16 bits), T <= max_tokens_per_rank (T may be 0).
            In an FP8 token format (``EPConfig.token_dtype``) bf16 tokens are quantized inside
            the kernel (per 128-element block, :mod:`ep_runtime.core.formats`); or pass the codes,
            [T, hidden] uint8 (E4M3 bits), with ``token_scales``. NVFP4 (``"nvfp4"``): quantized
            inside the kernel under ``token_global_scale`` (per 16-element block), or the packed
            codes, [T, hidden / 2] uint8 (two E2M1 codes a byte, element 2i in the low nibble),
            with ``token_scales`` and ``token_global_scale``.
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
            scaling elements 128 j .. 128 j + 127 (MAX's input scales). NVFP4: [T, hidden / 16]
            uint8 E4M3 codes (16-element blocks).
        routing : a :class:`KeptRouting` of this runtime (:meth:`keep_routing`), instead of
            ``topk_ids``, ``topk_weights`` and ``n_tokens``: dispatch ``tokens`` (as many rows
            as that dispatch had, e.g. a backward's gradients) with that dispatch's routing,
            weights and token count, sending no routing (every rank restores its own copies of
            the tables first). The batch is placed exactly as that dispatch's was. Every rank
            passes a routing kept from the same call.
        token_global_scale : NVFP4 only: [1] float32 device array, the tensor's decode global
            scale (``x ~= e2m1 * e4m3 * global``: FlashInfer's and TensorRT-LLM's ``global_sf``
            is its reciprocal), read on the device and carried in every message. Required with
            pre-quantized input; None with bf16 tokens: the runtime computes the rule's (the
            largest finite magnitude of the call's ``T`` rows over 2688) on the stream first,
            two small kernels, no host read (graph-safe).

        The inputs must stay unmodified until :meth:`dispatch_wait` of this call has run on
        the stream. Returns the handle for :meth:`dispatch_wait`.
        """
        self._require(State.IDLE, State.DISPATCHED, call="dispatch_async")
        inputs = (tokens, topk_ids, topk_weights, n_tokens, token_scales, token_global_scale)
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
        for step in call.before:
            step()
        self._run(call)
        handle = from_fields(DispatchHandle, {"owner": self._owner, "call": self._calls, "n_tokens": call.n_tokens})
        self._calls += 1
        self._state = State.DISPATCH_SENT
        return handle

    def _prepare_dispatch_async(self, tokens, topk_ids, topk_weights, n_tokens, token_scales, token_global_scale,
                                routing: KeptRouting | None = None) -> DispatchLaunch:
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
                               f"no scales; pass bf16 tokens alone, or build the runtime with token_dtype='fp8_e4m3', "
                               f"'fp8_e4m3_ue8m0' or 'nvfp4'.")
        if token_global_scale is not None and not fmt.has_global_scale:
            raise EPInputError(f"{c}: token_global_scale given but EPConfig.token_dtype is {cfg.token_dtype!r}, whose "
                               f"messages carry no global scale; leave it out, or build the runtime with "
                               f"token_dtype='nvfp4'.")
        if fp8_in:
            width = fmt.payload_width(cfg.hidden)
            arrays.check_array(tokens, c, "tokens", np.uint8, (None, width),
                               f"Pre-quantized tokens are [T, hidden / 2 = {width}] uint8, two E2M1 codes a byte "
                               f"(element 2i in the low nibble), with T <= {cfg.max_tokens_per_rank}."
                               if fmt.has_global_scale else
                               f"Pre-quantized tokens are [T, hidden={cfg.hidden}] uint8 E4M3 codes (view a "
                               f"float8_e4m3fn array as uint8), with T <= {cfg.max_tokens_per_rank}.")
        else:
            arrays.check_array(tokens, c, "tokens", np.uint16, (None, cfg.hidden),
                               f"Expected [T, hidden={cfg.hidden}] bfloat16 with T <= {cfg.max_tokens_per_rank}"
                               + (" (or pre-quantized uint8 codes with token_scales)." if fmt.quantized else "."))
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
                               f"Expected [T={T}, hidden / {fmt.block} = {S}] {fmt.scale_dtype.name} "
                               f"({cfg.token_dtype}: one scale per {fmt.block}-element block).")
            scales = token_scales.view(np.uint8)
        valid = self._valid_tokens(n_tokens, c)
        before, global_scale = (), {}
        if fmt.has_global_scale:
            global_scale, before = self._global_scale_inputs(tokens, token_global_scale, valid, fp8_in)
        call = self._prepare("dispatch_async", tokens=tokens, topk_ids=topk_ids, topk_weights=topk_weights, **valid,
                             token_scales=scales, prequantized=INT64[fp8_in], timeout_ns=self._timeout_ns,
                             reuse_routing=INT64[routing is not None], **global_scale)
        land = ()
        if self.plan.receiver is Receiver.LAND:  # places only, or places and copies (bf16 expanded)
            own = tokens if not fmt.quantized else self._no_tokens  # bf16: this rank's own rows, never sent
            land = tuple(self._prepare("dispatch_land", tokens=own, copy_rows=INT64[copy], **self._wait_scalars)
                         for copy in (0, 1))
        return DispatchLaunch(call.kernel, call.args, n_tokens=T, checked=(topk_ids, topk_weights, valid),
                              grid=self.plan.dispatch_async_grid, land=land, before=before)

    def _global_scale_inputs(self, tokens, token_global_scale, valid: dict, prequantized: bool) -> tuple:
        """A format with a global scale (NVFP4): ``({"token_global_scale_u8": its 4 bytes}, the
        steps each call enqueues first)``: the caller's ``[1]`` float32, or, when it passes none,
        the one :data:`~ep_runtime.core.builds.GLOBAL_SCALE_KERNELS` compute on the stream into
        ``token_global_scale`` (no host read)."""
        c = "dispatch_async"
        if token_global_scale is not None:
            g = arrays.to_backend(token_global_scale, self.session.backend, c, "token_global_scale")
            arrays.check_array(g, c, "token_global_scale", np.float32, (1,),
                               "Pass the tensor's decode global scale as a one-element float32 device array (the "
                               "NVFP4 rule's: amax / (6 * 448)).")
            return {"token_global_scale_u8": g.view(np.uint8)}, ()
        if prequantized:
            raise EPInputError(f"{c}: pre-quantized {self.cfg.token_dtype} input needs token_global_scale, the [1] "
                               f"float32 global scale its codes and scales were made with; pass it.")
        amax = self._prepare("tensor_amax", tokens=tokens, **valid)
        scale = self._prepare("global_scale_of_amax", grid=1)
        return {}, (functools.partial(self._run, amax), functools.partial(self._run, scale))

    def _valid_tokens(self, n_tokens, call) -> dict:
        """The ``valid_tokens`` / ``use_valid`` kernel arguments for ``n_tokens`` (see dispatch_async)."""
        if n_tokens is None:
            return {"valid_tokens": self._no_valid, "use_valid": INT64[0]}
        n_tokens = arrays.to_backend(n_tokens, self.session.backend, call, "n_tokens")
        arrays.check_array(n_tokens, call, "n_tokens", np.int32, (1,),
                           "Pass a one-element int32 device array holding the number of valid rows.")
        return {"valid_tokens": n_tokens, "use_valid": INT64[1]}

    def check_routing(self, topk_ids, topk_weights) -> None:
        """Enqueue the device-side routing check (debug mode runs it before every dispatch).

        Checks expert ids in ``[-1, n_experts)`` (-1: a masked slot) and distinct per token
        (masked slots aside), and the weights of unmasked slots finite (and non-negative unless
        ``EPConfig.allow_negative_weights``; a masked slot's weight is ignored, NaN included). Not
        collective; enqueued on the
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

        ``layout="dense"`` returns a :class:`DenseBatch`: DeepEP's received rows, one per
        (token, source rank), source-major then in token order, each with its slots' local
        expert ids and weights, written by ``dispatch_dense`` after the receive kernel (the
        batch's views are the same memory every call); ``combine_async(rows, h,
        layout="dense")`` takes one row per dense row.

        ``layout="batched"`` returns a :class:`BatchedBatch`: DeepEP's low-latency rows, local
        expert e's row at slot pos (source-major, then token order) at ``x[e, pos]``, M = n_ranks
        * max_tokens_per_rank slots per expert, written by ``dispatch_batched`` after the receive
        kernel (the same memory every call). Its FP8 scales are column-major per expert:
        ``scales="column"`` float32 ``[L, M, hidden / 128]`` (UE8M0 codes decoded), or
        ``scales="packed"`` (``fp8_e4m3_ue8m0``, hidden a multiple of 512) int32 ``[L, M,
        hidden / 512]``, four codes each.

        ``layout="compact"`` returns a :class:`CompactBatch`: no expansion copy (one kernel).
        The received rows stay where they landed, one per (token, source rank), and the batch
        gives per local expert the rows to gather (``gather``) and their weights, in the same
        expert-major order as the expanded batch. Its ``x`` is the receive buffer itself, the
        same memory every call (one CUDA graph serves every step): read it (in stream order)
        before ``combine_async`` or the next ``dispatch_async``, whichever comes first.

        FP8 token formats: ``x`` holds E4M3 codes (uint8) and ``scales`` their block scales;
        in the expanded layout ``scales="row"`` gives ``[C, S]`` and ``scales="column"``
        ``[S, C]`` (column-major, what TMA-based FP8 GEMMs read), S = hidden / 128. NVFP4:
        ``x`` holds packed E2M1 codes ``[rows, hidden / 2]``, ``scales`` E4M3 codes (S = hidden
        / 16, row- or column-major alike) and ``global_scales`` each row's source tensor's
        float32 global scale.
        """
        self._require(State.DISPATCH_SENT, call="dispatch_wait", handle=handle, handle_type=DispatchHandle)
        if layout not in self.plan.layouts:
            raise EPInputError(f"dispatch_wait: layout={layout!r}, but this runtime serves {self.plan.layouts} "
                               f"(EPConfig.layouts); pass one of them, or build the runtime with layouts "
                               f"including {layout!r}." if layout in DISPATCH_LAYOUTS else
                               f"dispatch_wait: layout={layout!r}; expected one of {self.plan.layouts}.")
        if layout == "batched":
            scales = self._batched_scales(scales)
        elif scales not in SCALE_LAYOUTS:
            raise EPInputError(f"dispatch_wait: scales={scales!r}; expected one of {SCALE_LAYOUTS} (row-major "
                               f"[rows, hidden / 128] or column-major [hidden / 128, rows]).")
        land = self.plan.receiver is Receiver.LAND
        if self.plan.transport is Transport.HIERARCHICAL:  # this node's share of the other nodes' calls, first
            self._run(self._fixed["dispatch_relay", self._kept_call])
        if layout in ("compact", "dense", "batched"):
            self._run(self._land[0] if land else self._fixed["compact"])
            self._state = State.DISPATCHED
            if layout == "compact":
                return from_fields(CompactBatch, {**self._batch_views["compact"], "handle": handle})
            if layout == "batched":
                self._run(self._fixed["dispatch_batched", BATCHED_SCALES[scales]])  # DeepEP's low-latency batch
                self._batched_call = handle.call
                return from_fields(BatchedBatch, {**self._batch_views["batched", scales], "handle": handle})
            self._run(self._fixed["dispatch_dense"])  # the received rows laid out densely
            self._dense_call = handle.call
            return from_fields(DenseBatch, {**self._batch_views["dense"], "handle": handle})
        copy = self.plan.expanded_copy
        if copy is ExpandedCopy.IN_LAND:  # placed and copied as the rows land
            self._run(self._land[1])
        elif copy is ExpandedCopy.IN_WAIT:  # placement and copy in one launch
            self._run(self._fixed["expanded"])
        else:  # placed, then the rows (and FP8 scales) laid out
            self._run(self._land[0] if land else self._fixed["compact"])
            self._run(self._fixed["dispatch_copy", scales])
        self._state = State.DISPATCHED
        return from_fields(ExpertBatch, {**self._batch_views["expanded", scales], "handle": handle})

    def batched_views(self, scales: str = "column") -> dict:
        """The arrays of ``dispatch_wait(h, layout="batched", scales=scales)`` (a
        :class:`BatchedBatch` less its handle), without a call: the same memory every call, holding
        a call's rows once its dispatch_wait has run on the stream (for a caller that hands them
        out before it enqueues the wait, as DeepEP's receive hook does). Not collective."""
        if not self.plan.serves("batched"):
            raise EPInputError(f"batched_views: this runtime serves {self.plan.layouts}; build it with 'batched' in "
                               f"EPConfig.layouts.")
        return dict(self._batch_views["batched", self._batched_scales(scales)])

    def _batched_scales(self, scales: str) -> str:
        """dispatch_wait's ``scales`` in the batched layout as a key of :data:`BATCHED_SCALES`
        (bf16 rows have none: any of them, or the default "row", serves), raising EPInputError
        before any launch."""
        fmt, c = self.cfg.token_format, "dispatch_wait"
        if not fmt.quantized and scales in SCALE_LAYOUTS:
            return "column"
        if scales not in BATCHED_SCALES:
            raise EPInputError(f"{c}: scales={scales!r} with layout='batched'; expected one of {tuple(BATCHED_SCALES)} "
                               f"(the batched layout's scales are column-major per expert, DeepEP's low-latency "
                               f"layout: float32, or UE8M0 codes packed four to an int32).")
        if scales == "packed" and (fmt.scale_dtype != np.uint8 or fmt.scale_count(self.cfg.hidden) % 4):
            raise EPInputError(f"{c}: scales='packed' packs UE8M0 codes four to an int32: it needs token_dtype "
                               f"'fp8_e4m3_ue8m0' and hidden a multiple of 512 (this runtime: "
                               f"{self.cfg.token_dtype!r}, hidden {self.cfg.hidden}); use scales='column'.")
        return scales

    def dispatch(self, tokens, topk_ids, topk_weights, layout: str = "expanded", token_scales=None,
                 scales: str = "row", token_global_scale=None):
        """``dispatch_async`` then ``dispatch_wait``, then :meth:`synchronize`. Collective."""
        batch = self.dispatch_wait(self.dispatch_async(tokens, topk_ids, topk_weights, token_scales=token_scales,
                                                       token_global_scale=token_global_scale),
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
        self._require(State.DISPATCHED, State.IDLE, call="keep_routing", handle=handle, handle_type=DispatchHandle)
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
        self._run(self._prepare("routing_copy", restore=INT64[0], **kept))
        restore = into.restore if into is not None else self._prepare("routing_copy", restore=INT64[1], **kept)
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


def batch_views(cfg: EPConfig, b: dict) -> dict:
    """The views dispatch_wait returns (less the handle), made once: ``("expanded", scales)``
    for each scale layout, and ``"compact"`` (the receive buffer has one group, so the compact
    batch is the same memory every call). In a quantized token format the compact ``x`` and
    ``scales`` (NVFP4: and ``global_scales``) are strided views of the messages."""
    fmt, R, T, H = cfg.token_format, cfg.n_ranks, cfg.max_tokens_per_rank, cfg.hidden
    rows = {k: b[f"row_{k}"] for k in ("src_rank", "src_token", "src_k", "weight")}
    meta = dict(row_offsets=b["row_offsets"], expert_counts=b["expert_counts"], **rows)
    views = {}
    for scales in SCALE_LAYOUTS if "expert_x" in b else ():  # (the expanded layout served)
        batch_scales = global_scales = None
        if fmt.quantized:
            C, S = cfg.recv_rows_capacity, fmt.scale_count(H)
            region = b["expert_scales"]  # NVFP4: the [C S] scales' bytes, then [C] float32 global scales
            batch_scales = region[:C * S].reshape((S, C) if scales == "column" else (C, S))
            if fmt.has_global_scale:
                global_scales = region[C * S:].view(np.float32)
        views["expanded", scales] = dict(x=b["expert_x"], scales=batch_scales, global_scales=global_scales, **meta)
    recv = b["dispatch_tokens"]
    recv_global = None
    if fmt.quantized:
        msg8 = recv.reshape(R * T, -1).view(np.uint8)
        pb, sb = fmt.payload_bytes(H), fmt.scale_bytes(H)
        x, recv_scales = msg8[:, :pb], msg8[:, pb:pb + sb].view(fmt.scale_dtype)
        if fmt.has_global_scale:
            G = fmt.global_scale_offset_bytes(H)
            recv_global = msg8[:, G:G + 4].view(np.float32)[:, 0]
    else:
        x, recv_scales = recv.reshape(R * T, H), None
    views["compact"] = dict(x=x, scales=recv_scales, global_scales=recv_global, recv_tokens=b["recv_tokens"],
                            gather=b["row_gather"], **meta)
    if "dense_x" in b:  # (the dense layout served)
        views["dense"] = dense_views(cfg, b)
    if "batched_x" in b:  # (the batched layout served)
        for scales in BATCHED_SCALES:
            views["batched", scales] = batched_layout_views(cfg, b, scales)
    return views


def dense_views(cfg: EPConfig, b: dict) -> dict:
    """The dense batch's views (less the handle) of the regions ``b``: in a quantized format its
    scales ``[N, S]`` row-major (NVFP4: and the rows' float32 global scales after them)."""
    fmt, N, H = cfg.token_format, cfg.n_ranks * cfg.max_tokens_per_rank, cfg.hidden
    scales = global_scales = None
    if fmt.quantized:
        S = fmt.scale_count(H)
        scales = b["dense_scales"][:N * S].reshape(N, S)
        if fmt.has_global_scale:
            global_scales = b["dense_scales"][N * S:].view(np.float32)
    return dict(x=b["dense_x"], scales=scales, global_scales=global_scales, topk_idx=b["dense_topk_idx"],
                topk_weights=b["dense_topk_weights"], slot=b["dense_slot"], slot_row=b["slot_dense_row"],
                source_rows=b["dense_source_rows"], row_offsets=b["row_offsets"], expert_counts=b["expert_counts"])


def batched_layout_views(cfg: EPConfig, b: dict, scales: str) -> dict:
    """The batched batch's views (less the handle) of the regions ``b``, its FP8 scales as
    ``scales`` gives them (:data:`BATCHED_SCALES`): strided views, column-major in the last two
    dimensions (None where the format has none, or packed where it has no UE8M0 codes)."""
    fmt, L, M, H = cfg.token_format, cfg.n_local_experts, cfg.n_ranks * cfg.max_tokens_per_rank, cfg.hidden
    S = fmt.scale_count(H) if fmt.quantized else 0
    view = None
    if fmt.quantized and scales == "column":
        view = b["batched_scales"][:L * M * S].reshape(L, S, M).transpose(0, 2, 1)
    elif fmt.quantized and fmt.scale_dtype == np.uint8 and S % 4 == 0:
        view = b["batched_scales"][:L * M * S // 4].view(np.int32).reshape(L, S // 4, M).transpose(0, 2, 1)
    return dict(x=b["batched_x"].reshape(L, M, -1), scales=view, counts=b["batched_counts"],
                src_token=b["batched_src_token"], layout_range=b["batched_layout_range"],
                row_weight=b["batched_row_weight"].reshape(L, M),
                row_offsets=b["row_offsets"], expert_counts=b["expert_counts"])
