"""The dispatch kernels: ``dispatch_async`` (send), ``dispatch_wait`` (receive, place) and
``dispatch_copy`` (lay the received rows out expert-major).

Built by :func:`make_dispatch_kernels` for a block size (a compile-time constant: shared-memory
scans are sized by it). Symbols as in :mod:`ep_runtime.layout`; ``g = n % 2`` is the buffer
group of call ``n`` and ``me`` this rank; ``W = H / pack`` words per token row (token rows move
as words of ``pack`` bf16 values: :func:`ep_runtime.layout.token_word`). See docs/protocol.md
for the timeline. The host's ``dispatch_wait`` enqueues ``dispatch_wait`` then ``dispatch_copy``:
the kernel boundary is the grid-wide barrier between "every row's position is known" and
"copy each received row once to all its expert rows".
"""

from numba import int32, int64, uint32, uint64

from ep_runtime.config import MAX_RANKS
from ep_runtime.kernels import pdl, shmem
from ep_runtime.kernels.bits import f32_bits
from ep_runtime.kernels.block import (block_exclusive_scan, last_block_ticket, local_expert_count, part_bounds,
                                      part_words, popc32, record_error, row_parts, sched_advance, sched_initial,
                                      warp_exclusive_count, warp_geometry, warp_sum, warp_sync)
from ep_runtime.kernels.cuda_api import SIMULATED, cuda, kernel_jit
from ep_runtime.kernels.token_codec import BLOCK_WORDS, CODE_WORDS, make_token_codec
from ep_runtime.kernels.trace import stamp_first, stamp_last
from ep_runtime.kernels.vec import address_of, make_pair_loops, pairs_aligned, store_u32_at, store_u8_at
from ep_runtime.layout import (PEER_COUNTS, PEER_HIST, PEER_IDS, PEER_TOKENS, PEER_WEIGHTS, ROUTE_CHUNK_MIN,
                              SIGNAL_TOKEN_BITS, STATUS_CODE, SYNC_CALLS, SYNC_TICKET)
from ep_runtime.status import (COUNTER_DISPATCH_SIGNAL, COUNTER_RECV_ROWS, ERR_CAPACITY, ERR_TIMEOUT,
                               KERNEL_DISPATCH_WAIT)

#: Words of a row each lane loads before storing any in dispatch_copy (memory-level
#: parallelism: 64 bytes per lane, 32 KB per 512-thread block in flight); as word pairs
#: (``kernels/vec.py``) where rows allow it, ``COPY_UNROLL // 2`` pairs.
COPY_UNROLL = 8


#: Routing chunks per source rank, at most. A source's T tokens are cut into chunks of
#: ``chunk_tokens(T)`` tokens (:func:`make_dispatch_kernels`): about T / ROUTE_CHUNKS, rounded
#: up to whole warps and at least two warps, so dispatch_wait has L x R x ROUTE_CHUNKS walks
#: (2,048 for 128 local experts and 2 ranks: one per warp of a 132 x 16-warp grid) whatever
#: the batch size, each at most T / ROUTE_CHUNKS tokens long, and the sender's totals are sums
#: of at most ROUTE_CHUNKS histogram rows. (Chunks of a fixed 512 tokens left a T=128 batch
#: 256 walks of 4 steps; fixed 64-token chunks gave T=4096 64 histogram rows to sum.)
ROUTE_CHUNKS = 8


#: Local experts dispatch_wait places per pass over a routing chunk's tokens (``place_chunk``:
#: shared masks of warps x PLACE_WINDOW words, 8 KB at 16 warps): one pass for up to 128 local
#: experts on a GPU. The simulator's windows are 4 experts, so its small configurations take
#: several passes and the window arithmetic is tested on every run.
PLACE_WINDOW = 4 if SIMULATED else 128


def route_chunk_tokens(threads: int, n_tokens: int) -> int:
    """Tokens per routing chunk of a source that sends ``n_tokens`` tokens, for blocks of
    ``threads`` threads: ``ceil(n_tokens / ROUTE_CHUNKS)`` rounded up to whole warps, and at
    least two warps, so dispatch_wait's warp walks a chunk in steps of a warp (more than one
    step where a chunk is minimal, on every backend: the simulator's 8-thread blocks are one
    warp). Always more than :data:`ep_runtime.layout.ROUTE_CHUNK_MIN`, which the layout sizes
    the histograms for. The host-side twin of the kernels' ``chunk_tokens``."""
    warp, _ = warp_geometry(threads)
    per = -(-int(n_tokens) // ROUTE_CHUNKS)
    return max(-(-per // warp) * warp, 2 * warp, ROUTE_CHUNK_MIN)


def make_dispatch_kernels(threads: int, quantized: bool = False, ue8m0: bool = False):
    """Build ``(dispatch_async, dispatch_wait, dispatch_copy)`` for blocks of ``threads``
    threads (a power of 2), for bf16 tokens or (``quantized``) an FP8 token format with float32
    or (``ue8m0``) power-of-two scales (:mod:`ep_runtime.kernels.token_codec` encodes and lays
    out the messages; the protocol below is the same for every format)."""
    warp, warps = warp_geometry(threads)
    QUANT = bool(quantized)
    encode_blocks, store_scales = make_token_codec(warp, bool(ue8m0))
    SB = 1 if ue8m0 else 4  # scale bytes per 128-element block
    U = COPY_UNROLL
    UP = U // 2  # word pairs per lane in flight
    load_pairs, store_pairs, store_pairs_at = make_pair_loops(UP, warp)
    NCH = ROUTE_CHUNKS
    EW = PLACE_WINDOW
    MASK_WORDS = warps * EW  # place_chunk's shared arrays (a compile-time size)

    @cuda.jit(device=True)
    def chunk_tokens(n_tokens):
        """Tokens per routing chunk of a source sending ``n_tokens`` (``route_chunk_tokens``)."""
        per = (n_tokens + NCH - 1) // NCH
        return max((per + warp - 1) // warp * warp, 2 * warp)

    @cuda.jit(device=True)
    def source_chunks(n_tokens):
        """Routing chunks of a source that sent ``n_tokens`` tokens."""
        chunk = chunk_tokens(n_tokens)
        return (n_tokens + chunk - 1) // chunk

    @cuda.jit(device=True)
    def source_expert_rows(d_hist, g, s, e, src_chunks):
        """Tokens source ``s`` sent local expert ``e`` in group ``g``: the sum of its routing
        chunks' histogram rows; ``src_chunks[s]`` (shared) says how many chunks it sent this
        call (rows past them are stale)."""
        c = int64(0)
        for ch in range(src_chunks[s]):
            c += d_hist[g, s, ch, e]
        return c

    @cuda.jit(device=True)
    def expert_rows(d_hist, g, e, src_chunks):
        """Rows local expert ``e`` receives in group ``g``: its tokens from every source."""
        c = int64(0)
        for s in range(d_hist.shape[1]):
            c += source_expert_rows(d_hist, g, s, e, src_chunks)
        return c

    @cuda.jit(device=True)
    def padded(rows, pad_multiple):
        """``rows`` rounded up to a multiple of ``pad_multiple`` (an expert's segment size)."""
        if pad_multiple == 1:
            return rows
        return (rows + pad_multiple - 1) // pad_multiple * pad_multiple

    @cuda.jit(device=True)
    def scan_expert_rows(d_counts, d_hist, g, pad_multiple, per, run_first, sum_buf, src_chunks):
        """Every thread of the block: thread i sums the padded rows of local experts
        ``[i per, (i + 1) per)`` and the block scans the sums, so ``run_first[i]`` (shared,
        int64, one per thread) is the first batch row of expert ``i per``. Returns the total
        padded rows. Block 0 also writes each source's per-expert counts into
        ``d_counts[g, s, :L]`` (for the host and tests; no kernel reads them). Deterministic;
        every block computes it (none waits for another)."""
        R = d_counts.shape[1]
        L = d_counts.shape[2] - 1
        e_lo = min(cuda.threadIdx.x * per, L)
        part = int64(0)
        for e in range(e_lo, min(e_lo + per, L)):
            rows = int64(0)
            for s in range(R):
                x = source_expert_rows(d_hist, g, s, e, src_chunks)
                if cuda.blockIdx.x == 0:
                    d_counts[g, s, e] = x
                rows += x
            part += padded(rows, pad_multiple)
        prefix, total = block_exclusive_scan(sum_buf, part)
        run_first[cuda.threadIdx.x] = prefix
        cuda.syncthreads()
        return total

    @cuda.jit(device=True)
    def expert_first_row(d_hist, g, e, pad_multiple, per, run_first, src_chunks):
        """The first batch row of local expert ``e`` (after :func:`scan_expert_rows`): its
        run's first row plus the padded rows of the run's experts before it (none when there
        are no more local experts than threads)."""
        run = e // per
        row = run_first[run]
        for e2 in range(run * per, e):
            row += padded(expert_rows(d_hist, g, e2, src_chunks), pad_multiple)
        return row

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
    def send_prequantized(codes, scales8, b0, b1, PB, peer_bases, sent, slot, lane, lo, hi):
        """Every lane of one warp: the caller's E4M3 code words of blocks ``[b0, b1)`` (``codes``:
        the token's row of uint64 words, 16-byte aligned) and their scale bytes (``scales8``:
        the token's row of scale bytes) stored into the receive slot of every rank whose bit is
        set in ``sent``, at byte ``slot`` past ``peer_bases[PEER_TOKENS, d]``; each word pair loaded once."""
        w1 = b1 * CODE_WORDS
        w = b0 * CODE_WORDS + 2 * lane
        while w < w1:
            load_pairs(codes, w, w1, lo, hi)
            for d in range(peer_bases.shape[1]):
                if (sent >> uint64(d)) & uint64(1):
                    store_pairs_at(peer_bases[PEER_TOKENS, d] + slot, w, w1, lo, hi)
            w += 2 * UP * warp
        scales_at = slot + uint64(PB)  # uint64 + uint64 (an int64 term would make it float64)
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
    def place_chunk(d_ids, d_weights, d_hist, g, s, c, T_s, first_mine, pad_multiple, per, run_first,
                    src_chunks, masks, warp_rows, next_row, row_src_rank, row_src_token, row_src_k,
                    row_weight, row_gather, token_rows, copy, d_tokens, expert_x, W, pairs, hit_row,
                    hit_token, scan_buf, lo, hi):
        """Every thread of the block: give each (token, local expert) pair of routing chunk ``c``
        of source ``s`` (which sent ``T_s`` tokens) its batch row, and write the row's
        description (dispatch_wait's outputs; with ``copy``, the received row into it).

        Token-major: each token's routing row is read once per window of ``EW`` local experts
        (one window for up to ``EW`` local experts), a thread per token. A round takes the
        block's ``threads`` consecutive tokens: (1) each lane sets its bit in the shared mask
        of each of its token's local experts for its warp (``masks[warp, expert]``, shared
        atomic OR); (2) a thread per expert turns the masks into each warp's first row for the
        expert (``warp_rows``), in warp order, starting from the expert's first row for this
        round (``next_row``: the expert's first row, plus its rows from earlier sources and
        from earlier chunks of this source, from the histograms; then the earlier rounds');
        (3) a lane's row for an expert is its warp's first row plus the lanes below it with
        the expert (the mask's bits below the lane). Rows therefore follow token order within
        the expert and source, as the reference's: no atomic decides a position (the OR's
        result does not depend on its order). ``masks``, ``warp_rows``: shared [warps * EW];
        ``next_row``: shared [EW].
        """
        tid = cuda.threadIdx.x
        lane = tid % warp
        wid = tid // warp
        lanes_below = (uint32(1) << uint32(lane)) - uint32(1)
        L = d_hist.shape[3]
        K = d_ids.shape[3]
        Tmax = d_ids.shape[2]
        chunk = chunk_tokens(T_s)
        t0 = c * chunk
        t1 = min(t0 + chunk, T_s)
        ids_s = d_ids[g, s]
        for w0 in range(0, L, EW):
            for el in range(tid, EW, threads):
                e = w0 + el
                if e < L:
                    row = expert_first_row(d_hist, g, e, pad_multiple, per, run_first, src_chunks)
                    for s2 in range(s):
                        row += source_expert_rows(d_hist, g, s2, e, src_chunks)
                    for c2 in range(c):
                        row += d_hist[g, s, c2, e]
                    next_row[el] = int32(row)
            for m in range(tid, warps * EW, threads):
                masks[m] = uint32(0)
            cuda.syncthreads()
            lo_id = first_mine + w0  # the window's global expert ids: [lo_id, lo_id + EW) and local
            hi_id = first_mine + min(w0 + EW, L)
            for tb in range(t0, t1, threads):
                t = tb + tid
                valid = t < t1
                # (1) this lane's bit in its warp's mask of each of its token's experts in the window
                if valid:
                    for k in range(K):
                        x = ids_s[t, k]
                        if x >= lo_id and x < hi_id:
                            cuda.atomic.or_(masks, wid * EW + (x - lo_id), uint32(1) << uint32(lane))
                cuda.syncthreads()
                # (2) a thread per expert: each warp's first row for it, warps in order
                for el in range(tid, EW, threads):
                    row = next_row[el]
                    for w in range(warps):
                        warp_rows[w * EW + el] = row
                        row += popc32(masks[w * EW + el])
                    next_row[el] = row
                cuda.syncthreads()
                # (3) each hit's row: the warp's first row plus the lanes below with the expert
                for k in range(K):
                    hit = False
                    r = int32(0)
                    if valid:
                        x = ids_s[t, k]
                        if x >= lo_id and x < hi_id:
                            hit = True
                            m = wid * EW + (x - lo_id)
                            r = warp_rows[m] + popc32(masks[m] & lanes_below)
                            j = 0  # rank of the expert among the token's local experts (ascending)
                            for k2 in range(K):
                                x2 = ids_s[t, k2]
                                if x2 >= first_mine and x2 < x:
                                    j += 1
                            describe_row(r, s, t, k, j, Tmax, d_weights[g, s, t, k], row_src_rank, row_src_token,
                                         row_src_k, row_weight, row_gather, token_rows)
                    if copy:  # the warp's hits of slot k
                        nb, hits = warp_exclusive_count(hit, scan_buf)
                        copy_warp_hits(hit, r, t, nb, hits, d_tokens[g, s], expert_x, W, pairs, hit_row, hit_token,
                                       lane, lo, hi)
                cuda.syncthreads()  # every mask read before the next round clears it
                for m in range(tid, warps * EW, threads):
                    masks[m] = uint32(0)
                cuda.syncthreads()

    @kernel_jit(threads)
    def dispatch_async(tokens, topk_ids, topk_weights, valid_tokens, use_valid,
                       d_tokens, d_ids, d_weights, d_counts, d_hist, d_signal,
                       sync, send_hist, send_count, status,
                       token_scales, prequantized, stage64, stage32, stage8, d_tokens8, peer_bases, peer_stores):
        """Send this rank's tokens, once per destination rank, and signal each destination.

        tokens [Tc, W] words, topk_ids [Tc, K] int32, topk_weights [Tc, K] float32: this rank's
        batch; its first T rows are sent, T = Tc, or ``min(Tc, valid_tokens[0])`` when
        use_valid (int64) is nonzero (valid_tokens [1] int32 on the device: one CUDA graph
        captured at capacity serves any batch size). Symmetric: d_tokens [G, R, Tmax, W],
        d_ids/d_weights [G, R, Tmax, K], d_counts [G, R, L + 1] int32 (this call stores only
        ``[g, me, L]``, the token count), d_hist [G, R, NC, L] int32, d_signal [G, R] uint64
        (set to ``(n + 1) << 32 | T``: ``layout.dispatch_signal_value``).
        Local: sync [2] int64, send_hist [R, NC, L] int32 (scratch: a routing block zeroes its
        chunk's rows before counting), send_count [1] int32, status [8] int64. FP8 token
        formats only (empty otherwise): token_scales [Tc, S * SB] uint8 (the caller's scales' bytes, when
        prequantized, int64, is nonzero: then tokens are [Tc, P] code words), the message stage
        [Tmax, MW] as uint64, uint32 and uint8 views (stage64/32/8); d_tokens is then [G, R,
        Tmax, MW] messages, d_tokens8 their uint8 view. peer_bases [2, R] uint64: row 0 the
        address of d_tokens on each PE as mapped here (``Session.peer_addresses``), used when
        peer_stores (int64) is nonzero.

        (1) Each warp takes items (grid-strided): part of token row t (``row_parts``: whole rows
        for large batches) and puts it into slot [g, me, t] of every rank that holds one of the
        token's experts: with peer_stores (bf16 rows of uint64 words), 16-byte stores through
        the NVLink mappings, each word pair loaded once for all destinations; otherwise
        ``put_nbi_warp`` (a warp-wide copy) per destination. In an FP8 format a part is a run
        of 128-element blocks: with peer_stores the warp encodes it straight into every
        destination's slot (``encode_blocks``: 4-byte stores of 4 codes, the blocks' scales;
        pre-quantized input: ``send_prequantized``, the caller's code word pairs and scale
        bytes); otherwise it encodes it into stage row t, then puts its codes and its scale
        bytes (pre-quantized input: straight from the caller's arrays, no stage). The
        message's padding is never sent.
        (2) Each block takes routing chunks of ``chunk_tokens(T)`` tokens (at most
        ``ROUTE_CHUNKS`` of them; chunk 0 in the last block): sends their routing rows to every
        rank, counts the chunk's tokens per expert into send_hist[:, c] and sends each rank its
        experts' row of that histogram (dispatch_wait places a chunk's tokens from it, with no
        scan over other chunks, and sums a source's per-expert counts from its chunks' rows).
        (3) The last block (ticket) signals every rank (every block fenced and quieted first:
        data before signal; the value is ``(n + 1) << 32 | T``) and advances the call counter.
        Nobody waits. With peer_stores, (2) is 4-byte stores by the whole block into the peers' regions (rows
        ``PEER_IDS`` ... of peer_bases; the last block of the grid also stores T into each
        peer's ``d_counts[g, me, L]``) and (3) one ``signal_op`` per rank; otherwise NVSHMEM
        block puts, and (3) one ``put_signal`` per rank carrying T (staged in send_count).
        Traced on one H200 (T=1): one thread's ``put_signal`` of 257 counts took 6.5 us, the
        block puts of (2) 4.7 us, and summing the histograms into counts in the last block, after
        the ticket, 2.0 us: each is gone from the path to the signal.
        """
        flag = cuda.shared.array(1, int32)
        lo = cuda.local.array(UP, uint64)
        hi = cuda.local.array(UP, uint64)
        pdl.trigger_dependents()
        pdl.dependency_wait()  # nothing stream-ordered is read before this (kernels/pdl.py)
        if status[STATUS_CODE] != 0:
            return  # an earlier call failed: send nothing, so peers time out naming this rank
        stamp_first(status, 0)
        me = shmem.my_pe()
        R = d_counts.shape[1]
        L = d_counts.shape[2] - 1
        K = topk_ids.shape[1]
        W = tokens.shape[1]
        T = tokens.shape[0]
        if use_valid != 0:
            T = max(0, min(T, valid_tokens[0]))
        tid = cuda.threadIdx.x
        n = sync[SYNC_CALLS]
        g = n % 2

        # (1) token rows, deduplicated per destination rank, a warp per row part
        all_warps = cuda.gridDim.x * warps
        if QUANT:  # a warp per part of a token (a run of 128-element blocks): encode once, put to each rank
            mbuf = cuda.shared.array(threads, int64)  # the simulator's warp-max scratch
            lane = tid % warp
            if prequantized != 0:
                S = tokens.shape[1] // CODE_WORDS
            else:
                S = tokens.shape[1] // BLOCK_WORDS
            PB = S * CODE_WORDS * 8  # code bytes of a message (= H)
            parts = row_parts(T, S, all_warps, 1)
            span = part_words(S, parts, 1)  # blocks per part
            # straight into peers' slots: encoded (4-byte stores), or the caller's codes (word pairs)
            direct = peer_stores != 0 and (prequantized == 0 or (d_tokens.shape[3] % 2 == 0 and pairs_aligned(tokens)
                                                                 and pairs_aligned(d_tokens)))
            i = cuda.blockIdx.x * warps + tid // warp
            while i < T * parts:
                t, b0, b1 = part_bounds(i, parts, span, S)
                if b0 < b1:
                    sent = uint64(0)  # bit d: the token goes to rank d
                    for k in range(K):
                        sent |= uint64(1) << uint64(topk_ids[t, k] // L)
                    if direct:
                        slot = address_of(d_tokens[g, me, t]) - address_of(d_tokens)  # the same on every PE
                        if prequantized == 0:
                            encode_blocks(tokens, t, b0, b1, stage32, stage8, PB, lane, mbuf, peer_bases, sent, slot)
                        else:
                            send_prequantized(tokens[t], token_scales[t], b0, b1, PB, peer_bases, sent, slot, lane,
                                              lo, hi)
                    else:
                        if prequantized == 0:
                            encode_blocks(tokens, t, b0, b1, stage32, stage8, PB, lane, mbuf, peer_bases, uint64(0),
                                          uint64(0))
                            warp_sync()  # the part is staged before the warp's puts read it
                        for d in range(R):
                            if (sent >> uint64(d)) & uint64(1):
                                dst_codes = d_tokens[g, me, t, b0 * CODE_WORDS:b1 * CODE_WORDS]
                                dst_scales = d_tokens8[g, me, t, PB + b0 * SB:PB + b1 * SB]
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
        parts = row_parts(T_parts, W, all_warps, warp)
        span = part_words(W, parts, warp)
        direct = (peer_stores != 0 and tokens.itemsize == 8 and W % 2 == 0 and pairs_aligned(tokens)
                  and pairs_aligned(d_tokens))
        lane = tid % warp
        i = cuda.blockIdx.x * warps + tid // warp
        while i < T_parts * parts:
            t, w0, w1 = part_bounds(i, parts, span, W)
            if w0 < w1:
                sent = uint64(0)  # bit d: this part goes to rank d
                for k in range(K):
                    d = topk_ids[t, k] // L
                    if (sent >> uint64(d)) & uint64(1) == uint64(0):
                        sent |= uint64(1) << uint64(d)
                        if not direct:
                            shmem.put_nbi_warp(d_tokens[g, me, t, w0:w1], tokens[t, w0:w1], d)
                if direct:  # UP word pairs per lane loaded once, stored to every destination
                    src = tokens[t]
                    slot = address_of(d_tokens[g, me, t]) - address_of(d_tokens)  # the same on every PE
                    w = w0 + 2 * lane
                    while w < w1:
                        load_pairs(src, w, w1, lo, hi)
                        for d in range(R):
                            if (sent >> uint64(d)) & uint64(1):
                                store_pairs_at(peer_bases[PEER_TOKENS, d] + slot, w, w1, lo, hi)
                        w += 2 * UP * warp
            i += all_warps

        stamp_last(status, 1)

        # (2) routing rows to every rank, and each routing chunk's per-expert histogram
        chunk = chunk_tokens(T)
        meta_stores = peer_stores != 0  # routing, histograms, token count: 4-byte stores into peers
        if meta_stores and cuda.blockIdx.x == cuda.gridDim.x - 1:  # T, even when 0 (no chunk then)
            counts_at = address_of(d_counts[g, me]) - address_of(d_counts)
            for d in range(tid, R, threads):
                store_u32_at(peer_bases[PEER_COUNTS, d] + counts_at, L, uint32(T))
        # chunks from the last block down: at decode sizes (1) leaves the high blocks idle, so
        # the routing runs beside the token rows instead of after them in block 0
        c = sched_initial(cuda.gridDim.x - 1 - cuda.blockIdx.x)
        while c * chunk < T:
            t0 = c * chunk
            t1 = min(t0 + chunk, T)
            if meta_stores:  # rows t0..t1 are contiguous on both sides: element j of the run
                ids_at = address_of(d_ids[g, me, t0]) - address_of(d_ids)
                weights_at = address_of(d_weights[g, me, t0]) - address_of(d_weights)
                for j in range(tid, (t1 - t0) * K, threads):
                    t = t0 + j // K
                    k = j - (t - t0) * K
                    x = uint32(topk_ids[t, k])
                    wbits = f32_bits(topk_weights[t, k])
                    for d in range(R):
                        store_u32_at(peer_bases[PEER_IDS, d] + ids_at, j, x)
                        store_u32_at(peer_bases[PEER_WEIGHTS, d] + weights_at, j, wbits)
            else:
                for d in range(R):
                    shmem.put_nbi_block(d_ids[g, me, t0:t1], topk_ids[t0:t1], d)
                    shmem.put_nbi_block(d_weights[g, me, t0:t1], topk_weights[t0:t1], d)
            for i in range(tid, R * L, threads):  # this chunk's rows are the block's own scratch
                send_hist[i // L, c, i - i // L * L] = 0
            cuda.syncthreads()  # zeroed before any thread counts into them
            for t in range(t0 + tid, t1, threads):
                for k in range(K):
                    x = topk_ids[t, k]
                    d = x // L
                    cuda.atomic.add(send_hist, (d, c, x - d * L), int32(1))
            cuda.syncthreads()  # the chunk's histogram is complete before the block sends it
            if meta_stores:
                hist_at = address_of(d_hist[g, me, c]) - address_of(d_hist)
                for i in range(tid, R * L, threads):
                    d = i // L
                    e = i - d * L
                    store_u32_at(peer_bases[PEER_HIST, d] + hist_at, e, uint32(send_hist[d, c, e]))
            else:
                for d in range(R):
                    shmem.put_nbi_block(d_hist[g, me, c], send_hist[d, c], d)
            c = sched_advance(c, cuda.gridDim.x)
        stamp_last(status, 2)

        # (3) the last block signals every rank (with the token count, on the puts path), then
        # advances the call counter; receivers sum the chunk histograms into counts themselves
        if last_block_ticket(sync[SYNC_TICKET:SYNC_TICKET + 1], flag):
            stamp_last(status, 3)
            if not meta_stores:
                if tid == 0:
                    send_count[0] = T
                cuda.syncthreads()  # staged before the threads below put it
            signal = (uint64(n + 1) << uint64(SIGNAL_TOKEN_BITS)) | uint64(T)  # layout.dispatch_signal_value
            for d in range(tid, R, threads):
                if meta_stores:
                    shmem.signal_op(d_signal[g, me:me + 1], signal, shmem.SIGNAL_SET, d)
                else:
                    shmem.put_signal(d_counts[g, me, L:L + 1], send_count, d_signal[g, me:me + 1],
                                     signal, shmem.SIGNAL_SET, d)
            if tid == 0:
                sync[SYNC_TICKET] = 0
                sync[SYNC_CALLS] = n + 1
            stamp_last(status, 6)

    @kernel_jit(threads)
    def dispatch_wait(d_ids, d_weights, d_counts, d_hist, d_signal, sync,
                      row_offsets, expert_counts, row_src_rank, row_src_token, row_src_k,
                      row_weight, row_gather, token_rows, status, pad_multiple, timeout_ns,
                      d_tokens, expert_x, copy_rows, place_by_token):
        """Wait for every source rank, then place every received (token, local expert) pair.

        Symmetric inputs as in dispatch_async (group g of the last call); d_hist [G, R, NC, L]
        int32: per source, tokens of each routing chunk (``chunk_tokens(T_s)`` tokens) per
        local expert.
        Outputs (local): row_offsets [L + 1] int32, expert_counts [L] int32, row_src_rank /
        row_src_token / row_src_k [C] int32, row_weight [C] float32, row_gather [C] int32 (the
        row's slot in the receive buffer, ``src * Tmax + t``: the compact layout's gather
        index; padding rows: -1, -1, -1, 0, -1), and token_rows [R, Tmax, K] int32 (row of the
        j-th local expert of token (src, t), for dispatch_copy and combine_async).
        pad_multiple, timeout_ns: int64. copy_rows (int64; bf16 builds only): nonzero for the
        expanded layout in one kernel (decode sizes; ``EPRuntime.fused_copy``): each walking warp
        also copies every hit's received row, d_tokens [G, R, Tmax, W] words, to its row of
        expert_x [C, W] words, and the expert warps zero the padding rows, so no dispatch_copy
        follows (a row is read once per local expert instead of once: the token-major
        dispatch_copy stays the better choice for large batches). place_by_token (int64):
        how (b) below places the rows (``EPRuntime.placement``: zero walks, nonzero by token).

        Every block waits for all R signals itself (each carries its source's token count, so
        no load follows the wait before the histograms), scans the local experts' padded row
        counts (a thread per run of experts, one block scan: every expert's first row; no block
        depends on another) and checks the capacity. Then a warp per local expert (from the
        last block down) writes its offset, count and padding rows, and a block per (source,
        routing chunk) (from block 0 up) gives each of the chunk's (token, local expert) pairs
        its row, reading each token's routing row once (``place_chunk``). Deterministic: rows
        by expert, source rank, source token; no atomic decides a position. A wait past
        timeout_ns or more rows than C records an error and writes nothing (dispatch_copy then
        copies nothing).
        """
        flag = cuda.shared.array(1, int32)
        scan_buf = cuda.shared.array(threads, int32)
        sum_buf = cuda.shared.array(threads, int64)
        run_first = cuda.shared.array(threads, int64)
        hit_row = cuda.shared.array(threads, int32)  # fused copy: each warp's hits of one step
        hit_token = cuda.shared.array(threads, int32)
        masks = cuda.shared.array(MASK_WORDS, uint32)  # place_chunk: [warp, expert] lanes with the expert
        warp_rows = cuda.shared.array(MASK_WORDS, int32)  # [warp, expert] the warp's first row
        next_row = cuda.shared.array(EW, int32)  # [expert] the next round's first row
        src_tokens = cuda.shared.array(MAX_RANKS, int32)  # tokens each source sent this call
        src_chunks = cuda.shared.array(MAX_RANKS, int32)  # and their routing chunks
        lo = cuda.local.array(UP, uint64)
        hi = cuda.local.array(UP, uint64)
        pdl.trigger_dependents()
        pdl.dependency_wait()  # nothing stream-ordered is read before this (kernels/pdl.py)
        if status[STATUS_CODE] != 0:
            return
        stamp_first(status, 8)
        me = shmem.my_pe()
        R = d_counts.shape[1]
        L = d_counts.shape[2] - 1
        K = d_ids.shape[3]
        Tmax = d_ids.shape[2]
        C = row_src_rank.shape[0]
        tid = cuda.threadIdx.x
        n = sync[SYNC_CALLS] - 1
        g = n % 2

        # wait for every source rank's signal (thread s waits for rank s)
        if tid == 0:
            flag[0] = 0
        cuda.syncthreads()
        want = uint64(n + 1) << uint64(SIGNAL_TOKEN_BITS)  # call n's signal, any token count
        for s in range(tid, R, threads):
            seen = shmem.wait_signal_ge(d_signal[g, s:s + 1], want, timeout_ns)
            if seen < want:
                record_error(status, ERR_TIMEOUT, KERNEL_DISPATCH_WAIT, me, s, COUNTER_DISPATCH_SIGNAL,
                             n + 1, int64(seen >> uint64(SIGNAL_TOKEN_BITS)), n + 1)
                flag[0] = 1
            src_tokens[s] = int32(seen & uint64(0xFFFFFFFF))  # T of source s, with its signal
            src_chunks[s] = source_chunks(src_tokens[s])  # (stale on a timeout: then unused)
        cuda.threadfence_system()
        cuda.syncthreads()
        if flag[0] != 0:
            return
        stamp_last(status, 9)

        # every expert's first row and the total (padded): every block scans them itself
        per = (L + threads - 1) // threads  # local experts per thread
        total = scan_expert_rows(d_counts, d_hist, g, pad_multiple, per, run_first, sum_buf, src_chunks)
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
        pairs = W % 2 == 0 and d_tokens.shape[3] % 2 == 0 and pairs_aligned(d_tokens) and pairs_aligned(expert_x)

        # (a) a warp per local expert, from the grid's last block down (the first blocks place
        # the routing chunks): offset, count, padding rows (source -1, weight 0; their data
        # zeroed by dispatch_copy, or here when copying)
        e = (cuda.gridDim.x - 1 - cuda.blockIdx.x) * warps + tid // warp
        while e < L:
            base = expert_first_row(d_hist, g, e, pad_multiple, per, run_first, src_chunks)
            count = expert_rows(d_hist, g, e, src_chunks)
            end = base + padded(count, pad_multiple)
            for r in range(base + count + lane, end, warp):
                row_src_rank[r] = -1
                row_src_token[r] = -1
                row_src_k[r] = -1
                row_weight[r] = 0.0
                row_gather[r] = -1
            if copy:
                for r in range(base + count, end):
                    for w in range(lane, W, warp):
                        expert_x[r, w] = 0
            if lane == 0:
                row_offsets[e] = base
                expert_counts[e] = count
            e += all_warps
        stamp_last(status, 10)

        # (b) every (token, local expert) pair's row: ``place_by_token`` zero, a warp per (local
        # expert, source, routing chunk) walks the chunk's tokens 32 at a time and gives each
        # hit its row: the expert's offset, plus the expert's tokens from earlier sources and
        # earlier chunks of this source (both from the histograms), plus the hits of lower lanes
        # (one ballot): the shortest path when the grid has a warp for every walk. Nonzero: a
        # block per (source, routing chunk) reads each token's routing row once
        # (``place_chunk``): the work is L times smaller, but each chunk is one block's chain.
        first_mine = me * L  # global id of local expert 0
        if place_by_token != 0:
            i = cuda.blockIdx.x
            while i < R * NCH:
                s = i // NCH
                c = i - s * NCH
                if c < src_chunks[s]:
                    place_chunk(d_ids, d_weights, d_hist, g, s, c, src_tokens[s], first_mine, pad_multiple, per,
                                run_first, src_chunks, masks, warp_rows, next_row, row_src_rank, row_src_token,
                                row_src_k, row_weight, row_gather, token_rows, copy, d_tokens, expert_x, W,
                                pairs, hit_row, hit_token, scan_buf, lo, hi)
                i += cuda.gridDim.x
            stamp_last(status, 11)
            return
        i = cuda.blockIdx.x * warps + tid // warp
        while i < L * R * NCH:
            e = i // (R * NCH)
            s = (i - e * R * NCH) // NCH
            c = i - (e * R + s) * NCH
            T_s = src_tokens[s]
            chunk = chunk_tokens(T_s)
            t0 = c * chunk
            if c < src_chunks[s] and d_hist[g, s, c, e] > 0:
                # first row: e's first row, plus e's rows from sources < s and from chunks < c
                # of source s (the lanes sum their shares, one warp reduction)
                part = int64(0)
                for s2 in range(lane, s, warp):
                    part += source_expert_rows(d_hist, g, s2, e, src_chunks)
                for c2 in range(lane, c, warp):
                    part += d_hist[g, s, c2, e]
                row = expert_first_row(d_hist, g, e, pad_multiple, per, run_first, src_chunks)
                row += warp_sum(part, sum_buf)
                e_global = first_mine + e
                ids_s = d_ids[g, s]
                t1 = min(t0 + chunk, T_s)
                for tb in range(t0, t1, warp):
                    t = tb + lane
                    k_hit = -1
                    j = 0  # rank of e among the token's local experts (ascending)
                    if t < t1:
                        ids_t = ids_s[t]
                        for k in range(K):
                            x = ids_t[k]
                            if x == e_global:
                                k_hit = k
                            elif x >= first_mine and x < e_global:  # a local expert below e
                                j += 1
                    below, hits = warp_exclusive_count(k_hit >= 0, scan_buf)
                    r = row + below
                    if k_hit >= 0:
                        describe_row(r, s, t, k_hit, j, Tmax, d_weights[g, s, t, k_hit], row_src_rank,
                                     row_src_token, row_src_k, row_weight, row_gather, token_rows)
                    if copy:  # the step's hits
                        copy_warp_hits(k_hit >= 0, r, t, below, hits, d_tokens[g, s], expert_x, W, pairs, hit_row,
                                       hit_token, lane, lo, hi)
                    row += hits
            i += all_warps
        stamp_last(status, 11)

    @kernel_jit(threads)
    def dispatch_copy(d_tokens, d_ids, d_counts, sync, token_rows, row_offsets, expert_counts,
                      expert_x, status, d_tokens8, expert_scales8, scales_col_major):
        """Copy each received token row once to all its expert rows; zero the padding rows.

        d_tokens [G, R, Tmax, W] words (symmetric, group g of the last call), d_ids
        [G, R, Tmax, K], d_counts [G, R, L + 1]; token_rows, row_offsets, expert_counts as
        dispatch_wait wrote them; expert_x [C, W] words (output). Runs after dispatch_wait on
        the same stream (the launch boundary orders them) and reads only what it waited for.

        Token-major: a warp per received row part (``row_parts``: whole rows for large batches)
        reads each word once and stores it to the token's n_local expert rows, ``COPY_UNROLL``
        words per lane in flight.
        Then a warp per local expert zeroes its padding rows.

        FP8 token formats: d_tokens holds messages ([G, R, Tmax, MW] words; d_tokens8 a uint8
        view); the first ``P = expert_x.shape[1]`` words of each (the codes) go to expert_x as
        above, and the warp holding a row's first part lays its scale bytes out in
        expert_scales8 (a uint8 view of [C * S] scales, row-major, or column-major when
        scales_col_major, int64, is nonzero; ``store_scales``); padding rows get zero scales.
        """
        vals = cuda.local.array(U, uint64)
        lo = cuda.local.array(UP, uint64)
        hi = cuda.local.array(UP, uint64)
        pdl.trigger_dependents()
        pdl.dependency_wait()  # nothing stream-ordered is read before this (kernels/pdl.py)
        if status[STATUS_CODE] != 0:
            return
        stamp_first(status, 12)
        me = shmem.my_pe()
        R = d_counts.shape[1]
        L = d_counts.shape[2] - 1
        W = expert_x.shape[1]
        C = expert_x.shape[0]
        # rows as word pairs (one 16-byte access for uint64 words) when every row starts aligned
        pairs = W % 2 == 0 and d_tokens.shape[3] % 2 == 0 and pairs_aligned(d_tokens) and pairs_aligned(expert_x)
        SBYTES = expert_scales8.shape[0] // C if C > 0 else 0  # scale bytes per row (FP8 formats)
        n = sync[SYNC_CALLS] - 1
        g = n % 2
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
                src = d_tokens[g, s, t]
                w = w0 + 2 * lane
                while pairs and w < w1:  # UP pairs per lane loaded before any is stored (w0, w1 even)
                    load_pairs(src, w, w1, lo, hi)
                    for j in range(n_local):
                        store_pairs(expert_x[token_rows[s, t, j]], w, w1, lo, hi)
                    w += 2 * UP * warp
                w = w0 + lane
                while not pairs and w < w1:  # U words per lane loaded before any is stored
                    for u in range(U):
                        if w + u * warp < w1:
                            vals[u] = src[w + u * warp]
                    for j in range(n_local):
                        dst = expert_x[token_rows[s, t, j]]
                        for u in range(U):
                            if w + u * warp < w1:
                                dst[w + u * warp] = vals[u]
                    w += U * warp
                if QUANT and w0 == 0:
                    for j in range(n_local):
                        store_scales(d_tokens8[g, s, t], W * 8, SBYTES, expert_scales8, token_rows[s, t, j], C,
                                     scales_col_major, lane, 0)
                i += all_warps

        e = first_warp
        while e < L:
            for r in range(row_offsets[e] + expert_counts[e], row_offsets[e + 1]):
                for w in range(lane, W, warp):
                    expert_x[r, w] = 0
                if QUANT:
                    store_scales(d_tokens8[g, 0, 0], W * 8, SBYTES, expert_scales8, r, C, scales_col_major, lane, 1)
            e += all_warps
        stamp_last(status, 13)

    # each waits for its predecessor on the device first: launchable with PDL
    return pdl.programmatic(dispatch_async), pdl.programmatic(dispatch_wait), pdl.programmatic(dispatch_copy)
