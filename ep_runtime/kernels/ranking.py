"""Ranking tokens per expert inside one block, with no atomic deciding a position.

A token's rank among the tokens with expert ``x`` (in token order) is found in rounds of a
token per thread: each lane sets its bit in its warp's shared mask of each of its token's
experts (atomic OR: the result does not depend on the order), a thread per expert turns the
masks into each warp's first rank (:func:`warp_first_ranks`), and a lane's rank is that plus
the mask's bits below it. Experts go in windows of shared-memory columns. The sender's routing
blocks rank their own tokens this way (ep_runtime/kernels/dispatch_route.py); a route-first receiver ranks
every received token (ep_runtime/kernels/route_first.py, ep_runtime/kernels/route_chunks.py) from the routing rows.

:func:`make_ranking` builds the device functions for a block size.
"""

import functools
from types import SimpleNamespace

from ep_runtime.kernels.block import popc32, warp_geometry
from ep_runtime.kernels.cuda_api import SIMULATED, cuda, int32, shared_atomic, uint32
from ep_runtime.kernels.layouts.expert_major import make_placement
from ep_runtime.kernels.protocol import MASKED_SLOT

#: Local experts a receiver ranks per pass over the received tokens (shared lane masks and row
#: words of warps x RECV_WINDOW words each, 8 KB apiece at 16 warps): one pass for up to 128
#: local experts. The simulator's windows are 4 experts, so its configurations take several
#: passes and the window arithmetic is tested on every run.
RECV_WINDOW = 4 if SIMULATED else 128
#: Expert ids of a token loaded together, before any is used: independent loads in flight
#: instead of a loop of load-then-use steps.
ID_BATCH = 8


@functools.lru_cache(maxsize=None)
def make_ranking(threads: int) -> SimpleNamespace:
    """``warp_first_ranks``, ``load_token``, ``rank_round``, ``local_rank``, ``describe_round``
    and the receiver's shared sizes (``recv_words``: masks and warp rows, ``RECV_WINDOW``
    columns a warp) for blocks of ``threads`` threads."""
    warp, warps = warp_geometry(threads)
    RW = RECV_WINDOW
    RECV_WORDS = warps * RW
    describe_row = make_placement(threads).describe_row

    @cuda.jit(device=True)
    def warp_first_ranks(masks, warp_rows, next_rank, width):
        """A thread per window expert ``el < width`` (the masks and rows are [warp, width]): each
        warp's first rank of the expert (``warp_rows``, warps in order, from ``next_rank[el]``)
        and ``next_rank[el]`` advanced past every warp's lanes with it (``masks``)."""
        for el in range(cuda.threadIdx.x, width, threads):
            r = next_rank[el]
            for w in range(warps):
                warp_rows[w * width + el] = r
                r += popc32(masks[w * width + el])
            next_rank[el] = r

    @cuda.jit(device=True)
    def load_token(d_ids, d_weights, g, s, t, K, ids_l, w_l):
        """The first ``ID_BATCH`` expert ids and weights of received token (s, t) into ``ids_l`` /
        ``w_l`` (local), all loaded before any is used (one memory latency, not one per id). The
        loops that use them are unrolled too (constant indices: registers, not local memory)."""
        for u in range(ID_BATCH):  # a constant trip count: unrolled, the arrays in registers
            if u < K:
                ids_l[u] = d_ids[g, s, t, u]
                w_l[u] = d_weights[g, s, t, u]

    @cuda.jit(device=True)
    def mark_window(masks, x, x0, wid, lane):
        """Set this lane's bit in its warp's mask of expert ``x`` (global id) if it is in the
        window ``[x0, x0 + RECV_WINDOW)``. Returns the mask word before (uint32; 0 outside the
        window): the lane's bit set in it means an earlier slot of the lane's token named the
        same expert (a repeat). The caller tests it only once all its slots are marked, so the
        atomics are in flight together rather than one round trip each."""
        el = x - x0
        if el >= 0 and el < RW:
            return shared_atomic.or_(masks, wid * RW + el, uint32(1) << uint32(lane))
        return uint32(0)

    @cuda.jit(device=True)
    def rank_round(d_ids, g, s, t, K, valid, ids_l, x0, masks, warp_rows, next_rank, wid, lane):
        """Every thread of the block, one round of a received token per thread (``valid``: this
        thread has one, (s, t), its first ids in ``ids_l``): the lane sets its bit in its warp's
        mask of each of its token's experts in the window ``[x0, x0 + RECV_WINDOW)`` (global
        ids), then a thread per window expert turns the masks into each warp's first rank
        (``warp_rows``, from ``next_rank``, which it advances past the round). Three barriers;
        the masks and warp rows stay valid until the next round.

        A slot whose expert an earlier slot of its token named (its bit was set already: the
        lane marks its slots in order) is a repeat: masked, -1 in ``ids_l`` and in the routing
        rows ``d_ids[g, s, t]`` themselves, so the descriptions and the kernels after this
        receiver count the expert once (a plain route-first sender leaves repeats in: docs/
        protocol.md, "Semantics"). Every thread ranking the token writes the same -1s. Only this
        window's experts are seen: the local ones, all a receiver places."""
        tid = cuda.threadIdx.x
        for m in range(tid, RECV_WORDS, threads):
            masks[m] = uint32(0)
        cuda.syncthreads()
        if valid:
            bit = uint32(1) << uint32(lane)
            olds = cuda.local.array(ID_BATCH, uint32)  # unrolled: registers
            for u in range(ID_BATCH):  # every atomic issued before any result is read
                olds[u] = mark_window(masks, ids_l[u], x0, wid, lane) if u < K else uint32(0)
            seen = uint32(0)
            for u in range(ID_BATCH):
                seen |= olds[u]
            if seen & bit:  # some slot repeats (rare): mask each one whose bit was set before
                for u in range(ID_BATCH):
                    if olds[u] & bit:
                        ids_l[u] = int32(MASKED_SLOT)
                        d_ids[g, s, t, u] = int32(MASKED_SLOT)
            for k in range(ID_BATCH, K):
                if mark_window(masks, d_ids[g, s, t, k], x0, wid, lane) & bit:
                    d_ids[g, s, t, k] = int32(MASKED_SLOT)
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
        of each of its (token, k) whose expert is local and in the window."""
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

    return SimpleNamespace(warp_first_ranks=warp_first_ranks, load_token=load_token, rank_round=rank_round,
                           local_rank=local_rank, describe_round=describe_round, recv_words=RECV_WORDS)
