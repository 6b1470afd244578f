"""Kept routing: a dispatch's routing tables copied aside, and copied back for a later dispatch.

A backward dispatches with the routing of its forward (``EPRuntime.keep_routing`` /
``dispatch_async(tokens, routing=kept)``). Between them other layers dispatch on the same runtime
and the routing regions alternate by call (group ``n % 2``), so the forward's tables are copied
aside right after its ``dispatch_wait``, and copied back into the group of the reusing call just
before its ``dispatch_async``, which then sends its token rows and no routing: every rank holds
what its peers would have sent.

What is kept, per source rank s (this rank's copies of the routing every rank received): its
routing rows' ids and weights for ``t < T_s`` (``dispatch_topk_ids`` / ``_weights``; the ids as
the receivers left them: -1 for a masked, dropped or repeated slot), its counts row
(``dispatch_counts``: tokens per local expert and ``T_s``) and, for the ``wait`` and ``land``
receivers, its ranks (``dispatch_ranks``). ``routing_copy`` with ``restore = 0`` copies call
n's group into the kept arrays (after call n's ``dispatch_wait``: ``n = calls - 1``); with
``restore = 1`` it copies them into call n's group (before call n's ``dispatch_async``: ``n =
calls``) and, for the receivers that wait for a route signal, sets this rank's
``dispatch_route_signal[g, s] = (n + 1) << 32 | T_s`` itself (the routing is here: no peer sends
it). Both read n on the device, so they replay in CUDA graphs as the other calls do.

Why the group is free to overwrite: a rank's readers of group g's previous call (n - 2) precede
this launch in its stream, and no peer writes group g before this rank's signal of call n + 1
(docs/protocol.md, "Why two buffer groups"); the reusing call writes no routing remotely.
"""

import functools

from ep_runtime.kernels.cuda_api import cuda, kernel_jit, uint64
from ep_runtime.kernels.pdl import make_pdl, programmatic
from ep_runtime.kernels.protocol import N_GROUPS, SIGNAL_TOKEN_BITS, SYNC_CALLS


@functools.lru_cache(maxsize=None)
def make_routing_copy(threads: int, pdl: bool):
    """The ``routing_copy`` kernel for blocks of ``threads`` threads (any grid), marked for PDL
    when ``pdl`` (it waits for its predecessor before reading anything, then triggers: the
    dispatch_async after it waits for it to complete)."""
    pdl_wait, pdl_trigger = make_pdl(pdl)

    @kernel_jit(threads)
    def routing_copy(dispatch_topk_ids, dispatch_topk_weights, dispatch_counts, dispatch_ranks, dispatch_route_signal,
                     dispatch_async_sync, kept_ids, kept_weights, kept_counts, kept_ranks, restore):
        """Copy call n's routing tables into the kept arrays (``restore`` = 0) or back (1).

        dispatch_topk_ids / dispatch_topk_weights / dispatch_ranks [G, R, Tmax, K] (int32 / float32 / int32;
        ranks [0, 0, 0, 0] where the plan has none), dispatch_counts [G, R, L + 1] int32,
        dispatch_route_signal [G, R] uint64 (empty where the plan has none): the runtime's routing regions.
        dispatch_async_sync: dispatch_async_sync (the call count). kept_ids / kept_weights / kept_ranks [R,
        Tmax, K] (ranks [0, 0, 0] where none), kept_counts [R, L + 1]: the kept routing. Source s's rows ``t <
        T_s`` are copied (``T_s`` = its counts row's last word: ``dispatch_counts`` when keeping,
        ``kept_counts`` when restoring), every word of the counts rows, and on restore the route signals.
        """
        pdl_wait()  # the kept call's placement (keep) or the earlier calls' readers (restore) are done
        pdl_trigger()
        n = dispatch_async_sync[SYNC_CALLS]
        if restore == 0:
            n -= 1
        g = n % N_GROUPS
        R = dispatch_counts.shape[1]
        L = dispatch_counts.shape[2] - 1
        Tm = dispatch_topk_ids.shape[2]
        K = dispatch_topk_ids.shape[3]
        ranks = dispatch_ranks.shape[0] > 0
        start = cuda.blockIdx.x * threads + cuda.threadIdx.x
        stride = cuda.gridDim.x * threads
        for j in range(start, R * (L + 1), stride):
            s = j // (L + 1)
            c = j - s * (L + 1)
            if restore == 0:
                kept_counts[s, c] = dispatch_counts[g, s, c]
            else:
                dispatch_counts[g, s, c] = kept_counts[s, c]
        for j in range(start, R * Tm * K, stride):
            s = j // (Tm * K)
            t = (j - s * Tm * K) // K
            k = j - (s * Tm + t) * K
            if restore == 0:
                if t < dispatch_counts[g, s, L]:
                    kept_ids[s, t, k] = dispatch_topk_ids[g, s, t, k]
                    kept_weights[s, t, k] = dispatch_topk_weights[g, s, t, k]
                    if ranks:
                        kept_ranks[s, t, k] = dispatch_ranks[g, s, t, k]
            elif t < kept_counts[s, L]:
                dispatch_topk_ids[g, s, t, k] = kept_ids[s, t, k]
                dispatch_topk_weights[g, s, t, k] = kept_weights[s, t, k]
                if ranks:
                    dispatch_ranks[g, s, t, k] = kept_ranks[s, t, k]
        if restore != 0 and dispatch_route_signal.shape[0] > 0 and cuda.blockIdx.x == 0:
            for s in range(cuda.threadIdx.x, R, threads):
                dispatch_route_signal[g, s] = (uint64(n + 1) << uint64(SIGNAL_TOKEN_BITS)) | uint64(kept_counts[s, L])

    return programmatic(routing_copy, pdl)
