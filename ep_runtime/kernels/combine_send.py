"""Combine, send half: ``combine_async`` and ``combine_async_rows`` send each token's partial home.

``combine_async`` (the expanded input) weights and pre-reduces the expert outputs of each token
over this rank's local experts; ``combine_async_rows`` (the compact input) sends the caller's
per-(source, token) rows as they are. Each part of each partial row is flagged on arrival
(``combine_row_flag``), so combine_wait reduces it as soon as it lands. docs/protocol.md has
the timeline and the summation order.

:func:`make_combine_send` builds both for a :class:`~ep_runtime.kernels.variant.CombineVariant`
(:func:`make_combine_async`, :func:`make_combine_async_rows`); combine_async's weighted sums are
ep_runtime/kernels/combine_sum.py, the writes to the peers the plan's transport's.
"""

import functools

from ep_runtime.kernels import shmem
from ep_runtime.kernels.block import interleaved_item, local_expert_count, most_tokens, part_bounds
from ep_runtime.kernels.combine_sum import make_partial_sums
from ep_runtime.kernels.cuda_api import cuda, float32, kernel_jit, uint64
from ep_runtime.kernels.partials import flagged_parts, make_home_row, partial_geometry
from ep_runtime.kernels.pdl import make_pdl, programmatic
from ep_runtime.kernels.protocol import STATUS_CODE, SYNC_CALLS
from ep_runtime.kernels.trace import stamp_first, stamp_last
from ep_runtime.kernels.transport import make_transport
from ep_runtime.kernels.variant import CombineVariant
from ep_runtime.kernels.vec import pairs_aligned


@functools.lru_cache(maxsize=None)
def make_combine_send(v: CombineVariant) -> dict:
    """``{"combine_async": ..., "combine_async_rows": ...}`` for ``v``: blocks of ``v.threads``
    threads, token words of ``v.word``, the partial format (``v.f32_partials``: float32, ``P =
    2`` partial words a token word, folded at compile time) and ``v.transport`` (stores into
    the peers' heaps through their NVLink mappings, ``peer_bases``, or NVSHMEM puts)."""
    return {"combine_async": make_combine_async(v), "combine_async_rows": make_combine_async_rows(v)}


def peer_words(pack: int) -> bool:
    """Whether partials stored through peers' NVLink mappings move as uint64 words (16-byte
    pairs): token words of ``pack`` = 4 bf16 values, or 2 float32 partials a word."""
    return pack == 4


@functools.lru_cache(maxsize=None)
def make_combine_async(v: CombineVariant):
    """The ``combine_async`` kernel of ``v`` (:func:`make_combine_send`), marked for PDL when ``v.pdl``."""
    threads = v.threads
    geo = partial_geometry(threads, v.word, v.f32_partials)
    warp, warps, word_t, pack, P, F32 = geo.warp, geo.warps, geo.word_t, geo.pack, geo.P, geo.F32
    tp = make_transport(v.transport, threads, v.node_size, v.node_stores, v.dest_slots)
    grant_credits, stores_to, stages, home_at = tp.grant_credits, tp.stores_to, tp.stages, tp.home_at
    stage_aligned, home_aligned, finish_part = tp.stage_aligned, tp.home_aligned, tp.finish_part
    sum_part = make_partial_sums(threads, v.word, v.f32_partials).sum_part
    home_row = make_home_row(v.partial_slots, v.node_size)
    U = geo.U
    ACC = U * pack  # float32 accumulators per lane (a compile-time constant for local.array)
    UP = geo.UP  # word pairs per lane in flight (pair loops)
    PEER_WORDS = peer_words(pack)
    pdl_wait, pdl_trigger = make_pdl(v.pdl)

    @kernel_jit(threads)
    def combine_async(expert_out, dispatch_topk_ids, dispatch_counts, combine_partials, dispatch_async_sync, token_rows,
                      row_weight, combine_stage, status, peer_bases, dispatch_token_credit, combine_row_flag,
                      relay_partials, relay_flag):
        """Weight and pre-reduce the expert outputs per token, send each partial home, signal.

        expert_out [>= rows, W] words, row-aligned with the last expert batch. Symmetric: dispatch_topk_ids
        [G, R, Tmax, K], dispatch_counts [G, R, L + 1] (group g of the last call), combine_partials [G, R,
        Tmax, P W] partial words, combine_row_flag [R, Tmax, FLAG_PARTS] uint64. Local: dispatch_async_sync
        (calls), token_rows [R, Tmax, K], row_weight [C] float32, stage [R, Tmax, P W] partial words (the puts
        path's staging), status int64. peer_bases [P, R] uint64: row PEER_PARTIALS the address of
        combine_partials on each PE as mapped here, used by a ``stores`` build. dispatch_token_credit [R]
        uint64 symmetric (``dispatch_token_credit``): block 0 first grants every peer the next call's token
        rows (``grant_credits``): this rank's reads of the received rows (dispatch_copy, the caller's
        expert compute on a compact batch) come before combine_async in stream order.

        A warp per item, part p of token (src, t)'s row (``flagged_parts``: the same parts on every rank; the
        sources' items interleaved, ``interleaved_item``, so partials for this rank, device memory only,
        overlap those for peers, NVLink), U words per lane in flight: partial = sum over the token's local
        experts in ascending order of weight * output, in float32 from 0, rounded to bf16 (or kept float32:
        token word w becomes partial words P w .. P w + P - 1). A partial for this rank's own token is stored
        straight into its slot [g, me, t]; one for a peer goes to slot [g, me, t] of rank src (with
        ``v.partial_slots``, [g, j, t]: j this rank's position among the token's destination ranks,
        ``partials.make_home_row``; its flags likewise [j, t, p]): in a ``stores``
        build stored there through its NVLink mapping, as word pairs where the arrays allow it (uint64 words,
        16-byte aligned), else a partial word per lane per step (no NVSHMEM put in the build); in a puts build
        staged in stage[src, t] and its partial words [P w0, P w1) put (``put_signal_nbi_warp``, the part's
        flag with it). Tokens that hit no local expert send nothing. Each part is flagged once stored
        (``flag_part``), this rank's own too: ``combine_row_flag[me, t, p]`` on rank src set to n + 1, so
        combine_wait (launched with PDL, started on the SMs this grid leaves free) reduces each part as it
        lands (docs/protocol.md, "Combine rows as they land"). The kernel lets its dependent start only after
        its own dependency wait (the caller's expert outputs are then complete for combine_wait too).

        The hierarchical transport: a partial for a token whose home is on another node goes to the home's
        proxy on this node (the PE with the home's local index) instead, into its ``relay_partials[row, t]``
        flagged in ``relay_flag[row, t, p]`` (symmetric [X N, Tmax, P W] partial words and [X N, Tmax, FLAG_PARTS]
        uint64; row = x N + this rank's local index, x the index of the home's node among the other
        nodes, N = node_size), and the proxy sends the node's
        sum home (ep_runtime/kernels/relay.py): stored through the proxy's mapping in a stores build
        (``node_stores``), else put.
        """
        acc = cuda.local.array(ACC, float32)
        vals = cuda.local.array(U, word_t)
        lo = cuda.local.array(UP, word_t)
        hi = cuda.local.array(UP, word_t)
        for u in range(UP):  # lanes past a row's end sum these (never stored): keep them finite
            lo[u] = 0
            hi[u] = 0
        for u in range(U):  # and so do the single-word loops' lanes
            vals[u] = 0
        pdl_wait()  # nothing stream-ordered is read before this (ep_runtime/kernels/pdl.py)
        pdl_trigger()  # after the wait: combine_wait may start early
        if status[STATUS_CODE] != 0:
            return
        stamp_first(status, 16)
        if cuda.blockIdx.x == 0 and cuda.threadIdx.x == 0:
            # the next call (n + 1, n = calls - 1)
            grant_credits(dispatch_token_credit, dispatch_async_sync[SYNC_CALLS])
        me = shmem.my_pe()
        R = dispatch_counts.shape[1]
        L = dispatch_counts.shape[2] - 1
        W = combine_partials.shape[3] // P  # token words (stage is an empty stand-in in a stores build)
        tid = cuda.threadIdx.x
        lane = tid % warp
        n = dispatch_async_sync[SYNC_CALLS] - 1
        g = n % 2
        all_warps = cuda.gridDim.x * warps
        pairs = (W % 2 == 0 and pairs_aligned(expert_out) and pairs_aligned(combine_partials)
                 and stage_aligned(combine_stage) and home_aligned(relay_partials))
        direct = PEER_WORDS and pairs  # partials stored into a peer go as word pairs

        # items of every source interleaved (``interleaved_item``): each warp alternates between
        # rows for this rank (device memory only) and rows for peers (NVLink), so the two overlap
        parts, span = flagged_parts(dispatch_counts[g], P * W, warp)  # parts every rank cuts alike, each flagged
        span = span // P  # token words
        items = R * most_tokens(dispatch_counts[g]) * parts
        q = cuda.blockIdx.x * warps + tid // warp
        while q < items:
            s, item = interleaved_item(q, all_warps, R)
            t, w0, w1 = part_bounds(item, parts, span, W)
            if t < dispatch_counts[g, s, L]:
                n_local = local_expert_count(dispatch_topk_ids[g, s, t], L, me)
                if n_local > 0 and w0 < w1:
                    row_at_home = home_row(dispatch_topk_ids, g, s, t, L, R, me)  # this PE's row of s's partials
                    # a peer's partial staged here and put, or stored into it below (home_at)
                    dst = combine_stage[s, t] if stages(me, s) else combine_partials[g, row_at_home, t]
                    stored = stores_to(me, s)  # stored into rank s through its mapping (else written here)
                    to_peer = direct and stored  # ... as word pairs
                    in_pairs = pairs and (to_peer or not stored)  # else a word per lane per step
                    peer_row = uint64(0)
                    if stored:
                        peer_row = home_at(combine_partials, relay_partials, peer_bases, g, row_at_home, s, t)
                    sum_part(expert_out, token_rows, row_weight, s, t, n_local, w0, w1, in_pairs, to_peer, stored,
                             dst, peer_row, lane, acc, vals, lo, hi)
                    pw0 = 2 * w0 if F32 else w0
                    pw1 = 2 * w1 if F32 else w1
                    # flagged where it went, or put from its stage with the flag
                    finish_part(combine_partials, combine_stage, relay_partials, relay_flag, combine_row_flag, g,
                                row_at_home, s, t, item - t * parts, pw0, pw1, n, lane)
            q += all_warps

        stamp_last(status, 17)
        stamp_last(status, 18)

    return programmatic(combine_async, v.pdl)


@functools.lru_cache(maxsize=None)
def make_combine_async_rows(v: CombineVariant):
    """The ``combine_async_rows`` kernel of ``v`` (:func:`make_combine_send`), marked for PDL when
    ``v.pdl``."""
    threads = v.threads
    geo = partial_geometry(threads, v.word, v.f32_partials)
    warp, warps, word_t = geo.warp, geo.warps, geo.word_t
    tp = make_transport(v.transport, threads, v.node_size, v.node_stores, v.dest_slots)
    grant_credits, home_aligned, send_home_part = tp.grant_credits, tp.home_aligned, tp.send_home_part
    home_row = make_home_row(v.partial_slots, v.node_size)
    UP = geo.UP  # word pairs per lane in flight
    PEER_WORDS = peer_words(geo.pack)
    pdl_wait, pdl_trigger = make_pdl(v.pdl)

    @kernel_jit(threads)
    def combine_async_rows(expert_out, dispatch_topk_ids, dispatch_counts, combine_partials, dispatch_async_sync,
                           status, peer_bases, dispatch_token_credit, combine_row_flag, relay_partials, relay_flag):
        """Compact layout: send the caller's per-(source, token) rows home as the partials.

        expert_out [R * Tmax, P W] partial words (bf16, or float32 with ``f32_partials``): row ``s * Tmax +
        t`` is this rank's partial for token t of rank s, already weighted and reduced over this rank's
        experts by the caller (the compact batch's row order: one row per received token, as DeepEP's and
        NCCL's users hold them). Rows of tokens that hit no local expert are not read. Symmetric and local
        arrays, and the grant of the next call's token rows (dispatch_token_credit), as in combine_async.
        Words are copied unchanged, so the kernel is the same for either partial format.

        A warp per item (part of a row, ``row_parts``; the peers' items interleaved, ``interleaved_item`` over
        the R - 1 peers): a row for a peer goes straight from expert_out to slot [g, me, t] of rank s ([g, j,
        t] with ``v.partial_slots``, as in combine_async) (no staging): in a ``stores`` build through its NVLink mapping (peer_bases row 1, as in combine_async),
        16-byte stores of word pairs where the arrays allow it, else a word per lane per step; in a puts build
        ``put_signal_nbi_warp``. This rank's own rows (``s = me``) are not copied: combine_wait reads them
        from expert_out itself (its ``own_rows``), so every warp carries NVLink rows. Each part is flagged as
        combine_async flags its parts (parts of partial words: this one build serves both partial formats).
        The hierarchical transport sends a row whose home is on another node to the home's proxy on this node,
        as combine_async does.
        """
        lo = cuda.local.array(UP, word_t)
        hi = cuda.local.array(UP, word_t)
        pdl_wait()  # nothing stream-ordered is read before this (ep_runtime/kernels/pdl.py)
        pdl_trigger()  # after the wait: combine_wait may start early
        if status[STATUS_CODE] != 0:
            return
        stamp_first(status, 16)
        if cuda.blockIdx.x == 0 and cuda.threadIdx.x == 0:
            # the next call (n + 1, n = calls - 1)
            grant_credits(dispatch_token_credit, dispatch_async_sync[SYNC_CALLS])
        me = shmem.my_pe()
        R = dispatch_counts.shape[1]
        L = dispatch_counts.shape[2] - 1
        Tmax = dispatch_topk_ids.shape[2]
        W = combine_partials.shape[3]
        direct = PEER_WORDS and W % 2 == 0 and pairs_aligned(expert_out) and pairs_aligned(combine_partials) and \
            home_aligned(relay_partials)  # stored into a peer as word pairs
        tid = cuda.threadIdx.x
        lane = tid % warp
        n = dispatch_async_sync[SYNC_CALLS] - 1
        g = n % 2
        all_warps = cuda.gridDim.x * warps

        # the peers' items interleaved (``interleaved_item`` over R - 1 sources, this rank
        # skipped: combine_wait reads its own rows from expert_out)
        parts, span = flagged_parts(dispatch_counts[g], W, warp)  # parts every rank cuts alike (partial words)
        items = (R - 1) * most_tokens(dispatch_counts[g]) * parts
        q = cuda.blockIdx.x * warps + tid // warp
        while q < items:
            s, item = interleaved_item(q, all_warps, R - 1)
            if s >= me:
                s += 1
            t, w0, w1 = part_bounds(item, parts, span, W)
            if t < dispatch_counts[g, s, L]:
                if w0 < w1 and local_expert_count(dispatch_topk_ids[g, s, t], L, me) > 0:
                    row_at_home = home_row(dispatch_topk_ids, g, s, t, L, R, me)  # this PE's row of s's partials
                    send_home_part(expert_out[s * Tmax + t], w0, w1, combine_partials, relay_partials, relay_flag,
                                   combine_row_flag, peer_bases, g, row_at_home, s, t, item - t * parts, n, direct,
                                   lane, lo, hi)
            q += all_warps

        stamp_last(status, 17)
        stamp_last(status, 18)

    return programmatic(combine_async_rows, v.pdl)
