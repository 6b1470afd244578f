"""Route-first placement: a receiver that places every row from the routing rows alone.

With ``Receiver.ROUTE_FIRST`` (and ``ROUTE_FIRST_CHUNKED``) the senders send and signal their
routing rows (ids, weights) before their token rows (``dispatch_route_signal``); dispatch_wait's
few placing blocks, started early by PDL on the SMs dispatch_async leaves, rank and describe
every received row from them while the token rows still fly, then wait for the dispatch signals.
No rank or count comes from the senders: the receiver ranks every received token in (source,
token) order, the reference's order, with no atomic deciding a position (ep_runtime/kernels/ranking.py).

:func:`make_route_first` builds the device functions for a variant's block size, chunking and
thresholds.
"""

import functools
from types import SimpleNamespace

from ep_runtime.kernels import shmem
from ep_runtime.kernels.block import record_error, warp_geometry
from ep_runtime.kernels.cuda_api import cuda, float32, int32, int64, uint64
from ep_runtime.kernels.layouts.expert_major import make_placement
from ep_runtime.kernels.protocol import (COUNTER_DISPATCH_PLACED, COUNTER_DISPATCH_SIGNAL, COUNTER_RECV_ROWS,
                                         COUNTER_ROUTE_SIGNAL, ERR_CAPACITY, ERR_TIMEOUT, KERNEL_DISPATCH_WAIT)
from ep_runtime.kernels.ranking import ID_BATCH, RECV_WINDOW, make_ranking
from ep_runtime.kernels.receive import make_receive
from ep_runtime.kernels.route_chunks import make_route_chunks
from ep_runtime.kernels.trace import stamp_last


@functools.lru_cache(maxsize=None)
def make_route_first(threads: int, chunked: bool, share_from_tokens: int, chunk_from_tokens: int) -> SimpleNamespace:
    """``place_from_routing``, ``publish_placed`` and ``await_placed_rows`` for blocks of
    ``threads`` threads; ``chunked``: the blocks rank a chunk each from ``chunk_from_tokens``
    received tokens; ``share_from_tokens``: the blocks share the descriptions from that many."""
    warp, warps = warp_geometry(threads)
    RW = RECV_WINDOW
    CHUNKS = bool(chunked)
    SHARE_FROM = int(share_from_tokens)
    CHUNK_FROM = int(chunk_from_tokens)
    place_fns, rank_fns, recv = make_placement(threads), make_ranking(threads), make_receive(threads)
    first_rows, write_segments, token_of = place_fns.first_rows, place_fns.write_segments, place_fns.token_of
    load_token, rank_round, describe_round = rank_fns.load_token, rank_fns.rank_round, rank_fns.describe_round
    await_sources, store_recv_tokens = recv.await_sources, recv.store_recv_tokens
    place_by_chunks = make_route_chunks(threads)

    @cuda.jit(device=True)
    def await_token_rows(d_signal, g, n, timeout_ns, status, recv_tokens, src_T, flag):
        """Every thread of a placing block, its rows described: wait for every source's dispatch
        signal (the token rows are in), then write recv_tokens [R] (each source's T, from its
        signal). Returns whether every signal came."""
        ok = await_sources(d_signal, g, n, timeout_ns, status, KERNEL_DISPATCH_WAIT, COUNTER_DISPATCH_SIGNAL, src_T,
                           flag)
        if ok:
            stamp_last(status, 9)
            store_recv_tokens(recv_tokens, src_T)
        stamp_last(status, 11)
        return ok

    @cuda.jit(device=True)
    def place_from_routing(d_ids, d_weights, d_route, d_signal, g, n, me, R, L, K, Tmax, C, timeout_ns, status,
                           pad_multiple, row_offsets, expert_counts, row_src_rank, row_src_token, row_src_k,
                           row_weight, row_gather, recv_tokens, token_rows, src_T, flag, place, sum_buf, masks,
                           warp_rows, next_rank, share, shares):
        """Every thread of a placing block: wait for every source's route signal (``d_route[g,
        s]``: its routing rows are here; its T in the low half), rank and place every received
        (token, local expert) from them while the token rows still fly, then wait for every
        source's dispatch signal (the token rows) and write recv_tokens. Returns (the same in
        every thread) whether every row is described and every token row is in.

        The received tokens, source 0's first, go in rounds of a token per thread; a row's
        position is its expert's first row plus its rank among all received tokens with that
        expert, in (source, token) order. Pass 1 counts each local expert's rows (window by
        window, ``rank_round``), the first warp scans them into first rows (``first_rows``, with
        the offsets and counts), padding rows are described (``write_segments``, when
        pad_multiple > 1); pass 2 ranks again and writes each row's description (with one window
        and one round, the decode case, pass 1's masks are reused). More rows than C records an
        error and describes no row (the offsets and counts are written: the runtime raises the
        capacity error, and the batch is not returned).

        ``shares`` blocks may place at once: from ``share_from_tokens`` received tokens each
        ranks every token alike (the same table, offsets and counts, written alike) and
        describes the rows of share ``share`` only (a warp's tokens of a round are share
        ``(round * warps + warp) % shares``: the descriptions are scattered stores, the phase a
        second block shortens); below it share 0 places alone and the others return True once
        the routing is in. A chunked build's blocks, from ``chunk_from_tokens`` received tokens
        (and two ranks or more), each rank a chunk instead (``place_by_chunks``). A block on one
        SM pays a fixed cost a phase whatever its work (docs/plans.md), so the phases are few:
        the scan is one warp's, the segments' offsets and counts are written by it, and padding
        rows are described only when there are any."""
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
        if shares > 1 and Q < SHARE_FROM:  # few rows: the first block describes them all
            if share != 0:
                return True
            shares = 1
        if CHUNKS and shares > 1 and R > 1 and Q >= CHUNK_FROM:  # many rows: each block ranks a chunk
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

    return SimpleNamespace(place_from_routing=place_from_routing, publish_placed=publish_placed,
                           await_placed_rows=await_placed_rows)


# -- how a copying route-first dispatch_wait's placing blocks hand the placed rows to its copying blocks
@cuda.jit(device=True)
def publish_placed(d_placed, share, n, ok):
    """Every thread of placing block ``share`` of a copying route-first dispatch_wait, once
    it has described its rows and seen every token row (``ok``), or failed: the block meets,
    thread 0 fences at GPU scope (what the block wrote, and what its acquire loads saw of
    the peers' stores, before the flag: the readers are blocks of this GPU) and sets
    ``d_placed[share]`` to ``(n + 1) << 1``, plus 1 if it failed (the copying blocks then
    copy nothing; the error is recorded), by an atomic exchange (no NVSHMEM call: the flag is
    this rank's own)."""
    cuda.syncthreads()
    if cuda.threadIdx.x == 0:
        cuda.threadfence()
        cuda.atomic.exch(d_placed, share, (uint64(n + 1) << uint64(1)) | uint64(0 if ok else 1))

@cuda.jit(device=True)
def await_placed_rows(d_placed, placers, n, timeout_ns, status, flag):
    """Every thread of a copying block of a route-first dispatch_wait: thread 0 waits until
    each of the ``placers`` placing blocks published call n (``d_placed[p] >= (n + 1) <<
    1``, acquire polls; the block then meets, so every thread sees what the placing blocks
    wrote and saw). Each wait is bounded by three times ``timeout_ns`` (a placing block's
    two waits are bounded by one each); a timeout is recorded naming dispatch_wait, this
    rank and ``dispatch_placed``. Returns whether every row is placed and in (False also
    when a placing block failed: it recorded why)."""
    if cuda.threadIdx.x == 0:
        want = uint64(n + 1) << uint64(1)
        ok = 1
        for p in range(placers):
            seen = shmem.wait_signal_ge(d_placed[p:p + 1], want, 3 * timeout_ns)
            if seen < want or (seen & uint64(1)) != uint64(0):
                ok = 0
            if seen < want:
                me = shmem.my_pe()
                record_error(status, ERR_TIMEOUT, KERNEL_DISPATCH_WAIT, me, me, COUNTER_DISPATCH_PLACED, n + 1,
                             int64(seen >> uint64(1)), n + 1)
                break
        flag[0] = ok
    cuda.syncthreads()
    ok = flag[0] != 0
    cuda.syncthreads()  # flag read by every thread before it is used again
    return ok
