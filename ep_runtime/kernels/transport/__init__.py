"""Transports: how this PE's writes reach its peers, one module each, one device interface.

A kernel never branches on the transport: its factory asks :func:`make_transport` for the
plan's transport and calls the device functions of the namespace it returns (bound to local
names first: device code reads no attribute of a Python object). Every module builds the same
names; ``docs/protocol.md`` has the protocol they implement.

Constants (closure constants of the kernels that read them)
    ``FENCED``: every write of the transport is a plain store, so a launch that wrote nothing
    else publishes with a system fence (``block.publish_fence``), not a quiet.
    ``NEAR_FENCED``: the same for its writes to near PEs (the routing a route ticket publishes).
    ``DIRECT``: token rows can be stored straight into the peers' receive slots (an FP8 encoder
    then writes every destination's message itself); otherwise they are staged and put.
    ``LISTED``: a token's destinations are a list (the build has ``dest_slots`` > 0), else a
    uint64 mask (what ``send_part``'s ``dests`` and the codecs' destinations are).
    ``warp``: the warp width the functions were built for.

Peers and credits
    ``near(me, d)`` (any thread): PE ``me`` writes ``d``'s routing rows, ranks, counts and slot
    values itself (every PE, or the PEs of its node under the hierarchical transport).
    ``row_dests(holders, me)``: of the PEs holding a token's experts (uint64 bits), those this PE
    sends the row to itself. ``no_dests(dests)``: a token's destination set is empty.
    ``grant_credits(credit, call)`` / ``await_credits(credit, n, status, timeout_ns)`` (one thread):
    the token rows' credits (:mod:`.common`).

Token rows (every lane of a warp)
    ``send_part(rows, me, t, src, w0, w1, dests, R, peer_bases, pairs, lane, lo, hi)``: words
    ``[w0, w1)`` of ``src`` into row ``[me, t]`` of ``rows`` on every PE below ``R`` set in
    ``dests`` (a build with destination lists, ``dest_slots`` > 0: every PE of the list ``dests``,
    ep_runtime/kernels/destinations.py). ``send_part_flagged(rows, flags, me, t, p, n, ...)``: then ``flags[me, t, p] =
    n + 1`` there, after the data. ``make_row_chunks(pack_row, holders)``: the token blocks'
    ``send_across`` of the rows bound for other nodes (nothing without nodes).

Routing rows, ranks, counts, the signal (every thread of a block unless said)
    ``spread_range(T, K, blocks)``: ``(j0, j1, step, t0, t1)``, this thread's routing elements
    ``range(j0, j1, step)`` and the tokens ``[t0, t1)`` its block flushes. ``row_at(rows, g,
    me)``: the byte offset of this PE's routing row. ``spread_slot(ids, weights, peer_bases,
    ids_at, weights_at, g, me, t, k, j, x, w)`` (one thread): slot ``(t, k)``'s id and weight
    into every near PE. ``spread_flush(ids, weights, g, me, t0, t1)``: the block's spread
    delivered. ``count_u32(counts, staged, peer_bases, g, me, d, e, value)`` (one thread): this
    PE's count ``e`` on PE ``d`` (stored there, or staged to go with the signal or the relay).
    ``send_ranks(ranks, staged, peer_bases, g, me, c0, c1, run_l)``: a routing block's staged
    ranks to the near PEs. ``counts_before_route(counts, staged, g, me)``: the staged counts
    rows out before a route signal. ``signal_call(...)``: dispatch_async's last block signals
    the call (with the counts rows where they were staged; the proxies' routing and relay
    signals across nodes).

Combine partials (every lane of a warp)
    Where they take ``g, me, s, t``, ``me`` names this PE's row of ``s``'s ``combine_partials[g]``
    and ``combine_row_flag``: its index, or in a build with partials by destination slot
    (``CombineVariant.partial_slots``, the stores and puts transports) its slot there, or by
    sender (the hierarchical transport's list builds) its local index (``partials.make_home_row``;
    the partial functions then ask ``my_pe`` which PE they run on). ``stores_to(me, s)`` / ``stages(me, s)`` take this PE's index.
    ``stores_to(me, s)`` / ``stages(me, s)``: this PE's partial for PE ``s`` is stored into
    ``s`` through its mapping / written to a local stage row and put. ``home_at(...)``: the
    address it is stored to. ``stage_aligned(stage)``, ``home_aligned(relay_partials)``:
    whether those rows take 16-byte accesses. ``finish_part(...)``: a written part flagged
    where it went, or put from its stage with its flag. ``send_home_part(...)``: a caller's
    partial row part home (compact layout). ``send_slot_part(...)``: the same arguments with
    the top-k slot ``k`` in place of this PE's index: an unweighted row part into ``[g, k, t]``
    of its home, flagged ``[k, t, p]`` (``combine_weights="home"``; the stores and puts
    transports only).

Slot values
    ``send_slot_value(...)`` (one thread), ``signal_slot_values(...)`` (the last block).

The hierarchical proxies' forwarding within their node
    ``forward_run(...)`` (a block), ``forward_row(...)`` (a warp).

The modules: :mod:`.stores` (plain stores through the peers' NVLink mappings), :mod:`.puts`
(NVSHMEM puts, to any PE NVSHMEM reaches) and :mod:`.hierarchical` (nodes: one of the two
within a node, packed chunks to a proxy across nodes).
"""

from __future__ import annotations

import functools

from ep_runtime.kernels.variant import Transport


@functools.lru_cache(maxsize=None)
def make_transport(kind: Transport, threads: int, node_size: int = 0, node_stores: bool = False,
                   dest_slots: int = 0):
    """The device interface of transport ``kind`` for blocks of ``threads`` threads (and, for the
    hierarchical transport, ``node_size`` PEs a node, stores within a node when
    ``node_stores``), a token's destinations a mask (``dest_slots`` 0) or a list of at most
    ``dest_slots`` ranks: a namespace of the names above."""
    if kind is Transport.STORES:
        from ep_runtime.kernels.transport import stores

        return stores.make(threads, 0, dest_slots)
    if kind is Transport.PUTS:
        from ep_runtime.kernels.transport import puts

        return puts.make(threads, 0, dest_slots)
    from ep_runtime.kernels.transport import hierarchical

    return hierarchical.make(threads, node_size, node_stores, dest_slots)


__all__ = ["make_transport"]
