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

The host side is written by job: this module builds the runtime (regions, peer addresses, plan,
kernels), keeps its lifetime (``synchronize``, ``reset``, ``close``) and the order of its calls
(:mod:`ep_runtime.core.runtime_state`); the calls themselves are in
:mod:`ep_runtime.core.runtime_dispatch` (``dispatch_async`` / ``dispatch_wait``, the routing check,
kept routings), :mod:`ep_runtime.core.runtime_combine` (``combine_async`` / ``combine_wait``) and
:mod:`ep_runtime.core.runtime_slot_values` (``slot_values_async`` / ``slot_values_wait``), mixins
that :class:`EPRuntime` combines.
"""

from __future__ import annotations

import itertools

import numpy as np

from ep_runtime.core import arrays
from ep_runtime.core.builds import combine_wait_with, kernel_builds
from ep_runtime.core.call_memo import CallMemo, PreparedCall
from ep_runtime.core.config import EPConfig
from ep_runtime.core.errors import EPConfigError, EPStateError
from ep_runtime.core.kernel_args import WORD_ARRAYS, build_args, region_views
from ep_runtime.core.layout import PEER_REGIONS, SYNC_CALLS, BufferLayout, partial_dtype, size_text, token_word
from ep_runtime.core.plan import (ExpandedCopy, Plan, Receiver, Topology, Transport, agree, check_plan, choose_plan,
                                  merged_overrides)
from ep_runtime.core.runtime_combine import CombineCalls
from ep_runtime.core.runtime_dispatch import SCALE_LAYOUTS, DispatchCalls, batch_views
from ep_runtime.core.runtime_slot_values import SlotValueCalls
from ep_runtime.core.runtime_state import INT64, STEP, State
from ep_runtime.shmem.session import Session
from ep_runtime.core.status import error_from_status
from ep_runtime.kernels.protocol import BATCHED_SCALES_FLOAT, BATCHED_SCALES_PACKED

_owner_ids = itertools.count(1)


class EPRuntime(DispatchCalls, CombineCalls, SlotValueCalls):
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
        if self.layout.symmetric_bytes > session.heap_bytes:
            raise EPConfigError(
                f"rank {self.rank}: the buffers of this config and plan need {size_text(self.layout.symmetric_bytes)} "
                f"of symmetric heap, more than the session's {size_text(session.heap_bytes)} (largest: "
                f"{self.layout.largest()}). Open the session with heap_bytes >= BufferLayout(cfg, plan)."
                f"symmetric_bytes, or lower max_tokens_per_rank (most regions grow with n_ranks x "
                f"max_tokens_per_rank) or the layouts served")
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
        self._arg["peer_bases"] = session.as_kernel_arg(session.to_device(self._peer_bases()))
        self._partial = partial_dtype(cfg)  # uint16 (bf16 bits) or float32
        self._f32_partials = self._partial == np.float32
        builds = kernel_builds(cfg, self.plan)
        self._kernels = {name: kernel for name, kernel, _ in builds}
        for name, view in region_views(regions, self._kernels.values()).items():  # e.g. dispatch_tokens_u8
            self._arg[name] = session.as_kernel_arg(view)
        for name, kernel, types in builds:  # compile now, not inside a timed wait
            session.precompile(kernel, types)
        # the batched layout's rows (L M, every local expert's M slots), where it is served
        self._batched_rows = (cfg.n_local_experts * cfg.n_ranks * cfg.max_tokens_per_rank
                              if self.plan.serves("batched") else 0)
        # stand-ins for the combine_wait arrays a call does not use (allocated once: graph-safe)
        self._no_out = session.alloc_local("unused out", (0, 0), np.uint16)
        self._no_partials = session.alloc_local("unused out_partials", (0, 0, 0), np.uint16)
        self._no_aux = session.alloc_local("unused aux", (0, 0), np.float32)
        # combine_wait's own_rows: the compact expert_out of the last combine_async (this rank's
        # partials are read there, not copied), or this empty stand-in after an expanded one
        self._no_own = session.alloc_local("unused own_rows", (0, 0), np.uint16)
        self._own_rows = self._no_own
        # combine_wait's topk_weights with EPConfig.combine_weights="home": the last combine_async's
        self._home_weights = None
        self._no_valid = session.alloc_local("unused valid_tokens", (1,), np.int32)
        self._no_scales = session.alloc_local("unused token_scales", (0, 0), np.uint8)
        # combine_async(weights=None): a weight of 1 per expanded (or batched) row (allocated here, not inside a
        # graph capture)
        self._unit_weights = session.alloc_local("unit row weights", (max(cfg.recv_rows_capacity, self._batched_rows),),
                                                 np.float32, fill=1.0)
        self._no_tokens = session.alloc_local("unused tokens", (0, cfg.hidden), np.uint16)
        self._batch_views = batch_views(cfg, self.buffers)
        self._pad_multiple = np.int64(cfg.pad_multiple)
        self._wait_scalars = dict(pad_multiple=self._pad_multiple, timeout_ns=self._timeout_ns)
        self._fixed = self._prepare_receive()
        self._land: tuple = ()  # the last dispatch_async's dispatch_land launches (they read its tokens)
        self._memo = CallMemo()  # the launches prepared from the caller's last arrays, per call
        self._calls = 0
        self._state = State.IDLE
        self._slots_call = -1  # the dispatch call whose slot values went home last
        self._kept_call = 0  # the last dispatch_async reused a kept routing (1) or sent its own (0)
        self._dense_call = -1  # the dispatch call whose rows dispatch_dense laid out last
        self._batched_call = -1  # ... and dispatch_batched
        self._epoch = 0  # reset() count: a kept routing of an earlier epoch is refused
        self._failed: Exception | None = None
        self._closed = False
        session.barrier()

    def _prepare_receive(self) -> dict:
        """The launches of dispatch_wait whose arguments are all the runtime's own, prepared once:
        ``"compact"`` (and the placement before ``dispatch_copy``), ``"expanded"`` where the
        receive kernel copies too (a route-first dispatch_wait on the whole grid), and
        ``("dispatch_copy", scales)``, ``"dispatch_dense"`` where the dense layout is served,
        ``("dispatch_batched", scales_form)`` where the batched one is,
        and with the hierarchical transport ``"dispatch_relay"``
        and ``"combine_relay"``. A landing plan's receive launches read each call's tokens:
        they are prepared with dispatch_async's."""
        plan, fixed = self.plan, {}
        if plan.receiver is not Receiver.LAND:
            fixed["compact"] = self._prepare("dispatch_wait", copy_rows=INT64[0], grid=plan.dispatch_wait_grid,
                                             **self._wait_scalars)
            if plan.expanded_copy is ExpandedCopy.IN_WAIT:
                fixed["expanded"] = self._prepare("dispatch_wait", copy_rows=np.int64(plan.placing_blocks),
                                                  **self._wait_scalars)
        if plan.transport is Transport.HIERARCHICAL:  # the proxies' forwarding, before the receiver and combine_wait
            for reuse in (0, 1):  # after a dispatch with its routing, and with a kept one
                fixed["dispatch_relay", reuse] = self._prepare("dispatch_relay", timeout_ns=self._timeout_ns,
                                                               reuse_routing=INT64[reuse])
            fixed["combine_relay"] = self._prepare("combine_relay", timeout_ns=self._timeout_ns)
        if plan.serves("dense"):
            fixed["dispatch_dense"] = self._prepare("dispatch_dense")
        if plan.serves("batched"):
            for form in (BATCHED_SCALES_FLOAT, BATCHED_SCALES_PACKED):
                fixed["dispatch_batched", form] = self._prepare("dispatch_batched", scales_form=np.int64(form))
        if plan.expanded_copy is ExpandedCopy.DISPATCH_COPY:
            for scales in SCALE_LAYOUTS:
                fixed["dispatch_copy", scales] = self._prepare("dispatch_copy",
                                                               scales_col_major=INT64[scales == "column"])
        return fixed

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
        self._calls, self._state, self._failed, self._slots_call = 0, State.IDLE, None, -1
        self._dense_call = self._batched_call = -1
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
        self._home_weights = None

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
            used = self._state not in states and STEP[self._state] > min(STEP[x] for x in states)
            if handle.call != self._calls - 1 or used:
                raise EPStateError(f"rank {self.rank}: {call} got the handle of call {handle.call}, which "
                                   f"{'already went through ' + call if used else 'is finished'} (current call "
                                   f"{self._calls - 1}, state '{self._state.value}'); each handle is used once, "
                                   f"in order dispatch_async -> dispatch_wait -> combine_async -> combine_wait.")
        if self._state not in states:
            nxt = {State.IDLE: "dispatch_async", State.DISPATCH_SENT: "dispatch_wait",
                   State.DISPATCHED: "combine_async, slot_values_async or dispatch_async",
                   State.SLOTS_SENT: "slot_values_wait", State.COMBINE_SENT: "combine_wait"}[self._state]
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
        return PreparedCall(kernel, build_args(kernel, self._arg, values), grid=grid)

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
