"""What every transport shares: the token-row credits, the copy depth, where rows go.

Credits (docs/protocol.md, "Token rows: one buffer, credits"): a PE's token rows of call ``n``
may be written into PE ``d`` once ``d`` granted call ``n`` (``dispatch_token_credit[d] >= n +
1`` on the writer). Under the hierarchical transport only the PEs that write into each other
exchange credits (``nodes.reaches``).
"""

import functools
from types import SimpleNamespace

from ep_runtime.kernels import shmem
from ep_runtime.kernels.block import record_error
from ep_runtime.kernels.destinations import no_listed
from ep_runtime.kernels.cuda_api import cuda, inlined, int64, uint64
from ep_runtime.kernels.nodes import node_bits, reaches
from ep_runtime.kernels.protocol import COUNTER_TOKEN_CREDIT, ERR_TIMEOUT, KERNEL_DISPATCH_ASYNC

#: Word pairs per lane in flight when a row (part) is copied into the peers.
PAIRS_IN_FLIGHT = 4
#: Staged ranks each thread of a routing block loads before it stores any to the ranks'
#: destinations (independent loads; the stores through raw addresses would otherwise wait for
#: each load in turn).
RUN_BATCH = 8


@functools.lru_cache(maxsize=None)
def make_credits(node_size: int) -> SimpleNamespace:
    """``grant_credits`` and ``await_credits`` for PEs that write into every PE (``node_size``
    0) or, under the hierarchical transport, into their node and their proxies."""

    @cuda.jit(device=True)
    def grant_credits(credit, call):
        """One thread: this PE has read the token rows of every call before ``call`` (stream
        order), so each PE that writes here may write its rows of ``call``: ``credit[me]`` set to
        ``call + 1`` on it (uint64 symmetric [R]; SIGNAL_SET of a value that never decreases
        between resets, so two grants of one call, or grants out of order, are harmless).
        dispatch_async grants its own call, combine_async the next, so in the dispatch ->
        combine cycle every grant is there when a peer's next dispatch_async looks."""
        me = shmem.my_pe()
        for d in range(credit.shape[0]):
            if d != me and reaches(me, d, node_size):
                shmem.signal_op(credit[me:me + 1], uint64(call + 1), shmem.SIGNAL_SET, d)

    @cuda.jit(device=True)
    def await_credits(credit, n, status, timeout_ns):
        """One thread: wait until every PE this one writes to granted call ``n`` its token rows
        (``credit[d] >= n + 1``), bounded by ``timeout_ns``; a timeout is recorded naming
        ``dispatch_async``, the peer and ``dispatch_token_credit``. Returns whether every credit
        was seen. This PE's own rows need none (its stream orders its reads first)."""
        me = shmem.my_pe()
        ok = True
        for d in range(credit.shape[0]):
            if d != me and reaches(me, d, node_size):
                seen = shmem.wait_signal_ge(credit[d:d + 1], uint64(n + 1), timeout_ns)
                if seen < uint64(n + 1):
                    record_error(status, ERR_TIMEOUT, KERNEL_DISPATCH_ASYNC, me, d, COUNTER_TOKEN_CREDIT, n + 1,
                                 int64(seen), n + 1)
                    ok = False
        return ok

    return SimpleNamespace(grant_credits=grant_credits, await_credits=await_credits)


@functools.lru_cache(maxsize=None)
def make_row_dests(node_size: int):
    """``row_dests(holders, me)`` of a transport that writes into every PE (``node_size`` 0) or
    into this PE's node only."""
    NODE = node_size

    @cuda.jit(device=True)
    def row_dests(holders, me):
        """The PEs a token's row goes to from here: its ``holders`` (uint64 bits) on this
        transport's PEs."""
        if NODE > 0:
            return holders & node_bits(me // NODE, NODE)
        return holders

    return row_dests


@inlined
def no_mask_dests(dests):
    """Whether the destination mask ``dests`` (uint64) is empty."""
    return dests == 0


@cuda.jit(device=True)
def home_aligned(relay_partials):
    """Whether the rows partials go to beyond ``combine_partials`` are 16-byte aligned: none (a
    transport without nodes sends partials into ``combine_partials`` only)."""
    return True


@cuda.jit(device=True)
def _no_rows_across(tokens, token_scales, token_global_scale_u8, prequantized, ids_base, relay_stage, relay_rows,
                    relay_chunk_flag, relay_slot, peer_bases, T, K, L, R, me, n, token_blocks, cmask, mbuf, held, ids_l,
                    lo, hi):
    """Nothing: every PE is reached directly (no node to cross to)."""


def no_dests_of(dest_slots: int):
    """``no_dests(dests)`` for destinations kept as a mask (``dest_slots`` 0) or a list."""
    return no_listed if dest_slots else no_mask_dests


def no_row_chunks(pack_row, holders):
    """``make_row_chunks`` of a transport without nodes: its ``send_across`` does nothing."""
    return _no_rows_across
