"""The ``stores`` transport: plain stores from the SMs into the peers' heaps, through their
NVLink mappings (``peer_bases``: each peer region's address as mapped here; a region's rows
are at the same offsets on every PE).

Stores are published by a barrier of the writing threads, one thread's system fence
(cumulative over what the barrier ordered) and then the flag or signal
(``block.publish_fence``, ``block.flag_part``). Built for every PE (``node_size`` 0) or for
the PEs of this PE's node (``node_size`` > 0: the hierarchical transport's writes within a
node, :mod:`.hierarchical`, which adds what crosses nodes).

:func:`make` merges the interface from a factory per job: :func:`make_rows` (token rows),
:func:`make_routing` (routing rows, ranks, counts, the call's signal), :func:`make_partials`
(the combine partials' home and flag, by source rank or by top-k slot), :func:`make_slots` (slot values) and
:func:`make_forwarding` (the proxies' forwarding within their node).
"""

import functools
from types import SimpleNamespace

from ep_runtime.kernels import shmem
from ep_runtime.kernels.bits import f32_bits
from ep_runtime.kernels.cuda_api import cuda, inlined, uint32, uint64
from ep_runtime.kernels.nodes import make_near
from ep_runtime.kernels.protocol import (PEER_COUNTS, PEER_IDS, PEER_PARTIALS, PEER_RANKS, PEER_SLOTS, PEER_TOKENS,
                                         PEER_WEIGHTS)
from ep_runtime.kernels.transport import common
from ep_runtime.kernels.transport.common import PAIRS_IN_FLIGHT, RUN_BATCH
from ep_runtime.kernels.block import flag_one, flag_part, flag_part_listed, warp_geometry
from ep_runtime.kernels.vec import (address_of, load_u32_at, make_listed_peer_copy, make_pair_loops, make_peer_copy,
                                    pairs_aligned, store_u32_at, store_word_at)


@functools.lru_cache(maxsize=None)
def make(threads: int, node_size: int = 0, dest_slots: int = 0) -> SimpleNamespace:
    """The stores transport for blocks of ``threads`` threads, into every PE (``node_size`` 0)
    or into the PEs of this PE's node, a token's destinations a mask (``dest_slots`` 0) or a list
    (ep_runtime/kernels/destinations.py): the package's device interface, one
    namespace."""
    warp, _ = warp_geometry(threads)
    near = make_near(node_size)
    copy_to_peers = make_peer_copy(PAIRS_IN_FLIGHT, warp)  # token rows and forwarded rows alike
    rows = (make_listed_rows(warp) if dest_slots else make_rows(node_size, copy_to_peers))
    return SimpleNamespace(warp=warp, FENCED=node_size == 0, NEAR_FENCED=True, DIRECT=True, LISTED=dest_slots > 0,
                           near=near, make_row_chunks=common.no_row_chunks, no_dests=common.no_dests_of(dest_slots),
                           **vars(rows), **vars(make_routing(threads, near)), **vars(make_partials(warp, dest_slots)),
                           **vars(make_slots(threads, near)),
                           **vars(make_forwarding(threads, node_size, copy_to_peers, dest_slots)),
                           **vars(common.make_credits(node_size)))


def make_rows(node_size: int, copy_to_peers) -> SimpleNamespace:
    """The token rows into the PEs (every PE, ``node_size`` 0, or this PE's node) through their
    mappings, each word (pair) loaded once for every PE (``copy_to_peers``:
    :func:`~ep_runtime.kernels.vec.make_peer_copy`): ``row_dests``, ``send_part``,
    ``send_part_flagged``."""

    @inlined
    def send_part(rows, me, t, src, w0, w1, dests, R, peer_bases, pairs, lane, lo, hi):
        """Every lane of a warp: words ``[w0, w1)`` of ``src`` into row ``[me, t]`` of ``rows``
        (``dispatch_tokens``) on every PE set in ``dests``, each word (pair) loaded once for
        every PE (``pairs``: uint64 words, 16-byte aligned on both sides)."""
        slot = address_of(rows[me, t]) - address_of(rows)  # the same on every PE
        copy_to_peers(src, w0, w1, dests, 0, R, peer_bases, PEER_TOKENS, slot, pairs, lane, lo, hi)

    @inlined
    def send_part_flagged(rows, flags, me, t, p, n, src, w0, w1, dests, R, peer_bases, pairs, lane, lo, hi):
        """``send_part``, then part ``p`` flagged on every destination (``flags[me, t, p] = n +
        1`` after a fence: ``flag_part``)."""
        send_part(rows, me, t, src, w0, w1, dests, R, peer_bases, pairs, lane, lo, hi)
        flag_part(flags, me, t, p, n, dests, lane)

    return SimpleNamespace(row_dests=common.make_row_dests(node_size), send_part=send_part, send_part_flagged=send_part_flagged)


def make_listed_rows(warp: int) -> SimpleNamespace:
    """:func:`make_rows` into every PE of a token's destination list (``dests``: int32, count
    first, ep_runtime/kernels/destinations.py) instead of a mask's bits."""
    copy_to_listed = make_listed_peer_copy(PAIRS_IN_FLIGHT, warp)

    @inlined
    def send_part(rows, me, t, src, w0, w1, dests, R, peer_bases, pairs, lane, lo, hi):
        """Every lane of a warp: words ``[w0, w1)`` of ``src`` into row ``[me, t]`` of ``rows``
        on every PE of the list ``dests``, each word (pair) loaded once for every PE."""
        slot = address_of(rows[me, t]) - address_of(rows)  # the same on every PE
        copy_to_listed(src, w0, w1, dests, peer_bases, PEER_TOKENS, slot, pairs, lane, lo, hi)

    @inlined
    def send_part_flagged(rows, flags, me, t, p, n, src, w0, w1, dests, R, peer_bases, pairs, lane, lo, hi):
        """``send_part``, then part ``p`` flagged on every PE of the list (``flag_part_listed``)."""
        send_part(rows, me, t, src, w0, w1, dests, R, peer_bases, pairs, lane, lo, hi)
        flag_part_listed(flags, me, t, p, n, dests, lane)

    return SimpleNamespace(row_dests=common.make_row_dests(0), send_part=send_part, send_part_flagged=send_part_flagged)


def make_routing(threads: int, near) -> SimpleNamespace:
    """A call's routing rows, ranks, counts and signal, stored into the ``near`` PEs through their
    mappings (blocks of ``threads`` threads): ``spread_range``, ``row_at``, ``spread_slot``,
    ``spread_flush``, ``count_u32``, ``send_ranks``, ``counts_before_route``, ``signal_pe``,
    ``signal_call``."""

    @cuda.jit(device=True)
    def spread_range(T, K, blocks):
        """``(j0, j1, step, t0, t1)``: the routing elements ``range(j0, j1, step)`` of the ``T K``
        this thread of one of ``blocks`` blocks writes (the grid's threads in turn), and the
        tokens ``[t0, t1)`` its block delivers at the flush (none: the stores are out)."""
        return cuda.blockIdx.x * threads + cuda.threadIdx.x, T * K, blocks * threads, 0, 0

    @cuda.jit(device=True)
    def row_at(rows, g, me):
        """The byte offset of this PE's routing row ``rows[g, me]`` in ``rows`` (the same on every
        PE): ``spread_u32``'s ``at``."""
        return address_of(rows[g, me]) - address_of(rows)

    @cuda.jit(device=True)
    def spread_slot(ids, weights, peer_bases, ids_at, weights_at, g, me, t, k, j, x, w):
        """Slot ``(t, k)`` (flat element ``j``) of this PE's routing rows, its expert id ``x``
        (int32) and weight ``w`` (float32), into ``ids[g, me]`` / ``weights[g, me]`` (at bytes
        ``ids_at`` / ``weights_at``: ``row_at``) of every near PE: 4-byte stores (rows 0..T
        are contiguous on both sides)."""
        bits = f32_bits(w)
        for d in range(peer_bases.shape[1]):
            if near(me, d):
                store_u32_at(peer_bases[PEER_IDS, d] + ids_at, j, uint32(x))
                store_u32_at(peer_bases[PEER_WEIGHTS, d] + weights_at, j, bits)

    @cuda.jit(device=True)
    def spread_flush(a, b, g, me, t0, t1):
        """Nothing: the stores are out (the caller's fence publishes them)."""

    @cuda.jit(device=True)
    def count_u32(counts, staged, peer_bases, g, me, d, e, value):
        """This PE's count ``e`` of ``counts[g, me]`` (int32 [.., L + 1]) stored into PE ``d``
        if near, else staged in ``staged[d, e]`` for the proxy that forwards it."""
        if near(me, d):
            at = address_of(counts[g, me]) - address_of(counts)
            store_u32_at(peer_bases[PEER_COUNTS, d] + at, e, uint32(value))
        else:
            staged[d, e] = value

    @cuda.jit(device=True)
    def send_ranks(ranks, staged, peer_bases, g, me, c0, c1, run_l):
        """Every thread of a routing block: the staged ranks of tokens ``[c0, c1)`` (``staged``
        [Tmax, K], flat element ``t K + k``) into ``ranks[g, me]`` of every near PE: contiguous
        4-byte stores across the block, ``RUN_BATCH`` loads in flight per thread (``run_l``)
        before its stores."""
        K = staged.shape[1]
        src = address_of(staged) + uint64(4 * c0 * K)
        at = address_of(ranks[g, me]) - address_of(ranks) + uint64(4 * c0 * K)
        count = (c1 - c0) * K
        j = cuda.threadIdx.x
        while j < count:
            for b in range(RUN_BATCH):  # a constant trip count: unrolled, run_l in registers
                if j + b * threads < count:
                    run_l[b] = load_u32_at(src, j + b * threads)
            for b in range(RUN_BATCH):
                if j + b * threads < count:
                    for d in range(peer_bases.shape[1]):
                        if near(me, d):
                            store_u32_at(peer_bases[PEER_RANKS, d] + at, j + b * threads, run_l[b])
            j += RUN_BATCH * threads

    @cuda.jit(device=True)
    def counts_before_route(counts, staged, g, me):
        """Nothing: the counts rows were stored (``count_u32``)."""

    @cuda.jit(device=True)
    def signal_pe(signal_, counts, staged, g, me, d, value, route):
        """One thread: the dispatch signal ``value`` into ``signal_[g, me]`` on PE ``d`` (the
        counts rows are there: ``count_u32``)."""
        shmem.signal_op(signal_[g, me:me + 1], value, shmem.SIGNAL_SET, d)

    @cuda.jit(device=True)
    def signal_call(signal_, counts, staged, relay_counts, relay_signal, ids, weights, ranks, g, me, T, value, route,
                    ranked):
        """Every thread of dispatch_async's last block, after its publish: the signal on every
        PE (``signal_pe``)."""
        for d in range(cuda.threadIdx.x, counts.shape[1], threads):
            signal_pe(signal_, counts, staged, g, me, d, value, route)

    return SimpleNamespace(spread_range=spread_range, row_at=row_at, spread_slot=spread_slot,
                           spread_flush=spread_flush, count_u32=count_u32, send_ranks=send_ranks,
                           counts_before_route=counts_before_route, signal_pe=signal_pe, signal_call=signal_call)


def make_partials(warp: int, dest_slots: int = 0) -> SimpleNamespace:
    """The combine partials, stored into their home through its mapping and flagged part by part
    (warps of ``warp`` lanes; a build with destination lists, ``dest_slots`` > 0, flags the one
    home without a mask): ``stores_to``, ``stages``, ``stage_aligned``, ``home_aligned``,
    ``home_at``, ``finish_part``, ``send_home_part``."""

    @cuda.jit(device=True)
    def stores_to(me, s):
        """Whether this PE's partial for PE ``s`` is stored into ``s`` (not into a local row)."""
        return s != me

    @cuda.jit(device=True)
    def stages(me, s):
        """Whether this PE's partial for PE ``s`` is written to a local stage row and put: never
        (a peer's is stored into it, ``home_at``; this PE's own into its own slot)."""
        return False

    @cuda.jit(device=True)
    def stage_aligned(stage):
        """Whether the stage rows are 16-byte aligned: no stage here."""
        return True

    @cuda.jit(device=True)
    def home_at(partials, relay_partials, peer_bases, g, me, s, t):
        """The address, through its mapping, of slot ``[g, me, t]`` of PE ``s``'s
        ``combine_partials``: where this PE's partial of token t of s goes."""
        return peer_bases[PEER_PARTIALS, s] + (address_of(partials[g, me, t]) - address_of(partials))

    @inlined
    def finish_part(partials, stage, relay_partials, relay_flag, row_flag, g, me, s, t, p, pw0, pw1, n, lane):
        """Every lane of the warp that stored part ``p`` of its partial of token ``t`` of PE ``s``:
        flag it there (``row_flag[me, t, p] = n + 1`` after a fence: ``flag_part``)."""
        flag_part(row_flag, me, t, p, n, uint64(1) << uint64(s), lane)

    @inlined
    def finish_slot_part(partials, stage, relay_partials, relay_flag, row_flag, g, k, s, t, p, pw0, pw1, n, lane):
        """Every lane of the warp that stored part ``p`` of the row slot ``k`` of token ``t`` of PE
        ``s`` went to (``combine_weights="home"``): flag it there (``row_flag[k, t, p] = n + 1``
        after a fence; ``flag_one``: any PE number)."""
        flag_one(row_flag, k, t, p, n, s, lane)

    @inlined
    def finish_listed_part(partials, stage, relay_partials, relay_flag, row_flag, g, me, s, t, p, pw0, pw1, n, lane):
        """``finish_part`` of a build with destination lists: the flag set on PE ``s``
        (``flag_one``: any PE number)."""
        flag_one(row_flag, me, t, p, n, s, lane)

    if dest_slots:
        finish_part = finish_listed_part
    return SimpleNamespace(stores_to=stores_to, stages=stages, stage_aligned=stage_aligned, home_aligned=common.home_aligned,
                           home_at=home_at, finish_part=finish_part,
                           send_home_part=make_home_sender(warp, home_at, finish_part),
                           send_slot_part=make_home_sender(warp, home_at, finish_slot_part))


def make_home_sender(warp: int, home_at, finish_part):
    """``send_home_part`` of a transport that stores partials into their home (``home_at``: its
    address; ``finish_part``: the flag after the data)."""
    load_pairs, _, store_pairs_at = make_pair_loops(PAIRS_IN_FLIGHT, warp)

    @inlined
    def send_home_part(src, w0, w1, partials, relay_partials, relay_flag, row_flag, peer_bases, g, me, s, t, p, n,
                       direct, lane, lo, hi):
        """Every lane of a warp: words ``[w0, w1)`` of the caller's partial row ``src`` into the
        home of this PE's partial of token ``t`` of PE ``s`` (``home_at``), then flagged
        (``finish_part``): ``PAIRS_IN_FLIGHT`` word pairs per lane where ``direct`` (uint64
        words, 16-byte aligned), else a word per lane per step."""
        home = home_at(partials, relay_partials, peer_bases, g, me, s, t)
        if direct:
            w = w0 + 2 * lane
            while w < w1:
                load_pairs(src, w, w1, lo, hi)
                store_pairs_at(home, w, w1, lo, hi)
                w += 2 * PAIRS_IN_FLIGHT * warp
        else:
            for w in range(w0 + lane, w1, warp):
                store_word_at(home, w, src[w])
        finish_part(partials, src, relay_partials, relay_flag, row_flag, g, me, s, t, p, w0, w1, n, lane)

    return send_home_part


def make_slots(threads: int, near) -> SimpleNamespace:
    """The combine slot values, stored into their PE through its mapping, and their signal to the
    ``near`` PEs (blocks of ``threads`` threads): ``send_slot_value``, ``signal_slot_values``."""

    @inlined
    def send_slot_value(slot_values, slot_stage, values, i, peer_bases, g, me, s, t, k):
        """One thread: ``values[i]`` (float32) into ``slot_values[g, t, k]`` of PE ``s``."""
        Tm = slot_values.shape[1]
        K = slot_values.shape[2]
        store_u32_at(peer_bases[PEER_SLOTS, s], (g * Tm + t) * K + k, f32_bits(values[i]))

    @inlined
    def signal_slot_values(slot_signal, slot_across, slot_stage, counts, g, me, n):
        """Every thread of the last block, after its publish: ``slot_signal[g, me]`` set to
        ``n + 1`` on every near PE."""
        for d in range(cuda.threadIdx.x, slot_signal.shape[1], threads):
            if near(me, d):
                shmem.signal_op(slot_signal[g, me:me + 1], uint64(n + 1), shmem.SIGNAL_SET, d)

    return SimpleNamespace(send_slot_value=send_slot_value, signal_slot_values=signal_slot_values)


def make_forwarding(threads: int, node_size: int, copy_to_peers, dest_slots: int = 0) -> SimpleNamespace:
    """The hierarchical proxies' forwarding within their node of ``node_size`` PEs, stores through
    the mappings (blocks of ``threads`` threads; ``copy_to_peers``:
    :func:`~ep_runtime.kernels.vec.make_peer_copy`; a row's PEs a mask, or with ``dest_slots`` >
    0 a destination list): ``forward_run``, ``forward_row``."""
    NODE = node_size
    copy_to_listed = make_listed_peer_copy(PAIRS_IN_FLIGHT, warp_geometry(threads)[0])

    @cuda.jit(device=True)
    def forward_run(array, g, s, t0, t1, peer_bases, region, first, me):
        """Every thread of a block: ``array[g, s, t0:t1]`` (int32 or float32 [G, R, Tmax, K],
        4-byte elements) into the same elements of the PEs ``[first, first + node_size)`` but
        this one: 4-byte stores through their mappings (``region``: the array's ``peer_bases``
        row), each element loaded once."""
        K = array.shape[3]
        src = address_of(array[g, s, t0])
        at = src - address_of(array)  # the same offset on every PE
        for j in range(cuda.threadIdx.x, (t1 - t0) * K, threads):
            word = load_u32_at(src, j)
            for q in range(first, first + NODE):
                if q != me:
                    store_u32_at(peer_bases[region, q] + at, j, word)

    @cuda.jit(device=True)
    def forward_row(rows, row, s, t, to, peer_bases, region, first, lane, lo, hi):
        """Every lane of a warp: the local ``row`` (uint64 words) into ``rows[s, t]`` of each PE
        of ``[first, first + node_size)`` set in ``to`` (uint64), this one included, each word
        (pair) loaded once for every PE."""
        W = row.shape[0]
        slot = address_of(rows[s, t]) - address_of(rows)  # the same on every PE
        pairs = row.itemsize == 8 and W % 2 == 0 and pairs_aligned(row) and pairs_aligned(rows)
        copy_to_peers(row, 0, W, to, first, first + NODE, peer_bases, region, slot, pairs, lane, lo, hi)

    @cuda.jit(device=True)
    def forward_listed_row(rows, row, s, t, to, peer_bases, region, first, lane, lo, hi):
        """``forward_row`` of a build with destination lists: into each PE of the list ``to``
        (int32, count first: the node's PEs holding one of the token's experts)."""
        W = row.shape[0]
        slot = address_of(rows[s, t]) - address_of(rows)  # the same on every PE
        pairs = row.itemsize == 8 and W % 2 == 0 and pairs_aligned(row) and pairs_aligned(rows)
        copy_to_listed(row, 0, W, to, peer_bases, region, slot, pairs, lane, lo, hi)

    return SimpleNamespace(forward_run=forward_run, forward_row=forward_listed_row if dest_slots else forward_row)
