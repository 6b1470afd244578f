"""Combine with the router weights applied at home (``EPConfig.combine_weights = "home"``): the
batched layout's ``combine_async`` sends each (token, top-k slot) row home unweighted, and
``combine_wait`` sums ``w[t, k] * row[t, k]`` there with the weights the home rank gives.

DeepEP's low-latency combine takes ``topk_weights`` at the combine only; the expert ranks never
see them. Here the home rank's ``combine_partials`` holds a row per (slot, token), ``[G, K, Tmax,
W]`` bf16 token words, flagged part by part in ``combine_row_flag[k, t, p]`` (``[K, Tmax,
FLAG_PARTS]``, monotonic call numbers): each routed slot's row has exactly one writer, the rank
holding its expert, and one flag, so the home waits for exactly the slots it routed and needs no
count from anyone. The traffic is the row of every (token, slot) instead of one partial per
(token, rank): ``K / (ranks a token reaches)`` times the partials' bytes, DeepEP's own.
docs/protocol.md, "Combine weights at home", has the timeline.

:func:`make_combine_home_kernels` builds both for a
:class:`~ep_runtime.kernels.variant.CombineVariant` with ``home_weights`` (bf16 partials; the
stores or puts transport: the transports' ``send_slot_part``).
"""

import functools

from ep_runtime.kernels import shmem
from ep_runtime.kernels.bits import bf16_bits_at, word_f32
from ep_runtime.kernels.block import (await_flag, interleaved_item, most_tokens, part_bounds,
                                      warp_sync)
from ep_runtime.kernels.combine_send import peer_words
from ep_runtime.kernels.cuda_api import cuda, float32, int32, kernel_jit, uint32, uint64
from ep_runtime.kernels.partials import flagged_parts, partial_geometry
from ep_runtime.kernels.pdl import make_pdl, programmatic
from ep_runtime.kernels.protocol import COUNTER_COMBINE_ROW_FLAG, KERNEL_COMBINE_WAIT, STATUS_CODE, SYNC_CALLS
from ep_runtime.kernels.trace import stamp_first, stamp_last
from ep_runtime.kernels.transport import make_transport
from ep_runtime.kernels.vec import pairs_aligned


@cuda.jit(device=True)
def routed_slot(ids, k, E):
    """Whether slot ``k`` of a token (``ids`` [K] int32, its routing row) sends a row home: its
    id is in ``[0, E)`` (a masked -1 or a dropped id sends none) and no earlier slot names the
    same expert (a repeated id is dispatched once, with its first slot)."""
    x = ids[k]
    if uint32(x) >= uint32(E):
        return False
    for k2 in range(k):
        if ids[k2] == x:
            return False
    return True


@cuda.jit(device=True)
def local_row_index(ids, k, E, L, me):
    """The index ``j`` of slot ``k``'s expert among the token's local experts of rank ``me``
    (ascending: ``batched_token_rows[s, t, j]`` is its row), or -1 when the slot is not routed
    (:func:`routed_slot`) or its expert is not on ``me``."""
    x = ids[k]
    lo = me * L
    if x < lo or x >= lo + L or not routed_slot(ids, k, E):
        return -1
    j = 0
    for k2 in range(ids.shape[0]):
        x2 = ids[k2]
        if x2 >= lo and x2 < x and routed_slot(ids, k2, E):
            j += 1
    return j


@functools.lru_cache(maxsize=None)
def make_combine_home_kernels(v, epilogue) -> dict:
    """``{"combine_async": ..., "combine_wait": ...}`` of ``v`` (``v.home_weights``), combine_wait
    with ``epilogue`` (as :func:`~ep_runtime.kernels.combine_wait.make_combine_wait`'s), each
    marked for PDL when ``v.pdl``."""
    return {"combine_async": make_combine_async_slots(v), "combine_wait": make_combine_wait_home(v, epilogue)}


@functools.lru_cache(maxsize=None)
def make_combine_async_slots(v):
    """The batched layout's ``combine_async`` with weights at home, for ``v``."""
    threads = v.threads
    geo = partial_geometry(threads, v.word, False)
    warp, warps, word_t = geo.warp, geo.warps, geo.word_t
    tp = make_transport(v.transport, threads, v.node_size, v.node_stores)
    grant_credits, home_aligned, send_slot_part = tp.grant_credits, tp.home_aligned, tp.send_slot_part
    UP = geo.UP  # word pairs per lane in flight
    PEER_WORDS = peer_words(geo.pack)
    pdl_wait, pdl_trigger = make_pdl(v.pdl)

    @kernel_jit(threads)
    def combine_async(expert_out, dispatch_topk_ids, dispatch_counts, combine_partials, dispatch_async_sync,
                      batched_token_rows, status, peer_bases, dispatch_token_credit, combine_row_flag, relay_partials,
                      relay_flag):
        """Send each (token, slot) row of the batch home, unweighted; flag each part.

        expert_out [L M, W] words: the output of local expert e's row at slot pos at row ``e M + pos`` (the
        batched layout). Symmetric: dispatch_topk_ids [G, R, Tmax, K], dispatch_counts [G, R, L + 1] (group g
        of the last call), combine_partials [G, K, Tmax, W] words, combine_row_flag [K, Tmax, FLAG_PARTS]
        uint64. Local: dispatch_async_sync (calls), batched_token_rows [R, Tmax, K] int32 (the batched row of
        each token's j-th local expert, ascending), status int64. peer_bases [P, R] uint64: row PEER_PARTIALS
        the address of combine_partials on each PE as mapped here (stores). dispatch_token_credit: block 0
        first grants every peer the next call's token rows, as the other combine senders do.
        relay_partials, relay_flag: empty stand-ins (no hierarchical build).

        A warp per item, part p of token (s, t) (``flagged_parts``: the parts every rank cuts alike; the
        sources interleaved, ``interleaved_item``): for each slot k of the token whose expert is on this rank
        (:func:`local_row_index`), the words of the part of its row go into ``combine_partials[g, k, t]`` of
        rank s, this rank's own tokens included, and ``combine_row_flag[k, t, p]`` there is set to n + 1 after
        them (``send_slot_part``: stored through the mapping then flagged after a fence, or put with the flag),
        as word pairs where the arrays allow it. Nothing is weighted or summed here.
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
        K = dispatch_topk_ids.shape[3]
        W = combine_partials.shape[3]
        direct = PEER_WORDS and W % 2 == 0 and pairs_aligned(expert_out) and pairs_aligned(combine_partials) and \
            home_aligned(relay_partials)  # stored as word pairs
        tid = cuda.threadIdx.x
        lane = tid % warp
        n = dispatch_async_sync[SYNC_CALLS] - 1
        g = n % 2
        all_warps = cuda.gridDim.x * warps

        parts, span = flagged_parts(dispatch_counts[g], W, warp)  # the parts every rank cuts alike
        items = R * most_tokens(dispatch_counts[g]) * parts
        q = cuda.blockIdx.x * warps + tid // warp
        while q < items:
            s, item = interleaved_item(q, all_warps, R)
            t, w0, w1 = part_bounds(item, parts, span, W)
            if t < dispatch_counts[g, s, L] and w0 < w1:
                ids = dispatch_topk_ids[g, s, t]
                for k in range(K):
                    j = local_row_index(ids, k, R * L, L, me)
                    if j >= 0:
                        send_slot_part(expert_out[batched_token_rows[s, t, j]], w0, w1, combine_partials,
                                       relay_partials, relay_flag, combine_row_flag, peer_bases, g, k, s, t,
                                       item - t * parts, n, direct, lane, lo, hi)
            q += all_warps

        stamp_last(status, 17)
        stamp_last(status, 18)

    return programmatic(combine_async, v.pdl)


@functools.lru_cache(maxsize=None)
def make_combine_wait_home(v, epilogue):
    """``combine_wait`` with weights at home, for ``v`` and ``epilogue``."""
    threads = v.threads
    geo = partial_geometry(threads, v.word, False)
    warp, warps, word_t, pack = geo.warp, geo.warps, geo.word_t, geo.pack
    U = geo.U
    ACC = U * pack  # float32 accumulators per lane (a compile-time constant for local.array)
    pdl_wait, pdl_trigger = make_pdl(v.pdl)

    @kernel_jit(threads)
    def combine_wait(out, topk_weights, dispatch_topk_ids, dispatch_counts, combine_partials, dispatch_async_sync,
                     status, timeout_ns, aux, combine_row_flag, combine_wait_claims):
        """Wait for each routed slot's row of each token, then weight and sum them in slot order.

        out [T, W] words = bf16(epilogue(sum over the routed slots k of token t (:func:`routed_slot` of
        ``dispatch_topk_ids[g, me, t]``), ascending k, of topk_weights[t, k] * f32(combine_partials[g, k, t]),
        in float32 from 0)). topk_weights [T, K] float32: this rank's router weights of the call (read only at
        routed slots). combine_partials [G, K, Tmax, W] words, combine_row_flag [K, Tmax, FLAG_PARTS] uint64.
        aux [T, H] float32: the epilogue's input.

        Launched with PDL, as the other combine_wait: each warp claims the parts (``flagged_parts``) in token
        order (``combine_wait_claims[g]``, zeroed by the call's receive kernel), lane 0 waits for the part's
        flag of every routed slot (``combine_row_flag[k, t, p] >= n + 1``; a timeout records the expert's
        rank and the token, and the other warps stop claiming), and the warp sums the part, U words per lane
        in flight. Before it exits the kernel waits for combine_async to complete (``pdl_wait``).
        """
        claim = cuda.shared.array(warps, int32)  # each warp's claimed part, then its flags' verdict
        acc = cuda.local.array(ACC, float32)
        vals = cuda.local.array(U, word_t)
        for u in range(U):  # lanes past a row's end sum these (never stored): keep them finite
            vals[u] = 0
        pdl_trigger()
        # what is read before the dependency wait (counts, calls, status, the caller's arrays)
        # was complete before combine_async started, which triggers this kernel only after its
        # own dependency wait
        n = dispatch_async_sync[SYNC_CALLS] - 1
        g = n % 2
        if status[STATUS_CODE] != 0:
            pdl_wait()
            return
        stamp_first(status, 20)
        me = shmem.my_pe()
        R = dispatch_counts.shape[1]
        L = dispatch_counts.shape[2] - 1
        K = dispatch_topk_ids.shape[3]
        E = R * L
        W = combine_partials.shape[3]
        tid = cuda.threadIdx.x
        lane = tid % warp
        wid = tid // warp

        T = dispatch_counts[g, me, L]
        parts, span = flagged_parts(dispatch_counts[g], W, warp)  # the senders' parts
        while True:
            if lane == 0:  # claim the next part (token order: the order the senders send them)
                c = T * parts
                if status[STATUS_CODE] == 0:
                    c = cuda.atomic.add(combine_wait_claims, g, int32(1))
                claim[wid] = c
            warp_sync()
            i = claim[wid]
            warp_sync()  # read by every lane before lane 0 writes it again
            if i >= T * parts:
                break
            t, w0, w1 = part_bounds(i, parts, span, W)
            ids = dispatch_topk_ids[g, me, t]
            if lane == 0:  # lane 0 waits for the part of every routed slot's row
                ok = 1
                p = i - t * parts
                for k in range(K):
                    if w0 < w1 and routed_slot(ids, k, E):
                        if not await_flag(combine_row_flag[k, t, p:p + 1], ids[k] // L, t, n, timeout_ns, status,
                                          KERNEL_COMBINE_WAIT, COUNTER_COMBINE_ROW_FLAG):
                            ok = 0
                            break
                claim[wid] = ok
            warp_sync()
            ok = claim[wid]
            warp_sync()
            if ok == 0:
                break
            w = w0 + lane
            while w < w1:  # U words per lane: each slot's loads issued before use
                for x in range(ACC):
                    acc[x] = float32(0.0)
                for k in range(K):
                    if routed_slot(ids, k, E):
                        weight = topk_weights[t, k]
                        src = combine_partials[g, k, t]
                        for u in range(U):
                            if w + u * warp < w1:
                                vals[u] = src[w + u * warp]
                        for u in range(U):
                            for x in range(pack):
                                acc[u * pack + x] += weight * word_f32(vals[u], x)
                for u in range(U):
                    wu = w + u * warp
                    if wu < w1:
                        packed = uint64(0)
                        for x in range(pack):
                            packed |= bf16_bits_at(epilogue(acc[u * pack + x], t, wu * pack + x, aux), x)
                        out[t, wu] = word_t(packed)
                w += U * warp
        stamp_last(status, 22)
        pdl_wait()  # completes after combine_async (stream order for what follows)

    return programmatic(combine_wait, v.pdl)
