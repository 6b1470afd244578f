"""The dispatch kernels: ``dispatch_async`` (send) and ``dispatch_wait`` (receive and lay out).

Both are built by :func:`make_dispatch_kernels` for a block size (a compile-time constant:
shared-memory scans are sized by it). Symbols as in :mod:`ep_runtime.layout`; ``g = n % 2``
is the buffer group of call ``n`` and ``me`` this rank. See docs/protocol.md for the timeline.
"""

from numba import int32, int64, uint64

from ep_runtime.kernels import shmem
from ep_runtime.kernels.block import (block_exclusive_scan, block_sum, last_block_ticket, record_error,
                                      sched_advance, sched_initial)
from ep_runtime.kernels.cuda_api import cuda
from ep_runtime.layout import STATUS_CODE, SYNC_CALLS, SYNC_TICKET
from ep_runtime.status import (COUNTER_DISPATCH_SIGNAL, COUNTER_RECV_ROWS, ERR_CAPACITY, ERR_TIMEOUT,
                               KERNEL_DISPATCH_WAIT)


def make_dispatch_kernels(threads: int):
    """Build ``(dispatch_async, dispatch_wait)`` for blocks of ``threads`` threads (a power of 2)."""

    @cuda.jit
    def dispatch_async(tokens, topk_ids, topk_weights,
                       d_tokens, d_ids, d_weights, d_counts, d_signal,
                       sync, send_hist, send_counts, status):
        """Send this rank's tokens, once per destination rank, and signal each destination.

        tokens [T, H] uint16 (bf16 bits), topk_ids [T, K] int32, topk_weights [T, K] float32:
        this rank's batch. Symmetric: d_tokens [G, R, Tmax, H], d_ids/d_weights [G, R, Tmax, K],
        d_counts [G, R, L + 1] int32, d_signal [G, R] uint64. Local: sync [2] int64,
        send_hist [E] int32 (zero on entry), send_counts [R, L + 1] int32, status [8] int64.

        One block: (1) for each token item t it owns (static schedule), puts row t into slot
        [g, me, t] of every rank that holds one of its experts; (2) for each chunk of
        ``threads`` tokens it owns, puts the chunk's routing rows to every rank and counts
        tokens per expert into send_hist; (3) takes a ticket. The last block puts each rank its
        counts with a signal of n + 1 (data before signal), then resets the scratch and
        advances the call counter. Nobody waits: the kernel returns once sends are issued.
        """
        flag = cuda.shared.array(1, int32)
        if status[STATUS_CODE] != 0:
            return  # an earlier call failed: send nothing, so peers time out naming this rank
        me = shmem.my_pe()
        R = d_counts.shape[1]
        L = d_counts.shape[2] - 1
        K = topk_ids.shape[1]
        T = tokens.shape[0]
        tid = cuda.threadIdx.x
        n = sync[SYNC_CALLS]
        g = n % 2

        # (1) token rows, deduplicated per destination rank
        t = sched_initial(cuda.blockIdx.x)
        while t < T:
            for d in range(R):
                hit = False
                for k in range(K):
                    if topk_ids[t, k] // L == d:
                        hit = True
                if hit:
                    shmem.put_nbi_block(d_tokens[g, me, t], tokens[t], d)
            t = sched_advance(t, cuda.gridDim.x)

        # (2) routing rows to every rank, and the per-expert histogram
        chunk = sched_initial(cuda.blockIdx.x)
        while chunk * threads < T:
            t0 = chunk * threads
            t1 = min(t0 + threads, T)
            for d in range(R):
                shmem.put_nbi_block(d_ids[g, me, t0:t1], topk_ids[t0:t1], d)
                shmem.put_nbi_block(d_weights[g, me, t0:t1], topk_weights[t0:t1], d)
            t = t0 + tid
            if t < t1:
                for k in range(K):
                    cuda.atomic.add(send_hist, topk_ids[t, k], int32(1))
            chunk = sched_advance(chunk, cuda.gridDim.x)

        # (3) the last block publishes counts with the signal, then resets for the next call
        if last_block_ticket(sync[SYNC_TICKET:SYNC_TICKET + 1], flag):
            for i in range(tid, R * (L + 1), threads):
                d = i // (L + 1)
                j = i - d * (L + 1)
                send_counts[d, j] = T if j == L else send_hist[d * L + j]
            cuda.syncthreads()
            for d in range(tid, R, threads):
                shmem.put_signal(d_counts[g, me], send_counts[d], d_signal[g, me:me + 1],
                                 uint64(n + 1), shmem.SIGNAL_SET, d)
            for e in range(tid, send_hist.shape[0], threads):
                send_hist[e] = 0
            cuda.syncthreads()
            if tid == 0:
                sync[SYNC_TICKET] = 0
                sync[SYNC_CALLS] = n + 1

    @cuda.jit
    def dispatch_wait(d_tokens, d_ids, d_weights, d_counts, d_signal, sync,
                      expert_x, row_offsets, expert_counts, row_src_rank, row_src_token, row_src_k,
                      row_weight, token_rows, status, pad_multiple, timeout_ns):
        """Wait for every source rank, then write the expert-major batch.

        Symmetric inputs as in dispatch_async (group g of the last call). Outputs (local):
        expert_x [C, H] uint16, row_offsets [L + 1] int32, expert_counts [L] int32,
        row_src_rank / row_src_token / row_src_k [C] int32, row_weight [C] float32, and
        token_rows [R, Tmax, K] int32 (for combine_async). pad_multiple, timeout_ns: int64.

        One block: waits for all R signals itself (no block depends on another), computes
        every segment's offset from the received counts, and then, for each local expert it
        owns, walks each source's routing rows in token order, placing hits with a block
        scan (deterministic: rows by expert, source rank, source token) and copying them.
        A wait past timeout_ns or more rows than C records an error and writes nothing.
        """
        flag = cuda.shared.array(1, int32)
        scan_buf = cuda.shared.array(threads, int32)
        hit_tokens = cuda.shared.array(threads, int32)
        sum_buf = cuda.shared.array(threads, int64)
        if status[STATUS_CODE] != 0:
            return
        me = shmem.my_pe()
        R = d_counts.shape[1]
        L = d_counts.shape[2] - 1
        K = d_ids.shape[3]
        H = expert_x.shape[1]
        C = expert_x.shape[0]
        tid = cuda.threadIdx.x
        n = sync[SYNC_CALLS] - 1
        g = n % 2

        # wait for every source rank's signal (thread s waits for rank s)
        if tid == 0:
            flag[0] = 0
        cuda.syncthreads()
        for s in range(tid, R, threads):
            seen = shmem.wait_signal_ge(d_signal[g, s:s + 1], n + 1, timeout_ns)
            if seen < uint64(n + 1):
                record_error(status, ERR_TIMEOUT, KERNEL_DISPATCH_WAIT, me, s, COUNTER_DISPATCH_SIGNAL,
                             n + 1, int64(seen), n + 1)
                flag[0] = 1
        cuda.threadfence_system()
        cuda.syncthreads()
        if flag[0] != 0:
            return

        # total rows (padded): every block computes it, so none waits for another
        part = int64(0)
        for e in range(tid, L, threads):
            c = int64(0)
            for s in range(R):
                c += d_counts[g, s, e]
            part += (c + pad_multiple - 1) // pad_multiple * pad_multiple
        total = block_sum(sum_buf, part)
        if total > C:
            if cuda.blockIdx.x == 0 and tid == 0:
                record_error(status, ERR_CAPACITY, KERNEL_DISPATCH_WAIT, me, -1, COUNTER_RECV_ROWS,
                             C, total, n + 1)
            return
        if cuda.blockIdx.x == 0 and tid == 0:
            row_offsets[L] = total

        e = sched_initial(cuda.blockIdx.x)
        while e < L:
            # offset of segment e: padded sizes of the segments before it
            part = int64(0)
            for e2 in range(tid, e, threads):
                c = int64(0)
                for s in range(R):
                    c += d_counts[g, s, e2]
                part += (c + pad_multiple - 1) // pad_multiple * pad_multiple
            base = block_sum(sum_buf, part)
            e_global = me * L + e
            row = base
            for s in range(R):
                T_s = d_counts[g, s, L]
                for t0 in range(0, T_s, threads):
                    t = t0 + tid
                    k_hit = -1
                    j = 0  # rank of e among the token's local experts (ascending)
                    if t < T_s:
                        for k in range(K):
                            x = d_ids[g, s, t, k]
                            if x == e_global:
                                k_hit = k
                            elif x // L == me and x < e_global:
                                j += 1
                    prefix, count = block_exclusive_scan(scan_buf, 1 if k_hit >= 0 else 0)
                    if k_hit >= 0:
                        r = row + prefix
                        hit_tokens[prefix] = t
                        row_src_rank[r] = s
                        row_src_token[r] = t
                        row_src_k[r] = k_hit
                        row_weight[r] = d_weights[g, s, t, k_hit]
                        token_rows[s, t, j] = r
                    cuda.syncthreads()
                    for i in range(count):
                        src = hit_tokens[i]
                        for h in range(tid, H, threads):
                            expert_x[row + i, h] = d_tokens[g, s, src, h]
                    cuda.syncthreads()
                    row += count
            if tid == 0:
                row_offsets[e] = base
                expert_counts[e] = row - base
            # padding rows: zero, source -1
            end = base + (row - base + pad_multiple - 1) // pad_multiple * pad_multiple
            for r in range(row, end):
                if tid == 0:
                    row_src_rank[r] = -1
                    row_src_token[r] = -1
                    row_src_k[r] = -1
                    row_weight[r] = 0.0
                for h in range(tid, H, threads):
                    expert_x[r, h] = 0
            e = sched_advance(e, cuda.gridDim.x)

    return dispatch_async, dispatch_wait
