"""The batched layout: DeepEP's low-latency rows, ``[local experts, M, hidden]``, written by a kernel.

The placement is the expert-major one (:mod:`.expert_major`) with a fixed stride per expert:
the row of local expert ``e`` at slot ``pos`` (its rank among the expert's rows: source rank
ascending, then the source's token order) is batched row ``e * M + pos``, where ``M = R Tmax``
(every rank's most tokens: DeepEP's ``num_max_dispatch_tokens_per_rank * num_ranks``), so no
prefix over the experts decides where an expert's rows start and the batch's shape is the same
every call (one CUDA graph serves every step). The receive kernels place rows as for the
compact layout (``row_offsets``, ``expert_counts``, the row descriptions; nothing copied);
``dispatch_batched`` (:func:`make_dispatch_batched`), after the receive kernel on the same
stream, copies each placed row ``r`` of expert ``e`` (slot ``pos = r - row_offsets[e]``) from
its receive-buffer slot (``row_gather[r]``) to batched row ``e * M + pos``, with its block
scales laid out by the codec (``lay_out_batched``: column-major per expert, float32 or UE8M0
packed four to an int32), and writes the per-expert counts, each slot's source token and each
(expert, source rank)'s range of slots. Slots past an expert's count are not written (stale).

:func:`make_layout` is the interface the receive kernels are built with (the compact layout's).
"""

import functools

from ep_runtime.kernels.block import part_bounds, part_words, row_parts, warp_geometry
from ep_runtime.kernels.codecs import CodecSpec, make_receiver
from ep_runtime.kernels.cuda_api import cuda, int32, int64, kernel_jit, uint64
from ep_runtime.kernels.layouts.compact import make_layout as make_compact_layout
from ep_runtime.kernels.layouts.expanded import COPY_PAIRS, COPY_UNROLL, make_row_copy
from ep_runtime.kernels.pdl import make_pdl, programmatic
from ep_runtime.kernels.protocol import STATUS_CODE
from ep_runtime.kernels.trace import stamp_first, stamp_last

#: ``batched_layout_range[e, s]``: the first slot of source s's rows of expert e in the high 32
#: bits, their count in the low 32 (DeepEP's ``layout_range`` encoding).
RANGE_SHIFT = 32


@cuda.jit(device=True)
def expert_of(row_offsets, L, r):
    """The local expert whose rows hold placed row ``r``: the largest ``e < L`` with
    ``row_offsets[e] <= r`` (a binary search of the [L + 1] offsets)."""
    lo = 0
    hi = L - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if row_offsets[mid] <= r:
            lo = mid
        else:
            hi = mid - 1
    return lo


@cuda.jit(device=True)
def first_of_source(row_src_rank, lo, hi, s):
    """The first of rows ``[lo, hi)`` (one expert's, source-major) whose source rank is at least
    ``s`` (``hi`` when none): a binary search of ``row_src_rank``."""
    while lo < hi:
        mid = (lo + hi) // 2
        if row_src_rank[mid] < s:
            lo = mid + 1
        else:
            hi = mid
    return lo


@functools.lru_cache(maxsize=None)
def make_dispatch_batched(threads: int, codec: CodecSpec, pdl: bool):
    """The ``dispatch_batched`` kernel for blocks of ``threads`` threads, a token format's
    ``codec`` (its receiver lays out the scales a message carries) and PDL."""
    warp, warps = warp_geometry(threads)
    U = COPY_UNROLL
    CP = COPY_PAIRS
    copy = make_row_copy(threads)
    copy_in_pairs, copy_to_rows = copy.copy_in_pairs, copy.copy_to_rows
    lay_out_batched = make_receiver(codec, threads).lay_out_batched
    pdl_wait, pdl_trigger = make_pdl(pdl)

    @kernel_jit(threads)
    def dispatch_batched(dispatch_tokens, dispatch_counts, status, row_offsets, expert_counts,
                         row_gather, row_src_rank, token_rows, row_weight, batched_x, batched_counts, batched_src_token,
                         batched_layout_range, batched_token_rows, batched_row_weight, dispatch_tokens_u8,
                         batched_scales_u8, scales_form):
        """Lay the placed rows out as DeepEP's low-latency batch; after the receive kernel, same stream.

        Inputs: dispatch_tokens [R, Tmax, W'] words (the rows of the call, all in once the receive kernel
        ended), dispatch_counts [G, R, L + 1] (its shape: R, L), row_offsets [L + 1], expert_counts [L],
        row_gather [rows] (``s * Tmax + t`` of each placed row, -1 on padding), row_src_rank [rows], token_rows
        [R, Tmax, K] and row_weight [rows] as the receive kernel wrote them. Outputs (local, M = R Tmax slots
        per expert): batched_x [L M, W] words (bf16 rows, or a quantized format's first W words of each message,
        its codes), batched_scales_u8 (a uint8 view of the [L M S] float32 scales region: ``lay_out_batched``
        with ``scales_form``, int64, a BATCHED_SCALES_* constant), batched_counts [L] int32 (each expert's
        rows), batched_src_token [L, M] int32 (each slot's token index on its source rank), batched_layout_range
        [L, R] int64 (each source's first slot and count, :data:`RANGE_SHIFT`), and what the combine reads the
        batch through: batched_token_rows [R, Tmax, K] int32 (``token_rows`` with each row as its batched row
        ``e M + pos``) and batched_row_weight [L M] float32 (each batched row's router weight). Slots past an
        expert's count are not written.

        A warp per part of a placed row (``row_parts`` of ``row_offsets[L]`` rows over the grid's warps) finds
        the row's expert (``expert_of``), copies the words to ``e * M + pos`` (``copy_to_rows``) and, holding
        the row's first part, its source token, weight, batched token row and scales. A thread per local expert
        writes its count and, per source, its range (``first_of_source``: the expert's rows are source-major).
        An earlier error (the status record) makes it return without writing.
        """
        dst_row = cuda.local.array(1, int32)
        vals = cuda.local.array(U, uint64)
        lo = cuda.local.array(CP, uint64)  # copy_to_rows' pairs
        hi = cuda.local.array(CP, uint64)
        pdl_trigger()
        pdl_wait()  # nothing stream-ordered is read before this (ep_runtime/kernels/pdl.py)
        if status[STATUS_CODE] != 0:
            return
        stamp_first(status, 7)
        R = dispatch_counts.shape[1]
        L = dispatch_counts.shape[2] - 1
        Tmax = dispatch_tokens.shape[1]
        M = batched_src_token.shape[1]
        W = batched_x.shape[1]
        S = batched_scales_u8.shape[0] // (4 * L * M) if L * M > 0 else 0  # block scales per row
        tid = cuda.threadIdx.x
        lane = tid % warp

        # per local expert: its count and each source's range of slots
        e = cuda.blockIdx.x * threads + tid
        while e < L:
            batched_counts[e] = expert_counts[e]
            lo_row = row_offsets[e]
            end = lo_row + expert_counts[e]
            for s in range(R):
                hi_row = first_of_source(row_src_rank, lo_row, end, s + 1)
                batched_layout_range[e, s] = (int64(lo_row - row_offsets[e]) << RANGE_SHIFT) | int64(hi_row - lo_row)
                lo_row = hi_row
            e += cuda.gridDim.x * threads

        # a warp per part of a placed row: its words, then (first part) its source token and scales
        pairs = copy_in_pairs(dispatch_tokens, batched_x)
        all_warps = cuda.gridDim.x * warps
        rows = row_offsets[L]
        parts = row_parts(rows, W, all_warps, warp)
        span = part_words(W, parts, warp)
        i = cuda.blockIdx.x * warps + tid // warp
        while i < rows * parts:
            r, w0, w1 = part_bounds(i, parts, span, W)
            at = row_gather[r]
            if at >= 0:  # (padding rows, with pad_multiple, have none)
                e = expert_of(row_offsets, L, r)
                pos = r - row_offsets[e]
                s = at // Tmax
                t = at - s * Tmax
                dst_row[0] = int32(e * M + pos)
                copy_to_rows(dispatch_tokens[s, t], dst_row, 1, batched_x, w0, w1, pairs, lane, lo, hi, vals)
                if w0 == 0:
                    if lane == 0:
                        batched_src_token[e, pos] = t
                        batched_row_weight[e * M + pos] = row_weight[r]
                        for j in range(token_rows.shape[2]):  # the row's place among the token's rows
                            if token_rows[s, t, j] == r:
                                batched_token_rows[s, t, j] = int32(e * M + pos)
                    lay_out_batched(dispatch_tokens_u8[s, t], W * 8, S, batched_scales_u8, e, pos, M, scales_form,
                                    lane)
            i += all_warps
        stamp_last(status, 21)

    return programmatic(dispatch_batched, pdl)


@functools.lru_cache(maxsize=None)
def make_layout(threads: int):
    """The batched layout for blocks of ``threads`` threads (:mod:`ep_runtime.kernels.layouts`): the
    receive kernels place and copy as for the compact layout (no expert batch); the batched rows
    are ``dispatch_batched``'s (:func:`make_dispatch_batched`)."""
    return make_compact_layout(threads)
