"""Which PEs of a session share a node: the node map, and the logical nodes of a testing topology.

A node is a set of PEs whose GPUs reach each other's symmetric heaps through load/store mappings
(NVLink): the kernels may store into peers of their node, and reach peers of other nodes only
through NVSHMEM puts (a runtime over several nodes puts to every peer for now: the plan's
transport rule). A session's node map (``Session.node_of``) gives each PE's node index: nodes are
numbered in the order of their first PE.

The real map comes from the PEs' host names. A testing topology (``Session.use_logical_nodes``)
splits it further into ``n`` logical nodes of consecutive PEs, each inside one real node, so that
a single host of 4 GPUs runs the inter-node paths as 2 x 2: peers in another logical node are
not mapped (``peer_addresses`` is None, ``peer_view`` refuses them) and are reached by puts only.
"""

from __future__ import annotations

from ep_runtime.core.errors import EPInputError


def nodes_of_hosts(hosts: list[str]) -> tuple[int, ...]:
    """The node index of every PE given its host name (``hosts[pe]``): nodes numbered in the order
    of their first PE."""
    first: dict[str, int] = {}
    return tuple(first.setdefault(host, len(first)) for host in hosts)


def logical_nodes(real: tuple[int, ...], n_nodes: int) -> tuple[int, ...]:
    """The node map of ``n_nodes`` logical nodes of consecutive PEs (PE p in node
    ``p // (R / n_nodes)``), checked against the real map ``real``: ``n_nodes`` must divide the PEs,
    and a logical node may not span real nodes (its PEs would not reach each other by stores).
    Raises EPInputError naming the argument."""
    R = len(real)
    if not isinstance(n_nodes, int) or isinstance(n_nodes, bool) or n_nodes < 1 or R % n_nodes:
        raise EPInputError(f"use_logical_nodes: n_nodes={n_nodes!r}; expected a positive int dividing the session's "
                           f"{R} PEs (each logical node takes {R} / n_nodes consecutive PEs).")
    per = R // n_nodes
    out = tuple(pe // per for pe in range(R))
    for node in range(n_nodes):
        spanned = sorted({real[pe] for pe in range(node * per, (node + 1) * per)})
        if len(spanned) > 1:
            raise EPInputError(f"use_logical_nodes: n_nodes={n_nodes} puts PEs {node * per}..{(node + 1) * per - 1} "
                               f"in logical node {node}, but they are on real nodes {spanned}; a logical node must "
                               f"lie inside one real node: use a multiple of the real node count "
                               f"({len(set(real))}).")
    return out
