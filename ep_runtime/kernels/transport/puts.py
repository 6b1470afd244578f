"""The ``puts`` transport: NVSHMEM puts, to any PE NVSHMEM reaches (on NVLink the calling
threads copy; across nodes a CPU proxy or the NIC moves the bytes).

A put is complete (delivered) after ``quiet``; ``put_signal`` delivers its data before its
signal. Built for every PE (``node_size`` 0) or for the PEs of this PE's node (``node_size`` >
0: the hierarchical transport's writes within a node, :mod:`.hierarchical`).

:func:`make` merges the interface from a factory per job: :func:`make_rows` (token rows),
:func:`make_routing` (routing rows, ranks, counts, the call's signal), :func:`make_partials`
(the combine partials' stage, put and flag, by source rank or by top-k slot), :func:`make_slots` (slot values) and
:func:`make_forwarding` (the proxies' forwarding within their node).
"""

import functools
from types import SimpleNamespace

from ep_runtime.kernels import shmem
from ep_runtime.kernels.cuda_api import cuda, inlined, uint64
from ep_runtime.kernels.block import flag_one, flag_part, warp_geometry, warp_sync
from ep_runtime.kernels.nodes import make_near
from ep_runtime.kernels.vec import pairs_aligned
from ep_runtime.kernels.transport import common


@functools.lru_cache(maxsize=None)
def make(threads: int, node_size: int = 0, dest_slots: int = 0) -> SimpleNamespace:
    """The puts transport for blocks of ``threads`` threads, to every PE (``node_size`` 0) or to
    the PEs of this PE's node, a token's destinations a mask (``dest_slots`` 0) or a list
    (ep_runtime/kernels/destinations.py): the package's device interface, one
    namespace."""
    warp, _ = warp_geometry(threads)
    near = make_near(node_size)
    rows = make_listed_rows() if dest_slots else make_rows(node_size)
    return SimpleNamespace(warp=warp, FENCED=False, NEAR_FENCED=False, DIRECT=False, LISTED=dest_slots > 0,
                           near=near, make_row_chunks=common.no_row_chunks, no_dests=common.no_dests_of(dest_slots),
                           **vars(rows), **vars(make_routing(threads, near)), **vars(make_partials(dest_slots)),
                           **vars(make_slots(threads, near)), **vars(make_forwarding(node_size, dest_slots)),
                           **vars(common.make_credits(node_size)))


def make_rows(node_size: int) -> SimpleNamespace:
    """The token rows put to the PEs (every PE, ``node_size`` 0, or this PE's node), a warp put
    each: ``row_dests``, ``send_part``, ``send_part_flagged``."""

    @inlined
    def send_part(rows, me, t, src, w0, w1, dests, R, peer_bases, pairs, lane, lo, hi):
        """Every lane of a warp: words ``[w0, w1)`` of ``src`` into row ``[me, t]`` of ``rows``
        (``dispatch_tokens``) on every PE set in ``dests``, a warp put each."""
        for d in range(R):
            if (dests >> uint64(d)) & uint64(1):
                shmem.put_nbi_warp(rows[me, t, w0:w1], src[w0:w1], d)

    @inlined
    def send_part_flagged(rows, flags, me, t, p, n, src, w0, w1, dests, R, peer_bases, pairs, lane, lo, hi):
        """``send_part``, each put with part ``p``'s flag (``flags[me, t, p] = n + 1``, after the
        data)."""
        for d in range(R):
            if (dests >> uint64(d)) & uint64(1):
                shmem.put_signal_nbi_warp(rows[me, t, w0:w1], src[w0:w1], flags[me, t, p:p + 1], uint64(n + 1),
                                          shmem.SIGNAL_SET, d)

    return SimpleNamespace(row_dests=common.make_row_dests(node_size), send_part=send_part, send_part_flagged=send_part_flagged)


def make_listed_rows() -> SimpleNamespace:
    """:func:`make_rows` to every PE of a token's destination list (``dests``: int32, count
    first, ep_runtime/kernels/destinations.py) instead of a mask's bits."""

    @inlined
    def send_part(rows, me, t, src, w0, w1, dests, R, peer_bases, pairs, lane, lo, hi):
        """Every lane of a warp: words ``[w0, w1)`` of ``src`` into row ``[me, t]`` of ``rows``
        on every PE of the list ``dests``, a warp put each."""
        for j in range(dests[0]):
            shmem.put_nbi_warp(rows[me, t, w0:w1], src[w0:w1], dests[1 + j])

    @inlined
    def send_part_flagged(rows, flags, me, t, p, n, src, w0, w1, dests, R, peer_bases, pairs, lane, lo, hi):
        """``send_part``, each put with part ``p``'s flag (``flags[me, t, p] = n + 1``, after the
        data)."""
        for j in range(dests[0]):
            shmem.put_signal_nbi_warp(rows[me, t, w0:w1], src[w0:w1], flags[me, t, p:p + 1], uint64(n + 1),
                                      shmem.SIGNAL_SET, dests[1 + j])

    return SimpleNamespace(row_dests=common.make_row_dests(0), send_part=send_part, send_part_flagged=send_part_flagged)


def make_routing(threads: int, near) -> SimpleNamespace:
    """A call's routing rows, ranks, counts and signal, written here and put to the ``near`` PEs
    (blocks of ``threads`` threads): ``spread_range``, ``row_at``, ``spread_slot``,
    ``spread_flush``, ``count_u32``, ``send_ranks``, ``counts_before_route``, ``signal_pe``,
    ``signal_call``."""

    @cuda.jit(device=True)
    def spread_range(T, K, blocks):
        """``(j0, j1, step, t0, t1)``: the routing elements ``range(j0, j1, step)`` of the ``T K``
        this thread of one of ``blocks`` blocks writes here, its block's run of tokens ``[t0,
        t1)``, which the flush puts."""
        per = (T + blocks - 1) // blocks
        t0 = min(cuda.blockIdx.x * per, T)
        t1 = min(t0 + per, T)
        return t0 * K + cuda.threadIdx.x, t1 * K, threads, t0, t1

    @cuda.jit(device=True)
    def row_at(rows, g, me):
        """No offset: the routing rows are written here and put (``spread_flush``)."""
        return uint64(0)

    @cuda.jit(device=True)
    def spread_slot(ids, weights, peer_bases, ids_at, weights_at, g, me, t, k, j, x, w):
        """Slot ``(t, k)`` of this PE's routing rows written here (``ids[g, me, t, k] = x``,
        ``weights[g, me, t, k] = w``); the flush puts the block's run."""
        ids[g, me, t, k] = x
        weights[g, me, t, k] = w

    @cuda.jit(device=True)
    def spread_flush(a, b, g, me, t0, t1):
        """Every thread of a block: the block's run of tokens ``[t0, t1)`` of this PE's routing
        rows ``a[g, me]`` and ``b[g, me]`` put to every other near PE (after a barrier: every
        thread's elements are written)."""
        cuda.syncthreads()
        if t0 < t1:
            for d in range(a.shape[1]):
                if d != me and near(me, d):
                    shmem.put_nbi_block(a[g, me, t0:t1], a[g, me, t0:t1], d)
                    shmem.put_nbi_block(b[g, me, t0:t1], b[g, me, t0:t1], d)

    @cuda.jit(device=True)
    def count_u32(counts, staged, peer_bases, g, me, d, e, value):
        """This PE's count ``e`` for PE ``d`` staged in ``staged[d, e]``: the row goes with the
        signal (``signal_pe``)."""
        staged[d, e] = value

    @cuda.jit(device=True)
    def send_ranks(ranks, staged, peer_bases, g, me, c0, c1, run_l):
        """Every thread of a routing block: the staged ranks of tokens ``[c0, c1)`` put into
        ``ranks[g, me]`` of every near PE, a block put each."""
        if c1 > c0:
            for d in range(ranks.shape[1]):
                if near(me, d):
                    shmem.put_nbi_block(ranks[g, me, c0:c1], staged[c0:c1], d)

    @cuda.jit(device=True)
    def counts_before_route(counts, staged, g, me):
        """Every thread of the block that has the counts: the staged counts rows put to every PE
        (before the route signal, whose ticket quiets them)."""
        for d in range(staged.shape[0]):
            shmem.put_nbi_block(counts[g, me], staged[d], d)

    @cuda.jit(device=True)
    def signal_pe(signal_, counts, staged, g, me, d, value, route):
        """One thread: the dispatch signal ``value`` into ``signal_[g, me]`` on PE ``d``, with the
        staged counts row when the call sent its routing (``route``)."""
        if not route:
            shmem.signal_op(signal_[g, me:me + 1], value, shmem.SIGNAL_SET, d)
        else:
            shmem.put_signal(counts[g, me], staged[d], signal_[g, me:me + 1], value, shmem.SIGNAL_SET, d)

    @cuda.jit(device=True)
    def signal_call(signal_, counts, staged, relay_counts, relay_signal, ids, weights, ranks, g, me, T, value, route,
                    ranked):
        """Every thread of dispatch_async's last block, after its quiet: the signal on every PE
        (``signal_pe``)."""
        for d in range(cuda.threadIdx.x, counts.shape[1], threads):
            signal_pe(signal_, counts, staged, g, me, d, value, route)

    return SimpleNamespace(spread_range=spread_range, row_at=row_at, spread_slot=spread_slot,
                           spread_flush=spread_flush, count_u32=count_u32, send_ranks=send_ranks,
                           counts_before_route=counts_before_route, signal_pe=signal_pe, signal_call=signal_call)


def make_partials(dest_slots: int = 0) -> SimpleNamespace:
    """The combine partials, staged here and put home with their flag, part by part (a build with
    destination lists, ``dest_slots`` > 0, flags its own without a mask): ``stores_to``, ``stages``,
    ``stage_aligned``, ``home_aligned``, ``home_at``, ``finish_part``, ``send_home_part``."""

    @cuda.jit(device=True)
    def stores_to(me, s):
        """Whether this PE's partial for PE ``s`` is stored into ``s``: never (staged, put)."""
        return False

    @cuda.jit(device=True)
    def stages(me, s):
        """Whether this PE's partial for PE ``s`` is written to a local stage row (``stage[s, t]``)
        and put: a peer's (this PE's own goes into its own slot)."""
        return s != me

    @cuda.jit(device=True)
    def stage_aligned(stage):
        """Whether the stage rows (``combine_stage``) are 16-byte aligned."""
        return pairs_aligned(stage)

    @cuda.jit(device=True)
    def home_at(partials, relay_partials, peer_bases, g, me, s, t):
        """No address: partials are put, never stored into a peer."""
        return uint64(0)

    @inlined
    def finish_part(partials, stage, relay_partials, relay_flag, row_flag, g, me, s, t, p, pw0, pw1, n, lane):
        """Every lane of the warp that wrote part ``p`` (partial words ``[pw0, pw1)``) of its
        partial of token ``t`` of PE ``s``: put the staged part into slot ``[g, me, t]`` of ``s``
        with its flag (``row_flag[me, t, p] = n + 1``, after the data), or flag this PE's own."""
        if s != me:
            warp_sync()  # the whole staged part is written before the warp's put
            shmem.put_signal_nbi_warp(partials[g, me, t, pw0:pw1], stage[s, t, pw0:pw1], row_flag[me, t, p:p + 1],
                                      uint64(n + 1), shmem.SIGNAL_SET, s)
        else:
            flag_part(row_flag, me, t, p, n, uint64(1) << uint64(s), lane)

    @inlined
    def finish_listed_part(partials, stage, relay_partials, relay_flag, row_flag, g, me, s, t, p, pw0, pw1, n, lane):
        """``finish_part`` of a build with destination lists: this PE's own part flagged with
        ``flag_one`` (any PE number). ``me`` is this PE's row of the home's partials only, its
        destination slot where they are kept by slot (``partials.make_home_row``): whether the
        part is this PE's own asks ``my_pe``."""
        if s != shmem.my_pe():
            warp_sync()  # the whole staged part is written before the warp's put
            shmem.put_signal_nbi_warp(partials[g, me, t, pw0:pw1], stage[s, t, pw0:pw1], row_flag[me, t, p:p + 1],
                                      uint64(n + 1), shmem.SIGNAL_SET, s)
        else:
            flag_one(row_flag, me, t, p, n, s, lane)

    if dest_slots:
        finish_part = finish_listed_part

    @inlined
    def send_home_part(src, w0, w1, partials, relay_partials, relay_flag, row_flag, peer_bases, g, me, s, t, p, n,
                       direct, lane, lo, hi):
        """Every lane of a warp: words ``[w0, w1)`` of the caller's partial row ``src`` put into slot
        ``[g, me, t]`` of PE ``s`` with the part's flag."""
        shmem.put_signal_nbi_warp(partials[g, me, t, w0:w1], src[w0:w1], row_flag[me, t, p:p + 1], uint64(n + 1),
                                  shmem.SIGNAL_SET, s)

    # a row by slot (combine_weights="home") is put as a caller's partial is, into [g, k, t] with
    # the flag [k, t, p]: the slot k stands where this PE's index does
    return SimpleNamespace(stores_to=stores_to, stages=stages, stage_aligned=stage_aligned, home_aligned=common.home_aligned,
                           home_at=home_at, finish_part=finish_part, send_home_part=send_home_part,
                           send_slot_part=send_home_part)


def make_slots(threads: int, near) -> SimpleNamespace:
    """The combine slot values, put to their PE, and their signal to the ``near`` PEs (blocks of
    ``threads`` threads): ``send_slot_value``, ``signal_slot_values``."""

    @inlined
    def send_slot_value(slot_values, slot_stage, values, i, peer_bases, g, me, s, t, k):
        """One thread: ``values[i]`` (float32) into ``slot_values[g, t, k]`` of PE ``s``, a put."""
        shmem.put(slot_values[g, t, k:k + 1], values[i:i + 1], s)

    @inlined
    def signal_slot_values(slot_signal, slot_across, slot_stage, counts, g, me, n):
        """Every thread of the last block, after its quiet: ``slot_signal[g, me]`` set to ``n + 1``
        on every near PE."""
        for d in range(cuda.threadIdx.x, slot_signal.shape[1], threads):
            if near(me, d):
                shmem.signal_op(slot_signal[g, me:me + 1], uint64(n + 1), shmem.SIGNAL_SET, d)

    return SimpleNamespace(send_slot_value=send_slot_value, signal_slot_values=signal_slot_values)


def make_forwarding(node_size: int, dest_slots: int = 0) -> SimpleNamespace:
    """The hierarchical proxies' forwarding within their node of ``node_size`` PEs, puts (a row's
    PEs a mask, or with ``dest_slots`` > 0 a destination list): ``forward_run``,
    ``forward_row``."""
    NODE = node_size

    @cuda.jit(device=True)
    def forward_run(array, g, s, t0, t1, peer_bases, region, first, me):
        """Every thread of a block: ``array[g, s, t0:t1]`` into the same elements of the PEs
        ``[first, first + node_size)`` but this one, a block put each."""
        for q in range(first, first + NODE):
            if q != me:
                shmem.put_nbi_block(array[g, s, t0:t1], array[g, s, t0:t1], q)

    @cuda.jit(device=True)
    def forward_row(rows, row, s, t, to, peer_bases, region, first, lane, lo, hi):
        """Every lane of a warp: the local ``row`` into ``rows[s, t]`` of each PE of ``[first,
        first + node_size)`` set in ``to`` (uint64), this one included, a warp put each."""
        for q in range(first, first + NODE):
            if (to >> uint64(q)) & uint64(1):
                shmem.put_nbi_warp(rows[s, t], row, q)

    @cuda.jit(device=True)
    def forward_listed_row(rows, row, s, t, to, peer_bases, region, first, lane, lo, hi):
        """``forward_row`` of a build with destination lists: to each PE of the list ``to``
        (int32, count first: the node's PEs holding one of the token's experts)."""
        for j in range(to[0]):
            shmem.put_nbi_warp(rows[s, t], row, to[1 + j])

    return SimpleNamespace(forward_run=forward_run, forward_row=forward_listed_row if dest_slots else forward_row)
