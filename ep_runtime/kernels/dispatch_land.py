"""Land: ``dispatch_land``, the receive kernel of the ``land`` receiver.

Launched right after dispatch_async with PDL, its first blocks start on the SMs dispatch_async
leaves free while that kernel still sends, and the rest as its blocks exit. It places every
received row as soon as the senders' routing (ids, weights, ranks, counts) is in
(``dispatch_route_signal``), and, for bf16 rows in the expanded layout, copies each part of
each row to its expert rows as the part lands (``dispatch_row_flag``). This rank's own bf16
rows are never sent: they are read from the caller's tokens. docs/protocol.md, "Dispatch rows
as they land".

:func:`make_dispatch_land` builds the kernel for a :class:`~ep_runtime.kernels.variant.DispatchVariant`.
"""

import functools

from ep_runtime.kernels import shmem
from ep_runtime.kernels.block import (await_part, flag_rule, local_expert_count, part_bounds, record_error,
                                      warp_geometry, warp_sync)
from ep_runtime.kernels.codecs import traits
from ep_runtime.kernels.cuda_api import cuda, float32, int32, int64, kernel_jit, uint64
from ep_runtime.kernels.layouts import make_layout
from ep_runtime.kernels.layouts.expanded import COPY_PAIRS, COPY_UNROLL
from ep_runtime.kernels.pdl import make_pdl, programmatic
from ep_runtime.kernels.protocol import (COUNTER_DISPATCH_ROW_FLAG, COUNTER_DISPATCH_SIGNAL, COUNTER_RECV_ROWS,
                                         COUNTER_ROUTE_SIGNAL, DISPATCH_FLAG_PARTS, ERR_CAPACITY, KERNEL_DISPATCH_LAND,
                                         PLACEMENT_WORDS, RECV_CLAIMS, STATUS_CODE)
from ep_runtime.kernels.receive import make_receive
from ep_runtime.kernels.trace import stamp_first, stamp_last
from ep_runtime.kernels.variant import DispatchVariant
from ep_runtime.kernels.vec import pairs_aligned


@functools.lru_cache(maxsize=None)
def make_land_rows(v: DispatchVariant):
    """``land_rows``, dispatch_land's work, for ``v``: the placement as the routing lands, then
    the items (a part of a token of a source) described and copied as the parts land."""
    threads = v.threads
    warp, warps = warp_geometry(threads)
    RAW = traits(v.codec).RAW  # messages are the caller's words: copied as they land
    place_fns, recv = make_layout(v.layout, threads), make_receive(threads)  # the placement and the copies
    scan_placement, write_segments, zero_padding_rows = (place_fns.scan_placement, place_fns.write_segments,
                                                         place_fns.zero_padding_rows)
    expert_warps, row_of, describe_row = place_fns.expert_warps, place_fns.row_of, place_fns.describe_row
    await_sources, store_recv_tokens = recv.await_sources, recv.store_recv_tokens
    copy_in_pairs, copy_to_rows, COPIES = place_fns.copy_in_pairs, place_fns.copy_to_rows, place_fns.COPIES

    @cuda.jit(device=True)
    def land_rows(d_ids, d_weights, d_counts, d_ranks, d_route, d_signal, receive_sync, row_offsets, expert_counts,
                  row_src_rank, row_src_token, row_src_k, row_weight, row_gather, recv_tokens, token_rows, status,
                  pad_multiple, timeout_ns, d_tokens, expert_x, d_row_flag, copy_rows, tokens, n,
                  flag, sum_buf, place, src_T, claim, item_rows, lo, hi, vals):
        """dispatch_land's work for call ``n``, every thread of a block (the kernel waits for its
        predecessor after it, whatever path returns). Arguments as the kernel's; the rest is
        scratch (shared: flag [1], sum_buf [threads], place [PLACEMENT_WORDS], src_T
        [rank_slots], claim [warps], item_rows [warps, warp] (each warp's token: its local
        experts' rows, for the copy); local: lo, hi, vals)."""
        if status[STATUS_CODE] != 0:
            return
        stamp_first(status, 24)
        me = shmem.my_pe()
        R = d_counts.shape[1]
        L = d_counts.shape[2] - 1
        Tmax = d_ids.shape[2]
        K = d_ids.shape[3]
        C = row_src_rank.shape[0]
        tid = cuda.threadIdx.x
        lane = tid % warp
        wid = tid // warp
        g = n % 2

        # every source's routing (thread s waits for rank s; the signal carries its T)
        if not await_sources(d_route, g, n, timeout_ns, status, KERNEL_DISPATCH_LAND, COUNTER_ROUTE_SIGNAL,
                             src_T, flag):
            return
        stamp_last(status, 25)
        if cuda.blockIdx.x == 0:
            store_recv_tokens(recv_tokens, src_T)
        total = scan_placement(d_counts, g, pad_multiple, place, sum_buf)
        if total > C:
            if cuda.blockIdx.x == 0 and tid == 0:
                record_error(status, ERR_CAPACITY, KERNEL_DISPATCH_LAND, me, -1, COUNTER_RECV_ROWS, C, total, n + 1)
            return
        if cuda.blockIdx.x == 0 and tid == 0:
            row_offsets[L] = total
        copy = COPIES and RAW and copy_rows != 0  # into the expert rows as the parts land
        # the words of a row part: the expert batch's rows when copying into them, else the
        # received rows' (the compact layout: no expert batch may be allocated)
        W = expert_x.shape[1] if copy else d_tokens.shape[2]
        pairs = copy_in_pairs(d_tokens, expert_x) if copy else W % 2 == 0 and pairs_aligned(d_tokens)
        own_pairs = pairs and pairs_aligned(tokens)  # the caller's rows (this rank's own) as word pairs too
        e0, stride = expert_warps(tid)
        write_segments(place, R, L, pad_multiple, row_offsets, expert_counts, row_src_rank, row_src_token, row_src_k,
                       row_weight, row_gather, e0, stride, lane)
        if copy:
            zero_padding_rows(place, R, L, pad_multiple, expert_x, e0, stride, lane)
        stamp_last(status, 26)

        # items (token t, source s, part p), token-major so the sources' rows, landing together,
        # are taken together; claimed one at a time, so blocks that start late take what is left
        P = 1  # the most parts of any source's rows (the senders' rule, from each T)
        T_hi = 0
        for s in range(R):
            T_hi = max(T_hi, src_T[s])
            if copy:
                P = max(P, flag_rule(src_T[s], W, DISPATCH_FLAG_PARTS, warp)[0])
        items = T_hi * R * P
        first_mine = me * L
        while True:
            if lane == 0:
                c = int64(items)
                if status[STATUS_CODE] == 0:
                    c = cuda.atomic.add(receive_sync, RECV_CLAIMS + g, int64(1))
                claim[wid] = int32(min(c, int64(items)))
            warp_sync()
            i = claim[wid]
            warp_sync()  # read by every lane before lane 0 writes it again
            if i >= items:
                break
            t = i // (R * P)
            s = (i - t * R * P) // P
            p = i - t * R * P - s * P
            parts = 1
            span = W
            if copy:
                parts, span = flag_rule(src_T[s], W, DISPATCH_FLAG_PARTS, warp)
            if t >= src_T[s] or p >= parts:
                continue
            t, w0, w1 = part_bounds(t * parts + p, parts, span, W)
            n_local = local_expert_count(d_ids[g, s, t], L, me)
            if n_local == 0 or w0 >= w1:
                continue  # nothing of this token here (never flagged), or an empty part
            own = RAW and s == me  # this rank's own row is the caller's (never sent: codecs.words)
            if copy and not own:  # lane 0 waits for the part
                if lane == 0:
                    claim[wid] = int32(await_part(d_row_flag, s, t, p, n, timeout_ns, status, KERNEL_DISPATCH_LAND,
                                                  COUNTER_DISPATCH_ROW_FLAG))
                warp_sync()
                ok = claim[wid]
                warp_sync()
                if ok == 0:
                    break
            # the token's rows (every part's warp writes the same token_rows); descriptions once
            for k in range(lane, K, warp):
                weight = d_weights[g, s, t, k] if p == 0 else float32(0.0)  # part 0 describes the rows
                r, j = row_of(d_ids, d_ranks, place, L, g, s, t, k, first_mine)
                if r >= 0:
                    if j < warp:
                        item_rows[wid, j] = r  # the copy's rows, read from shared memory
                    if p == 0:
                        describe_row(r, s, t, k, j, Tmax, weight, row_src_rank, row_src_token, row_src_k, row_weight,
                                     row_gather, token_rows)
                    else:
                        token_rows[s, t, j] = r
            warp_sync()  # the warp's token_rows and item_rows stores are seen by its lanes
            if copy and own and n_local <= warp:  # straight from the caller's tokens
                copy_to_rows(tokens[t], item_rows[wid], n_local, expert_x, w0, w1, own_pairs, lane, lo, hi, vals)
            elif copy and own:
                copy_to_rows(tokens[t], token_rows[s, t], n_local, expert_x, w0, w1, own_pairs, lane, lo, hi, vals)
            elif copy and n_local <= warp:
                copy_to_rows(d_tokens[s, t], item_rows[wid], n_local, expert_x, w0, w1, pairs, lane, lo, hi, vals)
            elif copy:
                copy_to_rows(d_tokens[s, t], token_rows[s, t], n_local, expert_x, w0, w1, pairs, lane, lo, hi, vals)
            elif own:  # the compact layout: the caller's row into this rank's slot of the receive buffer
                if lane == 0:
                    item_rows[wid, 0] = t
                warp_sync()
                copy_to_rows(tokens[t], item_rows[wid], 1, d_tokens[me], w0, w1, own_pairs, lane, lo, hi, vals)
        # every warp is out of the loop (one whose flag timed out left it, the others then claimed
        # nothing more): the block decides together whether to go on
        if tid == 0:
            flag[0] = int32(status[STATUS_CODE] != 0)
        cuda.syncthreads()
        failed = flag[0] != 0
        cuda.syncthreads()  # flag read by every thread before it is used again
        if failed:
            return
        stamp_last(status, 27)
        if not copy:  # the rows stay where they land (compact; FP8: dispatch_copy follows): all of them in
            if cuda.blockIdx.x == 0:
                await_sources(d_signal, g, n, timeout_ns, status, KERNEL_DISPATCH_LAND, COUNTER_DISPATCH_SIGNAL,
                              src_T, flag)
        stamp_last(status, 28)

    return land_rows


@functools.lru_cache(maxsize=None)
def make_dispatch_land(v: DispatchVariant):
    """The ``dispatch_land`` kernel of ``v`` (its receiver ``land``), marked for PDL when
    ``v.pdl``."""
    threads = v.threads
    warp, warps = warp_geometry(threads)
    CP = COPY_PAIRS
    U = COPY_UNROLL
    pdl_wait, pdl_trigger = make_pdl(v.pdl)
    begin_receive = make_receive(threads).begin_receive
    land_rows = make_land_rows(v)
    RANK_SLOTS = v.rank_slots  # a shared word per source

    @kernel_jit(threads, shmem_in_device_functions=True)
    def dispatch_land(dispatch_topk_ids, dispatch_topk_weights, dispatch_counts, dispatch_ranks, dispatch_route_signal,
                      dispatch_signal, receive_sync, row_offsets, expert_counts, row_src_rank, row_src_token, row_src_k,
                      row_weight, row_gather, recv_tokens, token_rows, status, pad_multiple, timeout_ns,
                      dispatch_tokens, expert_x, dispatch_row_flag, copy_rows, combine_wait_claims, tokens):
        """The receive kernel of landing calls: place every received row while the rows are still in flight,
        and (bf16, ``copy_rows`` nonzero: the expanded layout) copy each part of each row to its expert rows
        as it lands.

        Every block reads its call number (``begin_receive``) and waits for each source's route signal
        (dispatch_route_signal [G, R] uint64: ``(n + 1) << 32 | T`` once its ids, weights, ranks and counts
        are here), scans the placement table and checks the capacity as dispatch_wait does, and a warp per
        local expert writes its segment. Then each warp claims items (``receive_sync[RECV_CLAIMS + g]``, an
        atomic counter): (token t, source s, part p), token-major, the parts being the senders' (``flag_rule``
        from s's T; one per row unless copy_rows). For a token with an expert here it writes its rows'
        descriptions (part 0) and token_rows, and with copy_rows lane 0 first waits for the part's flag
        (dispatch_row_flag [R, Tmax, DISPATCH_FLAG_PARTS] uint64, ``[s, t, p] >= n + 1``) and the warp copies
        the part to every expert row, each word read once. This rank's own bf16 rows come from ``tokens`` (the
        caller's [T, W] words of this call; an empty stand-in for FP8, whose own rows are sent), copied to the
        expert rows, or in the compact layout to this rank's slots ``dispatch_tokens[me, t]``. Without
        copy_rows block 0 waits for every source's dispatch signal (all of its rows in) before the kernel
        ends. Finally every block waits for dispatch_async to complete (``pdl_wait``), so stream order holds
        for what follows. Outputs and their values are dispatch_wait's (and dispatch_copy's), bit for bit. A
        timeout names the route signal or the part's flag (rank and token); more rows than C records a
        capacity error and writes nothing.
        """
        flag = cuda.shared.array(1, int32)
        sum_buf = cuda.shared.array(threads, int64)
        place = cuda.shared.array(PLACEMENT_WORDS, int32)
        src_T = cuda.shared.array(RANK_SLOTS, int32)
        claim = cuda.shared.array(warps, int32)  # each warp's claimed item, then its flag's verdict
        item_rows = cuda.shared.array((warps, warp), int32)  # each warp's token: its local experts' rows
        ticket = cuda.shared.array(1, int32)
        lo = cuda.local.array(CP, uint64)  # copy_to_rows' pairs
        hi = cuda.local.array(CP, uint64)
        vals = cuda.local.array(U, uint64)
        pdl_trigger()
        # the receive kernel of the previous call completed before dispatch_async of this one
        # started, and that kernel starts this one only after its own dependency wait
        n = begin_receive(receive_sync, combine_wait_claims, ticket)
        land_rows(dispatch_topk_ids, dispatch_topk_weights, dispatch_counts, dispatch_ranks, dispatch_route_signal,
                  dispatch_signal, receive_sync, row_offsets, expert_counts, row_src_rank, row_src_token, row_src_k,
                  row_weight, row_gather, recv_tokens, token_rows, status, pad_multiple, timeout_ns, dispatch_tokens,
                  expert_x, dispatch_row_flag, copy_rows, tokens, n, flag, sum_buf, place, src_T, claim, item_rows, lo,
                  hi, vals)
        pdl_wait()  # completes after dispatch_async: stream order for what follows

    return programmatic(dispatch_land, v.pdl)
