"""Device side of the FP8 token formats (:mod:`ep_runtime.formats`): encode a token into its
message in dispatch_async, and lay a message's scales out in dispatch_copy.

The dispatch protocol moves messages of ``MW`` uint64 words and never looks inside them; these
two functions are the only code that does. A message is ``P`` payload words (the E4M3 codes,
``PB = 8 P = H`` bytes), then ``SB`` bytes of scale per 128-element block (4: float32, 1: UE8M0
code), then zero padding to ``MW`` words (``TokenFormat.message_words``). Built per scale kind
(a compile-time constant) by :func:`make_token_codec`; the rule is the reference's
(``ep_runtime/formats.py``), bit for bit.
"""

from numba import uint32

from ep_runtime.kernels.bits import bf16_to_f32, f32_bits, word_f32
from ep_runtime.kernels.block import warp_sync
from ep_runtime.kernels.cuda_api import cuda
from ep_runtime.kernels.fp8 import bf16_abs_max, e4m3_quantize, e4m3_scale, pack4, ue8m0_scale

#: bf16 words (4 values each) per 128-element scale block.
BLOCK_WORDS = 32


def make_token_codec(warp: int, ue8m0: bool):
    """``(encode_token, store_scales)`` for warps of ``warp`` lanes and scales that are UE8M0 codes
    (``ue8m0``, 1 byte) or float32 (4 bytes)."""
    SB = 1 if ue8m0 else 4

    @cuda.jit(device=True)
    def encode_token(tokens, token_scales, prequantized, t, stage64, stage32, stage8, amax, slot, lane):
        """Every lane of one warp: write the message of token ``t`` into row ``t`` of the stage.

        ``prequantized`` (int64) nonzero: ``tokens`` [T, P] uint64 are the codes (8 per word)
        and ``token_scales`` [T, S * SB] uint8 the scales' bytes: copied. Zero: ``tokens``
        [T, W] uint64 are bf16 words (4 values each); per 128-element block the lanes fold the
        block's amax (``bf16_abs_max``), meet on ``amax[slot]`` (a uint32 in shared memory, one
        per warp), take the scale (``e4m3_scale`` or ``ue8m0_scale``) and store 4 codes per
        word (``stage32``, a uint32 view of the stage); lane 0 stores the block's scale bytes
        (``stage8``, a uint8 view). The padding bytes are zeroed. The caller meets the warp
        (``warp_sync``) before anything reads the row.
        """
        MB = stage64.shape[1] * 8
        if prequantized != 0:
            P = tokens.shape[1]
            for w in range(lane, P, warp):
                stage64[t, w] = tokens[t, w]
            PB = P * 8
            SBYTES = token_scales.shape[1]
            for k in range(lane, SBYTES, warp):
                stage8[t, PB + k] = token_scales[t, k]
            for k in range(PB + SBYTES + lane, MB, warp):
                stage8[t, k] = 0
            return
        W = tokens.shape[1]
        S = W // BLOCK_WORDS
        PB = W * 4
        for b in range(S):
            m = uint32(0)
            for w in range(b * BLOCK_WORDS + lane, (b + 1) * BLOCK_WORDS, warp):
                m = bf16_abs_max(m, tokens[t, w])
            if lane == 0:
                amax[slot] = uint32(0)
            warp_sync()
            cuda.atomic.max(amax, slot, m)
            warp_sync()
            a = bf16_to_f32(amax[slot])
            warp_sync()  # every lane has read it before the next block resets it
            if ue8m0:
                scale, code = ue8m0_scale(a)
            else:
                scale = e4m3_scale(a)
                code = f32_bits(scale)
            for w in range(b * BLOCK_WORDS + lane, (b + 1) * BLOCK_WORDS, warp):
                v = tokens[t, w]
                stage32[t, w] = pack4(e4m3_quantize(word_f32(v, 0), scale), e4m3_quantize(word_f32(v, 1), scale),
                                      e4m3_quantize(word_f32(v, 2), scale), e4m3_quantize(word_f32(v, 3), scale))
            if lane == 0:
                for k in range(SB):
                    stage8[t, PB + b * SB + k] = (uint32(code) >> uint32(8 * k)) & uint32(0xFF)
        for k in range(PB + S * SB + lane, MB, warp):
            stage8[t, k] = 0

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

    return encode_token, store_scales
