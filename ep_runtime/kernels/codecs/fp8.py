"""The ``fp8`` codec: E4M3 codes with a scale per 128-element block (a float32, ``scale_bytes``
4, or a UE8M0 code, 1), the FP8 token formats of :mod:`ep_runtime.core.formats`.

The dispatch protocol moves messages of ``MW`` uint64 words and never looks inside them; this
module is the only device code that does. A message is ``P`` payload words (the E4M3 codes,
``PB = 8 P = H`` bytes), then ``SB`` bytes of scale per block, then padding to ``MW`` words
(``TokenFormat.message_words``; never written or sent). The sender encodes each token part once
(``encode_blocks``; the rule is the reference's, bit for bit) straight into every destination's
slot where the transport stores, else into a stage row it then puts, or moves the caller's codes
and scales as they are (pre-quantized input). The receiver lays a message's scales out for the
expanded layout, row- or column-major. See :mod:`ep_runtime.kernels.codecs` for the interface.
"""

import functools
from types import SimpleNamespace

from ep_runtime.kernels import shmem
from ep_runtime.kernels.bits import bf16_to_f32
from ep_runtime.kernels.block import group_max_u32, part_bounds, part_words, row_parts, warp_geometry, warp_sync
from ep_runtime.kernels.cuda_api import cuda, inlined, int32, uint8, uint32, uint64
from ep_runtime.kernels.destinations import no_listed
from ep_runtime.kernels.fp8 import bf16_abs_max4, block_scale, pack8, quantize4_by, quantize4_scaled, scaled_directly
from ep_runtime.kernels.protocol import BATCHED_SCALES_PACKED, PEER_TOKENS, UE8M0_NAN
from ep_runtime.kernels.transport.common import PAIRS_IN_FLIGHT
from ep_runtime.kernels.vec import (address_of, load_pair, load_u32_at, make_pair_loops, pairs_aligned, store_pair_at,
                                    store_u8_at, store_u32_at)

#: bf16 words (4 values each) per 128-element scale block.
BLOCK_WORDS = 32
#: E4M3 code words (uint64, 8 codes each) per 128-element block.
CODE_WORDS = 16
#: Lanes that encode one 128-element block together: each holds ``WORDS_PER_LANE`` bf16 words
#: (16 values, 32 bytes loaded as two word pairs) and stores their 16 codes as one word pair.
BLOCK_LANES = 8
WORDS_PER_LANE = BLOCK_WORDS // BLOCK_LANES
#: Warp steps (``warp / BLOCK_LANES`` blocks each) whose words a lane loads before it encodes
#: any: 64 bytes per lane in flight, 8 blocks per 32-lane warp. The words are held in
#: variables, not a local array (which Numba leaves in local memory: every loaded word stored
#: to the stack and loaded back; docs/plans.md).
STEPS_IN_FLIGHT = 2
#: Scales of a token part an encoding warp holds in shared memory (uint32 each) until its codes
#: are out, then stores together: 64 blocks (hidden up to 8192 in one part), 4 KB for 16 warps.
HELD_SCALES = 64
assert WORDS_PER_LANE == 4 and STEPS_IN_FLIGHT == 2, "encode_blocks is written for 4 words x 2 steps"
#: A message is computed (encoded) from the caller's bf16 token, or taken pre-quantized.
RAW = False
ENCODES = True


def make_encoder(warp: int, ue8m0: bool, listed: bool = False):
    """``(encode_blocks, store_scales)`` for warps of ``warp`` lanes (a multiple of
    ``BLOCK_LANES`` up to 32) and scales that are UE8M0 codes (``ue8m0``, 1 byte) or float32
    (4 bytes), the destinations ``sent`` of :func:`encode_blocks` a uint64 mask or, ``listed``,
    a destination list (int32, count first: ep_runtime/kernels/destinations.py)."""
    if warp % BLOCK_LANES or warp > 32:
        raise ValueError(f"make_encoder: warp={warp} must be a multiple of {BLOCK_LANES} up to 32")
    SB = 1 if ue8m0 else 4
    BPS = warp // BLOCK_LANES  # blocks per warp step
    WPL = WORDS_PER_LANE
    # a constant the compiler prunes on: the mask builds keep their loops over the mask's bits in
    # place, the code they compiled to before the lists
    LISTED = listed

    @cuda.jit(device=True)
    def store_scale(at, b, code):
        """Block ``b``'s scale (its code: float32 bits or the UE8M0 byte) at byte address
        ``at`` (the message's scales)."""
        if SB == 4:
            store_u32_at(at, b, uint32(code))
        else:
            store_u8_at(at, b, uint32(code))

    @cuda.jit(device=True)
    def load_lane_words(row, b, b1, j, src_pairs):
        """This lane's 4 bf16 words (16 values) of block ``b`` of ``row``: words ``32 b + 4 j
        ..``, as two word pairs where ``src_pairs``; zeros when ``b >= b1``."""
        w0 = w1 = w2 = w3 = uint64(0)
        if b < b1:
            w = b * BLOCK_WORDS + j * WPL
            if src_pairs:
                p = load_pair(row, w)
                q = load_pair(row, w + 2)
                w0, w1, w2, w3 = p[0], p[1], q[0], q[1]
            else:
                w0, w1, w2, w3 = row[w], row[w + 1], row[w + 2], row[w + 3]
        return w0, w1, w2, w3

    @cuda.jit(device=True)
    def encode_lane_words(b, b1, j, w0, w1, w2, w3, stage_at, PB, buf64, peer_bases, sent, slot, held, s0, keep):
        """Every lane of the warp (the amax shuffles are the warp's): encode this lane's 16
        values ``w0..w3`` of block ``b`` (nothing when ``b >= b1``) and store the codes where
        :func:`encode_blocks` says; the block's first lane keeps the scale in ``held[s0 + b]``
        (``keep``) or stores it too."""
        m = uint32(0)
        if b < b1:
            m = bf16_abs_max4(w0, w1, w2, w3)
        a = bf16_to_f32(group_max_u32(m, BLOCK_LANES, buf64))  # every lane: full-warp shuffles
        if b < b1:
            scale, code, inv = block_scale(a, ue8m0)
            if scaled_directly(scale, inv):  # every block of finite values: products, converted
                lo = pack8(quantize4_scaled(w0, inv), quantize4_scaled(w1, inv))
                hi = pack8(quantize4_scaled(w2, inv), quantize4_scaled(w3, inv))
            else:  # NaN or inf in the block, or an amax too small for 448 / amax
                lo = pack8(quantize4_by(w0, scale, inv), quantize4_by(w1, scale, inv))
                hi = pack8(quantize4_by(w2, scale, inv), quantize4_by(w3, scale, inv))
            cw = b * CODE_WORDS + 2 * j  # this lane's code words
            scales_at = uint64(PB)  # uint64 + uint64 below (an int64 term would make it float64)
            if keep and j == 0:
                held[s0 + b] = uint32(code)
            if LISTED:
                if no_listed(sent):
                    store_pair_at(stage_at, cw, lo, hi)
                    if j == 0 and not keep:
                        store_scale(stage_at + scales_at, b, code)
                for x in range(1, sent[0] + 1):
                    at = peer_bases[PEER_TOKENS, sent[x]] + slot
                    store_pair_at(at, cw, lo, hi)
                    if j == 0 and not keep:
                        store_scale(at + scales_at, b, code)
            elif sent == uint64(0):
                store_pair_at(stage_at, cw, lo, hi)
                if j == 0 and not keep:
                    store_scale(stage_at + scales_at, b, code)
            else:
                for d in range(peer_bases.shape[1]):
                    if (sent >> uint64(d)) & uint64(1):
                        at = peer_bases[PEER_TOKENS, d] + slot
                        store_pair_at(at, cw, lo, hi)
                        if j == 0 and not keep:
                            store_scale(at + scales_at, b, code)

    @cuda.jit(device=True)
    def store_held_scales(b0, b1, lane, stage_at, PB, peer_bases, sent, slot, held, s0):
        """Every lane of the warp, after ``warp_sync``: the scales of blocks ``[b0, b1)`` kept
        in ``held[s0 + b]`` stored to the message(s), a block per lane: contiguous warp stores
        (224 bytes for a 7168-wide FP8_E4M3 token) instead of a small store per warp step."""
        scales_at = uint64(PB)
        for b in range(b0 + lane, b1, warp):
            code = held[s0 + b]
            if LISTED:
                if no_listed(sent):
                    store_scale(stage_at + scales_at, b, code)
                for x in range(1, sent[0] + 1):
                    store_scale(peer_bases[PEER_TOKENS, sent[x]] + slot + scales_at, b, code)
            elif sent == uint64(0):
                store_scale(stage_at + scales_at, b, code)
            else:
                for d in range(peer_bases.shape[1]):
                    if (sent >> uint64(d)) & uint64(1):
                        store_scale(peer_bases[PEER_TOKENS, d] + slot + scales_at, b, code)

    @cuda.jit(device=True)
    def encode_blocks(tokens, t, b0, b1, src_pairs, stage_at, PB, lane, buf64, peer_bases, sent, slot, held, h0):
        """Every lane of one warp: encode 128-element blocks ``[b0, b1)`` of bf16 token ``t``
        (``tokens`` [T, W] uint64, 4 values a word; ``src_pairs``: its rows are 16-byte aligned,
        loaded as word pairs) into a message: block b's 128 codes are code words
        ``CODE_WORDS b ..``, its scale bytes at byte ``PB + b SB``.

        A warp step covers ``warp / BLOCK_LANES`` consecutive blocks, ``BLOCK_LANES`` lanes
        each: a lane loads 16 values (two word pairs), the lanes of a block take its amax
        (``bf16_abs_max4``, two magnitudes an operation, then ``group_max_u32``: 3 shuffles),
        the scale is ``e4m3_scale`` or ``ue8m0_scale``, and each lane stores its 16 codes as
        one 16-byte pair (a warp store: 512 contiguous bytes) and the block's first lane its
        scale. The scales of a part of at most ``HELD_SCALES`` blocks wait in this warp's
        ``held[h0 ..]`` (shared uint32) and go out together after the codes (contiguous warp
        stores); a longer part's go out a step at a time. Lanes load ``STEPS_IN_FLIGHT``
        steps before they encode any (memory-level parallelism). A block whose scale and
        multiplier pass ``scaled_directly`` (every finite block but the tiniest) converts its
        products without per-value range checks (``quantize4_scaled``).

        Where the message goes: with ``sent`` (uint64) zero (an empty list where ``listed``),
        the stage row at byte address ``stage_at`` (this process's), which the caller sends
        after meeting the warp (``warp_sync``); otherwise straight into the receive slot of
        every rank ``d`` whose bit is set in ``sent`` (or that ``sent`` lists), at byte
        ``slot`` past ``peer_bases[PEER_TOKENS, d]`` (its ``d_tokens`` as mapped here), with
        plain stores (publish as ``Session.peer_view`` says). Slots and stage rows start on
        128-byte lines (``formats.QUANTIZED_MESSAGE_ALIGN``), so the 512-byte warp stores of
        codes fill whole lines."""
        grp = lane // BLOCK_LANES  # the step's block this lane encodes
        j = lane - grp * BLOCK_LANES  # this lane's 16 values of it
        row = tokens[t]
        keep = b1 - b0 <= HELD_SCALES  # the part's scales fit the warp's held slots
        s0 = h0 - b0  # held[s0 + b]: block b's scale
        for bb in range(b0, b1, BPS * STEPS_IN_FLIGHT):
            ba = bb + grp
            bc = ba + BPS
            a0, a1, a2, a3 = load_lane_words(row, ba, b1, j, src_pairs)
            c0, c1, c2, c3 = load_lane_words(row, bc, b1, j, src_pairs)
            encode_lane_words(ba, b1, j, a0, a1, a2, a3, stage_at, PB, buf64, peer_bases, sent, slot, held, s0, keep)
            encode_lane_words(bc, b1, j, c0, c1, c2, c3, stage_at, PB, buf64, peer_bases, sent, slot, held, s0, keep)
        if keep:
            warp_sync()  # the part's scales are all held
            store_held_scales(b0, b1, lane, stage_at, PB, peer_bases, sent, slot, held, s0)
            warp_sync()  # read before the warp's next part writes them

    @cuda.jit(device=True)
    def store_scales(src8, PB, SBYTES, expert_scales8, r, C, col_major, lane, zero):
        """Every lane of one warp: the ``SBYTES`` scale bytes of a message (``src8``, a uint8
        view of it, scales from byte ``PB``; zeros when ``zero`` is nonzero, for padding rows)
        into expert-batch row ``r`` of ``expert_scales8``, a uint8 view of the ``[C * S]``
        scales: element ``r * S + b`` of block b (row-major) or ``b * C + r`` (``col_major``
        nonzero: what TMA-based FP8 GEMMs read)."""
        for k in range(lane, SBYTES, warp):
            if col_major != 0:
                b = k // SB
                dst = (b * C + r) * SB + (k - b * SB)
            else:
                dst = r * SBYTES + k
            expert_scales8[dst] = 0 if zero != 0 else src8[PB + k]

    return encode_blocks, store_scales


def make_sender(spec, threads: int, tp, destinations, lands: bool) -> SimpleNamespace:
    """The fp8 codec's sender (:mod:`ep_runtime.kernels.codecs`) for scales of
    ``spec.param("scale_bytes")`` bytes (4: float32, 1: UE8M0), a token's destinations a mask
    or, where the transport was built with destination lists (``tp.LISTED``), a list. Its
    messages land whole: it flags no parts (``lands`` is the receiver's concern)."""
    warp, warps = warp_geometry(threads)
    SB = int(spec.param("scale_bytes"))
    # a constant the compiler prunes on: the mask builds keep their loops in place (and their
    # send_rows, which a list build replaces with send_rows_listed)
    LISTED = tp.LISTED
    no_dests = tp.no_dests
    encode_blocks, _ = make_encoder(warp, SB == 1, LISTED)
    UP = PAIRS_IN_FLIGHT
    load_pairs, _, store_pairs_at = make_pair_loops(UP, warp)
    DIRECT = tp.DIRECT

    @cuda.jit(device=True)
    def send_prequantized(codes, scales8, b0, b1, PB, peer_bases, sent, slot, lane, lo, hi):
        """Every lane of one warp: the caller's E4M3 code words of blocks ``[b0, b1)`` (``codes``:
        the token's row of uint64 words, 16-byte aligned) and their scale bytes (``scales8``)
        stored into the receive slot of every PE whose bit is set in ``sent``, at byte ``slot``
        past ``peer_bases[PEER_TOKENS, d]`` (every PE ``sent`` lists, in a list build); each word
        pair loaded once. Float32 scales go a word per block when the caller's row is 4-byte
        aligned (the message's scales are: ``slot`` and ``PB`` are multiples of 128), else a
        byte per store."""
        w1 = b1 * CODE_WORDS
        w = b0 * CODE_WORDS + 2 * lane
        while w < w1:
            load_pairs(codes, w, w1, lo, hi)
            if LISTED:
                for x in range(1, sent[0] + 1):
                    store_pairs_at(peer_bases[PEER_TOKENS, sent[x]] + slot, w, w1, lo, hi)
            else:
                for d in range(peer_bases.shape[1]):
                    if (sent >> uint64(d)) & uint64(1):
                        store_pairs_at(peer_bases[PEER_TOKENS, d] + slot, w, w1, lo, hi)
            w += 2 * UP * warp
        scales_at = slot + uint64(PB)  # uint64 + uint64 (an int64 term would make it float64)
        src_at = address_of(scales8)
        if SB == 4 and src_at % uint64(4) == uint64(0):  # a float32 scale per block, as one word
            for b in range(b0 + lane, b1, warp):
                val = load_u32_at(src_at, b)
                if LISTED:
                    for x in range(1, sent[0] + 1):
                        store_u32_at(peer_bases[PEER_TOKENS, sent[x]] + scales_at, b, val)
                else:
                    for d in range(peer_bases.shape[1]):
                        if (sent >> uint64(d)) & uint64(1):
                            store_u32_at(peer_bases[PEER_TOKENS, d] + scales_at, b, val)
        else:
            for j in range(b0 * SB + lane, b1 * SB, warp):
                if LISTED:
                    for x in range(1, sent[0] + 1):
                        store_u8_at(peer_bases[PEER_TOKENS, sent[x]] + scales_at, j, scales8[j])
                else:
                    for d in range(peer_bases.shape[1]):
                        if (sent >> uint64(d)) & uint64(1):
                            store_u8_at(peer_bases[PEER_TOKENS, d] + scales_at, j, scales8[j])

    @cuda.jit(device=True)
    def send_listed(tokens, token_scales, prequantized, rows, rows_u8, stage, stage_u8, peer_bases, me, t, b0, b1,
                    PB, direct, src_pairs, lane, mbuf, held, h0, dl, none, lo, hi):
        """Every lane of one warp, in a build with destination lists: blocks ``[b0, b1)`` of
        token ``t`` to every PE of the list ``dl`` (not empty), as :func:`send_rows` sends them
        (``none``: an empty list, which :func:`encode_blocks` reads as the stage row)."""
        if direct:
            slot = address_of(rows[me, t]) - address_of(rows)  # the same on every PE
            if prequantized == 0:
                encode_blocks(tokens, t, b0, b1, src_pairs, uint64(0), PB, lane, mbuf, peer_bases, dl, slot, held, h0)
            else:
                send_prequantized(tokens[t], token_scales[t], b0, b1, PB, peer_bases, dl, slot, lane, lo, hi)
        else:
            if prequantized == 0:
                encode_blocks(tokens, t, b0, b1, src_pairs, address_of(stage[t]), PB, lane, mbuf, peer_bases, none,
                              uint64(0), held, h0)
                warp_sync()  # the part is staged before the warp's puts read it
            dst_codes = rows[me, t, b0 * CODE_WORDS:b1 * CODE_WORDS]
            dst_scales = rows_u8[me, t, PB + b0 * SB:PB + b1 * SB]
            for x in range(1, dl[0] + 1):
                d = dl[x]
                if prequantized == 0:
                    shmem.put_nbi_warp(dst_codes, stage[t, b0 * CODE_WORDS:b1 * CODE_WORDS], d)
                    shmem.put_nbi_warp(dst_scales, stage_u8[t, PB + b0 * SB:PB + b1 * SB], d)
                else:  # straight from the caller's arrays
                    shmem.put_nbi_warp(dst_codes, tokens[t, b0 * CODE_WORDS:b1 * CODE_WORDS], d)
                    shmem.put_nbi_warp(dst_scales, token_scales[t, b0 * SB:b1 * SB], d)

    @inlined
    def send_rows(tokens, token_scales, token_global_scale_u8, prequantized, ids_base, rows, rows_u8, stage, stage_u8,
                  row_flag, peer_bases, T, K, L, R, me, n, token_blocks, mbuf, held, ids_l, lo, hi):
        """Every thread of a token block: a warp per part of a token (a run of 128-element
        blocks), encoded once (or the caller's codes and scales, pre-quantized) and stored into
        the slot of every PE with one of its experts (16-byte stores of codes, then the scales)
        where the transport stores (``DIRECT``) and the caller's rows allow; else encoded into
        stage row t and put. Returns whether the rows went as plain stores."""
        tid = cuda.threadIdx.x
        all_warps = token_blocks * warps
        h0 = (tid // warp) * HELD_SCALES
        lane = tid % warp
        if prequantized != 0:
            S = tokens.shape[1] // CODE_WORDS
        else:
            S = tokens.shape[1] // BLOCK_WORDS
        PB = S * CODE_WORDS * 8  # code bytes of a message (= H)
        parts = row_parts(T, S, all_warps, 1)  # a part per warp (finer cuts measured slower here)
        span = part_words(S, parts, 1)  # blocks per part
        # straight into peers' slots (16-byte stores): encoded, or the caller's codes (word pairs)
        src_pairs = pairs_aligned(tokens)  # rows of whole word pairs (messages and bf16 blocks)
        direct = DIRECT and (prequantized == 0 or src_pairs)
        i = cuda.blockIdx.x * warps + tid // warp
        while cuda.blockIdx.x < token_blocks and i < T * parts:
            t, b0, b1 = part_bounds(i, parts, span, S)
            sent = uint64(0)
            if b0 < b1:
                sent = destinations(ids_base + uint64(4 * t * K), K, L, R, me, uint64(0), ids_l)  # bit d: to d
            if sent != 0:  # (a token whose slots are all masked goes nowhere: zero would mean the stage row)
                if direct:
                    slot = address_of(rows[me, t]) - address_of(rows)  # the same on every PE
                    if prequantized == 0:
                        encode_blocks(tokens, t, b0, b1, src_pairs, uint64(0), PB, lane, mbuf, peer_bases, sent,
                                      slot, held, h0)
                    else:
                        send_prequantized(tokens[t], token_scales[t], b0, b1, PB, peer_bases, sent, slot, lane,
                                          lo, hi)
                else:
                    if prequantized == 0:
                        encode_blocks(tokens, t, b0, b1, src_pairs, address_of(stage[t]), PB, lane, mbuf,
                                      peer_bases, uint64(0), uint64(0), held, h0)
                        warp_sync()  # the part is staged before the warp's puts read it
                    for d in range(R):
                        if (sent >> uint64(d)) & uint64(1):
                            dst_codes = rows[me, t, b0 * CODE_WORDS:b1 * CODE_WORDS]
                            dst_scales = rows_u8[me, t, PB + b0 * SB:PB + b1 * SB]
                            if prequantized == 0:
                                shmem.put_nbi_warp(dst_codes, stage[t, b0 * CODE_WORDS:b1 * CODE_WORDS], d)
                                shmem.put_nbi_warp(dst_scales, stage_u8[t, PB + b0 * SB:PB + b1 * SB], d)
                            else:  # straight from the caller's arrays
                                shmem.put_nbi_warp(dst_codes, tokens[t, b0 * CODE_WORDS:b1 * CODE_WORDS], d)
                                shmem.put_nbi_warp(dst_scales, token_scales[t, b0 * SB:b1 * SB], d)
            i += all_warps
        return direct

    @inlined
    def send_rows_listed(tokens, token_scales, token_global_scale_u8, prequantized, ids_base, rows, rows_u8, stage,
                         stage_u8, row_flag, peer_bases, T, K, L, R, me, n, token_blocks, mbuf, held, ids_l, lo, hi):
        """:func:`send_rows` of a build with destination lists: the same parts and messages, each
        to every PE of the token's list (:func:`send_listed`)."""
        tid = cuda.threadIdx.x
        all_warps = token_blocks * warps
        h0 = (tid // warp) * HELD_SCALES
        lane = tid % warp
        if prequantized != 0:
            S = tokens.shape[1] // CODE_WORDS
        else:
            S = tokens.shape[1] // BLOCK_WORDS
        PB = S * CODE_WORDS * 8  # code bytes of a message (= H)
        parts = row_parts(T, S, all_warps, 1)
        span = part_words(S, parts, 1)
        src_pairs = pairs_aligned(tokens)
        direct = DIRECT and (prequantized == 0 or src_pairs)
        none = cuda.local.array(1, int32)  # the empty list: encode into the stage row
        none[0] = 0
        i = cuda.blockIdx.x * warps + tid // warp
        while cuda.blockIdx.x < token_blocks and i < T * parts:
            t, b0, b1 = part_bounds(i, parts, span, S)
            if b0 < b1:
                dl = destinations(ids_base + uint64(4 * t * K), K, L, R, me, uint64(0), ids_l)
                if not no_dests(dl):  # (a token whose slots are all masked goes nowhere)
                    send_listed(tokens, token_scales, prequantized, rows, rows_u8, stage, stage_u8, peer_bases, me,
                                t, b0, b1, PB, direct, src_pairs, lane, mbuf, held, h0, dl, none, lo, hi)
            i += all_warps
        return direct

    @inlined
    def pack_row(tokens, token_scales, token_global_scale_u8, prequantized, t, row, lane, mbuf, peer_bases, held, lo,
                 hi):
        """Every lane of one warp: token ``t``'s message (encoded here, or the caller's codes and
        scales) into the local row ``row`` (16-byte aligned)."""
        h0 = (cuda.threadIdx.x // warp) * HELD_SCALES
        if prequantized == 0:
            S = tokens.shape[1] // BLOCK_WORDS
            PB = S * CODE_WORDS * 8
            if LISTED:
                none = cuda.local.array(1, int32)  # the empty list: encode into the row
                none[0] = 0
                encode_blocks(tokens, t, 0, S, pairs_aligned(tokens), address_of(row), PB, lane, mbuf, peer_bases,
                              none, uint64(0), held, h0)
            else:
                encode_blocks(tokens, t, 0, S, pairs_aligned(tokens), address_of(row), PB, lane, mbuf, peer_bases,
                              uint64(0), uint64(0), held, h0)
        else:
            PB = tokens.shape[1] * 8
            for w in range(lane, tokens.shape[1], warp):  # the codes, then the scales' bytes
                row[w] = tokens[t, w]
            for j in range(lane, token_scales.shape[1], warp):
                store_u8_at(address_of(row) + uint64(PB), j, token_scales[t, j])

    return SimpleNamespace(MBUF_WORDS=threads, HELD_WORDS=warps * HELD_SCALES,
                           send_rows=send_rows_listed if LISTED else send_rows, pack_row=pack_row)


@functools.lru_cache(maxsize=None)
def make_receiver(spec, threads: int) -> SimpleNamespace:
    """The fp8 codec's receiver: a message's scales laid out for the expanded layout."""
    warp, _ = warp_geometry(threads)
    SB = int(spec.param("scale_bytes"))
    _, store_scales = make_encoder(warp, SB == 1)

    @cuda.jit(device=True)
    def lay_out(msg_u8, P, XB, expert_scales_u8, r, C, col_major, lane):
        """Every lane of a warp: the ``XB`` scale bytes of the message ``msg_u8`` (from byte ``P``)
        into expert row ``r`` of ``C`` (``store_scales``)."""
        store_scales(msg_u8, P, XB, expert_scales_u8, r, C, col_major, lane, 0)

    @cuda.jit(device=True)
    def zero(XB, expert_scales_u8, r, C, col_major, lane):
        """Every lane of a warp: padding row ``r``'s ``XB`` scale bytes, zero."""
        store_scales(expert_scales_u8, 0, XB, expert_scales_u8, r, C, col_major, lane, 1)

    @cuda.jit(device=True)
    def lay_out_batched(msg_u8, P, S, batched_scales_u8, e, pos, M, form, lane):
        """Every lane of a warp: the ``S`` block scales of the message ``msg_u8`` (from byte ``P``)
        for slot ``pos`` of local expert ``e`` in the batched layout's scales, ``M`` slots per
        expert, column-major per expert: ``form`` BATCHED_SCALES_FLOAT, float32 byte ``4 ((e S +
        b) M + pos)`` of block b (UE8M0 codes decoded to ``2**(code - 127)``); or
        BATCHED_SCALES_PACKED (UE8M0 only; S a multiple of 4), code b in byte ``b % 4`` of the
        int32 ``(e S / 4 + b / 4) M + pos``."""
        for b in range(lane, S, warp):
            if SB == 1 and form == BATCHED_SCALES_PACKED:
                j = b // 4
                batched_scales_u8[((e * (S // 4) + j) * M + pos) * 4 + (b - 4 * j)] = msg_u8[P + b]
            else:
                at = ((e * S + b) * M + pos) * 4
                if SB == 4:
                    for i in range(4):
                        batched_scales_u8[at + i] = msg_u8[P + 4 * b + i]
                else:
                    bits = ue8m0_bits(msg_u8[P + b])
                    for i in range(4):
                        batched_scales_u8[at + i] = uint8((bits >> uint32(8 * i)) & uint32(0xFF))

    return SimpleNamespace(lay_out=lay_out, zero=zero, lay_out_batched=lay_out_batched)


#: float32 bits of a NaN scale, and of 2**-127 (a subnormal: UE8M0 code 0).
_F32_BITS_NAN = 0x7FC00000
_F32_BITS_2_POW_M127 = 0x00400000


@cuda.jit(device=True)
def ue8m0_bits(code):
    """The float32 bits of UE8M0 scale ``code``: ``code << 23`` (``2**(code - 127)``), the
    subnormal 2**-127 for code 0, NaN for UE8M0_NAN."""
    c = uint32(code)
    if c == uint32(UE8M0_NAN):
        return uint32(_F32_BITS_NAN)
    if c == uint32(0):
        return uint32(_F32_BITS_2_POW_M127)
    return c << uint32(23)
