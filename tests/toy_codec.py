"""A toy token format, added the way docs/formats.md, "Adding a format", says: its
:class:`TokenFormat` (the NumPy reference, registered with ``formats.register_format``) and its
device codec (``make_sender`` / ``make_receiver``, this module), nothing else of the project.

``toy_i8``: a symmetric int8 code per element and a float32 scale per 128-element block, ``scale
= amax / 127`` (1 for an all-zero block), ``code = clamp(floor(x / scale + 1/2), -127, 127)``, all
in float32; decoded ``code * scale``. The sender encodes each token into its send stage, a warp a
token (every lane takes the block's amax itself: a toy), and sends the message with the plan's
transport (``send_part``); the receiver lays the scales out as the FP8 codec lays its float32
scales. Finite tokens only (a non-finite block is not part of the toy's rule).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
from numba import float32, int32, uint32, uint64

from ep_runtime.core import formats
from ep_runtime.kernels.bits import bf16_to_f32, f32_bits
from ep_runtime.kernels.block import warp_geometry, warp_sync
from ep_runtime.kernels.codecs import CodecSpec
from ep_runtime.kernels.codecs import fp8 as fp8_codec
from ep_runtime.kernels.cuda_api import cuda
from ep_runtime.kernels.vec import address_of, pairs_aligned, store_u8_at, store_u32_at

#: The codec's messages are computed from the tokens, never the caller's words.
RAW = False
ENCODES = True
#: Block of the scales, and the code's largest magnitude.
BLOCK = 128
QMAX = 127


def _scale(amax):
    return np.where(amax == 0, np.float32(1.0), (amax / np.float32(QMAX)).astype(np.float32)).astype(np.float32)


TOY_SCALE = formats.ScaleEncoding("toy_float32", np.dtype(np.float32), lambda a: (_scale(a), _scale(a)),
                                  lambda s: np.asarray(s, np.float32), lambda a, s: np.float32(1.0) / s)


@dataclass(frozen=True)
class ToyInt8Format(formats.TokenFormat):
    """``toy_i8``'s reference: :meth:`quantize` and :meth:`dequantize` by the rule above; the
    message layout (codes, then the float32 scales, then padding) is :class:`TokenFormat`'s."""

    def quantize(self, tokens):
        tokens = self._check_tokens(tokens)
        T, H = tokens.shape
        x = (tokens.astype(np.uint32) << 16).view(np.float32).reshape(T, H // BLOCK, BLOCK)
        scale = _scale(np.abs(x).max(axis=2, initial=np.float32(0.0)))
        q = (x / scale[:, :, None]).astype(np.float32)
        codes = np.clip(np.floor((q + np.float32(0.5)).astype(np.float32)), -QMAX, QMAX).astype(np.int8)
        return codes.view(np.uint8).reshape(T, H), scale

    def dequantize(self, payload, scales):
        T, H = payload.shape
        codes = np.asarray(payload).view(np.int8).astype(np.float32).reshape(T, H // BLOCK, BLOCK)
        return (codes * np.asarray(scales, np.float32)[:, :, None]).astype(np.float32).reshape(T, H)


TOY_I8 = formats.register_format(ToyInt8Format(
    "toy_i8", np.dtype(np.uint8), BLOCK, TOY_SCALE, CodecSpec("toy_codec", (("stages", True), ("scale_bytes", 4)))))


def make_sender(spec, threads: int, tp, destinations, lands: bool) -> SimpleNamespace:
    warp, warps = warp_geometry(threads)
    send_part = tp.send_part

    @cuda.jit(device=True)
    def value(tokens, t, i):
        """Element ``i`` of bf16 token ``t`` (``tokens`` [T, W] words of ``tokens.itemsize / 2``
        values) as float32."""
        per = tokens.itemsize // 2
        w = tokens[t, i // per]
        return bf16_to_f32(uint32((uint64(w) >> uint64(16 * (i % per))) & uint64(0xFFFF)))

    @cuda.jit(device=True)
    def encode(tokens, token_scales, token_global_scale_u8, prequantized, t, row, lane):
        """Every lane of a warp: token ``t``'s message into the local row ``row`` (uint64 words)."""
        at = address_of(row)
        if prequantized != 0:  # the caller's codes (uint64 words) and scales' bytes
            for w in range(lane, tokens.shape[1], warp):
                row[w] = tokens[t, w]
            for j in range(lane, token_scales.shape[1], warp):
                store_u8_at(at + uint64(tokens.shape[1] * 8), j, token_scales[t, j])
            return
        H = tokens.shape[1] * (tokens.itemsize // 2)
        for b in range(H // BLOCK):
            amax = float32(0.0)
            for i in range(b * BLOCK, b * BLOCK + BLOCK):
                amax = max(amax, abs(value(tokens, t, i)))
            scale = float32(1.0) if amax == float32(0.0) else float32(amax / float32(QMAX))
            for j in range(b * BLOCK // 4 + lane, b * BLOCK // 4 + BLOCK // 4, warp):  # 4 codes a lane a step
                packed = uint32(0)
                for u in range(4):
                    q = float32(value(tokens, t, 4 * j + u) / scale)
                    c = min(max(int32(math.floor(float32(q + float32(0.5)))), -QMAX), QMAX)
                    packed |= uint32(c & 0xFF) << uint32(8 * u)
                store_u32_at(at, j, packed)
            if lane == 0:
                store_u32_at(at + uint64(H), b, f32_bits(scale))

    @cuda.jit(device=True)
    def send_rows(tokens, token_scales, token_global_scale_u8, prequantized, ids_base, rows, rows_u8, stage, stage_u8,
                  row_flag, peer_bases, T, K, L, R, me, n, token_blocks, mbuf, held, ids_l, lo, hi):
        lane = cuda.threadIdx.x % warp
        MW = rows.shape[2]
        pairs = MW % 2 == 0 and pairs_aligned(stage) and pairs_aligned(rows)
        t = cuda.blockIdx.x * warps + cuda.threadIdx.x // warp
        while cuda.blockIdx.x < token_blocks and t < T:  # a warp a token
            sent = destinations(ids_base + uint64(4 * t * K), K, L, R, me, uint64(0), ids_l)
            if sent != 0:
                encode(tokens, token_scales, token_global_scale_u8, prequantized, t, stage[t], lane)
                warp_sync()  # the message is staged before the warp sends it
                send_part(rows, me, t, stage[t], 0, MW, sent, R, peer_bases, pairs, lane, lo, hi)
            t += token_blocks * warps
        return True

    @cuda.jit(device=True)
    def pack_row(tokens, token_scales, token_global_scale_u8, prequantized, t, row, lane, mbuf, peer_bases, held, lo,
                 hi):
        encode(tokens, token_scales, token_global_scale_u8, prequantized, t, row, lane)

    return SimpleNamespace(MBUF_WORDS=1, HELD_WORDS=1, send_rows=send_rows, pack_row=pack_row)


def make_receiver(spec, threads: int) -> SimpleNamespace:
    """The scales are float32 per 128 elements: laid out as the fp8 codec lays its own."""
    return fp8_codec.make_receiver(spec, threads)
