"""`BufferLayout`: the single source of every buffer's size, type, owner and offset.

Pure and CPU-testable. The runtime allocates one symmetric block and one device-local block
of the sizes given here and carves every region out of them at the offsets given here, by
looping over this table (so no region can be forgotten or leak). ``docs/protocol.md`` mirrors
the table; :meth:`BufferLayout.describe` prints it.

Symbols: ``R`` ranks, ``E`` experts, ``L = E / R`` local experts, ``K`` top-k, ``H`` hidden,
``T = max_tokens_per_rank``, ``C`` expert-batch capacity in rows, ``G = 2`` buffer groups
(call ``n`` uses group ``n % 2``; see docs/protocol.md for why two are needed).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ep_runtime.core.config import EPConfig

# the protocol's constants, re-exported for host code
from ep_runtime.kernels.protocol import (COMBINE_FLAG_PARTS, DISPATCH_FLAG_PARTS, MAX_COPY_PLACERS,  # noqa: F401
                                         N_GROUPS, PEER_COUNTS, PEER_IDS, PEER_PARTIALS, PEER_RANKS, PEER_REGIONS,
                                         PEER_TOKENS, PEER_WEIGHTS, RECV_CALLS, RECV_CLAIMS, RECV_LEN, RECV_TICKET,
                                         SIGNAL_TOKEN_BITS, STATUS_CALL, STATUS_CODE, STATUS_COUNTER, STATUS_EXPECTED,
                                         STATUS_KERNEL, STATUS_LEN, STATUS_OBSERVED, STATUS_PEER, STATUS_RANK,
                                         SYNC_CALLS, SYNC_LEN, SYNC_ROUTE_TICKET, SYNC_TICKET, TRACE_BASE, TRACE_LEN)
from ep_runtime.kernels.protocol import signal_value as dispatch_signal_value  # noqa: F401
from ep_runtime.kernels.protocol import RELAY_CHUNK_MIN, relay_stage_rows

#: Byte alignment of every region (a multiple of every dtype and of 16-byte vector access).
ALIGN = 256


def token_word(hidden: int) -> np.dtype:
    """The word kernels move token rows in: the widest of uint64 / uint32 / uint16 that holds a
    whole number of bf16 values of a row (4, 2 or 1 per word). Rows of ``hidden`` bf16 values
    are ``hidden * 2 / itemsize`` words; every bf16 region keeps its uint16 shape and is
    passed to kernels as a view in this word (:data:`ep_runtime.core.kernel_args.WORD_ARRAYS`)."""
    for dtype in (np.uint64, np.uint32):
        if (hidden * 2) % np.dtype(dtype).itemsize == 0:
            return np.dtype(dtype)
    return np.dtype(np.uint16)


def partial_dtype(cfg: EPConfig) -> np.dtype:
    """The dtype of combine partials (``combine_partials``, ``combine_stage``, the compact
    combine input and ``combine_wait(reduce=False)``'s output): uint16 bf16 bits, or float32
    with ``combine_dtype="float32"``. Either is passed to kernels as a token-word view."""
    return np.dtype(np.float32 if cfg.combine_dtype == "float32" else np.uint16)


def partial_format_name(cfg: EPConfig) -> str:
    """How the layout table describes a partial's element: ``"bf16 bits"`` or ``"float32"``."""
    return "float32" if cfg.combine_dtype == "float32" else "bf16 bits"


#: Regions of the quantized token formats only (:func:`send_stage_regions`,
#: :func:`expert_scales_regions`, :func:`global_scale_regions`, :func:`dense_regions`' and
#: :func:`batched_regions`' scales), as (dtype, ndim) of their empty stand-ins in a layout of a
#: format without them.
FORMAT_REGIONS = {"dispatch_send_stage": (np.uint64, 2), "expert_scales": (np.float32, 1),
                  "token_global_scale": (np.float32, 1), "dense_scales": (np.float32, 1),
                  "batched_scales": (np.float32, 1)}

@dataclass(frozen=True)
class Region:
    """One buffer.

    ``shape`` and ``dtype`` are what kernels see; ``init`` is the value it holds at
    allocation; ``writer`` / ``readers`` name kernels (``dispatch_async``, ``dispatch_wait``,
    ``combine_async``, ``combine_wait``, ``peers`` for remote writes, ``user`` for the
    caller); ``offset`` is its byte offset in its block (symmetric or local).
    """

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    init: int | float
    symmetric: bool
    writer: str
    readers: tuple[str, ...]
    doc: str
    offset: int = 0

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


def size_text(nbytes: int) -> str:
    """``nbytes`` for a message: GiB, MiB or KiB with one decimal."""
    for unit, shift in (("GiB", 30), ("MiB", 20)):
        if nbytes >= 1 << shift:
            return f"{nbytes / (1 << shift):,.1f} {unit}"
    return f"{nbytes / 1024:,.1f} KiB"


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class BufferLayout:
    """The symmetric and device-local regions a runtime of an :class:`EPConfig` allocates under
    an execution plan (:class:`~ep_runtime.core.plan.Plan`), with offsets.

    ``plan`` None: every region any plan of ``cfg`` may use (the largest layout). The regions
    a plan does not use (:data:`USED_BY`) are not allocated; kernels that take them get empty
    stand-ins of the same dtype and rank (:meth:`absent`)."""

    def __init__(self, cfg: EPConfig, plan=None):
        self.cfg, self.plan = cfg, plan
        every = _regions(cfg, plan)
        self._every = {r.name: r for r in every}
        regions = [r for r in every if plan is None or USED_BY.get(r.name, _always)(plan, cfg)]
        placed, offsets = [], {True: 0, False: 0}
        for r in regions:
            off = offsets[r.symmetric]
            placed.append(Region(**{**r.__dict__, "offset": off}))
            offsets[r.symmetric] = _align(off + r.nbytes)
        self.regions: tuple[Region, ...] = tuple(placed)
        self.symmetric_bytes = offsets[True]
        self.local_bytes = offsets[False]

    def region(self, name: str) -> Region:
        for r in self.regions:
            if r.name == name:
                return r
        raise KeyError(f"no region named {name!r}; regions: {[r.name for r in self.regions]}")

    def has(self, name: str) -> bool:
        """Whether region ``name`` is allocated under this layout's plan."""
        return any(r.name == name for r in self.regions)

    def absent(self) -> dict:
        """``{name: (dtype, ndim)}`` of the regions this plan does not allocate (or this format
        does not have): what their empty stand-ins look like."""
        out = {name: (r.dtype, len(r.shape)) for name, r in self._every.items() if not self.has(name)}
        out.update({name: spec for name, spec in FORMAT_REGIONS.items() if name not in self._every})
        return out

    @property
    def symmetric_regions(self) -> tuple[Region, ...]:
        return tuple(r for r in self.regions if r.symmetric)

    @property
    def local_regions(self) -> tuple[Region, ...]:
        return tuple(r for r in self.regions if not r.symmetric)

    def largest(self, symmetric: bool = True, n: int = 3) -> str:
        """The ``n`` largest regions of one heap as text (``name shape MiB``), largest first: what
        an error about the heap's size names."""
        heap = sorted(self.symmetric_regions if symmetric else self.local_regions, key=lambda r: -r.nbytes)
        return "; ".join(f"{r.name} {list(r.shape)} {size_text(r.nbytes)}" for r in heap[:n])

    def describe(self) -> str:
        """The region table (under 120 columns): each region's heap, shape, dtype, MiB and
        writer, then the totals and the regions the plan leaves out."""
        mib = 1 << 20
        c = self.cfg
        head = (f"BufferLayout: {c.n_ranks} ranks, {c.n_experts} experts, top-{c.top_k}, hidden {c.hidden}, "
                f"{c.max_tokens_per_rank} tokens/rank, {c.token_dtype}"
                + (f"; plan: {self.plan.receiver.value} receiver, {self.plan.transport.value}, "
                   f"layouts {'+'.join(self.plan.layouts)}" if self.plan is not None else "; every region"))
        rows = [head, f"{'region':<24} {'heap':<4} {'shape':<18} {'dtype':<7} {'MiB':>9}  writer"]
        for r in self.regions:
            rows.append(f"{r.name:<24} {'sym' if r.symmetric else 'loc':<4} {str(r.shape):<18} {r.dtype.name:<7} "
                        f"{r.nbytes / mib:>9.3f}  {r.writer}")
        rows.append(f"symmetric {self.symmetric_bytes / mib:.3f} MiB, local {self.local_bytes / mib:.3f} MiB")
        left_out = [n for n in self._every if not self.has(n)]
        if left_out:
            rows.append("not allocated under this plan: " + ", ".join(left_out))
        return "\n".join(rows)


def _regions(cfg: EPConfig, plan=None) -> list[Region]:
    """Every region any plan of ``cfg`` may use, in allocation order (:data:`USED_BY` says which
    plans use which); ``plan`` sizes the hierarchical transport's (:func:`relay_regions`)."""
    R, L, K, H = cfg.n_ranks, cfg.n_local_experts, cfg.top_k, cfg.hidden
    T, C, G = cfg.max_tokens_per_rank, cfg.recv_rows_capacity, N_GROUPS
    i32, i64, u64, f32 = (np.dtype(t) for t in ("int32", "int64", "uint64", "float32"))
    DA, DW, DC, CA, CW = "dispatch_async", "dispatch_wait", "dispatch_copy", "combine_async", "combine_wait"
    DL = "dispatch_land"
    S, Lc = True, False
    pdt, pname = partial_dtype(cfg), partial_format_name(cfg)
    XN = other_nodes(cfg, plan) * node_pes(plan)  # a proxy's partial senders: a row per (other node, PE here)
    return [
        # -- symmetric: written by peers (and by this rank to itself) -----------------------------
        tokens_region(cfg),
        Region("dispatch_topk_ids", (G, R, T, K), i32, -1, S, f"{DA} (peers)", (DW, DL, DC, CA, CW),
               "[g, src, t]: global expert ids of token t of rank src (every token, sent to every rank)"),
        Region("dispatch_topk_weights", (G, R, T, K), f32, 0, S, f"{DA} (peers)", (DW, DL),
               "[g, src, t]: router weights of token t of rank src"),
        Region("dispatch_counts", (G, R, L + 1), i32, 0, S, f"{DA} (peers, routing block)", (DW, DL, DC, CA, CW),
               "[g, src, :L]: tokens of src per local expert (wait, land); [g, src, L]: tokens src dispatched"),
        Region("dispatch_ranks", (G, R, T, K), i32, 0, S, f"{DA} (peers, routing block)", (DW, DL),
               "[g, src, t, k]: rank of token t among src's tokens with expert topk_ids[t, k], in token "
               "order (wait, land)"),
        Region("dispatch_signal", (G, R), u64, 0, S, f"{DA} (peers, last block)", (DW, DL),
               "[g, src]: (n + 1) << 32 | T once everything of call n (T tokens) from src has arrived "
               "(monotonic)"),
        Region("dispatch_route_signal", (G, R), u64, 0, S, f"{DA} (peers, routing out)",
               (DL, DW), "[g, src]: (n + 1) << 32 | T once src's routing of call n has arrived, before its token "
               "rows (land: ids, weights, ranks, counts; route first: ids, weights and T; monotonic)"),
        combine_partials_region(cfg, plan),
        # cumulative over calls (not per group), as the token rows it guards
        Region("dispatch_token_credit", (R,), u64, 0, S, f"{DA}, {CA} (peers)", (DA,),
               "[d]: rank d has finished reading my token rows of every call before c - 1 once it is c "
               "(granted by d's dispatch_async of call c - 1 and combine_async of call c - 2), so my rows of "
               "call n may go into d once it is >= n + 1 (monotonic)"),
        # monotonic (call numbers), no group axis: a row of call n + 1 cannot come before
        # combine_wait of call n has finished (docs/protocol.md, "Combine rows as they land")
        combine_row_flag_region(cfg, plan),
        # monotonic (call numbers), no group axis, as the token rows it flags
        Region("dispatch_row_flag", (R, T, DISPATCH_FLAG_PARTS), u64, 0, S, f"{DA} (peers, each part's warp)",
               (DL,), "[src, t, p]: n + 1 once part p of token t of rank src of call n has arrived (land, bf16: "
               "dispatch_land copies each part as it lands; src != this rank)"),
        # monotonic (call numbers), no group axis: written by this rank to itself, symmetric so the
        # waits and the simulator treat it as every other flag
        Region("dispatch_placed", (MAX_COPY_PLACERS,), u64, 0, S, f"{DW} (its placing blocks)", (DW,),
               "[p]: (n + 1) << 1 (plus 1 if it failed) once placing block p of a copying route-first "
               "dispatch_wait of call n has described its rows and seen every token row"),
        Region("slot_values", (G, T, K), f32, 0, S, "slot_values_async (peers)", ("slot_values_wait",),
               "[g, t, k]: the value of the expert row slot k of my token t went to (one float per slot home)"),
        Region("slot_signal", (G, R), u64, 0, S, "slot_values_async (peers)", ("slot_values_wait",),
               "[g, src]: n + 1 once src's slot values of call n have arrived (monotonic)"),
        Region("slot_across", (G, R, T, K), f32, 0, S, "slot_values_async (peers of other nodes)",
               ("slot_values_wait",), "[g, r, t, k]: rank r's value for slot k of my token t when r is on another "
               "node, one put a rank and call (hierarchical)"),
        Region("slot_stage", (R, T, K), f32, 0, S, "slot_values_async", ("slot_values_async",),
               "[s, t, k]: this rank's value for slot k of token t of rank s of another node, staged for its "
               "put (hierarchical)"),
        # the hierarchical transport's proxies (ep_runtime/kernels/relay.py): [s] is a source of this PE
        # (a PE of another node with its local index), x the index of its node among the other nodes;
        # row x * node_size + j of the partials holds PE j of this node's
        Region("relay_counts", (G, other_nodes(cfg, plan), node_pes(plan), L + 1), i32, 0, S,
               f"{DA} (peers: sources, with the signal)", ("dispatch_relay",),
               "[g, x, j]: the counts row for PE j of this node of the source on the x-th other node "
               "(hierarchical)"),
        Region("relay_signal", (G, R), u64, 0, S, f"{DA} (peers: the sources, last block)", ("dispatch_relay",),
               "[g, s]: (n + 1) << 32 | T once everything of call n from source s for this node has arrived "
               "(hierarchical; monotonic)"),
        Region("relay_partials", (XN, T, H), pdt, 0, S, f"{CA} (node peers)", ("combine_relay",),
               f"[x node_size + j, t]: PE j's partial for token t of the source on the x-th other node ({pname}; "
               f"hierarchical)"),
        # monotonic (call numbers), no group axis: PE j writes call n + 1's partials only after its
        # dispatch_wait of call n + 1 saw this PE's signal, sent after this PE's relay of call n
        Region("relay_flag", (XN, T, COMBINE_FLAG_PARTS), u64, 0, S, f"{CA} (node peers, each part's warp)",
               ("combine_relay",), "[x node_size + j, t, p]: n + 1 once part p of PE j's partial for token t "
               "of the source on the x-th other node of call n has arrived (hierarchical)"),
        *relay_regions(cfg, plan, symmetric=True),
        # -- local: counters ------------------------------------------------------------------------
        Region("dispatch_async_sync", (SYNC_LEN,), i64, 0, Lc, DA, (DA, DC, CA, CW),
               "[0] ticket: finished blocks of the launch (reset by the last block); "
               "[1] calls: completed dispatch calls (call n sets n + 1); "
               "[2] route ticket (landing and split route-first calls): blocks whose routing went out"),
        Region("receive_sync", (RECV_LEN,), i64, 0, Lc, f"{DW}, {DL}", (DW, DL),
               "[0] ticket: blocks of the receive launch that read its call number (reset by the last); "
               "[1] receive calls so far (the last block of call n's receive kernel sets n + 1); "
               "[2 + g] items dispatch_land of a call of group g claimed (zeroed a call ahead)"),
        Region("combine_wait_claims", (2,), i32, 0, Lc, f"{CW}; the receive kernel (reset)", (CW,),
               "[g]: parts combine_wait of a call of group g has claimed; the receive kernel of call n "
               "zeroes [n % 2]"),
        # -- local: staging of the sender -------------------------------------------------------------
        Region("dispatch_send_ranks", (T, K), i32, 0, Lc, DA, (DA,),
               "staging of dispatch_ranks: [t, k] rank of token t among this rank's tokens with expert "
               "topk_ids[t, k] (wait, land)"),
        Region("dispatch_send_counts", (R, L + 1), i32, 0, Lc, DA, (DA,),
               "staging of the counts row put with each rank's signal (puts): [dst, :L] tokens per expert "
               "of rank dst, [dst, L] T"),
        *send_stage_regions(cfg),
        Region("combine_stage", (R, T, H), pdt, 0, Lc, CA, (CA,),
               f"[dst, t]: partial sum for token t of rank dst ({pname}), staged before the put (puts)"),
        # -- local: the batch ----------------------------------------------------------------------------
        Region("token_rows", (R, T, K), i32, -1, Lc, f"{DW}, {DL}", (DC, CA),
               "[src, t, j]: expert-batch row of the j-th local expert (ascending) of token (src, t)"),
        Region("expert_x", (C, cfg.token_format.payload_width(H)), cfg.token_format.element_dtype, 0, Lc, DC,
               ("user",), "rows grouped by local expert, then source rank, then source token (bf16 bits, or "
               "E4M3 codes in an FP8 token format, packed E2M1 codes in NVFP4; the expanded layout)"),
        *expert_scales_regions(cfg),
        Region("row_offsets", (L + 1,), i32, 0, Lc, f"{DW}, {DL}", ("user", DC),
               "segment e of the batch is rows [row_offsets[e], row_offsets[e + 1])"),
        Region("expert_counts", (L,), i32, 0, Lc, f"{DW}, {DL}", ("user", DC),
               "real (unpadded) rows per local expert"),
        Region("row_src_rank", (C,), i32, -1, Lc, f"{DW}, {DL}", ("user",), "source rank of each row (-1: padding)"),
        Region("row_src_token", (C,), i32, -1, Lc, f"{DW}, {DL}", ("user",), "source token index of each row"),
        Region("row_src_k", (C,), i32, -1, Lc, f"{DW}, {DL}", ("user",), "top-k slot of each row"),
        Region("row_weight", (C,), f32, 0, Lc, f"{DW}, {DL}", ("user", CA), "router weight of each row"),
        Region("row_gather", (C,), i32, -1, Lc, f"{DW}, {DL}", ("user (compact)",),
               "receive-buffer row of each batch row, src * T + t (-1: padding): the compact gather index"),
        Region("recv_tokens", (R,), i32, 0, Lc, f"{DW}, {DL}", ("user (compact)",),
               "[src]: tokens src dispatched in the last call (from its signal)"),
        # -- local: error records --------------------------------------------------------------------
        Region("status", (TRACE_BASE + TRACE_LEN,), i64, 0, Lc, "any kernel", ("host",),
               "first device error: code, kernel, rank, peer/token, counter/slot, expected, observed, call; "
               "then the first dropped slot (an expert id outside [-1, n_experts), the same fields); "
               "then TRACE_LEN phase time stamps (ep_runtime/kernels/trace.py, EP_RUNTIME_TRACE=1)"),
        Region("relay_sync", (1,), i64, 0, Lc, "dispatch_relay", ("dispatch_relay",),
               "[0] ticket: finished blocks of the dispatch_relay launch, reset by the last (hierarchical)"),
        *relay_regions(cfg, plan, symmetric=False),
        *global_scale_regions(cfg),
        # -- local: the dense layout's rows (after the rest: the other layouts' offsets stay) ------------
        *dense_regions(cfg),
        *batched_regions(cfg),
    ]


def _always(plan, cfg) -> bool:
    return True


def _ranked_by_sender(plan, cfg) -> bool:
    return plan.receiver.value in ("wait", "land")


def _puts(plan, cfg) -> bool:
    return plan.transport.value != "stores"


def _rows_put(plan, cfg) -> bool:  # token rows and partials put within a node (staged first)
    return plan.transport.value != "stores" and not plan.node_stores


def _hierarchical(plan, cfg) -> bool:
    return plan.transport.value == "hierarchical"


def _expanded(plan, cfg) -> bool:
    return plan.serves("expanded")


def _dense(plan, cfg) -> bool:
    return plan.serves("dense")


def _batched(plan, cfg) -> bool:
    return plan.serves("batched")


#: ``{region: used(plan, cfg)}``: which plans use a region; a region not listed is used by every
#: plan. A runtime allocates only what its plan uses.
USED_BY = {
    "dispatch_ranks": _ranked_by_sender,
    "dispatch_send_ranks": _ranked_by_sender,
    "dispatch_route_signal": lambda plan, cfg: plan.receiver.value != "wait",
    "dispatch_row_flag": lambda plan, cfg: plan.receiver.value == "land" and not cfg.token_format.quantized,
    # (a route-first bf16 dispatch_wait publishes it on an early error, whatever its launch)
    "dispatch_placed": lambda plan, cfg: plan.receiver.routes_first and not cfg.token_format.quantized,
    "dispatch_send_counts": _puts,
    # (a codec that stages every message, ``stages``, sends it from there on any transport)
    "dispatch_send_stage": lambda plan, cfg: _rows_put(plan, cfg) or bool(cfg.token_format.codec.param("stages")),
    "combine_stage": _rows_put,
    "relay_counts": _hierarchical,
    "relay_signal": _hierarchical,
    "relay_partials": _hierarchical,
    "relay_flag": _hierarchical,
    "relay_sync": _hierarchical,
    "relay_stage": _hierarchical,
    "relay_rows": _hierarchical,
    "relay_chunk_flag": _hierarchical,
    "relay_sums": _hierarchical,
    "combine_sums": lambda plan, cfg: _hierarchical(plan, cfg) and plan.partial_slots(cfg) > 0,
    "combine_chunk_flag": _hierarchical,
    "relay_slot": _hierarchical,
    "slot_across": _hierarchical,
    "slot_stage": _hierarchical,
    "expert_x": _expanded,
    "expert_scales": _expanded,
    "dense_x": _dense,
    "dense_scales": _dense,
    "dense_topk_idx": _dense,
    "dense_topk_weights": _dense,
    "dense_slot": _dense,
    "slot_dense_row": _dense,
    "dense_source_rows": _dense,
    "batched_x": _batched,
    "batched_scales": _batched,
    "batched_counts": _batched,
    "batched_src_token": _batched,
    "batched_layout_range": _batched,
    "batched_token_rows": _batched,
    "batched_row_weight": _batched,
}


def tokens_region(cfg: EPConfig) -> Region:
    """The symmetric receive buffer: bf16 rows ``[R, T, H]`` uint16, or, in an FP8 token
    format, messages ``[R, T, MW]`` uint64 (codes, scales, padding:
    :meth:`ep_runtime.core.formats.TokenFormat.message_words`). One buffer for every call (no group
    axis), so a compact batch's ``x`` is the same memory each call (one CUDA graph serves every
    step); ``dispatch_token_credit`` guards its reuse (docs/protocol.md)."""
    R, T, H = cfg.n_ranks, cfg.max_tokens_per_rank, cfg.hidden
    fmt = cfg.token_format
    readers = ("dispatch_copy", "user (compact)")
    if not fmt.quantized:
        return Region("dispatch_tokens", (R, T, H), np.dtype(np.uint16), 0, True, "dispatch_async (peers)", readers,
                      "[src, t]: token t of rank src (bf16 bits), sent once per destination rank; "
                      "the compact batch's x")
    return Region("dispatch_tokens", (R, T, fmt.message_words(H)), np.dtype(np.uint64), 0, True,
                  "dispatch_async (peers)", readers,
                  f"[src, t]: the {fmt.name} message of token t of rank src (codes, scales, padding)")


def node_pes(plan=None) -> int:
    """PEs a node under ``plan``'s hierarchical transport (1 without one, or for ``plan`` None)."""
    return getattr(plan, "node_size", 0) or 1


def other_nodes(cfg: EPConfig, plan=None) -> int:
    """The nodes other than its own a PE sends to under ``plan``'s hierarchical transport (at
    least 1, so a layout sized for any plan, ``plan`` None, holds the most: one PE a node)."""
    return max(cfg.n_ranks // node_pes(plan) - 1, 1)


def relay_regions(cfg: EPConfig, plan=None, symmetric: bool = True) -> list[Region]:
    """The hierarchical transport's packed chunks (ep_runtime/kernels/relay.py): a source's token rows bound
    for another node and a proxy's sums bound home cross in one put per (node, chunk of
    ``protocol.relay_chunk_tokens(T)`` tokens: C, at most ``T / RELAY_CHUNK_MIN`` a batch), the
    chunk's tokens bound there packed in token order; ``x`` is
    the index of a node among the other nodes (ascending). The symmetric ones (``symmetric``),
    or the local one. Staged rows and sums are symmetric: a remote transport reads a put's
    source from the registered heap."""
    H, T, G = cfg.hidden, cfg.max_tokens_per_rank, N_GROUPS
    X, C = other_nodes(cfg, plan), -(-cfg.max_tokens_per_rank // RELAY_CHUNK_MIN)
    tok, pdt, u64 = tokens_region(cfg), partial_dtype(cfg), np.dtype(np.uint64)
    row = (tok.shape[2],)
    senders, index = partial_rows(cfg, plan)
    if not symmetric:
        return [Region("relay_slot", (G, T, X), np.dtype(np.int32), -1, False, "dispatch_async", ("combine_wait",),
                       "[g, t, x]: where the x-th other node's sum for token t of chunk c comes back: row c CH + j "
                       "of combine_partials[g, proxy] (j: t's rank among the chunk's tokens bound there), or, kept "
                       "by sender, c CH KX + b + j of combine_sums[g] (hierarchical)")]
    return [
        Region("relay_stage", (T * relay_stage_rows(cfg.top_k, X), *row), tok.dtype, 0, True, "dispatch_async",
               ("dispatch_async",), "[c CH KX + b + j], KX = min(K, X): this PE's j-th row of chunk c bound for "
               "an other node, b its chunk's rows for the nodes before that one, staged for the chunk's put "
               "(hierarchical; a token goes to at most KX other nodes)"),
        Region("relay_rows", (X, T, *row), tok.dtype, 0, True, "dispatch_async (peers: sources)",
               ("dispatch_relay",), "[x, c CH + j]: the j-th row of chunk c of this PE's source on the "
               "x-th other node (hierarchical)"),
        Region("relay_chunk_flag", (X, C), u64, 0, True, "dispatch_async (peers: sources)", ("dispatch_relay",),
               "[x, c]: n + 1 once chunk c of call n of the source on the x-th other node has arrived "
               "(hierarchical; monotonic)"),
        Region("relay_sums", (X, T, H), pdt, 0, True, "combine_relay", ("combine_relay",),
               f"[x, c CH + j]: this node's sum for the j-th token of chunk c of the source of the x-th "
               f"other node ({partial_format_name(cfg)}), staged for its chunk's put (hierarchical)"),
        Region("combine_chunk_flag", (senders, C), u64, 0, True, "combine_relay (peers: proxies)",
               ("combine_wait",), f"[{index}, c]: n + 1 once proxy {index}'s sums of chunk c of my tokens of call n "
               f"have arrived ({'in combine_sums' if index == 'i' else f'in combine_partials[g, {index}, c CH:]'}; "
               f"hierarchical; monotonic; rows as combine_row_flag's)"),
        Region("combine_sums", (G, T * relay_stage_rows(cfg.top_k, X), H), pdt, 0, True, "combine_relay (peers: proxies)",
               ("combine_wait",), f"[g, relay_slot[g, t, x]]: the x-th other node's sum for my token t, at "
               f"c CH KX + b + j, KX = min(K, X) (the most other nodes a token goes to): chunk c's rows for the "
               f"nodes before that one (b), then t's rank j among the chunk's tokens bound there, as "
               f"dispatch_async staged them ({partial_format_name(cfg)}; hierarchical, kept by sender)"),
    ]


def send_stage_regions(cfg: EPConfig) -> list[Region]:
    """An FP8 token format's message staging (the puts path encodes each token once into it)."""
    fmt = cfg.token_format
    if not fmt.quantized:
        return []
    return [Region("dispatch_send_stage", (cfg.max_tokens_per_rank, fmt.message_words(cfg.hidden)),
                   np.dtype(np.uint64), 0, False, "dispatch_async", ("dispatch_async",),
                   "[t]: the message of this rank's token t, encoded once, put to every destination (puts)")]


def expert_scales_regions(cfg: EPConfig) -> list[Region]:
    """A quantized token format's expert-batch scales (``[C * S]`` of the scale dtype, S = H /
    block scales per row, laid out per call row-major ``[C, S]`` or column-major ``[S, C]``).
    NVFP4: ``C * (S + 4)`` bytes, the ``[C * S]`` E4M3 scales, then each row's float32 global
    scale (``[C]``, 4-byte aligned: S is a multiple of 4), what its codec's receiver lays out."""
    fmt = cfg.token_format
    if not fmt.quantized:
        return []
    C, H = cfg.recv_rows_capacity, cfg.hidden
    if fmt.has_global_scale:
        return [Region("expert_scales", (C * fmt.extras_bytes(H),), np.dtype(np.uint8), 0, False, "dispatch_copy",
                       ("user",), "the expert batch's rows' E4M3 scales, [C, S] row-major or [S, C] column-major "
                       "(per call), then their float32 global scales [C]")]
    return [Region("expert_scales", (C * fmt.scale_count(H),), fmt.scale_dtype, 0,
                   False, "dispatch_copy", ("user",),
                   "scales of the expert batch's rows: [C, S] row-major or [S, C] column-major (per call)")]


def dense_regions(cfg: EPConfig) -> list[Region]:
    """The dense layout's rows (:mod:`ep_runtime.kernels.layouts.dense`), written by
    ``dispatch_dense`` each call: ``N = R T`` rows, the most a rank can receive (one per
    received (token, source rank)), in DeepEP's order; a quantized format's codes and scales
    (row-major ``[N, S]``; NVFP4: then the rows' float32 global scales ``[N]``)."""
    R, T, K, H = cfg.n_ranks, cfg.max_tokens_per_rank, cfg.top_k, cfg.hidden
    N, fmt = R * T, cfg.token_format
    i32, f32, DD = np.dtype(np.int32), np.dtype(np.float32), "dispatch_dense"
    scales = []
    if fmt.quantized:
        width, dtype = (fmt.extras_bytes(H), np.uint8) if fmt.has_global_scale else (fmt.scale_count(H),
                                                                                   fmt.scale_dtype)
        scales = [Region("dense_scales", (N * width,), np.dtype(dtype), 0, False, DD, ("user (dense)",),
                         "the dense rows' block scales, [N, S] row-major (NVFP4: E4M3 codes, then the rows' "
                         "float32 global scales [N])")]
    return [
        Region("dense_x", (N, fmt.payload_width(H)), fmt.element_dtype, 0, False, DD, ("user (dense)",),
               "one row per received (token, source rank): source-major, then the source's token order (bf16 "
               "bits, or the format's codes); rows past the received count are stale"),
        *scales,
        Region("dense_topk_idx", (N, K), i32, -1, False, DD, ("user (dense)",),
               "[row, k]: the local expert of the row's slot k, or -1 (the expert is elsewhere, or masked; "
               "every slot of a row past the received count)"),
        Region("dense_topk_weights", (N, K), f32, 0, False, DD, ("user (dense)",),
               "[row, k]: the router weight of the row's slot k, 0 where dense_topk_idx is -1"),
        Region("dense_slot", (N,), i32, -1, False, DD, ("user (dense)",),
               "[row]: the receive-buffer slot src * T + t of the dense row, -1 past the received count"),
        Region("slot_dense_row", (R, T), i32, -1, False, DD, ("combine_async_dense", "user (dense)"),
               "[src, t]: the dense row of token t of rank src, -1 where it did not come here"),
        Region("dense_source_rows", (R,), i32, 0, False, DD, ("user (dense)",),
               "[src]: the dense rows from rank src (its tokens with an expert here)"),
    ]


def partial_rows(cfg: EPConfig, plan=None) -> tuple[int, str]:
    """``(rows, index)``: the rows a home keeps for a token's partials and what indexes them
    (``Plan.partial_slots``): on the stores and puts transports with destination lists, the
    destination slots (``min(K, R)``, slot j holding the partial of the token's j-th destination
    rank, ascending: ``"j"``); on the hierarchical transport with destination lists, its senders
    (``N + X``: a PE of this node by its local index, the proxy of the x-th other node in row
    ``N + x`` of ``combine_chunk_flag``, its sums in ``combine_sums``: ``"i"``); else a row a
    source rank (``R``: ``"r"``; ``plan`` None sizes for every plan: the most rows)."""
    rows = plan.partial_slots(cfg) if plan is not None else 0
    if not rows:
        return cfg.n_ranks, "r"
    return rows, "i" if getattr(plan, "node_size", 0) else "j"


def combine_partials_region(cfg: EPConfig, plan=None) -> Region:
    """``combine_partials``: a partial per (source rank, token), or per (destination slot,
    token) under a plan with partial slots (:func:`partial_rows`), or with
    ``combine_weights="home"`` a row per (top-k slot, token), unweighted
    (ep_runtime/kernels/combine_home.py)."""
    K, T, H, G = cfg.top_k, cfg.max_tokens_per_rank, cfg.hidden, N_GROUPS
    if cfg.combine_weights == "home":
        return Region("combine_partials", (G, K, T, H), partial_dtype(cfg), 0, True, "combine_async (peers)",
                      ("combine_wait",), "[g, k, t]: the unweighted row slot k of my token t went to (bf16; "
                      "combine_weights='home')")
    rows, index = partial_rows(cfg, plan)
    if index == "j":
        return Region("combine_partials", (G, rows, T, H), partial_dtype(cfg), 0, True, "combine_async (peers)",
                      ("combine_wait",), f"[g, j, t]: weighted partial sum over the experts of my token t's j-th "
                      f"destination rank, ascending ({partial_format_name(cfg)})")
    if index == "i":  # the node's PEs; the proxies' sums are combine_sums
        return Region("combine_partials", (G, node_pes(plan), T, H), partial_dtype(cfg), 0, True,
                      "combine_async (peers)", ("combine_wait",),
                      f"[g, i, t]: weighted partial sum for my token t from the PE of my node with local index i "
                      f"({partial_format_name(cfg)})")
    return Region("combine_partials", (G, rows, T, H), partial_dtype(cfg), 0, True, "combine_async (peers)",
                  ("combine_wait",), f"[g, r, t]: weighted partial sum over rank r's experts for my token t "
                  f"({partial_format_name(cfg)})")


def combine_row_flag_region(cfg: EPConfig, plan=None) -> Region:
    """``combine_row_flag``: monotonic (call numbers), no group axis: a row of call n + 1 cannot
    come before combine_wait of call n has finished (docs/protocol.md, "Combine rows as they
    land"); by source rank, destination slot or (a PE of the home's node) sender as
    ``combine_partials`` (:func:`partial_rows`), or with ``combine_weights="home"`` by top-k slot."""
    K, T, u64 = cfg.top_k, cfg.max_tokens_per_rank, np.dtype(np.uint64)
    if cfg.combine_weights == "home":
        return Region("combine_row_flag", (K, T, COMBINE_FLAG_PARTS), u64, 0, True,
                      "combine_async (peers, each part's warp)", ("combine_wait",),
                      "[k, t, p]: n + 1 once part p of the row slot k of my token t of call n went to has arrived "
                      "(combine_weights='home')")
    rows, index = partial_rows(cfg, plan)
    if index == "i":  # the node's PEs flag by row; the proxies flag a chunk (combine_chunk_flag)
        rows = node_pes(plan)
    whose = {"j": "my token t's j-th destination rank's partial", "i": "the partial of my token t from the PE of "
             "my node with local index i", "r": "rank r's partial of my token t"}[index]
    return Region("combine_row_flag", (rows, T, COMBINE_FLAG_PARTS), u64, 0, True, "combine_async (peers, each "
                  "part's warp)", ("combine_wait",), f"[{index}, t, p]: n + 1 once part p of {whose} of call n has "
                  "arrived")


def batched_regions(cfg: EPConfig) -> list[Region]:
    """The batched layout's rows (:mod:`ep_runtime.kernels.layouts.batched`), written by
    ``dispatch_batched`` each call: ``M = R T`` slots per local expert (the most one expert can
    receive), the row of expert e at slot pos at ``e M + pos``; an FP8 format's codes, and its
    scales column-major per expert (float32 ``[L, S, M]``, or UE8M0 codes packed four to an
    int32 ``[L, S / 4, M]`` in the region's first bytes)."""
    R, T, L, H, K = cfg.n_ranks, cfg.max_tokens_per_rank, cfg.n_local_experts, cfg.hidden, cfg.top_k
    M, fmt = R * T, cfg.token_format
    i32, DB = np.dtype(np.int32), "dispatch_batched"
    scales = []
    if fmt.quantized:
        scales = [Region("batched_scales", (L * M * fmt.scale_count(H),), np.dtype(np.float32), 0, False, DB,
                         ("user (batched)",), "the batched rows' block scales, per expert column-major: float32 "
                         "[L, S, M], or UE8M0 codes packed four to an int32 [L, S / 4, M] (per call)")]
    return [
        Region("batched_x", (L * M, fmt.payload_width(H)), fmt.element_dtype, 0, False, DB, ("user (batched)",),
               "[e M + pos]: local expert e's row at slot pos (bf16 bits, or the format's codes); slots past the "
               "expert's count are stale"),
        *scales,
        Region("batched_counts", (L,), i32, 0, False, DB, ("user (batched)",), "[e]: the rows of local expert e"),
        Region("batched_src_token", (L, M), i32, -1, False, DB, ("user (batched)",),
               "[e, pos]: the token index on its source rank of the row at slot pos (stale past the count)"),
        Region("batched_layout_range", (L, R), np.dtype(np.int64), 0, False, DB, ("user (batched)",),
               "[e, src]: the first slot of rank src's rows of expert e << 32 | their count"),
        Region("batched_token_rows", (R, T, K), i32, -1, False, DB, ("combine_async (batched)",),
               "[src, t, j]: the batched row e M + pos of the j-th local expert of token t of rank src"),
        Region("batched_row_weight", (L * M,), np.dtype(np.float32), 0, False, DB,
               ("combine_async (batched)", "user (batched)"), "[e M + pos]: the row's router weight"),
    ]


def global_scale_regions(cfg: EPConfig) -> list[Region]:
    """A token format with a global scale (NVFP4): the one dispatch_async encodes with when the
    caller passes none, and the amax it is computed from (ep_runtime/kernels/codecs/nvfp4.py)."""
    if not cfg.token_format.has_global_scale:
        return []
    return [
        Region("token_amax", (1,), np.dtype(np.uint32), 0, False, "tensor_amax (reset by global_scale_of_amax)",
               ("global_scale_of_amax",), "the largest finite bf16 magnitude pattern of the call's tokens, when "
               "the caller passes no global scale (0 between calls)"),
        Region("token_global_scale", (1,), np.dtype(np.float32), 0, False, "global_scale_of_amax",
               ("dispatch_async",), "the rule's global scale of the call's tokens (no caller scale)"),
    ]
