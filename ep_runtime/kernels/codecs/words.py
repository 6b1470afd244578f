"""The ``words`` codec: a token travels as the caller's row of words (bf16 values, ``pack`` a
word: :func:`ep_runtime.core.layout.token_word`), unchanged; nothing to encode or lay out.

Its sender cuts the batch's rows into parts so that every warp has about ``SEND_ROUNDS`` of them
(a landing receiver's parts: ``block.flag_rule``, each part flagged once it is in every
destination) and moves each part through the transport, each word (pair) loaded once for every
destination. See :mod:`ep_runtime.kernels.codecs` for the interface.
"""

from types import SimpleNamespace

from ep_runtime.kernels.block import flag_rule, part_bounds, part_words, row_parts, warp_geometry
from ep_runtime.kernels.cuda_api import cuda, inlined, uint64
from ep_runtime.kernels.protocol import DISPATCH_FLAG_PARTS
from ep_runtime.kernels.transport.common import PAIRS_IN_FLIGHT
from ep_runtime.kernels.vec import address_of, make_pair_loops, pairs_aligned

#: Items per warp the token loop aims at when a batch has a row for every warp (``send_warps``):
#: rows are cut into parts so the transfer's last round, in which the warps with one item more
#: than the others still send, is short (docs/plans.md, "Send rounds").
SEND_ROUNDS = 8
#: A message is the caller's row of words; nothing is computed to send it.
RAW = True
ENCODES = False


def make_sender(spec, threads: int, tp, destinations, lands: bool) -> SimpleNamespace:
    """The words codec's sender (:mod:`ep_runtime.kernels.codecs`)."""
    warp, warps = warp_geometry(threads)
    send_part, send_part_flagged, no_dests = tp.send_part, tp.send_part_flagged, tp.no_dests
    load_pairs, _, store_pairs_at = make_pair_loops(PAIRS_IN_FLIGHT, warp)

    @cuda.jit(device=True)
    def send_warps(rows, all_warps):
        """The warp count the token loop cuts ``rows`` rows for (``row_parts``): ``all_warps``,
        or ``SEND_ROUNDS`` times it for a batch with a row for every warp."""
        if rows >= all_warps:
            return all_warps * SEND_ROUNDS
        return all_warps

    @inlined
    def send_rows(tokens, token_scales, token_global_scale_u8, prequantized, ids_base, rows, rows_u8, stage, stage_u8,
                  row_flag, peer_bases, T, K, L, R, me, n, token_blocks, mbuf, held, ids_l, lo, hi):
        """Every thread of a token block: a warp per row part (``row_parts`` for about
        SEND_ROUNDS parts a warp; a landing receiver's: cut as its receivers cut them,
        ``flag_rule``, each flagged once it is in every destination, and none to this PE, whose
        rows the receiver reads from the caller's tokens), moved by the transport's
        ``send_part`` (word pairs where the rows allow). Returns True: the transport's own
        writes only."""
        tid = cuda.threadIdx.x
        W = tokens.shape[1]
        all_warps = token_blocks * warps
        parts = row_parts(T, W, send_warps(T, all_warps), warp)
        span = part_words(W, parts, warp)
        if lands:  # the receivers cut rows alike from T (dispatch_land)
            parts, span = flag_rule(T, W, DISPATCH_FLAG_PARTS, warp)
        own_skip = uint64(1) << uint64(me) if lands else uint64(0)
        pairs = tokens.itemsize == 8 and W % 2 == 0 and pairs_aligned(tokens) and pairs_aligned(rows)
        lane = tid % warp
        i = cuda.blockIdx.x * warps + tid // warp
        while cuda.blockIdx.x < token_blocks and i < T * parts:
            t, w0, w1 = part_bounds(i, parts, span, W)
            if w0 < w1:
                sent = destinations(ids_base + uint64(4 * t * K), K, L, R, me, own_skip, ids_l)  # bit d: to d
                if no_dests(sent):
                    pass  # a landing receiver's row for this PE only (it copies it from the tokens)
                elif lands:  # each part flagged on arrival
                    send_part_flagged(rows, row_flag, me, t, i - t * parts, n, tokens[t], w0, w1, sent, R, peer_bases,
                                      pairs, lane, lo, hi)
                else:
                    send_part(rows, me, t, tokens[t], w0, w1, sent, R, peer_bases, pairs, lane, lo, hi)
            i += all_warps
        return True

    @inlined
    def pack_row(tokens, token_scales, token_global_scale_u8, prequantized, t, row, lane, mbuf, peer_bases, held, lo,
                 hi):
        """Every lane of one warp: token ``t``'s words into the local row ``row`` (16-byte
        aligned): word pairs where the tokens allow, else a word per lane per step."""
        W = tokens.shape[1]
        if tokens.itemsize == 8 and W % 2 == 0 and pairs_aligned(tokens):
            w = 2 * lane
            while w < W:
                load_pairs(tokens[t], w, W, lo, hi)
                store_pairs_at(address_of(row), w, W, lo, hi)
                w += 2 * PAIRS_IN_FLIGHT * warp
        else:
            for w in range(lane, W, warp):
                row[w] = tokens[t, w]

    return SimpleNamespace(MBUF_WORDS=1, HELD_WORDS=1, send_rows=send_rows, pack_row=pack_row)


@cuda.jit(device=True)
def _lay_out(msg_u8, P, XB, expert_scales_u8, r, C, col_major, lane):
    """Nothing: a row of words has no extras."""


@cuda.jit(device=True)
def _zero(XB, expert_scales_u8, r, C, col_major, lane):
    """Nothing: a row of words has no extras."""


@cuda.jit(device=True)
def _lay_out_batched(msg_u8, P, S, batched_scales_u8, e, pos, M, form, lane):
    """Nothing: a row of words has no scales."""


def make_receiver(spec, threads: int) -> SimpleNamespace:
    """The words codec's receiver: nothing to lay out besides the words."""
    return SimpleNamespace(lay_out=_lay_out, zero=_zero, lay_out_batched=_lay_out_batched)
