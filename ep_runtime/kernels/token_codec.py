"""Device side of the FP8 token formats (:mod:`ep_runtime.core.formats`): encode a token into its
message in dispatch_async, and lay a message's scales out in dispatch_copy.

The dispatch protocol moves messages of ``MW`` uint64 words and never looks inside them; these
two functions (and the device helpers they call) are the only code that does. A message is ``P``
payload words (the E4M3 codes, ``PB = 8 P = H`` bytes), then ``SB`` bytes of scale per
128-element block (4: float32, 1: UE8M0 code), then padding to ``MW`` words
(``TokenFormat.message_words``; never written or sent). Built per scale kind (a compile-time constant) by :func:`make_token_codec`; the rule is the reference's
(``ep_runtime/core/formats.py``), bit for bit.
"""

from numba import uint32, uint64

from ep_runtime.kernels.bits import bf16_to_f32
from ep_runtime.kernels.block import group_max_u32, warp_sync
from ep_runtime.kernels.cuda_api import cuda
from ep_runtime.kernels.fp8 import bf16_abs_max4, block_scale, pack8, quantize4_by, quantize4_scaled, scaled_directly
from ep_runtime.kernels.vec import load_pair, store_pair_at, store_u8_at, store_u32_at
from ep_runtime.kernels.protocol import PEER_TOKENS

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


def make_token_codec(warp: int, ue8m0: bool):
    """``(encode_blocks, store_scales)`` for warps of ``warp`` lanes (a multiple of
    ``BLOCK_LANES`` up to 32) and scales that are UE8M0 codes (``ue8m0``, 1 byte) or float32
    (4 bytes)."""
    if warp % BLOCK_LANES or warp > 32:
        raise ValueError(f"make_token_codec: warp={warp} must be a multiple of {BLOCK_LANES} up to 32")
    SB = 1 if ue8m0 else 4
    BPS = warp // BLOCK_LANES  # blocks per warp step
    WPL = WORDS_PER_LANE

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
            if sent == uint64(0):
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
            if sent == uint64(0):
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

        Where the message goes: with ``sent`` (uint64) zero, the stage row at byte address
        ``stage_at`` (this process's), which the caller sends after meeting the warp
        (``warp_sync``); otherwise straight into the receive slot of every rank ``d`` whose bit
        is set in ``sent``, at byte ``slot`` past ``peer_bases[PEER_TOKENS, d]`` (its ``d_tokens``
        as mapped here), with plain stores (publish as ``Session.peer_view`` says). Slots and
        stage rows start on 128-byte lines (``formats.QUANTIZED_MESSAGE_ALIGN``), so the
        512-byte warp stores of codes fill whole lines."""
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
