"""Place: ``dispatch_wait``, the receive kernel of the ``wait`` and route-first receivers.

``Receiver.WAIT``: every block waits for every source's dispatch signal (its token rows are
in), builds the placement table from the senders' counts and describes every received row from
the ranks the senders computed. ``Receiver.ROUTE_FIRST`` / ``ROUTE_FIRST_CHUNKED``: a few
placing blocks, started early by PDL, place every row from the routing rows while the token
rows fly (ep_runtime/kernels/route_first.py); launched on the whole grid with ``copy_rows`` (bf16, the
expanded layout) the first block places and every block then copies (ep_runtime/kernels/layouts/expanded.py),
so the expanded batch takes one launch. docs/protocol.md has the timeline.

:func:`make_dispatch_wait` builds the kernel for a :class:`~ep_runtime.kernels.variant.DispatchVariant`.
"""

import functools

from ep_runtime.kernels import shmem
from ep_runtime.kernels.block import record_error, warp_geometry
from ep_runtime.kernels.codecs import traits
from ep_runtime.kernels.cuda_api import cuda, inlined, int32, int64, kernel_jit, uint32, uint64
from ep_runtime.kernels.layouts import make_layout
from ep_runtime.kernels.layouts.expanded import WAIT_COPY_PAIRS
from ep_runtime.kernels.pdl import make_pdl, programmatic
from ep_runtime.kernels.protocol import (COUNTER_DISPATCH_SIGNAL, COUNTER_RECV_ROWS, ERR_CAPACITY, KERNEL_DISPATCH_WAIT,
                                         MAX_COPY_PLACERS, PLACEMENT_WORDS, STATUS_CODE)
from ep_runtime.kernels.ranking import RECV_WINDOW, make_ranking
from ep_runtime.kernels.receive import make_receive
from ep_runtime.kernels.route_first import make_route_first
from ep_runtime.kernels.trace import stamp_first, stamp_last
from ep_runtime.kernels.variant import DispatchVariant, Receiver


@functools.lru_cache(maxsize=None)
def make_wait_placement(threads: int, layout: str):
    """``place_waited``: the ``wait`` receiver's placement once every source's signal is in,
    for blocks of ``threads`` threads and the plan's ``layout``."""
    warp, warps = warp_geometry(threads)
    place_fns = make_layout(layout, threads)
    scan_placement, write_segments, expert_warps = (place_fns.scan_placement, place_fns.write_segments,
                                                    place_fns.expert_warps)
    row_of, describe_row = place_fns.row_of, place_fns.describe_row

    @inlined
    def place_waited(dispatch_topk_ids, dispatch_topk_weights, dispatch_counts, dispatch_ranks, row_offsets,
                     expert_counts, row_src_rank, row_src_token, row_src_k, row_weight, row_gather, token_rows, status,
                     pad_multiple, src_items, place, sum_buf, g, n, me, R, L, K, Tmax, C):
        """Every thread of a block, once every source's signal is in (``src_items[s]``: the
        (token, k) pairs source s sent): every block scans the placement table itself (no block
        depends on another) and checks the capacity (more rows than C records an error and
        writes nothing); a warp per local expert (from the last block down) writes its offset,
        count and padding rows, and a thread per received (source, token, k) whose expert is
        local (from block 0 up) writes its row's description."""
        tid = cuda.threadIdx.x
        # every (source, expert)'s first row and the total (padded): every block scans them itself
        total = scan_placement(dispatch_counts, g, pad_multiple, place, sum_buf)
        stamp_last(status, 14)
        if total > C:
            if cuda.blockIdx.x == 0 and tid == 0:
                record_error(status, ERR_CAPACITY, KERNEL_DISPATCH_WAIT, me, -1, COUNTER_RECV_ROWS,
                             C, total, n + 1)
            return
        if cuda.blockIdx.x == 0 and tid == 0:
            row_offsets[L] = total

        lane = tid % warp
        all_warps = cuda.gridDim.x * warps

        # (a) a warp per local expert: offset, count, padding rows
        e0, stride = expert_warps(tid)
        write_segments(place, R, L, pad_multiple, row_offsets, expert_counts, row_src_rank, row_src_token, row_src_k,
                       row_weight, row_gather, e0, stride, lane)
        stamp_last(status, 10)

        # (b) a thread per received (source, token, k), a warp per 32 consecutive pairs of one
        # source (warp steps over the sources in turn, from block 0 up)
        first_mine = me * L  # global id of local expert 0
        steps = 0
        for s in range(R):
            steps += (src_items[s] + warp - 1) // warp
        i = cuda.blockIdx.x * warps + tid // warp
        while i < steps:
            s = 0  # the step's source, and its first pair
            step = i
            while step >= (src_items[s] + warp - 1) // warp:
                step -= (src_items[s] + warp - 1) // warp
                s += 1
            p = step * warp + lane
            t = p // K
            k = p - t * K
            if p < src_items[s]:
                weight = dispatch_topk_weights[g, s, t, k]  # loaded beside row_of's id and rank
                r, j = row_of(dispatch_topk_ids, dispatch_ranks, place, L, g, s, t, k, first_mine)
                if r >= 0:
                    describe_row(r, s, t, k, j, Tmax, weight, row_src_rank, row_src_token, row_src_k, row_weight,
                                 row_gather, token_rows)
            i += all_warps
        stamp_last(status, 11)

    return place_waited


@functools.lru_cache(maxsize=None)
def make_dispatch_wait(v: DispatchVariant):
    """The ``dispatch_wait`` kernel of ``v`` (its receiver ``wait``, ``route_first`` or
    ``route_first_chunked``), marked for PDL when ``v.pdl``."""
    threads = v.threads
    warp, warps = warp_geometry(threads)
    FIRST = v.receiver.routes_first
    RANK_SLOTS = v.rank_slots  # a shared word per source
    place_fns, recv = make_layout(v.layout, threads), make_receive(threads)  # the placement and the copies
    # a route-first wait may copy the rows into the expert batch in its own launch where they are
    # the caller's words
    FIRST_COPY = FIRST and traits(v.codec).RAW and place_fns.COPIES
    RECV_WORDS = make_ranking(threads).recv_words if FIRST else 1  # a route-first wait's masks and warp rows
    RECV_NEXT = RECV_WINDOW if FIRST else 1
    WCP = WAIT_COPY_PAIRS
    pdl_wait, pdl_trigger = make_pdl(v.pdl)
    place_waited = make_wait_placement(threads, v.layout)
    begin_receive, await_sources, store_recv_tokens = recv.begin_receive, recv.await_sources, recv.store_recv_tokens
    route = make_route_first(threads, v.receiver is Receiver.ROUTE_FIRST_CHUNKED, v.share_from_tokens,
                             v.chunk_from_tokens)
    place_from_routing, publish_placed, await_placed_rows = (route.place_from_routing, route.publish_placed,
                                                             route.await_placed_rows)
    gather_rows = place_fns.gather_rows  # the expanded layout's row-major copy (FIRST_COPY)

    @kernel_jit(threads, one_block_per_sm=True)  # its blocks start as dispatch_async's leave their SMs
    def dispatch_wait(dispatch_topk_ids, dispatch_topk_weights, dispatch_counts, dispatch_ranks, dispatch_signal,
                      dispatch_async_sync, row_offsets, expert_counts, row_src_rank, row_src_token, row_src_k,
                      row_weight, row_gather, recv_tokens, token_rows, status, pad_multiple, timeout_ns,
                      dispatch_tokens, expert_x, copy_rows, combine_wait_claims, receive_sync, dispatch_route_signal,
                      dispatch_placed):
        """Wait for every source rank, then place every received (token, local expert) pair.

        Symmetric inputs (group g of the last call): dispatch_topk_ids / dispatch_topk_weights [G, R, Tmax, K]
        (every source's routing rows), dispatch_counts [G, R, L + 1] int32 (source s's tokens per local
        expert, and its T), dispatch_ranks [G, R, Tmax, K] int32 (rank of token t among source s's tokens with
        expert ``dispatch_topk_ids[g, s, t, k]``), dispatch_signal / dispatch_route_signal [G, R] uint64 (the
        dispatch and route signals, ``(n + 1) << 32 | T``). Outputs (local): row_offsets [L + 1] int32,
        expert_counts [L] int32, row_src_rank / row_src_token / row_src_k [C] int32, row_weight [C] float32,
        row_gather [C] int32 (the row's slot in the receive buffer, ``src * Tmax + t``; padding rows: -1, -1,
        -1, 0, -1), recv_tokens [R] int32 (tokens each source dispatched), token_rows [R, Tmax, K] int32 (row
        of the j-th local expert of token (src, t)). pad_multiple, timeout_ns, copy_rows: int64.
        combine_wait_claims (int32 [2]) and receive_sync (int64 [RECV_LEN]): the receive bookkeeping
        (ep_runtime/kernels/receive.py).

        ``wait`` builds: every block reads its call number and waits for every signal before its dependency
        wait, so blocks started early by PDL see the signals as they land. Every block scans the placement
        table itself (no block depends on another) and checks the capacity; a warp per local expert (from the
        last block down) writes its offset, count and padding rows, and a thread per received (source, token,
        k) whose expert is local (from block 0 up) writes its row's description. A wait past timeout_ns or
        more rows than C records an error and writes nothing.

        Route-first builds (launched with the plan's placing blocks): each block waits for the routing, places
        (``place_from_routing``, sharing the descriptions), then waits for the dispatch signals. With
        copy_rows nonzero (bf16; launched on the whole grid) the blocks taking the first ``copy_rows`` tickets
        (at most ``MAX_COPY_PLACERS``, and one block fewer than the grid) place, sharing the descriptions, and
        each publishes its word of ``dispatch_placed`` (uint64 [MAX_COPY_PLACERS]); every other block waits
        for all of them and copies each received row to its expert rows, dispatch_tokens [R, Tmax, W] words
        into expert_x [C, W] words (``gather_rows``).
        """
        flag = cuda.shared.array(1, int32)
        sum_buf = cuda.shared.array(threads, int64)
        place = cuda.shared.array(PLACEMENT_WORDS, int32)  # the placement table
        src_items = cuda.shared.array(RANK_SLOTS, int32)  # T, then (token, k) pairs, each source sent this call
        masks = cuda.shared.array(RECV_WORDS, uint32)  # route-first builds: [warp, window expert] lanes
        warp_rows = cuda.shared.array(RECV_WORDS, int32)  # ... and each warp's first rank
        next_rank = cuda.shared.array(RECV_NEXT, int32)  # ... and the next round's
        ticket = cuda.shared.array(1, int32)  # the block's receive ticket (0: the first block)
        copy_lo = cuda.local.array(WCP, uint64)  # a route-first build's copy (gather_rows)
        copy_hi = cuda.local.array(WCP, uint64)
        pdl_trigger()
        # before the dependency wait (blocks start early, on the SMs dispatch_async's blocks leave):
        # the call number from the receive count, then every source's signal
        code = status[STATUS_CODE]  # an earlier call's error (this call's dispatch_async records after)
        n = begin_receive(receive_sync, combine_wait_claims, ticket)
        # a copying launch's placing blocks: the first tickets, leaving at least one block to copy
        placers = max(1, min(copy_rows, MAX_COPY_PLACERS, cuda.gridDim.x - 1))
        if FIRST_COPY and code != 0 and ticket[0] == 0:  # the copying blocks are not left waiting
            for p in range(placers):
                publish_placed(dispatch_placed, p, n, False)
        if code != 0:
            pdl_wait()
            return
        stamp_first(status, 8)
        stamp_last(status, 23)
        me = shmem.my_pe()
        R = dispatch_counts.shape[1]
        L = dispatch_counts.shape[2] - 1
        K = dispatch_topk_ids.shape[3]
        Tmax = dispatch_topk_ids.shape[2]
        C = row_src_rank.shape[0]
        tid = cuda.threadIdx.x
        g = n % 2
        if FIRST:  # placed from the routing rows while the rows fly
            # a copying launch (the whole grid): the blocks taking the first tickets place, each
            # describing its share of the rows (a block cannot wait for one that never runs), and
            # the others copy after them (a one-block grid places and copies); any other launch
            # (the placing blocks) places in every block, each describing its share
            fused = FIRST_COPY and copy_rows != 0
            placer = True
            copier = False
            share = cuda.blockIdx.x
            shares = cuda.gridDim.x
            if fused:
                placer = ticket[0] < placers
                copier = not placer or cuda.gridDim.x == 1
                share = ticket[0]
                shares = placers
            ok = True
            if placer:
                ok = place_from_routing(dispatch_topk_ids, dispatch_topk_weights, dispatch_route_signal,
                                        dispatch_signal, g, n, me, R, L, K, Tmax, C, timeout_ns, status, pad_multiple,
                                        row_offsets, expert_counts, row_src_rank, row_src_token, row_src_k, row_weight,
                                        row_gather, recv_tokens, token_rows, src_items, flag, place, sum_buf, masks,
                                        warp_rows, next_rank, share, shares)
            if FIRST_COPY:
                if fused:  # the expanded layout in one launch: the copying blocks copy once it is placed
                    if placer:
                        publish_placed(dispatch_placed, share, n, ok)
                    else:  # idle until dispatch_async completes, not polling beside its blocks
                        pdl_wait()
                    if copier and await_placed_rows(dispatch_placed, placers, n, timeout_ns, status, flag):
                        gather_rows(dispatch_tokens, row_gather, row_offsets, L, expert_x, status, copy_lo, copy_hi,
                                    max(0, ticket[0] - placers), max(1, cuda.gridDim.x - placers))
            pdl_wait()  # completes after dispatch_async: stream order for what follows
            return

        # wait for every source rank's signal (thread s waits for rank s; each carries its T)
        ok = await_sources(dispatch_signal, g, n, timeout_ns, status, KERNEL_DISPATCH_WAIT, COUNTER_DISPATCH_SIGNAL,
                           src_items, flag)
        pdl_wait()  # dispatch_async complete: stream order for the rest and what follows
        if not ok:
            return
        stamp_first(status, 15)
        stamp_last(status, 9)
        if cuda.blockIdx.x == 0:
            store_recv_tokens(recv_tokens, src_items)
        for s in range(tid, R, threads):
            src_items[s] *= K  # (token, k) pairs of source s
        cuda.syncthreads()

        place_waited(dispatch_topk_ids, dispatch_topk_weights, dispatch_counts, dispatch_ranks, row_offsets,
                     expert_counts, row_src_rank, row_src_token, row_src_k, row_weight, row_gather, token_rows, status,
                     pad_multiple, src_items, place, sum_buf, g, n, me, R, L, K, Tmax, C)

    return programmatic(dispatch_wait, v.pdl)
