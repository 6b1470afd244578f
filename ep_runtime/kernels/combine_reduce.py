"""Combine, wait half: ``combine_wait``'s loops over one part of a token's partials.

Once every partial of a part has landed, its warp either sums them in ascending rank order, in
float32 from 0, applies the caller's epilogue and rounds to bf16 (``MODE_REDUCE``), or copies
each rank's partial as it is (``MODE_PARTIALS``). Partials are bf16 token words or float32
pairs (``partials.py``: ``P`` partial words a token word); docs/protocol.md has the summation
order.

:func:`make_partial_reduce` builds the device functions for a block size, token word, partial
format, epilogue and where partials arrive.
"""

import functools
from types import SimpleNamespace

from ep_runtime.kernels.bits import bf16_bits_at, f32_word_at, word_f32
from ep_runtime.kernels.cuda_api import float32, inlined, uint64
from ep_runtime.kernels.nodes import make_partial_sources, sender_index
from ep_runtime.kernels.partials import partial_geometry
from ep_runtime.kernels.vec import load_pair, store_pair


@functools.lru_cache(maxsize=None)
def make_partial_reduce(threads: int, word: str, f32_partials: bool, epilogue, node_size: int,
                        dest_slots: int = 0, partial_slots: int = 0) -> SimpleNamespace:
    """The part loops of ``combine_wait`` for blocks of ``threads`` threads, token words of
    ``word`` (a NumPy dtype name), the partial format, ``epilogue(value: float32, token: int,
    col: int, aux: [T, H] float32) -> float32`` (a Numba device function applied to each reduced
    element before the bf16 store) and the partials' rows (``nodes.make_partial_sources`` of
    ``node_size``), a token's ranks a uint64 mask (``dest_slots`` 0: :func:`make_mask_reduce`) or
    an ascending list (ep_runtime/kernels/destinations.py: :func:`make_listed_reduce`), with
    ``partial_slots`` the list's j-th rank's partial in row j of ``combine_partials[g]``, or with
    nodes rank r's in row ``nodes.sender_index(me, r)`` (``CombineVariant.partial_slots``):
    ``reduce_part`` and ``copy_part``."""
    if dest_slots:
        return make_listed_reduce(threads, word, f32_partials, epilogue, node_size, partial_slots)
    return make_mask_reduce(threads, word, f32_partials, epilogue, node_size)


def loop_shape(threads: int, word: str, f32_partials: bool):
    """``(warp, word_t, pack, P, F32, rounded_word, UW, UPW)`` of ``partials.partial_geometry``:
    ``UW`` token words per lane per pass, so that ``U`` partial words are in flight (the same
    bytes and registers as bf16's U words), ``UPW`` token-word pairs per pass (``UP``
    partial-word pairs in flight)."""
    geo = partial_geometry(threads, word, f32_partials)
    return (geo.warp, geo.word_t, geo.pack, geo.P, geo.F32, geo.rounded_word, geo.U // geo.P, geo.UP // geo.P)


@functools.lru_cache(maxsize=None)
def make_part_adders(threads: int, word: str, f32_partials: bool) -> SimpleNamespace:
    """``add_pairs`` and ``add_words``: one rank's partial added into a warp's accumulators (UP
    partial-word pairs or U partial words a lane and pass), for ``reduce_part`` of the mask and
    list builds alike."""
    warp, word_t, pack, P, F32, rounded_word, UW, UPW = loop_shape(threads, word, f32_partials)

    @inlined
    def add_pairs(src, w, w1, lo, hi, acc):
        """Every lane: one rank's partial ``src`` added into ``acc``, UP partial-word pairs from
        token word ``w`` (each lane's loads issued before use)."""
        for u in range(UPW):
            wu = w + 2 * u * warp
            if wu < w1:
                if F32:  # token words wu, wu + 1: partial words 2 wu .. 2 wu + 3
                    pair = load_pair(src, 2 * wu)
                    lo[2 * u] = pair[0]
                    hi[2 * u] = pair[1]
                    pair = load_pair(src, 2 * wu + 2)
                    lo[2 * u + 1] = pair[0]
                    hi[2 * u + 1] = pair[1]
                else:
                    pair = load_pair(src, wu)
                    lo[u] = pair[0]
                    hi[u] = pair[1]
        for u in range(UPW):
            for x in range(pack):
                if F32:
                    acc[2 * u * pack + x] += f32_word_at(lo[2 * u] if x < 2 else hi[2 * u], x % 2)
                    acc[(2 * u + 1) * pack + x] += f32_word_at(
                        lo[2 * u + 1] if x < 2 else hi[2 * u + 1], x % 2)
                else:
                    acc[2 * u * pack + x] += word_f32(lo[u], x)
                    acc[(2 * u + 1) * pack + x] += word_f32(hi[u], x)

    @inlined
    def add_words(src, w, w1, vals, acc):
        """Every lane: one rank's partial ``src`` added into ``acc``, U partial words from token
        word ``w`` (each lane's loads issued before use)."""
        for u in range(UW):
            if w + u * warp < w1:
                if F32:  # token word w + u warp: partial words 2 (w + u warp) + 0, 1
                    vals[2 * u] = src[2 * (w + u * warp)]
                    vals[2 * u + 1] = src[2 * (w + u * warp) + 1]
                else:
                    vals[u] = src[w + u * warp]
        for u in range(UW):
            for x in range(pack):
                if F32:
                    acc[u * pack + x] += f32_word_at(vals[2 * u + x // 2], x % 2)
                else:
                    acc[u * pack + x] += word_f32(vals[u], x)

    return SimpleNamespace(add_pairs=add_pairs, add_words=add_words)


def make_mask_reduce(threads: int, word: str, f32_partials: bool, epilogue, node_size: int) -> SimpleNamespace:
    """``reduce_part`` and ``copy_part`` over a token's ranks as a uint64 mask (every build of 64
    ranks or fewer; arguments as :func:`make_partial_reduce`'s)."""
    warp, word_t, pack, P, F32, rounded_word, UW, UPW = loop_shape(threads, word, f32_partials)
    _, partial_row, _ = make_partial_sources(node_size)
    adders = make_part_adders(threads, word, f32_partials)
    add_pairs, add_words = adders.add_pairs, adders.add_words

    @inlined
    def reduce_part(out, own_rows, combine_partials, combine_sums, relay_slot, aux, g, me, t, Tmax, R, went, own,
                    pairs, w0, w1, lane, acc, vals, lo, hi):
        """Every lane of one warp (MODE_REDUCE): token words ``[w0, w1)`` of ``out[t]`` ([T, W]
        words) = bf16(epilogue(sum over the ranks r set in ``went`` (uint64), ascending, of
        f32(partial_r), from 0)). Rank r's partial is row ``partial_row(relay_slot, g, t, r,
        me)`` of ``combine_partials[g, r]`` ([G, R, Tmax, P W] partial words), or, ``own`` and
        r = me, row ``me * Tmax + t`` of ``own_rows``. ``pairs``: UP partial-word pairs per
        lane in flight (16-byte accesses), else U partial words; each rank's loads are issued
        before use. ``acc`` (local float32 [U / P pack]), ``vals`` (local [U] words), ``lo``,
        ``hi`` (local [U / 2] words): the lanes' registers, their lanes past the row's end
        finite."""
        orow = out[t]
        w = w0 + 2 * lane
        while pairs and w < w1:  # UP partial-word pairs per lane: each rank's loads issued before use
            for x in range(2 * UPW * pack):
                acc[x] = float32(0.0)
            for r in range(R):
                if (went >> uint64(r)) & uint64(1):
                    src = (own_rows[me * Tmax + t] if own and r == me
                           else combine_partials[g, r, partial_row(relay_slot, g, t, r, me)])
                    add_pairs(src, w, w1, lo, hi, acc)
            for u in range(UPW):
                wu = w + 2 * u * warp
                if wu < w1:
                    for x in range(2 * pack):
                        acc[2 * u * pack + x] = epilogue(acc[2 * u * pack + x], t, wu * pack + x, aux)
                    store_pair(orow, wu, rounded_word(acc, 2 * u * pack), rounded_word(acc, (2 * u + 1) * pack))
            w += 2 * UPW * warp
        w = w0 + lane
        while not pairs and w < w1:  # U partial words per lane: each rank's loads issued before use
            for x in range(UW * pack):
                acc[x] = float32(0.0)
            for r in range(R):
                if (went >> uint64(r)) & uint64(1):
                    src = (own_rows[me * Tmax + t] if own and r == me
                           else combine_partials[g, r, partial_row(relay_slot, g, t, r, me)])
                    add_words(src, w, w1, vals, acc)
            for u in range(UW):
                wu = w + u * warp
                if wu < w1:
                    packed = uint64(0)
                    for x in range(pack):
                        packed |= bf16_bits_at(epilogue(acc[u * pack + x], t, wu * pack + x, aux), x)
                    out[t, wu] = word_t(packed)
            w += UW * warp

    @inlined
    def copy_part(out_partials, own_rows, combine_partials, combine_sums, relay_slot, g, me, t, Tmax, R, went, own, w0,
                  w1, lane):
        """Every lane of one warp (MODE_PARTIALS): partial words ``[P w0, P w1)`` of each rank's
        partial of token t into ``out_partials[r, t]`` ([R, T, P W] partial words; zero for the
        ranks r not set in ``went``), from where ``reduce_part`` reads them."""
        for w in range(P * w0 + lane, P * w1, warp):  # partial words
            for r in range(R):
                if (went >> uint64(r)) & uint64(1):
                    if own and r == me:
                        out_partials[r, t, w] = own_rows[me * Tmax + t, w]
                    else:
                        out_partials[r, t, w] = combine_partials[g, r, partial_row(relay_slot, g, t, r, me), w]
                else:
                    out_partials[r, t, w] = 0

    return SimpleNamespace(reduce_part=reduce_part, copy_part=copy_part)


def make_listed_reduce(threads: int, word: str, f32_partials: bool, epilogue, node_size: int,
                       partial_slots: int) -> SimpleNamespace:
    """``reduce_part`` and ``copy_part`` over a token's ascending destination list (the builds
    with destination lists; arguments as :func:`make_partial_reduce`'s): the mask's ranks in the
    mask's order, rank r's partial where ``partial_slots`` puts it (``listed_row``)."""
    warp, word_t, pack, P, F32, rounded_word, UW, UPW = loop_shape(threads, word, f32_partials)
    _, partial_row, _ = make_partial_sources(node_size)
    adders = make_part_adders(threads, word, f32_partials)
    add_pairs, add_words = adders.add_pairs, adders.add_words
    BY_SENDER = bool(partial_slots and node_size)  # the rows (constants the compiler prunes on)
    BY_SLOT = bool(partial_slots and not node_size)

    @inlined
    def listed_row(relay_slot, g, t, r, j, me):
        """``(a, b)``: rank r's partial of token t, r the j-th rank of the token's list, is
        ``combine_partials[g, a, b]``: ``(r, partial_row(...))``, or with ``partial_slots`` ``(j,
        t)``, with nodes by sender ``(sender_index(me, r), t)`` for a PE of this node and ``(-1,
        relay_slot[g, t, x])`` for the proxy of another node, whose sum is ``combine_sums[g, b]``
        (this rank's own in ``own_rows`` aside)."""
        if BY_SENDER:
            i = sender_index(me, r, node_size)
            if i >= node_size:
                return -1, partial_row(relay_slot, g, t, r, me)
            return i, t
        if BY_SLOT:
            return j, t
        return r, partial_row(relay_slot, g, t, r, me)

    @inlined
    def sum_listed(own_rows, combine_partials, combine_sums, relay_slot, g, me, t, Tmax, R, went, own, pairs, w, w1,
                   lo, hi, vals, acc):
        """``sum_mask`` over the ranks of the list ``went`` (int32, count first, ascending:
        ep_runtime/kernels/destinations.py): the same ranks in the same order."""
        for j in range(went[0]):
            r = went[1 + j]
            a, b = listed_row(relay_slot, g, t, r, j, me)
            src = (own_rows[me * Tmax + t] if own and r == me
                   else combine_sums[g, b] if BY_SENDER and a < 0 else combine_partials[g, a, b])
            if pairs:
                add_pairs(src, w, w1, lo, hi, acc)
            else:
                add_words(src, w, w1, vals, acc)

    @inlined
    def reduce_listed_part(out, own_rows, combine_partials, combine_sums, relay_slot, aux, g, me, t, Tmax, R, went,
                           own, pairs, w0, w1, lane, acc, vals, lo, hi):
        """``reduce_part`` of a build with destination lists: the ranks of the list ``went``
        (int32, count first, ascending), summed in the mask's order."""
        orow = out[t]
        w = w0 + 2 * lane
        while pairs and w < w1:  # UP partial-word pairs per lane
            for x in range(2 * UPW * pack):
                acc[x] = float32(0.0)
            sum_listed(own_rows, combine_partials, combine_sums, relay_slot, g, me, t, Tmax, R, went, own, True, w, w1,
                       lo, hi, vals, acc)
            for u in range(UPW):
                wu = w + 2 * u * warp
                if wu < w1:
                    for x in range(2 * pack):
                        acc[2 * u * pack + x] = epilogue(acc[2 * u * pack + x], t, wu * pack + x, aux)
                    store_pair(orow, wu, rounded_word(acc, 2 * u * pack), rounded_word(acc, (2 * u + 1) * pack))
            w += 2 * UPW * warp
        w = w0 + lane
        while not pairs and w < w1:  # U partial words per lane
            for x in range(UW * pack):
                acc[x] = float32(0.0)
            sum_listed(own_rows, combine_partials, combine_sums, relay_slot, g, me, t, Tmax, R, went, own, False, w, w1,
                       lo, hi, vals, acc)
            for u in range(UW):
                wu = w + u * warp
                if wu < w1:
                    packed = uint64(0)
                    for x in range(pack):
                        packed |= bf16_bits_at(epilogue(acc[u * pack + x], t, wu * pack + x, aux), x)
                    out[t, wu] = word_t(packed)
            w += UW * warp

    @inlined
    def copy_listed_part(out_partials, own_rows, combine_partials, combine_sums, relay_slot, g, me, t, Tmax, R, went,
                         own, w0, w1, lane):
        """``copy_part`` of the ranks of the list ``went`` (int32, count first, ascending)."""
        for w in range(P * w0 + lane, P * w1, warp):  # partial words
            j = 0  # the next listed rank
            for r in range(R):
                if j < went[0] and went[1 + j] == r:
                    if own and r == me:
                        out_partials[r, t, w] = own_rows[me * Tmax + t, w]
                    else:
                        a, b = listed_row(relay_slot, g, t, r, j, me)
                        out_partials[r, t, w] = (combine_sums[g, b, w] if BY_SENDER and a < 0
                                                 else combine_partials[g, a, b, w])
                    j += 1
                else:
                    out_partials[r, t, w] = 0

    return SimpleNamespace(reduce_part=reduce_listed_part, copy_part=copy_listed_part)
