"""Send, routing half: dispatch_async's routing rows, ranks, counts and route signal.

Every receiver needs each source's routing rows (``dispatch_topk_ids`` / ``_weights``: ids and
weights of every token, sent to every rank). The ids go as ``routed_id`` reads them: -1 for a
masked slot, for an id outside ``[0, n_experts)`` (dropped, and recorded) and for a repeat of an
earlier slot's id, so every receiver sees only its experts' ids or -1; only a plain route-first
call's routing block leaves repeats in, which its receivers mask in their copy of the rows before
any kernel reads them (``ranking.rank_round``). The ``wait`` and ``land``
receivers also need each (token, k)'s rank among the source's tokens with that expert
(``dispatch_ranks``) and each expert's token count (``dispatch_counts``): the grid's last blocks
(routing blocks) compute them beside the token blocks, each a chunk of the tokens. Route-first receivers rank for
themselves: a route-first sender only sends the routing rows and T and signals them
(``dispatch_route_signal``) before its token rows.

:func:`make_dispatch_route` builds the device functions for a
:class:`~ep_runtime.kernels.variant.DispatchVariant`.
"""

import functools
from types import SimpleNamespace

from ep_runtime.kernels import shmem
from ep_runtime.kernels.block import last_block_ticket, popc32, publish_fence, record_error, udiv32, warp_geometry
from ep_runtime.kernels.codecs import traits
from ep_runtime.kernels.cuda_api import SIMULATED, cuda, inlined, int32, int64, shared_atomic, uint32, uint64
from ep_runtime.kernels.protocol import (DROPPED_SLOT, ERR_BAD_EXPERT_ID, KERNEL_DISPATCH_ASYNC, MASKED_SLOT,
                                         SIGNAL_TOKEN_BITS, STATUS_LEN, SYNC_ROUTE_TICKET)
from ep_runtime.kernels.ranking import ID_BATCH, make_ranking
from ep_runtime.kernels.trace import stamp_last
from ep_runtime.kernels.transport import make_transport
from ep_runtime.kernels.variant import DispatchVariant, Receiver
from ep_runtime.kernels.vec import address_of, load_u32_at, store_u32_at

#: Experts a routing block ranks per pass over this rank's tokens (shared lane masks of warps x
#: RANK_WINDOW words, 16 KB at 16 warps, and as many row words): one pass for up to 256 experts
#: on a GPU. The simulator's windows are 4 experts, so its small configurations take several
#: passes and the window arithmetic is tested on every run.
RANK_WINDOW = 4 if SIMULATED else 256
#: Routing blocks (the grid's last): at most this many, one per ``ROUTE_GRID_SHARE`` blocks of
#: the grid beyond the first, each ranking a chunk of the tokens so the routing is out sooner.
#: Rows that are only copied want 8; an encoding codec (FP8), bound by its SMs, wants 4 (its 128
#: token blocks then deal 4,096 rows evenly): docs/plans.md, "Routing blocks".
ROUTE_BLOCKS = 2 if SIMULATED else 8
ROUTE_BLOCKS_ENCODING = 2 if SIMULATED else 4
ROUTE_GRID_SHARE = 1 if SIMULATED else 12


@cuda.jit(device=True)
def routed_id(topk_ids, t, k, K, E, ids_l) -> int32:
    """The expert slot ``k`` of token ``t`` routes to (int32): ``topk_ids[t, k]`` (``[Tc, K]``
    int32), or -1 (``MASKED_SLOT``) when the slot is masked (-1), when its id is outside ``[0,
    E)`` (the slot is dropped: the caller records it, ``record_dropped``) or when an earlier slot
    of the token names the same expert (a repeated id counts once, with its first slot's
    weight). The token's first ``ID_BATCH`` ids are loaded together into ``ids_l`` (local int32
    [ID_BATCH]) and compared in registers, so a slot costs one memory latency (the routing rows
    are on a route-first dispatch's critical path); slots past ``ID_BATCH`` read the rest."""
    for u in range(ID_BATCH):  # a constant trip count: unrolled, ids_l in registers, the loads independent
        if u < K:
            ids_l[u] = topk_ids[t, u]
    x = topk_ids[t, k]
    keep = uint32(x) < uint32(E)  # (one comparison: a negative id is a large uint32)
    for u in range(ID_BATCH):
        if u < k:
            keep = keep and ids_l[u] != x
    for u in range(ID_BATCH, k):
        keep = keep and topk_ids[t, u] != x
    return x if keep else int32(MASKED_SLOT)


@cuda.jit(device=True)
def record_dropped(status, topk_ids, t, k, E, me, n):
    """Record slot ``k`` of token ``t`` (an id outside ``[-1, E)``) in the dropped-slot record of
    ``status`` (int64): rank ``me``, token, slot, the id, call ``n + 1``. The first wins."""
    record_error(status[DROPPED_SLOT:DROPPED_SLOT + STATUS_LEN], ERR_BAD_EXPERT_ID, KERNEL_DISPATCH_ASYNC, me, t, k,
                 E, topk_ids[t, k], n + 1)


@functools.lru_cache(maxsize=None)
def make_route_signals(v: DispatchVariant) -> SimpleNamespace:
    """The routing's publication for ``v``: ``route_blocks``, ``signal_routing``,
    ``store_token_count``, ``publish_route`` and ``publish_route_share``."""
    threads = v.threads
    tp = make_transport(v.transport, threads, v.node_size, v.node_stores)
    NEAR_FENCED, count_u32 = tp.NEAR_FENCED, tp.count_u32
    ENCODES = traits(v.codec).ENCODES  # the token blocks compute the messages
    FIRST = v.receiver.routes_first

    @cuda.jit(device=True)
    def route_blocks(grid, split):
        """Routing blocks of dispatch_async's grid of ``grid`` blocks: one per ROUTE_GRID_SHARE
        blocks beyond the first, at least 1, at most ROUTE_BLOCKS (ROUTE_BLOCKS_ENCODING for a codec
        that encodes).
        A route-first call has one, which only sends the routing rows, or none when the token
        blocks send them (``split``)."""
        if FIRST:
            return 0 if split else 1
        return max(1, min(ROUTE_BLOCKS_ENCODING if ENCODES else ROUTE_BLOCKS, (grid - 1) // ROUTE_GRID_SHARE))

    @cuda.jit(device=True)
    def signal_routing(d_route, g, me, n, T, R, first, step):
        """Set ``d_route[g, me]`` on ranks ``first, first + step, ...`` below R to ``(n + 1) << 32 |
        T``: this rank's routing of call n is out. The caller has published the routing (a fence
        after its stores, or the route ticket)."""
        signal = (uint64(n + 1) << uint64(SIGNAL_TOKEN_BITS)) | uint64(T)
        for d in range(first, R, step):
            shmem.signal_op(d_route[g, me:me + 1], signal, shmem.SIGNAL_SET, d)

    @cuda.jit(device=True)
    def store_token_count(d_counts, send_counts, peer_bases, g, me, R, L, T):
        """Every thread of a block: this call's T into ``d_counts[g, me, L]`` on every rank (a
        route-first call's routing carries it; combine reads it there)."""
        for d in range(cuda.threadIdx.x, R, threads):
            count_u32(d_counts, send_counts, peer_bases, g, me, d, L, T)

    @cuda.jit(device=True)
    def publish_route(sync, flag, d_route, g, me, n, T, R, status):
        """Every thread of a block, once, when the block's share of the routing is out: the route
        ticket (``last_block_ticket``: barrier, fence or quiet, ticket); the block that takes
        the last sets ``d_route[g, me]`` on every rank and resets the ticket."""
        if last_block_ticket(sync[SYNC_ROUTE_TICKET:SYNC_ROUTE_TICKET + 1], flag, NEAR_FENCED):
            signal_routing(d_route, g, me, n, T, R, cuda.threadIdx.x, threads)
            if cuda.threadIdx.x == 0:
                sync[SYNC_ROUTE_TICKET] = 0
            stamp_last(status, 29)
        cuda.syncthreads()  # flag read by every thread before the next ticket reuses it

    @cuda.jit(device=True)
    def publish_route_share(sync, d_route, g, me, n, T, R, token_blocks, status):
        """One thread of each token block of a split route-first call that encodes FP8 rows, after
        a barrier that ordered every thread's share of the routing rows (and block 0's T) before
        it: the route ticket of :func:`publish_route` taken by this thread alone (system fence,
        ticket; the block that takes the last sets ``d_route[g, me]`` on every rank and resets
        it), so the fence's wait for the routing stores to land holds up one warp, not the
        block's token rows."""
        publish_fence(NEAR_FENCED)  # (a route-first build stores: the fence, cumulative over the barrier)
        done = cuda.atomic.add(sync, SYNC_ROUTE_TICKET, int64(1))
        if done == token_blocks - 1:
            cuda.threadfence()
            signal_routing(d_route, g, me, n, T, R, 0, 1)
            sync[SYNC_ROUTE_TICKET] = 0
            stamp_last(status, 29)

    return SimpleNamespace(route_blocks=route_blocks, signal_routing=signal_routing,
                           store_token_count=store_token_count, publish_route=publish_route,
                           publish_route_share=publish_route_share)


@functools.lru_cache(maxsize=None)
def make_routing_rows(v: DispatchVariant) -> SimpleNamespace:
    """The routing rows of ``v``'s dispatch_async: ``send_routing_spread`` (the token blocks'
    shares) and ``send_routing_first`` (a route-first call's routing block)."""
    threads = v.threads
    tp = make_transport(v.transport, threads, v.node_size, v.node_stores)
    NEAR_FENCED = tp.NEAR_FENCED
    spread_range, row_at, spread_slot, spread_flush = tp.spread_range, tp.row_at, tp.spread_slot, tp.spread_flush
    signals = make_route_signals(v)
    signal_routing, store_token_count = signals.signal_routing, signals.store_token_count
    CHUNKS = v.receiver is Receiver.ROUTE_FIRST_CHUNKED

    @inlined
    def send_routing_spread(topk_ids, topk_weights, d_ids, d_weights, peer_bases, g, me, n, T, R, L, K, token_blocks,
                            status):
        """Every thread of a token block: its share of this rank's routing rows (the ids as
        ``routed_id`` reads them, the weights) into ``d_ids[g, me]`` / ``d_weights[g, me]`` of
        every near rank (``spread_u32``: stored there, or written here and put at the block's
        ``spread_flush``). Hierarchical: to the ranks of this node (this rank's own rows
        included), which its proxies get in one put each."""
        E = R * L
        ids_l = cuda.local.array(ID_BATCH, int32)
        drop = int32(-1)  # the first slot (t K + k) this thread dropped
        j0, j1, step, t0, t1 = spread_range(T, K, token_blocks)
        ids_at = row_at(d_ids, g, me)
        weights_at = row_at(d_weights, g, me)
        for j in range(j0, j1, step):
            t = j // K
            k = j - t * K
            x = routed_id(topk_ids, t, k, K, E, ids_l)
            if x == MASKED_SLOT and drop < 0 and uint32(topk_ids[t, k]) >= uint32(E) and topk_ids[t, k] != x:
                drop = int32(j)
            spread_slot(d_ids, d_weights, peer_bases, ids_at, weights_at, g, me, t, k, j, x, topk_weights[t, k])
        spread_flush(d_ids, d_weights, g, me, t0, t1)
        if drop >= 0:
            record_dropped(status, topk_ids, drop // K, drop - (drop // K) * K, E, me, n)

    @inlined
    def send_routing_first(topk_ids, topk_weights, d_ids, d_weights, d_counts, send_counts, d_route, peer_bases, g,
                           me, n, T, R, L, K, status):
        """Every thread of a route-first call's routing block: the routing rows (the ids, the
        weights) and T (``d_counts[g, me, L]``, read by combine) into every rank, then, after a
        system fence, the route signal. Nothing is ranked here: each receiver ranks from the
        routing rows. An id outside ``[0, E)`` goes as -1, and once the route signal is out a
        second pass over the ids records the first such slot (``record_dropped``): no
        bookkeeping in the loop before the signal (docs/plans.md, "The guard on expert ids"). A
        chunked build's ids go as ``routed_id`` reads them (its chunk counts take them as they
        are); a plain route-first build's repeats go as they are: its receivers mask them from
        the marks they rank with (``ranking.rank_round``), where comparing each slot with its
        token's earlier slots here would be on the routing's critical path."""
        ids_at = row_at(d_ids, g, me)
        weights_at = row_at(d_weights, g, me)
        E = R * L
        ids_l = cuda.local.array(ID_BATCH, int32)
        for j in range(cuda.threadIdx.x, T * K, threads):
            t = int32(udiv32(j, K))
            k = j - t * K
            if CHUNKS:
                x = routed_id(topk_ids, t, k, K, E, ids_l)
            else:  # the range alone: the receivers mask repeats
                x = topk_ids[t, k]
                if uint32(x) >= uint32(E):
                    x = int32(MASKED_SLOT)
            spread_slot(d_ids, d_weights, peer_bases, ids_at, weights_at, g, me, t, k, j, x, topk_weights[t, k])
        store_token_count(d_counts, send_counts, peer_bases, g, me, R, L, T)
        cuda.syncthreads()
        if cuda.threadIdx.x == 0:  # data before signal: the system fence is cumulative over the barrier
            publish_fence(NEAR_FENCED)
            signal_routing(d_route, g, me, n, T, R, 0, 1)
        for j in range(cuda.threadIdx.x, T * K, threads):  # the dropped slots, after the signal
            t = int32(udiv32(j, K))
            k = j - t * K
            x = topk_ids[t, k]
            if uint32(x) >= uint32(E) and x != MASKED_SLOT:
                record_dropped(status, topk_ids, t, k, E, me, n)
                break
        stamp_last(status, 29)

    return SimpleNamespace(send_routing_spread=send_routing_spread, send_routing_first=send_routing_first)


@functools.lru_cache(maxsize=None)
def make_rank_chunk(v: DispatchVariant) -> SimpleNamespace:
    """The ``wait`` and ``land`` receivers' ranking in ``v``'s routing blocks: ``rank_chunk``
    and the shared words it takes (``rank_words``, ``rank_window``)."""
    threads = v.threads
    warp, warps = warp_geometry(threads)
    tp = make_transport(v.transport, threads, v.node_size, v.node_stores)
    count_u32, deliver_ranks, counts_before_route = tp.count_u32, tp.send_ranks, tp.counts_before_route
    publish_route = make_route_signals(v).publish_route
    LAND = v.receiver is Receiver.LAND
    SW = RANK_WINDOW
    RANK_WORDS = warps * SW
    warp_first_ranks = make_ranking(threads).warp_first_ranks

    @cuda.jit(device=True)
    def mark_expert(masks, el, wid, lane):
        """Set this lane's bit in its warp's mask of window expert ``el`` (nothing outside the
        window ``[0, RANK_WINDOW)``)."""
        if el >= 0 and el < SW:
            shared_atomic.or_(masks, wid * SW + el, uint32(1) << uint32(lane))

    @cuda.jit(device=True)
    def stage_rank(masks, warp_rows, el, wid, lanes_below, ranks_src, j):
        """The rank of this lane's token among the tokens with window expert ``el`` (its warp's
        first rank plus the lanes below with the expert), staged as flat element ``j`` of the
        ranks at ``ranks_src`` (nothing outside the window)."""
        if el >= 0 and el < SW:
            m = wid * SW + el
            store_u32_at(ranks_src, j, uint32(warp_rows[m] + popc32(masks[m] & lanes_below)))

    @cuda.jit(device=True)
    def count_token_experts(ids_base, t, K, w0, next_rank, ids_l):
        """Add 1 to ``next_rank[x - w0]`` for each distinct expert ``x`` of token ``t`` (the flat
        ids at ``ids_base``) in the window ``[w0, w0 + RANK_WINDOW)``: a repeated id counts once,
        as the masks of :func:`rank_chunk`'s rounds count it (a lane's bit is set once) and as
        ``routed_id`` sends it. The first ``ID_BATCH`` ids are compared in registers (``ids_l``)."""
        for u in range(ID_BATCH):  # a constant trip count: unrolled, ids_l in registers, the loads independent
            if u < K:
                ids_l[u] = int32(load_u32_at(ids_base, t * K + u))
        for u in range(ID_BATCH):
            if u < K:
                x = ids_l[u]
                el = x - w0
                if el >= 0 and el < SW:
                    first = True
                    for u2 in range(ID_BATCH):
                        if u2 < u and ids_l[u2] == x:
                            first = False
                    if first:
                        shared_atomic.add(next_rank, el, int32(1))
        for k in range(ID_BATCH, K):
            x = int32(load_u32_at(ids_base, t * K + k))
            el = x - w0
            if el >= 0 and el < SW:
                first = True
                for k2 in range(k):
                    if int32(load_u32_at(ids_base, t * K + k2)) == x:
                        first = False
                if first:
                    shared_atomic.add(next_rank, el, int32(1))

    @inlined
    def rank_chunk(ids_base, d_ranks, d_counts, send_ranks, send_counts, peer_bases, g, me, n, T, R, L, K, rb,
                   n_route, sync, flag, d_route, status, masks, warp_rows, next_rank, run_l):
        """Every thread of routing block ``rb`` of ``n_route``: each (token, k) of chunk rb of the
        tokens ranked among this rank's tokens with expert ``topk_ids[t, k]`` (``ids_base``, the
        flat ids), staged in send_ranks and stored on every rank (``d_ranks[g, me]``), starting
        from the count of each expert's tokens before the chunk (a shared-memory histogram of
        their experts, a token counting a repeated id once: ``count_token_experts``), so no
        routing block waits for another; the last chunk's block stores each
        expert's count on its rank (``d_counts[g, me, :L]``, and T at ``[g, me, L]``). A landing
        build then takes the route ticket (``publish_route``). The puts path stages the counts
        rows (send_counts) and puts the ranks per block. Hierarchical: the ranks go to this
        node's ranks, and the counts rows of another node's ranks are staged (its proxy gets
        them with the relay signal)."""
        tid = cuda.threadIdx.x
        chunk = (T + n_route - 1) // n_route  # this block ranks tokens [c0, c1)
        c0 = min(rb * chunk, T)
        c1 = min(c0 + chunk, T)
        counts_here = rb == n_route - 1  # the last chunk's block knows every count after ranking
        E = R * L
        lane = tid % warp
        wid = tid // warp
        lanes_below = (uint32(1) << uint32(lane)) - uint32(1)
        ranks_src = address_of(send_ranks)  # likewise [Tmax, K]
        ids_l = cuda.local.array(ID_BATCH, int32)
        for w0 in range(0, E, SW):
            for el in range(tid, SW, threads):
                next_rank[el] = 0
            for m in range(tid, RANK_WORDS, threads):
                masks[m] = uint32(0)
            cuda.syncthreads()
            for t in range(tid, c0, threads):  # tokens before the chunk: each expert's first rank
                count_token_experts(ids_base, t, K, w0, next_rank, ids_l)
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
            # the window's counts, each to its expert's rank
            for el in range(tid, SW if counts_here else 0, threads):
                x = w0 + el
                if x < E:
                    d = x // L  # (hierarchical: another node's go with its relay signal)
                    count_u32(d_counts, send_counts, peer_bases, g, me, d, x - d * L, next_rank[el])
            cuda.syncthreads()  # next_rank read before the next window resets it
        for d in range(tid, R if counts_here else 0, threads):  # T, even when 0
            count_u32(d_counts, send_counts, peer_bases, g, me, d, L, T)
        cuda.syncthreads()  # the ranks are staged before the block sends them
        stamp_last(status, 19)
        # the staged ranks of the chunk to every near rank (hierarchical: a proxy gets them with its signal)
        deliver_ranks(d_ranks, send_ranks, peer_bases, g, me, c0, c1, run_l)
        if LAND:
            if counts_here:  # the counts rows before the route signal (its ticket's quiet, where put)
                counts_before_route(d_counts, send_counts, g, me)
            publish_route(sync, flag, d_route, g, me, n, T, R, status)

    return SimpleNamespace(rank_chunk=rank_chunk, rank_words=RANK_WORDS, rank_window=SW)


@functools.lru_cache(maxsize=None)
def make_dispatch_route(v: DispatchVariant) -> SimpleNamespace:
    """The routing half of dispatch_async for ``v``: ``route_blocks``, ``rank_words`` and
    ``rank_window`` (the shared words a routing block's masks and rows take, and its experts per
    pass), ``send_routing_spread``, ``send_routing_first``, ``rank_chunk``, ``publish_route``,
    ``publish_route_share`` and ``store_token_count``."""
    signals, rows, ranks = make_route_signals(v), make_routing_rows(v), make_rank_chunk(v)
    return SimpleNamespace(route_blocks=signals.route_blocks, rank_words=ranks.rank_words,
                           rank_window=ranks.rank_window, send_routing_spread=rows.send_routing_spread,
                           send_routing_first=rows.send_routing_first, rank_chunk=ranks.rank_chunk,
                           publish_route=signals.publish_route, publish_route_share=signals.publish_route_share,
                           store_token_count=signals.store_token_count)
