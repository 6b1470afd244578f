"""Combine, wait half: ``combine_wait`` sums each token's partials in rank order.

Launched with PDL, its blocks start on the SMs combine_async leaves free and reduce each part of
each partial row as soon as it is flagged (``combine_row_flag``), then apply the caller's
epilogue and round to bf16 (or hand back the per-rank partials). docs/protocol.md has the
summation order.

:func:`make_combine_wait` builds it for a block size, token word, partial format, PDL and an
epilogue; its loops over a part's partials (the sum, or the copy) are
ep_runtime/kernels/combine_reduce.py.
"""

import functools

from ep_runtime.kernels import shmem
from ep_runtime.kernels.block import await_flag, part_bounds, warp_sync
from ep_runtime.kernels.combine_reduce import make_partial_reduce
from ep_runtime.kernels.cuda_api import cuda, float32, inlined, int32, kernel_jit, uint32, uint64
from ep_runtime.kernels.destinations import holders_of, list_words
from ep_runtime.kernels.nodes import make_partial_sources, via_proxies_listed
from ep_runtime.kernels.partials import flagged_parts, partial_geometry
from ep_runtime.kernels.pdl import make_pdl, programmatic
from ep_runtime.kernels.protocol import COUNTER_COMBINE_ROW_FLAG, KERNEL_COMBINE_WAIT, STATUS_CODE, SYNC_CALLS
from ep_runtime.kernels.trace import stamp_first, stamp_last
from ep_runtime.kernels.vec import pairs_aligned

#: combine_wait modes
MODE_REDUCE = 0      # out [T, H]: sum of the partials, epilogue, bf16
MODE_PARTIALS = 1    # out [R, T, H]: each rank's partial (zero where the token did not go)


@cuda.jit(device=True)
def identity_epilogue(value, token, col, aux):
    """The default epilogue: returns ``value`` (float32) unchanged."""
    return value


def make_list_waits(node_size: int, dest_slots: int, partial_slots: int, await_partial):
    """The list builds' ``went_of_list`` (a token's ranks whose partials it sums, as an ascending
    list) and ``await_listed`` (wait for each of them), for ``combine_wait`` of
    ``make_combine_wait``'s ``node_size``, ``dest_slots`` and ``partial_slots``; ``await_partial``
    of the build's ``nodes.make_partial_sources``."""
    LIST = list_words(dest_slots)

    @inlined
    def went_of_list(dispatch_topk_ids, g, me, t, K, L, R, went_l):
        """The ranks whose partials token t sums (the kernel's mask loop) as an ascending list in
        ``went_l`` (ep_runtime/kernels/destinations.py; hierarchical: the holders' list in
        ``went_l[LIST:]``, the senders' in front), returned (a device function returns only an
        array it was passed)."""
        if node_size:
            holders_of(dispatch_topk_ids[g, me, t], L, R, went_l[LIST:])
            via_proxies_listed(went_l[LIST:], me, node_size, went_l)
        else:
            holders_of(dispatch_topk_ids[g, me, t], L, R, went_l)
        return went_l

    @inlined
    def await_list(combine_row_flag, combine_chunk_flag, went, me, t, i, parts, n, T, R, own, w0, w1, timeout_ns,
                   status):
        """One thread: wait for part ``p = i - t parts`` of the partial of every rank of the list
        ``went`` (not this rank's own in expert_out; none where the part has no word, ``w0 >=
        w1``); 1 when all came, 0 on a timeout (recorded). The kernel's mask loop over a list."""
        ok = 1
        p = i - t * parts
        for j in range(went[0]):
            r = went[1 + j]
            if w0 < w1 and not (own and r == me):
                if not await_partial(combine_row_flag, combine_chunk_flag, me, r, t, p, n, T, timeout_ns, status):
                    ok = 0
                    break
        return ok

    @inlined
    def await_slots(combine_row_flag, combine_chunk_flag, went, me, t, i, parts, n, T, R, own, w0, w1, timeout_ns,
                    status):
        """``await_list`` where partials are kept by destination slot: the list's j-th rank r's
        flag is ``combine_row_flag[j, t, p]`` (a timeout names r)."""
        ok = 1
        p = i - t * parts
        for j in range(went[0]):
            r = went[1 + j]
            if w0 < w1 and not (own and r == me):
                if not await_flag(combine_row_flag[j, t, p:p + 1], r, t, n, timeout_ns, status, KERNEL_COMBINE_WAIT,
                                  COUNTER_COMBINE_ROW_FLAG):
                    ok = 0
                    break
        return ok

    return went_of_list, (await_slots if partial_slots and not node_size else await_list)


@functools.lru_cache(maxsize=None)
def make_combine_wait(threads: int, word: str, f32_partials: bool, pdl: bool, epilogue=identity_epilogue,
                      node_size: int = 0, dest_slots: int = 0, partial_slots: int = 0):
    """``combine_wait`` for blocks of ``threads`` threads, token words of ``word`` (a NumPy
    dtype name), the partial format, PDL, and ``epilogue(value: float32, token: int, col: int,
    aux: [T, H] float32) -> float32``, a Numba device function applied to each reduced element
    before the bf16 store (e.g. a residual add reading ``aux[token, col]``). Of the transport it
    sees only where partials arrive (``nodes.make_partial_sources`` of the hierarchical one's
    ``node_size``; 0 otherwise): a token's partials from another node come summed, from this
    rank's proxy there, in its chunk's packed row (``relay_slot``). A token's ranks are a uint64
    mask (``dest_slots`` 0) or an ascending list of at most ``dest_slots`` ranks
    (ep_runtime/kernels/destinations.py); with ``partial_slots`` (a list build) its partials and
    their flags are kept by destination slot, the list's j-th rank's in row j, or with nodes by
    sender, rank r's in row ``nodes.sender_index(me, r)`` (``CombineVariant.partial_slots``)."""
    if partial_slots and not dest_slots:
        raise ValueError(f"partials by destination slot or sender (partial_slots={partial_slots}) need "
                         f"destination lists (dest_slots={dest_slots}); pass partial_slots=0 for a mask build")
    geo = partial_geometry(threads, word, f32_partials)
    warp, warps, word_t, pack, P, F32 = geo.warp, geo.warps, geo.word_t, geo.pack, geo.P, geo.F32
    U = geo.U
    UP = geo.UP
    # token words per lane per pass, so that U partial words are in flight (the same bytes and
    # registers as bf16's U words), and their accumulators (combine_reduce.py)
    UW = U // P
    ACCW = UW * pack
    pdl_wait, pdl_trigger = make_pdl(pdl)

    by_sender = partial_slots and node_size  # the mask builds share one set of functions with combine_reduce
    sources = make_partial_sources(node_size, True) if by_sender else make_partial_sources(node_size)
    senders, _, await_partial = sources
    reduce = make_partial_reduce(threads, word, f32_partials, epilogue, node_size, dest_slots, partial_slots)
    LIST = list_words(dest_slots)
    WENT_WORDS = max(1, 2 * LIST if node_size else LIST)  # hierarchical: the holders, then the senders

    went_of_list, await_listed = make_list_waits(node_size, dest_slots, partial_slots, await_partial)
    # a constant the compiler prunes on: the mask builds keep their loops in the kernel body, the
    # code they compiled to before the lists (an inlined helper reorders it)
    LISTED = dest_slots > 0
    reduce_part, copy_part = reduce.reduce_part, reduce.copy_part

    @kernel_jit(threads)
    def combine_wait(out, out_partials, dispatch_topk_ids, dispatch_counts, combine_partials, dispatch_async_sync,
                     status, mode, timeout_ns, aux, own_rows, combine_row_flag, combine_wait_claims, relay_slot,
                     combine_chunk_flag, combine_sums):
        """Wait for every rank's partials, then reduce them per token in rank order.

        MODE_REDUCE: out [T, W] words = bf16(epilogue(sum over ranks r that token t went to, in ascending r,
        of f32(partial_r), from 0)). MODE_PARTIALS: out_partials [R, T, P W] partial words = partial_r (zero
        where the token did not go to r). The array of the other mode is not touched (pass any array of the
        right rank). combine_partials [G, R, T, P W] partial words ([G, S, T, P W] with ``partial_slots`` S,
        rank r's partial in row j, r's position among the token's destination ranks, or with nodes in row
        ``sender_index(me, r)``; combine_row_flag and combine_chunk_flag likewise). aux [T, H] float32: the
        epilogue's input.
        own_rows: after combine_async_rows (compact layout), its expert_out [R * Tmax, P W] partial words,
        where this rank's own partial of token t is row ``me * Tmax + t`` (combine_async_rows does not copy
        it); after combine_async, an empty [0, 0] array (the own partial is in combine_partials[g, me, t]).

        No dependency wait first: combine_async lets this kernel start once the caller's data is complete, so
        with PDL its blocks start on the SMs combine_async leaves free and work while the partials arrive.
        Each warp combine_wait_claims the senders' parts (``flagged_parts``) in turn (lane 0:
        ``combine_wait_claims[g]``, int32 [2], an atomic counter the receive kernel of the call zeroes), lane
        0 waits for the part's flags (``combine_row_flag[r, t, p] >= n + 1`` for every rank r the token went
        to, this rank's own row in expert_out excepted), and the warp reduces the part, U partial words per
        lane in flight (UW = U / P token words); parts are claimed in token order, the order they are sent.
        Before it exits the kernel waits for combine_async to complete (``pdl_wait``), so stream order still
        holds for what follows. A flag's timeout records the rank and the token, and the other warps stop
        claiming.

        Hierarchical (``node_size`` > 0): the partial of a token from another node is its proxy r's sum, in
        ``combine_partials[g, r, relay_slot[g, t, x]]`` (x: ``other_index`` of r's node; the packed row
        dispatch_async noted), or kept by sender ``combine_sums[g, relay_slot[g, t, x]]`` ([G, Tmax min(K,
        X), P W]: the proxies' sums as dispatch_async staged the chunks' rows; combine_partials then [G, N,
        Tmax, P W]), flagged for the token's whole chunk (``combine_chunk_flag[r, t // chunk_tokens(T)]``);
        relay_slot [G, Tmax, X] int32, combine_chunk_flag [R, C] uint64 ([N + X, C] by sender) (empty
        stand-ins otherwise).
        """
        claim = cuda.shared.array(warps, int32)  # each warp's claimed part, then its flags' verdict
        acc = cuda.local.array(ACCW, float32)
        went_l = cuda.local.array(WENT_WORDS, int32)  # a token's ranks, where built with destination lists
        vals = cuda.local.array(U, word_t)
        lo = cuda.local.array(UP, word_t)
        hi = cuda.local.array(UP, word_t)
        for u in range(UP):  # lanes past a row's end sum these (never stored): keep them finite
            lo[u] = 0
            hi[u] = 0
        for u in range(U):  # and so do the single-word loops' lanes
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
        W = combine_partials.shape[3] // 2 if F32 else combine_partials.shape[3]  # token words
        own = own_rows.shape[0] > 0  # this rank's partials in the compact expert_out
        pairs = (W % 2 == 0 and pairs_aligned(out) and pairs_aligned(combine_partials)
                 and (not own or pairs_aligned(own_rows)))
        tid = cuda.threadIdx.x
        lane = tid % warp
        wid = tid // warp

        T = dispatch_counts[g, me, L]
        Tmax = dispatch_topk_ids.shape[2]
        parts, span = flagged_parts(dispatch_counts[g], P * W, warp)  # the senders' parts (in partial words)
        span = span // P
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
            if LISTED:
                went = went_of_list(dispatch_topk_ids, g, me, t, K, L, R, went_l)
                if lane == 0:  # lane 0 waits for the part's partials (its own in expert_out are there)
                    claim[wid] = await_listed(combine_row_flag, combine_chunk_flag, went, me, t, i, parts, n, T, R,
                                              own, w0, w1, timeout_ns, status)
            else:
                went = uint64(0)  # bit r: token t went to rank r
                for k in range(K):
                    x = dispatch_topk_ids[g, me, t, k]
                    if uint32(x) < uint32(R * L):  # a masked (-1) or dropped id went nowhere
                        went |= uint64(1) << uint64(x // L)
                went = senders(went, me, R)  # hierarchical: one partial per other node
                if lane == 0:  # lane 0 waits for the part's partials (its own in expert_out are there)
                    ok = 1
                    p = i - t * parts
                    for r in range(R):
                        if w0 < w1 and (went >> uint64(r)) & uint64(1) and not (own and r == me):
                            if not await_partial(combine_row_flag, combine_chunk_flag, me, r, t, p, n, T, timeout_ns,
                                                 status):
                                ok = 0
                                break
                    claim[wid] = ok
            warp_sync()
            ok = claim[wid]
            warp_sync()
            if ok == 0:
                break
            if mode == MODE_REDUCE:
                reduce_part(out, own_rows, combine_partials, combine_sums, relay_slot, aux, g, me, t, Tmax, R, went,
                            own, pairs, w0, w1, lane, acc, vals, lo, hi)
            else:
                copy_part(out_partials, own_rows, combine_partials, combine_sums, relay_slot, g, me, t, Tmax, R, went,
                          own, w0, w1, lane)
        stamp_last(status, 22)
        pdl_wait()  # completes after combine_async (stream order for what follows)

    return programmatic(combine_wait, pdl)
