"""The dispatch kernels: ``dispatch_async`` (send), ``dispatch_wait`` (receive, place),
``dispatch_copy`` (lay the received rows out expert-major), ``dispatch_signal`` (the copy-engine
transfer's signal) and ``dispatch_land`` (receive, place and copy while the rows land: the
receive kernel of a landing runtime, docs/protocol.md "Dispatch rows as they land").

Built by :func:`make_dispatch_kernels` for a block size (a compile-time constant: shared-memory
scans are sized by it). Symbols as in :mod:`ep_runtime.layout`; ``g = n % 2`` is the buffer
group of call ``n`` (routing, counts, signals; the token rows have one buffer, guarded by
credits) and ``me`` this rank; ``W = H / pack`` words per token row (token rows move
as words of ``pack`` bf16 values: :func:`ep_runtime.layout.token_word`). See docs/protocol.md
for the timeline. The host's ``dispatch_wait`` enqueues ``dispatch_wait`` then ``dispatch_copy``:
the kernel boundary is the grid-wide barrier between "every row's position is known" and
"copy each received row once to all its expert rows" (a route-first runtime's dispatch_wait
does both in one launch instead: its placing block publishes ``dispatch_placed``, v30).
"""

from numba import float32, int32, int64, uint32, uint64

from ep_runtime.kernels.protocol import MAX_RANKS, PLACEMENT_WORDS
from ep_runtime.kernels import pdl, shmem
from ep_runtime.kernels.bits import f32_bits
from ep_runtime.kernels.block import (await_part, block_exclusive_scan, flag_part, flag_rule,
                                      grant_token_credits, last_block_ticket, local_expert_count, part_bounds,
                                      part_words, popc32, publish_fence, record_error, row_parts, udiv32,
                                      warp_exclusive_count, warp_exclusive_sum, warp_geometry, warp_sync)
from ep_runtime.kernels.cuda_api import SIMULATED, cuda, kernel_jit
from ep_runtime.kernels.token_codec import BLOCK_WORDS, CODE_WORDS, HELD_SCALES, make_token_codec
from ep_runtime.kernels.trace import stamp_first, stamp_last
from ep_runtime.kernels.vec import (address_of, load_u32_at, load_u32x4_at, make_pair_loops, pairs_aligned,
                                    store_u32_at, store_u8_at, store_word_at)
from ep_runtime.kernels.protocol import (DISPATCH_FLAG_PARTS, LAND_CALLS, LAND_CLAIMS, LAND_TICKET, PEER_COUNTS,
                                         PEER_IDS, PEER_RANKS, PEER_TOKENS, PEER_WEIGHTS, SIGNAL_TOKEN_BITS,
                                         STATUS_CODE, SYNC_CALLS, SYNC_ROUTE_TICKET, SYNC_TICKET)
from ep_runtime.kernels.protocol import (COUNTER_DISPATCH_PLACED, COUNTER_DISPATCH_ROW_FLAG, COUNTER_DISPATCH_SIGNAL,
                                         COUNTER_RECV_ROWS, COUNTER_ROUTE_CHUNK, COUNTER_ROUTE_SIGNAL,
                                         COUNTER_TOKEN_CREDIT, ERR_CAPACITY, ERR_TIMEOUT, KERNEL_DISPATCH_ASYNC,
                                         KERNEL_DISPATCH_LAND, KERNEL_DISPATCH_WAIT)

#: Words of a row each lane loads before storing any in dispatch_copy (memory-level
#: parallelism: 64 bytes per lane, 32 KB per 512-thread block in flight); as word pairs
#: (``kernels/vec.py``) where rows allow it, ``COPY_UNROLL // 2`` pairs.
COPY_UNROLL = 8

#: Word pairs per lane that copy_to_rows (dispatch_land, dispatch_copy: a received row to its
#: expert rows) loads before storing any: 128 bytes per lane, 64 KB per 512-thread block in
#: flight, twice the send loops' ``COPY_UNROLL // 2`` (2 x H200, T=4096: the expanded
#: dispatch's copy moved ~25 GB/s per SM with 64 bytes per lane; docs/throughput.md, "v27").
COPY_PAIRS = 8

#: The same for the copy inside a route-first dispatch_wait (``expand_rows_in_wait``): that
#: kernel's placement leaves fewer registers, and 8 pairs spilled there (ptxas: 96 bytes of
#: stack); 4 pairs fit with no spill (v30; on 2 x H100 the two measured alike at T <= 128).
WAIT_COPY_PAIRS = 4

#: Items per warp dispatch_async's bf16 token loop aims at when a batch has a row for every warp
#: (``send_warps``): the rows are cut into parts so that the transfer's last round, in which the
#: warps with one item more than the others still send, is short. 2 x H200, placing, compact,
#: dispatch (async + wait) us, one row per item -> 4 -> 8 items per warp: T=2048 102.3 -> 98.2 ->
#: 97.9, T=4096 181.4 -> 180.0 -> 178.3, T=8192 342.8 -> 342.6 -> 340.5. The FP8 encoder keeps
#: a part per warp: e4m3 T=4096 124.2 -> 125.8 -> 127.6 (docs/throughput.md, "v27").
SEND_ROUNDS = 8


#: Local experts the single block of a route-first dispatch_wait ranks per pass over the received
#: tokens (shared lane masks and row words of warps x RECV_WINDOW words each, 8 KB apiece at 16
#: warps): one pass for up to 128 local experts (256 experts on 2 ranks). The simulator's windows
#: are 4 experts, so its configurations take several passes.
RECV_WINDOW = 4 if SIMULATED else 128

#: Received tokens (every source's) from which the blocks of a route-first dispatch_wait's
#: compact launch share the rows' descriptions (``place_from_routing``); below it the first
#: block describes them all and the others stand down once the routing is in. 2 x H100, graph,
#: compact dispatch us, sharing at every size -> from 128 (session 31, calls 1-2, rank 0 /
#: rank 1): T=32 24.2-24.5 / 24.2 -> 23.3-23.6 / 23.5-23.6, T=128 24.8-25.3 / 25.3 -> 24.4-24.8 /
#: 25.0-25.2. The simulator's is a few rows, so its tests take both ways.
SHARE_FROM_TOKENS = 8 if SIMULATED else 128

#: Received tokens (every source's) from which the blocks of a route-first dispatch_wait's
#: compact launch also share the ranking (v33, ``place_by_chunks``): block b ranks and describes
#: chunk b of the received tokens only, from each local expert's rows before the chunk (a
#: shared-memory histogram of every received id), instead of every block ranking every token
#: (two blocks took ~196 us after the transfer to place 8,192 received FP8 tokens at T=4096,
#: session 32). The simulator's is a few rows, so its tests take both ways.
CHUNK_FROM_TOKENS = 24 if SIMULATED else 1024

#: Tokens of a call (this rank's T) from which a route-first dispatch_async's token blocks send
#: the routing rows (each a share, before its token rows) and take the route ticket, the last
#: signalling the routing (v33), instead of its one routing block sending them all: beside 128
#: blocks storing token rows one block's stores get ~1/130 of the link, so the routing of 4,096
#: tokens (256 KB a peer) would arrive only with the token rows.
FIRST_SPLIT_TOKENS = 8 if SIMULATED else 512

#: 16-byte loads of received expert ids (four ids each) every thread of a chunk-placing block
#: issues before it counts any (``place_by_chunks``): independent loads in flight instead of
#: one latency per id, which the encoder's traffic makes long while the token rows fly. v33
#: loaded 8 single ids a batch: its counting pass was 31 us of dispatch_wait's ~100 (e4m3
#: T=4096, 8,192 received tokens, each of 4 blocks reading all 65,536 ids; session 33's trace),
#: a latency per batch; four ids to a load take 4 x fewer batches.
COUNT_QUADS = 4
COUNT_IDS = 4 * COUNT_QUADS

#: Experts the routing block ranks per pass over this rank's tokens (dispatch_async (2): shared
#: lane masks of warps x RANK_WINDOW words, 16 KB at 16 warps, and as many row words): one pass
#: for up to 256 experts on a GPU. The simulator's windows are 4 experts, so its small
#: configurations take several passes and the window arithmetic is tested on every run.
RANK_WINDOW = 4 if SIMULATED else 256

#: dispatch_async ranks its tokens in several routing blocks (the grid's last), each a chunk of
#: the tokens, so the routing (and with it the ticket) is out sooner (``route_blocks``): at most
#: this many, one per ``ROUTE_GRID_SHARE`` blocks of the grid beyond the first. The simulator
#: takes 2 from a grid of 3. Measured on one H100 at T=4096 (docs/throughput.md, "v19"): bf16
#: rows, bound by the routing with fewer, want 8 (dispatch_async 103 us with 1, 86 with 2, 75
#: with 4, 65 with 8 or 16); the FP8 encoder, bound by its SMs, wants 4 (91, 75, 75, 94, 94:
#: 124 encoding blocks leave 128 warps a third row, 128 blocks deal 4096 rows evenly).
ROUTE_BLOCKS = 2 if SIMULATED else 8
ROUTE_BLOCKS_QUANT = 2 if SIMULATED else 4
ROUTE_GRID_SHARE = 1 if SIMULATED else 12

#: Expert ids of a token loaded together, before any is used (:func:`token_destinations`):
#: independent loads in flight instead of a loop of load-then-use steps.
ID_BATCH = 8

#: Staged ranks each thread of the routing block loads before it stores any to the ranks'
#: destinations (the loads are independent; the stores, through raw addresses, would otherwise
#: wait for each load in turn).
RUN_BATCH = 8


def make_dispatch_kernels(threads: int, quantized: bool = False, ue8m0: bool = False, stores: bool = True,
                          copy_engine: bool = False, land: bool = False, place: bool = False,
                          route_first: bool = False, route_chunks: bool = False):
    """Build ``(dispatch_async, dispatch_wait, dispatch_copy, dispatch_signal, dispatch_land)`` for
    blocks of ``threads`` threads (a power of 2), for bf16 tokens or (``quantized``) an FP8 token format with float32
    or (``ue8m0``) power-of-two scales (:mod:`ep_runtime.kernels.token_codec` encodes and lays
    out the messages; the protocol below is the same for every format).

    The send path is fixed when the kernels are built, not read per call, so a build holds only
    the code its runtime runs (docs/throughput.md, "v20": dispatch_async's code was a third
    smaller and 1-5 us faster at decode sizes without the paths it never took): ``stores``,
    dispatch_async stores routing rows, ranks, counts and token rows into the peers' heaps
    through the NVLink mappings (``peer_bases``), else NVSHMEM puts; ``copy_engine``, the copy
    engine carries the token rows (bf16, with ``stores``); ``land``, dispatch_async serves
    dispatch_land (the routing signalled on its own, bf16 row parts flagged, none sent to
    this rank; not with the copy engine); ``place``, dispatch_async's routing blocks place the received rows during
    the transfer and dispatch_wait only waits for the rows (v26; with ``stores``, not with
    ``copy_engine`` or ``land``); ``route_first``, dispatch_async sends and signals the routing
    rows first and ranks nothing, and dispatch_wait, a few blocks started early by PDL, places every
    received row from the routing rows while the token rows fly (v29; with ``stores``, not with
    ``copy_engine``, ``land`` or ``place``); ``route_chunks`` (with ``route_first``), for large
    batches: from ``FIRST_SPLIT_TOKENS`` tokens the token blocks send the routing rows and the
    last of every block signals them, and from ``CHUNK_FROM_TOKENS`` received tokens each of
    dispatch_wait's few blocks ranks and describes a chunk of them (v33, ``place_by_chunks``).
    dispatch_copy and dispatch_signal do not depend on them."""
    if copy_engine and (not stores or land):
        raise ValueError("make_dispatch_kernels: copy_engine needs stores and excludes land")
    if place and (not stores or land or copy_engine):
        raise ValueError("make_dispatch_kernels: place needs stores and excludes land and copy_engine")
    if route_first and (not stores or land or copy_engine or place):
        raise ValueError("make_dispatch_kernels: route_first needs stores and excludes land, copy_engine and place")
    if route_chunks and not route_first:
        raise ValueError("make_dispatch_kernels: route_chunks needs route_first")
    warp, warps = warp_geometry(threads)
    QUANT = bool(quantized)
    STORES = bool(stores)  # peer stores (else NVSHMEM puts)
    ENGINE = bool(copy_engine)  # the copy engine carries the token rows
    LAND = bool(land)  # calls for dispatch_land
    # dispatch_async's routing blocks place the received rows while the token rows fly (v26;
    # docs/protocol.md, "Placement during the transfer"); dispatch_wait then only waits for the
    # token rows (and copies them when asked)
    EARLY = bool(place)
    # the routing rows first, signalled on their own; the receiver ranks and places from them (v29)
    FIRST = bool(route_first)
    # ... and for large batches: the token blocks send the routing rows, the placing blocks rank
    # chunks (v33; left out of a decode-size build, where the code alone cost 0.5-1 us)
    CHUNKS = FIRST and bool(route_chunks)
    encode_blocks, store_scales = make_token_codec(warp, bool(ue8m0))
    SB = 1 if ue8m0 else 4  # scale bytes per 128-element block
    U = COPY_UNROLL
    UP = U // 2  # word pairs per lane in flight
    load_pairs, store_pairs, store_pairs_at = make_pair_loops(UP, warp)
    CP = COPY_PAIRS  # copy_to_rows' word pairs per lane in flight
    WCP = WAIT_COPY_PAIRS  # ... in a route-first dispatch_wait's copy
    SW = RANK_WINDOW
    RANK_WORDS = warps * SW  # the routing block's shared masks and rows (a compile-time size)
    HELD_WORDS = warps * HELD_SCALES  # the FP8 encoder's held scales (a compile-time size)
    # the routing blocks' row words double as the placement table once the ranks are out
    ROW_WORDS = max(RANK_WORDS, PLACEMENT_WORDS) if EARLY else RANK_WORDS
    SCAN_WORDS = threads if EARLY else 1  # the placement scan's sums (int64)
    RW = RECV_WINDOW
    RECV_WORDS = warps * RW if FIRST else 1  # a route-first dispatch_wait's masks and warp rows
    RECV_NEXT = RW if FIRST else 1
    # a route-first dispatch_wait may copy the expanded layout itself (bf16 only: the FP8 scales
    # are laid out by dispatch_copy)
    FIRST_COPY = FIRST and not QUANT

    @cuda.jit(device=True)
    def padded(rows, pad_multiple):
        """``rows`` rounded up to a multiple of ``pad_multiple`` (an expert's segment size)."""
        if pad_multiple == 1:
            return rows
        return (rows + pad_multiple - 1) // pad_multiple * pad_multiple

    @cuda.jit(device=True)
    def scan_placement(d_counts, g, pad_multiple, place, scan_buf):
        """Every thread of the block: the placement table of group ``g`` in shared memory, and
        the total padded rows (returned, int64). ``place`` (shared int32, at least
        ``(R + 1) L`` words, ``config.PLACEMENT_WORDS``): ``place[s L + e]`` = the first batch
        row of source s's rows of local expert e, ``place[R L + e]`` = the end of expert e's
        received rows (its padding follows), so expert e starts at ``place[e]`` and holds
        ``place[R L + e] - place[e]`` rows.

        The counts (``d_counts[g]``, [R, L + 1] int32, each written by its source) are loaded
        once, a word per thread, into rows 1..R of the table; a thread per run of local experts
        sums its padded rows and the block scans the sums (``block_exclusive_scan``); each
        thread then turns its experts' counts into first rows in place (row s + 1 holds source
        s's count until row s takes its first row). Deterministic; every block computes it
        (none waits for another). Before v24 the counts were read from device memory in each of
        dispatch_wait's three phases (docs/throughput.md, "v24")."""
        R = d_counts.shape[1]
        L1 = d_counts.shape[2]
        L = L1 - 1
        tid = cuda.threadIdx.x
        for i in range(tid, R * L1, threads):  # coalesced: the group's counts rows are contiguous
            s = int32(udiv32(i, L1))
            e = i - s * L1
            if e < L:
                place[(s + 1) * L + e] = d_counts[g, s, e]
        cuda.syncthreads()
        per = (L + threads - 1) // threads  # local experts per thread
        e_lo = min(tid * per, L)
        e_hi = min(e_lo + per, L)
        part = int64(0)
        for e in range(e_lo, e_hi):
            rows = int64(0)
            for s in range(R):
                rows += place[(s + 1) * L + e]
            part += padded(rows, pad_multiple)
        first, total = block_exclusive_scan(scan_buf, part)
        for e in range(e_lo, e_hi):
            row = first
            for s in range(R):
                c = place[(s + 1) * L + e]
                place[s * L + e] = int32(row)
                row += c
            place[R * L + e] = int32(row)
            first += padded(row - place[e], pad_multiple)
        cuda.syncthreads()
        return total

    @cuda.jit(device=True)
    def copy_row(src, dst, W, pairs, lane, lo, hi):
        """Every lane of one warp: the first ``W`` words of row ``src`` into row ``dst``, as
        word pairs (``UP`` per lane in flight) when ``pairs``, else a word per lane per step."""
        if pairs:
            w = 2 * lane
            while w < W:
                load_pairs(src, w, W, lo, hi)
                store_pairs(dst, w, W, lo, hi)
                w += 2 * UP * warp
        else:
            for w in range(lane, W, warp):
                dst[w] = src[w]

    @cuda.jit(device=True)
    def copy_in_pairs(d_tokens, expert_x):
        """Whether received rows (``d_tokens`` [R, Tmax, W'] words) go to ``expert_x`` [C, W]
        words as word pairs (one 16-byte access for uint64 words): every row of both starts
        aligned to two words."""
        return (expert_x.shape[1] % 2 == 0 and d_tokens.shape[2] % 2 == 0 and pairs_aligned(d_tokens)
                and pairs_aligned(expert_x))

    def make_copy_to_rows(cp):
        """``copy_to_rows`` with ``cp`` word pairs per lane in flight (``COPY_PAIRS``, or
        ``WAIT_COPY_PAIRS`` in a kernel with fewer registers to spare)."""
        load_cp, store_cp, _ = make_pair_loops(cp, warp)

        @cuda.jit(device=True)
        def copy_to_rows(src, rows, n_local, expert_x, w0, w1, pairs, lane, lo, hi, vals):
            """Every lane of one warp: words ``[w0, w1)`` of the received row ``src`` into the
            ``n_local`` expert rows ``expert_x[rows[j]]``, each word loaded once: ``cp`` word
            pairs per lane in flight when ``pairs`` (w0, w1 even; lo, hi local [cp]), else ``U``
            words."""
            w = w0 + 2 * lane
            while pairs and w < w1:
                load_cp(src, w, w1, lo, hi)
                for j in range(n_local):
                    store_cp(expert_x[rows[j]], w, w1, lo, hi)
                w += 2 * cp * warp
            w = w0 + lane
            while not pairs and w < w1:
                for u in range(U):
                    if w + u * warp < w1:
                        vals[u] = src[w + u * warp]
                for j in range(n_local):
                    dst = expert_x[rows[j]]
                    for u in range(U):
                        if w + u * warp < w1:
                            dst[w + u * warp] = vals[u]
                w += U * warp

        return copy_to_rows

    copy_to_rows = make_copy_to_rows(CP)

    @cuda.jit(device=True)
    def await_sources(d_sig, g, n, timeout_ns, status, kernel, counter, src_T, flag):
        """Every thread of the block: thread s waits until source s's signal of call n is in
        (``d_sig[g, s] >= (n + 1) << 32``; its low half, the source's token count, goes to
        ``src_T[s]``, shared int32), bounded by ``timeout_ns``; a timeout is recorded naming
        ``kernel``, the source and ``counter``. The waits poll with acquire loads
        (``shmem.wait_signal_ge``) and the block then meets, so what the signals published is
        visible to every thread. Returns whether every signal was seen."""
        me = shmem.my_pe()
        if cuda.threadIdx.x == 0:
            flag[0] = 0
        cuda.syncthreads()
        want = uint64(n + 1) << uint64(SIGNAL_TOKEN_BITS)  # call n's signal, any token count
        for s in range(cuda.threadIdx.x, d_sig.shape[1], threads):
            seen = shmem.wait_signal_ge(d_sig[g, s:s + 1], want, timeout_ns)
            if seen < want:
                record_error(status, ERR_TIMEOUT, kernel, me, s, counter, n + 1,
                             int64(seen >> uint64(SIGNAL_TOKEN_BITS)), n + 1)
                flag[0] = 1
            src_T[s] = int32(seen & uint64(0xFFFFFFFF))  # stale on a timeout: unused
        cuda.syncthreads()
        ok = flag[0] == 0
        cuda.syncthreads()  # flag read by every thread before it is used again
        return ok

    @cuda.jit(device=True)
    def write_segments(place, R, L, pad_multiple, row_offsets, expert_counts, row_src_rank, row_src_token, row_src_k,
                       row_weight, row_gather, e0, stride, lane):
        """A warp per local expert (``e0``, ``e0 + stride``, ...): its offset and count (from the
        placement table ``place`` of R sources and L local experts, :func:`scan_placement` done)
        and its padding rows' descriptions (source -1, weight 0)."""
        e = e0
        while e < L:
            base = place[e]
            count = place[R * L + e] - base
            end = base + padded(count, pad_multiple)
            for r in range(base + count + lane, end, warp):
                row_src_rank[r] = -1
                row_src_token[r] = -1
                row_src_k[r] = -1
                row_weight[r] = 0.0
                row_gather[r] = -1
            if lane == 0:
                row_offsets[e] = base
                expert_counts[e] = count
            e += stride

    @cuda.jit(device=True)
    def zero_padding_rows(place, R, L, pad_multiple, expert_x, e0, stride, lane):
        """A warp per local expert (``e0``, ``e0 + stride``, ...): zero its padding rows of
        expert_x [C, W] words (the placement table ``place``, :func:`scan_placement` done)."""
        W = expert_x.shape[1]
        e = e0
        while e < L:
            base = place[e]
            count = place[R * L + e] - base
            for r in range(base + count, base + padded(count, pad_multiple)):
                for w in range(lane, W, warp):
                    expert_x[r, w] = 0
            e += stride

    @cuda.jit(device=True)
    def expert_warps(tid):
        """``(e0, stride)`` of a warp per local expert from the grid's last block down (the
        first blocks place the rows)."""
        return (cuda.gridDim.x - 1 - cuda.blockIdx.x) * warps + tid // warp, cuda.gridDim.x * warps

    @cuda.jit(device=True)
    def token_destinations(ids_at, K, L, skip, ids_l):
        """Bit d set (uint64) for every rank d holding one of a token's ``K`` experts, but not for
        the ranks set in ``skip``: the token's ids are the int32 at address ``ids_at`` (its row of
        ``topk_ids``), rank d holds experts ``[d L, (d + 1) L)``. The ids are loaded ``ID_BATCH``
        at a time into ``ids_l`` (local int32 [ID_BATCH]), all before any is used: a loop that
        loaded one id and tested it before the next load left one memory latency per id on the
        token rows' path (docs/throughput.md, "v21")."""
        sent = uint64(0)
        for k0 in range(0, K, ID_BATCH):
            for u in range(ID_BATCH):  # a constant trip count: unrolled, ids_l in registers
                if k0 + u < K:
                    ids_l[u] = int32(load_u32_at(ids_at, k0 + u))
            for u in range(ID_BATCH):
                if k0 + u < K:
                    sent |= uint64(1) << uint64(udiv32(ids_l[u], L))
        return sent & ~skip

    @cuda.jit(device=True)
    def send_prequantized(codes, scales8, b0, b1, PB, peer_bases, sent, slot, lane, lo, hi):
        """Every lane of one warp: the caller's E4M3 code words of blocks ``[b0, b1)`` (``codes``:
        the token's row of uint64 words, 16-byte aligned) and their scale bytes (``scales8``:
        the token's row of scale bytes) stored into the receive slot of every rank whose bit is
        set in ``sent``, at byte ``slot`` past ``peer_bases[PEER_TOKENS, d]``; each word pair loaded
        once. Float32 scales (``SB`` = 4) go a word per block when the caller's row is 4-byte
        aligned (the message's scales are: ``slot`` and ``PB`` are multiples of 128), else, as
        UE8M0 scales, a byte per store (v31: a byte per store cost e4m3 T=4096 ~6 us against
        UE8M0's quarter of the stores)."""
        w1 = b1 * CODE_WORDS
        w = b0 * CODE_WORDS + 2 * lane
        while w < w1:
            load_pairs(codes, w, w1, lo, hi)
            for d in range(peer_bases.shape[1]):
                if (sent >> uint64(d)) & uint64(1):
                    store_pairs_at(peer_bases[PEER_TOKENS, d] + slot, w, w1, lo, hi)
            w += 2 * UP * warp
        scales_at = slot + uint64(PB)  # uint64 + uint64 (an int64 term would make it float64)
        src_at = address_of(scales8)
        if SB == 4 and src_at % uint64(4) == uint64(0):  # a float32 scale per block, as one word
            for b in range(b0 + lane, b1, warp):
                v = load_u32_at(src_at, b)
                for d in range(peer_bases.shape[1]):
                    if (sent >> uint64(d)) & uint64(1):
                        store_u32_at(peer_bases[PEER_TOKENS, d] + scales_at, b, v)
        else:
            for j in range(b0 * SB + lane, b1 * SB, warp):
                for d in range(peer_bases.shape[1]):
                    if (sent >> uint64(d)) & uint64(1):
                        store_u8_at(peer_bases[PEER_TOKENS, d] + scales_at, j, scales8[j])

    @cuda.jit(device=True)
    def describe_row(r, s, t, k, j, Tmax, w, row_src_rank, row_src_token, row_src_k, row_weight, row_gather,
                     token_rows):
        """Write batch row ``r``'s description: token ``t`` of source ``s`` for its ``k``-th expert,
        the ``j``-th of its local experts (ascending), router weight ``w``. One thread."""
        row_src_rank[r] = s
        row_src_token[r] = t
        row_src_k[r] = k
        row_weight[r] = w
        row_gather[r] = s * Tmax + t
        token_rows[s, t, j] = r

    @cuda.jit(device=True)
    def row_of(d_ids, d_ranks, place, L, g, s, t, k, first_mine):
        """``(r, j)``: the batch row of received (source s, token t, slot k) and the rank of its
        expert among the token's local experts (ascending), or ``(-1, -1)`` when the expert is
        not local. r = the first row of source s's rows of the expert (the placement table
        ``place``, :func:`scan_placement` done) + the rank the source gave the token
        (docs/protocol.md, "Placement"). The id and the rank are loaded together."""
        x = d_ids[g, s, t, k]
        rank = d_ranks[g, s, t, k]
        e = x - first_mine
        if e < 0 or e >= L:
            return int32(-1), int32(-1)
        r = int32(place[s * L + e] + rank)
        j = int32(0)
        for k2 in range(d_ids.shape[3]):
            x2 = d_ids[g, s, t, k2]
            if x2 >= first_mine and x2 < x:
                j += 1
        return r, j

    @cuda.jit(device=True)
    def copy_warp_hits(hit, r, t, below, hits, src_rows, expert_x, W, pairs, hit_row, hit_token, lane, lo, hi):
        """Every lane of one warp: list the warp's hits in shared memory in lane order (``hit``: this
        lane's token ``t`` goes to batch row ``r``; ``below`` hits in lower lanes, ``hits`` in all),
        then copy each hit's received row, ``src_rows[t]``, to ``expert_x[r]``."""
        mine = cuda.threadIdx.x - lane  # this warp's slots in hit_row / hit_token
        if hit:
            hit_row[mine + below] = r
            hit_token[mine + below] = t
        warp_sync()
        for h in range(hits):
            copy_row(src_rows[hit_token[mine + h]], expert_x[hit_row[mine + h]], W, pairs, lane, lo, hi)
        warp_sync()  # the list is read before the warp's next step writes it

    @cuda.jit(device=True)
    def send_rank_run(src, n, R, peer_bases, ranks_at, tid, run_l):
        """Every thread of the routing block: the first ``n`` int32 of the staged ranks (the
        flat run at address ``src``: element ``t K + k``) into every rank's run at byte
        ``ranks_at`` past its ``dispatch_ranks`` (``peer_bases[PEER_RANKS, d]``): contiguous
        4-byte stores across the block, flat addresses (no per-element index arithmetic or
        division), RUN_BATCH loads in flight per thread (``run_l``) before its stores."""
        j = tid
        while j < n:
            for b in range(RUN_BATCH):  # a constant trip count: unrolled, run_l in registers
                if j + b * threads < n:
                    run_l[b] = load_u32_at(src, j + b * threads)
            for b in range(RUN_BATCH):
                if j + b * threads < n:
                    for d in range(R):
                        store_u32_at(peer_bases[PEER_RANKS, d] + ranks_at, j + b * threads, run_l[b])
            j += RUN_BATCH * threads

    @cuda.jit(device=True)
    def mark_expert(masks, el, wid, lane):
        """The routing block: set this lane's bit in its warp's mask of window expert ``el``
        (nothing outside the window ``[0, RANK_WINDOW)``)."""
        if el >= 0 and el < SW:
            cuda.atomic.or_(masks, wid * SW + el, uint32(1) << uint32(lane))

    @cuda.jit(device=True)
    def stage_rank(masks, warp_rows, el, wid, lanes_below, ranks_src, j):
        """The routing block: the rank of this lane's token among the tokens with window expert
        ``el`` (its warp's first rank plus the lanes below with the expert), staged as flat
        element ``j`` of the ranks at ``ranks_src`` (nothing outside the window)."""
        if el >= 0 and el < SW:
            m = wid * SW + el
            store_u32_at(ranks_src, j, uint32(warp_rows[m] + popc32(masks[m] & lanes_below)))

    @cuda.jit(device=True)
    def send_routing_rows(topk_ids, topk_weights, d_ids, d_weights, peer_bases, g, me, R, K, j0, j1):
        """Every thread of a block: elements ``[j0, j1)`` of this rank's routing rows (flat ``t K +
        k``: topk_ids [Tc, K] int32, topk_weights [Tc, K] float32) into ``d_ids[g, me]`` and
        ``d_weights[g, me]`` of every rank, 4-byte stores through the peer mappings (the runs are
        contiguous on both sides)."""
        ids_at = address_of(d_ids[g, me]) - address_of(d_ids)
        weights_at = address_of(d_weights[g, me]) - address_of(d_weights)
        for j in range(j0 + cuda.threadIdx.x, j1, threads):
            t = int32(udiv32(j, K))
            x = uint32(topk_ids[t, j - t * K])
            wbits = f32_bits(topk_weights[t, j - t * K])
            for d in range(R):
                store_u32_at(peer_bases[PEER_IDS, d] + ids_at, j, x)
                store_u32_at(peer_bases[PEER_WEIGHTS, d] + weights_at, j, wbits)

    @cuda.jit(device=True)
    def warp_first_ranks(masks, warp_rows, next_rank, width):
        """A thread per window expert ``el < width`` (the masks and rows are [warp, width]): each
        warp's first rank of the expert (``warp_rows``, warps in order, from ``next_rank[el]``)
        and ``next_rank[el]`` advanced past every warp's lanes with it (``masks``). The routing
        block's and the route-first dispatch_wait's ranking step."""
        for el in range(cuda.threadIdx.x, width, threads):
            r = next_rank[el]
            for w in range(warps):
                warp_rows[w * width + el] = r
                r += popc32(masks[w * width + el])
            next_rank[el] = r

    @cuda.jit(device=True)
    def send_warps(rows, all_warps):
        """The warp count dispatch_async's bf16 token loop cuts ``rows`` rows for (``row_parts``):
        ``all_warps``, or ``SEND_ROUNDS`` times it for a batch with a row for every warp, so
        each warp takes about SEND_ROUNDS items and the last round, when fewer warps still send,
        moves smaller parts (v27)."""
        if rows >= all_warps:
            return all_warps * SEND_ROUNDS
        return all_warps

    @cuda.jit(device=True)
    def route_blocks(grid, split):
        """Routing blocks of dispatch_async's grid of ``grid`` blocks: one per ROUTE_GRID_SHARE
        blocks beyond the first, at least 1, at most ROUTE_BLOCKS (bf16 rows: 8 of an H200's
        132 SMs, and of the 108 a landing call leaves itself) or ROUTE_BLOCKS_QUANT (FP8). A
        route-first call has one, which only sends the routing rows, or none when the token
        blocks send them (``split``, v33)."""
        if FIRST:
            return 0 if split else 1  # (a route-first build ranks nothing)
        return max(1, min(ROUTE_BLOCKS_QUANT if QUANT else ROUTE_BLOCKS, (grid - 1) // ROUTE_GRID_SHARE))

    @cuda.jit(device=True)
    def signal_routing(d_route, g, me, n, T, R, first, step):
        """Set ``d_route[g, me]`` on ranks ``first, first + step, ...`` below R to ``(n + 1) << 32 |
        T`` (``layout.dispatch_signal_value``): this rank's routing of call n is out. The caller
        has published the routing (a fence after its stores, or the route ticket)."""
        signal = (uint64(n + 1) << uint64(SIGNAL_TOKEN_BITS)) | uint64(T)
        for d in range(first, R, step):
            shmem.signal_op(d_route[g, me:me + 1], signal, shmem.SIGNAL_SET, d)

    @cuda.jit(device=True)
    def store_token_count(d_counts, peer_bases, g, me, R, L, T):
        """Every thread of a block: this call's T into ``d_counts[g, me, L]`` on every rank, through
        the NVLink mappings (a route-first call's routing carries it; combine reads it there)."""
        counts_at = address_of(d_counts[g, me]) - address_of(d_counts)
        for d in range(cuda.threadIdx.x, R, threads):
            store_u32_at(peer_bases[PEER_COUNTS, d] + counts_at, L, uint32(T))

    @cuda.jit(device=True)
    def publish_route(sync, flag, d_route, g, me, n, T, R, status):
        """Every thread of a block of dispatch_async in a landing call, once, when the block's
        share of the routing (routing rows; ranks and counts) is out: the route ticket
        (``last_block_ticket``: barrier, fence or quiet, ticket); the block that takes the last sets
        ``d_route[g, me]`` on every rank to ``(n + 1) << 32 | T`` and resets the ticket."""
        if last_block_ticket(sync[SYNC_ROUTE_TICKET:SYNC_ROUTE_TICKET + 1], flag, STORES):
            signal_routing(d_route, g, me, n, T, R, cuda.threadIdx.x, threads)
            if cuda.threadIdx.x == 0:
                sync[SYNC_ROUTE_TICKET] = 0
            stamp_last(status, 29)
        cuda.syncthreads()  # flag read by every thread before the next ticket reuses it

    @cuda.jit(device=True)
    def publish_route_share(sync, d_route, g, me, n, T, R, token_blocks, status):
        """One thread of each token block of a split route-first call that encodes FP8 rows
        (v34), after a barrier that ordered every thread's share of the routing rows (and block
        0's T) before it: the route ticket of :func:`publish_route` taken by this thread alone
        (system fence, ticket; the block that takes the last sets ``d_route[g, me]`` on every
        rank and resets it), so the fence's wait for the routing stores to land holds up one
        warp, not the block's token rows (v33's block-wide ticket started them 3.7 us later than
        dispatch_wait's placement does: token rows begun 7.8 against 4.1 us, e4m3 T=4096,
        session 33's trace; dispatch 111.4 -> 108.1 us there)."""
        publish_fence(True)  # a route-first build stores (STORES): the fence, cumulative over the barrier
        done = cuda.atomic.add(sync, SYNC_ROUTE_TICKET, int64(1))
        if done == token_blocks - 1:
            cuda.threadfence()
            signal_routing(d_route, g, me, n, T, R, 0, 1)
            sync[SYNC_ROUTE_TICKET] = 0
            stamp_last(status, 29)

    @cuda.jit(device=True)
    def await_credits(d_credit, n, status, timeout_ns):
        """One thread: wait until every peer granted call ``n`` its token rows (``d_credit[d]
        >= n + 1``; ``grant_token_credits``), bounded by ``timeout_ns``; a timeout is recorded
        naming ``dispatch_async``, the peer and ``dispatch_token_credit``. Returns whether every
        credit was seen. This rank's own rows need none (its stream orders its reads first)."""
        me = shmem.my_pe()
        ok = True
        for d in range(d_credit.shape[0]):
            if d != me:
                seen = shmem.wait_signal_ge(d_credit[d:d + 1], uint64(n + 1), timeout_ns)
                if seen < uint64(n + 1):
                    record_error(status, ERR_TIMEOUT, KERNEL_DISPATCH_ASYNC, me, d, COUNTER_TOKEN_CREDIT, n + 1,
                                 int64(seen), n + 1)
                    ok = False
        return ok

    @cuda.jit(device=True)
    def exchange_credits(d_credit, copy_go, n, status, timeout_ns):
        """One thread, at the start of call ``n``'s dispatch_async on the copy-engine transfer:
        wait for every peer's credit of call n, then release the side stream's copies
        (``copy_go[0] = 1``, also after a timeout, which is recorded: the copies never wait
        forever)."""
        await_credits(d_credit, n, status, timeout_ns)
        stamp_first(status, 5)
        copy_go[0] = uint32(1)
        cuda.threadfence_system()  # the stream's wait polls copy_go from outside the SMs

    @cuda.jit(device=True)
    def publish_chunk(d_chunk, rb, n, R):
        """Every thread of routing block ``rb``, once its chunk's routing (ids, weights, ranks;
        chunk 0 also the counts and T) is stored into every rank: the block meets, thread 0
        publishes (``publish_fence``: a system fence, cumulative over what the barrier ordered,
        or quiet on the puts path: data before flag, as in ``last_block_ticket``) and sets
        ``d_chunk[me, rb]`` (uint64 symmetric [R, ROUTE_CHUNKS], ``dispatch_route_chunk``) to
        ``n + 1`` on every rank."""
        me = shmem.my_pe()
        cuda.syncthreads()
        if cuda.threadIdx.x == 0:
            publish_fence(STORES)  # the chunk's routing: stores into peers, or puts
            for d in range(R):
                shmem.signal_op(d_chunk[me, rb:rb + 1], uint64(n + 1), shmem.SIGNAL_SET, d)

    @cuda.jit(device=True)
    def await_chunks(d_chunk, rb, n, timeout_ns, status, flag):
        """Every thread of routing block ``rb``: wait until every source's routing chunks 0 (the
        counts) and ``rb`` of call n are here (``d_chunk[s, c] >= n + 1``), bounded by
        ``timeout_ns``; a timeout is recorded naming ``dispatch_async``, the source and
        ``dispatch_route_chunk`` (the chunk in the observed value's high half). The waits poll
        with acquire loads and the block then meets. Returns whether every flag was seen.
        A block waits only for chunks its peers' blocks of the same or a lower index flag before
        they wait themselves, so no wait depends on a block that waits (the simulator runs a
        kernel's blocks one at a time, in order)."""
        me = shmem.my_pe()
        R = d_chunk.shape[0]
        if cuda.threadIdx.x == 0:
            flag[0] = 0
        cuda.syncthreads()
        for i in range(cuda.threadIdx.x, 2 * R, threads):
            s = i % R
            c = 0 if i < R else rb
            seen = shmem.wait_signal_ge(d_chunk[s, c:c + 1], uint64(n + 1), timeout_ns)
            if seen < uint64(n + 1):
                record_error(status, ERR_TIMEOUT, KERNEL_DISPATCH_ASYNC, me, s, COUNTER_ROUTE_CHUNK, n + 1,
                             (int64(c) << int64(32)) | int64(seen & uint64(0xFFFFFFFF)), n + 1)
                flag[0] = 1
        cuda.syncthreads()
        ok = flag[0] == 0
        cuda.syncthreads()  # flag read by every thread before it is used again
        return ok

    @cuda.jit(device=True)
    def place_chunk(d_ids, d_weights, d_counts, d_ranks, g, n, rb, n_route, row_offsets, expert_counts,
                    row_src_rank, row_src_token, row_src_k, row_weight, row_gather, token_rows, status,
                    pad_multiple, place, scan_buf):
        """Every thread of routing block ``rb`` of ``n_route``, as receiver (every source's
        chunks 0 and rb here, :func:`await_chunks`): the placement dispatch_wait made after the
        signal until v25. The block scans every expert's first row (:func:`scan_placement`,
        the same table in every routing block) and checks the capacity (routing block 0 records
        an overflow, and no block writes anything); its warps write their share of the local
        experts' segments (a warp per expert over the routing blocks' warps); and for each
        (token, k) of chunk rb of every source (the sender's cut: ``ceil(T_s / n_route)``
        tokens per chunk) whose expert is local it writes the row's description and token_rows
        entry (``describe_row``: row = the expert's first row + the expert's rows from earlier
        sources + the rank the source gave it), a thread per pair. Outputs as dispatch_wait's,
        bit for bit."""
        me = shmem.my_pe()
        R = d_counts.shape[1]
        L = d_counts.shape[2] - 1
        K = d_ids.shape[3]
        Tmax = d_ids.shape[2]
        C = row_src_rank.shape[0]
        tid = cuda.threadIdx.x
        total = scan_placement(d_counts, g, pad_multiple, place, scan_buf)
        if total > C:
            if rb == 0 and tid == 0:
                record_error(status, ERR_CAPACITY, KERNEL_DISPATCH_ASYNC, me, -1, COUNTER_RECV_ROWS, C, total, n + 1)
            return
        if rb == 0 and tid == 0:
            row_offsets[L] = total
        write_segments(place, R, L, pad_multiple, row_offsets, expert_counts, row_src_rank, row_src_token, row_src_k,
                       row_weight, row_gather, rb * warps + tid // warp, n_route * warps, tid % warp)
        first_mine = me * L
        for s in range(R):
            T_s = d_counts[g, s, L]
            chunk = (T_s + n_route - 1) // n_route
            c0 = min(rb * chunk, T_s)
            c1 = min(c0 + chunk, T_s)
            # a thread per (token, k), as dispatch_wait (tried: a thread per token, its pairs in
            # turn: 12.7 us instead of 6.7 at T=128, 33 instead of 37 at T=4096; 2 x H200)
            for p in range(c0 * K + tid, c1 * K, threads):
                t = int32(udiv32(p, K))
                k = p - t * K
                weight = d_weights[g, s, t, k]  # loaded beside row_of's id and rank
                r, j = row_of(d_ids, d_ranks, place, L, g, s, t, k, first_mine)
                if r >= 0:
                    describe_row(r, s, t, k, j, Tmax, weight, row_src_rank, row_src_token, row_src_k, row_weight,
                                 row_gather, token_rows)

    @kernel_jit(threads)
    def dispatch_async(tokens, topk_ids, topk_weights, valid_tokens, use_valid,
                       d_tokens, d_ids, d_weights, d_counts, d_ranks, d_signal,
                       sync, send_ranks, send_counts, status,
                       token_scales, prequantized, stage64, stage8, d_tokens8, peer_bases,
                       d_credit, copy_go, timeout_ns, d_route, d_row_flag, d_chunk, row_offsets, expert_counts,
                       row_src_rank, row_src_token, row_src_k, row_weight, row_gather, token_rows, pad_multiple):
        """Send this rank's tokens, once per destination rank, and signal each destination.

        tokens [Tc, W] words, topk_ids [Tc, K] int32, topk_weights [Tc, K] float32: this rank's
        batch; its first T rows are sent, T = Tc, or ``min(Tc, valid_tokens[0])`` when
        use_valid (int64) is nonzero (valid_tokens [1] int32 on the device: one CUDA graph
        captured at capacity serves any batch size). Symmetric: d_tokens [R, Tmax, W] (no
        group axis: see below), d_ids/d_weights/d_ranks [G, R, Tmax, K], d_counts [G, R, L + 1] int32, d_signal [G, R]
        uint64 (set to ``(n + 1) << 32 | T``: ``layout.dispatch_signal_value``).
        Local: sync [2] int64, send_ranks [Tmax, K] int32 (the ranks, staged), send_counts
        [R, L + 1] int32 (staging of the counts rows, puts path), status [8] int64. FP8 token
        formats only (empty otherwise):
        token_scales [Tc, S * SB] uint8 (the caller's scales' bytes, when prequantized, int64,
        is nonzero: then tokens are [Tc, P] code words), the message stage [Tmax, MW] as
        uint64 and uint8 views (stage64/8); d_tokens is then [R, Tmax, MW]
        messages, d_tokens8 their uint8 view. peer_bases [P, R] uint64: the address of each of
        ``layout.PEER_REGIONS`` on each PE as mapped here (``Session.peer_addresses``), used
        by a ``stores`` build.

        Token rows have one buffer (no group axis: a compact batch's ``x`` is the same memory
        every call, so one CUDA graph serves every step), guarded by credits: block 0 first
        grants every peer this call (``grant_token_credits``: d_credit, uint64 symmetric [R],
        ``d_credit[d] >= n + 1`` once rank d has finished reading its rows of earlier calls;
        combine_async grants the next call earlier), and no block stores a token row into a
        peer before that peer's credit of call n is seen (``await_credits``, bounded by
        timeout_ns; a timeout is recorded naming the peer and ``dispatch_token_credit``, and
        the blocks then send nothing more, so no signal goes out).

        A ``copy_engine`` build: the copy-engine transfer (bf16 tokens; docs/protocol.md,
        "Copy-engine transfer"). The host has enqueued, on a side stream, a copy of the
        token rows into every peer's slot, held until ``copy_go[0]`` (uint32, local) is 1:
        block 0 sets it once every credit is seen (always, also after a timeout, so the side
        stream never hangs); the token blocks store each row to this rank only; and the ticket
        does not signal (``dispatch_signal`` does, after the copies).

        The grid's last ``route_blocks`` blocks are routing blocks, each ranking a chunk of the
        tokens (with one block, block 0 is both); the others are token blocks.
        (1) The token blocks send every token's routing row (ids and weights) to every rank,
        then each of their warps takes items (grid-strided): part of token row t (``row_parts``:
        whole rows for large batches) and puts it into slot [me, t] of every rank that holds
        one of the token's experts (``token_destinations``: the token's ids loaded together).
        A ``stores`` build stores through the NVLink mappings, each word loaded once for all
        destinations: 16-byte word pairs where the rows allow it (uint64 words, 16-byte
        aligned), else a word per lane per step; a puts build, ``put_nbi_warp`` (a warp-wide
        copy) per destination. In an FP8 format a part
        is a run of 128-element blocks: with stores the warp encodes it straight into
        every destination's slot (``encode_blocks``: 8 lanes a block, 16-byte stores of 16
        codes, the blocks' scales; pre-quantized input: ``send_prequantized``, the caller's code word pairs and
        scale bytes); otherwise it encodes it into stage row t, then puts its codes and its
        scale bytes (pre-quantized input: straight from the caller's arrays, no stage). The
        message's padding is never sent.
        (2) The routing blocks, beside them, rank every (token, k): its rank among this rank's
        tokens with expert ``topk_ids[t, k]``, in token order, staged in send_ranks and then
        sent to every rank (``d_ranks[g, me]``: contiguous stores, so the blocks' share of the
        busy links carries 4 bytes per rank, not a 32-byte sector each). Routing block b ranks
        chunk b of the tokens, starting from the count of each expert's tokens before the chunk
        (a shared-memory histogram of their ids), so no block waits for another; the last
        chunk's block counts each expert's tokens (``d_counts[g, me, :L]`` on each rank, with T
        at ``[g, me, L]``), so dispatch_wait places every row without a scan over tokens
        (docs/protocol.md, "Placement"). Experts go in windows of ``RANK_WINDOW``; within a
        window the tokens go in rounds of a token per thread: each lane sets its bit in its
        warp's shared mask of each of its token's experts (atomic OR), a thread per expert turns
        the masks into each warp's first rank, and a lane's rank is that plus the mask's bits
        below it. No atomic decides a rank (the OR's result does not depend on its order).
        (3) The last block (ticket) signals every rank (every block fenced first, or quieted
        where it put: data before signal; the value is ``(n + 1) << 32 | T``) and advances the
        call counter.
        (4) A ``place`` build (v26, docs/protocol.md,
        "Placement during the transfer"): the routing blocks send their chunk's routing rows
        themselves (the token blocks send none, so token rows start at once), block 0 of them
        counts every expert's tokens, and each flags its chunk on every rank once its routing
        is there (``publish_chunk``: d_chunk [R, ROUTE_CHUNKS] uint64 symmetric,
        ``dispatch_route_chunk``, ``[me, rb]`` = n + 1). After its ticket (the signal never
        waits for what follows), routing block rb waits for chunks 0 and rb of every source
        (``await_chunks``, bounded by timeout_ns) and places them as receiver
        (``place_chunk``): the outputs dispatch_wait used to write after the signal, row_offsets
        [L + 1], expert_counts [L], row_src_rank / row_src_token / row_src_k [C] int32,
        row_weight [C] float32, row_gather [C] int32 and token_rows [R, Tmax, K] int32, with
        padding to pad_multiple (int64), written while the token rows fly. The kernel then
        completes only once the peers' routing is here (bounded). Otherwise nobody waits. With stores, the routing rows, ranks and counts are 4-byte stores
        into the peers' regions and (3) is one ``signal_op`` per rank; otherwise NVSHMEM block
        puts (ranks and counts from the staging), and (3) one ``put_signal`` per rank carrying
        its counts row.

        A ``land`` build: landing calls (docs/protocol.md, "Dispatch rows as they land";
        not with the copy engine). Each block, once its share of the routing is out (a token
        block after (1a), a routing block after (2); on the puts path the last puts the counts
        rows first), fences (quiets on the puts path) and takes the route ticket
        (``sync[SYNC_ROUTE_TICKET]``); the last sets d_route [G, R] uint64 (symmetric,
        ``dispatch_route_signal``) ``[g, me]`` on every rank to ``(n + 1) << 32 | T``, before the
        token rows are all out, so the receiver's dispatch_land places rows while they fly. With
        bf16 tokens each row is cut into the parts of ``flag_rule(T, W, DISPATCH_FLAG_PARTS)``
        (every receiver cuts alike from T) and each part, once stored into a rank, is flagged
        there (d_row_flag [R, Tmax, DISPATCH_FLAG_PARTS] uint64 symmetric, ``[me, t, p]`` set to
        n + 1 after a system fence; on the puts path ``put_signal_nbi_warp``); a bf16 row is not
        sent to this rank at all (v28: dispatch_land reads it from ``tokens``). The ticket and
        the signal of (3) are unchanged. This kernel triggers its dependents after its own
        dependency wait, so a dispatch_land started early finds everything before it complete.

        A ``route_first`` build (v29, docs/protocol.md, "Route first"): one routing block, which
        (2') stores the routing rows (ids, weights) and T (``d_counts[g, me, L]``, read by
        combine) into every rank and, after a system fence, sets ``d_route[g, me]`` on every rank to
        ``(n + 1) << 32 | T``; nothing is ranked or counted here (each receiver's dispatch_wait
        places from the routing rows alone), and the token blocks send no routing rows. The
        token rows, the ticket and the signal of (3) are unchanged. A ``route_chunks`` build
        (v33), in a call of FIRST_SPLIT_TOKENS tokens or more, has no routing block instead: the
        token blocks send the routing rows (1a), block 0 stores T, and each takes the route ticket
        (``publish_route``), the last setting ``d_route[g, me]`` on every rank, so the routing
        is not left to one block's share of the busy links; where it encodes FP8 rows (v34) the
        block meets once and one thread takes the ticket (``publish_route_share``) while the
        others start their token rows.
        """
        flag = cuda.shared.array(1, int32)
        masks = cuda.shared.array(RANK_WORDS, uint32)  # (2): [warp, expert] lanes with the expert
        warp_rows = cuda.shared.array(ROW_WORDS, int32)  # (2): [warp, expert] the warp's first rank; (4): placement
        scan_sums = cuda.shared.array(SCAN_WORDS, int64)  # (4): the placement scan's scratch
        next_rank = cuda.shared.array(SW, int32)  # (2): [expert] the next round's first rank
        lo = cuda.local.array(UP, uint64)
        hi = cuda.local.array(UP, uint64)
        run_l = cuda.local.array(RUN_BATCH, uint32)  # (2): ranks loaded before they are stored
        ids_l = cuda.local.array(ID_BATCH, int32)  # (1): a token's expert ids
        pdl.dependency_wait()  # nothing stream-ordered is read before this (kernels/pdl.py)
        pdl.trigger_dependents()  # after the wait: a dispatch_land started now finds all before this complete
        # the prologue's loads issued together, before the first branch on any of them (one
        # memory latency for all, not one each; ``n < 0`` never holds: it keeps the compiler
        # from sinking the counter's load past the early return)
        code = status[STATUS_CODE]
        n = sync[SYNC_CALLS]
        T = tokens.shape[0]
        if use_valid != 0:
            T = max(0, min(T, valid_tokens[0]))
        if code != 0 or n < 0:
            if ENGINE and cuda.blockIdx.x == 0 and cuda.threadIdx.x == 0:
                copy_go[0] = uint32(1)  # releases the copies (they write rows no one will read)
                cuda.threadfence_system()
            return  # an earlier call failed: send nothing, so peers time out naming this rank
        stamp_first(status, 0)
        stamp_last(status, 30)
        if cuda.blockIdx.x == 0 and cuda.threadIdx.x == 0:
            grant_token_credits(d_credit, n)
            if ENGINE:
                exchange_credits(d_credit, copy_go, n, status, timeout_ns)
        if ENGINE and status[STATUS_CODE] != 0:
            return  # a peer's credit timed out (block 0 recorded it): send nothing more
        me = shmem.my_pe()
        R = d_counts.shape[1]
        L = d_counts.shape[2] - 1
        K = topk_ids.shape[1]
        W = tokens.shape[1]
        tid = cuda.threadIdx.x
        g = n % 2
        ids_base = address_of(topk_ids)  # [Tc, K] C-contiguous: (t, k) is flat element t K + k
        by_engine = uint64(0) if not ENGINE else ~(uint64(1) << uint64(me))  # destinations the copy engine serves
        meta_stores = STORES  # routing rows, ranks, counts: 4-byte stores into peers
        route = LAND  # landing call: the routing is signalled on its own (route ticket)
        flag_rows = route and not QUANT  # ... and the bf16 rows part by part
        # ... but none to this rank: dispatch_land reads its own rows from the caller's tokens (v28)
        own_skip = uint64(1) << uint64(me) if flag_rows else uint64(0)
        # a chunked route-first call of FIRST_SPLIT_TOKENS or more: no routing block, the token
        # blocks send the routing rows and take the route ticket (v33)
        split = CHUNKS and T >= FIRST_SPLIT_TOKENS
        # ... FP8 rows encoded here: each block's share published by one thread (v34), so the
        # fence holds up one warp, not the block's token rows; rows that are only copied (bf16,
        # pre-quantized FP8) flood the SM's stores at once, and a fence behind them held the
        # routing back (pre-quantized T=1024 dispatch 49.4 -> 52.6-56.3 us): the block's ticket
        share_route = split and QUANT and prequantized == 0
        n_route = route_blocks(cuda.gridDim.x, split)  # routing blocks: the grid's last
        token_blocks = max(cuda.gridDim.x - n_route, 1)
        rb = cuda.blockIdx.x - (cuda.gridDim.x - n_route)  # this block's routing chunk (< 0: none)
        routing_block = rb >= 0

        # (1a) routing rows (ids, weights) to every rank, spread over the token blocks (placing
        # builds: each routing block sends its chunk's, see (2); route-first: the routing block,
        # see (2'), unless the call is split)
        if cuda.blockIdx.x < token_blocks and not EARLY and (split or not FIRST):
            if meta_stores:  # rows 0..T are contiguous on both sides: element j of the run
                ids_at = address_of(d_ids[g, me]) - address_of(d_ids)
                weights_at = address_of(d_weights[g, me]) - address_of(d_weights)
                for j in range(cuda.blockIdx.x * threads + tid, T * K, token_blocks * threads):
                    t = j // K
                    k = j - t * K
                    x = uint32(topk_ids[t, k])
                    wbits = f32_bits(topk_weights[t, k])
                    for d in range(R):
                        store_u32_at(peer_bases[PEER_IDS, d] + ids_at, j, x)
                        store_u32_at(peer_bases[PEER_WEIGHTS, d] + weights_at, j, wbits)
            else:
                per = (T + token_blocks - 1) // token_blocks
                t0 = min(cuda.blockIdx.x * per, T)
                t1 = min(t0 + per, T)
                if t0 < t1:
                    for d in range(R):
                        shmem.put_nbi_block(d_ids[g, me, t0:t1], topk_ids[t0:t1], d)
                        shmem.put_nbi_block(d_weights[g, me, t0:t1], topk_weights[t0:t1], d)
        if split and cuda.blockIdx.x == 0:  # T into every rank's counts row (combine reads it there)
            store_token_count(d_counts, peer_bases, g, me, R, L, T)
        stamp_last(status, 4)
        if (route or (split and not share_route)) and cuda.blockIdx.x < token_blocks and not routing_block:
            publish_route(sync, flag, d_route, g, me, n, T, R, status)  # this block's share of the routing is out
        if share_route:
            cuda.syncthreads()  # every thread's routing rows stored before one thread publishes them (below)

        # every peer's credit of call n before any token row goes to it (the copy engine's
        # block 0 waited above; a block without token rows, or with only its own, need not)
        if not ENGINE and cuda.blockIdx.x < token_blocks and T > 0 and R > 1:
            if cuda.threadIdx.x == 0:
                flag[0] = int32(await_credits(d_credit, n, status, timeout_ns))
                stamp_first(status, 5)
            cuda.syncthreads()
            if flag[0] == 0:
                return  # a peer's credit timed out (recorded): no token row, no ticket, no signal
            cuda.syncthreads()  # flag read by every thread before the ticket reuses it

        # an encoding split call's routing share: published by the last warp's first thread (the
        # fence waits for its stores to land) while the other warps go on to the token rows
        if share_route and cuda.blockIdx.x < token_blocks and tid == threads - warp:
            publish_route_share(sync, d_route, g, me, n, T, R, token_blocks, status)

        # (1) token rows, deduplicated per destination rank, a warp per row part, in the token blocks
        if cuda.blockIdx.x < token_blocks:
            stamp_last(status, 31)
        all_warps = token_blocks * warps
        stores_only = STORES  # the token rows go as plain stores (the ticket's fence: publish_fence)
        if QUANT:  # a warp per part of a token (a run of 128-element blocks): encode once, put to each rank
            mbuf = cuda.shared.array(threads, int64)  # the simulator's warp-max scratch
            held = cuda.shared.array(HELD_WORDS, uint32)  # each warp's part's scales (HELD_SCALES)
            h0 = (tid // warp) * HELD_SCALES
            lane = tid % warp
            if prequantized != 0:
                S = tokens.shape[1] // CODE_WORDS
            else:
                S = tokens.shape[1] // BLOCK_WORDS
            PB = S * CODE_WORDS * 8  # code bytes of a message (= H)
            parts = row_parts(T, S, all_warps, 1)  # (finer cuts measured slower here: SEND_ROUNDS)
            span = part_words(S, parts, 1)  # blocks per part
            # straight into peers' slots (16-byte stores): encoded, or the caller's codes (word pairs)
            src_pairs = pairs_aligned(tokens)  # rows of whole word pairs (messages and bf16 blocks)
            direct = STORES and (prequantized == 0 or src_pairs)
            stores_only = direct  # else staged or the caller's codes go by puts
            i = cuda.blockIdx.x * warps + tid // warp
            while cuda.blockIdx.x < token_blocks and i < T * parts:
                t, b0, b1 = part_bounds(i, parts, span, S)
                if b0 < b1:
                    sent = token_destinations(ids_base + uint64(4 * t * K), K, L, uint64(0), ids_l)  # bit d: to rank d
                    if direct:
                        slot = address_of(d_tokens[me, t]) - address_of(d_tokens)  # the same on every PE
                        if prequantized == 0:
                            encode_blocks(tokens, t, b0, b1, src_pairs, uint64(0), PB, lane, mbuf, peer_bases, sent,
                                          slot, held, h0)
                        else:
                            send_prequantized(tokens[t], token_scales[t], b0, b1, PB, peer_bases, sent, slot, lane,
                                              lo, hi)
                    else:
                        if prequantized == 0:
                            encode_blocks(tokens, t, b0, b1, src_pairs, address_of(stage64[t]), PB, lane, mbuf,
                                          peer_bases, uint64(0), uint64(0), held, h0)
                            warp_sync()  # the part is staged before the warp's puts read it
                        for d in range(R):
                            if (sent >> uint64(d)) & uint64(1):
                                dst_codes = d_tokens[me, t, b0 * CODE_WORDS:b1 * CODE_WORDS]
                                dst_scales = d_tokens8[me, t, PB + b0 * SB:PB + b1 * SB]
                                if prequantized == 0:
                                    shmem.put_nbi_warp(dst_codes, stage64[t, b0 * CODE_WORDS:b1 * CODE_WORDS], d)
                                    shmem.put_nbi_warp(dst_scales, stage8[t, PB + b0 * SB:PB + b1 * SB], d)
                                else:  # straight from the caller's arrays
                                    shmem.put_nbi_warp(dst_codes, tokens[t, b0 * CODE_WORDS:b1 * CODE_WORDS], d)
                                    shmem.put_nbi_warp(dst_scales, token_scales[t, b0 * SB:b1 * SB], d)
                i += all_warps
            T_parts = 0  # no bf16 row parts
        else:
            T_parts = T
        parts = row_parts(T_parts, W, send_warps(T_parts, all_warps), warp)
        span = part_words(W, parts, warp)
        if flag_rows:  # the receivers cut rows alike from T (dispatch_land)
            parts, span = flag_rule(T_parts, W, DISPATCH_FLAG_PARTS, warp)
        direct = (STORES and tokens.itemsize == 8 and W % 2 == 0 and pairs_aligned(tokens)
                  and pairs_aligned(d_tokens))
        lane = tid % warp
        i = cuda.blockIdx.x * warps + tid // warp
        while cuda.blockIdx.x < token_blocks and i < T_parts * parts:
            t, w0, w1 = part_bounds(i, parts, span, W)
            if w0 < w1:
                # bit d: this part goes to rank d (by these warps, not the copy engine)
                sent = token_destinations(ids_base + uint64(4 * t * K), K, L, by_engine | own_skip, ids_l)
                p = i - t * parts
                src = tokens[t]
                if sent == 0:
                    pass  # a landing build's row for this rank only (dispatch_land copies it)
                elif not STORES:  # an NVSHMEM put per destination (landing: the part's flag travels with it)
                    for d in range(R):
                        if (sent >> uint64(d)) & uint64(1):
                            if flag_rows:
                                shmem.put_signal_nbi_warp(d_tokens[me, t, w0:w1], src[w0:w1],
                                                          d_row_flag[me, t, p:p + 1], uint64(n + 1),
                                                          shmem.SIGNAL_SET, d)
                            else:
                                shmem.put_nbi_warp(d_tokens[me, t, w0:w1], src[w0:w1], d)
                else:
                    slot = address_of(d_tokens[me, t]) - address_of(d_tokens)  # the same on every PE
                    if direct:  # UP word pairs per lane loaded once, stored to every destination
                        w = w0 + 2 * lane
                        while w < w1:
                            load_pairs(src, w, w1, lo, hi)
                            for d in range(R):
                                if (sent >> uint64(d)) & uint64(1):
                                    store_pairs_at(peer_bases[PEER_TOKENS, d] + slot, w, w1, lo, hi)
                            w += 2 * UP * warp
                    else:  # rows without 16-byte word pairs: a word per lane per step, loaded once
                        for w in range(w0 + lane, w1, warp):
                            v = src[w]
                            for d in range(R):
                                if (sent >> uint64(d)) & uint64(1):
                                    store_word_at(peer_bases[PEER_TOKENS, d] + slot, w, v)
                    if flag_rows:  # the part is in every destination: flag it there
                        flag_part(d_row_flag, me, t, p, n, sent, lane)
            i += all_warps

        stamp_last(status, 1)

        # (2') a route-first build's routing block: the routing rows (ids, weights) to every rank,
        # T into every rank's counts row, then the route signal (nothing is ranked here: each
        # receiver's dispatch_wait ranks and places from the routing rows, v29)
        if routing_block and FIRST:
            send_routing_rows(topk_ids, topk_weights, d_ids, d_weights, peer_bases, g, me, R, K, 0, T * K)
            store_token_count(d_counts, peer_bases, g, me, R, L, T)  # (combine reads it there)
            cuda.syncthreads()
            if tid == 0:  # data before signal: the system fence is cumulative over the barrier
                publish_fence(True)  # the routing rows and T: stores into peers
                signal_routing(d_route, g, me, n, T, R, 0, 1)
            stamp_last(status, 29)

        # (2) the routing block(s): each (token, k)'s rank among this rank's tokens to its expert,
        # stored on the expert's rank, and each expert's token count, stored on its rank
        if routing_block and not FIRST:
            chunk = (T + n_route - 1) // n_route  # this block ranks tokens [c0, c1)
            c0 = min(rb * chunk, T)
            c1 = min(c0 + chunk, T)
            # the block that counts every expert's tokens: the last chunk's (it knows them after
            # ranking), or in a placing build the first's (it counts the tokens after its chunk
            # too), so a receiver's chunk-rb placement waits only for chunks 0 and rb
            counts_here = rb == 0 if EARLY else rb == n_route - 1
            E = R * L
            lane = tid % warp
            wid = tid // warp
            lanes_below = (uint32(1) << uint32(lane)) - uint32(1)
            ranks_at = address_of(d_ranks[g, me]) - address_of(d_ranks)  # element t * K + k of the run
            counts_at = address_of(d_counts[g, me]) - address_of(d_counts)
            if EARLY:  # the chunk's routing rows (ids, weights) to every rank
                send_routing_rows(topk_ids, topk_weights, d_ids, d_weights, peer_bases, g, me, R, K, c0 * K, c1 * K)
            ranks_src = address_of(send_ranks)  # likewise [Tmax, K]
            for w0 in range(0, E, SW):
                for el in range(tid, SW, threads):
                    next_rank[el] = 0
                for m in range(tid, RANK_WORDS, threads):
                    masks[m] = uint32(0)
                cuda.syncthreads()
                for j in range(tid, c0 * K, threads):  # tokens before the chunk: each expert's first rank
                    el = int32(load_u32_at(ids_base, j)) - w0
                    if el >= 0 and el < SW:
                        cuda.atomic.add(next_rank, el, int32(1))
                cuda.syncthreads()
                for tb in range(c0, c1, threads):
                    if tb > c0:  # a later round: clear the masks the last one set (read by all: its last barrier)
                        for m in range(tid, RANK_WORDS, threads):
                            masks[m] = uint32(0)
                        cuda.syncthreads()
                    t = tb + tid
                    valid = t < c1
                    # this lane's bit in its warp's mask of each of its token's experts in the window
                    if valid:
                        for k in range(K):
                            mark_expert(masks, int32(load_u32_at(ids_base, t * K + k)) - w0, wid, lane)
                    cuda.syncthreads()
                    warp_first_ranks(masks, warp_rows, next_rank, SW)
                    cuda.syncthreads()
                    # each (token, k)'s rank: its warp's first rank plus the lanes below with the expert
                    if valid:
                        for k in range(K):
                            stage_rank(masks, warp_rows, int32(load_u32_at(ids_base, t * K + k)) - w0, wid,
                                       lanes_below, ranks_src, t * K + k)
                    cuda.syncthreads()  # every mask read before the next round (or window) clears it
                if EARLY and counts_here:  # the tokens after the chunk: every expert's total
                    for j in range(c1 * K + tid, T * K, threads):
                        el = int32(load_u32_at(ids_base, j)) - w0
                        if el >= 0 and el < SW:
                            cuda.atomic.add(next_rank, el, int32(1))
                    cuda.syncthreads()
                # the window's counts, each to its expert's rank
                for el in range(tid, SW if counts_here else 0, threads):
                    x = w0 + el
                    if x < E:
                        d = x // L
                        if meta_stores:
                            store_u32_at(peer_bases[PEER_COUNTS, d] + counts_at, x - d * L, uint32(next_rank[el]))
                        else:
                            send_counts[d, x - d * L] = next_rank[el]
                cuda.syncthreads()  # next_rank read before the next window resets it
            for d in range(tid, R if counts_here else 0, threads):  # T, even when 0
                if meta_stores:
                    store_u32_at(peer_bases[PEER_COUNTS, d] + counts_at, L, uint32(T))
                else:
                    send_counts[d, L] = T
            cuda.syncthreads()  # the ranks are staged before the block sends them
            stamp_last(status, 19)
            if meta_stores:  # the staged run of the chunk to every rank, 128 bytes per warp store
                send_rank_run(ranks_src + uint64(4 * c0 * K), (c1 - c0) * K, R, peer_bases,
                              ranks_at + uint64(4 * c0 * K), tid, run_l)
            elif c1 > c0:
                for d in range(R):
                    shmem.put_nbi_block(d_ranks[g, me, c0:c1], send_ranks[c0:c1], d)
            if route:
                if not meta_stores and counts_here:  # the counts rows before the route signal (its quiet)
                    for d in range(R):
                        shmem.put_nbi_block(d_counts[g, me], send_counts[d], d)
                publish_route(sync, flag, d_route, g, me, n, T, R, status)
            if EARLY:
                publish_chunk(d_chunk, rb, n, R)
                stamp_last(status, 32)
        stamp_last(status, 2)

        # (3) the last block signals every rank (with its counts row, on the puts path), then
        # advances the call counter
        if last_block_ticket(sync[SYNC_TICKET:SYNC_TICKET + 1], flag, stores_only):
            stamp_last(status, 3)
            signal = (uint64(n + 1) << uint64(SIGNAL_TOKEN_BITS)) | uint64(T)  # layout.dispatch_signal_value
            for d in range(tid, R if not ENGINE else 0, threads):  # copy engine: dispatch_signal signals
                if meta_stores:
                    shmem.signal_op(d_signal[g, me:me + 1], signal, shmem.SIGNAL_SET, d)
                else:
                    shmem.put_signal(d_counts[g, me], send_counts[d], d_signal[g, me:me + 1], signal,
                                     shmem.SIGNAL_SET, d)
            if tid == 0:
                sync[SYNC_TICKET] = 0
                sync[SYNC_CALLS] = n + 1
            stamp_last(status, 6)

        # (4) placing builds: the routing blocks, their ticket taken (so the signal never waits
        # for this), place the rows every source sends here, chunk by chunk, while the token rows
        # fly; this kernel completes when they are placed, and dispatch_wait, which waits for it,
        # then only waits for the token rows
        if EARLY and routing_block:
            cuda.syncthreads()  # the ticket's flag read by every thread before await_chunks reuses it
            if await_chunks(d_chunk, rb, n, timeout_ns, status, flag):
                stamp_last(status, 33)
                place_chunk(d_ids, d_weights, d_counts, d_ranks, g, n, rb, n_route, row_offsets, expert_counts,
                            row_src_rank, row_src_token, row_src_k, row_weight, row_gather, token_rows, status,
                            pad_multiple, warp_rows, scan_sums)
                stamp_last(status, 34)

    @kernel_jit(threads)
    def dispatch_signal(tokens, valid_tokens, use_valid, d_signal, sync, status):
        """The copy-engine transfer's signal: every rank's ``d_signal[g, me]`` set to
        ``(n + 1) << 32 | T`` for call n = ``sync[SYNC_CALLS] - 1`` (dispatch_async advanced
        it), T as dispatch_async counts it (tokens [Tc, W]: Tc, or ``min(Tc,
        valid_tokens[0])`` when use_valid). Enqueued after dispatch_async and the side
        stream's copies (the host joins the streams), so everything of the call has landed
        on every rank. Nothing if an error was recorded (peers then time out naming this
        rank). One block; thread d signals rank d. Launched without PDL (its predecessor
        includes the join, an event wait), so the wait below returns at once; kept so that
        every kernel reads stream-ordered data only after it."""
        pdl.trigger_dependents()
        pdl.dependency_wait()
        if status[STATUS_CODE] != 0:
            return
        me = shmem.my_pe()
        R = d_signal.shape[1]
        T = tokens.shape[0]
        if use_valid != 0:
            T = max(0, min(T, valid_tokens[0]))
        n = sync[SYNC_CALLS] - 1
        g = n % 2
        signal = (uint64(n + 1) << uint64(SIGNAL_TOKEN_BITS)) | uint64(T)  # layout.dispatch_signal_value
        cuda.threadfence_system()
        if cuda.blockIdx.x == 0:
            for d in range(cuda.threadIdx.x, R, threads):
                shmem.signal_op(d_signal[g, me:me + 1], signal, shmem.SIGNAL_SET, d)
        stamp_last(status, 7)

    @cuda.jit(device=True)
    def await_placed(d_signal, land_sync, recv_tokens, combine_claims, status, timeout_ns, src_items, flag):
        """dispatch_wait of a placing build (v27), every thread, before the kernel's dependency
        wait: started early by PDL (as soon as every block of dispatch_async has started, on
        an SM it leaves; the runtime launches one block), block 0 waits for every source's
        dispatch signal while the token rows still fly and writes recv_tokens, so the kernel
        completes as soon as dispatch_async does. It reads nothing dispatch_async writes: the
        call number is ``land_sync[LAND_CALLS]`` (advanced here by the previous call's
        dispatch_wait, which completed before this call's dispatch_async started), and an
        error recorded by an earlier call stops it. A timeout names dispatch_wait and the
        dispatch signal of the silent source, as in the other builds."""
        if cuda.blockIdx.x != 0:
            return
        code = status[STATUS_CODE]
        n = land_sync[LAND_CALLS]
        if code != 0:
            return
        stamp_first(status, 8)
        stamp_last(status, 23)
        g = n % 2
        if cuda.threadIdx.x == 0:
            combine_claims[g] = 0  # rows this call's combine_wait claims (its last user, call n - 2, is done)
        if not await_sources(d_signal, g, n, timeout_ns, status, KERNEL_DISPATCH_WAIT, COUNTER_DISPATCH_SIGNAL,
                             src_items, flag):
            return
        stamp_first(status, 15)
        stamp_last(status, 9)
        for s in range(cuda.threadIdx.x, d_signal.shape[1], threads):
            recv_tokens[s] = src_items[s]
        if cuda.threadIdx.x == 0:
            land_sync[LAND_CALLS] = n + 1  # this call's number, read by the next call's dispatch_wait
        stamp_last(status, 11)

    @cuda.jit(device=True)
    def token_of(q, src_T, R):
        """``(s, t)``: received token ``q`` of every source's tokens in order (source 0's first;
        ``src_T`` [R] shared int32, each source's T)."""
        s = 0
        while s < R - 1 and q >= src_T[s]:
            q -= src_T[s]
            s += 1
        return s, q

    @cuda.jit(device=True)
    def load_token(d_ids, d_weights, g, s, t, K, ids_l, w_l):
        """The first ``ID_BATCH`` expert ids and weights of received token (s, t) into ``ids_l`` /
        ``w_l`` (local), all loaded before any is used (one memory latency, not one per id: a
        loop that marked each id before loading the next took 17 us at T=128, v29). The loops
        that use them are unrolled too (constant indices: registers); indexed at run time they
        live in local memory, and that build was 2.8-5.6 us slower at T=1-128 (v29)."""
        for u in range(ID_BATCH):  # a constant trip count: unrolled, the arrays in registers
            if u < K:
                ids_l[u] = d_ids[g, s, t, u]
                w_l[u] = d_weights[g, s, t, u]

    @cuda.jit(device=True)
    def mark_window(masks, x, x0, wid, lane):
        """Set this lane's bit in its warp's mask of expert ``x`` (global id) if it is in the
        window ``[x0, x0 + RECV_WINDOW)``."""
        el = x - x0
        if el >= 0 and el < RW:
            cuda.atomic.or_(masks, wid * RW + el, uint32(1) << uint32(lane))

    @cuda.jit(device=True)
    def rank_round(d_ids, g, s, t, K, valid, ids_l, x0, masks, warp_rows, next_rank, wid, lane):
        """Every thread of a route-first dispatch_wait, one round of a received token per thread
        (``valid``: this thread has one, (s, t), its first ids in ``ids_l``): the lane sets its
        bit in its warp's mask of each of its token's experts in the window ``[x0, x0 +
        RECV_WINDOW)`` (global ids), then a thread per window expert turns the masks into each
        warp's first rank (``warp_rows``, from ``next_rank``, which it advances past the round).
        Three barriers; the masks and warp rows stay valid until the next round."""
        tid = cuda.threadIdx.x
        for m in range(tid, RECV_WORDS, threads):
            masks[m] = uint32(0)
        cuda.syncthreads()
        if valid:
            for u in range(ID_BATCH):
                if u < K:
                    mark_window(masks, ids_l[u], x0, wid, lane)
            for k in range(ID_BATCH, K):
                mark_window(masks, d_ids[g, s, t, k], x0, wid, lane)
        cuda.syncthreads()
        warp_first_ranks(masks, warp_rows, next_rank, RW)
        cuda.syncthreads()

    @cuda.jit(device=True)
    def local_rank(d_ids, g, s, t, K, ids_l, lo, x):
        """How many of token (s, t)'s experts are in ``[lo, x)``: the rank of expert x among its
        local experts (ascending), from ``ids_l`` and, past ID_BATCH, memory."""
        j = int32(0)
        for u in range(ID_BATCH):
            if u < K and ids_l[u] >= lo and ids_l[u] < x:
                j += 1
        for k in range(ID_BATCH, K):
            x2 = d_ids[g, s, t, k]
            if x2 >= lo and x2 < x:
                j += 1
        return j

    @cuda.jit(device=True)
    def describe_pair(d_ids, g, s, t, k, K, x, w, ids_l, L, Tmax, first_mine, w0, place, masks, warp_rows, wid,
                      below, row_src_rank, row_src_token, row_src_k, row_weight, row_gather, token_rows):
        """The description of received (s, t, k), expert ``x`` and weight ``w``, if the expert is
        local and in the window from local expert ``w0``: row = the expert's first row
        (``place[e]``) + its warp's first rank + the lanes below with the expert."""
        e = x - first_mine
        el = e - w0
        if el >= 0 and el < RW and e < L:
            m = wid * RW + el
            r = int32(place[e] + warp_rows[m] + popc32(masks[m] & below))
            j = local_rank(d_ids, g, s, t, K, ids_l, first_mine, x)
            describe_row(r, s, t, k, j, Tmax, w, row_src_rank, row_src_token, row_src_k, row_weight, row_gather,
                         token_rows)

    @cuda.jit(device=True)
    def describe_round(d_ids, d_weights, g, s, t, K, valid, ids_l, w_l, L, Tmax, first_mine, w0, place, masks,
                       warp_rows, wid, lane, row_src_rank, row_src_token, row_src_k, row_weight, row_gather,
                       token_rows):
        """One thread per received token of the round :func:`rank_round` ranked: the description
        of each of its (token, k) whose expert is local and in the window (:func:`describe_pair`)."""
        if valid:
            below = (uint32(1) << uint32(lane)) - uint32(1)
            for u in range(ID_BATCH):
                if u < K:
                    describe_pair(d_ids, g, s, t, u, K, ids_l[u], w_l[u], ids_l, L, Tmax, first_mine, w0, place,
                                  masks, warp_rows, wid, below, row_src_rank, row_src_token, row_src_k,
                                  row_weight, row_gather, token_rows)
            for k in range(ID_BATCH, K):
                describe_pair(d_ids, g, s, t, k, K, d_ids[g, s, t, k], d_weights[g, s, t, k], ids_l, L, Tmax,
                              first_mine, w0, place, masks, warp_rows, wid, below, row_src_rank, row_src_token,
                              row_src_k, row_weight, row_gather, token_rows)

    @cuda.jit(device=True)
    def first_rows(place, R, L, pad_multiple, row_offsets, expert_counts, sum_buf):
        """Every thread: ``place[R L + e]`` (expert e's received rows) -> ``place[e]`` its first
        row and ``place[R L + e]`` the end of its received rows (its padding follows, to a
        multiple of pad_multiple), the table :func:`write_segments` reads, scanned by the first
        warp alone (shuffles, no block barrier but the last), which also writes row_offsets [L +
        1] and expert_counts [L]. Returns the total padded rows (int64)."""
        tid = cuda.threadIdx.x
        if tid < warp:
            per = (L + warp - 1) // warp  # local experts per lane
            e_lo = min(tid * per, L)
            e_hi = min(e_lo + per, L)
            part = int64(0)
            for e in range(e_lo, e_hi):
                part += padded(int64(place[R * L + e]), pad_multiple)
            first, total = warp_exclusive_sum(part, sum_buf)
            for e in range(e_lo, e_hi):
                c = place[R * L + e]
                place[e] = int32(first)
                place[R * L + e] = int32(first + c)
                row_offsets[e] = int32(first)
                expert_counts[e] = c
                first += padded(int64(c), pad_multiple)
            if tid == 0:
                sum_buf[threads - 1] = total  # (the simulator's scan used the buffer: read before this)
                row_offsets[L] = int32(total)
        cuda.syncthreads()
        total = sum_buf[threads - 1]
        cuda.syncthreads()  # read by every thread before the buffer is used again
        return total

    def make_expand_rows(copy_rows_of):
        """``expand_rows`` copying with ``copy_rows_of`` (a ``copy_to_rows``)."""

        @cuda.jit(device=True)
        def expand_rows(d_tokens, d_ids, d_counts, g, token_rows, row_offsets, expert_counts, expert_x, status,
                        d_tokens8, expert_scales8, SBYTES, scales_col_major, lo, hi, vals):
            """Every thread of the grid, once every row of call group g is described (token_rows,
            row_offsets, expert_counts) and every token row is in: copy each received row once to
            all its expert rows, then zero the padding rows (dispatch_copy, and the copying blocks
            of a route-first dispatch_wait).

            Token-major: a warp per received row part (``row_parts``: whole rows for large
            batches; source s's T from ``d_counts[g, s, L]``) reads each word once and stores it to
            the token's n_local expert rows (``copy_to_rows``). Then a warp per local expert
            zeroes its padding rows. FP8 token formats (``d_tokens8``, ``expert_scales8``,
            ``SBYTES`` scale bytes per row, ``scales_col_major``: dispatch_copy's): the warp
            holding a row's first part lays its scale bytes out; padding rows get zero scales.
            Scratch: lo, hi local [CP] (``WCP`` for ``expand_rows_in_wait``), vals local [U]."""
            stamp_first(status, 12)
            me = shmem.my_pe()
            R = d_counts.shape[1]
            L = d_counts.shape[2] - 1
            W = expert_x.shape[1]
            C = expert_x.shape[0]
            pairs = copy_in_pairs(d_tokens, expert_x)
            lane = cuda.threadIdx.x % warp
            first_warp = cuda.blockIdx.x * warps + cuda.threadIdx.x // warp
            all_warps = cuda.gridDim.x * warps

            for s in range(R):
                T_s = d_counts[g, s, L]
                parts = row_parts(T_s, W, all_warps, warp)
                span = part_words(W, parts, warp)
                i = first_warp
                while i < T_s * parts:
                    t, w0, w1 = part_bounds(i, parts, span, W)
                    n_local = local_expert_count(d_ids[g, s, t], L, me)
                    copy_rows_of(d_tokens[s, t], token_rows[s, t], n_local, expert_x, w0, w1, pairs, lane, lo, hi,
                                 vals)
                    if QUANT:
                        if w0 == 0:
                            for j in range(n_local):
                                store_scales(d_tokens8[s, t], W * 8, SBYTES, expert_scales8, token_rows[s, t, j], C,
                                             scales_col_major, lane, 0)
                    i += all_warps

            e = first_warp
            while e < L:
                for r in range(row_offsets[e] + expert_counts[e], row_offsets[e + 1]):
                    for w in range(lane, W, warp):
                        expert_x[r, w] = 0
                    if QUANT:
                        store_scales(d_tokens8[0, 0], W * 8, SBYTES, expert_scales8, r, C, scales_col_major, lane, 1)
                e += all_warps
            stamp_last(status, 13)

        return expand_rows

    expand_rows = make_expand_rows(copy_to_rows)
    expand_rows_in_wait = make_expand_rows(make_copy_to_rows(WCP))

    @cuda.jit(device=True)
    def publish_placed(d_placed, n, ok):
        """Every thread of the placing block of a copying route-first dispatch_wait, once it has
        described every row and seen every token row (``ok``), or failed: the block meets,
        thread 0 fences at GPU scope (what the block wrote, and what its acquire loads saw of
        the peers' stores, before the flag: the readers are blocks of this GPU) and sets
        ``d_placed[0]`` to ``(n + 1) << 1``, plus 1 if it failed (the copying blocks then copy
        nothing; the error is recorded), by an atomic exchange (no NVSHMEM call: the flag is
        this rank's own)."""
        cuda.syncthreads()
        if cuda.threadIdx.x == 0:
            cuda.threadfence()
            cuda.atomic.exch(d_placed, 0, (uint64(n + 1) << uint64(1)) | uint64(0 if ok else 1))

    @cuda.jit(device=True)
    def await_placed_rows(d_placed, n, timeout_ns, status, flag):
        """Every thread of a block of a copying route-first dispatch_wait: thread 0 waits until the
        placing block published call n (``d_placed[0] >= (n + 1) << 1``, an acquire poll; the
        block then meets, so every thread sees what the placing block wrote and saw). Bounded by
        three times ``timeout_ns`` (the placing block's two waits are bounded by one each); a
        timeout is recorded naming dispatch_wait, this rank and ``dispatch_placed``. Returns
        whether the rows are placed and in (False also when the placing block failed: it
        recorded why)."""
        if cuda.threadIdx.x == 0:
            want = uint64(n + 1) << uint64(1)
            seen = shmem.wait_signal_ge(d_placed[0:1], want, 3 * timeout_ns)
            flag[0] = 1 if seen >= want and (seen & uint64(1)) == uint64(0) else 0
            if seen < want:
                me = shmem.my_pe()
                record_error(status, ERR_TIMEOUT, KERNEL_DISPATCH_WAIT, me, me, COUNTER_DISPATCH_PLACED, n + 1,
                             int64(seen >> uint64(1)), n + 1)
        cuda.syncthreads()
        ok = flag[0] != 0
        cuda.syncthreads()  # flag read by every thread before it is used again
        return ok

    @cuda.jit(device=True)
    def await_token_rows(d_signal, g, n, timeout_ns, status, recv_tokens, src_T, flag):
        """Every thread of a placing block of a route-first dispatch_wait, its rows described:
        wait for every source's dispatch signal (the token rows are in), then write
        recv_tokens [R] (each source's T, from its signal). Returns whether every signal came."""
        ok = await_sources(d_signal, g, n, timeout_ns, status, KERNEL_DISPATCH_WAIT, COUNTER_DISPATCH_SIGNAL, src_T,
                           flag)
        if ok:
            stamp_last(status, 9)
            for s in range(cuda.threadIdx.x, d_signal.shape[1], threads):
                recv_tokens[s] = src_T[s]
        stamp_last(status, 11)
        return ok

    @cuda.jit(device=True)
    def count_received_id(place, x, j, before, first_mine, R, L):
        """``place_by_chunks``'s count of received id ``x``, element ``j`` of its source's run: if
        its expert is local, one more row of it (``place[R L + e]``) and, when ``j < before`` (a
        token before the chunk), one more before the chunk (``place[L + e]``)."""
        e = x - first_mine
        if e >= 0 and e < L:
            cuda.atomic.add(place, R * L + e, int32(1))
            if j < before:
                cuda.atomic.add(place, L + e, int32(1))

    @cuda.jit(device=True)
    def place_by_chunks(d_ids, d_weights, g, n, me, R, L, K, Tmax, C, status, pad_multiple, row_offsets, expert_counts,
                        row_src_rank, row_src_token, row_src_k, row_weight, row_gather, token_rows, src_T, Q, place,
                        sum_buf, masks, warp_rows, next_rank, share, shares):
        """Every thread of placing block ``share`` of ``shares`` (a route-first dispatch_wait from
        CHUNK_FROM_TOKENS received tokens, R >= 2, every source's routing here, v33): rank and
        describe the received tokens ``[share q, (share + 1) q)`` of the ``Q`` (source 0's first,
        ``q = ceil(Q / shares)``). One pass over every received id (v34: four to a 16-byte load
        where a source's run is aligned) counts each local expert's rows
        and those before the chunk (shared-memory atomics: counts, so no order matters; the
        expert's rows in ``place[R L + e]``, those before the chunk in ``place[L + e]``, a part of
        the table route-first placement leaves unused when R >= 2); the first warp scans the rows
        into first rows (:func:`first_rows`, every block alike, with the offsets and counts);
        the padding rows are described a warp per expert over the blocks; then the chunk's tokens
        go in rounds (:func:`rank_round`) from the rows before it, each (token, local expert)'s
        row = the expert's first row + its rank among every received token with that expert, in
        (source, token) order: the reference's order, as the unchunked placement. Returns whether
        the rows fit the capacity C (a larger total is recorded by block 0 and nothing is
        described)."""
        tid = cuda.threadIdx.x
        lane = tid % warp
        wid = tid // warp
        first_mine = me * L
        per = (Q + shares - 1) // shares
        q_lo = min(share * per, Q)
        q_hi = min(q_lo + per, Q)
        for e in range(tid, L, threads):
            place[R * L + e] = 0
            place[L + e] = 0
        cuda.syncthreads()
        xs = cuda.local.array(COUNT_IDS, int32)
        q0 = 0  # the source's first received token
        for s in range(R):
            base = address_of(d_ids[g, s])  # [Tmax, K] contiguous: (t, k) is flat element t K + k
            n_s = src_T[s] * K
            before = min(max(q_lo - q0, 0) * K, n_s)  # the source's ids of tokens before the chunk
            n4 = n_s // 4 if base % uint64(16) == 0 else 0  # ids read four to a load
            for jb in range(0, n4, threads * COUNT_QUADS):  # the source's run of ids, coalesced
                for u in range(COUNT_QUADS):  # loaded together (a constant trip count: registers)
                    j4 = jb + u * threads + tid
                    if j4 < n4:
                        a, b, c, d = load_u32x4_at(base, j4)
                        xs[4 * u] = int32(a)
                        xs[4 * u + 1] = int32(b)
                        xs[4 * u + 2] = int32(c)
                        xs[4 * u + 3] = int32(d)
                    else:  # no id: no local expert
                        for v in range(4):
                            xs[4 * u + v] = int32(-1)
                for u in range(COUNT_QUADS):
                    j = 4 * (jb + u * threads + tid)
                    for v in range(4):
                        count_received_id(place, xs[4 * u + v], j + v, before, first_mine, R, L)
            for j in range(4 * n4 + tid, n_s, threads):  # the rest (fewer than 4, or a misaligned run)
                count_received_id(place, int32(load_u32_at(base, j)), j, before, first_mine, R, L)
            q0 += src_T[s]
        cuda.syncthreads()
        stamp_last(status, 37)
        total = first_rows(place, R, L, pad_multiple, row_offsets, expert_counts, sum_buf)
        stamp_last(status, 38)
        if total > C:
            if share == 0 and tid == 0:
                record_error(status, ERR_CAPACITY, KERNEL_DISPATCH_WAIT, me, -1, COUNTER_RECV_ROWS, C, total, n + 1)
            return False
        if pad_multiple != 1:  # a warp per local expert over the blocks' warps
            write_segments(place, R, L, pad_multiple, row_offsets, expert_counts, row_src_rank, row_src_token,
                           row_src_k, row_weight, row_gather, share * warps + wid, shares * warps, lane)
        stamp_last(status, 39)
        ids_l = cuda.local.array(ID_BATCH, int32)  # this thread's token's first ids and weights
        w_l = cuda.local.array(ID_BATCH, float32)
        for w0 in range(0, L, RW):
            for el in range(tid, RW, threads):  # the window's rows before the chunk (rank_round's barrier orders it)
                next_rank[el] = place[L + w0 + el] if w0 + el < L else 0
            for qb in range(q_lo, q_hi, threads):
                q = qb + tid
                valid = q < q_hi
                s, t = token_of(min(q, q_hi - 1), src_T, R)
                if valid:
                    load_token(d_ids, d_weights, g, s, t, K, ids_l, w_l)
                rank_round(d_ids, g, s, t, K, valid, ids_l, first_mine + w0, masks, warp_rows, next_rank, wid, lane)
                describe_round(d_ids, d_weights, g, s, t, K, valid, ids_l, w_l, L, Tmax, first_mine, w0, place,
                               masks, warp_rows, wid, lane, row_src_rank, row_src_token, row_src_k, row_weight,
                               row_gather, token_rows)
                cuda.syncthreads()  # the masks read before the next round clears them
        stamp_last(status, 36)
        return True

    @cuda.jit(device=True)
    def place_from_routing(d_ids, d_weights, d_route, d_signal, g, n, me, R, L, K, Tmax, C, timeout_ns, status,
                           pad_multiple, row_offsets, expert_counts, row_src_rank, row_src_token, row_src_k,
                           row_weight, row_gather, recv_tokens, token_rows, src_T, flag, place, sum_buf, masks,
                           warp_rows, next_rank, share, shares):
        """A route-first dispatch_wait (v29), every thread of a placing block, started early by PDL
        on the SMs dispatch_async leaves: wait for every source's route signal (``d_route[g, s]``:
        its routing rows, ids and weights, are here; its T in the low half), rank and place every
        received (token, local expert) from them while the token rows still fly, then wait for
        every source's dispatch signal (the token rows) and write recv_tokens. Returns (the same
        in every thread) whether every row is described and every token row is in.

        The received tokens, source 0's first, go in rounds of a token per thread; a row's
        position is its expert's first row plus its rank among all received tokens with that
        expert, in (source, token) order: the order the reference lays rows out in, with no
        ranks from the sources and no atomic deciding a position. Pass 1 counts each local
        expert's rows (window by window, :func:`rank_round`), the first warp scans them into
        first rows (:func:`first_rows`, with the offsets and counts), padding rows are described
        (:func:`write_segments`, when pad_multiple > 1); pass 2 ranks again and writes each row's
        description (with one window and one round, the decode case, pass 1's masks are reused).
        More rows than C records an error and describes no row (the offsets and counts are
        written: the runtime raises the capacity error, and the batch is not returned).

        ``shares`` blocks may place at once (v31: the compact launch's ``ROUTE_FIRST_BLOCKS``):
        from ``SHARE_FROM_TOKENS`` received tokens each ranks every token alike (the same
        table, offsets and counts, written alike) and describes the rows of share ``share``
        only: a warp's tokens of a round are share ``(round * warps + warp) % shares``; below
        it share 0 places alone and the others return True once the routing is in (v32: a
        second block cost ~1 us at T=32). The descriptions are scattered stores (a row per
        lane anywhere in the batch): one block took 6.2 of dispatch_wait's 18.2 us describing
        the rows at T=128 on an H100 (v31's trace); with two, dispatch_wait alone took 16.4-16.5
        us instead of 17.7-17.9 there (docs/throughput.md, "v31").

        A block on one SM: each phase costs 1-4 us whatever its work (traced at T=1 and 128:
        counting 2-3, the scan 1-2, padding rows 2, descriptions 3-6), so the phases are few: the
        scan is one warp's, the segments' offsets and counts are written by it, and padding
        rows are described only when there are any. A dry pass over stale routing first (to
        fetch the code while the routing flies) made the real pass 3-5 us faster but took longer
        than the routing's flight (v29)."""
        tid = cuda.threadIdx.x
        lane = tid % warp
        wid = tid // warp
        if not await_sources(d_route, g, n, timeout_ns, status, KERNEL_DISPATCH_WAIT, COUNTER_ROUTE_SIGNAL,
                             src_T, flag):
            return False
        stamp_last(status, 35)
        Q = 0  # every source's tokens
        for s in range(R):
            Q += src_T[s]
        if shares > 1 and Q < SHARE_FROM_TOKENS:  # few rows: the first block describes them all
            if share != 0:
                return True
            shares = 1
        if CHUNKS and shares > 1 and R > 1 and Q >= CHUNK_FROM_TOKENS:  # many rows: each block ranks a chunk (v33)
            if not place_by_chunks(d_ids, d_weights, g, n, me, R, L, K, Tmax, C, status, pad_multiple, row_offsets,
                                   expert_counts, row_src_rank, row_src_token, row_src_k, row_weight, row_gather,
                                   token_rows, src_T, Q, place, sum_buf, masks, warp_rows, next_rank, share, shares):
                return False
            return await_token_rows(d_signal, g, n, timeout_ns, status, recv_tokens, src_T, flag)
        first_mine = me * L
        ids_l = cuda.local.array(ID_BATCH, int32)  # this thread's token's first ids and weights
        w_l = cuda.local.array(ID_BATCH, float32)
        again = L > RW or Q > threads  # more than one window or round: pass 2 ranks again
        for w0 in range(0, L, RW):  # pass 1: each local expert's received rows
            for el in range(tid, RW, threads):
                next_rank[el] = 0
            for q0 in range(0, Q, threads):
                valid = q0 + tid < Q
                s, t = token_of(min(q0 + tid, Q - 1), src_T, R)
                if valid:
                    load_token(d_ids, d_weights, g, s, t, K, ids_l, w_l)
                rank_round(d_ids, g, s, t, K, valid, ids_l, first_mine + w0, masks, warp_rows, next_rank, wid, lane)
            for el in range(tid, min(RW, L - w0), threads):
                place[R * L + w0 + el] = next_rank[el]
            cuda.syncthreads()
        stamp_last(status, 37)
        total = first_rows(place, R, L, pad_multiple, row_offsets, expert_counts, sum_buf)
        stamp_last(status, 38)
        if total > C:
            if tid == 0:
                record_error(status, ERR_CAPACITY, KERNEL_DISPATCH_WAIT, me, -1, COUNTER_RECV_ROWS, C, total, n + 1)
            return False
        if pad_multiple != 1:  # a warp of this block per local expert (whatever the grid)
            write_segments(place, R, L, pad_multiple, row_offsets, expert_counts, row_src_rank, row_src_token,
                           row_src_k, row_weight, row_gather, wid, warps, lane)
        stamp_last(status, 39)
        for w0 in range(0, L, RW):  # pass 2: each row's description (one window and round: pass 1's ranks)
            if again:
                for el in range(tid, RW, threads):
                    next_rank[el] = 0
            for q0 in range(0, Q, threads):
                valid = q0 + tid < Q
                s, t = token_of(min(q0 + tid, Q - 1), src_T, R)
                if again:
                    if valid:
                        load_token(d_ids, d_weights, g, s, t, K, ids_l, w_l)
                    rank_round(d_ids, g, s, t, K, valid, ids_l, first_mine + w0, masks, warp_rows, next_rank, wid,
                               lane)
                mine = ((q0 // threads) * warps + wid) % shares == share  # this block's share
                describe_round(d_ids, d_weights, g, s, t, K, valid and mine, ids_l, w_l, L, Tmax, first_mine, w0,
                               place, masks, warp_rows, wid, lane, row_src_rank, row_src_token, row_src_k,
                               row_weight, row_gather, token_rows)
                cuda.syncthreads()  # the masks read before the next round clears them
        stamp_last(status, 36)
        return await_token_rows(d_signal, g, n, timeout_ns, status, recv_tokens, src_T, flag)

    @kernel_jit(threads)
    def dispatch_wait(d_ids, d_weights, d_counts, d_ranks, d_signal, sync,
                      row_offsets, expert_counts, row_src_rank, row_src_token, row_src_k,
                      row_weight, row_gather, recv_tokens, token_rows, status, pad_multiple, timeout_ns,
                      d_tokens, expert_x, copy_rows, combine_claims, land_sync, d_route, d_placed):
        """Wait for every source rank, then place every received (token, local expert) pair.

        Symmetric inputs as in dispatch_async (group g of the last call): d_counts [G, R, L + 1]
        int32 (source s's tokens per local expert, and its T), d_ranks [G, R, Tmax, K] int32
        (rank of token t among source s's tokens with expert ``d_ids[g, s, t, k]``).
        Outputs (local): row_offsets [L + 1] int32, expert_counts [L] int32, row_src_rank /
        row_src_token / row_src_k [C] int32, row_weight [C] float32, row_gather [C] int32 (the
        row's slot in the receive buffer, ``src * Tmax + t``: the compact layout's gather
        index; padding rows: -1, -1, -1, 0, -1), recv_tokens [R] int32 (tokens each source
        dispatched, from its signal), and token_rows [R, Tmax, K] int32 (row of the
        j-th local expert of token (src, t), for dispatch_copy and combine_async).
        pad_multiple, timeout_ns: int64. copy_rows (int64; bf16 builds only): nonzero for the
        expanded layout in one kernel (decode sizes; ``EPRuntime.fused_copy``): each warp also
        copies its hits' received rows, d_tokens [R, Tmax, W] words, to their rows of
        expert_x [C, W] words, and the expert warps zero the padding rows, so no dispatch_copy
        follows (a row is read once per local expert instead of once: the token-major
        dispatch_copy stays the better choice for large batches). combine_claims (int32 [2],
        ``combine_wait_claims``): block 0 zeroes ``[n % 2]`` for this call's combine_wait (its
        last user, combine_wait of call n - 2, has completed). land_sync (int64 [4],
        ``dispatch_land_sync``): ``[LAND_CALLS]`` set to n + 1 and the next call's claims zeroed,
        as dispatch_land does (so the two receive kernels may follow each other).

        Early wait (v28; T=128 compact dispatch 28.7 -> 28.1 us on 2 x H200): the call number is
        ``land_sync[LAND_CALLS]`` (the previous call's dispatch_wait advanced it; the last block
        to read it here advances it, ``land_sync[LAND_TICKET]`` counting the blocks), and every
        block waits for the signals before its dependency wait, so blocks started early by PDL
        (on the SMs dispatch_async's blocks leave as they exit) see the signals as they land
        instead of after dispatch_async has completed and this kernel has started.

        Every block waits for all R signals itself (each carries its source's token count),
        scans the local experts' padded row counts (a thread per run of experts, one block scan:
        every expert's first row; no block depends on another) and checks the capacity. Then a
        warp per local expert (from the last block down) writes its offset, count and padding
        rows, and a thread per received (source, token, k) (from block 0 up) whose expert is
        local writes its row's description at row = the expert's first row + the expert's
        rows from earlier sources + the rank its source gave it. Deterministic: rows by expert,
        source rank, source token, as the reference's; no atomic decides a position, and no
        thread's row depends on another's. A wait past timeout_ns or more rows than C records
        an error and writes nothing (dispatch_copy then copies nothing).

        A ``place`` build (v26; see dispatch_async (4)): dispatch_async's routing blocks have
        placed every row before that kernel completed, and this kernel only waits for the
        signals (the token rows are in) and writes recv_tokens, before its dependency wait
        (``await_placed``, v27: launched with one block, it waits while dispatch_async still
        sends, and completes right after it); copy_rows is ignored (a placing runtime never
        fuses the copy: the expanded layout's dispatch_copy follows).

        A ``route_first`` build (v29; d_route [G, R] uint64, ``dispatch_route_signal``): launched
        with ``ROUTE_FIRST_BLOCKS`` blocks (v31; one before), started early by PDL on the SMs
        dispatch_async leaves, each block waits for every source's routing, ranks and places
        every received row from the routing rows alone while the token rows still fly
        (``place_from_routing``: d_counts and d_ranks are not read; the blocks share the
        descriptions), then waits for the dispatch signals and writes recv_tokens; its
        dependency wait comes last. With copy_rows nonzero (bf16; the expanded layout, v30) the
        runtime launches it on the whole grid instead, and it copies too, in one launch: the
        block that takes the first ticket places as above and then sets ``d_placed`` (uint64
        symmetric [1], ``dispatch_placed``: ``(n + 1) << 1``, plus 1 if it failed), and every
        block waits for that and then copies each received row to its expert rows,
        token-major, as dispatch_copy does (``expand_rows``). Without copy_rows it launches the few blocks, and
        dispatch_copy follows for the expanded layout (FP8 formats, ``EP_RUNTIME_FUSED_COPY=0``).
        """
        flag = cuda.shared.array(1, int32)
        scan_buf = cuda.shared.array(threads, int32)
        sum_buf = cuda.shared.array(threads, int64)
        place = cuda.shared.array(PLACEMENT_WORDS, int32)  # scan_placement's table
        hit_row = cuda.shared.array(threads, int32)  # fused copy: each warp's hits of one step
        hit_token = cuda.shared.array(threads, int32)
        src_items = cuda.shared.array(MAX_RANKS, int32)  # T, then (token, k) pairs, each source sent this call
        masks = cuda.shared.array(RECV_WORDS, uint32)  # route-first builds: [warp, window expert] lanes
        warp_rows = cuda.shared.array(RECV_WORDS, int32)  # ... and each warp's first rank
        next_rank = cuda.shared.array(RECV_NEXT, int32)  # ... and the next round's
        lo = cuda.local.array(UP, uint64)
        hi = cuda.local.array(UP, uint64)
        ticket = cuda.shared.array(1, int32)  # route-first builds: the block's ticket (0: it places)
        copy_lo = cuda.local.array(WCP, uint64)  # a route-first build's copy (expand_rows_in_wait)
        copy_hi = cuda.local.array(WCP, uint64)
        copy_vals = cuda.local.array(U, uint64)
        pdl.trigger_dependents()
        if EARLY:  # placing builds: the rows awaited while dispatch_async still runs (v27)
            await_placed(d_signal, land_sync, recv_tokens, combine_claims, status, timeout_ns, src_items, flag)
            pdl.dependency_wait()  # completes after dispatch_async (its placement): stream order for what follows
            return
        # before the dependency wait (started early by PDL on the SMs dispatch_async's
        # blocks leave as they exit): the call number from land_sync (the previous call's
        # dispatch_wait advanced it), then every source's signal
        code = status[STATUS_CODE]  # an earlier call's error (this call's dispatch_async records after)
        n = land_sync[LAND_CALLS]
        tid = cuda.threadIdx.x
        cuda.syncthreads()  # every thread has read n before thread 0 may advance it
        if tid == 0:  # every block has read n: the last one advances it for the next call
            ticket[0] = cuda.atomic.add(land_sync, LAND_TICKET, int64(1))
            if ticket[0] == cuda.gridDim.x - 1:
                land_sync[LAND_TICKET] = 0
                land_sync[LAND_CALLS] = n + 1
        if FIRST_COPY:
            cuda.syncthreads()  # the ticket seen by every thread
            if code != 0 and ticket[0] == 0:  # the copying blocks are not left waiting
                publish_placed(d_placed, n, False)
        if code != 0:
            pdl.dependency_wait()
            return
        stamp_first(status, 8)
        stamp_last(status, 23)
        me = shmem.my_pe()
        R = d_counts.shape[1]
        L = d_counts.shape[2] - 1
        K = d_ids.shape[3]
        Tmax = d_ids.shape[2]
        C = row_src_rank.shape[0]
        g = n % 2
        if cuda.blockIdx.x == 0 and tid == 0:
            combine_claims[g] = 0  # rows this call's combine_wait claims (flagged rows)
            land_sync[LAND_CLAIMS + 1 - g] = 0  # a dispatch_land's claims (their last user, call n - 1, has completed)
        if FIRST:  # placed from the routing rows while the rows fly
            # a copying launch (the whole grid): the first block to run places (it cannot wait
            # for one that never runs), the others copy after it; any other launch (a few
            # blocks, v31) places in every block, each describing its share of the rows
            fused = FIRST_COPY and copy_rows != 0
            placer = True
            share = cuda.blockIdx.x
            shares = cuda.gridDim.x
            if fused:
                placer = ticket[0] == 0
                share = 0
                shares = 1
            ok = True
            if placer:
                ok = place_from_routing(d_ids, d_weights, d_route, d_signal, g, n, me, R, L, K, Tmax, C, timeout_ns,
                                        status, pad_multiple, row_offsets, expert_counts, row_src_rank,
                                        row_src_token, row_src_k, row_weight, row_gather, recv_tokens, token_rows,
                                        src_items, flag, place, sum_buf, masks, warp_rows, next_rank, share, shares)
            if FIRST_COPY:
                if fused:  # the expanded layout in one launch: every block copies once it is placed
                    if placer:
                        publish_placed(d_placed, n, ok)
                    else:  # idle until dispatch_async completes, not polling beside its blocks
                        pdl.dependency_wait()
                    if await_placed_rows(d_placed, n, timeout_ns, status, flag):
                        expand_rows_in_wait(d_tokens, d_ids, d_counts, g, token_rows, row_offsets, expert_counts,
                                            expert_x, status, d_tokens, d_tokens, 0, 0, copy_lo, copy_hi, copy_vals)
            pdl.dependency_wait()  # completes after dispatch_async: stream order for what follows
            return

        # wait for every source rank's signal (thread s waits for rank s; each carries its T)
        ok = await_sources(d_signal, g, n, timeout_ns, status, KERNEL_DISPATCH_WAIT, COUNTER_DISPATCH_SIGNAL,
                           src_items, flag)
        pdl.dependency_wait()  # dispatch_async complete: stream order for the rest and what follows
        if not ok:
            return
        stamp_first(status, 15)
        stamp_last(status, 9)
        for s in range(tid, R, threads):
            if cuda.blockIdx.x == 0:
                recv_tokens[s] = src_items[s]
            src_items[s] *= K  # (token, k) pairs of source s
        cuda.syncthreads()

        # every (source, expert)'s first row and the total (padded): every block scans them itself
        total = scan_placement(d_counts, g, pad_multiple, place, sum_buf)
        stamp_last(status, 14)
        if total > C:
            if cuda.blockIdx.x == 0 and tid == 0:
                record_error(status, ERR_CAPACITY, KERNEL_DISPATCH_WAIT, me, -1, COUNTER_RECV_ROWS,
                             C, total, n + 1)
            return
        if cuda.blockIdx.x == 0 and tid == 0:
            row_offsets[L] = total

        lane = tid % warp
        all_warps = cuda.gridDim.x * warps
        copy = copy_rows != 0 and not QUANT
        W = expert_x.shape[1]
        pairs = copy_in_pairs(d_tokens, expert_x)

        # (a) a warp per local expert: offset, count, padding rows
        e0, stride = expert_warps(tid)
        write_segments(place, R, L, pad_multiple, row_offsets, expert_counts, row_src_rank, row_src_token, row_src_k,
                       row_weight, row_gather, e0, stride, lane)
        if copy:
            zero_padding_rows(place, R, L, pad_multiple, expert_x, e0, stride, lane)
        stamp_last(status, 10)

        # (b) a thread per received (source, token, k), a warp per 32 consecutive pairs of one
        # source (warp steps over the sources in turn, from block 0 up)
        first_mine = me * L  # global id of local expert 0
        steps = 0
        for s in range(R):
            steps += (src_items[s] + warp - 1) // warp
        i = cuda.blockIdx.x * warps + tid // warp
        while i < steps:
            s = 0  # the step's source, and its first pair
            step = i
            while step >= (src_items[s] + warp - 1) // warp:
                step -= (src_items[s] + warp - 1) // warp
                s += 1
            p = step * warp + lane
            t = p // K
            k = p - t * K
            hit = False
            r = int32(0)
            if p < src_items[s]:
                weight = d_weights[g, s, t, k]  # loaded beside row_of's id and rank
                r, j = row_of(d_ids, d_ranks, place, L, g, s, t, k, first_mine)
                if r >= 0:
                    hit = True
                    describe_row(r, s, t, k, j, Tmax, weight, row_src_rank, row_src_token, row_src_k, row_weight,
                                 row_gather, token_rows)
            if copy:  # the step's hits
                below, hits = warp_exclusive_count(hit, scan_buf)
                copy_warp_hits(hit, r, t, below, hits, d_tokens[s], expert_x, W, pairs, hit_row, hit_token,
                               lane, lo, hi)
            i += all_warps
        stamp_last(status, 11)

    @cuda.jit(device=True)
    def land_rows(d_ids, d_weights, d_counts, d_ranks, d_route, d_signal, land_sync, row_offsets, expert_counts,
                  row_src_rank, row_src_token, row_src_k, row_weight, row_gather, recv_tokens, token_rows, status,
                  pad_multiple, timeout_ns, d_tokens, expert_x, d_row_flag, copy_rows, combine_claims, tokens,
                  flag, sum_buf, place, src_T, claim, item_rows, lo, hi, vals):
        """dispatch_land's work, every thread of a block (the kernel waits for its predecessor after
        it, whatever path returns). Arguments as the kernel's; the rest is scratch (shared:
        flag [1], sum_buf [threads], place [PLACEMENT_WORDS], src_T [MAX_RANKS], claim [warps],
        item_rows [warps, warp] (each warp's token: its local experts' rows, for the copy); local:
        lo, hi, vals)."""
        if status[STATUS_CODE] != 0:
            return
        stamp_first(status, 24)
        me = shmem.my_pe()
        R = d_counts.shape[1]
        L = d_counts.shape[2] - 1
        Tmax = d_ids.shape[2]
        K = d_ids.shape[3]
        C = row_src_rank.shape[0]
        tid = cuda.threadIdx.x
        lane = tid % warp
        wid = tid // warp
        # the receive kernel of the previous call completed before dispatch_async of this one
        # started, and that kernel starts this one only after its own dependency wait
        n = land_sync[LAND_CALLS]
        g = n % 2
        if cuda.blockIdx.x == 0 and tid == 0:
            combine_claims[g] = 0  # rows this call's combine_wait claims (its last user, call n - 2, is done)
            land_sync[LAND_CLAIMS + 1 - g] = 0  # the next call's claims (their last user, call n - 1, is done)

        # every source's routing (thread s waits for rank s; the signal carries its T)
        if not await_sources(d_route, g, n, timeout_ns, status, KERNEL_DISPATCH_LAND, COUNTER_ROUTE_SIGNAL,
                             src_T, flag):
            return
        stamp_last(status, 25)
        if cuda.blockIdx.x == 0:
            for s in range(tid, R, threads):
                recv_tokens[s] = src_T[s]
        total = scan_placement(d_counts, g, pad_multiple, place, sum_buf)
        if total > C:
            if cuda.blockIdx.x == 0 and tid == 0:
                record_error(status, ERR_CAPACITY, KERNEL_DISPATCH_LAND, me, -1, COUNTER_RECV_ROWS, C, total, n + 1)
            return
        if cuda.blockIdx.x == 0 and tid == 0:
            row_offsets[L] = total
        copy = copy_rows != 0 and not QUANT
        W = expert_x.shape[1]
        pairs = copy_in_pairs(d_tokens, expert_x)
        own_pairs = pairs and pairs_aligned(tokens)  # the caller's rows (this rank's own) as word pairs too
        e0, stride = expert_warps(tid)
        write_segments(place, R, L, pad_multiple, row_offsets, expert_counts, row_src_rank, row_src_token, row_src_k,
                       row_weight, row_gather, e0, stride, lane)
        if copy:
            zero_padding_rows(place, R, L, pad_multiple, expert_x, e0, stride, lane)
        stamp_last(status, 26)

        # items (token t, source s, part p), token-major so the sources' rows, landing together,
        # are taken together; claimed one at a time, so blocks that start late take what is left
        P = 1  # the most parts of any source's rows (the senders' rule, from each T)
        T_hi = 0
        for s in range(R):
            T_hi = max(T_hi, src_T[s])
            if copy:
                P = max(P, flag_rule(src_T[s], W, DISPATCH_FLAG_PARTS, warp)[0])
        items = T_hi * R * P
        first_mine = me * L
        while True:
            if lane == 0:
                c = int64(items)
                if status[STATUS_CODE] == 0:
                    c = cuda.atomic.add(land_sync, LAND_CLAIMS + g, int64(1))
                claim[wid] = int32(min(c, int64(items)))
            warp_sync()
            i = claim[wid]
            warp_sync()  # read by every lane before lane 0 writes it again
            if i >= items:
                break
            t = i // (R * P)
            s = (i - t * R * P) // P
            p = i - t * R * P - s * P
            parts = 1
            span = W
            if copy:
                parts, span = flag_rule(src_T[s], W, DISPATCH_FLAG_PARTS, warp)
            if t >= src_T[s] or p >= parts:
                continue
            t, w0, w1 = part_bounds(t * parts + p, parts, span, W)
            n_local = local_expert_count(d_ids[g, s, t], L, me)
            if n_local == 0 or w0 >= w1:
                continue  # nothing of this token here (never flagged), or an empty part
            own = not QUANT and s == me  # bf16: this rank's own row is the caller's (never sent, v28)
            if copy and not own:  # lane 0 waits for the part
                if lane == 0:
                    claim[wid] = int32(await_part(d_row_flag, s, t, p, n, timeout_ns, status, KERNEL_DISPATCH_LAND,
                                                  COUNTER_DISPATCH_ROW_FLAG))
                warp_sync()
                ok = claim[wid]
                warp_sync()
                if ok == 0:
                    break
            # the token's rows (every part's warp writes the same token_rows); descriptions once
            for k in range(lane, K, warp):
                weight = d_weights[g, s, t, k] if p == 0 else float32(0.0)  # part 0 describes the rows
                r, j = row_of(d_ids, d_ranks, place, L, g, s, t, k, first_mine)
                if r >= 0:
                    if j < warp:
                        item_rows[wid, j] = r  # the copy's rows, read from shared memory (v28)
                    if p == 0:
                        describe_row(r, s, t, k, j, Tmax, weight, row_src_rank, row_src_token, row_src_k, row_weight,
                                     row_gather, token_rows)
                    else:
                        token_rows[s, t, j] = r
            warp_sync()  # the warp's token_rows and item_rows stores are seen by its lanes
            if copy and own and n_local <= warp:  # straight from the caller's tokens
                copy_to_rows(tokens[t], item_rows[wid], n_local, expert_x, w0, w1, own_pairs, lane, lo, hi, vals)
            elif copy and own:
                copy_to_rows(tokens[t], token_rows[s, t], n_local, expert_x, w0, w1, own_pairs, lane, lo, hi, vals)
            elif copy and n_local <= warp:
                copy_to_rows(d_tokens[s, t], item_rows[wid], n_local, expert_x, w0, w1, pairs, lane, lo, hi, vals)
            elif copy:
                copy_to_rows(d_tokens[s, t], token_rows[s, t], n_local, expert_x, w0, w1, pairs, lane, lo, hi, vals)
            elif own:  # the compact layout: the caller's row into this rank's slot of the receive buffer
                if lane == 0:
                    item_rows[wid, 0] = t
                warp_sync()
                copy_to_rows(tokens[t], item_rows[wid], 1, d_tokens[me], w0, w1, own_pairs, lane, lo, hi, vals)
        # every warp is out of the loop (one whose flag timed out left it, the others then claimed
        # nothing more): the block decides together whether to go on
        if tid == 0:
            flag[0] = int32(status[STATUS_CODE] != 0)
        cuda.syncthreads()
        failed = flag[0] != 0
        cuda.syncthreads()  # flag read by every thread before it is used again
        if failed:
            return
        stamp_last(status, 27)
        if not copy:  # the rows stay where they land (compact; FP8: dispatch_copy follows): all of them in
            if cuda.blockIdx.x == 0:
                if not await_sources(d_signal, g, n, timeout_ns, status, KERNEL_DISPATCH_LAND,
                                     COUNTER_DISPATCH_SIGNAL, src_T, flag):
                    return
        # the last block advances the receive count (the next call's dispatch_land reads it)
        if last_block_ticket(land_sync[LAND_TICKET:LAND_TICKET + 1], flag, False):
            if tid == 0:
                land_sync[LAND_CALLS] = n + 1
                land_sync[LAND_TICKET] = 0
        stamp_last(status, 28)

    @kernel_jit(threads)
    def dispatch_land(d_ids, d_weights, d_counts, d_ranks, d_route, d_signal, land_sync,
                      row_offsets, expert_counts, row_src_rank, row_src_token, row_src_k,
                      row_weight, row_gather, recv_tokens, token_rows, status, pad_multiple, timeout_ns,
                      d_tokens, expert_x, d_row_flag, copy_rows, combine_claims, tokens):
        """dispatch_wait for landing calls: place every received row while the rows are still in
        flight, and (bf16, expanded) copy each part of each row to its expert rows as it lands
        (docs/protocol.md, "Dispatch rows as they land").

        Launched right after dispatch_async with PDL, its blocks start on the SMs dispatch_async
        leaves free (``EP_RUNTIME_DISPATCH_LAND_SMS``) while that kernel still sends; the rest
        start as its blocks exit. It reads nothing of this call before the peers' signals: its
        call number is ``land_sync[LAND_CALLS]`` (int64 [4], ``dispatch_land_sync``; the previous
        call's receive kernel set it, and combine_wait_claims / the claims it zeroes were last
        used by kernels that have completed).

        Every block waits for each source's route signal (d_route [G, R] uint64,
        ``dispatch_route_signal``: ``(n + 1) << 32 | T`` once its ids, weights, ranks and counts
        are here), scans the local experts' offsets and checks the capacity as dispatch_wait
        does, and a warp per local expert writes its segment. Then each warp claims items
        (``land_sync[LAND_CLAIMS + g]``, an atomic counter): (token t, source s, part p),
        token-major, the parts being the senders' (``flag_rule`` from s's T; one per row
        unless copy_rows). For a token with an expert here, it computes the rows of its local
        experts (the formula of dispatch_wait), writes their descriptions (part 0) and
        token_rows, and with copy_rows (int64; bf16 builds: the expanded layout in one kernel)
        lane 0 first waits for the part's flag (d_row_flag [R, Tmax, DISPATCH_FLAG_PARTS]
        uint64, ``[s, t, p] >= n + 1``) and the warp copies the part to every expert row, each
        word read once (the token's rows from shared memory, ``item_rows``). This rank's own bf16
        rows were never sent (dispatch_async's landing build skips its own rank, v28): they come
        from ``tokens`` (the caller's [T, W] words of this call, unmodified until dispatch_wait
        has run; an empty stand-in for FP8, whose own rows are sent), with no flag to wait for,
        copied to the expert rows, or in the compact layout to this rank's slots
        ``d_tokens[me, t]``. Without copy_rows the rows stay where they landed (the compact layout;
        FP8 expanded, dispatch_copy follows) and block 0 waits for every source's dispatch
        signal (all of its rows in) before the kernel ends. The last block (ticket
        ``land_sync[LAND_TICKET]``) sets ``land_sync[LAND_CALLS] = n + 1``. Finally every block
        waits for dispatch_async to complete (``dependency_wait``), so stream order holds for
        what follows. Outputs and their values are dispatch_wait's (and dispatch_copy's),
        bit for bit. A timeout names the route signal or the part's flag (rank and token); more
        rows than C records a capacity error and writes nothing.
        """
        flag = cuda.shared.array(1, int32)
        sum_buf = cuda.shared.array(threads, int64)
        place = cuda.shared.array(PLACEMENT_WORDS, int32)
        src_T = cuda.shared.array(MAX_RANKS, int32)
        claim = cuda.shared.array(warps, int32)  # each warp's claimed item, then its flag's verdict
        item_rows = cuda.shared.array((warps, warp), int32)  # each warp's token: its local experts' rows
        lo = cuda.local.array(CP, uint64)  # copy_to_rows' pairs
        hi = cuda.local.array(CP, uint64)
        vals = cuda.local.array(U, uint64)
        pdl.trigger_dependents()
        land_rows(d_ids, d_weights, d_counts, d_ranks, d_route, d_signal, land_sync, row_offsets, expert_counts,
                  row_src_rank, row_src_token, row_src_k, row_weight, row_gather, recv_tokens, token_rows, status,
                  pad_multiple, timeout_ns, d_tokens, expert_x, d_row_flag, copy_rows, combine_claims, tokens,
                  flag, sum_buf, place, src_T, claim, item_rows, lo, hi, vals)
        pdl.dependency_wait()  # completes after dispatch_async: stream order for what follows

    @kernel_jit(threads)
    def dispatch_copy(d_tokens, d_ids, d_counts, sync, token_rows, row_offsets, expert_counts,
                      expert_x, status, d_tokens8, expert_scales8, scales_col_major):
        """Copy each received token row once to all its expert rows; zero the padding rows.

        d_tokens [R, Tmax, W] words (symmetric: the rows of the last call), d_ids
        [G, R, Tmax, K], d_counts [G, R, L + 1]; token_rows, row_offsets, expert_counts as
        dispatch_wait wrote them; expert_x [C, W] words (output). Runs after dispatch_wait on
        the same stream (the launch boundary orders them) and reads only what it waited for.

        Token-major (``expand_rows``, ``COPY_PAIRS`` word pairs per lane in flight): a warp per
        received row part reads each word once and stores it to the token's n_local expert
        rows; then a warp per local expert zeroes its padding rows.

        FP8 token formats: d_tokens holds messages ([R, Tmax, MW] words; d_tokens8 a uint8
        view); the first ``P = expert_x.shape[1]`` words of each (the codes) go to expert_x as
        above, and the warp holding a row's first part lays its scale bytes out in
        expert_scales8 (a uint8 view of [C * S] scales, row-major, or column-major when
        scales_col_major, int64, is nonzero; ``store_scales``); padding rows get zero scales.
        """
        vals = cuda.local.array(U, uint64)
        lo = cuda.local.array(CP, uint64)  # copy_to_rows' pairs
        hi = cuda.local.array(CP, uint64)
        pdl.trigger_dependents()
        pdl.dependency_wait()  # nothing stream-ordered is read before this (kernels/pdl.py)
        if status[STATUS_CODE] != 0:
            return
        n = sync[SYNC_CALLS] - 1
        C = expert_x.shape[0]
        SBYTES = expert_scales8.shape[0] // C if C > 0 else 0  # scale bytes per row (FP8 formats)
        expand_rows(d_tokens, d_ids, d_counts, n % 2, token_rows, row_offsets, expert_counts, expert_x, status,
                    d_tokens8, expert_scales8, SBYTES, scales_col_major, lo, hi, vals)

    # each waits for its predecessor on the device first: launchable with PDL (dispatch_signal
    # follows a join with the side stream, a full dependency: launched without PDL)
    return (pdl.programmatic(dispatch_async), pdl.programmatic(dispatch_wait), pdl.programmatic(dispatch_copy),
            dispatch_signal, pdl.programmatic(dispatch_land))
