"""The combine kernels: ``combine_async`` (weight, pre-reduce, send) and ``combine_wait``
(wait, sum in rank order, epilogue, store).

Built by :func:`make_combine_kernels` for a block size, a token word type, an epilogue and a
partial format. Symbols as in :mod:`ep_runtime.layout`; rows move as ``W = H / pack`` words of
``pack`` bf16 values (:func:`ep_runtime.layout.token_word`). docs/protocol.md has the timeline
and the summation order. Both kernels give a warp to each token row; each lane handles whole
words.

Partials (``combine_partials``, ``combine_stage``, ``out_partials``) are bf16 in the token word
(``P = 1`` partial word per token word), or, with ``f32_partials`` (``EPConfig.combine_dtype =
"float32"``), float32 passed as uint64 words of 2 floats: token word ``w`` (4 bf16 values)
owns partial words ``2 w`` and ``2 w + 1`` (``P = 2``), element order as in the float32 row.
The format is a compile-time choice: the bf16 kernels carry no branch for it.
"""

import numpy as np
from numba import float32, from_dtype, int32, int64, uint64

from ep_runtime.kernels import shmem
from ep_runtime.kernels.bits import bf16_bits_at, f32_bits_at, f32_word_at, word_f32
from ep_runtime.kernels.block import (last_block_ticket, local_expert_count, part_bounds, part_words,
                                      record_error, row_parts, warp_geometry, warp_sync)
from ep_runtime.kernels.cuda_api import cuda, kernel_jit
from ep_runtime.layout import STATUS_CODE, SYNC_CALLS
from ep_runtime.status import COUNTER_COMBINE_SIGNAL, ERR_TIMEOUT, KERNEL_COMBINE_WAIT

#: Words of a row each lane loads before using any of them (memory-level parallelism: with
#: 8-byte words, 64 bytes per lane and 32 KB per 512-thread block in flight per row read).
#: combine_async reads a token's expert rows one after another, combine_wait its ranks'
#: partials; within each row the U loads are independent.
WORDS_IN_FLIGHT = 8

#: combine_wait modes
MODE_REDUCE = 0      # out [T, H]: sum of the partials, epilogue, bf16
MODE_PARTIALS = 1    # out [R, T, H]: each rank's partial (zero where the token did not go)


@cuda.jit(device=True)
def identity_epilogue(value, token, col, aux):
    """The default epilogue: returns ``value`` (float32) unchanged."""
    return value


def partial_words(word_dtype, f32_partials: bool) -> int:
    """Partial words per token word (``P``): 1 for bf16 partials (the token word itself), 2 for
    float32 partials (uint64 words of 2 floats), which need uint64 token words (4 bf16 values;
    hidden a multiple of 4)."""
    if not f32_partials:
        return 1
    if np.dtype(word_dtype) != np.uint64:
        raise ValueError(f"float32 partials need uint64 token words (hidden a multiple of 4); got "
                         f"{np.dtype(word_dtype)}")
    return 2


def make_combine_kernels(threads: int, word_dtype, epilogue=identity_epilogue, f32_partials: bool = False):
    """Build ``(combine_async, combine_wait, combine_async_rows)`` for blocks of ``threads`` threads and token
    words of ``word_dtype`` (NumPy uint64, uint32 or uint16: 4, 2 or 1 bf16 values).

    ``epilogue(value: float32, token: int, col: int, aux: [T, H] float32) -> float32`` is a Numba
    device function applied to each reduced element before the bf16 store (e.g. a residual
    add reading ``aux[token, col]``).

    ``f32_partials`` (compile time): the partials are float32 (``EPConfig.combine_dtype =
    "float32"``), passed as uint64 words, ``P = 2`` per token word (:func:`partial_words`);
    needs uint64 token words. Otherwise bf16 in the token word. The argument types are the
    same either way (word views); only the partial arrays' word counts differ. The choice is
    a closure constant (``F32``): its ``if F32`` branches are folded at compile time, so the
    bf16 kernels are the code they were before the option existed.
    """
    warp, warps = warp_geometry(threads)
    word_t = from_dtype(np.dtype(word_dtype))
    pack = np.dtype(word_dtype).itemsize // 2
    P = partial_words(word_dtype, f32_partials)
    F32 = P == 2
    U = WORDS_IN_FLIGHT
    ACC = U * pack  # float32 accumulators per lane (a compile-time constant for local.array)
    # combine_wait: token words per lane per pass, so that U partial words are in flight
    # (the same bytes and registers as bf16's U words), and its accumulators
    UW = U // P
    ACCW = UW * pack

    @cuda.jit(device=True)
    def publish_partials(ticket, flag, c_signal, g, me, n, R):
        """Every thread: complete this block's puts and stores; the last block (ticket) signals
        ``n + 1`` into slot [g, me] of every rank's combine_signal and resets the ticket."""
        if last_block_ticket(ticket, flag):
            for d in range(cuda.threadIdx.x, R, threads):
                shmem.signal_op(c_signal[g, me:me + 1], uint64(n + 1), shmem.SIGNAL_SET, d)
            cuda.syncthreads()
            if cuda.threadIdx.x == 0:
                ticket[0] = 0

    @kernel_jit(threads)
    def combine_async(expert_out, d_ids, d_counts, c_partials, c_signal,
                      sync, token_rows, row_weight, stage, ticket, status):
        """Weight and pre-reduce the expert outputs per token, send each partial home, signal.

        expert_out [>= rows, W] words, row-aligned with the last expert batch.
        Symmetric: d_ids [G, R, Tmax, K], d_counts [G, R, L + 1] (group g of the last call),
        c_partials [G, R, Tmax, P W] partial words, c_signal [G, R] uint64. Local: sync (calls),
        token_rows [R, Tmax, K], row_weight [C] float32, stage [R, Tmax, P W] partial words,
        ticket [1] int64, status [8] int64.

        A warp per item, part of token (src, t)'s row (``row_parts`` over the W token words:
        whole rows for large batches), U words per lane in flight: partial = sum over the
        token's local experts in ascending order of weight * output, in float32 from 0,
        rounded to bf16 (or kept float32: token word w becomes partial words P w .. P w + P - 1).
        A partial for this rank's own token is stored straight into its slot [g, me, t]; one
        for a peer is staged in stage[src, t] and its partial words [P w0, P w1) put
        (``put_nbi_warp``) to slot [g, me, t] of rank src. Tokens that hit no local expert send
        nothing. The last block (ticket) signals n + 1 to every rank after every block's puts
        and stores completed.
        """
        flag = cuda.shared.array(1, int32)
        acc = cuda.local.array(ACC, float32)
        vals = cuda.local.array(U, word_t)
        if status[STATUS_CODE] != 0:
            return
        me = shmem.my_pe()
        R = d_counts.shape[1]
        L = d_counts.shape[2] - 1
        W = stage.shape[2] // 2 if F32 else stage.shape[2]  # token words
        tid = cuda.threadIdx.x
        lane = tid % warp
        n = sync[SYNC_CALLS] - 1
        g = n % 2
        all_warps = cuda.gridDim.x * warps

        for s in range(R):
            T_s = d_counts[g, s, L]
            parts = row_parts(T_s, W, all_warps, warp)
            span = part_words(W, parts, warp)
            i = cuda.blockIdx.x * warps + tid // warp
            while i < T_s * parts:
                t, w0, w1 = part_bounds(i, parts, span, W)
                n_local = local_expert_count(d_ids[g, s, t], L, me)
                if n_local > 0 and w0 < w1:
                    dst = c_partials[g, me, t] if s == me else stage[s, t]
                    w = w0 + lane
                    while w < w1:  # U words per lane: every row's loads issued before they are used
                        for x in range(U * pack):
                            acc[x] = float32(0.0)
                        for j in range(n_local):
                            r = token_rows[s, t, j]
                            weight = row_weight[r]
                            src = expert_out[r]
                            for u in range(U):
                                if w + u * warp < w1:
                                    vals[u] = src[w + u * warp]
                            for u in range(U):
                                for x in range(pack):
                                    acc[u * pack + x] += weight * word_f32(vals[u], x)
                        for u in range(U):
                            if w + u * warp < w1:
                                if F32:  # unrounded: partial words 2 wu, 2 wu + 1
                                    wu = w + u * warp
                                    dst[2 * wu] = f32_bits_at(acc[u * 4], 0) | f32_bits_at(acc[u * 4 + 1], 1)
                                    dst[2 * wu + 1] = f32_bits_at(acc[u * 4 + 2], 0) | f32_bits_at(acc[u * 4 + 3], 1)
                                else:
                                    packed = uint64(0)
                                    for x in range(pack):
                                        packed |= bf16_bits_at(acc[u * pack + x], x)
                                    dst[w + u * warp] = word_t(packed)
                        w += U * warp
                    if s != me:
                        warp_sync()  # the whole staged part is written before the warp's put
                        if F32:
                            shmem.put_nbi_warp(c_partials[g, me, t, 2 * w0:2 * w1], stage[s, t, 2 * w0:2 * w1], s)
                        else:
                            shmem.put_nbi_warp(c_partials[g, me, t, w0:w1], stage[s, t, w0:w1], s)
                i += all_warps

        publish_partials(ticket, flag, c_signal, g, me, n, R)

    @kernel_jit(threads)
    def combine_async_rows(expert_out, d_ids, d_counts, c_partials, c_signal, sync, ticket, status):
        """Compact layout: send the caller's per-(source, token) rows home as the partials.

        expert_out [R * Tmax, P W] partial words (bf16, or float32 with ``f32_partials``): row
        ``s * Tmax + t`` is this rank's partial for token t of rank s, already weighted and
        reduced over this rank's experts by the caller (the compact batch's row order: one row
        per received token, as DeepEP's and NCCL's users hold them). Rows of tokens that hit no
        local expert are not read. Symmetric and local arrays as in combine_async. Words are
        copied unchanged, so the kernel is the same for either partial format.

        A warp per item (part of a row, ``row_parts``): a row for this rank is copied into
        its own slot [g, me, t], U words per lane in flight; a row for a peer is put
        (``put_nbi_warp``) straight from expert_out to slot [g, me, t] of rank s (no staging).
        The last block (ticket) signals n + 1 to every rank.
        """
        flag = cuda.shared.array(1, int32)
        vals = cuda.local.array(U, word_t)
        if status[STATUS_CODE] != 0:
            return
        me = shmem.my_pe()
        R = d_counts.shape[1]
        L = d_counts.shape[2] - 1
        Tmax = d_ids.shape[2]
        W = c_partials.shape[3]
        tid = cuda.threadIdx.x
        lane = tid % warp
        n = sync[SYNC_CALLS] - 1
        g = n % 2
        all_warps = cuda.gridDim.x * warps

        for s in range(R):
            T_s = d_counts[g, s, L]
            parts = row_parts(T_s, W, all_warps, warp)
            span = part_words(W, parts, warp)
            i = cuda.blockIdx.x * warps + tid // warp
            while i < T_s * parts:
                t, w0, w1 = part_bounds(i, parts, span, W)
                if w0 < w1 and local_expert_count(d_ids[g, s, t], L, me) > 0:
                    src = expert_out[s * Tmax + t]
                    if s == me:
                        dst = c_partials[g, me, t]
                        w = w0 + lane
                        while w < w1:
                            for u in range(U):
                                if w + u * warp < w1:
                                    vals[u] = src[w + u * warp]
                            for u in range(U):
                                if w + u * warp < w1:
                                    dst[w + u * warp] = vals[u]
                            w += U * warp
                    else:
                        shmem.put_nbi_warp(c_partials[g, me, t, w0:w1], src[w0:w1], s)
                i += all_warps

        publish_partials(ticket, flag, c_signal, g, me, n, R)

    @kernel_jit(threads)
    def combine_wait(out, out_partials, d_ids, d_counts, c_partials, c_signal, sync, status, mode,
                     timeout_ns, aux):
        """Wait for every rank's partials, then reduce them per token in rank order.

        MODE_REDUCE: out [T, W] words = bf16(epilogue(sum over ranks r that token t went to,
        in ascending r, of f32(partial_r), from 0)). MODE_PARTIALS: out_partials [R, T, P W]
        partial words = partial_r (zero where the token did not go to r). The array of the
        other mode is not touched (pass any array of the right rank). c_partials [G, R, T, P W]
        partial words. aux [T, H] float32: the epilogue's input.

        Every block waits for all R signals itself, then a warp per item, part of token t's
        row (``row_parts`` over the W token words), grid-strided, U partial words per lane in
        flight (UW = U / P token words). A wait past timeout_ns records an error and writes
        nothing.
        """
        flag = cuda.shared.array(1, int32)
        acc = cuda.local.array(ACCW, float32)
        vals = cuda.local.array(U, word_t)
        if status[STATUS_CODE] != 0:
            return
        me = shmem.my_pe()
        R = d_counts.shape[1]
        L = d_counts.shape[2] - 1
        K = d_ids.shape[3]
        W = c_partials.shape[3] // 2 if F32 else c_partials.shape[3]  # token words
        tid = cuda.threadIdx.x
        lane = tid % warp
        n = sync[SYNC_CALLS] - 1
        g = n % 2

        if tid == 0:
            flag[0] = 0
        cuda.syncthreads()
        for r in range(tid, R, threads):
            seen = shmem.wait_signal_ge(c_signal[g, r:r + 1], n + 1, timeout_ns)
            if seen < uint64(n + 1):
                record_error(status, ERR_TIMEOUT, KERNEL_COMBINE_WAIT, me, r, COUNTER_COMBINE_SIGNAL,
                             n + 1, int64(seen), n + 1)
                flag[0] = 1
        cuda.threadfence_system()
        cuda.syncthreads()
        if flag[0] != 0:
            return

        T = d_counts[g, me, L]
        all_warps = cuda.gridDim.x * warps
        parts = row_parts(T, W, all_warps, warp)
        span = part_words(W, parts, warp)
        i = cuda.blockIdx.x * warps + tid // warp
        while i < T * parts:
            t, w0, w1 = part_bounds(i, parts, span, W)
            went = uint64(0)  # bit r: token t went to rank r
            for k in range(K):
                went |= uint64(1) << uint64(d_ids[g, me, t, k] // L)
            if mode == MODE_REDUCE:
                w = w0 + lane
                while w < w1:  # U partial words per lane: each rank's loads issued before they are used
                    for x in range(UW * pack):
                        acc[x] = float32(0.0)
                    for r in range(R):
                        if (went >> uint64(r)) & uint64(1):
                            src = c_partials[g, r, t]
                            for u in range(UW):
                                if w + u * warp < w1:
                                    if F32:  # token word w + u warp: partial words 2 (w + u warp) + 0, 1
                                        vals[2 * u] = src[2 * (w + u * warp)]
                                        vals[2 * u + 1] = src[2 * (w + u * warp) + 1]
                                    else:
                                        vals[u] = src[w + u * warp]
                            for u in range(UW):
                                for x in range(pack):
                                    if F32:
                                        acc[u * pack + x] += f32_word_at(vals[2 * u + x // 2], x % 2)
                                    else:
                                        acc[u * pack + x] += word_f32(vals[u], x)
                    for u in range(UW):
                        wu = w + u * warp
                        if wu < w1:
                            packed = uint64(0)
                            for x in range(pack):
                                packed |= bf16_bits_at(epilogue(acc[u * pack + x], t, wu * pack + x, aux), x)
                            out[t, wu] = word_t(packed)
                    w += UW * warp
            else:
                for w in range(P * w0 + lane, P * w1, warp):  # partial words
                    for r in range(R):
                        if (went >> uint64(r)) & uint64(1):
                            out_partials[r, t, w] = c_partials[g, r, t, w]
                        else:
                            out_partials[r, t, w] = 0
            i += all_warps

    return combine_async, combine_wait, combine_async_rows
