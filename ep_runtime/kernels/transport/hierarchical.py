"""The ``hierarchical`` transport: nodes of ``node_size`` consecutive PEs (:mod:`..nodes`).

Within its node a PE writes as the ``stores`` transport does (``node_stores``) or as ``puts``
does: this module is that transport, built for the node's PEs, plus what crosses nodes. Across
nodes a PE writes only to its proxies (the PE with its local index on each other node), in few
large puts: a token's row once per node in a packed chunk, its routing in one put per proxy and
call, the node's partials summed by the proxy (``dispatch_relay`` and ``combine_relay``,
kernels/relay.py, forward within the proxy's node). docs/cluster.md has the protocol and its
traffic.

:func:`make` takes the node's transport (``WITHIN``) and replaces what crosses nodes, a factory
per job: :func:`make_slots` (slot values), :func:`make_signal` (the call's signal and routing),
:func:`make_partials` (the combine partials to the proxies) and :func:`make_row_chunks` (the
token rows in packed chunks).
"""

import functools
from types import SimpleNamespace

from ep_runtime.kernels import shmem
from ep_runtime.kernels.cuda_api import cuda, inlined, shared_atomic, uint32, uint64
from ep_runtime.kernels.block import flag_one, flag_part, flag_stored, popc32, publish_fence, warp_geometry, warp_sync
from ep_runtime.kernels.nodes import chunk_tokens, node_bits, other_index, reaches, stage_rows
from ep_runtime.kernels.protocol import PEER_RELAY_PARTIALS
from ep_runtime.kernels.transport import puts, stores
from ep_runtime.kernels.vec import address_of, pairs_aligned


#: The names of the interface the hierarchical transport takes unchanged from its node's transport
#: (``stores`` or ``puts`` built for the node's PEs): the constants, the credits and what is written
#: only within the node.
WITHIN = ("warp", "NEAR_FENCED", "DIRECT", "LISTED", "near", "row_dests", "no_dests",
          "send_part", "send_part_flagged", "spread_range",
          "row_at", "spread_slot", "spread_flush", "count_u32", "send_ranks", "counts_before_route", "forward_run",
          "forward_row", "grant_credits", "await_credits", "stores_to", "stages", "stage_aligned")


@functools.lru_cache(maxsize=None)
def make(threads: int, node_size: int, node_stores: bool, dest_slots: int = 0) -> SimpleNamespace:
    """The hierarchical transport for blocks of ``threads`` threads and nodes of ``node_size``
    PEs, storing within a node when ``node_stores`` (else putting), a token's destinations a
    mask (``dest_slots`` 0) or a list (ep_runtime/kernels/destinations.py): the package's device
    interface, one namespace, the node's transport (``WITHIN``) with what crosses nodes."""
    NODE = node_size
    within = (stores if node_stores else puts).make(threads, node_size, dest_slots)

    @cuda.jit(device=True)
    def reaches_pe(me, d):
        """Whether PE ``me`` writes into PE ``d`` (its node's PEs and its proxies)."""
        return reaches(me, d, NODE)

    return SimpleNamespace(FENCED=False, reaches=reaches_pe,
                           make_row_chunks=functools.partial(make_row_chunks, threads, node_size, dest_slots),
                           **{name: getattr(within, name) for name in WITHIN}, **vars(make_slots(within)),
                           **vars(make_signal(threads, node_size, within.signal_pe)),
                           **vars(make_partials(node_size, node_stores, within, dest_slots)))


def make_slots(within) -> SimpleNamespace:
    """The combine slot values: to the PEs of this node as the node's transport (``within``)
    writes them, staged for the PEs of other nodes and put with the signal:
    ``send_slot_value``, ``signal_slot_values``."""
    near = within.near
    slot_value_near, signal_slot_values_near = within.send_slot_value, within.signal_slot_values

    @inlined
    def send_slot_value(slot_values, slot_stage, values, i, peer_bases, g, me, s, t, k):
        """One thread: slot ``k`` of token ``t`` of PE ``s`` written as the node's transport
        writes it, or, for ``s`` on another node, staged in ``slot_stage[s, t, k]`` (the last
        block puts ``s`` its block of them: ``signal_slot_values``)."""
        if not near(me, s):
            slot_stage[s, t, k] = values[i]
        else:
            slot_value_near(slot_values, slot_stage, values, i, peer_bases, g, me, s, t, k)

    @inlined
    def signal_slot_values(slot_signal, slot_across, slot_stage, counts, g, me, n):
        """Every thread of the last block, after its quiet: the node's PEs signalled, then each PE
        ``d`` of another node gets this PE's staged values for its tokens, ``slot_stage[d,
        :T_d]`` into ``slot_across[g, me]`` there, in one block put with the signal."""
        signal_slot_values_near(slot_signal, slot_across, slot_stage, counts, g, me, n)
        L = counts.shape[2] - 1
        for d in range(slot_signal.shape[1]):
            if not near(me, d):
                Ts = counts[g, d, L]
                shmem.put_signal_block(slot_across[g, me, 0:Ts], slot_stage[d, 0:Ts], slot_signal[g, me:me + 1],
                                       uint64(n + 1), shmem.SIGNAL_SET, d)

    return SimpleNamespace(send_slot_value=send_slot_value, signal_slot_values=signal_slot_values)


def make_signal(threads: int, node_size: int, signal_near) -> SimpleNamespace:
    """dispatch_async's signal of a call (blocks of ``threads`` threads, nodes of ``node_size``
    PEs): within the node as the node's transport gives it (``signal_near``: its ``signal_pe``);
    across nodes the routing in one put per proxy and call, the counts rows with the relay
    signal (the proxies forward them: dispatch_relay): ``signal_call``. (A token's row crosses
    once per node in a packed chunk: :func:`make_row_chunks`.)"""
    NODE = node_size

    @cuda.jit(device=True)
    def signal_call(signal_, counts, staged, relay_counts, relay_signal, ids, weights, ranks, g, me, T, value, route,
                    ranked):
        """Every thread of dispatch_async's last block, after its quiet: when the call sent its
        routing, each proxy first gets this PE's routing rows (ids, weights and, ``ranked``, the
        ranks) in a put each, quieted; then each proxy gets this PE's counts rows for its node's PEs
        in ``relay_counts[g, x]`` (x: this node among the proxy's other nodes) with the relay signal
        ``value`` (the signal alone on a kept routing's call), and each PE of this node the dispatch
        signal as the node's transport gives it."""
        tid = cuda.threadIdx.x
        R = counts.shape[1]
        if route and T > 0:
            for node in range(R // NODE):
                if node != me // NODE:
                    d = node * NODE + me % NODE
                    shmem.put_nbi_block(ids[g, me, 0:T], ids[g, me, 0:T], d)
                    shmem.put_nbi_block(weights[g, me, 0:T], weights[g, me, 0:T], d)
                    if ranked:
                        shmem.put_nbi_block(ranks[g, me, 0:T], ranks[g, me, 0:T], d)
            cuda.syncthreads()
            if tid == 0:
                publish_fence(False)  # quiet: they are delivered before the signals below
            cuda.syncthreads()
        for d in range(tid, R, threads):
            if d // NODE != me // NODE:  # a proxy: its node's counts rows, its relay signal
                if reaches(me, d, NODE) and route:
                    n0 = (d // NODE) * NODE
                    x = other_index(me // NODE, d // NODE)  # this node among the proxy's other nodes
                    shmem.put_signal(relay_counts[g, x, 0:NODE], staged[n0:n0 + NODE], relay_signal[g, me:me + 1],
                                     value, shmem.SIGNAL_SET, d)
                elif reaches(me, d, NODE):  # a kept routing's call: the counts rows are the receivers' own
                    shmem.signal_op(relay_signal[g, me:me + 1], value, shmem.SIGNAL_SET, d)
            else:
                signal_near(signal_, counts, staged, g, me, d, value, route)

    return SimpleNamespace(signal_call=signal_call)


def make_partials(node_size: int, node_stores: bool, within, dest_slots: int = 0) -> SimpleNamespace:
    """The combine partials: a partial for a home on another node goes to the home's proxy on this
    node (the PE with the home's local index), into its relay_partials row ``x node_size +
    local(me)`` (x: the index of the home's node among the other nodes), flagged in relay_flag; the
    proxy sums its node's partials (combine_relay). Stored (``node_stores``:
    :func:`make_stored_partials`) or put
    (:func:`make_put_partials`) as the node's transport (``within``) writes: ``home_aligned``,
    ``home_at``, ``finish_part``, ``send_home_part``. A build with destination lists
    (``dest_slots`` > 0) keeps a home's partials by sender (``CombineVariant.partial_slots``):
    where these functions take ``me`` it is this PE's row there, its local index
    (``partials.make_home_row``), and which PE this is they ask ``my_pe``."""
    NODE = node_size

    @cuda.jit(device=True)
    def far(me, s):
        return s // NODE != me // NODE

    @cuda.jit(device=True)
    def proxy_row(me, s):
        """``(row, proxy)``: where this PE's partial for PE ``s`` of another node goes: its row of
        the proxy's ``relay_partials`` (``x N + j``: x the index of s's node among the other nodes,
        j this PE's local index) and the proxy."""
        return other_index(s // NODE, me // NODE) * NODE + me % NODE, (me // NODE) * NODE + s % NODE

    @cuda.jit(device=True)
    def far_of_row(row, s):
        """:func:`far` where the caller names this PE by its row of the home's partials
        (``row``: its local index, partials by sender): this PE asked of ``my_pe``."""
        return far(shmem.my_pe(), s)

    @cuda.jit(device=True)
    def proxy_row_of_row(row, s):
        """:func:`proxy_row` where the caller names this PE by its row of the home's partials."""
        return proxy_row(shmem.my_pe(), s)

    @cuda.jit(device=True)
    def home_aligned(relay_partials):
        """Whether the proxies' ``relay_partials`` rows are 16-byte aligned."""
        return pairs_aligned(relay_partials)

    make_across = make_stored_partials if node_stores else make_put_partials
    if dest_slots:  # partials by sender: ``me`` in the partial functions is this PE's local index
        across = make_across(within, far_of_row, proxy_row_of_row, dest_slots)
    else:
        across = make_across(within, far, proxy_row, dest_slots)
    return SimpleNamespace(home_aligned=home_aligned, **vars(across))


def make_stored_partials(within, far, proxy_row, dest_slots: int = 0) -> SimpleNamespace:
    """``home_at``, ``finish_part``, ``send_home_part`` of partials stored through the mappings
    (``within``: the stores transport of the node's PEs; ``far(me, s)``: whether ``s`` is on
    another node; ``proxy_row(me, s)``: its ``(row, proxy)``; a build with destination lists,
    ``dest_slots`` > 0, flags the proxy without a mask)."""
    near_home_at = within.home_at
    near_finish_part = within.finish_part

    @cuda.jit(device=True)
    def home_at(partials, relay_partials, peer_bases, g, me, s, t):
        """The address, through its mapping, where this PE's partial of token t of PE ``s``
        goes: slot ``[g, me, t]`` of s's ``combine_partials`` on this node, or its row of the
        proxy's ``relay_partials`` for s on another node (the same offsets on every PE)."""
        if far(me, s):
            row, proxy = proxy_row(me, s)
            return peer_bases[PEER_RELAY_PARTIALS, proxy] + (address_of(relay_partials[row, t])
                                                             - address_of(relay_partials))
        return near_home_at(partials, relay_partials, peer_bases, g, me, s, t)

    @inlined
    def finish_part(partials, stage, relay_partials, relay_flag, row_flag, g, me, s, t, p, pw0, pw1, n, lane):
        """Every lane of the warp that stored part ``p``: flag it where it went
        (``relay_flag[row, t, p]`` on the proxy for ``s`` on another node)."""
        if far(me, s):
            row, proxy = proxy_row(me, s)
            flag_stored(relay_flag[row, t, p:p + 1], n, uint64(1) << uint64(proxy), row_flag.shape[0], lane)
        else:
            near_finish_part(partials, stage, relay_partials, relay_flag, row_flag, g, me, s, t, p, pw0, pw1, n,
                             lane)

    @inlined
    def finish_listed_part(partials, stage, relay_partials, relay_flag, row_flag, g, me, s, t, p, pw0, pw1, n,
                           lane):
        """``finish_part`` of a build with destination lists: the proxy's relay flag set with
        ``flag_one`` (any PE number)."""
        if far(me, s):
            row, proxy = proxy_row(me, s)
            flag_one(relay_flag, row, t, p, n, proxy, lane)
        else:
            near_finish_part(partials, stage, relay_partials, relay_flag, row_flag, g, me, s, t, p, pw0, pw1, n,
                             lane)

    if dest_slots:
        finish_part = finish_listed_part

    return SimpleNamespace(home_at=home_at, finish_part=finish_part,
                           send_home_part=stores.make_home_sender(within.warp, home_at, finish_part))


def make_put_partials(within, far, proxy_row, dest_slots: int = 0) -> SimpleNamespace:
    """``home_at``, ``finish_part``, ``send_home_part`` of partials staged and put (``within``:
    the puts transport of the node's PEs; ``far(me, s)``: whether ``s`` is on another node;
    ``proxy_row(me, s)``: its ``(row, proxy)``; a build with destination lists, ``dest_slots`` >
    0, flags its own without a mask, ``me`` its row of the home's partials)."""
    near_send_home_part = within.send_home_part

    @inlined
    def put_staged(partials, stage, relay_partials, relay_flag, row_flag, g, me, s, t, p, pw0, pw1, n):
        """Every lane of the warp that staged part ``p`` of its partial for PE ``s`` (not this
        PE): put it with its flag to ``s`` on this node, into row ``me`` of its partials, or to
        the proxy's ``relay_partials`` row with its ``relay_flag`` for ``s`` on another node."""
        warp_sync()  # the whole staged part is written before the warp's put
        if far(me, s):
            row, proxy = proxy_row(me, s)
            shmem.put_signal_nbi_warp(relay_partials[row, t, pw0:pw1], stage[s, t, pw0:pw1],
                                      relay_flag[row, t, p:p + 1], uint64(n + 1), shmem.SIGNAL_SET, proxy)
        else:
            shmem.put_signal_nbi_warp(partials[g, me, t, pw0:pw1], stage[s, t, pw0:pw1],
                                      row_flag[me, t, p:p + 1], uint64(n + 1), shmem.SIGNAL_SET, s)

    @inlined
    def finish_part(partials, stage, relay_partials, relay_flag, row_flag, g, me, s, t, p, pw0, pw1, n, lane):
        """Every lane of the warp that staged part ``p`` of its partial for PE ``s``: put it
        (:func:`put_staged`); this PE's own part flagged here."""
        if s != me:
            put_staged(partials, stage, relay_partials, relay_flag, row_flag, g, me, s, t, p, pw0, pw1, n)
        else:
            flag_part(row_flag, me, t, p, n, uint64(1) << uint64(s), lane)

    @inlined
    def finish_listed_part(partials, stage, relay_partials, relay_flag, row_flag, g, me, s, t, p, pw0, pw1, n,
                           lane):
        """``finish_part`` of a build with destination lists, ``me`` this PE's row of the home's
        partials (by sender: its local index; whether the part is its own asks ``my_pe``); this
        PE's own part flagged with ``flag_one`` (any PE number)."""
        if s != shmem.my_pe():
            put_staged(partials, stage, relay_partials, relay_flag, row_flag, g, me, s, t, p, pw0, pw1, n)
        else:
            flag_one(row_flag, me, t, p, n, s, lane)

    @inlined
    def send_home_part(src, w0, w1, partials, relay_partials, relay_flag, row_flag, peer_bases, g, me, s, t, p, n,
                       direct, lane, lo, hi):
        """Every lane of a warp: the caller's partial row part put to the proxy for ``s`` on
        another node (else as within the node)."""
        if far(me, s):
            row, proxy = proxy_row(me, s)
            shmem.put_signal_nbi_warp(relay_partials[row, t, w0:w1], src[w0:w1], relay_flag[row, t, p:p + 1],
                                      uint64(n + 1), shmem.SIGNAL_SET, proxy)
        else:
            near_send_home_part(src, w0, w1, partials, relay_partials, relay_flag, row_flag, peer_bases, g, me,
                                s, t, p, n, direct, lane, lo, hi)

    return SimpleNamespace(home_at=within.home_at, finish_part=finish_listed_part if dest_slots else finish_part,
                           send_home_part=send_home_part)


def make_row_chunks(threads: int, node_size: int, dest_slots: int, pack_row, holders):
    """``send_across``: the token blocks' rows bound for other nodes under the hierarchical
    transport of ``node_size`` PEs a node, built with the format's ``pack_row(tokens,
    token_scales, token_global_scale_u8, prequantized, t, row, lane, mbuf, peer_bases, held, lo, hi)`` (token ``t``'s
    row as it travels, into a local row) and ``holders(ids_at, K, L, R, ids_l)`` (the PEs holding
    a token's experts, uint64 bits; with ``dest_slots`` > 0 a destination list,
    ep_runtime/kernels/destinations.py)."""
    warp, warps = warp_geometry(threads)
    NODE = node_size

    @inlined
    def mark_by_bits(cmask, held_by, j, mine, nodes):
        """Bit j of ``cmask[node]`` set for each node other than ``mine`` with a PE set in
        ``held_by`` (uint64)."""
        for node in range(nodes):
            if node != mine and held_by & node_bits(node, NODE) != uint64(0):
                shared_atomic.or_(cmask, node, uint32(1) << uint32(j))

    @inlined
    def mark_by_list(cmask, held_by, j, mine, nodes):
        """``mark_by_bits`` of a destination list: a step per listed PE, not per node."""
        for q in range(held_by[0]):
            node = held_by[1 + q] // NODE
            if node != mine:
                shared_atomic.or_(cmask, node, uint32(1) << uint32(j))

    mark_nodes = mark_by_list if dest_slots else mark_by_bits
    # a constant the compiler prunes on: the list builds keep the home's partials by sender, the
    # proxies' sums in combine_sums as this stage packs the rows (combine_relay's rows_before)
    SUMS_PACKED = dest_slots > 0

    @inlined
    def send_across(tokens, token_scales, token_global_scale_u8, prequantized, ids_base, relay_stage, relay_rows,
                    relay_chunk_flag, relay_slot, peer_bases, T, K, L, R, me, n, token_blocks, cmask, mbuf, held, ids_l,
                    lo, hi):
        """Every thread of a token block: the rows bound for other nodes, a chunk of ``CH =
        chunk_tokens(T)`` consecutive tokens a block in turn. The block ranks the chunk's tokens
        with an expert on each other node (``cmask[node]``, bit j: token ``c CH + j``); for each
        such node x (``other_index``) it packs those tokens' rows in token order into its stage
        ``relay_stage[c CH KX + b:]`` (a warp a row; FP8: messages; ``KX = min(K, X)``, the most
        other nodes a token goes to, so a chunk's rows for all of them fit ``CH KX`` rows; b: the
        chunk's rows for the nodes before this one), notes each token's packed row in
        ``relay_slot[g, t, x]`` (combine_wait finds the node's sum there: the chunk row ``c CH + j``, or
        with destination lists the stage row, where combine_relay puts it in ``combine_sums``), and puts the
        packed rows
        to its proxy there in one ``put_signal_nbi_block`` that sets the proxy's
        ``relay_chunk_flag[x', c]`` to n + 1 (x': this node among the proxy's other nodes). A chunk
        with no token bound to a node sends it nothing (the proxy ranks the chunk alike and waits
        for no flag)."""
        tid = cuda.threadIdx.x
        lane = tid % warp
        wid = tid // warp
        mine = me // NODE
        nodes = R // NODE
        g = n % 2
        CH = chunk_tokens(T)
        KX = stage_rows(K, nodes - 1)
        c = cuda.blockIdx.x
        while cuda.blockIdx.x < token_blocks and c * CH < T:  # block-uniform
            for node in range(tid, nodes, threads):
                cmask[node] = uint32(0)
            cuda.syncthreads()
            for j in range(tid, CH, threads):
                t = c * CH + j
                if t < T:
                    mark_nodes(cmask, holders(ids_base + uint64(4 * t * K), K, L, R, ids_l), j, mine, nodes)
            cuda.syncthreads()
            s0 = c * CH * KX  # the chunk's stage rows; the next node's follow this node's
            for node in range(nodes):
                mask = cmask[node]
                if node != mine and mask != uint32(0):
                    x = other_index(node, mine)
                    c0 = c * CH
                    cnt = popc32(mask)
                    for b in range(CH):
                        if (mask >> uint32(b)) & uint32(1):
                            j = popc32(mask & ((uint32(1) << uint32(b)) - uint32(1)))
                            if j % warps == wid:
                                if lane == 0:  # where the node's sum comes back (combine_sums by sender)
                                    relay_slot[g, c0 + b, x] = s0 + j if SUMS_PACKED else c0 + j
                                pack_row(tokens, token_scales, token_global_scale_u8, prequantized, c0 + b,
                                         relay_stage[s0 + j], lane, mbuf, peer_bases, held, lo, hi)
                    cuda.syncthreads()  # the packed rows are written before the block's put reads them
                    shmem.put_signal_nbi_block(relay_rows[other_index(mine, node), c0:c0 + cnt],
                                               relay_stage[s0:s0 + cnt],
                                               relay_chunk_flag[other_index(mine, node), c:c + 1],
                                               uint64(n + 1), shmem.SIGNAL_SET, node * NODE + me % NODE)
                    s0 += cnt
            cuda.syncthreads()  # cmask read by every thread before the next chunk clears it
            c += token_blocks

    return send_across
