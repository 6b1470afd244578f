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

from ep_runtime.kernels import pdl, shmem
from ep_runtime.kernels.bits import bf16_bits_at, f32_bits_at, f32_to_bf16, f32_word_at, word_f32
from ep_runtime.kernels.block import (await_part, flag_part, flag_rule, grant_token_credits, interleaved_item,
                                      interleaved_rows, last_block_ticket, local_expert_count, most_tokens,
                                      part_bounds, part_words, record_error, row_parts, warp_geometry, warp_sync)
from ep_runtime.kernels.cuda_api import cuda, kernel_jit
from ep_runtime.kernels.trace import stamp_first, stamp_last
from ep_runtime.kernels.vec import (address_of, load_pair, make_pair_loops, pack_bf16x2, pack_bf16x4, pack_f32x2,
                                   pairs_aligned, store_pair, store_pair_at, store_word_at)
from ep_runtime.layout import COMBINE_FLAG_PARTS as FLAG_PARTS
from ep_runtime.layout import PEER_PARTIALS, STATUS_CODE, SYNC_CALLS
from ep_runtime.status import COUNTER_COMBINE_ROW_FLAG, COUNTER_COMBINE_SIGNAL, ERR_TIMEOUT, KERNEL_COMBINE_WAIT

#: Words of a row each lane loads before using any of them (memory-level parallelism: with
#: 8-byte words, 64 bytes per lane and 32 KB per 512-thread block in flight per row read).
#: combine_async reads a token's expert rows one after another, combine_wait its ranks'
#: partials; within each row the U loads are independent. Where rows allow it they move as
#: word pairs (``kernels/vec.py``: one 16-byte access each for uint64 words), U / 2 pairs.
WORDS_IN_FLIGHT = 8

#: combine_wait modes
MODE_REDUCE = 0      # out [T, H]: sum of the partials, epilogue, bf16
MODE_PARTIALS = 1    # out [R, T, H]: each rank's partial (zero where the token did not go)


@cuda.jit(device=True)
def rows_flagged(counts, row_flags_from):
    """Whether this call's partials are flagged part by part on arrival (``combine_row_flag``)
    so combine_wait reduces each part as it lands: the most tokens any source dispatched is at
    least ``row_flags_from`` (int64; 0: never). Sender and receiver decide alike."""
    return row_flags_from > 0 and most_tokens(counts) >= row_flags_from


@cuda.jit(device=True)
def flagged_parts(counts, PW, warp):
    """``(parts, span)`` of a flagged call's partial rows of ``PW`` partial words, the same on
    every rank whatever its grid and build: :func:`~ep_runtime.kernels.block.flag_rule` for the
    R x (most tokens) rows of the call, at most FLAG_PARTS parts a row, each part ``span``
    partial words (a multiple of ``warp``, so of P). Kernels that walk token words divide
    ``span`` by P; combine_async_rows, one build for both partial formats, walks partial words."""
    return flag_rule(counts.shape[0] * max(most_tokens(counts), 1), PW, FLAG_PARTS, warp)


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


def make_combine_kernels(threads: int, word_dtype, epilogue=identity_epilogue, f32_partials: bool = False,
                         stores: bool = True):
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

    ``stores`` (compile time, as for the dispatch kernels): combine_async and combine_async_rows
    store the partials into the peers' heaps through the NVLink mappings (``peer_bases``),
    else they put them with NVSHMEM; combine_wait does not depend on it.
    """
    warp, warps = warp_geometry(threads)
    STORES = bool(stores)  # peer stores (else NVSHMEM puts)
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
    UP = U // 2  # word pairs per lane in flight (pair loops)
    # stores through peers' NVLink mappings move uint64 words (16-byte pairs): 4 bf16 values or
    # 2 float32 partials a word
    PEER_WORDS = pack == 4
    UPW = UP // P  # combine_wait's token-word pairs per pass: UP partial-word pairs in flight
    load_pairs, store_pairs, store_pairs_at = make_pair_loops(UP, warp)

    @cuda.jit(device=True)
    def rounded_word(acc, b):
        """The token word of bf16 values rounded from acc[b .. b + pack - 1] (element 0 in the
        low bits)."""
        if pack == 4:
            return word_t(pack_bf16x4(acc[b], acc[b + 1], acc[b + 2], acc[b + 3]))
        if pack == 2:
            return word_t(pack_bf16x2(acc[b], acc[b + 1]))
        return word_t(f32_to_bf16(acc[b]))

    @cuda.jit(device=True)
    def store_partial_pair(dst, wu, acc, b):
        """Store the partials of token words wu, wu + 1 (acc[b .. b + 2 pack - 1]) into the
        partial row ``dst``: rounded to bf16 (one word pair), or float32 unrounded (``F32``:
        partial words 2 wu .. 2 wu + 3, two pairs)."""
        if F32:
            store_pair(dst, 2 * wu, pack_f32x2(acc[b], acc[b + 1]), pack_f32x2(acc[b + 2], acc[b + 3]))
            store_pair(dst, 2 * wu + 2, pack_f32x2(acc[b + 4], acc[b + 5]), pack_f32x2(acc[b + 6], acc[b + 7]))
        else:
            store_pair(dst, wu, rounded_word(acc, b), rounded_word(acc, b + pack))

    @cuda.jit(device=True)
    def store_partial_pair_at(row, wu, acc, b):
        """As ``store_partial_pair``, into the partial row at address ``row`` (a peer's, through
        its NVLink mapping; uint64 words)."""
        if F32:
            store_pair_at(row, 2 * wu, pack_f32x2(acc[b], acc[b + 1]), pack_f32x2(acc[b + 2], acc[b + 3]))
            store_pair_at(row, 2 * wu + 2, pack_f32x2(acc[b + 4], acc[b + 5]), pack_f32x2(acc[b + 6], acc[b + 7]))
        else:
            store_pair_at(row, wu, uint64(rounded_word(acc, b)), uint64(rounded_word(acc, b + pack)))

    @cuda.jit(device=True)
    def publish_partials(ticket, flag, c_signal, g, me, n, R):
        """Every thread: complete this block's puts and stores; the last block (ticket) signals
        ``n + 1`` into slot [g, me] of every rank's combine_signal and resets the ticket."""
        if last_block_ticket(ticket, flag, STORES):  # a stores build puts nothing
            for d in range(cuda.threadIdx.x, R, threads):
                shmem.signal_op(c_signal[g, me:me + 1], uint64(n + 1), shmem.SIGNAL_SET, d)
            cuda.syncthreads()
            if cuda.threadIdx.x == 0:
                ticket[0] = 0

    @kernel_jit(threads)
    def combine_async(expert_out, d_ids, d_counts, c_partials, c_signal,
                      sync, token_rows, row_weight, stage, ticket, status, peer_bases, d_credit,
                      c_row_flag, row_flags_from):
        """Weight and pre-reduce the expert outputs per token, send each partial home, signal.

        expert_out [>= rows, W] words, row-aligned with the last expert batch.
        Symmetric: d_ids [G, R, Tmax, K], d_counts [G, R, L + 1] (group g of the last call),
        c_partials [G, R, Tmax, P W] partial words, c_signal [G, R] uint64. Local: sync (calls),
        token_rows [R, Tmax, K], row_weight [C] float32, stage [R, Tmax, P W] partial words,
        ticket [1] int64, status [8] int64. peer_bases [2, R] uint64: row 1 the address of
        c_partials on each PE as mapped here, used by a ``stores`` build.
        d_credit [R] uint64 symmetric (``dispatch_token_credit``): block 0 first grants every
        peer the next call's token rows (``grant_token_credits``): this rank's reads of the
        received rows (dispatch_copy, the caller's expert compute on a compact batch) come
        before combine_async in stream order.

        A warp per item, part of token (src, t)'s row (``row_parts`` over the W token words:
        whole rows for large batches; the sources' items interleaved, ``interleaved_item``, so
        partials for this rank, device memory only, overlap those for peers, NVLink), U words per
        lane in flight: partial = sum over the
        token's local experts in ascending order of weight * output, in float32 from 0,
        rounded to bf16 (or kept float32: token word w becomes partial words P w .. P w + P - 1).
        A partial for this rank's own token is stored straight into its slot [g, me, t]; one
        for a peer goes to slot [g, me, t] of rank src: in a ``stores`` build stored there
        through its NVLink mapping, as word pairs where the arrays allow it (uint64 words,
        16-byte aligned), else a partial word per lane per step (no NVSHMEM put in the build);
        in a puts build staged in stage[src, t] and its partial words [P w0, P w1) put
        (``put_nbi_warp``). Tokens that hit no local expert send
        nothing. The last block (ticket) signals n + 1 to every rank after every block's puts
        and stores completed.

        Flagged calls (``rows_flagged``: some source sent at least row_flags_from tokens; the
        default, docs/protocol.md "Combine rows as they land"): a warp item is a part of a row
        (``flagged_parts``: the same parts on every rank), each flagged once stored
        (``flag_part``; staged parts by ``put_signal_nbi_warp``), this rank's own too:
        c_row_flag [R, Tmax, FLAG_PARTS] uint64 symmetric, ``[me, t, p]`` on rank src set to
        n + 1, so combine_wait (launched with PDL, started on the SMs this grid leaves free)
        reduces each part as it lands; no ticket, no signal. The kernel lets its dependent start
        only after its own dependency wait (the caller's expert outputs are then complete for
        combine_wait too). c_row_flag, row_flags_from: as in combine_wait.
        """
        flag = cuda.shared.array(1, int32)
        acc = cuda.local.array(ACC, float32)
        vals = cuda.local.array(U, word_t)
        lo = cuda.local.array(UP, word_t)
        hi = cuda.local.array(UP, word_t)
        for u in range(UP):  # lanes past a row's end sum these (never stored): keep them finite
            lo[u] = 0
            hi[u] = 0
        for u in range(U):  # and so do the single-word loops' lanes
            vals[u] = 0
        pdl.dependency_wait()  # nothing stream-ordered is read before this (kernels/pdl.py)
        pdl.trigger_dependents()  # after the wait: combine_wait may start early (rows flagged)
        if status[STATUS_CODE] != 0:
            return
        stamp_first(status, 16)
        if cuda.blockIdx.x == 0 and cuda.threadIdx.x == 0:
            grant_token_credits(d_credit, sync[SYNC_CALLS])  # the next call (n + 1, n = calls - 1)
        me = shmem.my_pe()
        R = d_counts.shape[1]
        L = d_counts.shape[2] - 1
        W = stage.shape[2] // 2 if F32 else stage.shape[2]  # token words
        tid = cuda.threadIdx.x
        lane = tid % warp
        n = sync[SYNC_CALLS] - 1
        g = n % 2
        all_warps = cuda.gridDim.x * warps
        pairs = W % 2 == 0 and pairs_aligned(expert_out) and pairs_aligned(stage) and pairs_aligned(c_partials)
        direct = PEER_WORDS and pairs and STORES

        # items of every source interleaved (``interleaved_item``): each warp alternates between
        # rows for this rank (device memory only) and rows for peers (NVLink), so the two overlap
        parts, span, items = interleaved_rows(d_counts[g], W, all_warps, warp)
        flagged = rows_flagged(d_counts[g], row_flags_from)
        if flagged:  # parts every rank computes alike (in partial words), each flagged
            parts, span = flagged_parts(d_counts[g], P * W, warp)
            span = span // P  # token words
            items = R * most_tokens(d_counts[g]) * parts
        q = cuda.blockIdx.x * warps + tid // warp
        while q < items:
            s, item = interleaved_item(q, all_warps, R)
            t, w0, w1 = part_bounds(item, parts, span, W)
            if t < d_counts[g, s, L]:
                n_local = local_expert_count(d_ids[g, s, t], L, me)
                if n_local > 0 and w0 < w1:
                    dst = c_partials[g, me, t] if s == me else stage[s, t]
                    stored = STORES and s != me  # stored into rank s through its mapping (else staged, put)
                    to_peer = direct and s != me  # ... as word pairs
                    in_pairs = pairs and (to_peer or not stored)  # else a word per lane per step
                    peer_row = uint64(0)
                    if stored:  # slot [g, me, t] of rank s: the same offset on every PE
                        peer_row = peer_bases[PEER_PARTIALS, s] + (address_of(c_partials[g, me, t])
                                                                   - address_of(c_partials))
                    w = w0 + 2 * lane
                    while in_pairs and w < w1:  # UP word pairs per lane: every row's loads issued before use
                        for x in range(U * pack):
                            acc[x] = float32(0.0)
                        for j in range(n_local):
                            r = token_rows[s, t, j]
                            weight = row_weight[r]
                            load_pairs(expert_out[r], w, w1, lo, hi)
                            for u in range(UP):
                                for x in range(pack):
                                    acc[2 * u * pack + x] += weight * word_f32(lo[u], x)
                                    acc[(2 * u + 1) * pack + x] += weight * word_f32(hi[u], x)
                        for u in range(UP):
                            if w + 2 * u * warp < w1:
                                if to_peer:
                                    store_partial_pair_at(peer_row, w + 2 * u * warp, acc, 2 * u * pack)
                                else:
                                    store_partial_pair(dst, w + 2 * u * warp, acc, 2 * u * pack)
                        w += 2 * UP * warp
                    w = w0 + lane
                    while not in_pairs and w < w1:  # U words per lane: every row's loads issued before use
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
                                    p0 = f32_bits_at(acc[u * 4], 0) | f32_bits_at(acc[u * 4 + 1], 1)
                                    p1 = f32_bits_at(acc[u * 4 + 2], 0) | f32_bits_at(acc[u * 4 + 3], 1)
                                    if stored:
                                        store_word_at(peer_row, 2 * wu, uint64(p0))
                                        store_word_at(peer_row, 2 * wu + 1, uint64(p1))
                                    else:
                                        dst[2 * wu] = p0
                                        dst[2 * wu + 1] = p1
                                else:
                                    packed = uint64(0)
                                    for x in range(pack):
                                        packed |= bf16_bits_at(acc[u * pack + x], x)
                                    if stored:
                                        store_word_at(peer_row, w + u * warp, word_t(packed))
                                    else:
                                        dst[w + u * warp] = word_t(packed)
                        w += U * warp
                    if s != me and not stored:
                        warp_sync()  # the whole staged part is written before the warp's put
                        pw0 = 2 * w0 if F32 else w0
                        pw1 = 2 * w1 if F32 else w1
                        if flagged:
                            p = item - t * parts
                            shmem.put_signal_nbi_warp(c_partials[g, me, t, pw0:pw1], stage[s, t, pw0:pw1],
                                                      c_row_flag[me, t, p:p + 1], uint64(n + 1), shmem.SIGNAL_SET, s)
                        else:
                            shmem.put_nbi_warp(c_partials[g, me, t, pw0:pw1], stage[s, t, pw0:pw1], s)
                    elif flagged:
                        flag_part(c_row_flag, me, t, item - t * parts, n, uint64(1) << uint64(s), lane)
            q += all_warps

        stamp_last(status, 17)
        if not flagged:  # a flagged call's parts carry their own flags: no ticket, no signal
            publish_partials(ticket, flag, c_signal, g, me, n, R)
        stamp_last(status, 18)

    @kernel_jit(threads)
    def combine_async_rows(expert_out, d_ids, d_counts, c_partials, c_signal, sync, ticket, status, peer_bases,
                           d_credit, c_row_flag, row_flags_from):
        """Compact layout: send the caller's per-(source, token) rows home as the partials.

        expert_out [R * Tmax, P W] partial words (bf16, or float32 with ``f32_partials``): row
        ``s * Tmax + t`` is this rank's partial for token t of rank s, already weighted and
        reduced over this rank's experts by the caller (the compact batch's row order: one row
        per received token, as DeepEP's and NCCL's users hold them). Rows of tokens that hit no
        local expert are not read. Symmetric and local arrays, and the grant of the next call's
        token rows (d_credit), as in combine_async. Words are copied unchanged, so the kernel is
        the same for either partial format.

        A warp per item (part of a row, ``row_parts``; the peers' items interleaved,
        ``interleaved_item`` over the R - 1 peers): a row for a peer goes straight from
        expert_out to slot [g, me, t] of rank s (no staging): in a ``stores`` build through its
        NVLink mapping (peer_bases row 1, as in combine_async), 16-byte stores of word pairs
        where the arrays allow it, else a word per lane per step; in a puts build
        ``put_nbi_warp``. This rank's own rows (``s = me``) are not copied: combine_wait
        reads them from expert_out itself (its ``own_rows``), so every warp carries NVLink rows.
        The last block (ticket) signals n + 1 to every rank. Flagged calls flag each part as
        combine_async does (parts of partial words: this one build serves both partial formats;
        ``put_signal_nbi_warp`` on the puts path), with no ticket and no signal.
        """
        flag = cuda.shared.array(1, int32)
        lo = cuda.local.array(UP, word_t)
        hi = cuda.local.array(UP, word_t)
        pdl.dependency_wait()  # nothing stream-ordered is read before this (kernels/pdl.py)
        pdl.trigger_dependents()  # after the wait: combine_wait may start early (rows flagged)
        if status[STATUS_CODE] != 0:
            return
        stamp_first(status, 16)
        if cuda.blockIdx.x == 0 and cuda.threadIdx.x == 0:
            grant_token_credits(d_credit, sync[SYNC_CALLS])  # the next call (n + 1, n = calls - 1)
        me = shmem.my_pe()
        R = d_counts.shape[1]
        L = d_counts.shape[2] - 1
        Tmax = d_ids.shape[2]
        W = c_partials.shape[3]
        pairs = W % 2 == 0 and pairs_aligned(expert_out) and pairs_aligned(c_partials)
        direct = PEER_WORDS and pairs and STORES
        tid = cuda.threadIdx.x
        lane = tid % warp
        n = sync[SYNC_CALLS] - 1
        g = n % 2
        all_warps = cuda.gridDim.x * warps

        # the peers' items interleaved (``interleaved_item`` over R - 1 sources, this rank
        # skipped: combine_wait reads its own rows from expert_out)
        parts, span, items = interleaved_rows(d_counts[g], W, all_warps, warp)
        flagged = rows_flagged(d_counts[g], row_flags_from)
        if flagged:  # parts every rank computes alike (in partial words: this kernel's W), each flagged
            parts, span = flagged_parts(d_counts[g], W, warp)
            items = R * most_tokens(d_counts[g]) * parts
        items = items // R * (R - 1)
        q = cuda.blockIdx.x * warps + tid // warp
        while q < items:
            s, item = interleaved_item(q, all_warps, R - 1)
            if s >= me:
                s += 1
            t, w0, w1 = part_bounds(item, parts, span, W)
            if t < d_counts[g, s, L]:
                if w0 < w1 and local_expert_count(d_ids[g, s, t], L, me) > 0:
                    src = expert_out[s * Tmax + t]
                    if STORES:  # through the mapping: slot [g, me, t] of rank s, the same offset on every PE
                        peer_row = peer_bases[PEER_PARTIALS, s] + (address_of(c_partials[g, me, t])
                                                                   - address_of(c_partials))
                        if direct:  # UP pairs per lane in flight
                            w = w0 + 2 * lane
                            while w < w1:
                                load_pairs(src, w, w1, lo, hi)
                                store_pairs_at(peer_row, w, w1, lo, hi)
                                w += 2 * UP * warp
                        else:  # rows without 16-byte word pairs: a word per lane per step
                            for w in range(w0 + lane, w1, warp):
                                store_word_at(peer_row, w, src[w])
                        if flagged:
                            flag_part(c_row_flag, me, t, item - t * parts, n, uint64(1) << uint64(s), lane)
                    elif flagged:
                        p = item - t * parts
                        shmem.put_signal_nbi_warp(c_partials[g, me, t, w0:w1], src[w0:w1], c_row_flag[me, t, p:p + 1],
                                                  uint64(n + 1), shmem.SIGNAL_SET, s)
                    else:
                        shmem.put_nbi_warp(c_partials[g, me, t, w0:w1], src[w0:w1], s)
            q += all_warps

        stamp_last(status, 17)
        if not flagged:  # a flagged call's parts carry their own flags: no ticket, no signal
            publish_partials(ticket, flag, c_signal, g, me, n, R)
        stamp_last(status, 18)

    @kernel_jit(threads)
    def combine_wait(out, out_partials, d_ids, d_counts, c_partials, c_signal, sync, status, mode,
                     timeout_ns, aux, own_rows, c_row_flag, claims, row_flags_from):
        """Wait for every rank's partials, then reduce them per token in rank order.

        MODE_REDUCE: out [T, W] words = bf16(epilogue(sum over ranks r that token t went to,
        in ascending r, of f32(partial_r), from 0)). MODE_PARTIALS: out_partials [R, T, P W]
        partial words = partial_r (zero where the token did not go to r). The array of the
        other mode is not touched (pass any array of the right rank). c_partials [G, R, T, P W]
        partial words. aux [T, H] float32: the epilogue's input. own_rows: after
        combine_async_rows (compact layout), its expert_out [R * Tmax, P W] partial words, where
        this rank's own partial of token t is row ``me * Tmax + t`` (combine_async_rows does not
        copy it); after combine_async, an empty [0, 0] array (the own partial is in
        c_partials[g, me, t]).

        Every block waits for all R signals itself, then a warp per item, part of token t's
        row (``row_parts`` over the W token words), grid-strided, U partial words per lane in
        flight (UW = U / P token words). A wait past timeout_ns records an error and writes
        nothing.

        Flagged calls (``rows_flagged``, decided as the senders decide): no signal wait and no
        dependency wait first (combine_async lets this kernel start once the caller's data is
        complete, so with PDL its blocks start on the SMs combine_async leaves free and work
        while the partials arrive). Each warp claims the senders' parts (``flagged_parts``) in
        turn (lane 0: ``claims[g]``, int32 [2], an atomic counter that dispatch_wait of the call
        zeroes), lane 0 waits for the part's flags (``c_row_flag[r, t, p] >= n + 1`` for every
        rank r the token went to, this rank's own row in expert_out excepted), and the warp
        reduces the part as above; parts are claimed in token order, the order they are sent.
        The same sums in the same order as the signalled path: results are bit-identical.
        Before it exits the kernel waits for combine_async to complete (``dependency_wait``),
        so stream order still holds for what follows. A flag's timeout records the rank and
        the token, and the other warps stop claiming.
        """
        flag = cuda.shared.array(1, int32)
        claim = cuda.shared.array(warps, int32)  # each warp's claimed part (flagged calls), then its flags' verdict
        acc = cuda.local.array(ACCW, float32)
        vals = cuda.local.array(U, word_t)
        lo = cuda.local.array(UP, word_t)
        hi = cuda.local.array(UP, word_t)
        for u in range(UP):  # lanes past a row's end sum these (never stored): keep them finite
            lo[u] = 0
            hi[u] = 0
        for u in range(U):  # and so do the single-word loops' lanes
            vals[u] = 0
        pdl.trigger_dependents()
        # what is read before the dependency wait (counts, calls, status, the caller's arrays)
        # was complete before combine_async started, which triggers this kernel only after its
        # own dependency wait
        n = sync[SYNC_CALLS] - 1
        g = n % 2
        flagged = rows_flagged(d_counts[g], row_flags_from)
        if not flagged:
            pdl.dependency_wait()  # nothing stream-ordered is read before this (kernels/pdl.py)
        if status[STATUS_CODE] != 0:
            pdl.dependency_wait()
            return
        stamp_first(status, 20)
        me = shmem.my_pe()
        R = d_counts.shape[1]
        L = d_counts.shape[2] - 1
        K = d_ids.shape[3]
        W = c_partials.shape[3] // 2 if F32 else c_partials.shape[3]  # token words
        own = own_rows.shape[0] > 0  # this rank's partials in the compact expert_out
        pairs = (W % 2 == 0 and pairs_aligned(out) and pairs_aligned(c_partials)
                 and (not own or pairs_aligned(own_rows)))
        tid = cuda.threadIdx.x
        lane = tid % warp
        wid = tid // warp

        if tid == 0:
            flag[0] = 0
        cuda.syncthreads()
        for r in range(tid, R if not flagged else 0, threads):
            seen = shmem.wait_signal_ge(c_signal[g, r:r + 1], n + 1, timeout_ns)
            if seen < uint64(n + 1):
                record_error(status, ERR_TIMEOUT, KERNEL_COMBINE_WAIT, me, r, COUNTER_COMBINE_SIGNAL,
                             n + 1, int64(seen), n + 1)
                flag[0] = 1
        cuda.syncthreads()  # the waits' acquire loads, then the barrier: the signalled data is visible
        if flag[0] != 0:
            return
        stamp_last(status, 21)

        T = d_counts[g, me, L]
        Tmax = d_ids.shape[2]
        all_warps = cuda.gridDim.x * warps
        if flagged:  # the senders' parts (flagged_parts counts partial words)
            parts, span = flagged_parts(d_counts[g], P * W, warp)
            span = span // P
        else:
            parts = row_parts(T, W, all_warps, warp)
            span = part_words(W, parts, warp)
        i = cuda.blockIdx.x * warps + wid
        while True:
            if flagged:  # claim the next row (token order: the order the senders send them)
                if lane == 0:
                    c = T * parts
                    if status[STATUS_CODE] == 0:
                        c = cuda.atomic.add(claims, g, int32(1))
                    claim[wid] = c
                warp_sync()
                i = claim[wid]
                warp_sync()  # read by every lane before lane 0 writes it again
            if i >= T * parts:
                break
            t, w0, w1 = part_bounds(i, parts, span, W)
            went = uint64(0)  # bit r: token t went to rank r
            for k in range(K):
                went |= uint64(1) << uint64(d_ids[g, me, t, k] // L)
            if flagged:  # lane 0 waits for the part's partials (its own in expert_out are there)
                if lane == 0:
                    ok = 1
                    p = i - t * parts
                    for r in range(R):
                        if w0 < w1 and (went >> uint64(r)) & uint64(1) and not (own and r == me):
                            if not await_part(c_row_flag, r, t, p, n, timeout_ns, status, KERNEL_COMBINE_WAIT,
                                              COUNTER_COMBINE_ROW_FLAG):
                                ok = 0
                                break
                    claim[wid] = ok
                warp_sync()
                ok = claim[wid]
                warp_sync()
                if ok == 0:
                    break
            if mode == MODE_REDUCE:
                orow = out[t]
                w = w0 + 2 * lane
                while pairs and w < w1:  # UP partial-word pairs per lane: each rank's loads issued before use
                    for x in range(2 * UPW * pack):
                        acc[x] = float32(0.0)
                    for r in range(R):
                        if (went >> uint64(r)) & uint64(1):
                            src = own_rows[me * Tmax + t] if own and r == me else c_partials[g, r, t]
                            for u in range(UPW):
                                wu = w + 2 * u * warp
                                if wu < w1:
                                    if F32:  # token words wu, wu + 1: partial words 2 wu .. 2 wu + 3
                                        pair = load_pair(src, 2 * wu)
                                        lo[2 * u] = pair[0]
                                        hi[2 * u] = pair[1]
                                        pair = load_pair(src, 2 * wu + 2)
                                        lo[2 * u + 1] = pair[0]
                                        hi[2 * u + 1] = pair[1]
                                    else:
                                        pair = load_pair(src, wu)
                                        lo[u] = pair[0]
                                        hi[u] = pair[1]
                            for u in range(UPW):
                                for x in range(pack):
                                    if F32:
                                        acc[2 * u * pack + x] += f32_word_at(lo[2 * u] if x < 2 else hi[2 * u], x % 2)
                                        acc[(2 * u + 1) * pack + x] += f32_word_at(
                                            lo[2 * u + 1] if x < 2 else hi[2 * u + 1], x % 2)
                                    else:
                                        acc[2 * u * pack + x] += word_f32(lo[u], x)
                                        acc[(2 * u + 1) * pack + x] += word_f32(hi[u], x)
                    for u in range(UPW):
                        wu = w + 2 * u * warp
                        if wu < w1:
                            for x in range(2 * pack):
                                acc[2 * u * pack + x] = epilogue(acc[2 * u * pack + x], t, wu * pack + x, aux)
                            store_pair(orow, wu, rounded_word(acc, 2 * u * pack), rounded_word(acc, (2 * u + 1) * pack))
                    w += 2 * UPW * warp
                w = w0 + lane
                while not pairs and w < w1:  # U partial words per lane: each rank's loads issued before use
                    for x in range(UW * pack):
                        acc[x] = float32(0.0)
                    for r in range(R):
                        if (went >> uint64(r)) & uint64(1):
                            src = own_rows[me * Tmax + t] if own and r == me else c_partials[g, r, t]
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
                            if own and r == me:
                                out_partials[r, t, w] = own_rows[me * Tmax + t, w]
                            else:
                                out_partials[r, t, w] = c_partials[g, r, t, w]
                        else:
                            out_partials[r, t, w] = 0
            if not flagged:
                i += all_warps
        stamp_last(status, 22)
        pdl.dependency_wait()  # flagged rows: completes after combine_async (stream order for what follows)

    # each waits for its predecessor on the device first: launchable with PDL
    return pdl.programmatic(combine_async), pdl.programmatic(combine_wait), pdl.programmatic(combine_async_rows)
