"""Device side of the FP8 token formats (:mod:`ep_runtime.formats`): encode a token into its
message in dispatch_async, and lay a message's scales out in dispatch_copy.

The dispatch protocol moves messages of ``MW`` uint64 words and never looks inside them; these
two functions are the only code that does. A message is ``P`` payload words (the E4M3 codes,
``PB = 8 P = H`` bytes), then ``SB`` bytes of scale per 128-element block (4: float32, 1: UE8M0
code), then padding to ``MW`` words (``TokenFormat.message_words``; never written or sent). Built per scale kind
(a compile-time constant) by :func:`make_token_codec`; the rule is the reference's
(``ep_runtime/formats.py``), bit for bit.
"""

from numba import uint32, uint64

from ep_runtime.kernels.bits import bf16_to_f32, f32_bits
from ep_runtime.kernels.block import group_max_u32
from ep_runtime.kernels.cuda_api import cuda
from ep_runtime.kernels.fp8 import (bf16_abs_max, e4m3_inverse, e4m3_scale, pack8, quantize4_by, ue8m0_inverse,
                                    ue8m0_scale)
from ep_runtime.kernels.vec import load_pair, store_pair_at, store_u8_at, store_u32_at
from ep_runtime.layout import PEER_TOKENS

#: bf16 words (4 values each) per 128-element scale block.
BLOCK_WORDS = 32
#: E4M3 code words (uint64, 8 codes each) per 128-element block.
CODE_WORDS = 16
#: Lanes that encode one 128-element block together: each holds ``WORDS_PER_LANE`` bf16 words
#: (16 values, 32 bytes loaded as two word pairs) and stores their 16 codes as one word pair.
BLOCK_LANES = 8
WORDS_PER_LANE = BLOCK_WORDS // BLOCK_LANES
#: Warp steps (``warp / BLOCK_LANES`` blocks each) whose words a lane loads before it encodes
#: any: 64 bytes per lane in flight, 8 blocks per 32-lane warp.
STEPS_IN_FLIGHT = 2


def make_token_codec(warp: int, ue8m0: bool):
    """``(encode_blocks, store_scales)`` for warps of ``warp`` lanes (a multiple of
    ``BLOCK_LANES`` up to 32) and scales that are UE8M0 codes (``ue8m0``, 1 byte) or float32
    (4 bytes)."""
    if warp % BLOCK_LANES or warp > 32:
        raise ValueError(f"make_token_codec: warp={warp} must be a multiple of {BLOCK_LANES} up to 32")
    SB = 1 if ue8m0 else 4
    BPS = warp // BLOCK_LANES  # blocks per warp step
    WPL = WORDS_PER_LANE
    SIF = STEPS_IN_FLIGHT
    NV = SIF * WPL  # words a lane holds (a compile-time size)

    @cuda.jit(device=True)
    def store_scale(at, b, code):
        """Block ``b``'s scale (its code: float32 bits or the UE8M0 byte) at byte address
        ``at`` (the message's scales)."""
        if SB == 4:
            store_u32_at(at, b, uint32(code))
        else:
            store_u8_at(at, b, uint32(code))

    @cuda.jit(device=True)
    def encode_blocks(tokens, t, b0, b1, src_pairs, stage_at, PB, lane, buf64, peer_bases, sent, slot):
        """Every lane of one warp: encode 128-element blocks ``[b0, b1)`` of bf16 token ``t``
        (``tokens`` [T, W] uint64, 4 values a word; ``src_pairs``: its rows are 16-byte aligned,
        loaded as word pairs) into a message: block b's 128 codes are code words
        ``CODE_WORDS b ..``, its scale bytes at byte ``PB + b SB``.

        A warp step covers ``warp / BLOCK_LANES`` consecutive blocks, ``BLOCK_LANES`` lanes
        each: a lane loads 16 values (two word pairs), the lanes of a block take its amax with
        ``group_max_u32`` (3 shuffles), the scale is ``e4m3_scale`` or ``ue8m0_scale``, and each
        lane stores its 16 codes as one 16-byte pair (a warp store: 512 contiguous bytes) and
        the block's first lane its scale (a warp store: the step's scales, contiguous). Lanes
        load ``STEPS_IN_FLIGHT`` steps before they encode any (memory-level parallelism).

        Where the message goes: with ``sent`` (uint64) zero, the stage row at byte address
        ``stage_at`` (this process's), which the caller sends after meeting the warp
        (``warp_sync``); otherwise straight into the receive slot of every rank ``d`` whose bit
        is set in ``sent``, at byte ``slot`` past ``peer_bases[PEER_TOKENS, d]`` (its ``d_tokens``
        as mapped here), with plain stores (publish as ``Session.peer_view`` says). Slots and
        stage rows start 16-byte aligned (messages are whole word pairs:
        ``formats.QUANTIZED_MESSAGE_ALIGN``)."""
        vals = cuda.local.array(NV, uint64)
        grp = lane // BLOCK_LANES  # the step's block this lane encodes
        j = lane - grp * BLOCK_LANES  # this lane's 16 values of it
        row = tokens[t]
        for bb in range(b0, b1, BPS * SIF):
            for u in range(SIF):
                b = bb + u * BPS + grp
                if b < b1:
                    w = b * BLOCK_WORDS + j * WPL
                    if src_pairs:
                        for q in range(0, WPL, 2):
                            pair = load_pair(row, w + q)
                            vals[u * WPL + q] = pair[0]
                            vals[u * WPL + q + 1] = pair[1]
                    else:
                        for q in range(WPL):
                            vals[u * WPL + q] = row[w + q]
            for u in range(SIF):
                b = bb + u * BPS + grp
                m = uint32(0)
                if b < b1:
                    for q in range(WPL):
                        m = bf16_abs_max(m, vals[u * WPL + q])
                a = bf16_to_f32(group_max_u32(m, BLOCK_LANES, buf64))  # every lane: full-warp shuffles
                if b < b1:
                    if ue8m0:  # a power of two: its exact reciprocal (the division's quotients)
                        scale, code = ue8m0_scale(a)
                        inv = ue8m0_inverse(code)
                    else:  # the rule's multiplier, 448 / amax (0: divide)
                        scale = e4m3_scale(a)
                        code = f32_bits(scale)
                        inv = e4m3_inverse(a)
                    lo = pack8(quantize4_by(vals[u * WPL], scale, inv), quantize4_by(vals[u * WPL + 1], scale, inv))
                    hi = pack8(quantize4_by(vals[u * WPL + 2], scale, inv), quantize4_by(vals[u * WPL + 3], scale, inv))
                    cw = b * CODE_WORDS + 2 * j  # this lane's code words
                    scales_at = uint64(PB)  # uint64 + uint64 below (an int64 term would make it float64)
                    if sent == uint64(0):
                        store_pair_at(stage_at, cw, lo, hi)
                        if j == 0:
                            store_scale(stage_at + scales_at, b, code)
                    else:
                        for d in range(peer_bases.shape[1]):
                            if (sent >> uint64(d)) & uint64(1):
                                at = peer_bases[PEER_TOKENS, d] + slot
                                store_pair_at(at, cw, lo, hi)
                                if j == 0:
                                    store_scale(at + scales_at, b, code)

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
