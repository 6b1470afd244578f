"""The combine calls of :class:`~ep_runtime.core.runtime.EPRuntime`: ``combine_async`` /
``combine_wait`` (and ``combine``, the two then a synchronize), with the checks and conversions of
their arguments (expert outputs, row weights, the output, the epilogue's input).

Mixed into :class:`~ep_runtime.core.runtime.EPRuntime`: its methods use the regions, plan and
prepared launches the runtime's constructor makes, and its ``_require`` (the call order),
``_prepare`` (a launch's arguments) and ``_run`` (the launch).
"""

from __future__ import annotations

import numpy as np

from ep_runtime.core import arrays
from ep_runtime.core.call_memo import PreparedCall
from ep_runtime.core.errors import EPInputError
from ep_runtime.core.handles import CombineHandle, DispatchHandle, from_fields
from ep_runtime.core.plan import Transport
from ep_runtime.core.runtime_dispatch import DISPATCH_LAYOUTS
from ep_runtime.core.runtime_state import INT64, State


class CombineCalls:
    """The combine calls of :class:`~ep_runtime.core.runtime.EPRuntime` (a mixin: see the module)."""

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
            - ``layout="dense"``: ``[rows, hidden]``, one row per row of the dense batch of
              this call (``dispatch_wait(handle, layout="dense")``), in its order: this rank's
              partial for that (source rank, token), already combined over this rank's experts
              by the caller (DeepEP's combine input; summed unweighted at home, as DeepEP's
              combine sums). The kernel reads row ``batch.slot_row[s, t]`` for each token that
              came here, so ``rows`` must be at least the rows received (a shorter array is a
              device error raised by :meth:`synchronize`; rows past them are not read). Dtype
              as the compact layout's.
            - ``layout="batched"``: bfloat16 (or uint16 bits) ``[L, M, hidden]`` (or ``[L M,
              hidden]``), M = n_ranks * max_tokens_per_rank: the output of local expert e's row
              at slot pos at ``[e, pos]`` (the batched batch of this call,
              ``dispatch_wait(handle, layout="batched")``; slots past each expert's count are not
              read). Each token's partial is the expanded layout's: the sum over its local
              experts, ascending, of weight x output (read through the batch's
              ``batched_token_rows``, no reordering copy).
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
            must stay unmodified until :meth:`combine_wait` has run. The batched layout takes
            the same, its array float32 ``[L, M]`` (or ``[L M]``), a weight per slot. The
            expanded and batched layouts only: compact and dense rows come weighted.
            With ``EPConfig.combine_weights="home"`` (batched layout only): this rank's router
            weights, float32 ``[T, top_k]`` (T the dispatch's tokens), which combine_wait applies
            here to the unweighted (token, slot) rows the expert ranks send (masked, dropped and
            repeated slots are not read); the array must stay unmodified until combine_wait has
            run on the stream.
        """
        self._require(State.DISPATCHED, call="combine_async", handle=handle, handle_type=DispatchHandle)
        if layout not in DISPATCH_LAYOUTS:
            raise EPInputError(f"combine_async: layout={layout!r}; expected one of {DISPATCH_LAYOUTS}.")
        mode = "dispatch" if isinstance(weights, str) and weights == "dispatch" else \
            "none" if weights is None else "array"
        if self.cfg.combine_weights == "home":
            self._home_weights = self._home_weights_of(layout, weights, handle)
            mode = "home"
        if mode != "dispatch" and layout not in ("expanded", "batched"):
            raise EPInputError(f"combine_async: weights= applies to the expanded and batched layouts only; {layout} "
                               f"rows are the caller's partials, already weighted (leave weights='dispatch').")
        if layout == "batched" and (not self.plan.serves("batched") or self._batched_call != handle.call):
            raise EPInputError("combine_async: layout='batched' reads the batched rows of this call's dispatch: call "
                               "dispatch_wait(handle, layout='batched') first (on a runtime with 'batched' in "
                               f"EPConfig.layouts; this one serves {self.plan.layouts}).")
        if layout == "dense" and (not self.plan.serves("dense") or self._dense_call != handle.call):
            raise EPInputError("combine_async: layout='dense' reads the dense rows of this call's dispatch: call "
                               "dispatch_wait(handle, layout='dense') first (on a runtime with 'dense' in "
                               f"EPConfig.layouts; this one serves {self.plan.layouts}).")
        if isinstance(weights, str) and weights != "dispatch":
            raise EPInputError(f"combine_async: weights={weights!r}; expected 'dispatch', None or a float32 [rows] "
                               f"array.")
        call = self._memo.get_or_prepare("combine_async", (layout, mode), (expert_out, weights if mode == "array"
                                                                            else None),
                                         lambda: self._prepare_combine_async(expert_out, layout, mode, weights))
        if self.debug and layout == "expanded":
            needed = int(self.session.to_host(self.buffers["row_offsets"])[-1])
            if call.n_tokens < needed:
                raise EPInputError(f"combine_async: expert_out has {call.n_tokens} rows but the expert batch has "
                                   f"{needed}; pass one output row per batch row.")
        self._run(call)
        self._own_rows = call.checked[0]
        self._state = State.COMBINE_SENT
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
        elif layout == "dense":
            self._check_partial_dtype(expert_out, c, "expert_out", "the dense layout's rows")
            arrays.check_array(expert_out, c, "expert_out", self._partial, (None, cfg.hidden),
                               f"The dense layout has one row per dense row of the dispatch (at least the rows "
                               f"received, at most n_ranks * max_tokens_per_rank = "
                               f"{cfg.n_ranks * cfg.max_tokens_per_rank}): [rows, hidden = {cfg.hidden}].")
            if expert_out.shape[0] > cfg.n_ranks * cfg.max_tokens_per_rank:
                raise EPInputError(f"{c}: expert_out has {expert_out.shape[0]} rows, more than the "
                                   f"{cfg.n_ranks * cfg.max_tokens_per_rank} dense rows a dispatch can receive "
                                   f"(n_ranks * max_tokens_per_rank); pass one row per dense row.")
            call = self._prepare("combine_async_dense", expert_out=expert_out)
            own = self._no_own  # this rank's own partials are copied into combine_partials
        elif layout == "batched":
            call = self._prepare_combine_batched(expert_out, mode, weights)
            own = self._no_own
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

    def _prepare_combine_batched(self, expert_out, mode, weights) -> PreparedCall:
        """combine_async's launch in the batched layout: ``combine_async`` itself, reading the
        ``[L M, hidden]`` rows through ``batched_token_rows`` and their weights (``mode``) from
        ``batched_row_weight``, a weight of 1 each, or the caller's ``[L M]``."""
        c, cfg = "combine_async", self.cfg
        L, M = cfg.n_local_experts, cfg.n_ranks * cfg.max_tokens_per_rank
        if expert_out.ndim == 3:
            arrays.check_array(expert_out, c, "expert_out", np.uint16, (L, M, cfg.hidden),
                               f"The batched layout has M = n_ranks * max_tokens_per_rank = {M} slots per local "
                               f"expert: [L = {L}, M = {M}, hidden = {cfg.hidden}] (or [L M, hidden]).")
            expert_out = expert_out.reshape(L * M, cfg.hidden)
        arrays.check_array(expert_out, c, "expert_out", np.uint16, (L * M, cfg.hidden),
                           f"The batched layout has M = n_ranks * max_tokens_per_rank = {M} slots per local expert: "
                           f"[L M = {L * M}, hidden = {cfg.hidden}] (or [L, M, hidden]).")
        if mode == "home":  # the rows go home unweighted (combine_wait weights them)
            return self._prepare("combine_async", expert_out=expert_out)
        row_weight = {"dispatch": self.buffers["batched_row_weight"], "none": self._unit_weights}.get(mode)
        if mode == "array":
            row_weight = arrays.to_backend(weights, self.session.backend, c, "weights")
            if row_weight.ndim == 2:
                arrays.check_array(row_weight, c, "weights", np.float32, (L, M), f"Expected float32 [L = {L}, M = "
                                   f"{M}] (or [L M]), a weight per batched slot.")
                row_weight = row_weight.reshape(L * M)
            arrays.check_array(row_weight, c, "weights", np.float32, (L * M,),
                               f"Expected float32 [L M = {L * M}] (or [L, M]), a weight per batched slot.")
        return self._prepare("combine_async", expert_out=expert_out, token_rows=self.buffers["batched_token_rows"],
                             row_weight=row_weight)

    def _home_weights_of(self, layout: str, weights, handle: DispatchHandle):
        """``combine_async``'s ``weights`` on a runtime with ``combine_weights="home"``: this rank's
        float32 ``[T, top_k]`` router weights as a backend array (raising EPInputError, naming
        the fix, for another layout or anything else)."""
        c, cfg = "combine_async", self.cfg
        if layout != "batched":
            raise EPInputError(f"{c}: layout={layout!r} on a runtime with EPConfig.combine_weights='home', which "
                               f"sends the batched rows home by slot; use layout='batched'.")
        if weights is None or isinstance(weights, str):
            raise EPInputError(f"{c}: weights={weights!r}, but EPConfig.combine_weights is 'home': combine_wait "
                               f"weights each (token, slot) row here by this rank's router weights; pass them as "
                               f"float32 [T = {handle.n_tokens}, top_k = {cfg.top_k}], or build the runtime with "
                               f"combine_weights='expert' to weight on the expert ranks.")
        weights = arrays.to_backend(weights, self.session.backend, c, "weights")
        arrays.check_array(weights, c, "weights", np.float32, (handle.n_tokens, cfg.top_k),
                           f"Expected float32 [T = {handle.n_tokens}, top_k = {cfg.top_k}], this rank's router "
                           f"weights (combine_weights='home').")
        return weights

    def combine_wait(self, handle: CombineHandle, out=None, epilogue=None, aux=None, reduce: bool = True):
        """Complete the combine of ``handle``. Collective; enqueued on the stream.

        Returns ``out`` [T, hidden] uint16 (bf16 bits): for each token, the sum over the ranks
        it went to (rank order, float32) of their partials, through ``epilogue`` (a Numba
        device function ``f(value, token, col, aux) -> float32``, e.g. a residual add reading
        ``aux``, a [T, hidden] float32 array) and rounded to bf16. With ``reduce=False`` returns
        the per-rank partials ``[n_ranks, T, hidden]`` instead (zero where the token did not
        go), in the partials' dtype: uint16 bf16 bits, or float32 when
        ``EPConfig.combine_dtype`` is ``"float32"``. With ``EPConfig.combine_weights="home"``: for
        each token, the sum over its routed slots (slot order, float32 from 0) of the weight
        combine_async was given times the slot's row; ``reduce=False`` is refused.
        """
        self._require(State.COMBINE_SENT, call="combine_wait", handle=handle, handle_type=CombineHandle)
        if not reduce and self.cfg.combine_weights == "home":
            raise EPInputError("combine_wait: reduce=False returns each rank's partial, but with "
                               "EPConfig.combine_weights='home' the ranks send a row per (token, slot), summed here; "
                               "use reduce=True, or a runtime with combine_weights='expert'.")
        if not reduce and self.plan.transport is Transport.HIERARCHICAL:
            raise EPInputError("combine_wait: reduce=False returns each rank's partial, but the hierarchical "
                               "transport sums each other node's partials on that node; use reduce=True, or a "
                               "runtime with plan transport=puts.")
        if out is None:  # every element is written by the kernel (rows < n_tokens with n_tokens)
            shape = (handle.n_tokens, self.cfg.hidden) if reduce else (self.cfg.n_ranks, handle.n_tokens,
                                                                       self.cfg.hidden)
            out = self.session.alloc_local("combine_out", shape, np.uint16 if reduce else self._partial, fill=None)
        own, home = self._own_rows, self._home_weights
        call = self._memo.get_or_prepare("combine_wait", (handle.n_tokens, bool(reduce), epilogue),
                                         (out, aux, own, home),
                                         lambda: self._prepare_combine_wait(handle.n_tokens, out, aux, epilogue,
                                                                            reduce, own, home))
        if "combine_relay" in self._fixed:  # the other nodes' partials of this node's proxies, summed and sent
            self._run(self._fixed["combine_relay"])
        self._run(call)
        self._state = State.IDLE
        return call.checked[0]

    def _prepare_combine_wait(self, T, out, aux, epilogue, reduce, own, home) -> PreparedCall:
        """Check and convert combine_wait's ``out`` and ``aux`` for ``T`` tokens (raising
        EPInputError before any launch); the launch, with ``checked = (out,)`` as returned.
        ``own``: the last combine_async's compact expert_out (checked there), or the empty
        stand-in; ``home``: its router weights with ``combine_weights="home"`` (checked there),
        else None."""
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
                             out_partials=unused if reduce else out, mode=INT64[0 if reduce else 1],
                             timeout_ns=self._timeout_ns, aux=aux, own_rows=own, topk_weights=home)
        return PreparedCall(call.kernel, call.args, n_tokens=T, checked=(out,))

    def combine(self, expert_out, handle: DispatchHandle, layout: str = "expanded", weights="dispatch", **kwargs):
        """``combine_async`` then ``combine_wait``, then :meth:`synchronize`. Collective."""
        out = self.combine_wait(self.combine_async(expert_out, handle, layout=layout, weights=weights), **kwargs)
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
