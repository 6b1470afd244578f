"""Combine, send half: the weighted sums of ``combine_async``, one partial row part at a time.

A token's partial is the sum over its local experts, in ascending order, of router weight times
expert output, in float32 from 0, rounded to bf16 or kept float32 (``partials.py``: ``P``
partial words a token word). The warp of a part computes it U words per lane in flight and
stores it where the transport says: this rank's row, a stage row, or a peer's row through its
NVLink mapping. docs/protocol.md has the summation order.

:func:`make_partial_sums` builds the device functions for a block size, token word and partial
format.
"""

import functools
from types import SimpleNamespace

from ep_runtime.kernels.bits import bf16_bits_at, f32_bits_at, word_f32
from ep_runtime.kernels.cuda_api import cuda, float32, inlined, uint64
from ep_runtime.kernels.partials import partial_geometry
from ep_runtime.kernels.vec import make_pair_loops, pack_f32x2, store_pair, store_pair_at, store_word_at


@functools.lru_cache(maxsize=None)
def make_partial_sums(threads: int, word: str, f32_partials: bool) -> SimpleNamespace:
    """The partial sums' device functions for blocks of ``threads`` threads, token words of
    ``word`` (a NumPy dtype name) and the partial format (``f32_partials``: float32, ``P = 2``
    partial words a token word, folded at compile time): ``store_partial_pair``,
    ``store_partial_pair_at`` and ``sum_part``."""
    geo = partial_geometry(threads, word, f32_partials)
    warp, word_t, pack, F32 = geo.warp, geo.word_t, geo.pack, geo.F32
    rounded_word = geo.rounded_word
    U = geo.U
    UP = geo.UP  # word pairs per lane in flight (pair loops)
    load_pairs, _, _ = make_pair_loops(UP, warp)

    @cuda.jit(device=True)
    def store_partial_pair(dst, wu, acc, b):
        """Store the partials of token words wu, wu + 1 (acc[b .. b + 2 pack - 1]) into the
        partial row ``dst``: rounded to bf16 (one word pair), or float32 unrounded (``F32``:
        partial words 2 wu .. 2 wu + 3, two pairs)."""
        if F32:
            store_pair(dst, 2 * wu, pack_f32x2(acc[b], acc[b + 1]), pack_f32x2(acc[b + 2], acc[b + 3]))
            store_pair(dst, 2 * wu + 2, pack_f32x2(acc[b + 4], acc[b + 5]), pack_f32x2(acc[b + 6], acc[b + 7]))
        else:
            store_pair(dst, wu, rounded_word(acc, b), rounded_word(acc, b + pack))

    @cuda.jit(device=True)
    def store_partial_pair_at(row, wu, acc, b):
        """As ``store_partial_pair``, into the partial row at address ``row`` (a peer's, through
        its NVLink mapping; uint64 words)."""
        if F32:
            store_pair_at(row, 2 * wu, pack_f32x2(acc[b], acc[b + 1]), pack_f32x2(acc[b + 2], acc[b + 3]))
            store_pair_at(row, 2 * wu + 2, pack_f32x2(acc[b + 4], acc[b + 5]), pack_f32x2(acc[b + 6], acc[b + 7]))
        else:
            store_pair_at(row, wu, uint64(rounded_word(acc, b)), uint64(rounded_word(acc, b + pack)))

    @inlined
    def sum_part(expert_out, token_rows, row_weight, s, t, n_local, w0, w1, in_pairs, to_peer, stored, dst, peer_row,
                 lane, acc, vals, lo, hi):
        """Every lane of one warp: the partial of token words ``[w0, w1)`` of token ``t`` of rank
        ``s``: the sum over its ``n_local`` local experts (rows ``token_rows[s, t, :n_local]``
        of expert_out [>= rows, W] words, weights ``row_weight[r]`` float32), ascending, of
        weight * output, in float32 from 0, rounded to bf16 (or kept float32: token word w
        becomes partial words P w .. P w + P - 1).

        ``in_pairs``: U / 2 word pairs per lane in flight (16-byte accesses), stored into the
        partial row ``dst`` (``store_partial_pair``) or, ``to_peer``, the row at address
        ``peer_row`` (``store_partial_pair_at``); else U words per lane, a partial word per lane
        per step, into ``dst`` or (``stored``) at ``peer_row``. Every row's loads are issued
        before use. ``acc`` (local float32 [U pack]), ``vals`` (local [U] words), ``lo``, ``hi``
        (local [U / 2] words): the lanes' registers, their lanes past the row's end finite."""
        w = w0 + 2 * lane
        while in_pairs and w < w1:  # UP word pairs per lane: every row's loads issued before use
            for x in range(U * pack):
                acc[x] = float32(0.0)
            for j in range(n_local):
                r = token_rows[s, t, j]
                weight = row_weight[r]
                load_pairs(expert_out[r], w, w1, lo, hi)
                for u in range(UP):
                    for x in range(pack):
                        acc[2 * u * pack + x] += weight * word_f32(lo[u], x)
                        acc[(2 * u + 1) * pack + x] += weight * word_f32(hi[u], x)
            for u in range(UP):
                if w + 2 * u * warp < w1:
                    if to_peer:
                        store_partial_pair_at(peer_row, w + 2 * u * warp, acc, 2 * u * pack)
                    else:
                        store_partial_pair(dst, w + 2 * u * warp, acc, 2 * u * pack)
            w += 2 * UP * warp
        w = w0 + lane
        while not in_pairs and w < w1:  # U words per lane: every row's loads issued before use
            for x in range(U * pack):
                acc[x] = float32(0.0)
            for j in range(n_local):
                r = token_rows[s, t, j]
                weight = row_weight[r]
                src = expert_out[r]
                for u in range(U):
                    if w + u * warp < w1:
                        vals[u] = src[w + u * warp]
                for u in range(U):
                    for x in range(pack):
                        acc[u * pack + x] += weight * word_f32(vals[u], x)
            for u in range(U):
                if w + u * warp < w1:
                    if F32:  # unrounded: partial words 2 wu, 2 wu + 1
                        wu = w + u * warp
                        p0 = f32_bits_at(acc[u * 4], 0) | f32_bits_at(acc[u * 4 + 1], 1)
                        p1 = f32_bits_at(acc[u * 4 + 2], 0) | f32_bits_at(acc[u * 4 + 3], 1)
                        if stored:
                            store_word_at(peer_row, 2 * wu, uint64(p0))
                            store_word_at(peer_row, 2 * wu + 1, uint64(p1))
                        else:
                            dst[2 * wu] = p0
                            dst[2 * wu + 1] = p1
                    else:
                        packed = uint64(0)
                        for x in range(pack):
                            packed |= bf16_bits_at(acc[u * pack + x], x)
                        if stored:
                            store_word_at(peer_row, w + u * warp, word_t(packed))
                        else:
                            dst[w + u * warp] = word_t(packed)
            w += U * warp

    return SimpleNamespace(store_partial_pair=store_partial_pair, store_partial_pair_at=store_partial_pair_at,
                           sum_part=sum_part)
