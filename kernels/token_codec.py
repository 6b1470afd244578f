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
from ep_runtime.kernels.block import warp_max_u32
from ep_runtime.kernels.cuda_api import cuda
from ep_runtime.kernels.fp8 import bf16_abs_max, e4m3_scale, quantize4, ue8m0_scale
from ep_runtime.kernels.vec import store_u8_at, store_u32_at
from ep_runtime.layout import PEER_TOKENS

#: bf16 words (4 values each) per 128-element scale block.
BLOCK_WORDS = 32
#: E4M3 code words (uint64, 8 codes each) per 128-element block.
CODE_WORDS = 16
#: bf16 words each lane loads before it encodes any (8 blocks of one word on a GPU).
WORDS_IN_FLIGHT = 8


def make_token_codec(warp: int, ue8m0: bool):
    """``(encode_blocks, store_scales)`` for warps of ``warp`` lanes (a divisor of 32) and scales
    that are UE8M0 codes (``ue8m0``, 1 byte) or float32 (4 bytes)."""
    SB = 1 if ue8m0 else 4

    @cuda.jit(device=True)
    def encode_blocks(tokens, t, b0, b1, stage32, stage8, PB, lane, buf64, peer_bases, sent, slot):
        """Every lane of one warp: encode 128-element blocks ``[b0, b1)`` of bf16 token ``t``
        (``tokens`` [T, W] uint64, 4 values a word) into a message: 4 codes per uint32 (block
        b is uint32 words ``32 b ..``), the block's scale bytes at byte ``PB + b * SB``.

        Where the message goes: with ``sent`` (uint64) zero, row ``t`` of the stage
        (``stage32`` / ``stage8``, uint32 and uint8 views), which the caller then sends after
        meeting the warp (``warp_sync``); otherwise straight into the receive slot of every
        rank ``d`` whose bit is set in ``sent``, at byte ``slot`` past ``peer_bases[PEER_TOKENS, d]``
        (its ``d_tokens`` as mapped here), with plain stores (``store_u32_at``: publish as
        ``Session.peer_view`` says). Blocks go ``WORDS_IN_FLIGHT / (32 / warp)`` at a time: each lane loads
        its words of all of them before it uses any (memory-level parallelism), the warp takes
        each block's amax with ``warp_max_u32``, the scale is ``e4m3_scale`` or ``ue8m0_scale``."""
        vals = cuda.local.array(WORDS_IN_FLIGHT, uint64)
        WPL = BLOCK_WORDS // warp  # words of a block per lane
        UB = WORDS_IN_FLIGHT // WPL  # blocks in flight
        for bb in range(b0, b1, UB):
            for u in range(UB):
                if bb + u < b1:
                    for q in range(WPL):
                        vals[u * WPL + q] = tokens[t, (bb + u) * BLOCK_WORDS + q * warp + lane]
            for u in range(UB):
                b = bb + u
                if b < b1:  # the same for every lane
                    m = uint32(0)
                    for q in range(WPL):
                        m = bf16_abs_max(m, vals[u * WPL + q])
                    a = bf16_to_f32(warp_max_u32(m, buf64))
                    if ue8m0:
                        scale, code = ue8m0_scale(a)
                    else:
                        scale = e4m3_scale(a)
                        code = f32_bits(scale)
                    if sent == uint64(0):
                        for q in range(WPL):
                            stage32[t, b * BLOCK_WORDS + q * warp + lane] = quantize4(vals[u * WPL + q], scale)
                        if lane < SB:
                            stage8[t, PB + b * SB + lane] = (uint32(code) >> uint32(8 * lane)) & uint32(0xFF)
                    else:
                        for q in range(WPL):
                            word = quantize4(vals[u * WPL + q], scale)
                            for d in range(peer_bases.shape[1]):
                                if (sent >> uint64(d)) & uint64(1):
                                    store_u32_at(peer_bases[PEER_TOKENS, d] + slot, b * BLOCK_WORDS + q * warp + lane,
                                                 word)
                        if lane == 0:
                            scales_at = slot + uint64(PB)  # uint64 + uint64 (an int64 term would make it float64)
                            for d in range(peer_bases.shape[1]):
                                if (sent >> uint64(d)) & uint64(1):
                                    if SB == 4:
                                        store_u32_at(peer_bases[PEER_TOKENS, d] + scales_at, b, uint32(code))
                                    else:
                                        store_u8_at(peer_bases[PEER_TOKENS, d] + scales_at, b, uint32(code))

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
