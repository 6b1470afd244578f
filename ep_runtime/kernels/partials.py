"""Combine partials: their formats on the wire, how a row is cut into flagged parts, and the
geometry both combine kernels share.

Partials (``combine_partials``, ``combine_stage``, ``out_partials``) are bf16 in the token word
(``P = 1`` partial word per token word), or, with float32 partials (``EPConfig.combine_dtype =
"float32"``), float32 passed as uint64 words of 2 floats: token word ``w`` (4 bf16 values) owns
partial words ``2 w`` and ``2 w + 1`` (``P = 2``), element order as in the float32 row. The
format is a compile-time choice: the bf16 kernels carry no branch for it.

On its home a token's partials sit in rows of ``combine_partials[g]`` (flagged in the same rows
of ``combine_row_flag``): a row a source rank, or a row a destination slot
(``CombineVariant.partial_slots``, :func:`make_home_row`), or under the hierarchical transport
a row a sender (its node's PEs, then a proxy per other node).
"""

import functools
from types import SimpleNamespace

import numpy as np

from ep_runtime.kernels.bits import f32_to_bf16
from ep_runtime.kernels.block import flag_rule, most_tokens, warp_geometry
from ep_runtime.kernels.cuda_api import cuda, from_dtype, inlined
from ep_runtime.kernels.destinations import rank_position
from ep_runtime.kernels.protocol import COMBINE_FLAG_PARTS
from ep_runtime.kernels.vec import pack_bf16x2, pack_bf16x4

#: Words of a row each lane loads before using any of them (memory-level parallelism: with
#: 8-byte words, 64 bytes per lane and 32 KB per 512-thread block in flight per row read).
#: combine_async reads a token's expert rows one after another, combine_wait its ranks'
#: partials; within each row the U loads are independent. Where rows allow it they move as
#: word pairs (``ep_runtime/kernels/vec.py``: one 16-byte access each for uint64 words), U / 2 pairs.
WORDS_IN_FLIGHT = 8


@cuda.jit(device=True)
def flagged_parts(counts, PW, warp):
    """``(parts, span)`` of a call's partial rows of ``PW`` partial words, each part flagged on
    arrival (``combine_row_flag``), the same on every rank whatever its grid and build:
    :func:`~ep_runtime.kernels.block.flag_rule` for the R x (most tokens) rows of the call, at
    most COMBINE_FLAG_PARTS parts a row, each part ``span`` partial words (a multiple of
    ``warp``, so of P). Kernels that walk token words divide ``span`` by P; combine_async_rows,
    one build for both partial formats, walks partial words."""
    return flag_rule(counts.shape[0] * max(most_tokens(counts), 1), PW, COMBINE_FLAG_PARTS, warp)


def partial_words(word_dtype, f32_partials: bool) -> int:
    """Partial words per token word (``P``): 1 for bf16 partials (the token word itself), 2 for
    float32 partials (uint64 words of 2 floats), which need uint64 token words (4 bf16 values;
    hidden a multiple of 4)."""
    if not f32_partials:
        return 1
    if np.dtype(word_dtype) != np.uint64:
        raise ValueError(f"float32 partials need uint64 token words (hidden a multiple of 4); got "
                         f"{np.dtype(word_dtype)}")
    return 2


@functools.lru_cache(maxsize=None)
def partial_geometry(threads: int, word: str, f32_partials: bool) -> SimpleNamespace:
    """The compile-time sizes both combine kernels use, for blocks of ``threads`` threads,
    token words of ``word`` (a NumPy dtype name) and the partial format: ``warp``, ``warps``,
    ``word_t`` (the Numba word type), ``pack`` (bf16 values a word), ``P`` (partial words a
    token word), ``F32``, ``U`` (words in flight), ``UP`` (word pairs in flight), and
    ``rounded_word(acc, b)``, the token word of bf16 values rounded from ``acc[b .. b + pack -
    1]`` (element 0 in the low bits)."""
    word_dtype = np.dtype(word)
    warp, warps = warp_geometry(threads)
    word_t = from_dtype(word_dtype)
    pack = word_dtype.itemsize // 2
    P = partial_words(word_dtype, f32_partials)

    @cuda.jit(device=True)
    def rounded_word(acc, b):
        """The token word of bf16 values rounded from acc[b .. b + pack - 1]."""
        if pack == 4:
            return word_t(pack_bf16x4(acc[b], acc[b + 1], acc[b + 2], acc[b + 3]))
        if pack == 2:
            return word_t(pack_bf16x2(acc[b], acc[b + 1]))
        return word_t(f32_to_bf16(acc[b]))

    return SimpleNamespace(warp=warp, warps=warps, word_t=word_t, pack=pack, P=P, F32=P == 2, U=WORDS_IN_FLIGHT,
                           UP=WORDS_IN_FLIGHT // 2, rounded_word=rounded_word)


@inlined
def rank_row(dispatch_topk_ids, g, s, t, L, R, me):
    """The home row of this PE's partial of token t of PE ``s``, indexed by source rank: ``me``."""
    return me


@inlined
def slot_row(dispatch_topk_ids, g, s, t, L, R, me):
    """The home row of this PE's partial of token t of PE ``s``, indexed by destination slot: the
    position of ``me`` among the token's ascending destination ranks, from its routing row
    ``dispatch_topk_ids[g, s, t]`` (the home finds it in its own list)."""
    return rank_position(dispatch_topk_ids[g, s, t], L, me)


@functools.lru_cache(maxsize=None)
def make_home_row(partial_slots: int, node_size: int = 0):
    """``home_row(dispatch_topk_ids, g, s, t, L, R, me)``: the row of PE ``s``'s
    ``combine_partials[g]`` and ``combine_row_flag`` (int32 ids [G, R, Tmax, K]; rank d holds
    experts ``[d L, (d + 1) L)``) where this PE's partial of token t of ``s`` goes: its own index
    (``partial_slots`` 0), its destination slot, or under the hierarchical transport
    (``node_size`` > 0) its local index, its row among the senders of a home on its node
    (``nodes.sender_index``; a home on another node gets it summed by the proxy, which puts it in
    the proxy's row). The transports' partial functions take it where they name this PE's row
    (``me``)."""
    if not partial_slots:
        return rank_row
    if not node_size:
        return slot_row

    @inlined
    def sender_row(dispatch_topk_ids, g, s, t, L, R, me):
        """The home row of this PE's partial of token t of PE ``s`` on its node, indexed by
        sender: its local index."""
        return me % node_size

    return sender_row
