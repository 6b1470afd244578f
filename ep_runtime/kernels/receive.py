"""The receive kernels' bookkeeping: the call number, the signals awaited, the counts kept.

dispatch_wait and dispatch_land (whichever a plan's receiver uses) start before the sender has
finished, some of their blocks early through PDL, so they read nothing the sender writes for
their call number. They count their own calls in ``receive_sync`` (int64 [RECV_LEN], local):
``[RECV_CALLS]`` is the calls received so far, advanced by the last block of each receive launch
to read it (``[RECV_TICKET]`` counts the blocks). Block 0 also zeroes what this call's
combine_wait claims (``combine_wait_claims[g]``, its last user the combine_wait of call n - 2)
and what the next call's dispatch_land claims (``receive_sync[RECV_CLAIMS + 1 - g]``, last used
by call n - 1), both complete before this kernel started.

:func:`make_receive` builds the device functions for a block size.
"""

import functools
from types import SimpleNamespace

from ep_runtime.kernels import shmem
from ep_runtime.kernels.block import record_error
from ep_runtime.kernels.cuda_api import cuda, int32, int64, uint64
from ep_runtime.kernels.protocol import ERR_TIMEOUT, RECV_CALLS, RECV_CLAIMS, RECV_TICKET, SIGNAL_TOKEN_BITS


@functools.lru_cache(maxsize=None)
def make_receive(threads: int) -> SimpleNamespace:
    """``begin_receive``, ``await_sources`` and ``store_recv_tokens`` for blocks of ``threads``
    threads."""

    @cuda.jit(device=True)
    def begin_receive(receive_sync, combine_claims, ticket):
        """Every thread of every block of a receive kernel, before anything else: this call's
        number n (returned), read by every thread before the last block to read it advances
        ``receive_sync[RECV_CALLS]`` to n + 1; block 0 zeroes the claims of this call's
        combine_wait and of the next call's dispatch_land. ``ticket`` (shared int32 [1]) holds
        the block's ticket afterwards (0: the first block to get here)."""
        n = receive_sync[RECV_CALLS]
        cuda.syncthreads()  # every thread has read n before thread 0 may advance it
        if cuda.threadIdx.x == 0:
            ticket[0] = cuda.atomic.add(receive_sync, RECV_TICKET, int64(1))
            if ticket[0] == cuda.gridDim.x - 1:
                receive_sync[RECV_TICKET] = 0
                receive_sync[RECV_CALLS] = n + 1
            if cuda.blockIdx.x == 0:
                g = n % 2
                combine_claims[g] = 0
                receive_sync[RECV_CLAIMS + 1 - g] = 0
        cuda.syncthreads()  # the ticket seen by every thread
        return n

    @cuda.jit(device=True)
    def await_sources(d_sig, g, n, timeout_ns, status, kernel, counter, src_T, flag):
        """Every thread of the block: thread s waits until source s's signal of call n is in
        (``d_sig[g, s] >= (n + 1) << 32``; its low half, the source's token count, goes to
        ``src_T[s]``, shared int32), bounded by ``timeout_ns``; a timeout is recorded naming
        ``kernel``, the source and ``counter``. The waits poll with acquire loads
        (``shmem.wait_signal_ge``) and the block then meets, so what the signals published is
        visible to every thread. Returns whether every signal was seen."""
        me = shmem.my_pe()
        if cuda.threadIdx.x == 0:
            flag[0] = 0
        cuda.syncthreads()
        want = uint64(n + 1) << uint64(SIGNAL_TOKEN_BITS)  # call n's signal, any token count
        for s in range(cuda.threadIdx.x, d_sig.shape[1], threads):
            seen = shmem.wait_signal_ge(d_sig[g, s:s + 1], want, timeout_ns)
            if seen < want:
                record_error(status, ERR_TIMEOUT, kernel, me, s, counter, n + 1,
                             int64(seen >> uint64(SIGNAL_TOKEN_BITS)), n + 1)
                flag[0] = 1
            src_T[s] = int32(seen & uint64(0xFFFFFFFF))  # stale on a timeout: unused
        cuda.syncthreads()
        ok = flag[0] == 0
        cuda.syncthreads()  # flag read by every thread before it is used again
        return ok

    @cuda.jit(device=True)
    def store_recv_tokens(recv_tokens, src_T):
        """Every thread of a block: ``recv_tokens[s] = src_T[s]``, the tokens each source sent
        this call (from its signal), for the caller's compact batch. Blocks that store it store
        the same values."""
        for s in range(cuda.threadIdx.x, recv_tokens.shape[0], threads):
            recv_tokens[s] = src_T[s]

    return SimpleNamespace(begin_receive=begin_receive, await_sources=await_sources,
                           store_recv_tokens=store_recv_tokens)
