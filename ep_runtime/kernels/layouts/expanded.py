"""The expanded layout: one row per (token, local expert), expert-major, copied into the batch.

Its rows are placed by the expert-major rule (:mod:`.expert_major`) and copied from the receive
buffer into ``expert_x`` once every row is described and every token row is in: ``expand_rows``
(the ``dispatch_copy`` kernel's, for every batch size): token-major, a warp per received row part
reads each word once and stores it to the token's local expert rows, then a warp per local expert
zeroes its padding rows; the codec's receiver lays out what a message carries besides its payload
words (FP8: the scales). ``gather_rows`` (a route-first dispatch_wait that copies in the same
launch, at decode sizes): row-major, a warp per expert row part reads its source slot, then the
words. dispatch_land copies each landed part with ``copy_to_rows``.

:func:`make_dispatch_copy` builds the kernel; :func:`make_row_copy`, :func:`make_expand_rows` and
:func:`make_gather_rows` the copies the receivers share.
"""

import functools
from types import SimpleNamespace

from ep_runtime.kernels import shmem
from ep_runtime.kernels.block import local_expert_count, part_bounds, part_words, row_parts, warp_geometry
from ep_runtime.kernels.cuda_api import cuda, kernel_jit, uint64
from ep_runtime.kernels.layouts.expert_major import make_placement
from ep_runtime.kernels.pdl import make_pdl, programmatic
from ep_runtime.kernels.protocol import STATUS_CODE, SYNC_CALLS
from ep_runtime.kernels.codecs import CodecSpec, make_receiver
from ep_runtime.kernels.trace import stamp_first, stamp_last
from ep_runtime.kernels.vec import make_pair_loops, pairs_aligned

#: Words of a row each lane loads before storing any where rows are not in 16-byte word pairs.
COPY_UNROLL = 8
#: Word pairs per lane that ``copy_to_rows`` loads before storing any: 128 bytes per lane, 64 KB
#: per 512-thread block in flight (docs/plans.md, "Copy depth").
COPY_PAIRS = 8
#: Word pairs per lane in flight in ``gather_rows``, the copy inside a route-first dispatch_wait,
#: whose placement leaves fewer registers: 8 pairs spilled there, 4 fit with no spill.
WAIT_COPY_PAIRS = 4


@functools.lru_cache(maxsize=None)
def make_row_copy(threads: int) -> SimpleNamespace:
    """``copy_in_pairs`` and ``copy_to_rows`` (``COPY_PAIRS`` deep) for blocks of ``threads``
    threads."""
    warp, _ = warp_geometry(threads)
    U = COPY_UNROLL
    CP = COPY_PAIRS
    load_cp, store_cp, _ = make_pair_loops(CP, warp)

    @cuda.jit(device=True)
    def copy_in_pairs(d_tokens, expert_x):
        """Whether received rows (``d_tokens`` [R, Tmax, W'] words) go to ``expert_x`` [C, W]
        words as word pairs (one 16-byte access for uint64 words): every row of both starts
        aligned to two words."""
        return (expert_x.shape[1] % 2 == 0 and d_tokens.shape[2] % 2 == 0 and pairs_aligned(d_tokens)
                and pairs_aligned(expert_x))

    @cuda.jit(device=True)
    def copy_to_rows(src, rows, n_local, expert_x, w0, w1, pairs, lane, lo, hi, vals):
        """Every lane of one warp: words ``[w0, w1)`` of the received row ``src`` into the
        ``n_local`` expert rows ``expert_x[rows[j]]``, each word loaded once: ``CP`` word
        pairs per lane in flight when ``pairs`` (w0, w1 even; lo, hi local [CP]), else ``U``
        words."""
        w = w0 + 2 * lane
        while pairs and w < w1:
            load_cp(src, w, w1, lo, hi)
            for j in range(n_local):
                store_cp(expert_x[rows[j]], w, w1, lo, hi)
            w += 2 * CP * warp
        w = w0 + lane
        while not pairs and w < w1:
            for u in range(U):
                if w + u * warp < w1:
                    vals[u] = src[w + u * warp]
            for j in range(n_local):
                dst = expert_x[rows[j]]
                for u in range(U):
                    if w + u * warp < w1:
                        dst[w + u * warp] = vals[u]
            w += U * warp

    return SimpleNamespace(copy_in_pairs=copy_in_pairs, copy_to_rows=copy_to_rows)


@functools.lru_cache(maxsize=None)
def make_expand_rows(threads: int, codec: CodecSpec) -> SimpleNamespace:
    """``expand_rows`` for blocks of ``threads`` threads and a token format's ``codec``, whose
    receiver lays out what a message carries besides its payload words (FP8: the scales)."""
    warp, warps = warp_geometry(threads)
    copy = make_row_copy(threads)
    copy_in_pairs, copy_to_rows = copy.copy_in_pairs, copy.copy_to_rows
    receiver = make_receiver(codec, threads)
    lay_out, zero_extras = receiver.lay_out, receiver.zero

    @cuda.jit(device=True)
    def expand_rows(d_tokens, d_ids, d_counts, g, token_rows, row_offsets, expert_counts, expert_x, status,
                    d_tokens8, expert_scales8, XB, scales_col_major, lo, hi, vals):
        """Every thread of the grid, once every row of call group g is described and every
        token row is in: copy each received row once to all its expert rows, then zero the
        padding rows.

        Token-major: a warp per received row part (``row_parts``: whole rows for large
        batches; source s's T from ``d_counts[g, s, L]``) reads each word once and stores it
        to the token's n_local expert rows (``copy_to_rows``). Then a warp per local expert
        zeroes its padding rows. The codec's extras (``d_tokens8``, ``expert_scales8``, ``XB``
        bytes per row, ``scales_col_major``: FP8 scales) are laid out by the warp holding a
        row's first part (``lay_out``); padding rows get zeros. Scratch: lo, hi local [pairs in
        flight], vals local [U]."""
        stamp_first(status, 12)
        me = shmem.my_pe()
        R = d_counts.shape[1]
        L = d_counts.shape[2] - 1
        W = expert_x.shape[1]
        C = expert_x.shape[0]
        pairs = copy_in_pairs(d_tokens, expert_x)
        lane = cuda.threadIdx.x % warp
        first_warp = cuda.blockIdx.x * warps + cuda.threadIdx.x // warp
        all_warps = cuda.gridDim.x * warps

        for s in range(R):
            T_s = d_counts[g, s, L]
            parts = row_parts(T_s, W, all_warps, warp)
            span = part_words(W, parts, warp)
            i = first_warp
            while i < T_s * parts:
                t, w0, w1 = part_bounds(i, parts, span, W)
                n_local = local_expert_count(d_ids[g, s, t], L, me)
                copy_to_rows(d_tokens[s, t], token_rows[s, t], n_local, expert_x, w0, w1, pairs, lane, lo, hi,
                             vals)
                if w0 == 0:
                    for j in range(n_local):
                        lay_out(d_tokens8[s, t], W * 8, XB, expert_scales8, token_rows[s, t, j], C, scales_col_major,
                                lane)
                i += all_warps

        e = first_warp
        while e < L:
            for r in range(row_offsets[e] + expert_counts[e], row_offsets[e + 1]):
                for w in range(lane, W, warp):
                    expert_x[r, w] = 0
                zero_extras(XB, expert_scales8, r, C, scales_col_major, lane)
            e += all_warps
        stamp_last(status, 13)

    return SimpleNamespace(expand_rows=expand_rows)


@functools.lru_cache(maxsize=None)
def make_gather_rows(threads: int) -> SimpleNamespace:
    """``gather_rows`` (``WAIT_COPY_PAIRS`` deep) for blocks of ``threads`` threads."""
    warp, warps = warp_geometry(threads)
    copy_in_pairs = make_row_copy(threads).copy_in_pairs
    load_wcp, store_wcp, _ = make_pair_loops(WAIT_COPY_PAIRS, warp)

    @cuda.jit(device=True)
    def gather_rows(d_tokens, row_gather, row_offsets, L, expert_x, status, lo, hi, block, blocks):
        """Every thread of the ``blocks`` copying blocks of a route-first dispatch_wait (this one
        is copying block ``block``), once every row is described and every token row is in:
        expert row r (below ``row_offsets[L]``, the rows placed) is received row
        ``row_gather[r]`` (``s * Tmax + t`` of d_tokens [R, Tmax, W] words), or zeros for a
        padding row (-1).

        Row-major: a warp per part of an expert row (``row_parts`` of the rows placed) reads its
        row's source slot, then the words, and stores them (``WAIT_COPY_PAIRS`` word pairs per
        lane in flight, or a word at a time where rows are not in word pairs). A received row is
        read once per local expert, the repeats from L2, so that no warp waits on a token's ids
        and row list before its words: at decode sizes every warp has about one item and that
        chain of loads is its time (docs/plans.md, "The expanded copy at decode sizes").
        Scratch: lo, hi local [WAIT_COPY_PAIRS]."""
        if block == 0:  # the copy's start: its first copying block (block 0 may be placing)
            stamp_last(status, 12)
        W = expert_x.shape[1]
        Tmax = d_tokens.shape[1]
        pairs = copy_in_pairs(d_tokens, expert_x)
        lane = cuda.threadIdx.x % warp
        first_warp = block * warps + cuda.threadIdx.x // warp
        all_warps = blocks * warps
        rows = row_offsets[L]
        parts = row_parts(rows, W, all_warps, warp)
        span = part_words(W, parts, warp)
        i = first_warp
        while i < rows * parts:
            r, w0, w1 = part_bounds(i, parts, span, W)
            at = row_gather[r]
            if at < 0:  # a padding row
                for w in range(w0 + lane, w1, warp):
                    expert_x[r, w] = 0
            else:
                s = at // Tmax
                src = d_tokens[s, at - s * Tmax]
                w = w0 + 2 * lane
                while pairs and w < w1:
                    load_wcp(src, w, w1, lo, hi)
                    store_wcp(expert_x[r], w, w1, lo, hi)
                    w += 2 * WAIT_COPY_PAIRS * warp
                if not pairs:
                    for w in range(w0 + lane, w1, warp):
                        expert_x[r, w] = src[w]
            i += all_warps
        stamp_last(status, 13)

    return SimpleNamespace(gather_rows=gather_rows)


@functools.lru_cache(maxsize=None)
def make_dispatch_copy(threads: int, codec: CodecSpec, pdl: bool):
    """The ``dispatch_copy`` kernel for blocks of ``threads`` threads, a token format's ``codec``
    and PDL."""
    U = COPY_UNROLL
    CP = COPY_PAIRS
    expand_rows = make_expand_rows(threads, codec).expand_rows
    pdl_wait, pdl_trigger = make_pdl(pdl)

    @kernel_jit(threads, shmem_in_device_functions=True)
    def dispatch_copy(dispatch_tokens, dispatch_topk_ids, dispatch_counts, dispatch_async_sync, token_rows, row_offsets,
                      expert_counts, expert_x, status, dispatch_tokens_u8, expert_scales_u8, scales_col_major):
        """Copy each received token row once to all its expert rows; zero the padding rows.

        dispatch_tokens [R, Tmax, W] words (symmetric: the rows of the last call), dispatch_topk_ids [G, R,
        Tmax, K], dispatch_counts [G, R, L + 1]; token_rows, row_offsets, expert_counts as the receive kernel
        wrote them; expert_x [C, W] words (output). Runs after the receive kernel on the same stream and reads
        only what it waited for (``expand_rows``).

        FP8 token formats: dispatch_tokens holds messages ([R, Tmax, MW] words; dispatch_tokens_u8 a uint8
        view); the first ``P = expert_x.shape[1]`` words of each (the codes) go to expert_x, and the scale
        bytes to expert_scales_u8 (a uint8 view of [C * S] scales, row-major, or column-major when
        scales_col_major, int64, is nonzero); padding rows get zero scales.
        """
        vals = cuda.local.array(U, uint64)
        lo = cuda.local.array(CP, uint64)  # copy_to_rows' pairs
        hi = cuda.local.array(CP, uint64)
        pdl_trigger()
        pdl_wait()  # nothing stream-ordered is read before this (ep_runtime/kernels/pdl.py)
        if status[STATUS_CODE] != 0:
            return
        n = dispatch_async_sync[SYNC_CALLS] - 1
        C = expert_x.shape[0]
        XB = expert_scales_u8.shape[0] // C if C > 0 else 0  # the codec's extra bytes per row (FP8 scales)
        expand_rows(dispatch_tokens, dispatch_topk_ids, dispatch_counts, n % 2, token_rows, row_offsets, expert_counts,
                    expert_x, status, dispatch_tokens_u8, expert_scales_u8, XB, scales_col_major, lo, hi, vals)

    return programmatic(dispatch_copy, pdl)


@functools.lru_cache(maxsize=None)
def make_layout(threads: int) -> SimpleNamespace:
    """The expanded layout for blocks of ``threads`` threads (:mod:`ep_runtime.kernels.layouts`)."""
    copy = make_row_copy(threads)
    return SimpleNamespace(**vars(make_placement(threads)), COPIES=True, copy_in_pairs=copy.copy_in_pairs,
                           copy_to_rows=copy.copy_to_rows, gather_rows=make_gather_rows(threads).gather_rows)
