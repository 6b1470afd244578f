"""The expert-major placement (the expanded and compact layouts'): where each received row goes
in the expert batch, its placement table and row descriptions.

Every receiver (dispatch_wait, dispatch_land, a route-first dispatch_wait's placing blocks)
places rows by the same rule (docs/protocol.md, "Placement"): expert-major, then source rank,
then source token, as the NumPy reference lays them out. Row ``r`` of local expert ``e`` from
source ``s`` is the expert's first row, plus the rows of ``e`` from sources before ``s``, plus
the token's rank among ``s``'s tokens with ``e``. The table lives in shared memory:
``place[s L + e]`` is the first row of source ``s``'s rows of expert ``e`` and
``place[R L + e]`` the end of ``e``'s received rows (its padding to ``pad_multiple`` follows).

:func:`make_placement` builds the device functions for a block size: the table's
(:func:`make_table`) and the rows' (:func:`make_rows`).
"""

import functools
from types import SimpleNamespace

from ep_runtime.kernels.block import block_exclusive_scan, udiv32, warp_exclusive_sum, warp_geometry
from ep_runtime.kernels.cuda_api import cuda, int32, int64


@functools.lru_cache(maxsize=None)
def make_table(threads: int) -> SimpleNamespace:
    """The placement table's device functions for blocks of ``threads`` threads: ``padded``,
    ``scan_placement``, ``first_rows``, ``write_segments``, ``zero_padding_rows``,
    ``expert_warps``."""
    warp, warps = warp_geometry(threads)

    @cuda.jit(device=True)
    def padded(rows, pad_multiple):
        """``rows`` rounded up to a multiple of ``pad_multiple`` (an expert's segment size)."""
        if pad_multiple == 1:
            return rows
        return (rows + pad_multiple - 1) // pad_multiple * pad_multiple

    @cuda.jit(device=True)
    def scan_placement(d_counts, g, pad_multiple, place, scan_buf):
        """Every thread of the block: the placement table of group ``g`` from the senders'
        counts, and the total padded rows (returned, int64). ``place`` (shared int32, at least
        ``(R + 1) L`` words).

        The counts (``d_counts[g]``, [R, L + 1] int32, each row written by its source) are
        loaded once, a word per thread, into rows 1..R of the table; a thread per run of local
        experts sums its padded rows and the block scans the sums (``block_exclusive_scan``);
        each thread then turns its experts' counts into first rows in place (row s + 1 holds
        source s's count until row s takes its first row). Deterministic; every block computes
        it (none waits for another)."""
        R = d_counts.shape[1]
        L1 = d_counts.shape[2]
        L = L1 - 1
        tid = cuda.threadIdx.x
        for i in range(tid, R * L1, threads):  # coalesced: the group's counts rows are contiguous
            s = int32(udiv32(i, L1))
            e = i - s * L1
            if e < L:
                place[(s + 1) * L + e] = d_counts[g, s, e]
        cuda.syncthreads()
        per = (L + threads - 1) // threads  # local experts per thread
        e_lo = min(tid * per, L)
        e_hi = min(e_lo + per, L)
        part = int64(0)
        for e in range(e_lo, e_hi):
            rows = int64(0)
            for s in range(R):
                rows += place[(s + 1) * L + e]
            part += padded(rows, pad_multiple)
        first, total = block_exclusive_scan(scan_buf, part)
        for e in range(e_lo, e_hi):
            row = first
            for s in range(R):
                c = place[(s + 1) * L + e]
                place[s * L + e] = int32(row)
                row += c
            place[R * L + e] = int32(row)
            first += padded(row - place[e], pad_multiple)
        cuda.syncthreads()
        return total

    @cuda.jit(device=True)
    def first_rows(place, R, L, pad_multiple, row_offsets, expert_counts, sum_buf):
        """Every thread: ``place[R L + e]`` (expert e's received rows, counted by the receiver)
        -> ``place[e]`` its first row and ``place[R L + e]`` the end of its received rows,
        scanned by the first warp alone (shuffles, no block barrier but the last), which also
        writes row_offsets [L + 1] and expert_counts [L]. Returns the total padded rows (int64)."""
        tid = cuda.threadIdx.x
        if tid < warp:
            per = (L + warp - 1) // warp  # local experts per lane
            e_lo = min(tid * per, L)
            e_hi = min(e_lo + per, L)
            part = int64(0)
            for e in range(e_lo, e_hi):
                part += padded(int64(place[R * L + e]), pad_multiple)
            first, total = warp_exclusive_sum(part, sum_buf)
            for e in range(e_lo, e_hi):
                c = place[R * L + e]
                place[e] = int32(first)
                place[R * L + e] = int32(first + c)
                row_offsets[e] = int32(first)
                expert_counts[e] = c
                first += padded(int64(c), pad_multiple)
            if tid == 0:
                sum_buf[threads - 1] = total  # (the simulator's scan used the buffer: read before this)
                row_offsets[L] = int32(total)
        cuda.syncthreads()
        total = sum_buf[threads - 1]
        cuda.syncthreads()  # read by every thread before the buffer is used again
        return total

    @cuda.jit(device=True)
    def write_segments(place, R, L, pad_multiple, row_offsets, expert_counts, row_src_rank, row_src_token, row_src_k,
                       row_weight, row_gather, e0, stride, lane):
        """A warp per local expert (``e0``, ``e0 + stride``, ...): its offset and count (from the
        placement table ``place`` of R sources and L local experts) and its padding rows'
        descriptions (source -1, weight 0)."""
        e = e0
        while e < L:
            base = place[e]
            count = place[R * L + e] - base
            end = base + padded(count, pad_multiple)
            for r in range(base + count + lane, end, warp):
                row_src_rank[r] = -1
                row_src_token[r] = -1
                row_src_k[r] = -1
                row_weight[r] = 0.0
                row_gather[r] = -1
            if lane == 0:
                row_offsets[e] = base
                expert_counts[e] = count
            e += stride

    @cuda.jit(device=True)
    def zero_padding_rows(place, R, L, pad_multiple, expert_x, e0, stride, lane):
        """A warp per local expert (``e0``, ``e0 + stride``, ...): zero its padding rows of
        expert_x [C, W] words (the placement table ``place``)."""
        W = expert_x.shape[1]
        e = e0
        while e < L:
            base = place[e]
            count = place[R * L + e] - base
            for r in range(base + count, base + padded(count, pad_multiple)):
                for w in range(lane, W, warp):
                    expert_x[r, w] = 0
            e += stride

    @cuda.jit(device=True)
    def expert_warps(tid):
        """``(e0, stride)`` of a warp per local expert from the grid's last block down (the
        first blocks place the rows)."""
        return (cuda.gridDim.x - 1 - cuda.blockIdx.x) * warps + tid // warp, cuda.gridDim.x * warps

    return SimpleNamespace(padded=padded, scan_placement=scan_placement, first_rows=first_rows,
                           write_segments=write_segments, zero_padding_rows=zero_padding_rows,
                           expert_warps=expert_warps)


@functools.lru_cache(maxsize=None)
def make_rows(threads: int) -> SimpleNamespace:
    """The rows' device functions: ``describe_row``, ``row_of``, ``token_of``."""

    @cuda.jit(device=True)
    def describe_row(r, s, t, k, j, Tmax, w, row_src_rank, row_src_token, row_src_k, row_weight, row_gather,
                     token_rows):
        """Write batch row ``r``'s description: token ``t`` of source ``s`` for its ``k``-th expert,
        the ``j``-th of its local experts (ascending), router weight ``w``. One thread."""
        row_src_rank[r] = s
        row_src_token[r] = t
        row_src_k[r] = k
        row_weight[r] = w
        row_gather[r] = s * Tmax + t
        token_rows[s, t, j] = r

    @cuda.jit(device=True)
    def row_of(d_ids, d_ranks, place, L, g, s, t, k, first_mine):
        """``(r, j)``: the batch row of received (source s, token t, slot k) and the rank of its
        expert among the token's local experts (ascending), or ``(-1, -1)`` when the expert is
        not local: r = the first row of source s's rows of the expert (``place``) + the rank the
        source gave the token. The id and the rank are loaded together."""
        x = d_ids[g, s, t, k]
        rank = d_ranks[g, s, t, k]
        e = x - first_mine
        if e < 0 or e >= L:
            return int32(-1), int32(-1)
        r = int32(place[s * L + e] + rank)
        j = int32(0)
        for k2 in range(d_ids.shape[3]):
            x2 = d_ids[g, s, t, k2]
            if x2 >= first_mine and x2 < x:
                j += 1
        return r, j

    @cuda.jit(device=True)
    def token_of(q, src_T, R):
        """``(s, t)``: received token ``q`` of every source's tokens in order (source 0's first;
        ``src_T`` [R] shared int32, each source's T)."""
        s = 0
        while s < R - 1 and q >= src_T[s]:
            q -= src_T[s]
            s += 1
        return s, q

    return SimpleNamespace(describe_row=describe_row, row_of=row_of, token_of=token_of)


@functools.lru_cache(maxsize=None)
def make_placement(threads: int) -> SimpleNamespace:
    """The placement device functions for blocks of ``threads`` threads (every one a closure
    over the block geometry): :func:`make_table`'s and :func:`make_rows`'."""
    return SimpleNamespace(**vars(make_table(threads)), **vars(make_rows(threads)))
