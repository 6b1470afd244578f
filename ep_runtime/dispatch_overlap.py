"""Dispatch rows as they land: the choices the runtime makes for it (docs/protocol.md,
"Dispatch rows as they land").

In a landing runtime dispatch_async signals each rank's routing on its own
(``dispatch_route_signal``) as soon as it is out, and flags every part of every bf16 token row
on arrival (``dispatch_row_flag``); dispatch_wait enqueues one kernel, ``dispatch_land``,
launched with programmatic dependent launch (PDL) so that its first blocks start on the SMs
dispatch_async leaves free: it places the rows while they fly and, in the expanded layout,
copies each part to its expert rows as it lands (the FP8 formats keep ``dispatch_copy`` after
it). Two knobs, read when a runtime is built, the same on every rank:

- ``EP_RUNTIME_DISPATCH_LAND`` (default ``auto``): ``1`` builds a landing runtime; ``0`` keeps
  dispatch_wait (and dispatch_copy); ``auto`` lands where it was measured faster
  (:func:`auto_landing`: bf16 tokens, at least two ranks, a whole-GPU grid and
  ``max_tokens_per_rank`` >= :data:`LAND_AUTO_MIN_TOKENS`). Not with the copy-engine transfer
  (its rows are not flagged): ``auto`` then keeps dispatch_wait, ``1`` is refused.
- ``EP_RUNTIME_DISPATCH_LAND_SMS`` (default :data:`DEFAULT_LAND_SMS`): SMs dispatch_async
  leaves free for dispatch_land's first blocks, when the runtime's grid is the whole GPU
  (``EPConfig.n_sms`` None) and PDL is on (``EP_RUNTIME_PDL`` and the session's fast launcher).
  With ``n_sms`` set, or without PDL, dispatch_async keeps the whole grid.

- ``EP_RUNTIME_DISPATCH_PLACE`` (default ``auto``, v26): ``1`` builds a placing runtime:
  dispatch_async's routing blocks place the received rows while the token rows fly and
  dispatch_wait only waits for the rows (peer stores only, not with landing or the copy
  engine); ``0`` keeps the placement in dispatch_wait; ``auto`` places where landing is off
  and it was measured faster (:func:`auto_placing`: bf16, two ranks or more, the whole GPU, from
  :data:`PLACE_AUTO_MIN_TOKENS` tokens per rank). So a runtime that serves the compact layout
  sets ``EP_RUNTIME_DISPATCH_LAND=0`` and gets placement during the transfer.
- ``EP_RUNTIME_DISPATCH_ROUTE_FIRST`` (default ``auto``, v29): ``1`` builds a route-first
  runtime: dispatch_async sends and signals the routing rows first and ranks nothing, and
  dispatch_wait, started early by PDL on the SMs dispatch_async leaves (v31:
  :data:`ROUTE_FIRST_BLOCKS` blocks, each describing a share of the rows from 128 received
  tokens), places the rows from them while the token rows fly (peer stores only, not with
  landing, placing or the copy engine; docs/protocol.md, "Route first"); ``0`` keeps
  dispatch_wait's placement after the signal; ``auto`` takes it where it was measured faster
  (:func:`auto_route_first`: two ranks or more, the whole GPU with PDL, bf16 up to
  :data:`ROUTE_FIRST_MAX_TOKENS` tokens per rank: T=128 compact dispatch 27.9 -> 24.7 us on 2 x
  H200; FP8 from :data:`ROUTE_FIRST_FP8_MIN_TOKENS`). Above ROUTE_FIRST_MAX_TOKENS the kernels
  are built with chunked placement (v33, :func:`route_chunks`): :data:`ROUTE_FIRST_CHUNK_BLOCKS`
  placing blocks each rank a chunk of the received tokens (v34: counting four ids to a load),
  and from 512 tokens the token blocks send the routing rows (v34: an FP8 encoder's block
  publishes its share from one thread); e4m3 T=4096 compact dispatch 123.0 -> 108.3 us on 2 x
  H100 (pre-quantized 116.3 -> 105.9), so ``auto`` takes it for FP8.
Measured on 2 x H100 over NVLink (docs/throughput.md, "v23"): landing takes 13-160 us off the
expanded dispatch from 1024 tokens per rank up (T=4096: 420.8 -> 351.5 us) and leaves the
compact one within -2.3 / +2.1 us there, but costs 5-13 us below 1024 tokens and with FP8 tokens.
On 2 x H200 (v26): landing 288.7 us expanded and 189.2 compact at T=4096, placing 348.8 and 183.0;
v27 leaves dispatch_land 48 SMs (expanded 268.3 us) and the placing compact dispatch takes 178.4;
v28's dispatch_land reads this rank's own rows from the caller's tokens (they are never sent):
expanded 252.7-253.2 us, compact (landing) 195.8-196.1.
"""

from __future__ import annotations

import os

from .combine_overlap import sender_grid
from .config import EPConfig
from .errors import EPConfigError
from .kernels.cuda_api import SIMULATED

LAND_ENV = "EP_RUNTIME_DISPATCH_LAND"
LAND_SMS_ENV = "EP_RUNTIME_DISPATCH_LAND_SMS"
#: Values of :data:`LAND_ENV` (unset or empty: ``auto``).
LAND_CHOICES = ("auto", "0", "1")
#: Tokens per rank (the runtime's capacity) from which ``auto`` lands bf16 dispatches. 2 x H100,
#: NVLink, graph replay, dispatch (async + wait) us, dispatch_wait -> landing on 24 SMs left:
#: expanded T=512 80.8 -> 80.8, 1024 132.0 -> 119.0, 2048 230.3 -> 200.9, 4096 420.8 -> 351.5,
#: 8192 801.4 -> 641.7; compact 1024 74.0 -> 76.1, 2048 117.4 -> 115.1, 4096 193.7 -> 194.7,
#: 8192 359.9 -> 361.1; T=128 compact 28.7 -> 41.6 (docs/throughput.md, "v23").
LAND_AUTO_MIN_TOKENS = 1024
#: SMs left to dispatch_land's early blocks. 2 x H200 (v27), landing, graph, dispatch (async +
#: wait) us, expanded / compact, with 24 / 48 / 72 SMs left: T=1024 103.8 / 70.6, 101.2 / 68.8,
#: 100.2 / 76.5; T=2048 173.5 / 111.3, 160.0 / 110.1, 156.0 / 120.1; T=4096 ~289 / ~190,
#: 268.3 / 201.6, 262.5 / 206.0; T=8192 518.0 / 358.5, 498.0 / 355.6, 492.2 / 371.4. 48 takes
#: most of the expanded layout's gain (the copy runs on more SMs while the rows fly) and leaves
#: the compact one within 3 us but at T=4096 (+11; a runtime serving the compact layout places
#: instead: ``EP_RUNTIME_DISPATCH_LAND=0``, 178.4 us there). 2 x H100 (v23) had 24. v28 (own
#: rows from the caller's tokens), 48 / 64 / 80 SMs left, expanded / compact: T=1024 98.1 / 69.2,
#: 96.4 / 73.6, 95.9 / 73.6; T=2048 150.1 / 108.3, 146.6 / 114.8, 146.7 / 113.9; T=4096 253.0 /
#: 196.0, 248.3 / 202.5, 247.5 / 201.0; T=8192 457.3 / 354.4, 454.7 / 368.7, 454.0 / 364.1: 48
#: stays (64-80 gain the expanded layout 3-5 us and cost the compact one 4-14).
DEFAULT_LAND_SMS = 48


def auto_landing(cfg: EPConfig) -> bool:
    """Whether ``auto`` lands a runtime of ``cfg``'s dispatches: bf16 tokens (FP8 landing measured
    5-6 us slower on 2 x H100; on 2 x H200, e4m3 compact, 8 / 16 / 32 / 48 SMs left against
    dispatch_wait: T=1024 57.6 / 57.8 / 56.0 / 54.7 against 54.2, T=4096 128.1 / 126.5 / 124.6 /
    139.2 against 122.3, T=8192 214.5 / 209.7 / 223.1 / 231.0 against 215.4: the routing queues
    behind the encoder's stores; docs/throughput.md, "Session 27"), at least two ranks (at one
    rank no row is in flight: nothing to overlap), the whole GPU (``cfg.n_sms`` None: the early start needs SMs left free; the only case
    measured) and ``cfg.max_tokens_per_rank >= LAND_AUTO_MIN_TOKENS``."""
    return (cfg.n_ranks >= 2 and not cfg.token_format.quantized and cfg.n_sms is None
            and cfg.max_tokens_per_rank >= LAND_AUTO_MIN_TOKENS)


def landing(cfg: EPConfig, copy_engine: bool) -> bool:
    """Whether a runtime of ``cfg`` lands its dispatches (``EP_RUNTIME_DISPATCH_LAND``: ``auto``,
    ``0`` or ``1``). Raises EPConfigError for another value, or for ``1`` with the copy-engine
    transfer; ``auto`` with the copy engine keeps dispatch_wait."""
    value = os.environ.get(LAND_ENV, "").strip().lower() or "auto"
    if value not in LAND_CHOICES:
        raise EPConfigError(f"{LAND_ENV}={value!r}: expected auto (unset: where measured faster), 0 (dispatch_wait) "
                            f"or 1 (dispatch_land).")
    if value == "1" and copy_engine:
        raise EPConfigError(f"{LAND_ENV}=1 with EP_RUNTIME_TOKEN_TRANSFER=copy_engine: the copy engine's rows "
                            f"carry no flags; unset one of the two.")
    if value == "auto":
        return auto_landing(cfg) and not copy_engine
    return value == "1"


#: Chooses placement during the transfer (docs/protocol.md, "Placement during the transfer", v26).
PLACE_ENV = "EP_RUNTIME_DISPATCH_PLACE"
#: Values of :data:`PLACE_ENV` (unset or empty: ``auto``).
PLACE_CHOICES = ("auto", "0", "1")
#: Tokens per rank (the runtime's capacity) from which ``auto`` places bf16 dispatches during the
#: transfer when the runtime does not land them (``EP_RUNTIME_DISPATCH_LAND=0``, or a grid set by
#: ``n_sms``). 2 x H200, NVLink, graph replay, dispatch (async + wait) us, placing against
#: dispatch_wait / landing: compact T=1024 62.4 / - / 69.9, 4096 183.0 / 196.4 / 189.2, 8192
#: 343.2 / - / 359.0; expanded 4096 348.8 / 364.3 / 288.7 (landing copies rows as they land:
#: it stays the default); at T=128 the routing is out only after the token rows and placing
#: cost 1-3 us (docs/throughput.md, "v26").
PLACE_AUTO_MIN_TOKENS = 1024


def auto_placing(cfg: EPConfig) -> bool:
    """Whether ``auto`` places a runtime of ``cfg``'s dispatches during the transfer (where it
    does not land them): bf16 tokens (the FP8 encoder's 4 routing blocks get their routing out
    late and place slowly: 124 -> 158 us at T=4096), at least two ranks, the whole GPU
    (``cfg.n_sms`` None: a small grid has one routing block to place every row; the only case
    measured) and ``cfg.max_tokens_per_rank >= PLACE_AUTO_MIN_TOKENS``."""
    return (cfg.n_ranks >= 2 and not cfg.token_format.quantized and cfg.n_sms is None
            and cfg.max_tokens_per_rank >= PLACE_AUTO_MIN_TOKENS)


def placing(cfg: EPConfig, stores: bool, copy_engine: bool, land: bool) -> bool:
    """Whether a runtime of ``cfg`` places its dispatches' rows in dispatch_async's routing blocks
    (``EP_RUNTIME_DISPATCH_PLACE``: ``auto``, ``0`` or ``1``). Only the peer-store send path
    places (the puts path's counts travel with the signal); landing runtimes place in
    dispatch_land and the copy-engine transfer has no routing blocks beside its rows. Raises
    EPConfigError for another value, or for ``1`` where the send path cannot place."""
    value = os.environ.get(PLACE_ENV, "").strip().lower() or "auto"
    if value not in PLACE_CHOICES:
        raise EPConfigError(f"{PLACE_ENV}={value!r}: expected auto (unset: where measured faster), 0 (dispatch_wait "
                            f"places after the signal) or 1 (dispatch_async places during the transfer).")
    possible = stores and not copy_engine and not land
    if value == "1" and not possible:
        why = ("the puts path (EP_RUNTIME_PEER_STORES=0 or unmapped peers) sends the counts with the signal"
               if not stores else "landing (EP_RUNTIME_DISPATCH_LAND=1) places in dispatch_land" if land
               else "the copy-engine transfer (EP_RUNTIME_TOKEN_TRANSFER=copy_engine) has no routing blocks beside "
                    "its rows")
        raise EPConfigError(f"{PLACE_ENV}=1 cannot be honoured: {why}; unset one of the two.")
    if value == "auto":
        return possible and auto_placing(cfg)
    return value == "1"


def dispatch_send_grid(grid: int, whole_gpu: bool, pdl_on: bool) -> int:
    """dispatch_async's grid in a landing runtime: ``grid`` less the SMs left to dispatch_land's
    early blocks when the grid is the whole GPU and PDL is on (at least half kept); else ``grid``."""
    return sender_grid(grid, whole_gpu, pdl_on, LAND_SMS_ENV, DEFAULT_LAND_SMS)


#: Chooses the route-first dispatch (v29; docs/protocol.md, "Route first").
ROUTE_FIRST_ENV = "EP_RUNTIME_DISPATCH_ROUTE_FIRST"
#: Values of :data:`ROUTE_FIRST_ENV` (unset or empty: ``auto``).
ROUTE_FIRST_CHOICES = ("auto", "0", "1")
#: Tokens per rank (the runtime's capacity) up to which ``auto`` takes the route-first dispatch.
#: 2 x H200, NVLink, graph replay, compact dispatch (async + wait) us, ROUTE_FIRST=0 -> 1, twice
#: each (docs/throughput.md, "v29"): T=1 24.4 -> 21.6 / 21.7, T=32 25.2-25.5 -> 21.7 / 21.9, T=128
#: 28.3 -> 25.0 / 24.9, T=256 33.9 -> 38.9 / 39.4 (one block places 512 received tokens slower
#: than 132 blocks place them after the signal).
ROUTE_FIRST_MAX_TOKENS = 128
#: Blocks of a route-first runtime's dispatch_wait (its compact launch; the expanded layout's
#: one-launch copy takes the whole grid), each on an SM dispatch_async leaves free: every block
#: ranks every received token and describes a share of the rows (kernels/dispatch.py,
#: ``place_from_routing``). One block issued every description itself (scattered stores):
#: 6.2 of dispatch_wait's 18.2 us at T=128 on an H100 (v31's trace). 2 x H100, graph, compact
#: dispatch (async + wait) us, 1 -> 2 blocks, twice each in one call (docs/throughput.md,
#: "v31"): T=1 23.3 / 23.3 -> 23.3 / 23.4, T=32 23.5 / 23.3 -> 24.3 / 24.4, **T=128 25.6 / 26.0
#: -> 25.0 / 24.5**; expanded (its one-launch copy unchanged) T=128 53.9 / 54.0 -> 54.5 / 54.3.
#: v32: they share from ``SHARE_FROM_TOKENS`` (128) received tokens, the first block alone
#: below it (T=32 back to 23.3-23.6). 3 and 4 blocks measured no better (session 31, T=32 / 64
#: / 128 rank 0: 2 blocks 23.3 / 24.2-24.3 / 24.4-24.5, 3: 22.8-23.0 / 24.6-25.1 / 25.2-25.5,
#: 4: 22.7-23.2 / 24.0-24.5 / 24.8-25.0).
ROUTE_FIRST_BLOCKS = 2
#: Placing blocks of a route-first runtime of more than ``ROUTE_FIRST_MAX_TOKENS`` tokens per
#: rank (v33): from ``CHUNK_FROM_TOKENS`` received tokens each ranks and describes a chunk of
#: them (kernels/dispatch.py, ``place_by_chunks``). 4 on a 132-SM GPU leave dispatch_async 128
#: token blocks (a chunked call from ``FIRST_SPLIT_TOKENS`` tokens has no routing block): the FP8
#: encoder deals 4,096 tokens evenly to 128 blocks' warps (124 left a third row to some warps: 75
#: -> 94 us, docs/throughput.md, "v19"). 2 x H100, graph, e4m3 T=4096 compact dispatch us, rank
#: 0 / rank 1 (session 32, docs/throughput.md "v33"): dispatch_wait's placement 122.6 / 122.3,
#: route first before v33 (two blocks each ranking every token) 293.6 / 295.4, with 3 chunk
#: blocks 146.2 / 146.2, with 4 and batched counting **115.7 / 117.2**; pre-quantized 116.3 /
#: 115.9 -> 115.2 / 116.0; bf16 T=4096 (3 blocks) 180.3 / 180.4 against placing's 179.5 / 179.3.
#: v34 (four ids to a load in the counting pass, session 33): 111.2-111.6 / 111.1-111.4, and
#: 107.7-108.5 / 107.9-108.4 with the encoder's routing published from one thread a block.
ROUTE_FIRST_CHUNK_BLOCKS = 4


#: Tokens per rank (the runtime's capacity) above which a route-first runtime's kernels are built
#: with chunked placement (``SendPaths.route_chunks``). The simulator's is a few tokens, so its
#: tests build both.
ROUTE_CHUNKS_ABOVE = 16 if SIMULATED else ROUTE_FIRST_MAX_TOKENS


def route_chunks(cfg: EPConfig, route_first: bool) -> bool:
    """Whether a runtime of ``cfg`` (route-first: ``route_first``) builds the chunked placement:
    more than :data:`ROUTE_CHUNKS_ABOVE` tokens per rank."""
    return route_first and cfg.max_tokens_per_rank > ROUTE_CHUNKS_ABOVE


def route_first_blocks(cfg: EPConfig) -> int:
    """Blocks of a route-first runtime's compact dispatch_wait, each on an SM its dispatch_async
    leaves free: :data:`ROUTE_FIRST_CHUNK_BLOCKS` where the kernels place in chunks
    (:func:`route_chunks`), else :data:`ROUTE_FIRST_BLOCKS`."""
    return ROUTE_FIRST_CHUNK_BLOCKS if route_chunks(cfg, True) else ROUTE_FIRST_BLOCKS


#: Tokens per rank (the runtime's capacity) from which ``auto`` takes the route-first dispatch
#: for FP8 tokens (v34: the chunked build, above :data:`ROUTE_CHUNKS_ABOVE`). 2 x H100, graph,
#: e4m3 dispatch (async + wait) us rank 0, route first 0 -> 1 (docs/throughput.md, "v34"),
#: compact / expanded, quantized in dispatch_async and pre-quantized: T=256 30.8 -> 28.9 / 66.9
#: -> 70.3 and 29.8 -> 31.7 / 66.4 -> 69.4 (slower but compact e4m3); T=512 44.6 -> 36.5 / 73.1
#: -> 71.5 and 41.8 -> 40.3 / 71.2 -> 70.0; T=1024 56.3 -> 50.7 / 100.0 -> 95.9; T=2048 78.6 ->
#: 69.1 / 145.4 -> 138.3; **T=4096 123.0 -> 108.3** / 248.3 -> 234.5 and 116.3 -> 105.9 / 240.8
#: -> 231.7; T=8192 213.6 -> 196.0 / 453.4 -> 437.9 (ue8m0 alike).
ROUTE_FIRST_FP8_MIN_TOKENS = 512


def auto_route_first(cfg: EPConfig) -> bool:
    """Whether ``auto`` takes the route-first dispatch for ``cfg``: at least two ranks, the whole
    GPU (``cfg.n_sms`` None: dispatch_async leaves SMs to dispatch_wait's blocks), and either
    bf16 tokens up to :data:`ROUTE_FIRST_MAX_TOKENS` tokens per rank or FP8 tokens from
    :data:`ROUTE_FIRST_FP8_MIN_TOKENS` (the chunked build, :func:`route_chunks`; v34, exact in
    ``fp8_check``). bf16 above 128 tokens stays on landing / placing: route first measured alike
    compact (180.9 against placing's 179.5 us at T=4096, 2 x H100) and far slower expanded
    (404.9 against landing's 318.6: its copy waits for the placement); FP8 below 512 tokens
    measured slower with it in three of four cases at T=256."""
    if cfg.n_ranks < 2 or cfg.n_sms is not None:
        return False
    if cfg.token_format.quantized:
        return cfg.max_tokens_per_rank >= ROUTE_FIRST_FP8_MIN_TOKENS
    return cfg.max_tokens_per_rank <= ROUTE_FIRST_MAX_TOKENS


def routing_first(cfg: EPConfig, stores: bool, copy_engine: bool, land: bool, place: bool, early: bool) -> bool:
    """Whether a runtime of ``cfg`` sends and signals the routing rows first and places the rows
    in a one-block dispatch_wait started early (``EP_RUNTIME_DISPATCH_ROUTE_FIRST``: ``auto``,
    ``0`` or ``1``). Only the peer-store send path, without landing, placing or the copy
    engine; ``auto`` also wants ``early`` (PDL on, so the block starts beside dispatch_async).
    Raises EPConfigError for another value, or for ``1`` where the send path cannot."""
    value = os.environ.get(ROUTE_FIRST_ENV, "").strip().lower() or "auto"
    if value not in ROUTE_FIRST_CHOICES:
        raise EPConfigError(f"{ROUTE_FIRST_ENV}={value!r}: expected auto (unset: where measured faster), 0 "
                            f"(dispatch_wait places after the signal) or 1 (the routing first, placed while the "
                            f"token rows fly).")
    possible = stores and not copy_engine and not land and not place
    if value == "1" and not possible:
        why = ("the puts path (EP_RUNTIME_PEER_STORES=0 or unmapped peers) sends the routing with NVSHMEM puts"
               if not stores else "the copy-engine transfer (EP_RUNTIME_TOKEN_TRANSFER=copy_engine) signals "
               "after its copies" if copy_engine else "landing (EP_RUNTIME_DISPATCH_LAND=1) places in dispatch_land"
               if land else "placing (EP_RUNTIME_DISPATCH_PLACE=1) places in dispatch_async")
        raise EPConfigError(f"{ROUTE_FIRST_ENV}=1 cannot be honoured: {why}; unset one of the two.")
    if value == "auto":
        return possible and early and auto_route_first(cfg)
    return value == "1"
