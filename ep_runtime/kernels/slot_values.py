"""Slot values home: ``slot_values_async`` / ``slot_values_wait`` carry one float32 per expert-batch
row back to the (token, top-k slot) it came from.

What a backward needs for the router weights' gradient: ``d loss / d w[t, k]`` is the dot product
of the combine output's gradient for token t with the output of the expert row slot k went to.
Both are on the expert's rank after the backward's dispatch of the gradient, so each rank
computes one float per row there, and these kernels bring the ``T x K`` floats home: 4 bytes a
slot, where a combine moves a row of hidden values.

``slot_values_async`` (the plan's grid, after ``dispatch_wait`` of call n): every row ``i <
row_offsets[L]`` that came from a slot (``row_src_k[i] >= 0``; padding rows did not) writes
``values[i]`` into ``slot_values[g, t, k]`` of its source rank (``t, k`` = ``row_src_token[i],
row_src_k[i]``), a thread a row: a 4-byte store through the peer's NVLink mapping
(``peer_bases[PEER_SLOTS]``), or an NVSHMEM put on the puts transport. Each block then publishes
and takes a ticket (``dispatch_async_sync[SYNC_SLOT_TICKET]``); the last sets
``slot_signal[g, me]`` to ``n + 1`` on every rank. Each routed slot of a token is one row
somewhere, so every element it writes has exactly one writer.

The hierarchical transport (``node_size`` > 0): a value for a rank of this node goes as above
(stores within a node, or puts); one for rank s of another node is staged in
``slot_stage[s, t, k]``, and the last block puts each such rank its whole staged block
``[T_s, K]`` into ``slot_across[g, me]`` there with the signal (one ``put_signal`` per rank of
another node and call, 4 T_s K bytes, the whole block's: what a CPU proxy can afford; only the
slots this rank holds are read there). ``slot_values_wait`` reads a slot held on another node from
``slot_across[g, holder]``.

``slot_values_wait`` (the plan's grid): thread r of every block waits for ``slot_signal[g, r] >=
n + 1`` (bounded; a timeout is recorded naming the rank and the counter), then the grid copies
``slot_values[g]`` into ``out`` [T_out, K], an element a thread: the value of each routed slot of
this rank's tokens, 0.0 for a masked or dropped slot (the routing row carries -1: ``routed_id``),
for a repeat of an earlier slot's id (a plain route-first sender sends repeats, and a receiver
masks only its own experts': each element is compared with its token's earlier slots) and for
tokens past the call's T (docs/plans.md says why the whole grid copies).

Both read the call number from the device (``dispatch_async_sync[SYNC_CALLS]``), so they replay
in CUDA graphs as the other calls do, and both wait for their predecessor before anything else
(PDL: ``pdl_wait``, then ``pdl_trigger``). ``g = n % 2``: a rank's next call of the same group
comes after a dispatch that every rank's earlier call must have finished.
"""

import functools

from ep_runtime.kernels import shmem
from ep_runtime.kernels.block import last_block_ticket, record_error
from ep_runtime.kernels.cuda_api import cuda, float32, int32, int64, kernel_jit, uint32, uint64
from ep_runtime.kernels.nodes import make_near
from ep_runtime.kernels.pdl import make_pdl, programmatic
from ep_runtime.kernels.protocol import (COUNTER_SLOT_SIGNAL, ERR_SHORT_ROWS, ERR_TIMEOUT, KERNEL_SLOT_VALUES_ASYNC,
                                         KERNEL_SLOT_VALUES_WAIT, N_GROUPS, STATUS_CODE, SYNC_CALLS,
                                         SYNC_SLOT_TICKET)
from ep_runtime.kernels.transport import make_transport
from ep_runtime.kernels.variant import Transport


@functools.lru_cache(maxsize=None)
def make_slot_values_kernels(threads: int, transport: Transport, pdl: bool, node_size: int = 0,
                             node_stores: bool = False) -> dict:
    """``{"slot_values_async": ..., "slot_values_wait": ...}`` for blocks of ``threads`` threads,
    the plan's transport (:func:`~ep_runtime.kernels.transport.make_transport`: ``transport``,
    and for the hierarchical one ``node_size`` and ``node_stores``) and PDL. They do not depend
    on the formats or layouts."""
    tp = make_transport(transport, threads, node_size, node_stores)
    send_slot_value, signal_slot_values = tp.send_slot_value, tp.signal_slot_values
    near = make_near(node_size)  # (slot_values_wait reads by the topology alone: one build for every transport)
    FENCED = tp.FENCED
    pdl_wait, pdl_trigger = make_pdl(pdl)

    @kernel_jit(threads)
    def slot_values_async(row_values, row_offsets, row_src_rank, row_src_token, row_src_k, slot_values, slot_signal,
                          dispatch_async_sync, status, peer_bases, slot_across, slot_stage, dispatch_counts):
        """Write each expert-batch row's value home; the last block signals every rank.

        values [V] float32: one value per expert-batch row (row-aligned with the batch, ``V >=
        row_offsets[L]``; a shorter array is refused with ``ERR_SHORT_ROWS`` and nothing is sent, so the ranks
        waiting for this one time out naming it). row_offsets [L + 1], row_src_rank / row_src_token /
        row_src_k [C] int32: the batch dispatch_wait of call n placed. slot_values [G, T, K] float32,
        slot_signal [G, R] uint64: symmetric. dispatch_async_sync: this rank's dispatch_async_sync (the call
        number, the launch's ticket). status: the error record. peer_bases [P, R] uint64: row PEER_SLOTS,
        ``slot_values`` on every rank (stores). The hierarchical transport: slot_across [G, R, Tmax, K]
        float32 (``[g, r]``: rank r's values when r is on another node) and slot_stage [R, Tmax, K] float32,
        symmetric; dispatch_counts [G, R, L + 1] int32 (each source's T); empty stand-ins otherwise.
        """
        flag = cuda.shared.array(1, int32)
        pdl_wait()  # the caller's values and the batch are complete
        pdl_trigger()
        n = dispatch_async_sync[SYNC_CALLS] - 1
        g = n % N_GROUPS
        if status[STATUS_CODE] != 0:
            return
        me = shmem.my_pe()
        L = row_offsets.shape[0] - 1
        rows = row_offsets[L]
        if rows > row_values.shape[0]:  # every block sees it: none takes the ticket, nothing is signalled
            if cuda.blockIdx.x == 0 and cuda.threadIdx.x == 0:
                record_error(status, ERR_SHORT_ROWS, KERNEL_SLOT_VALUES_ASYNC, me, -1, 0, row_values.shape[0], rows,
                             n + 1)
            return
        for i in range(cuda.blockIdx.x * threads + cuda.threadIdx.x, rows, cuda.gridDim.x * threads):
            k = row_src_k[i]
            if k >= 0:
                send_slot_value(slot_values, slot_stage, row_values, i, peer_bases, g, me, row_src_rank[i],
                                row_src_token[i], k)
        # values before signal: the ticket's fence or quiet (the hierarchical transport's staged
        # values too, which the last block's puts read)
        if last_block_ticket(dispatch_async_sync[SYNC_SLOT_TICKET:SYNC_SLOT_TICKET + 1], flag, FENCED):
            signal_slot_values(slot_signal, slot_across, slot_stage, dispatch_counts, g, me, n)
            if cuda.threadIdx.x == 0:
                dispatch_async_sync[SYNC_SLOT_TICKET] = 0

    @kernel_jit(threads)
    def slot_values_wait(slot_out, slot_values, slot_signal, dispatch_topk_ids, dispatch_counts, dispatch_async_sync,
                         status, timeout_ns, slot_across):
        """Wait for every rank's slot values of call n, then ``out[t, k]`` (float32 [T_out, K]) =
        ``slot_values[g, t, k]`` where slot k of token t was routed (``dispatch_topk_ids[g, me, t, k]`` in
        ``[0, E)`` and no earlier slot's) and ``t < T`` (``dispatch_counts[g, me, L]``), else 0.0; the
        hierarchical transport reads a slot held on another node from ``slot_across[g, holder, t, k]``. After
        a timeout (recorded) or an earlier error, ``out`` is not (or not wholly) written: ``synchronize``
        raises it.
        """
        stop = cuda.shared.array(1, int32)
        pdl_wait()
        pdl_trigger()
        n = dispatch_async_sync[SYNC_CALLS] - 1
        g = n % N_GROUPS
        tid = cuda.threadIdx.x
        me = shmem.my_pe()
        if tid == 0:
            stop[0] = int32(status[STATUS_CODE] != 0)
        cuda.syncthreads()
        if stop[0] != 0:
            return
        want = uint64(n + 1)
        for r in range(tid, slot_signal.shape[1], threads):
            seen = shmem.wait_signal_ge(slot_signal[g, r:r + 1], want, timeout_ns)
            if seen < want:
                record_error(status, ERR_TIMEOUT, KERNEL_SLOT_VALUES_WAIT, me, r, COUNTER_SLOT_SIGNAL, n + 1,
                             int64(seen), n + 1)
                stop[0] = 1
        cuda.syncthreads()  # with the acquire polls: what the signals published is visible to the block
        if stop[0] != 0:
            return
        R = dispatch_counts.shape[1]
        L = dispatch_counts.shape[2] - 1
        E = R * L
        K = slot_out.shape[1]
        T = dispatch_counts[g, me, L]
        for j in range(cuda.blockIdx.x * threads + tid, slot_out.shape[0] * K, cuda.gridDim.x * threads):
            t = j // K
            k = j - t * K
            v = float32(0.0)
            x = dispatch_topk_ids[g, me, t, k]
            if t < T and uint32(x) < uint32(E):  # a masked (-1) or dropped slot has none
                routed = True  # ... nor a repeat (a plain route-first sender sends them; receivers mask their own)
                for k2 in range(k):
                    if dispatch_topk_ids[g, me, t, k2] == x:
                        routed = False
                if routed:
                    if near(me, x // L):
                        v = slot_values[g, t, k]
                    else:
                        v = slot_across[g, x // L, t, k]
            slot_out[t, k] = v

    return {"slot_values_async": programmatic(slot_values_async, pdl),
            "slot_values_wait": programmatic(slot_values_wait, pdl)}
