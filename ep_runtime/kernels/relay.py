"""The hierarchical transport's proxies: ``dispatch_relay`` and ``combine_relay``.

Nodes are ``node_size`` consecutive PEs (ep_runtime/kernels/nodes.py). A PE is the proxy, on its node, of
each PE of another node that has its local index: its *sources*, one per other node. Across
nodes only sources and their proxies exchange data, in few large puts; within a node every PE
writes every other with stores through their mappings (``node_stores``), or with puts.

``dispatch_relay`` runs after dispatch_async and before the receive kernel. For each source s,
once s's relay signal shows call n complete here (s's routing rows and ranks, the rows of its
tokens with an expert on this node, and this node's counts rows: s put them, then its signal),
it forwards to each other PE q of this node the routing rows and ranks, and the rows of the
tokens with an expert on q, into the slots s would have written on q. Then the last block
gives every PE of the node, this one included, its counts row and dispatch signal of s, as s
would have. The receive kernels, the layouts and the handles are those of a flat run.

``combine_relay`` runs after combine_async and before combine_wait. For each part of each
token of each source with an expert on this node, it waits for the partials of this node's PEs
that hold its experts (``relay_flag``), sums them in ascending PE order in float32 from 0,
rounds the sum to the partial format, and puts it into this PE's slot of s's
``combine_partials`` with its ``combine_row_flag``: one partial crosses per (token, node), and
s sums the partials of its own node's PEs and one per other node, in ascending PE order
(``reference.combine``'s ``node_size``).
"""

import functools
from types import SimpleNamespace

from ep_runtime.kernels import shmem
from ep_runtime.kernels.bits import f32_bits_at, f32_word_at, word_f32
from ep_runtime.kernels.block import (await_flag, last_block_ticket, part_bounds, popc32, publish_fence, record_error,
                                      warp_geometry, warp_sync)
from ep_runtime.kernels.cuda_api import cuda, float32, inlined, int32, int64, kernel_jit, shared_atomic, uint32, uint64
from ep_runtime.kernels.destinations import insert_rank, list_words
from ep_runtime.kernels.nodes import (chunk_tokens, holders, node_bits, node_slots, nth_set_bit, other_index,
                                      stage_rows)
from ep_runtime.kernels.partials import flagged_parts, partial_geometry
from ep_runtime.kernels.protocol import (COUNTER_RELAY_CHUNK, COUNTER_RELAY_FLAG, COUNTER_RELAY_SIGNAL,
                                         COUNTER_TOKEN_CREDIT, ERR_TIMEOUT, KERNEL_COMBINE_RELAY, KERNEL_DISPATCH_RELAY,
                                         PEER_IDS, PEER_RANKS, PEER_TOKENS, PEER_WEIGHTS, SIGNAL_TOKEN_BITS,
                                         STATUS_CODE, SYNC_CALLS)
from ep_runtime.kernels.transport import make_transport
from ep_runtime.kernels.transport.common import PAIRS_IN_FLIGHT
from ep_runtime.kernels.variant import CombineVariant, DispatchVariant


@cuda.jit(device=True)
def chunk_mask(cmask, d_ids, g, s, c, CH, T, here, L, R):
    """Every thread of a block: ``cmask[0]`` (shared uint32) set to the mask of chunk ``c`` of
    source ``s``'s ``T`` tokens (``CH`` a chunk: ``chunk_tokens(T)``) with an expert on a PE of
    ``here`` (uint64 PE bits), bit j for token ``c CH + j``, from the routing rows
    ``d_ids[g, s]``: the packing its sender made of the chunk (``dispatch_async``'s
    ``send_across``, ep_runtime/kernels/transport/hierarchical.py). Returns the mask (a barrier before and after)."""
    if cuda.threadIdx.x == 0:
        cmask[0] = uint32(0)
    cuda.syncthreads()
    for j in range(cuda.threadIdx.x, CH, cuda.blockDim.x):
        t = c * CH + j
        if t < T and holders(d_ids[g, s, t], L, R) & here != uint64(0):
            shared_atomic.or_(cmask, 0, uint32(1) << uint32(j))
    cuda.syncthreads()
    mask = cmask[0]
    cuda.syncthreads()  # read by every thread before the next chunk clears it
    return mask


@cuda.jit(device=True)
def slot_node(x, L, R, node_size):
    """The node of the PE holding global expert ``x`` (``L`` experts a PE, ``R`` PEs, nodes of
    ``node_size``), or -1 for a masked or out-of-range slot."""
    if x >= 0 and x < R * L:
        return (x // L) // node_size
    return -1


@cuda.jit(device=True)
def block_count(count, value):
    """Every thread of a block: the sum of ``value`` (uint32) over the block's threads, through
    ``count`` (a shared uint32 [1], free on entry and on return; a barrier before and after)."""
    if cuda.threadIdx.x == 0:
        count[0] = uint32(0)
    cuda.syncthreads()
    if value != uint32(0):
        shared_atomic.add(count, 0, value)
    cuda.syncthreads()
    total = count[0]
    cuda.syncthreads()  # read by every thread before the next use clears it
    return total


@cuda.jit(device=True)
def chunk_mask_listed(cmask, d_ids, g, s, c, CH, T, here, L, R, node_size):
    """:func:`chunk_mask` of a build with destination lists: ``here`` is the node's index, and a
    token is in the chunk's mask when one of its experts is on a PE d of it (``d // node_size ==
    here``), any PE number."""
    if cuda.threadIdx.x == 0:
        cmask[0] = uint32(0)
    cuda.syncthreads()
    for j in range(cuda.threadIdx.x, CH, cuda.blockDim.x):
        t = c * CH + j
        if t < T:
            ids = d_ids[g, s, t]
            on = False
            for k in range(ids.shape[0]):
                if slot_node(ids[k], L, R, node_size) == here:
                    on = True
            if on:
                shared_atomic.or_(cmask, 0, uint32(1) << uint32(j))
    cuda.syncthreads()
    mask = cmask[0]
    cuda.syncthreads()  # read by every thread before the next chunk clears it
    return mask


@cuda.jit(device=True)
def rows_before(count, d_ids, g, s, c, CH, T, here, L, R, node_size):
    """Every thread of a block: the rows source s's chunk c of ``CH`` tokens staged for the nodes
    before node ``here`` other than its own (dispatch_async's ``send_across`` stages a chunk's
    rows node after node, ascending): a row per token and such node holding one of its experts.
    ``count``: a shared uint32 [1] (:func:`block_count`)."""
    own = s // node_size
    rows = uint32(0)
    for j in range(cuda.threadIdx.x, CH, cuda.blockDim.x):
        t = c * CH + j
        if t < T:
            ids = d_ids[g, s, t]
            for k in range(ids.shape[0]):
                node = slot_node(ids[k], L, R, node_size)
                first = node >= 0 and node < here and node != own
                for k2 in range(k):  # a node counts once a token: at its first slot there
                    if slot_node(ids[k2], L, R, node_size) == node:
                        first = False
                if first:
                    rows += uint32(1)
    return block_count(count, rows)


@functools.lru_cache(maxsize=None)
def make_node_holders(node_size: int, dest_slots: int) -> SimpleNamespace:
    """The relays' view of a token's holders on their node: ``node_set(mine, node_size)`` (the
    node as the other functions take it: its PE bits, ``node_bits``, or with lists its index),
    ``chunk_marks(cmask, d_ids, g, s, c, CH, T, here, L, R)`` (:func:`chunk_mask`), ``held_here(ids,
    L, R, here, store)`` (the holders on the node: a uint64 of PE bits, or with destination lists,
    ``dest_slots`` > 0, the list in ``store``, int32 [S +
    1], count first) and ``is_held(held, q)`` (PE q among them); inlined, so a mask build is the
    code it was with the expressions written in the kernels."""
    NODE = node_size
    if not dest_slots:
        @inlined
        def held_bits(ids, L, R, here, store):
            return holders(ids, L, R) & here

        @inlined
        def bit_set(held, q):
            return (held >> uint64(q)) & uint64(1)

        return SimpleNamespace(node_set=node_bits, chunk_marks=chunk_mask, held_here=held_bits, is_held=bit_set)

    @inlined
    def held_listed(ids, L, R, here, store):
        store[0] = 0
        for k in range(ids.shape[0]):
            x = ids[k]
            if x >= 0 and x < R * L and (x // L) // NODE == here:
                insert_rank(store, int32(x // L))
        return store

    @inlined
    def listed(held, q):
        for j in range(held[0]):
            if held[1 + j] == q:
                return True
        return False

    @inlined
    def marks_listed(cmask, d_ids, g, s, c, CH, T, here, L, R):
        return chunk_mask_listed(cmask, d_ids, g, s, c, CH, T, here, L, R, NODE)

    @inlined
    def index_of_node(mine, node_size):
        return mine

    return SimpleNamespace(node_set=index_of_node, chunk_marks=marks_listed, held_here=held_listed, is_held=listed)


@functools.lru_cache(maxsize=None)
def make_dispatch_relay(v: DispatchVariant):
    """The ``dispatch_relay`` kernel of a hierarchical ``v`` (``v.node_size`` PEs a node)."""
    threads = v.threads
    warp, warps = warp_geometry(threads)
    NODE = v.node_size
    tp = make_transport(v.transport, threads, NODE, v.node_stores, v.dest_slots)
    forward_run, forward_row = tp.forward_run, tp.forward_row  # stores or puts within the node
    near = make_node_holders(NODE, v.dest_slots)
    node_set, chunk_marks, held_here = near.node_set, near.chunk_marks, near.held_here
    HELD_WORDS = max(1, list_words(v.dest_slots))
    NODE_SLOTS = node_slots(v.rank_slots, NODE)
    # a constant the compiler prunes on: a mask build keeps the holders' expression in the kernel
    # body, the code it compiled to before the lists (``held_here`` inlined reorders it)
    LISTED = v.dest_slots > 0

    @kernel_jit(threads)
    def dispatch_relay(dispatch_tokens, dispatch_topk_ids, dispatch_topk_weights, dispatch_ranks, dispatch_counts,
                       dispatch_signal, relay_counts, relay_signal, dispatch_token_credit, dispatch_async_sync,
                       relay_sync, status, timeout_ns, relay_rows, relay_chunk_flag, peer_bases, reuse_routing):
        """Forward each source's call to this node's PEs, then signal them on its behalf.

        Symmetric, as dispatch_async writes them: dispatch_tokens [R, Tmax, W] token words (or FP8 messages),
        dispatch_topk_ids / dispatch_topk_weights / dispatch_ranks [G, R, Tmax, K], dispatch_counts [G, R, L +
        1] int32, dispatch_signal [G, R] uint64, relay_counts [G, X, N, L + 1] int32 ([g, x, j]: the counts row
        for PE j of this node of the source on the x-th other node; ``N = node_size``), relay_signal [G, R]
        uint64, dispatch_token_credit [R] uint64, relay_rows [X, Tmax, W] (``[other_index(node(s)), c CH + j]``:
        the j-th packed row of chunk c of source s) and relay_chunk_flag [X, C] uint64 (``[other_index(node(s)),
        c]``: n + 1 once it arrived). peer_bases [P, R] uint64: the node's PEs' regions as mapped here (a
        ``node_stores`` build forwards with stores through
        them). Local: dispatch_async_sync (dispatch_async's call counter: this is call ``sync[1] - 1``),
        relay_sync [1] int64 (the launch's ticket), status int64. timeout_ns bounds each wait. reuse_routing
        (int64) nonzero: the call dispatched a kept routing (every rank restored every source's tables): the
        rows and the signals only, no routing rows, ranks or counts rows.

        Every block: thread 0 waits for the credit of call n of each other PE of this node (it has read its
        rows of earlier calls) and for each source's relay signal (its routing rows, ranks and counts rows are
        here). A timeout records this kernel, the peer and the counter, and the block returns: no signal goes
        out, so the node's receivers time out naming the source. Then, each source's tokens in a range a
        block, the block copies its range of the routing rows and ranks to each other PE of the node
        (``forward_run``; not on a kept routing's call); and a chunk of ``CH = chunk_tokens(T_s)`` tokens a
        block in turn, it ranks the chunk's tokens with an expert on this node (``chunk_mask``, as the source
        packed them), waits for the chunk's flag, and a warp per packed row copies the row into
        ``dispatch_tokens[s, t]`` of each PE of the node holding one of its experts, this one included
        (``forward_row``). The last block (ticket after a quiet, which also publishes stores) puts each
        source's counts row with its dispatch signal, ``(n + 1) << 32 | T_s``, to every PE of the node (the
        signal alone on a kept routing's call).
        """
        flag = cuda.shared.array(1, int32)
        cmask = cuda.shared.array(1, uint32)
        t_of = cuda.shared.array(NODE_SLOTS, int32)  # each source node's token count (T_s)
        held_l = cuda.local.array(HELD_WORDS, int32)  # a token's holders here, where built with lists
        lo = cuda.local.array(PAIRS_IN_FLIGHT, uint64)  # forward_row's word pairs
        hi = cuda.local.array(PAIRS_IN_FLIGHT, uint64)
        if status[STATUS_CODE] != 0:
            return  # an earlier error: forward nothing, so the node's receivers time out naming the sources
        n = dispatch_async_sync[SYNC_CALLS] - 1
        g = n % 2
        me = shmem.my_pe()
        R = dispatch_counts.shape[1]
        L = dispatch_counts.shape[2] - 1
        mine = me // NODE
        first = mine * NODE  # this node's first PE
        here = node_set(mine, NODE)
        tid = cuda.threadIdx.x
        wid = tid // warp
        if tid == 0:
            ok = 1
            for q in range(first, first + NODE):
                if q != me and ok == 1:
                    seen = shmem.wait_signal_ge(dispatch_token_credit[q:q + 1], uint64(n + 1), timeout_ns)
                    if seen < uint64(n + 1):
                        record_error(status, ERR_TIMEOUT, KERNEL_DISPATCH_RELAY, me, q, COUNTER_TOKEN_CREDIT, n + 1,
                                     int64(seen), n + 1)
                        ok = 0
            for node in range(R // NODE):
                s = node * NODE + me % NODE
                if node != mine and ok == 1:
                    want = uint64(n + 1) << uint64(SIGNAL_TOKEN_BITS)
                    seen = shmem.wait_signal_ge(relay_signal[g, s:s + 1], want, timeout_ns)
                    if seen < want:
                        record_error(status, ERR_TIMEOUT, KERNEL_DISPATCH_RELAY, me, s, COUNTER_RELAY_SIGNAL,
                                     int64(want), int64(seen), n + 1)
                        ok = 0
                    t_of[node] = int32(seen & uint64(0xFFFFFFFF))
            flag[0] = ok
        cuda.syncthreads()
        if flag[0] == 0:
            return
        for node in range(R // NODE):
            if node != mine:
                s = node * NODE + me % NODE
                T = t_of[node]
                per = (T + cuda.gridDim.x - 1) // cuda.gridDim.x
                t0 = min(cuda.blockIdx.x * per, T)
                t1 = min(t0 + per, T)
                if t0 < t1 and reuse_routing == 0:
                    forward_run(dispatch_topk_ids, g, s, t0, t1, peer_bases, PEER_IDS, first, me)
                    forward_run(dispatch_topk_weights, g, s, t0, t1, peer_bases, PEER_WEIGHTS, first, me)
                    forward_run(dispatch_ranks, g, s, t0, t1, peer_bases, PEER_RANKS, first, me)
                x = other_index(node, mine)
                CH = chunk_tokens(T)
                c = cuda.blockIdx.x
                while c * CH < T:  # block-uniform
                    mask = chunk_marks(cmask, dispatch_topk_ids, g, s, c, CH, T, here, L, R)
                    if mask != uint32(0):
                        if tid == 0 and not await_flag(relay_chunk_flag[x, c:c + 1], s, c * CH, n, timeout_ns,
                                                       status, KERNEL_DISPATCH_RELAY, COUNTER_RELAY_CHUNK):
                            flag[0] = 0
                        cuda.syncthreads()
                        if flag[0] == 0:
                            return  # no ticket: the node's receivers time out naming the source
                        for j in range(wid, popc32(mask), warps):  # a warp a packed row
                            t = c * CH + nth_set_bit(mask, j)
                            if LISTED:
                                to = held_here(dispatch_topk_ids[g, s, t], L, R, here, held_l)
                            else:
                                to = holders(dispatch_topk_ids[g, s, t], L, R) & here
                            forward_row(dispatch_tokens, relay_rows[x, c * CH + j], s, t, to, peer_bases,
                                        PEER_TOKENS, first, tid % warp, lo, hi)
                    c += cuda.gridDim.x
        if last_block_ticket(relay_sync[0:1], flag, False):  # every block's puts complete (quiet)
            for j in range(tid, (R // NODE) * NODE, threads):  # (source node, PE of this node)
                node = j // NODE
                q = first + j - node * NODE
                if node != mine:
                    s = node * NODE + me % NODE
                    signal = (uint64(n + 1) << uint64(SIGNAL_TOKEN_BITS)) | uint64(t_of[node])
                    if reuse_routing == 0:
                        shmem.put_signal(dispatch_counts[g, s], relay_counts[g, other_index(node, mine), q - first],
                                         dispatch_signal[g, s:s + 1], signal, shmem.SIGNAL_SET, q)
                    else:
                        shmem.signal_op(dispatch_signal[g, s:s + 1], signal, shmem.SIGNAL_SET, q)
            if tid == 0:
                relay_sync[0] = 0

    return dispatch_relay


@functools.lru_cache(maxsize=None)
def make_combine_relay(v: CombineVariant):
    """The ``combine_relay`` kernel of a hierarchical ``v`` (``v.node_size`` PEs a node)."""
    threads = v.threads
    geo = partial_geometry(threads, v.word, v.f32_partials)
    warp, warps, word_t, pack, F32 = geo.warp, geo.warps, geo.word_t, geo.pack, geo.F32
    rounded_word = geo.rounded_word
    E = 2 if F32 else pack  # values a partial word holds
    NODE = v.node_size
    near = make_node_holders(NODE, v.dest_slots)
    node_set, chunk_marks, held_here, is_held = near.node_set, near.chunk_marks, near.held_here, near.is_held
    HELD_WORDS = max(1, list_words(v.dest_slots))
    # a constant the compiler prunes on: the list builds keep the home's partials by sender
    # (``CombineVariant.partial_slots``), the mask builds a row a rank
    BY_SENDER = v.partial_slots > 0

    @kernel_jit(threads)
    def combine_relay(combine_partials, relay_partials, relay_flag, relay_sums, combine_chunk_flag, dispatch_topk_ids,
                      dispatch_counts, dispatch_async_sync, status, timeout_ns, combine_sums):
        """Sum this node's partials of each source's tokens and send them home, a chunk a put.

        Symmetric: combine_partials [G, R, Tmax, PW] partial words (a chunk's sums go to ``[g, me, c CH:]`` of
        the source, packed), or kept by sender (``v.partial_slots``) combine_sums [G, Tmax min(K, X), PW]
        (``[g, c CH KX + b:]``, KX = min(K, X), b the chunk's rows for the nodes before this one other
        than the source's: ``rows_before``, where dispatch_async staged the chunk's rows and noted each
        token's, relay_slot; combine_partials then unused), relay_partials [X N, Tmax, PW] (``[x
        node_size + j, t]``: the partial of PE j of this node for token t of source s, x the index of s's node
        among the other nodes), relay_flag [X N, Tmax, FLAG_PARTS] uint64, relay_sums [X, Tmax, PW] (the sums,
        packed and staged for their put), combine_chunk_flag [R, C] uint64 ([N + X, C] by sender;
        ``combine_chunk_flag``); dispatch_topk_ids [G, R, Tmax, K] and dispatch_counts [G, R, L + 1] of the
        call (group g). Local: dispatch_async_sync (the call counter), status int64.

        A chunk of ``CH = chunk_tokens(T_s)`` tokens of a source a block in turn: the block ranks the chunk's
        tokens with an expert on this node (``chunk_mask``: the packing of dispatch), and a warp per part
        (``flagged_parts``, as combine_async cuts them) of each packed token has lane 0 wait for each holder's
        relay flag of the part, then sums the holders' partial words in ascending PE order (float32 from 0)
        and rounds the sum to the partial format into ``relay_sums[x, c CH + j]`` (x: ``other_index`` of the
        source's node, j the token's packed row). Then the block puts the chunk's packed sums to the source in
        one ``put_signal_nbi_block`` setting its ``combine_chunk_flag[me, c]`` (by sender ``[N + x', c]``, x'
        the index of this node among the source's other nodes) to
        n + 1; each block quiets its puts at the end (their source is reused by the next call). A flag's
        timeout records this kernel, the holder and the token, and the block stops before its put (the
        source's combine_wait then times out naming this PE).
        """
        acc = cuda.local.array(E, float32)
        held_l = cuda.local.array(HELD_WORDS, int32)  # a token's holders here, where built with lists
        cmask = cuda.shared.array(1, uint32)
        ok = cuda.shared.array(1, int32)  # the block's flags: all seen (1) or not
        verdict = cuda.shared.array(warps, int32)  # each warp's flags
        if status[STATUS_CODE] != 0:
            return
        n = dispatch_async_sync[SYNC_CALLS] - 1
        g = n % 2
        me = shmem.my_pe()
        R = dispatch_counts.shape[1]
        L = dispatch_counts.shape[2] - 1
        K = dispatch_topk_ids.shape[3]
        PW = combine_partials.shape[3]
        mine = me // NODE
        first = mine * NODE
        here = node_set(mine, NODE)
        lane = cuda.threadIdx.x % warp
        wid = cuda.threadIdx.x // warp
        parts, span = flagged_parts(dispatch_counts[g], PW, warp)  # the parts every rank cuts alike
        for node in range(R // NODE):
            if node != mine:
                s = node * NODE + me % NODE
                T = dispatch_counts[g, s, L]
                x = other_index(node, mine)
                CH = chunk_tokens(T)
                c = cuda.blockIdx.x
                while c * CH < T:  # block-uniform
                    if cuda.threadIdx.x == 0:
                        ok[0] = 1
                    mask = chunk_marks(cmask, dispatch_topk_ids, g, s, c, CH, T, here, L, R)
                    packed = popc32(mask)
                    i = wid
                    while i < packed * parts and ok[0] == 1:  # (token j, part p) of the chunk, a warp each
                        j = i // parts
                        p = i - j * parts
                        t = c * CH + nth_set_bit(mask, j)
                        _, w0, w1 = part_bounds(t * parts + p, parts, span, PW)
                        held = held_here(dispatch_topk_ids[g, s, t], L, R, here, held_l)
                        if lane == 0:
                            seen_all = 1
                            for q in range(first, first + NODE):
                                if seen_all == 1 and w0 < w1 and is_held(held, q):
                                    row = x * NODE + q - first  # PE q's partials of source s's tokens
                                    if not await_flag(relay_flag[row, t, p:p + 1], q, t, n, timeout_ns, status,
                                                      KERNEL_COMBINE_RELAY, COUNTER_RELAY_FLAG):
                                        seen_all = 0
                                        ok[0] = 0
                            verdict[wid] = seen_all
                        warp_sync()
                        seen_all = verdict[wid]
                        warp_sync()  # read by every lane before lane 0 writes it again
                        if seen_all == 1:
                            for w in range(w0 + lane, w1, warp):
                                for e in range(E):
                                    acc[e] = float32(0.0)
                                for q in range(first, first + NODE):
                                    if is_held(held, q):
                                        word = relay_partials[x * NODE + q - first, t, w]
                                        for e in range(E):
                                            if F32:
                                                acc[e] += f32_word_at(word, e)
                                            else:
                                                acc[e] += word_f32(word, e)
                                if F32:
                                    relay_sums[x, c * CH + j, w] = word_t(f32_bits_at(acc[0], 0)
                                                                          | f32_bits_at(acc[1], 1))
                                else:
                                    relay_sums[x, c * CH + j, w] = rounded_word(acc, 0)
                        i += warps
                    cuda.syncthreads()  # every sum of the chunk is staged (or a flag timed out)
                    if ok[0] == 0:
                        return  # no put: the source's combine_wait times out naming this PE
                    if packed > 0:
                        c0 = c * CH
                        if BY_SENDER:  # where s staged the chunk's rows for this node; flagged in this proxy's row
                            at = NODE + other_index(mine, node)
                            q0 = c * CH * stage_rows(K, R // NODE - 1) + rows_before(
                                cmask, dispatch_topk_ids, g, s, c, CH, T, mine, L, R, NODE)
                            shmem.put_signal_nbi_block(combine_sums[g, q0:q0 + packed],
                                                       relay_sums[x, c0:c0 + packed], combine_chunk_flag[at, c:c + 1],
                                                       uint64(n + 1), shmem.SIGNAL_SET, s)
                        else:
                            shmem.put_signal_nbi_block(combine_partials[g, me, c0:c0 + packed],
                                                       relay_sums[x, c0:c0 + packed], combine_chunk_flag[me, c:c + 1],
                                                       uint64(n + 1), shmem.SIGNAL_SET, s)
                    c += cuda.gridDim.x
        cuda.syncthreads()
        if cuda.threadIdx.x == 0:
            publish_fence(False)  # quiet: the block's puts are complete before relay_sums is written again

    return combine_relay
