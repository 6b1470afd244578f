"""The dense layout: DeepEP's received rows, one per (token, source rank), written by a kernel.

The receive kernels place rows by the expert-major rule (:mod:`.expert_major`: ``row_offsets``,
``expert_counts`` and the row descriptions, as for the compact layout, and nothing copied into
an expert batch); ``dispatch_dense`` (:func:`make_dispatch_dense`), after the receive kernel on
the same stream, then lays the received tokens out densely, in DeepEP's normal-mode order:
source rank ascending, then the source's token order, only the tokens with an expert here.
Dense row of received token (s, t) = ``prefix(s)`` (the tokens received from sources before
s) + the rank of t among s's tokens that have an expert here. Per dense row it writes the
token's words (or a quantized format's codes, its scales laid out by the codec's receiver),
its slots' local expert ids (-1 where the slot's expert is elsewhere or masked) and weights (0
there), and the maps between dense rows and receive-buffer slots (``s * Tmax + t``).

Every block of ``dispatch_dense`` counts each source's received tokens itself (a pass over
every received token's ids: no block waits for another) and takes a contiguous chunk of the
received tokens, which it ranks a round of ``threads`` tokens at a time (``block_exclusive_scan``)
and copies a warp a row (``copy_to_rows``). No atomic decides a position: the rows are the
reference's, bit for bit, run to run.

:func:`make_layout` is the interface the receive kernels are built with (the compact layout's:
the rows are read where they landed until ``dispatch_dense`` copies them).
"""

import functools
from types import SimpleNamespace

from ep_runtime.kernels import shmem
from ep_runtime.kernels.block import block_exclusive_scan, block_sum, warp_geometry
from ep_runtime.kernels.codecs import CodecSpec, make_receiver
from ep_runtime.kernels.cuda_api import cuda, float32, int32, int64, kernel_jit, uint64
from ep_runtime.kernels.layouts.compact import make_layout as make_compact_layout
from ep_runtime.kernels.layouts.expanded import COPY_PAIRS, COPY_UNROLL, make_row_copy
from ep_runtime.kernels.layouts.expert_major import make_placement
from ep_runtime.kernels.pdl import make_pdl, programmatic
from ep_runtime.kernels.protocol import MASK_RANKS, STATUS_CODE, SYNC_CALLS
from ep_runtime.kernels.trace import stamp_first, stamp_last


@functools.lru_cache(maxsize=None)
def make_dense_rows(threads: int) -> SimpleNamespace:
    """The dense placement's device functions for blocks of ``threads`` threads:
    ``has_local_expert``, ``count_sources`` and ``describe_dense_row``."""
    token_of = make_placement(threads).token_of

    @cuda.jit(device=True)
    def has_local_expert(d_ids, g, s, t, lo, hi):
        """Whether token (s, t) of group g names an expert in ``[lo, hi)`` in any slot (the
        receivers left only routed ids: masked, dropped and repeated slots are -1)."""
        for k in range(d_ids.shape[3]):
            x = d_ids[g, s, t, k]
            if x >= lo and x < hi:
                return True
        return False

    @cuda.jit(device=True)
    def count_sources(d_ids, g, src_T, R, lo, hi, q0, src_rows, sum_buf):
        """Every thread of the block: ``src_rows[s]`` (shared int32 [R]) = source s's tokens
        with an expert in ``[lo, hi)`` (a thread per token, ``block_sum`` per source), and the
        return value: the received tokens among the first ``q0`` of every source's tokens in
        order (source 0's first)."""
        tid = cuda.threadIdx.x
        before = int64(0)
        first = 0  # the flat index of source s's token 0
        for s in range(R):
            mine = int64(0)
            ahead = int64(0)
            for t in range(tid, src_T[s], threads):
                if has_local_expert(d_ids, g, s, t, lo, hi):
                    mine += 1
                    if first + t < q0:
                        ahead += 1
            total = block_sum(sum_buf, mine)
            if first < q0:
                before += block_sum(sum_buf, ahead)
            if tid == 0:
                src_rows[s] = int32(total)
            first += src_T[s]
        cuda.syncthreads()
        return before

    @cuda.jit(device=True)
    def describe_dense_row(d_ids, d_weights, g, s, t, row, Tmax, lo, L, dense_topk_idx, dense_topk_weights,
                           dense_slot):
        """One thread: dense row ``row`` is received token (s, t): its slot ``s * Tmax + t``, and
        per top-k slot its local expert (``id - lo`` where ``id`` is one of this rank's L) or -1,
        and its router weight or 0."""
        dense_slot[row] = s * Tmax + t
        for k in range(d_ids.shape[3]):
            e = d_ids[g, s, t, k] - lo
            if e >= 0 and e < L:
                dense_topk_idx[row, k] = e
                dense_topk_weights[row, k] = d_weights[g, s, t, k]
            else:
                dense_topk_idx[row, k] = -1
                dense_topk_weights[row, k] = float32(0.0)

    return SimpleNamespace(has_local_expert=has_local_expert, count_sources=count_sources,
                           describe_dense_row=describe_dense_row, token_of=token_of)


@functools.lru_cache(maxsize=None)
def make_dispatch_dense(threads: int, codec: CodecSpec, pdl: bool, rank_slots: int = MASK_RANKS):
    """The ``dispatch_dense`` kernel for blocks of ``threads`` threads, a token format's
    ``codec`` (its receiver lays out what a message carries besides its payload words), PDL and
    ``rank_slots`` shared words per source (at least the rank count)."""
    warp, warps = warp_geometry(threads)
    U = COPY_UNROLL
    CP = COPY_PAIRS
    rows_fns = make_dense_rows(threads)
    has_local_expert, count_sources = rows_fns.has_local_expert, rows_fns.count_sources
    describe_dense_row, token_of = rows_fns.describe_dense_row, rows_fns.token_of
    copy = make_row_copy(threads)
    copy_in_pairs, copy_to_rows = copy.copy_in_pairs, copy.copy_to_rows
    lay_out = make_receiver(codec, threads).lay_out
    pdl_wait, pdl_trigger = make_pdl(pdl)

    @kernel_jit(threads)
    def dispatch_dense(dispatch_tokens, dispatch_topk_ids, dispatch_topk_weights, dispatch_counts, dispatch_async_sync,
                       status, dense_x, dense_topk_idx, dense_topk_weights, dense_slot, slot_dense_row,
                       dense_source_rows, dispatch_tokens_u8, dense_scales_u8):
        """Lay the received tokens out as DeepEP's dense rows; after the receive kernel, same stream.

        Inputs (group g of the last call, n = ``dispatch_async_sync[SYNC_CALLS] - 1``): dispatch_tokens
        [R, Tmax, W'] words (the rows of the call, all in once the receive kernel ended), dispatch_topk_ids /
        dispatch_topk_weights [G, R, Tmax, K] (as the receivers left them: repeats masked), dispatch_counts
        [G, R, L + 1] (``[g, s, L]``: source s's T). Outputs (local, N = R Tmax rows): dense_x [N, W] words
        (bf16 rows; a quantized format's first W words of each message, its codes, and the codec's extras
        in dense_scales_u8, row-major ``[N, XB]`` bytes as the expanded layout's ``scales="row"``),
        dense_topk_idx [N, K] int32 (the slot's local expert, or -1), dense_topk_weights [N, K] float32
        (0 where -1), dense_slot [N] int32 (``s * Tmax + t`` of each dense row, -1 past the rows received),
        slot_dense_row [R, Tmax] int32 (the dense row of (s, t), -1 where t did not come here),
        dense_source_rows [R] int32 (the tokens received from each source). Rows of dense_x, dense_topk_idx
        and dense_topk_weights past the rows received: x stale, ids -1, weights 0.

        Every block counts each source's received tokens (``count_sources``: a pass over every received
        token's ids; block 0 writes dense_source_rows) and the received tokens before its chunk of the
        received tokens (``ceil(Q / blocks)`` tokens of Q, source 0's first), then ranks the chunk a round of
        a token per thread (``block_exclusive_scan``): each token's dense row is the received tokens before
        it. A thread writes its token's maps and slots, then a warp per row of the round copies its words
        (``copy_to_rows``) and lays out the codec's extras. The last block to hold a row (or block 0 when no
        row came) clears the rows past the received count; every block clears its share of the slots past
        each source's T. An earlier error (the status record) makes it return without writing.
        """
        sum_buf = cuda.shared.array(threads, int64)
        scan_buf = cuda.shared.array(threads, int32)
        src_T = cuda.shared.array(rank_slots, int32)
        src_rows = cuda.shared.array(rank_slots, int32)
        round_row = cuda.shared.array(threads, int32)  # the round's tokens: dense row (-1: not here)
        round_slot = cuda.shared.array(threads, int32)  # ... and receive-buffer slot
        vals = cuda.local.array(U, uint64)
        lo = cuda.local.array(CP, uint64)  # copy_to_rows' pairs
        hi = cuda.local.array(CP, uint64)
        pdl_trigger()
        pdl_wait()  # nothing stream-ordered is read before this (ep_runtime/kernels/pdl.py)
        if status[STATUS_CODE] != 0:
            return
        stamp_first(status, 32)
        n = dispatch_async_sync[SYNC_CALLS] - 1
        g = n % 2
        me = shmem.my_pe()
        R = dispatch_counts.shape[1]
        L = dispatch_counts.shape[2] - 1
        K = dispatch_topk_ids.shape[3]
        Tmax = dispatch_topk_ids.shape[2]
        N = dense_slot.shape[0]
        W = dense_x.shape[1]
        XB = dense_scales_u8.shape[0] // N if N > 0 else 0  # the codec's extra bytes per row (FP8 scales)
        first_mine = me * L
        tid = cuda.threadIdx.x
        lane = tid % warp
        wid = tid // warp
        for s in range(tid, R, threads):
            src_T[s] = min(dispatch_counts[g, s, L], Tmax)
        cuda.syncthreads()
        Q = 0  # every source's tokens
        for s in range(R):
            Q += src_T[s]
        per = (Q + cuda.gridDim.x - 1) // cuda.gridDim.x
        q0 = min(cuda.blockIdx.x * per, Q)
        q1 = min(q0 + per, Q)

        # each source's received tokens, and those before this block's chunk
        before = count_sources(dispatch_topk_ids, g, src_T, R, first_mine, first_mine + L, q0, src_rows, sum_buf)
        received = 0
        for s in range(R):
            received += src_rows[s]
        if cuda.blockIdx.x == 0:
            for s in range(tid, R, threads):
                dense_source_rows[s] = src_rows[s]
        pairs = copy_in_pairs(dispatch_tokens, dense_x)

        # the chunk, a round of a token per thread: rank, describe, then a warp per row copies it
        for base in range(q0, q1, threads):
            q = base + tid
            valid = q < q1
            s, t = token_of(min(q, Q - 1), src_T, R)
            mine = valid and has_local_expert(dispatch_topk_ids, g, s, t, first_mine, first_mine + L)
            rank, count = block_exclusive_scan(scan_buf, int32(1 if mine else 0))
            row = int32(before + rank)
            round_row[tid] = row if mine else int32(-1)
            round_slot[tid] = int32(s * Tmax + t)
            if valid:
                slot_dense_row[s, t] = row if mine else int32(-1)
            if mine:
                describe_dense_row(dispatch_topk_ids, dispatch_topk_weights, g, s, t, row, Tmax, first_mine, L,
                                   dense_topk_idx, dense_topk_weights, dense_slot)
            cuda.syncthreads()
            for j in range(wid, threads, warps):
                if round_row[j] >= 0:
                    at = round_slot[j]
                    src = at // Tmax
                    tok = at - src * Tmax
                    copy_to_rows(dispatch_tokens[src, tok], round_row[j:j + 1], 1, dense_x, 0, W, pairs, lane, lo,
                                 hi, vals)
                    lay_out(dispatch_tokens_u8[src, tok], W * 8, XB, dense_scales_u8, round_row[j], N, 0, lane)
            cuda.syncthreads()  # the round's rows copied before the next round overwrites them
            before += count
        stamp_last(status, 33)

        # what lies past the rows received, and past each source's T
        if (q1 == Q and q0 < q1) or (Q == 0 and cuda.blockIdx.x == 0):  # the block holding the last token
            for r in range(received + tid, N, threads):
                dense_slot[r] = -1
                for k in range(K):
                    dense_topk_idx[r, k] = -1
                    dense_topk_weights[r, k] = float32(0.0)
        i = cuda.blockIdx.x * threads + tid
        while i < R * Tmax:
            s = i // Tmax
            if i - s * Tmax >= src_T[s]:
                slot_dense_row[s, i - s * Tmax] = -1
            i += cuda.gridDim.x * threads
        stamp_last(status, 34)

    return programmatic(dispatch_dense, pdl)


@functools.lru_cache(maxsize=None)
def make_layout(threads: int) -> SimpleNamespace:
    """The dense layout for blocks of ``threads`` threads (:mod:`ep_runtime.kernels.layouts`): the
    receive kernels place and copy as for the compact layout (no expert batch); the dense rows
    are ``dispatch_dense``'s (:func:`make_dispatch_dense`)."""
    return make_compact_layout(threads)
