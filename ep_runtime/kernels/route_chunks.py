"""Route-first placement for large batches: each placing block ranks a chunk of the tokens.

A chunked route-first dispatch_wait (``Receiver.ROUTE_FIRST_CHUNKED``) launches a few placing
blocks; from ``chunk_from_tokens`` received tokens, instead of every block ranking every token,
block ``b`` ranks and describes chunk ``b`` of them, starting each local expert's ranks from the
rows before the chunk (a shared-memory histogram of every received id). The rows are the same
as the unchunked placement's: the reference's order.

:func:`make_route_chunks` builds ``place_by_chunks`` for a block size.
"""

import functools

from ep_runtime.kernels.block import record_error, warp_geometry
from ep_runtime.kernels.cuda_api import cuda, float32, int32, shared_atomic, uint64
from ep_runtime.kernels.layouts.expert_major import make_placement
from ep_runtime.kernels.protocol import COUNTER_RECV_ROWS, ERR_CAPACITY, KERNEL_DISPATCH_WAIT
from ep_runtime.kernels.ranking import ID_BATCH, RECV_WINDOW, make_ranking
from ep_runtime.kernels.trace import stamp_last
from ep_runtime.kernels.vec import address_of, load_u32_at, load_u32x4_at

#: 16-byte loads of received expert ids (four ids each) every thread of a placing block issues
#: before it counts any: independent loads in flight instead of one latency per id, which the
#: sender's traffic makes long while the token rows fly.
COUNT_QUADS = 4
COUNT_IDS = 4 * COUNT_QUADS


@functools.lru_cache(maxsize=None)
def make_route_chunks(threads: int):
    """``place_by_chunks`` for blocks of ``threads`` threads."""
    warp, warps = warp_geometry(threads)
    RW = RECV_WINDOW
    place_fns, rank_fns = make_placement(threads), make_ranking(threads)
    first_rows, write_segments, token_of = place_fns.first_rows, place_fns.write_segments, place_fns.token_of
    load_token, rank_round, describe_round = rank_fns.load_token, rank_fns.rank_round, rank_fns.describe_round

    @cuda.jit(device=True)
    def count_received_id(place, x, j, before, first_mine, R, L):
        """The count of received id ``x``, element ``j`` of its source's run: if its expert is
        local, one more row of it (``place[R L + e]``) and, when ``j < before`` (a token before
        the chunk), one more before the chunk (``place[L + e]``)."""
        e = x - first_mine
        if e >= 0 and e < L:
            shared_atomic.add(place, R * L + e, int32(1))
            if j < before:
                shared_atomic.add(place, L + e, int32(1))

    @cuda.jit(device=True)
    def place_by_chunks(d_ids, d_weights, g, n, me, R, L, K, Tmax, C, status, pad_multiple, row_offsets, expert_counts,
                        row_src_rank, row_src_token, row_src_k, row_weight, row_gather, token_rows, src_T, Q, place,
                        sum_buf, masks, warp_rows, next_rank, share, shares):
        """Every thread of placing block ``share`` of ``shares`` (R >= 2, every source's routing
        here): rank and describe the received tokens ``[share q, (share + 1) q)`` of the ``Q``
        (source 0's first, ``q = ceil(Q / shares)``).

        One pass over every received id (four to a 16-byte load where a source's run is
        aligned) counts each local expert's rows and those before the chunk (shared-memory
        atomics: counts, so no order matters; the expert's rows in ``place[R L + e]``, those
        before the chunk in ``place[L + e]``, a part of the table route-first placement leaves
        unused when R >= 2); the first warp scans the rows into first rows (``first_rows``,
        every block alike, with the offsets and counts); the padding rows are described a warp
        per expert over the blocks; then the chunk's tokens go in rounds (``rank_round``) from
        the rows before it, each (token, local expert)'s row = the expert's first row + its rank
        among every received token with that expert, in (source, token) order. Returns whether
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

    return place_by_chunks
