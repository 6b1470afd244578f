"""Block-level device helpers shared by the EP kernels.

Every helper here is called by *every thread of the block* (they contain ``syncthreads``),
with ``blockDim.x`` threads in a 1-D block.

- the static tile scheduler (grid size, initial state, advance);
- ``publish_fence``: data before flag (a system fence after plain stores, ``quiet`` after puts);
- ``last_block_ticket``: the "last block done" pattern that lets async kernels signal once
  after all blocks' sends are complete, without any block waiting for another;
- ``block_exclusive_scan`` / ``block_sum``: shared-memory scans for deterministic placement;
- ``record_error``: claims the device error record (first error wins);
- ``warp_geometry`` / ``warp_sync``: how kernels split a block into warps, and the warp barrier;
- ``warp_exclusive_count`` / ``warp_sum`` / ``group_max_u32``: a warp's ballot prefix count
  and sum, and the maximum over each group of its lanes (shuffles and ballots on a GPU, no
  shared memory);
- ``popc32``: set bits of a 32-bit mask (any thread, no barrier); ``udiv32``: a 32-bit unsigned
  quotient (Numba divides integers in 64 bits: a call to a division routine on a GPU);
- ``row_parts`` / ``part_words`` / ``part_bounds``: how many warp items each token row is cut
  into, so that small batches still give every warp work (a row is ``W`` words; a warp item is
  one part of one row), and which words an item covers; ``interleaved_item``: items of R sources
  dealt so that a warp alternates between them;
- ``flag_rule`` / ``flag_part`` / ``await_part``: rows flagged part by part as they land
  (combine and dispatch): how many parts a row is cut into, by a rule every
  rank computes alike, the sending warp's fence and flag, and the receiver's bounded wait;
  ``flag_part_listed`` / ``flag_listed`` / ``flag_one``: the same flags to a destination list's PEs or
  one PE (builds with destination lists, ep_runtime/kernels/destinations.py);
- ``local_expert_count``: how many of a token's experts live on a rank.
"""

from ep_runtime.kernels import cuda_api, shmem
from ep_runtime.kernels.cuda_api import cuda, int32, int64, uint32, uint64
from ep_runtime.kernels.protocol import (STATUS_CALL, STATUS_CODE, STATUS_COUNTER, STATUS_EXPECTED, STATUS_KERNEL,
                                         STATUS_OBSERVED, STATUS_PEER, STATUS_RANK, ERR_TIMEOUT)


# -- static tile scheduler (MAX's MHATileScheduler role) ------------------------------------------
# Work items 0..n-1 are dealt round-robin: block b takes b, b + grid, b + 2 * grid, ...
# Items never depend on each other, so any grid size and any block order is correct.
@cuda.jit(device=True)
def sched_initial(block):
    """First work item of block ``block``."""
    return block


@cuda.jit(device=True)
def sched_advance(item, grid):
    """Next work item after ``item`` for a grid of ``grid`` blocks."""
    return item + grid


# -- synchronization -------------------------------------------------------------------------------
@cuda.jit(device=True)
def publish_fence(stores_only):
    """One thread, after a barrier of the block whose writes it publishes, before the flag or
    signal that publishes them: make those writes visible to every GPU first.

    ``stores_only`` (a build constant where the caller can make it one): everything published
    was written with plain stores, locally or into peers through their NVLink mappings. A
    system fence then suffices (cumulative over what the barrier ordered: data before flag).
    Otherwise NVSHMEM puts may be pending and ``quiet`` completes them (on NVLink it is the same
    system fence after the puts' own stores; the simulator delivers puts only there). The
    fence alone publishes faster than ``quiet`` (measured: docs/plans.md)."""
    if stores_only:
        cuda.threadfence_system()
    else:
        shmem.quiet()


@cuda.jit(device=True)
def last_block_ticket(ticket, flag, stores_only):
    """Complete this block's puts and stores, take a ticket, and tell whether this block finished last.

    ``ticket``: int64 device array; ``ticket[0]`` counts finished blocks of the launch.
    ``flag``: int32 shared array of one element (scratch). ``stores_only``: the block's
    published writes were all plain stores (:func:`publish_fence`). Every thread calls it;
    every thread gets the same answer. The last block must reset ``ticket[0]`` to 0 when done.
    The block meets, then thread 0 publishes (:func:`publish_fence`: a system fence, or
    ``quiet`` where puts may be pending) and takes the ticket. The barrier orders every
    thread's earlier stores (its NVLink stores, the lanes' share of warp and block puts)
    before thread 0's fence, which is cumulative: it publishes what thread 0 observed through
    the barrier, not only its own stores (NVSHMEM's block-scope quiet relies on the same: on
    the load/store path its thread 0 alone runs ``__threadfence_system``). ``quiet`` also
    completes what a transport still holds for this PE, so when the last block sees the final
    ticket every block's data has been delivered. One fence per block, not one per warp: every
    warp fencing measured slower than one (docs/plans.md).
    """
    cuda.syncthreads()
    if cuda.threadIdx.x == 0:
        publish_fence(stores_only)
        done = cuda.atomic.add(ticket, 0, int64(1))
        flag[0] = int32(1) if done == cuda.gridDim.x - 1 else int32(0)
        cuda.threadfence()
    cuda.syncthreads()
    return flag[0] == 1


@cuda.jit(device=True)
def block_exclusive_scan(buf, value):
    """Exclusive prefix sum of ``value`` over the threads of the block, in thread order.

    ``buf``: int32 shared array of ``blockDim.x`` elements (scratch). Returns
    ``(prefix, total)``; deterministic (no atomics).
    """
    tid = cuda.threadIdx.x
    n = cuda.blockDim.x
    buf[tid] = value
    cuda.syncthreads()
    offset = 1
    while offset < n:
        v = buf[tid - offset] if tid >= offset else 0
        cuda.syncthreads()
        buf[tid] += v
        cuda.syncthreads()
        offset *= 2
    total = buf[n - 1]
    prefix = buf[tid] - value
    cuda.syncthreads()
    return prefix, total


@cuda.jit(device=True)
def block_sum(buf, value):
    """Sum of ``value`` over the threads of the block. ``buf``: int64 shared scratch of
    ``blockDim.x`` elements. Every thread gets the total."""
    tid = cuda.threadIdx.x
    buf[tid] = value
    cuda.syncthreads()
    half = cuda.blockDim.x // 2
    while half > 0:
        if tid < half:
            buf[tid] += buf[tid + half]
        cuda.syncthreads()
        half //= 2
    total = buf[0]
    cuda.syncthreads()
    return total


# -- error record -----------------------------------------------------------------------------------
@cuda.jit(device=True)
def record_error(status, code, kernel, rank, peer, counter, expected, observed, call):
    """Claim the int64 error record ``status`` (first error wins) and fill it. One thread."""
    if cuda.atomic.cas(status, STATUS_CODE, int64(0), int64(code)) == 0:
        status[STATUS_KERNEL] = kernel
        status[STATUS_RANK] = rank
        status[STATUS_PEER] = peer
        status[STATUS_COUNTER] = counter
        status[STATUS_EXPECTED] = expected
        status[STATUS_OBSERVED] = observed
        status[STATUS_CALL] = call
        cuda.threadfence()


# -- warps -------------------------------------------------------------------------------------------
def warp_geometry(threads: int) -> tuple[int, int]:
    """``(warp_size, warps_per_block)`` the kernels divide work by, for blocks of ``threads``.

    On a GPU a warp is 32 threads. The simulator's blocks are smaller than a warp (each simulated
    thread is a Python thread), so there a "warp" is the whole block: ``min(32, threads)``.
    """
    size = min(32, threads)
    return size, threads // size


if cuda_api.SIMULATED:

    def warp_sync():
        """Barrier of the calling warp. Simulated blocks are one warp (``warp_geometry``), so
        the block barrier is the warp barrier. A plain function: see ep_runtime/kernels/cuda_api.py."""
        cuda.syncthreads()

    def warp_exclusive_count(pred, buf32):
        """See the GPU version. Simulated blocks are one warp: a block scan over ``buf32``."""
        return block_exclusive_scan(buf32, 1 if pred else 0)

    def warp_exclusive_sum(value, buf64):
        """See the GPU version. Simulated blocks are one warp: a block scan over ``buf64``."""
        return block_exclusive_scan(buf64, int64(value))

    def warp_sum(value, buf64):
        """See the GPU version. Simulated blocks are one warp: a block sum over ``buf64``."""
        return block_sum(buf64, int64(value))

    def popc32(mask):
        """See the GPU version."""
        return bin(int(mask) & 0xFFFFFFFF).count("1")

    def udiv32(a, b):
        """See the GPU version."""
        return uint32((int(a) & 0xFFFFFFFF) // (int(b) & 0xFFFFFFFF))

    def group_max_u32(value, group, buf64):
        """See the GPU version: the maximum over the lanes of this thread's group of ``group``
        consecutive lanes, through ``buf64``."""
        tid = cuda.threadIdx.x
        buf64[tid] = int64(value)
        cuda.syncthreads()
        first = tid - tid % group
        m = buf64[first]
        for i in range(first + 1, first + group):
            m = max(m, buf64[i])
        cuda.syncthreads()
        return uint32(m)

else:

    @cuda.jit(device=True)
    def warp_sync():
        """Barrier of the calling warp (``__syncwarp`` with every lane)."""
        cuda.syncwarp(0xFFFFFFFF)

    @cuda.jit(device=True)
    def warp_exclusive_count(pred, buf32):
        """Every lane of the warp: ``(lanes below this one with pred true, lanes with pred
        true)``, from one ballot (deterministic: lane order). ``buf32`` is the simulator's
        scratch (an int32 shared array of the block's size), unused here."""
        mask = cuda.ballot_sync(0xFFFFFFFF, pred)
        below = mask & ((uint32(1) << uint32(cuda.laneid)) - uint32(1))
        return cuda.popc(below), cuda.popc(mask)

    @cuda.jit(device=True)
    def popc32(mask):
        """Set bits of the 32-bit ``mask`` (one ``POPC``). Any thread; no barrier."""
        return cuda.popc(uint32(mask))

    if cuda_api.MLIR:
        from ep_runtime.kernels.mlir_intrinsics import udiv32
    else:
        from llvmlite import ir
        from numba import types
        from numba.core.extending import intrinsic

        def _to_u32(builder, value, ty):
            """LLVM ``i32`` of integer ``value`` of Numba type ``ty`` (truncated or zero-extended)."""
            i32 = ir.IntType(32)
            if ty.bitwidth > 32:
                return builder.trunc(value, i32)
            return builder.zext(value, i32) if ty.bitwidth < 32 else value

        @intrinsic
        def udiv32(typingctx, a, b):
            """``uint32(a) // uint32(b)`` (``b > 0``; both taken modulo 2**32) as one 32-bit unsigned
            division, which ptxas expands inline (a reciprocal and a correction). Numba's ``//`` on
            integers divides in 64 bits, which compiles to a 32-bit fast path plus a call to a
            64-bit division routine (docs/plans.md)."""
            if not (isinstance(a, types.Integer) and isinstance(b, types.Integer)):
                return None

            def codegen(context, builder, signature, args):
                (ta, tb), (va, vb) = signature.args, args
                return builder.udiv(_to_u32(builder, va, ta), _to_u32(builder, vb, tb))

            return types.uint32(a, b), codegen

    @cuda.jit(device=True)
    def group_max_u32(value, group, buf64):
        """Every lane of the warp: the maximum of the uint32 ``value`` (below 2**31) over its group
        of ``group`` consecutive lanes (a power of two up to 32, the same for every lane: groups
        ``[0, group)``, ``[group, 2 group)``, ...), by butterfly shuffles inside the group (32-bit:
        one shuffle a step). ``buf64`` is the simulator's scratch, unused here. Every lane of the
        warp must call it."""
        v = int32(value)
        offset = group // 2
        while offset > 0:
            v = max(v, cuda.shfl_xor_sync(0xFFFFFFFF, v, offset))
            offset //= 2
        return uint32(v)

    @cuda.jit(device=True)
    def warp_exclusive_sum(value, buf64):
        """Every lane of the warp: ``(the int64 sum of value over the lanes below, over all
        lanes)``, in lane order, by five shuffles up (no barrier; ``buf64`` is the simulator's
        scratch, unused here). Every lane of the warp must call it."""
        v = int64(value)
        offset = 1
        while offset < 32:
            y = cuda.shfl_up_sync(0xFFFFFFFF, v, offset)
            if cuda.laneid >= offset:
                v += y
            offset *= 2
        return v - int64(value), cuda.shfl_sync(0xFFFFFFFF, v, 31)

    @cuda.jit(device=True)
    def warp_sum(value, buf64):
        """Every lane of the warp: the int64 sum of ``value`` over the warp's lanes (butterfly
        shuffles; ``buf64`` is the simulator's scratch, unused here)."""
        v = int64(value)
        offset = 16
        while offset > 0:
            v += cuda.shfl_xor_sync(0xFFFFFFFF, v, offset)
            offset //= 2
        return v


# -- rows cut into warp items ----------------------------------------------------------------------
@cuda.jit(device=True)
def row_parts(n_rows, W, all_warps, warp):
    """Parts to cut each of ``n_rows`` rows of ``W`` words into: the smallest power of two for
    which ``n_rows * parts >= all_warps`` (every warp gets an item), but parts of at least one
    word per lane. Large batches get 1 (a warp per row); a decode batch of 128 rows on 132 x 16
    warps gets 16. Every thread computes the same value."""
    parts = 1
    while n_rows * parts < all_warps and parts * 2 * warp <= W:
        parts *= 2
    return parts


@cuda.jit(device=True)
def interleaved_item(q, all_warps, R):
    """``(source, item)`` of flat warp item ``q`` of ``R x n`` (source, item) pairs: item ``q //
    R``, and a source that rotates with the pass (``q // span``, span = ``all_warps`` rounded
    down to a multiple of R), so a warp stepping by ``all_warps`` visits the sources in turn
    instead of one source per phase: rows for this rank (device memory) and rows for peers
    (NVLink) overlap. A bijection: the R items ``[k R, k R + R)`` share one pass (span is a
    multiple of R), so their sources are R distinct values."""
    span = max(R, all_warps // R * R)
    return (q % R + q // span) % R, q // R


@cuda.jit(device=True)
def most_tokens(counts):
    """The most tokens any source dispatched this call (``counts`` [R, L + 1], the call's group
    of ``dispatch_counts``, ``counts[s, L]`` tokens of source s: the same on every rank)."""
    L = counts.shape[1] - 1
    t_hi = 0
    for s in range(counts.shape[0]):
        t_hi = max(t_hi, counts[s, L])
    return t_hi


@cuda.jit(device=True)
def interleaved_rows(counts, W, all_warps, warp):
    """How :func:`interleaved_item` deals the rows of every source: ``(parts, span, items)``,
    each row of ``W`` words cut into ``parts`` parts of ``span`` words, ``items`` flat warp
    items (R times the most tokens a source sent, times parts: items past a source's own count
    are skipped by the caller). ``counts`` [R, L + 1]: ``counts[s, L]`` tokens of source s."""
    R = counts.shape[0]
    t_hi = most_tokens(counts)
    parts = row_parts(R * t_hi, W, all_warps, warp)
    return parts, part_words(W, parts, warp), R * t_hi * parts


@cuda.jit(device=True)
def part_words(W, parts, warp):
    """Words per part: ``ceil(W / parts)`` rounded up to a multiple of ``warp`` (so each lane's
    words stay aligned to the warp); the last part of a row may be shorter or empty."""
    span = (W + parts - 1) // parts
    return (span + warp - 1) // warp * warp


@cuda.jit(device=True)
def part_bounds(item, parts, span, W):
    """Token and word range of warp item ``item`` when each row of ``W`` words is cut into
    ``parts`` parts of ``span`` words: ``(t, w0, w1)``, words ``[w0, w1)`` of row ``t``
    (empty when ``w0 >= w1``)."""
    t = item // parts
    w0 = (item - t * parts) * span
    return t, w0, min(W, w0 + span)


#: Rows flagged as they land are cut into parts so that the senders' items number about this
#: many (a grid's warps on an H200: 132 x 16).
FLAG_ITEMS = 2048


@cuda.jit(device=True)
def flag_rule(rows, PW, max_parts, warp):
    """``(parts, span)`` of rows of ``PW`` words flagged part by part, when ``rows`` rows are
    sent in all: ``parts = ceil(FLAG_ITEMS / rows)`` clamped to [1, max_parts] and to the row's
    warp-wide chunks, ``ceil(PW / warp)`` (whole rows for large batches, several parts of a row
    for small ones, so a small call still spreads over many warps, and no part narrower than a
    warp), each part ``span`` words (``part_words``: a multiple of ``warp``). A rule of sizes
    every rank knows, so senders and receivers cut rows alike whatever their grids."""
    parts = max(1, min(max_parts, (PW + warp - 1) // warp, (FLAG_ITEMS + max(rows, 1) - 1) // max(rows, 1)))
    return parts, part_words(PW, parts, warp)


@cuda.jit(device=True)
def flag_part(row_flag, me, t, part, n, dests, lane):
    """Every lane of a warp that stored its share of part ``part`` of row t into the ranks whose
    bits are set in ``dests`` (uint64; plain stores, through the mappings or locally): fence at
    system scope, meet, and lane 0 sets ``row_flag[me, t, part]`` on each of them to n + 1
    (data before flag; ``row_flag`` [R, T, parts] uint64 symmetric)."""
    flag_stored(row_flag[me, t, part:part + 1], n, dests, row_flag.shape[0], lane)


@cuda.jit(device=True)
def flag_stored(flag, n, dests, R, lane):
    """Every lane of a warp that stored its share of what ``flag`` (a 1-element uint64 slice of
    a symmetric flag) guards into the PEs whose bits are set in ``dests`` (uint64, PEs below
    R; plain stores): fence at system scope, meet, and lane 0 sets the flag on each of them to
    n + 1 (data before flag)."""
    cuda.threadfence_system()
    warp_sync()
    if lane == 0:
        for d in range(R):
            if (dests >> uint64(d)) & uint64(1):
                shmem.signal_op(flag, uint64(n + 1), shmem.SIGNAL_SET, d)


@cuda.jit(device=True)
def flag_part_listed(row_flag, me, t, part, n, dl, lane):
    """``flag_part`` of a build with destination lists: the ranks of the list ``dl``
    (ep_runtime/kernels/destinations.py) in place of a mask's bits."""
    flag_listed(row_flag[me, t, part:part + 1], n, dl, lane)


@cuda.jit(device=True)
def flag_listed(flag, n, dl, lane):
    """``flag_stored`` to the PEs of the destination list ``dl`` (int32, count first: ep_runtime/
    kernels/destinations.py): fence at system scope, meet, and lane 0 sets the flag on each."""
    cuda.threadfence_system()
    warp_sync()
    if lane == 0:
        for j in range(dl[0]):
            shmem.signal_op(flag, uint64(n + 1), shmem.SIGNAL_SET, dl[1 + j])


@cuda.jit(device=True)
def flag_one(row_flag, me, t, part, n, d, lane):
    """``flag_part`` to the one PE ``d`` (any PE number: no mask), of a build with destination
    lists: fence at system scope, meet, and lane 0 sets ``row_flag[me, t, part]`` on d to n + 1."""
    cuda.threadfence_system()
    warp_sync()
    if lane == 0:
        shmem.signal_op(row_flag[me, t, part:part + 1], uint64(n + 1), shmem.SIGNAL_SET, d)


@cuda.jit(device=True)
def await_part(row_flag, r, t, part, n, timeout_ns, status, kernel, counter):
    """One thread (lane 0 of the warp that will read the part): wait until
    ``row_flag[r, t, part] >= n + 1`` (rank r's part of row t of call n is here): ``await_flag``."""
    return await_flag(row_flag[r, t, part:part + 1], r, t, n, timeout_ns, status, kernel, counter)


@cuda.jit(device=True)
def await_flag(flag, r, t, n, timeout_ns, status, kernel, counter):
    """One thread: wait until ``flag[0] >= n + 1`` (``flag``: a 1-element uint64 slice of a
    flag rank r sets for row t of call n, or for the chunk holding it), bounded by
    ``timeout_ns``; a timeout is recorded naming ``kernel``, rank r and ``counter``, with the
    token in the high half of the observed value. Returns whether the flag was seen. The caller
    fences before its warp reads what the flag guards."""
    seen = shmem.wait_signal_ge(flag, uint64(n + 1), timeout_ns)
    if seen < uint64(n + 1):
        record_error(status, ERR_TIMEOUT, kernel, shmem.my_pe(), r, counter, n + 1,
                     (int64(t) << 32) | int64(seen & uint64(0xFFFFFFFF)), n + 1)
        return False
    return True


@cuda.jit(device=True)
def local_expert_count(ids, L, me):
    """How many of a token's expert ids (``ids`` [K] int32) belong to rank ``me`` (``L`` local
    experts per rank): ids in ``[me * L, me * L + L)``, two comparisons each (no division)."""
    lo = me * L
    hi = lo + L
    n = 0
    for k in range(ids.shape[0]):
        x = ids[k]
        if x >= lo and x < hi:
            n += 1
    return n
