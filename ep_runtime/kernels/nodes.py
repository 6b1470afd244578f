"""Who a PE sends to under the hierarchical transport: device helpers.

Nodes are ``node_size`` consecutive PEs (``ep_runtime.core.plan`` checks the node map); PE ``p`` is
on node ``p // node_size`` with local index ``p % node_size``. A PE sends to the peers of its
own node, and to one PE of each other node, its *proxy* there: the PE with its own local index.
A token bound for experts on another node goes once to that node's proxy, which forwards it to
its node's peers (ep_runtime/kernels/relay.py); a partial bound home goes to the proxy of the home rank's
local index on the sender's node, which sums its node's partials and sends one. ``node_size``
0 means one transport for every peer (every helper is then the flat rule).

Across nodes rows and sums travel in chunks of ``chunk_tokens(T)`` consecutive tokens of a
source's batch of T: a chunk's tokens bound for a node (an expert there) are packed in token
order (``chunk_mask`` ranks them) and cross in one put.
"""

import functools

from ep_runtime.kernels.block import await_flag, await_part
from ep_runtime.kernels.cuda_api import cuda, uint32, uint64
from ep_runtime.kernels.destinations import insert_rank
from ep_runtime.kernels.protocol import (COUNTER_COMBINE_CHUNK, COUNTER_COMBINE_ROW_FLAG, KERNEL_COMBINE_WAIT,
                                         relay_chunk_tokens, relay_stage_rows)

#: The nodes a block keeps a mask or count for in shared memory, at least: every build of 64
#: ranks or fewer keeps this many; wider ones one per node (:func:`node_slots`).
MAX_NODES = 64


def node_slots(rank_slots: int, node_size: int) -> int:
    """The shared words a block keeps per node for ``rank_slots`` ranks (``DispatchVariant``) in
    nodes of ``node_size`` PEs: ``max(rank_slots / node_size, MAX_NODES)``."""
    return max(rank_slots // node_size, MAX_NODES)


@cuda.jit(device=True)
def reaches(me, d, node_size):
    """Whether PE ``me`` sends to PE ``d`` itself: always with ``node_size`` 0; else when
    ``d`` is on its node, or is its proxy on another node (the same local index)."""
    return node_size == 0 or d // node_size == me // node_size or d % node_size == me % node_size


@cuda.jit(device=True)
def on_node(me, d, node_size):
    """Whether PE ``d`` is on PE ``me``'s node (every PE is, with ``node_size`` 0): where a PE
    spreads its routing rows and ranks as its blocks make them (a proxy gets them in one put each
    with the relay signal)."""
    return node_size == 0 or d // node_size == me // node_size


@functools.lru_cache(maxsize=None)
def make_near(node_size: int):
    """``near(me, d)``: :func:`on_node` for nodes of ``node_size`` PEs (a closure constant), one
    function per node size, so every kernel that asks it of the same topology is the same build."""

    @cuda.jit(device=True)
    def near(me, d):
        return on_node(me, d, node_size)

    return near


@cuda.jit(device=True)
def node_bits(node, node_size):
    """The mask (uint64) of the PEs of ``node``."""
    return ((uint64(1) << uint64(node_size)) - uint64(1)) << uint64(node * node_size)


@cuda.jit(device=True)
def via_proxies(dests, me, node_size, R):
    """``dests`` (bit d: PE d is a destination, uint64) as PE ``me`` sends them: its own node's
    bits as they are, and for each other node with any bit set only the bit of its proxy there
    (the PE with ``me``'s local index). ``node_size`` 0: ``dests`` unchanged."""
    if node_size == 0:
        return dests
    mine = me // node_size
    out = dests & node_bits(mine, node_size)
    for node in range(R // node_size):
        if node != mine and dests & node_bits(node, node_size) != uint64(0):
            out |= uint64(1) << uint64(node * node_size + me % node_size)
    return out


@cuda.jit(device=True)
def via_proxies_listed(dl, me, node_size, out):
    """:func:`via_proxies` of destination lists (int32, count first, ascending:
    ep_runtime/kernels/destinations.py): ``out`` set to the ranks of ``dl`` on ``me``'s node and,
    for each other node with a rank in ``dl``, ``me``'s proxy there, ascending, and returned."""
    out[0] = 0
    mine = me // node_size
    for j in range(dl[0]):
        d = dl[1 + j]
        if d // node_size == mine:
            insert_rank(out, d)
        else:
            insert_rank(out, (d // node_size) * node_size + me % node_size)
    return out


@cuda.jit(device=True)
def holders_near(ids, L, R, first, node_size):
    """Bit ``q - first`` (uint64) set for every PE q of the node ``[first, first + node_size)``
    holding one of the experts ``ids`` ([K] int32; an id outside ``[0, R L)`` sets none): a
    node-relative mask, which any PE number fits (a node has at most 64 PEs)."""
    out = uint64(0)
    for k in range(ids.shape[0]):
        x = ids[k]
        if x >= 0 and x < R * L:
            q = x // L
            if q >= first and q < first + node_size:
                out |= uint64(1) << uint64(q - first)
    return out


@cuda.jit(device=True)
def holders(ids, L, R):
    """Bit d (uint64) set for every PE d holding one of a token's experts: ``ids`` [K] int32
    expert ids (routed: -1, or an id outside ``[0, R L)``, sets none), ``L`` experts a PE."""
    out = uint64(0)
    for k in range(ids.shape[0]):
        x = ids[k]
        if x >= 0 and x < R * L:
            out |= uint64(1) << uint64(x // L)
    return out


#: Tokens a chunk of a batch of T holds (``protocol.relay_chunk_tokens``, compiled: one rule for
#: the kernels and the host's traffic model).
chunk_tokens = cuda.jit(device=True)(relay_chunk_tokens)
#: Stage rows a token can take: one per other node it goes to (``protocol.relay_stage_rows``,
#: compiled: one rule for the stage's writer, the proxies and the layout).
stage_rows = cuda.jit(device=True)(relay_stage_rows)


@cuda.jit(device=True)
def other_index(node, mine):
    """The index of ``node`` among the nodes other than ``mine`` (ascending): where a PE of node
    ``mine`` keeps what it exchanges with ``node`` (``relay_rows``, the chunk flags,
    ``relay_sums``, ``relay_slot``)."""
    return node if node < mine else node - 1


@cuda.jit(device=True)
def sender_index(me, r, node_size):
    """The row of PE ``me``'s partials (``combine_partials[g]``, ``combine_row_flag``,
    ``combine_chunk_flag``) from its sender ``r``, where they are kept by sender
    (``CombineVariant.partial_slots`` of a hierarchical build): r's local index for r on
    ``me``'s node, else ``node_size + other_index(node(r), node(me))`` (r the proxy there)."""
    mine = me // node_size
    if r // node_size == mine:
        return r % node_size
    return node_size + other_index(r // node_size, mine)


@cuda.jit(device=True)
def nth_set_bit(mask, j):
    """The position of the ``j``-th (from 0) set bit of the 32-bit ``mask``, counting from bit 0
    (32 if it has no such bit): the token of a chunk's ``j``-th packed row."""
    seen = 0
    for b in range(32):
        if (mask >> uint32(b)) & uint32(1):
            if seen == j:
                return b
            seen += 1
    return 32


@functools.lru_cache(maxsize=None)
def make_partial_sources(node_size: int, by_sender: bool = False):
    """Where combine_wait finds each rank's partial of a token, for nodes of ``node_size`` PEs
    (0: every rank sends its own), its rows and flags a row a rank, or ``by_sender`` a row a
    sender (:func:`sender_index`): ``(senders, partial_row, await_partial)``.

    - ``senders(went, me, R)``: the ranks whose partials a token that went to the ranks set in
      ``went`` (uint64) gets (``via_proxies``: one per other node, its proxy's sum);
    - ``partial_row(relay_slot, g, t, r, me)``: the row of ``combine_partials[g, r]`` holding rank
      r's partial of token t: t, or for a proxy r on another node the packed row of t's chunk
      (``relay_slot[g, t, other_index(node(r), node(me))]``);
    - ``await_partial(row_flag, chunk_flag, me, r, t, p, n, T, timeout_ns, status)`` (one thread): wait
      for part p of that partial (``row_flag[r, t, p]``, or the proxy's whole chunk,
      ``chunk_flag[r, t // chunk_tokens(T)]``; ``by_sender``, the rows ``sender_index(me, r)``),
      recording a timeout naming combine_wait (and rank r)."""
    @cuda.jit(device=True)
    def across(me, r):
        return node_size > 0 and r // node_size != me // node_size

    @cuda.jit(device=True)
    def senders(went, me, R):
        return via_proxies(went, me, node_size, R)

    @cuda.jit(device=True)
    def partial_row(relay_slot, g, t, r, me):
        if across(me, r):
            return relay_slot[g, t, other_index(r // node_size, me // node_size)]
        return t

    @cuda.jit(device=True)
    def await_partial(row_flag, chunk_flag, me, r, t, p, n, T, timeout_ns, status):
        if across(me, r):
            c = t // chunk_tokens(T)
            return await_flag(chunk_flag[r, c:c + 1], r, t, n, timeout_ns, status, KERNEL_COMBINE_WAIT,
                              COUNTER_COMBINE_CHUNK)
        return await_part(row_flag, r, t, p, n, timeout_ns, status, KERNEL_COMBINE_WAIT, COUNTER_COMBINE_ROW_FLAG)

    @cuda.jit(device=True)
    def await_sender(row_flag, chunk_flag, me, r, t, p, n, T, timeout_ns, status):
        i = sender_index(me, r, node_size)
        if across(me, r):
            c = t // chunk_tokens(T)
            return await_flag(chunk_flag[i, c:c + 1], r, t, n, timeout_ns, status, KERNEL_COMBINE_WAIT,
                              COUNTER_COMBINE_CHUNK)
        return await_flag(row_flag[i, t, p:p + 1], r, t, n, timeout_ns, status, KERNEL_COMBINE_WAIT,
                          COUNTER_COMBINE_ROW_FLAG)

    return senders, partial_row, await_sender if by_sender else await_partial
