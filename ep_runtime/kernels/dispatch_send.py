"""Send: ``dispatch_async``, each token row once to every rank that holds one of its experts.

The grid's first blocks (token blocks) send the token rows, each once to every rank that holds
one of its experts: the token format's codec cuts and moves them (ep_runtime/kernels/codecs: rows
of words copied, FP8 messages encoded once straight into every destination's slot), through the
plan's transport (ep_runtime/kernels/transport: stores through the peers' mappings or NVSHMEM
puts; packed chunks across nodes). The routing half (the routing rows, and for the ``wait`` and
``land`` receivers the ranks and counts of the grid's last blocks) is
ep_runtime/kernels/dispatch_route.py. The last block to finish signals every rank.

:func:`make_dispatch_async` builds the kernel for a
:class:`~ep_runtime.kernels.variant.DispatchVariant`.
"""

import functools
from types import SimpleNamespace

from ep_runtime.kernels import shmem
from ep_runtime.kernels.block import last_block_ticket, udiv32, warp_geometry
from ep_runtime.kernels.codecs import make_sender, traits
from ep_runtime.kernels.cuda_api import cuda, inlined, int32, int64, kernel_jit, uint32, uint64
from ep_runtime.kernels.destinations import holders_at, list_words
from ep_runtime.kernels.dispatch_route import make_dispatch_route
from ep_runtime.kernels.nodes import node_slots
from ep_runtime.kernels.pdl import make_pdl, programmatic
from ep_runtime.kernels.protocol import SIGNAL_TOKEN_BITS, STATUS_CODE, SYNC_CALLS, SYNC_TICKET
from ep_runtime.kernels.ranking import ID_BATCH
from ep_runtime.kernels.trace import stamp_first, stamp_last
from ep_runtime.kernels.transport import make_transport
from ep_runtime.kernels.transport.common import PAIRS_IN_FLIGHT, RUN_BATCH
from ep_runtime.kernels.variant import DispatchVariant, Receiver
from ep_runtime.kernels.vec import address_of, load_u32_at


@cuda.jit(device=True)
def token_holders(ids_at, K, L, R, ids_l):
    """Bit d set (uint64) for every rank d holding one of a token's ``K`` experts: the token's ids
    are the int32 at address ``ids_at`` (its row of ``topk_ids``), rank d holds experts ``[d L,
    (d + 1) L)``; an id outside ``[0, R L)`` (-1, a masked slot, or one the routing rows drop:
    ``routed_id``) sets none. The ids are loaded ``ID_BATCH`` at a time into ``ids_l`` (local int32
    [ID_BATCH]), all before any is used (one memory latency, not one per id, on the token rows'
    path)."""
    E = R * L
    sent = uint64(0)
    for k0 in range(0, K, ID_BATCH):
        for u in range(ID_BATCH):  # a constant trip count: unrolled, ids_l in registers
            if k0 + u < K:
                ids_l[u] = int32(load_u32_at(ids_at, k0 + u))
        for u in range(ID_BATCH):
            if k0 + u < K and uint32(ids_l[u]) < uint32(E):  # (a negative id is a large uint32)
                sent |= uint64(1) << uint64(udiv32(ids_l[u], L))
    return sent


@functools.lru_cache(maxsize=None)
def make_token_senders(v: DispatchVariant) -> SimpleNamespace:
    """The token rows of ``v``'s dispatch_async: the codec's ``send_rows`` (every token once to
    each rank with one of its experts, ``token_destinations``) and the transport's
    ``send_across`` (the rows bound for other nodes, a packed chunk a put; nothing without
    nodes), and the encoder's shared scratch (``MBUF_WORDS``, ``HELD_WORDS``)."""
    tp = make_transport(v.transport, v.threads, v.node_size, v.node_stores, v.dest_slots)
    row_dests = tp.row_dests
    LANDS = v.receiver is Receiver.LAND
    NODE = v.node_size
    LIST = list_words(v.dest_slots)  # ids_l: a list build's destination list, then the ids

    @cuda.jit(device=True)
    def token_destinations(ids_at, K, L, R, me, skip, ids_l):
        """The ranks a token's row goes to from here, one at a time (uint64 bits): its holders
        (``token_holders``) but not the ranks set in ``skip``. The hierarchical transport sends
        only to the holders on this rank's node here: a row bound for another node crosses in
        its chunk (the transport's ``send_across``)."""
        return row_dests(token_holders(ids_at, K, L, R, ids_l) & ~skip, me)

    @cuda.jit(device=True)
    def token_destination_list(ids_at, K, L, R, me, skip, ids_l):
        """``token_destinations`` of a build with destination lists: the list (int32, count
        first: ep_runtime/kernels/destinations.py) at the front of ``ids_l``, the ids loaded behind
        it (``ids_l[LIST:]``), and ``ids_l`` returned (a device function returns only an array it
        was passed). The codec's
        ``skip`` mask cannot name a rank past 63: this rank is left out exactly when the receiver
        lands (it reads its own rows from the caller's tokens), which is what the codecs skip.
        The hierarchical transport's list holds this rank's node's holders only."""
        holders_at(ids_at, K, L, R, me if LANDS else -1, NODE, me, ids_l[LIST:], ids_l)
        return ids_l

    @cuda.jit(device=True)
    def token_holder_list(ids_at, K, L, R, ids_l):
        """``token_holders`` as a destination list at the front of ``ids_l``: every rank holding
        one of the token's experts (the hierarchical transport's chunks bound for other nodes)."""
        holders_at(ids_at, K, L, R, -1, 0, 0, ids_l[LIST:], ids_l)
        return ids_l

    sender = make_sender(v.codec, v.threads, tp, token_destination_list if v.dest_slots else token_destinations,
                         LANDS)
    send_across = tp.make_row_chunks(sender.pack_row, token_holder_list if v.dest_slots else token_holders)
    return SimpleNamespace(send_rows=sender.send_rows, send_across=send_across,
                           MBUF_WORDS=sender.MBUF_WORDS, HELD_WORDS=sender.HELD_WORDS)


@functools.lru_cache(maxsize=None)
def make_call_stages(v: DispatchVariant) -> SimpleNamespace:
    """The stages of ``v``'s dispatch_async around its token rows: ``send_routing`` (the token
    blocks' share of the routing), ``await_peers`` (the credits), ``rank_or_route`` (the routing
    blocks) and ``signal_call`` (the last block)."""
    threads = v.threads
    warp, _ = warp_geometry(threads)
    tp = make_transport(v.transport, threads, v.node_size, v.node_stores)
    await_credits, signal_call_here = tp.await_credits, tp.signal_call
    LAND = v.receiver is Receiver.LAND  # the routing signalled on its own, row parts flagged (codec words)
    FIRST = v.receiver.routes_first  # the routing rows first; nothing ranked here
    route_fns = make_dispatch_route(v)
    send_routing_spread, send_routing_first = route_fns.send_routing_spread, route_fns.send_routing_first
    rank_chunk, publish_route, publish_route_share = (route_fns.rank_chunk, route_fns.publish_route,
                                                      route_fns.publish_route_share)
    store_token_count = route_fns.store_token_count

    @inlined
    def send_routing(topk_ids, topk_weights, d_ids, d_weights, d_counts, send_counts, d_route, sync, flag, peer_bases,
                     g, me, n, T, R, L, K, route, split, share_route, token_blocks, routing_block, status):
        """Every thread of a block: the token blocks' share of this call's routing rows (ids,
        weights) to every rank, unless a route-first call's routing block sends them (below:
        ``rank_or_route``) and the call is not split; a split call's T into every rank's counts
        row (block 0; combine reads it there); then, landing or split, each token block's route
        ticket once its share is out (an encoding split call's share is published by one thread
        later: ``publish_route_share``, after the barrier here)."""
        if route and cuda.blockIdx.x < token_blocks and (split or not FIRST):
            send_routing_spread(topk_ids, topk_weights, d_ids, d_weights, peer_bases, g, me, n, T, R, L, K,
                                token_blocks, status)
        if split and cuda.blockIdx.x == 0:
            store_token_count(d_counts, send_counts, peer_bases, g, me, R, L, T)
        stamp_last(status, 4)
        if route and (LAND or (split and not share_route)) and cuda.blockIdx.x < token_blocks and not routing_block:
            publish_route(sync, flag, d_route, g, me, n, T, R, status)  # this block's share of the routing is out
        if share_route:
            cuda.syncthreads()  # every thread's routing rows stored before one thread publishes them

    @inlined
    def await_peers(credit, sync, d_route, flag, g, me, n, T, R, token_blocks, share_route, status, timeout_ns):
        """Every thread of a block: every peer's credit of call n before any token row goes to it
        (a block without token rows, or with only its own, need not); returns False when a credit
        timed out (recorded: no token row, ticket or signal follows). Then an encoding split
        call's routing share, published by the last warp's first thread (the fence waits for its
        stores to land) while the other warps go on to the token rows."""
        if cuda.blockIdx.x < token_blocks and T > 0 and R > 1:
            if cuda.threadIdx.x == 0:
                flag[0] = int32(await_credits(credit, n, status, timeout_ns))
                stamp_first(status, 5)
            cuda.syncthreads()
            if flag[0] == 0:
                return False
            cuda.syncthreads()  # flag read by every thread before the ticket reuses it
        if share_route and cuda.blockIdx.x < token_blocks and cuda.threadIdx.x == threads - warp:
            publish_route_share(sync, d_route, g, me, n, T, R, token_blocks, status)
        return True

    @inlined
    def rank_or_route(topk_ids, topk_weights, ids_base, d_ids, d_weights, d_ranks, d_counts, send_ranks, send_counts,
                      d_route, sync, flag, peer_bases, g, me, n, T, R, L, K, rb, n_route, status, masks, warp_rows,
                      next_rank, run_l):
        """Every thread of routing block ``rb`` of ``n_route``: a route-first call's routing rows
        and T, then the route signal; else each (token, k)'s rank and each expert's count, on its
        rank (``rank_chunk``)."""
        if FIRST:
            send_routing_first(topk_ids, topk_weights, d_ids, d_weights, d_counts, send_counts, d_route, peer_bases,
                               g, me, n, T, R, L, K, status)
        else:
            rank_chunk(ids_base, d_ranks, d_counts, send_ranks, send_counts, peer_bases, g, me, n, T, R, L, K, rb,
                       n_route, sync, flag, d_route, status, masks, warp_rows, next_rank, run_l)

    @inlined
    def signal_call(d_signal, d_counts, send_counts, relay_counts, relay_signal, d_ids, d_weights, d_ranks, sync,
                    flag, g, me, n, T, route, stores_only, status):
        """Every thread of a block, after its rows: the last block to finish (ticket: every block
        fenced first, or quieted where it put) signals every rank (with its counts row where it
        was staged; the proxies across nodes: ``tp.signal_call``), then advances the call
        counter."""
        if last_block_ticket(sync[SYNC_TICKET:SYNC_TICKET + 1], flag, stores_only):
            stamp_last(status, 3)
            signal = (uint64(n + 1) << uint64(SIGNAL_TOKEN_BITS)) | uint64(T)
            signal_call_here(d_signal, d_counts, send_counts, relay_counts, relay_signal, d_ids, d_weights, d_ranks, g,
                             me, T, signal, route, not FIRST)
            if cuda.threadIdx.x == 0:
                sync[SYNC_TICKET] = 0
                sync[SYNC_CALLS] = n + 1
            stamp_last(status, 6)

    return SimpleNamespace(send_routing=send_routing, await_peers=await_peers, rank_or_route=rank_or_route,
                           signal_call=signal_call)


@functools.lru_cache(maxsize=None)
def make_dispatch_async(v: DispatchVariant):
    """The ``dispatch_async`` kernel of ``v``, marked for PDL when ``v.pdl``."""
    threads = v.threads
    tp = make_transport(v.transport, threads, v.node_size, v.node_stores)
    FENCED, grant_credits = tp.FENCED, tp.grant_credits
    FIRST = v.receiver.routes_first  # the routing rows first; nothing ranked here
    CHUNKS = v.receiver is Receiver.ROUTE_FIRST_CHUNKED
    SPLIT_FROM = int(v.split_from_tokens)
    ENCODES = traits(v.codec).ENCODES  # the token blocks compute the messages (FP8)
    CHUNK_MASKS = node_slots(v.rank_slots, v.node_size) if v.node_size > 0 else 1  # the node chunks' masks
    IDS_WORDS = list_words(v.dest_slots) + ID_BATCH  # a list build's destination list, then a token's ids
    pdl_wait, pdl_trigger = make_pdl(v.pdl)
    route = make_dispatch_route(v)
    RANK_WORDS = route.rank_words if not FIRST else 1  # a routing block's masks and rows (none route first)
    RANK_NEXT = route.rank_window if not FIRST else 1
    route_blocks = route.route_blocks
    senders = make_token_senders(v)
    send_rows, send_across = senders.send_rows, senders.send_across
    MBUF_WORDS, HELD_WORDS = senders.MBUF_WORDS, senders.HELD_WORDS  # the encoder's shared scratch
    stages = make_call_stages(v)
    send_routing, await_peers, rank_or_route, signal_call = (stages.send_routing, stages.await_peers,
                                                             stages.rank_or_route, stages.signal_call)

    @kernel_jit(threads)
    def dispatch_async(tokens, topk_ids, topk_weights, valid_tokens, use_valid, dispatch_tokens, dispatch_topk_ids,
                       dispatch_topk_weights, dispatch_counts, dispatch_ranks, dispatch_signal, dispatch_async_sync,
                       dispatch_send_ranks, dispatch_send_counts, status, token_scales, token_global_scale_u8,
                       prequantized, dispatch_send_stage, dispatch_send_stage_u8, dispatch_tokens_u8, peer_bases,
                       dispatch_token_credit, timeout_ns, dispatch_route_signal, dispatch_row_flag, reuse_routing,
                       relay_counts, relay_signal, relay_stage, relay_rows, relay_chunk_flag, relay_slot):
        """Send this rank's tokens, once per destination rank, and signal each destination.

        tokens [Tc, W] words, topk_ids [Tc, K] int32, topk_weights [Tc, K] float32: this rank's batch; its
        first T rows are sent, T = Tc, or ``min(Tc, valid_tokens[0])`` when use_valid (int64) is nonzero
        (valid_tokens [1] int32 on the device: one CUDA graph captured at capacity serves any batch size). An
        id of -1 masks its slot (nothing is sent for it); an id outside [0, n_experts) is dropped alike and
        recorded, and a repeated id counts once (``routed_id``): the routing rows carry -1 for all three.
        Symmetric: dispatch_tokens [R, Tmax, W] (one buffer, guarded by credits), dispatch_topk_ids /
        dispatch_topk_weights / dispatch_ranks [G, R, Tmax, K], dispatch_counts [G, R, L + 1] int32,
        dispatch_signal and dispatch_route_signal [G, R] uint64 (``(n + 1) << 32 | T``), dispatch_row_flag [R,
        Tmax, DISPATCH_FLAG_PARTS] uint64, dispatch_token_credit [R] uint64. Local: dispatch_async_sync
        [SYNC_LEN] int64, dispatch_send_ranks [Tmax, K] int32 (the ranks, staged), dispatch_send_counts [R, L
        + 1] int32 (the counts rows, staged for the puts path), status int64. FP8 token formats only (empty
        otherwise): token_scales [Tc, S * SB] uint8 (the caller's scales' bytes when prequantized, int64, is
        nonzero: then tokens are [Tc, P] code words), the message stage [Tmax, MW] as uint64 and uint8 views
        (dispatch_send_stage / 8); dispatch_tokens then holds [R, Tmax, MW] messages, dispatch_tokens_u8 their
        uint8 view. A format with a global scale (NVFP4): token_global_scale_u8 [4] uint8, the float32 the
        codec encodes with and sends in every message (empty otherwise). peer_bases [P, R] uint64: the
        address of each of ``protocol.PEER_REGIONS`` on each PE as mapped here (a stores build). The
        hierarchical transport (ep_runtime/kernels/relay.py): relay_counts [G, X, node_size, L + 1] int32 and
        relay_signal [G, R] uint64 symmetric: a proxy gets this rank's counts rows for its node's PEs in
        ``relay_counts[g, x]`` (x: this node among the proxy's other nodes) with ``relay_signal[g, me]`` (the
        dispatch signal's value) instead of any signal of this rank; its rows bound there in chunks (the
        transport's ``send_across``): relay_stage [Tmax min(K, X), W] and relay_rows [X, Tmax, W] (X other
        nodes; token words or messages, symmetric), relay_chunk_flag [X, C] uint64 (symmetric, ``[x, c]``),
        relay_slot [G, Tmax, X] int32 (local); empty stand-ins otherwise.

        Block 0 first grants every peer this call (``grant_credits``), and no block stores a token row
        into a peer before that peer's credit of call n is seen (``await_credits``, bounded by timeout_ns; on
        a timeout the blocks send nothing more, so no signal goes out). The token blocks send the routing rows
        (``send_routing_spread``; a route-first call's routing block does, ``send_routing_first``, unless the
        call is split: then the token blocks do and take the route ticket), then their token rows
        (the codec's ``send_rows``). The routing blocks of the ``wait`` and ``land`` receivers
        rank their chunk of the tokens (``rank_chunk``). The last block (ticket: every block fenced first, or
        quieted where it put) signals every rank, with its counts row on the puts path, and advances the call
        counter. A landing build flags each bf16 row part on arrival and sends none to this rank
        (dispatch_land reads this rank's rows from ``tokens``), and each block takes the route ticket once its
        share of the routing is out, the last setting ``dispatch_route_signal``. This kernel triggers its
        dependents after its own dependency wait, so a receive kernel started early finds everything before
        this one complete.

        reuse_routing (int64) nonzero: a dispatch with a kept routing (ep_runtime/kernels/routing_keep.py
        restored every source's tables and route signal on every rank just before): the token rows and the
        signal only, no routing rows, ranks, counts or route tickets; topk_ids is then this rank's kept ids,
        and on the puts path the signal goes alone (the counts rows are the receivers' own).
        """
        flag = cuda.shared.array(1, int32)
        cmask = cuda.shared.array(CHUNK_MASKS, uint32)  # hierarchical: a chunk's tokens bound for each node
        masks = cuda.shared.array(RANK_WORDS, uint32)  # routing blocks: [warp, expert] lanes with the expert
        warp_rows = cuda.shared.array(RANK_WORDS, int32)  # ... the warp's first rank
        next_rank = cuda.shared.array(RANK_NEXT, int32)  # ... [expert] the next round's first rank
        mbuf = cuda.shared.array(MBUF_WORDS, int64)
        held = cuda.shared.array(HELD_WORDS, uint32)
        lo = cuda.local.array(PAIRS_IN_FLIGHT, uint64)  # a warp's word pairs in flight (the codec's copies)
        hi = cuda.local.array(PAIRS_IN_FLIGHT, uint64)
        run_l = cuda.local.array(RUN_BATCH, uint32)  # a routing block's ranks loaded before they are stored
        ids_l = cuda.local.array(IDS_WORDS, int32)  # a token's expert ids (and its destination list)
        pdl_wait()  # nothing stream-ordered is read before this (ep_runtime/kernels/pdl.py)
        pdl_trigger()  # after the wait: a receive kernel started now finds all before this complete
        # the prologue's loads issued together, before the first branch on any of them (one
        # memory latency for all, not one each; ``n < 0`` never holds: it keeps the compiler
        # from sinking the counter's load past the early return)
        code = status[STATUS_CODE]
        n = dispatch_async_sync[SYNC_CALLS]
        T = tokens.shape[0]
        if use_valid != 0:
            T = max(0, min(T, valid_tokens[0]))
        if code != 0 or n < 0:
            return  # an earlier call failed: send nothing, so peers time out naming this rank
        stamp_first(status, 0)
        stamp_last(status, 30)
        if cuda.blockIdx.x == 0 and cuda.threadIdx.x == 0:
            grant_credits(dispatch_token_credit, n)
        me = shmem.my_pe()
        R = dispatch_counts.shape[1]
        L = dispatch_counts.shape[2] - 1
        K = topk_ids.shape[1]
        g = n % 2
        ids_base = address_of(topk_ids)  # [Tc, K] C-contiguous: (t, k) is flat element t K + k
        # a chunked route-first call of split_from_tokens or more: no routing block, the token
        # blocks send the routing rows and take the route ticket
        split = CHUNKS and T >= SPLIT_FROM and reuse_routing == 0
        route = reuse_routing == 0  # this call sends its routing (not a kept routing's call)
        # ... FP8 rows encoded here: each block's share published by one thread, so the fence holds
        # up one warp, not the block's token rows; rows that are only copied (bf16, pre-quantized
        # FP8) flood the SM's stores at once and a fence behind them held the routing back: the
        # block's ticket
        share_route = split and ENCODES and prequantized == 0
        n_route = route_blocks(cuda.gridDim.x, split)  # routing blocks: the grid's last
        token_blocks = max(cuda.gridDim.x - n_route, 1)
        rb = cuda.blockIdx.x - (cuda.gridDim.x - n_route)  # this block's routing chunk (< 0: none)
        routing_block = rb >= 0

        send_routing(topk_ids, topk_weights, dispatch_topk_ids, dispatch_topk_weights, dispatch_counts,
                     dispatch_send_counts, dispatch_route_signal, dispatch_async_sync, flag, peer_bases, g, me, n, T,
                     R, L, K, route, split, share_route, token_blocks, routing_block, status)
        if not await_peers(dispatch_token_credit, dispatch_async_sync, dispatch_route_signal, flag, g, me, n, T, R,
                           token_blocks, share_route, status, timeout_ns):
            return  # a peer's credit timed out (recorded): no token row, no ticket, no signal

        # token rows, each once to every rank with one of its experts, in the token blocks: as plain
        # stores (the ticket's fence) where the transport and the rows allow, else the ticket's quiet
        # completes the puts (before relay_stage is reused)
        if cuda.blockIdx.x < token_blocks:
            stamp_last(status, 31)
        stores_only = send_rows(tokens, token_scales, token_global_scale_u8, prequantized, ids_base, dispatch_tokens,
                                dispatch_tokens_u8, dispatch_send_stage, dispatch_send_stage_u8, dispatch_row_flag,
                                peer_bases, T, K, L, R, me, n, token_blocks, mbuf, held, ids_l, lo, hi) and FENCED
        send_across(tokens, token_scales, token_global_scale_u8, prequantized, ids_base, relay_stage, relay_rows,
                    relay_chunk_flag, relay_slot, peer_bases, T, K, L, R, me, n, token_blocks, cmask, mbuf, held, ids_l,
                    lo, hi)
        stamp_last(status, 1)
        if route and routing_block:  # the routing rows first, or each (token, k)'s rank and expert's count
            rank_or_route(topk_ids, topk_weights, ids_base, dispatch_topk_ids, dispatch_topk_weights, dispatch_ranks,
                          dispatch_counts, dispatch_send_ranks, dispatch_send_counts, dispatch_route_signal,
                          dispatch_async_sync, flag, peer_bases, g, me, n, T, R, L, K, rb, n_route, status, masks,
                          warp_rows, next_rank, run_l)
        stamp_last(status, 2)
        signal_call(dispatch_signal, dispatch_counts, dispatch_send_counts, relay_counts, relay_signal,
                    dispatch_topk_ids, dispatch_topk_weights, dispatch_ranks, dispatch_async_sync, flag, g, me, n, T,
                    route, stores_only, status)

    return programmatic(dispatch_async, v.pdl)
