"""Combine, send half of the dense layout: ``combine_async_dense`` sends the caller's dense rows home.

The dense layout's combine input is DeepEP's: one row per dense row (a received (token, source
rank), in ``dispatch_dense``'s order, :mod:`ep_runtime.kernels.layouts.dense`), each this rank's
partial for that token, already combined over this rank's experts by the caller. The kernel
finds the row of each (source, token) through ``slot_dense_row`` (no host-side reordering) and
sends it home unchanged, as ``combine_async_rows`` sends a compact row, flagged part by part;
combine_wait sums the partials as after any combine_async.

:func:`make_combine_async_dense` builds it for a :class:`~ep_runtime.kernels.variant.CombineVariant`.
"""

import functools

from ep_runtime.kernels import shmem
from ep_runtime.kernels.block import interleaved_item, most_tokens, part_bounds, record_error
from ep_runtime.kernels.combine_send import peer_words
from ep_runtime.kernels.cuda_api import cuda, int64, kernel_jit
from ep_runtime.kernels.partials import flagged_parts, make_home_row, partial_geometry
from ep_runtime.kernels.pdl import make_pdl, programmatic
from ep_runtime.kernels.protocol import ERR_SHORT_ROWS, KERNEL_COMBINE_ASYNC, STATUS_CODE, SYNC_CALLS
from ep_runtime.kernels.trace import stamp_first, stamp_last
from ep_runtime.kernels.transport import make_transport
from ep_runtime.kernels.variant import CombineVariant
from ep_runtime.kernels.vec import pairs_aligned


@functools.lru_cache(maxsize=None)
def make_combine_async_dense(v: CombineVariant):
    """The ``combine_async_dense`` kernel of ``v`` (words copied unchanged: the bf16-partials
    build serves float32 partials too), marked for PDL when ``v.pdl``."""
    threads = v.threads
    geo = partial_geometry(threads, v.word, v.f32_partials)
    warp, warps, word_t = geo.warp, geo.warps, geo.word_t
    tp = make_transport(v.transport, threads, v.node_size, v.node_stores, v.dest_slots)
    grant_credits, home_aligned, send_home_part = tp.grant_credits, tp.home_aligned, tp.send_home_part
    finish_part = tp.finish_part
    home_row = make_home_row(v.partial_slots, v.node_size)
    UP = geo.UP  # word pairs per lane in flight
    PEER_WORDS = peer_words(geo.pack)
    pdl_wait, pdl_trigger = make_pdl(v.pdl)

    @kernel_jit(threads)
    def combine_async_dense(expert_out, dispatch_topk_ids, dispatch_counts, combine_partials, dispatch_async_sync,
                            status, peer_bases, dispatch_token_credit, combine_row_flag, relay_partials, relay_flag,
                            combine_stage, slot_dense_row):
        """Dense layout: send the caller's dense rows home as the partials.

        expert_out [rows, P W] partial words (bf16, or float32 with ``f32_partials``): row
        ``slot_dense_row[s, t]`` (int32 [R, Tmax], written by this call's dispatch_dense; -1 where token t of
        rank s did not come here) is this rank's partial for token t of rank s, already combined over this
        rank's experts by the caller (DeepEP's combine input). Symmetric and local arrays, and the grant of
        the next call's token rows (dispatch_token_credit), as in combine_async; combine_stage [R, Tmax, P W]
        (the puts transport's staging; an empty stand-in otherwise) only types the transport's flag path.

        A warp per item (part of a row, ``flagged_parts``; the sources' items interleaved,
        ``interleaved_item``): a row for a peer goes from expert_out to slot [g, me, t] of rank s ([g, j, t]
        with ``v.partial_slots``: j this rank's destination slot, ``partials.make_home_row``) (the
        transport's ``send_home_part``: stores through its NVLink mapping, or a put with the part's flag);
        this rank's own row is copied into its own slot [g, me, t] and flagged there (combine_wait then reads
        every partial from combine_partials). A row past ``expert_out``'s rows records ``ERR_SHORT_ROWS``
        (naming the rank, the row and the rows given) and is not sent: its home's combine_wait times out.
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
        W = combine_partials.shape[3]
        direct = PEER_WORDS and W % 2 == 0 and pairs_aligned(expert_out) and pairs_aligned(combine_partials) and \
            home_aligned(relay_partials)  # stored into a peer as word pairs
        tid = cuda.threadIdx.x
        lane = tid % warp
        n = dispatch_async_sync[SYNC_CALLS] - 1
        g = n % 2
        all_warps = cuda.gridDim.x * warps

        parts, span = flagged_parts(dispatch_counts[g], W, warp)  # parts every rank cuts alike (partial words)
        items = R * most_tokens(dispatch_counts[g]) * parts
        q = cuda.blockIdx.x * warps + tid // warp
        while q < items:
            s, item = interleaved_item(q, all_warps, R)
            t, w0, w1 = part_bounds(item, parts, span, W)
            if t < dispatch_counts[g, s, L] and w0 < w1:
                row = slot_dense_row[s, t]
                if row >= expert_out.shape[0]:
                    if lane == 0:
                        record_error(status, ERR_SHORT_ROWS, KERNEL_COMBINE_ASYNC, me, row, -1,
                                     int64(row) + 1, int64(expert_out.shape[0]), n + 1)
                elif row >= 0 and s == me:  # this rank's own partial: into its own slot, flagged there
                    row_at_home = home_row(dispatch_topk_ids, g, s, t, L, R, me)  # this PE's row of its partials
                    src = expert_out[row]
                    dst = combine_partials[g, row_at_home, t]
                    for w in range(w0 + lane, w1, warp):
                        dst[w] = src[w]
                    finish_part(combine_partials, combine_stage, relay_partials, relay_flag, combine_row_flag, g,
                                row_at_home, s, t, item - t * parts, w0, w1, n, lane)
                elif row >= 0:
                    row_at_home = home_row(dispatch_topk_ids, g, s, t, L, R, me)  # this PE's row of s's partials
                    send_home_part(expert_out[row], w0, w1, combine_partials, relay_partials, relay_flag,
                                   combine_row_flag, peer_bases, g, row_at_home, s, t, item - t * parts, n, direct,
                                   lane, lo, hi)
            q += all_warps

        stamp_last(status, 17)
        stamp_last(status, 18)

    return programmatic(combine_async_dense, v.pdl)
