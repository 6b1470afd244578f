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

from .config import EPConfig

# the protocol's constants, re-exported for host code
from .kernels.protocol import (COMBINE_FLAG_PARTS, DISPATCH_FLAG_PARTS, LAND_CALLS, LAND_CLAIMS,  # noqa: F401
                               LAND_TICKET,
                               N_GROUPS, PEER_COUNTS, PEER_IDS, PEER_PARTIALS, PEER_RANKS, PEER_REGIONS, PEER_TOKENS,
                               PEER_WEIGHTS, ROUTE_CHUNKS, SIGNAL_TOKEN_BITS, STATUS_CALL, STATUS_CODE,
                               STATUS_COUNTER, STATUS_EXPECTED, STATUS_KERNEL, STATUS_LEN, STATUS_OBSERVED, STATUS_PEER,
                               STATUS_RANK, SYNC_CALLS, SYNC_ROUTE_TICKET, SYNC_TICKET, TRACE_LEN)
from .kernels.protocol import signal_value as dispatch_signal_value  # noqa: F401

#: Byte alignment of every region (a multiple of every dtype and of 16-byte vector access).
ALIGN = 256


def token_word(hidden: int) -> np.dtype:
    """The word kernels move token rows in: the widest of uint64 / uint32 / uint16 that holds a
    whole number of bf16 values of a row (4, 2 or 1 per word). Rows of ``hidden`` bf16 values
    are ``hidden * 2 / itemsize`` words; every bf16 region keeps its uint16 shape and is
    passed to kernels as a view in this word (:data:`ep_runtime.kernel_args.WORD_ARRAYS`)."""
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


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class BufferLayout:
    """Every symmetric and device-local region of an :class:`EPConfig`, with offsets."""

    def __init__(self, cfg: EPConfig):
        self.cfg = cfg
        regions = _regions(cfg)
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

    @property
    def symmetric_regions(self) -> tuple[Region, ...]:
        return tuple(r for r in self.regions if r.symmetric)

    @property
    def local_regions(self) -> tuple[Region, ...]:
        return tuple(r for r in self.regions if not r.symmetric)

    def describe(self) -> str:
        """The region table with per-region and total MiB."""
        mib = 1 << 20
        rows = [f"BufferLayout for {self.cfg}", f"{'region':24} {'heap':9} {'shape':28} {'dtype':8} "
                f"{'init':>5} {'offset':>14} {'MiB':>10}  writer -> readers"]
        for r in self.regions:
            rows.append(f"{r.name:24} {'symmetric' if r.symmetric else 'local':9} {str(r.shape):28} "
                        f"{r.dtype.name:8} {r.init!s:>5} {r.offset:>14} {r.nbytes / mib:>10.3f}  "
                        f"{r.writer} -> {', '.join(r.readers)}")
        rows.append(f"symmetric total {self.symmetric_bytes / mib:.3f} MiB; "
                    f"local total {self.local_bytes / mib:.3f} MiB")
        return "\n".join(rows)


def _regions(cfg: EPConfig) -> list[Region]:
    R, L, K, H = cfg.n_ranks, cfg.n_local_experts, cfg.top_k, cfg.hidden
    T, C, G = cfg.max_tokens_per_rank, cfg.recv_rows_capacity, N_GROUPS
    i32, i64, u64, f32 = (np.dtype(t) for t in ("int32", "int64", "uint64", "float32"))
    DA, DW, DC, CA, CW = "dispatch_async", "dispatch_wait", "dispatch_copy", "combine_async", "combine_wait"
    DL = "dispatch_land"
    S, Lc = True, False
    fmt = cfg.token_format
    pdt, pname = partial_dtype(cfg), partial_format_name(cfg)
    return [
        # -- symmetric: written by peers (and by this rank to itself) -----------------------------
        tokens_region(cfg),
        Region("dispatch_topk_ids", (G, R, T, K), i32, -1, S, f"{DA} (peers)", (DW, DC, CA, CW),
               "[g, src, t]: global expert ids of token t of rank src (every token, sent to every rank)"),
        Region("dispatch_topk_weights", (G, R, T, K), f32, 0, S, f"{DA} (peers)", (DW,),
               "[g, src, t]: router weights of token t of rank src"),
        Region("dispatch_counts", (G, R, L + 1), i32, 0, S, f"{DA} (peers, routing block)", (DW, DC, CA, CW),
               "[g, src, :L]: tokens of src per local expert; [g, src, L]: tokens src dispatched"),
        Region("dispatch_ranks", (G, R, T, K), i32, 0, S, f"{DA} (peers, routing block)", (DW,),
               "[g, src, t, k]: rank of token t among src's tokens with expert topk_ids[t, k], in token "
               "order (the whole run stored on every rank)"),
        Region("dispatch_signal", (G, R), u64, 0, S, f"{DA} (peers, last block)", (DW,),
               "[g, src]: (n + 1) << 32 | T once everything of call n (T tokens) from src has arrived "
               "(dispatch_signal_value; monotonic)"),
        Region("combine_partials", (G, R, T, H), pdt, 0, S, f"{CA} (peers)", (CW,),
               f"[g, r, t]: weighted partial sum over rank r's experts for my token t ({pname})"),
        Region("combine_signal", (G, R), u64, 0, S, f"{CA} (peers, last block)", (CW,),
               "[g, r]: n + 1 once rank r's partials of call n have arrived (monotonic)"),
        # cumulative over calls (not per group), as the token rows it guards
        Region("dispatch_token_credit", (R,), u64, 0, S, f"{DA}, {CA} (peers, block 0)", (DA,),
               "[d]: rank d has finished reading my token rows of every call before c - 1 once it is c "
               "(granted by d's dispatch_async of call c - 1 and combine_async of call c - 2), so my rows of "
               "call n may go into d once it is >= n + 1 (monotonic)"),
        # monotonic (call numbers), no group axis: a row of call n + 1 cannot come before
        # combine_wait of call n has finished (docs/protocol.md, "Combine rows as they land")
        Region("combine_row_flag", (R, T, COMBINE_FLAG_PARTS), u64, 0, S, f"{CA} (peers, each part's warp)", (CW,),
               "[r, t, p]: n + 1 once part p of rank r's partial of my token t of call n has arrived (flagged "
               "calls: combine_wait reduces each part as it lands)"),
        # landing calls (v18) and route-first builds (v29), at the end of the heap so no earlier region moves
        Region("dispatch_route_signal", (G, R), u64, 0, S, f"{DA} (peers, last route ticket or the routing block)",
               (DL, DW), "[g, src]: (n + 1) << 32 | T once src's routing of call n has arrived, before its token "
               "rows (landing calls: ids, weights, ranks, counts; route-first builds: ids, weights and T; "
               "monotonic)"),
        # monotonic (call numbers), no group axis, as the token rows it flags
        Region("dispatch_row_flag", (R, T, DISPATCH_FLAG_PARTS), u64, 0, S, f"{DA} (peers, each part's warp)",
               (DL,), "[src, t, p]: n + 1 once part p of token t of rank src of call n has arrived (landing "
               "calls: dispatch_land copies each part as it lands; src != this rank, whose own bf16 rows "
               "dispatch_land reads from the caller's tokens, v28)"),
        # monotonic (call numbers), no group axis (v26): the receiver's placement reads group g's
        # routing before its dispatch_wait of call n, as dispatch_wait did after the signal
        Region("dispatch_route_chunk", (R, ROUTE_CHUNKS), u64, 0, S, f"{DA} (peers, each routing block)", (DA,),
               "[src, c]: n + 1 once routing chunk c of rank src's call n (its ids, weights and ranks; chunk 0 "
               "also the counts and T) has arrived (peer-store builds without landing: the routing blocks "
               "place the received rows during the transfer)"),
        # monotonic (call numbers), no group axis (v30): written by this rank to itself, symmetric
        # so the waits and the simulator treat it as every other flag
        Region("dispatch_placed", (1,), u64, 0, S, f"{DW} (its placing block)", (DW,),
               "[0]: (n + 1) << 1 (plus 1 if it failed) once the placing block of a copying route-first "
               "dispatch_wait of call n has described every row and seen every token row (its other blocks "
               "wait for it, then copy)"),
        # -- local: counters of dispatch_async -----------------------------------------------------
        Region("dispatch_async_sync", (3,), i64, 0, Lc, DA, (DA, DW, CA, CW),
               "[0] ticket: finished blocks of the launch (reset by the last block); "
               "[1] calls: completed dispatch calls (call n sets n + 1); "
               "[2] route ticket (landing and chunked route-first calls): blocks whose routing rows went out "
               "(reset by the last)"),
        Region("dispatch_send_ranks", (T, K), i32, 0, Lc, DA, (DA,),
               "staging of dispatch_ranks: [t, k] rank of token t among this rank's tokens with expert "
               "topk_ids[t, k]"),
        Region("dispatch_send_counts", (R, L + 1), i32, 0, Lc, DA, (DA,),
               "staging of the counts row put with each rank's signal (puts path): [dst, :L] tokens per "
               "expert of rank dst, [dst, L] T"),
        # -- local: shared by dispatch_wait and combine_async --------------------------------------
        Region("token_rows", (R, T, K), i32, -1, Lc, DW, (DC, CA),
               "[src, t, j]: expert-batch row of the j-th local expert (ascending) of token (src, t)"),
        Region("combine_async_sync", (1,), i64, 0, Lc, CA, (CA,),
               "[0] ticket: finished blocks of the launch (reset by the last block)"),
        # -- local: staging of combine_async -------------------------------------------------------
        Region("combine_stage", (R, T, H), pdt, 0, Lc, CA, (CA,),
               f"[dst, t]: partial sum for token t of rank dst ({pname}), staged before the put"),
        # -- local: the expert batch (output of dispatch_wait) -------------------------------------
        Region("expert_x", (C, H), fmt.element_dtype, 0, Lc, DC, ("user",),
               "rows grouped by local expert, then source rank, then source token (bf16 bits, or "
               "E4M3 codes in an FP8 token format)"),
        Region("row_offsets", (L + 1,), i32, 0, Lc, DW, ("user", DC),
               "segment e of the batch is rows [row_offsets[e], row_offsets[e + 1])"),
        Region("expert_counts", (L,), i32, 0, Lc, DW, ("user", DC),
               "real (unpadded) rows per local expert"),
        Region("row_src_rank", (C,), i32, -1, Lc, DW, ("user",), "source rank of each row (-1: padding)"),
        Region("row_src_token", (C,), i32, -1, Lc, DW, ("user",), "source token index of each row"),
        Region("row_src_k", (C,), i32, -1, Lc, DW, ("user",), "top-k slot of each row"),
        Region("row_weight", (C,), f32, 0, Lc, DW, ("user", CA), "router weight of each row"),
        Region("row_gather", (C,), i32, -1, Lc, DW, ("user (compact)",),
               "receive-buffer row of each batch row, src * T + t (-1: padding): the compact gather index"),
        *quantized_regions(cfg),
        # -- local: error record --------------------------------------------------------------------
        Region("status", (STATUS_LEN + TRACE_LEN,), i64, 0, Lc, "any kernel", ("host",),
               "first device error: code, kernel, rank, peer/expert, counter, expected, observed, call; "
               "then TRACE_LEN phase time stamps (kernels/trace.py, EP_RUNTIME_TRACE=1)"),
        Region("dispatch_copy_go", (1,), np.dtype(np.uint32), 0, Lc, f"{DA} (block 0); side stream", ("side stream",),
               "[0] 1: every peer granted this call's copies (copy-engine transfer); the side stream waits "
               "for 1, resets it to 0, then copies"),
        Region("recv_tokens", (R,), i32, 0, Lc, DW, ("user (compact)",),
               "[src]: tokens src dispatched in the last call (from its signal)"),
        Region("combine_wait_claims", (2,), i32, 0, Lc, f"{CW} (claims); {DW} (reset)", (CW,),
               "[g]: rows combine_wait of a call of group g has claimed (reduced as they land); "
               "dispatch_wait of call n zeroes [n % 2]"),
        # at the ends of both heaps (v18), so no earlier region moves
        Region("dispatch_land_sync", (4,), i64, 0, Lc, f"{DW}, {DL}", (DW, DL),
               "[0] ticket: finished blocks of dispatch_land (reset by the last block); [1] receive calls: "
               "dispatch_wait or dispatch_land of call n sets n + 1 (dispatch_land, and dispatch_wait in a "
               "placing runtime, read their call number here, while dispatch_async still runs); [2 + g] items dispatch_land of a call of group g "
               "claimed (the receive kernel of call n zeroes [2 + (n + 1) % 2])"),
    ]


def tokens_region(cfg: EPConfig) -> Region:
    """The symmetric receive buffer: bf16 rows ``[R, T, H]`` uint16, or, in an FP8 token
    format, messages ``[R, T, MW]`` uint64 (codes, scales, padding:
    :meth:`ep_runtime.formats.TokenFormat.message_words`). One buffer for every call (no group
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


def quantized_regions(cfg: EPConfig) -> list[Region]:
    """The regions only an FP8 token format has: the sender's message staging and the expert
    batch's scales (``[C * S]`` of the scale dtype, S = H / 128 blocks per row, laid out per
    call row-major ``[C, S]`` or column-major ``[S, C]``)."""
    fmt = cfg.token_format
    if not fmt.quantized:
        return []
    T, H, C = cfg.max_tokens_per_rank, cfg.hidden, cfg.recv_rows_capacity
    return [
        Region("dispatch_send_stage", (T, fmt.message_words(H)), np.dtype(np.uint64), 0, False, "dispatch_async",
               ("dispatch_async",), "[t]: the message of this rank's token t, encoded once, put to every destination"),
        Region("expert_scales", (C * fmt.scale_count(H),), fmt.scale_dtype, 0, False, "dispatch_copy", ("user",),
               "scales of the expert batch's rows: [C, S] row-major or [S, C] column-major (per call)"),
    ]
