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

from numba import uint32, uint64

from ep_runtime.kernels.cuda_api import cuda
from ep_runtime.kernels.protocol import relay_chunk_tokens

#: The most nodes a runtime may span (a block keeps a mask per node in shared memory).
MAX_NODES = 64


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


@cuda.jit(device=True)
def other_index(node, mine):
    """The index of ``node`` among the nodes other than ``mine`` (ascending): where a PE of node
    ``mine`` keeps what it exchanges with ``node`` (``relay_stage``, ``relay_rows``,
    ``relay_sums``, ``relay_slot``)."""
    return node if node < mine else node - 1


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
