"""Token formats: how a token is encoded into a message, its bytes, and how it is decoded.

A :class:`TokenFormat` describes one token on the wire and holds the NumPy reference of its
encoding. The dispatch protocol moves messages of :meth:`TokenFormat.message_words` uint64
words and never looks inside, so adding a format touches only this module and its codec
(:mod:`ep_runtime.kernels.codecs`). Formats:

``BF16`` (``"bf16"``)
    Today's format: the token's bf16 bit patterns (uint16), no scales. Encoding is the identity.
``FP8_E4M3`` (``"fp8_e4m3"``)
    One E4M3 code (uint8, ``ml_dtypes.float8_e4m3fn``) per element and one float32 scale per
    block of 128 consecutive elements of a token.
``FP8_E4M3_UE8M0`` (``"fp8_e4m3_ue8m0"``)
    E4M3 codes with a power-of-two scale per 128-element block, stored as one uint8 biased
    exponent ``code``: scale ``2**(code - 127)`` (code 255 is NaN, as in OCP MX's E8M0).
``NVFP4`` (``"nvfp4"``)
    E2M1 codes, two a byte, an E4M3 scale per 16 elements and the tensor's float32 global
    scale in every message (below).

Message layout (one token, every format)
    ``payload_bytes`` bytes of payload (the elements, little-endian), then ``scale_bytes``
    bytes of scales (block order; NVFP4: then its 4-byte global scale, ``extras_bytes`` in
    all), then zero padding to a whole number of 8-byte words
    (``MESSAGE_ALIGN``; for the quantized formats ``QUANTIZED_MESSAGE_ALIGN``, 128 bytes,
    so every slot starts on a cache line):
    ``message_bytes = message_words * 8``. Scales start at ``scale_offset_bytes =
    payload_bytes``, itself a multiple of 16 for FP8 (hidden % 128 == 0). Example: hidden 7168
    in FP8_E4M3 is 7168 + 56 * 4 = 7392 bytes padded to 7424 (928 words); in FP8_E4M3_UE8M0
    7168 + 56 = 7224 bytes padded to 7296 (912 words); in BF16 14336 bytes (1792 words).

Quantization rule (FP8 formats; the device code in ep_runtime/kernels/fp8.py gives the same bits)
    Per token and per block of 128 elements (bf16 values ``x``, widened exactly to float32):

    1. ``amax = max |x|`` over the block, in float32 (exact: the largest bf16 magnitude).
    2. Scale. FP8_E4M3: ``scale = amax / 448`` (float32, IEEE division, round to nearest even);
       ``scale = 1.0`` when ``amax == 0``. FP8_E4M3_UE8M0: ``scale = 2**(code - 127)`` the
       smallest power of two with ``amax <= 448 * scale`` (an exact test on amax's float32
       exponent and mantissa: no division, no log2), but at least ``2**-127`` (code 0, for
       ``amax < 2**-118``); ``amax == 0`` gives code 127 (scale 1.0). Codes of finite blocks
       are at most 247.
    3. Each element's code is ``e4m3(q)``, ``q`` the element's quotient in float32:
       FP8_E4M3: ``q = x * inv`` with ``inv = 448 / amax`` (IEEE division once per block,
       DeepEP's form; ``inv = 1`` for ``amax == 0``), or ``q = x / scale`` (IEEE division) for
       the blocks where ``inv`` overflows (``amax`` below about 2**-119.2); FP8_E4M3_UE8M0:
       ``q = x * 2**(127 - code)``, which equals ``x / scale`` bit for bit (an exact
       reciprocal). Then conversion to E4M3 exactly as ``ml_dtypes.float8_e4m3fn`` converts
       float32: round to nearest, ties to even, subnormals (steps of 2**-9) included, the sign
       kept (-0.0 gives 0x80); magnitudes that round above 448 (more than 464; 464 ties to 448)
       and inf/NaN become NaN (0x7F, 0xFF), as E4M3 has no infinity. By construction ``|q| <=
       448`` except for two float32 roundings (and, for a float32-subnormal E4M3 scale, ``amax
       < 2**-117``, by at most 0.4 %), so finite blocks never produce NaN codes.
    4. Decoding is ``e4m3_value(code) * scale`` in float32 (exact for UE8M0 scales unless the
       product is a float32 subnormal). Rounding up can carry a value past the float32 maximum:
       elements within 2**-4 of it (``|x| > 3.2e38``) may decode to +-inf.

    Error bound: for a finite block with scale ``s``, each element ``x`` (``|x| <= 3.2e38``)
    and its decoded ``d``: ``|d - x| <= 2**-4 * max(|x|, 2**-6 * s) * (1 + 2**-18)``. E4M3 keeps
    3 mantissa bits, so rounding moves a normal value by at most half an ulp, ``2**-4`` of its
    magnitude, and a subnormal one (``|x / s| < 2**-6``) by at most ``2**-10 * s``; the float32
    quotient (one or two roundings) and the product add at most ``2**-22 |x|``. As ``|x| <=
    amax <= 448 s``, the error is at most ``2**-4`` (times ``1 + 2**-18``) of the block's range
    ``448 s``.

    Non-finite tokens (the runtime rejects non-finite router weights in debug mode, never
    tokens): a block holding any inf or NaN has a non-finite amax (NaN magnitudes order above
    inf, so NaN propagates into amax); its scale is NaN (float32 0x7FC00000; UE8M0 code 255)
    and every code of the block is 0x7F, so the whole block decodes to NaN. Other blocks of
    the token are unaffected.

NVFP4 (``"nvfp4"``; hidden a multiple of 64)
    Message: the E2M1 codes, two a byte (``hidden / 2`` bytes; element 2i in the low nibble of
    byte i, 2i + 1 in the high one), the E4M3 block scales (``hidden / 16`` bytes, block j covers
    elements 16 j .. 16 j + 15), the tensor's float32 global scale (4 bytes), padding to 128-byte
    lines: 3584 + 448 + 4 bytes in 4096 (512 words) at hidden 7168. The rule, every operation
    float32 IEEE round to nearest even (NVIDIA's decode ``x ~= e2m1 * e4m3 * global``):

    1. The global scale ``g`` (per tensor: the caller's, or the rule's): ``A / 2688`` (6 x 448),
       ``A`` the largest finite magnitude of the tensor; 1.0 when there is none (all zero).
       Non-finite elements do not enter it: their blocks are NaN blocks (step 2) on their own.
    2. Per block of 16, ``a = max |x|``. A block holding inf or NaN gets scale 0x7F (E4M3 NaN)
       and every code 0. Otherwise the scale is ``e4m3_saturated(a / (6 g))`` (``6 g`` rounded
       once per tensor; round to nearest even, magnitudes above 448 saturate to 448, NaN gives
       0x7F), ``S`` its value, the multiplier ``m = 1 / (S g)`` (one reciprocal of the rounded
       product per block), or 0 where that is not finite (``S g`` zero, NaN or below about
       2**-128: an all-zero block has ``S = 0``).
    3. Each code is ``e2m1(x * m)``: the product rounded once, then to the nearest of 0, 0.5, 1,
       1.5, 2, 3, 4, 6, ties to the even code (0.25 -> 0, 0.75 -> 1, 5 -> 4), magnitudes above 6
       (inf) saturate to 6, the sign bit kept (-0.0 and small negatives give 0x8). E2M1 has no
       inf or NaN; so an all-zero block has codes 0 (0x8 for -0.0) and scale 0.
    4. Decoding: ``e2m1(code) * S`` (exact) times ``g`` (one rounding); a NaN scale gives NaN.

    Error bound: for a finite block whose scale is an E4M3 normal (``a / (6 g) >= 2**-6``) and
    ``g`` from step 1, each decoded ``d`` of ``x`` has ``|d - x| <= S g (1 + 2**-20)``: E2M1
    rounds ``|x| m`` (at most ``6 (1 + 2**-4)``, the scale's rounding) by at most half its
    widest step, 2 (between 4 and 6), and saturation at 6 by at most 0.375.

Arrays: tokens are ``[T, hidden]`` uint16 bf16 bit patterns; FP8 payloads ``[T, hidden]``
uint8 E4M3 codes (NVFP4: ``[T, hidden / 2]`` packed E2M1 codes); scales ``[T, hidden / block]``
float32 or uint8 (block ``j`` covers elements ``block j .. block (j + 1) - 1``); messages ``[T,
message_words]`` uint64.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import ml_dtypes
import numpy as np

from ep_runtime.core.errors import EPConfigError, EPInputError
from ep_runtime.kernels.codecs import WORDS, CodecSpec
# E4M3_NAN: NaN's code with a + sign (0xFF is the - one), every code of a block with a non-finite
# element; UE8M0_NAN: a NaN scale's code (E8M0 has no infinity; finite blocks' codes stay below 248)
from ep_runtime.kernels.protocol import E4M3_MAX, E4M3_NAN, UE8M0_NAN
from ep_runtime.core.nvfp4_rule import (E2M1_MAX, E2M1_VALUES, NVFP4_BLOCK, NVFP4_GLOBAL_BYTES,  # noqa: F401
                                        NVFP4_GLOBAL_RANGE, NVFP4_HIDDEN_MULTIPLE, e2m1_codes, e2m1_value,
                                        e4m3_saturated, nvfp4_global_scale)

#: Every message is a whole number of these bytes (uint64 words: what the kernels move).
MESSAGE_ALIGN = 8
#: A quantized format's message is a whole number of 128-byte lines, so every receive slot and
#: stage row starts line-aligned: the encoder's 512-byte warp stores of codes (16-byte pairs,
#: ep_runtime/kernels/codecs/fp8.py) then fill whole lines, and a peer receives 4 full-line writes per
#: warp step instead of 5 partial ones (a 16-byte multiple left three rows in four off the
#: line at hidden 7168). The padding is never written or sent.
QUANTIZED_MESSAGE_ALIGN = 128
#: Elements per scale block of the FP8 formats.
FP8_BLOCK = 128
#: UE8M0 code of scale 1.0 (an all-zero block).
UE8M0_ONE = 127

_E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
_F32_NAN_BITS = 0x7FC00000
_F32_BITS_2_POW_M127 = 0x00400000
#: float32 mantissa field of 1.75 (448 = 1.75 * 2**8): a larger mantissa needs the next power.
_F32_MANTISSA_1_75 = 0x600000


# -- scale encodings ---------------------------------------------------------------------------
def _bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    return (np.asarray(bits).astype(np.uint32) << 16).view(np.float32)


def _f32_from_bits(bits) -> np.ndarray:
    return np.asarray(bits, np.uint32).view(np.float32)


def _float32_scale(amax: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """FP8_E4M3: ``amax / 448`` (float32), 1.0 for amax 0, NaN for non-finite amax."""
    with np.errstate(invalid="ignore", over="ignore"):
        scale = np.where(amax == 0, np.float32(1.0), amax / np.float32(E4M3_MAX)).astype(np.float32)
    scale = np.where(np.isfinite(amax), scale, _f32_from_bits(_F32_NAN_BITS))
    return scale, scale


def _float32_inverse(amax: np.ndarray, stored: np.ndarray) -> np.ndarray:
    """FP8_E4M3's multiplier: ``448 / amax`` (float32, IEEE division), 1.0 for amax 0, and 0.0
    (divide by the scale instead) where amax is not finite or the quotient overflows."""
    amax = np.asarray(amax, np.float32)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        inv = (np.float32(E4M3_MAX) / amax).astype(np.float32)
    inv = np.where(amax == 0, np.float32(1.0), inv)
    return np.where(np.isfinite(amax) & np.isfinite(inv), inv, np.float32(0.0)).astype(np.float32)


def _float32_scale_value(stored: np.ndarray) -> np.ndarray:
    return np.asarray(stored, np.float32)


def ue8m0_value(codes: np.ndarray) -> np.ndarray:
    """float32 ``2**(code - 127)`` of uint8 UE8M0 ``codes`` (code 0 is the float32 subnormal
    2**-127; code 255 is NaN 0x7FC00000). Same shape."""
    c = np.asarray(codes).astype(np.uint32)
    bits = np.where(c == UE8M0_NAN, _F32_NAN_BITS, np.where(c == 0, _F32_BITS_2_POW_M127, c << 23))
    return _f32_from_bits(bits.astype(np.uint32))


def _ue8m0_inverse(amax: np.ndarray, codes: np.ndarray) -> np.ndarray:
    """FP8_E4M3_UE8M0's multiplier: ``2**(127 - code)``, the scale's exact reciprocal (products
    by it equal the quotients by the scale bit for bit); 0.0 for the NaN code."""
    c = np.asarray(codes).astype(np.int32)
    inv = np.ldexp(np.float32(1.0), 127 - np.minimum(c, 254)).astype(np.float32)
    return np.where(c == UE8M0_NAN, np.float32(0.0), inv).astype(np.float32)


def _ue8m0_scale(amax: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """FP8_E4M3_UE8M0: smallest power of two with ``amax <= 448 * scale`` (>= 2**-127)."""
    a = np.asarray(amax, np.float32).view(np.uint32) & np.uint32(0x7FFFFFFF)
    code = (a >> 23).astype(np.int32) - 8 + ((a & 0x7FFFFF) > _F32_MANTISSA_1_75)
    code = np.maximum(code, 0)
    code = np.where(a == 0, UE8M0_ONE, code)
    code = np.where(a >= 0x7F800000, UE8M0_NAN, code).astype(np.uint8)
    return ue8m0_value(code), code


@dataclass(frozen=True)
class ScaleEncoding:
    """How a block's scale is derived from its amax and stored.

    ``from_amax(amax float32 [...]) -> (scale float32 [...], stored [...] dtype)``: the scale
    and its stored form; ``value(stored) -> float32 [...]`` recovers the scale;
    ``inverse(amax, stored) -> float32 [...]``: the multiplier the elements are quantized by
    (``x * inverse``), or 0.0 where they are divided by the scale instead (rule step 3).
    """

    name: str
    dtype: np.dtype
    from_amax: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]
    value: Callable[[np.ndarray], np.ndarray]
    inverse: Callable[[np.ndarray, np.ndarray], np.ndarray]


FLOAT32_SCALE = ScaleEncoding("float32", np.dtype(np.float32), _float32_scale, _float32_scale_value, _float32_inverse)
UE8M0_SCALE = ScaleEncoding("ue8m0", np.dtype(np.uint8), _ue8m0_scale, ue8m0_value, _ue8m0_inverse)


# -- formats -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class TokenFormat:
    """One token's encoding on the wire.

    Attributes
    ----------
    name : the name :func:`get_format` knows it by.
    element_dtype : payload element: uint16 (bf16 bits) or uint8 (E4M3 codes; NVFP4: two E2M1
        codes a byte).
    block : elements per scale block (None: no scales).
    scale : the encoding of the block-scale rule the FP8 formats share (None for BF16, and for a
        format with its own rule, such as NVFP4, which overrides :attr:`scale_dtype`).
    codec : the device codec the kernels are built with (:mod:`ep_runtime.kernels.codecs`).
    """

    name: str
    element_dtype: np.dtype
    block: int | None
    scale: ScaleEncoding | None
    codec: CodecSpec = WORDS

    #: Whether a message also carries its tensor's float32 global scale (NVFP4).
    has_global_scale = False
    #: Elements one payload item (of ``element_dtype``) holds: 1, or 2 (NVFP4: two codes a byte).
    elements_per_item = 1

    def __post_init__(self):
        if (self.block is None) != (self.scale_dtype is None):
            raise ValueError(f"token format {self.name!r}: block and scale go together")
        if self.block is not None and (self.block * self.element_dtype.itemsize) % MESSAGE_ALIGN:
            raise ValueError(f"token format {self.name!r}: a block of {self.block} elements must fill "
                             f"whole {MESSAGE_ALIGN}-byte words, so the scales start on a word")

    # -- properties ------------------------------------------------------------------------------
    @property
    def quantized(self) -> bool:
        """Whether tokens are quantized (carry scales)."""
        return self.block is not None

    @property
    def scale_dtype(self) -> np.dtype | None:
        """Stored scale dtype: float32, uint8 (UE8M0 exponent) or None."""
        return None if self.scale is None else self.scale.dtype

    @property
    def hidden_multiple(self) -> int:
        """What ``hidden`` must be a multiple of: the block (1 without scales)."""
        return self.block or 1

    # -- layout ----------------------------------------------------------------------------------
    def validate_hidden(self, hidden: int) -> None:
        """Raise :class:`EPConfigError` unless tokens of ``hidden`` elements fit this format:
        a positive int, and for block formats a multiple of :attr:`hidden_multiple` (the block:
        the payload is whole words and the scales start on a word)."""
        if isinstance(hidden, bool) or not isinstance(hidden, (int, np.integer)):
            raise EPConfigError(f"token format {self.name!r}: hidden={hidden!r} must be an int, got "
                                f"{type(hidden).__name__}; pass int(hidden)")
        if hidden < 1:
            raise EPConfigError(f"token format {self.name!r}: hidden={hidden} must be >= 1; pass the "
                                f"model's hidden size")
        m = self.hidden_multiple
        if hidden % m:
            up = -(-hidden // m) * m
            raise EPConfigError(
                f"token format {self.name!r}: hidden={hidden} must be a multiple of {m} "
                f"(one scale per {self.block} elements, and a message of whole {MESSAGE_ALIGN}-byte "
                f"words{self._hidden_reason}); pad hidden to {up} or use token format 'bf16'")

    #: What more than the block makes :attr:`hidden_multiple` (a format's own reason, or nothing).
    _hidden_reason = ""

    def payload_bytes(self, hidden: int) -> int:
        """Bytes of one token's elements."""
        self.validate_hidden(hidden)
        return hidden // self.elements_per_item * self.element_dtype.itemsize

    def scale_count(self, hidden: int) -> int:
        """Scales per token (``hidden / block``; 0 without scales)."""
        self.validate_hidden(hidden)
        return 0 if self.block is None else hidden // self.block

    def payload_width(self, hidden: int) -> int:
        """Elements of ``element_dtype`` in one token's payload (its arrays' last axis)."""
        return self.payload_bytes(hidden) // self.element_dtype.itemsize

    def scale_bytes(self, hidden: int) -> int:
        """Bytes of one token's block scales."""
        return 0 if self.scale_dtype is None else self.scale_count(hidden) * self.scale_dtype.itemsize

    def extras_bytes(self, hidden: int) -> int:
        """Bytes of a message after its payload, padding aside: the block scales (and a
        format's other fields: NVFP4's global scale). What a codec's receiver lays out."""
        return self.scale_bytes(hidden)

    def scale_offset_bytes(self, hidden: int) -> int:
        """Byte offset of the scales in a message (right after the payload)."""
        return self.payload_bytes(hidden)

    def message_bytes(self, hidden: int) -> int:
        """Bytes of one token's message: payload, scales (and extras), zero padding to
        ``MESSAGE_ALIGN`` (``QUANTIZED_MESSAGE_ALIGN`` for a quantized format)."""
        raw = self.payload_bytes(hidden) + self.extras_bytes(hidden)
        align = QUANTIZED_MESSAGE_ALIGN if self.quantized else MESSAGE_ALIGN
        return -(-raw // align) * align

    def message_words(self, hidden: int) -> int:
        """uint64 words of one token's message."""
        return self.message_bytes(hidden) // MESSAGE_ALIGN

    # -- reference encoding ------------------------------------------------------------------------
    def quantize(self, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """Encode tokens by the module's quantization rule.

        Parameters
        ----------
        tokens : [T, hidden] uint16, bf16 bit patterns.

        Returns
        -------
        payload : [T, hidden] ``element_dtype`` (uint16 bits for BF16: a copy of ``tokens``;
            uint8 E4M3 codes for FP8).
        scales : [T, hidden / block] ``scale_dtype``, or None for BF16.
        """
        tokens = self._check_tokens(tokens)
        if self.scale is None:
            return tokens.copy(), None
        T, H = tokens.shape
        blocks = tokens.reshape(T, H // self.block, self.block)
        # |x| patterns order like |x|, NaNs above inf: their max is amax's pattern, NaN-propagating.
        amax_bits = (blocks & np.uint16(0x7FFF)).max(axis=2, initial=0)
        finite = amax_bits < 0x7F80
        amax = _bf16_bits_to_f32(amax_bits)
        scale, stored = self.scale.from_amax(amax)
        inv = self.scale.inverse(amax, stored)[:, :, None]
        x = _bf16_bits_to_f32(blocks)
        with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
            q = np.where(inv != 0, x * inv, x / scale[:, :, None]).astype(np.float32)
            codes = q.astype(_E4M3).view(np.uint8)
        codes = np.where(finite[:, :, None], codes, np.uint8(E4M3_NAN))
        return codes.reshape(T, H), stored

    def dequantize(self, payload: np.ndarray, scales: np.ndarray | None) -> np.ndarray:
        """Decode: ``[T, hidden]`` float32, ``e4m3_value(code) * scale`` (the bf16 values for BF16).

        ``payload`` [T, hidden] ``element_dtype``; ``scales`` [T, hidden / block]
        ``scale_dtype`` (None for BF16).
        """
        payload = np.asarray(payload)
        if payload.ndim != 2 or payload.dtype != self.element_dtype:
            raise EPInputError(f"token format {self.name!r}: payload must be [T, hidden] "
                               f"{self.element_dtype}, got {payload.shape} {payload.dtype}")
        if self.scale is None:
            return _bf16_bits_to_f32(payload)
        T, H = payload.shape
        scales = self._check_scales(scales, T, H)
        values = payload.view(_E4M3).astype(np.float32).reshape(T, H // self.block, self.block)
        with np.errstate(invalid="ignore", over="ignore", under="ignore"):
            out = values * self.scale.value(scales)[:, :, None]
        return out.astype(np.float32).reshape(T, H)

    def codes(self, payload: np.ndarray) -> np.ndarray:
        """``[T, hidden]``: one code per element (the payload itself; NVFP4 unpacks its nibbles)."""
        return np.asarray(payload)

    def pack_messages(self, payload: np.ndarray, scales: np.ndarray | None) -> np.ndarray:
        """Lay tokens out as messages: ``[T, message_words]`` uint64 (see the module docstring:
        payload bytes, scale bytes, zero padding; little-endian, the bytes the kernels move)."""
        payload = np.ascontiguousarray(payload)
        if payload.ndim != 2 or payload.dtype != self.element_dtype:
            raise EPInputError(f"token format {self.name!r}: payload must be [T, hidden] "
                               f"{self.element_dtype}, got {payload.shape} {payload.dtype}")
        T, H = payload.shape[0], self._hidden_of(payload)
        out = np.zeros((T, self.message_bytes(H)), np.uint8)
        P = self.payload_bytes(H)
        out[:, :P] = payload.view(np.uint8).reshape(T, P)
        if self.scale_dtype is not None:
            scales = np.ascontiguousarray(self._check_scales(scales, T, H))
            out[:, P:P + self.scale_bytes(H)] = scales.view(np.uint8).reshape(T, -1)
        return out.view(np.uint64)

    def unpack_messages(self, messages: np.ndarray, hidden: int) -> tuple[np.ndarray, np.ndarray | None]:
        """Inverse of :meth:`pack_messages`: ``[T, message_words]`` uint64 -> ``(payload,
        scales)`` as :meth:`quantize` returns them (copies)."""
        messages = np.ascontiguousarray(messages)
        W = self.message_words(hidden)
        if messages.ndim != 2 or messages.dtype != np.uint64 or messages.shape[1] != W:
            raise EPInputError(f"token format {self.name!r}: messages for hidden={hidden} must be "
                               f"[T, {W}] uint64, got {messages.shape} {messages.dtype}")
        raw = messages.view(np.uint8)
        P = self.payload_bytes(hidden)
        payload = raw[:, :P].copy().view(self.element_dtype)
        if self.scale_dtype is None:
            return payload, None
        scales = raw[:, P:P + self.scale_bytes(hidden)].copy().view(self.scale_dtype)
        return payload, scales

    # -- checks ------------------------------------------------------------------------------------
    def _hidden_of(self, payload: np.ndarray) -> int:
        """The hidden size of a ``[T, payload_width]`` payload."""
        return payload.shape[1] * self.elements_per_item

    def _check_tokens(self, tokens) -> np.ndarray:
        tokens = np.ascontiguousarray(tokens)
        if tokens.ndim != 2 or tokens.dtype != np.uint16:
            raise EPInputError(f"token format {self.name!r}: tokens must be [T, hidden] uint16 bf16 bit "
                               f"patterns, got {tokens.shape} {tokens.dtype}; pass x.view(np.uint16)")
        self.validate_hidden(tokens.shape[1])
        return tokens

    def _check_scales(self, scales, T: int, H: int) -> np.ndarray:
        self.validate_hidden(H)
        want = (T, H // self.block)
        scales = np.asarray(scales) if scales is not None else None
        if scales is None or scales.shape != want or scales.dtype != self.scale_dtype:
            got = "None" if scales is None else f"{scales.shape} {scales.dtype}"
            raise EPInputError(f"token format {self.name!r}: scales must be {list(want)} "
                               f"{self.scale_dtype}, got {got}")
        return scales


BF16 = TokenFormat("bf16", np.dtype(np.uint16), None, None, WORDS)
FP8_E4M3 = TokenFormat("fp8_e4m3", np.dtype(np.uint8), FP8_BLOCK, FLOAT32_SCALE,
                       CodecSpec("ep_runtime.kernels.codecs.fp8", (("scale_bytes", 4),)))
FP8_E4M3_UE8M0 = TokenFormat("fp8_e4m3_ue8m0", np.dtype(np.uint8), FP8_BLOCK, UE8M0_SCALE,
                             CodecSpec("ep_runtime.kernels.codecs.fp8", (("scale_bytes", 1),)))

# -- NVFP4 (the rule's conversions: ep_runtime/core/nvfp4_rule.py) -------------------------------
@dataclass(frozen=True)
class Nvfp4Format(TokenFormat):
    """NVFP4: E2M1 codes, two a byte, an E4M3 scale per 16 elements and a float32 global scale per
    tensor (the module docstring states the rule). ``quantize`` takes the tensor's global scale
    (a float32); ``dequantize`` and ``pack_messages`` a float32 or one per row (``[T]``: a batch
    of rows from several tensors)."""

    has_global_scale = True
    elements_per_item = 2
    _hidden_reason = ", the block scales whole 4-byte words before the float32 global scale"

    @property
    def scale_dtype(self) -> np.dtype:
        return np.dtype(np.uint8)

    @property
    def hidden_multiple(self) -> int:
        return NVFP4_HIDDEN_MULTIPLE

    def extras_bytes(self, hidden: int) -> int:
        return self.scale_bytes(hidden) + NVFP4_GLOBAL_BYTES

    def global_scale_offset_bytes(self, hidden: int) -> int:
        """Byte offset of the global scale in a message (after the block scales; 4-byte aligned)."""
        return self.payload_bytes(hidden) + self.scale_bytes(hidden)

    def global_scale(self, tokens: np.ndarray) -> np.float32:
        """The rule's global scale of ``[T, hidden]`` bf16 tokens (uint16 bits)."""
        return nvfp4_global_scale(self._check_tokens(tokens))

    def quantize(self, tokens: np.ndarray, global_scale=None) -> tuple[np.ndarray, np.ndarray]:
        """``(codes [T, hidden / 2] uint8, scales [T, hidden / 16] uint8)`` of ``[T, hidden]`` bf16
        tokens (uint16 bits) under ``global_scale`` (float32; None: :meth:`global_scale`)."""
        tokens = self._check_tokens(tokens)
        g = np.float32(nvfp4_global_scale(tokens) if global_scale is None else global_scale)
        T, H = tokens.shape
        blocks = tokens.reshape(T, H // NVFP4_BLOCK, NVFP4_BLOCK)
        amax_bits = (blocks & np.uint16(0x7FFF)).max(axis=2, initial=0)
        finite = amax_bits < 0x7F80
        with np.errstate(invalid="ignore", over="ignore", divide="ignore", under="ignore"):
            s = _bf16_bits_to_f32(amax_bits) / (np.float32(E2M1_MAX) * g)
            scales = np.where(finite, e4m3_saturated(s), np.uint8(E4M3_NAN)).astype(np.uint8)
            m = np.float32(1.0) / (scales.view(_E4M3).astype(np.float32) * g)
            m = np.where(np.isfinite(m), m, np.float32(0.0)).astype(np.float32)
            q = (_bf16_bits_to_f32(blocks) * m[:, :, None]).astype(np.float32)
        codes = np.where(finite[:, :, None], e2m1_codes(q), np.uint8(0)).reshape(T, H)
        return (codes[:, 0::2] | (codes[:, 1::2] << np.uint8(4))).astype(np.uint8), scales

    def codes(self, payload: np.ndarray) -> np.ndarray:
        """``[T, hidden]`` uint8 E2M1 codes of ``[T, hidden / 2]`` packed ones (2i: low nibble)."""
        p = np.asarray(payload, np.uint8)
        out = np.empty((p.shape[0], 2 * p.shape[1]), np.uint8)
        out[:, 0::2], out[:, 1::2] = p & np.uint8(15), p >> np.uint8(4)
        return out

    def dequantize(self, payload: np.ndarray, scales: np.ndarray, global_scales=None) -> np.ndarray:
        """``[T, hidden]`` float32: ``e2m1(code) * e4m3(scale)`` (exact) times the row's global
        scale (``global_scales``: a float32 scalar or ``[T]``; required)."""
        payload = np.asarray(payload)
        if payload.ndim != 2 or payload.dtype != np.uint8 or global_scales is None:
            raise EPInputError(f"token format {self.name!r}: dequantize takes payload [T, hidden / 2] uint8 and "
                               f"global_scales, got {payload.shape} {payload.dtype} and {global_scales!r}")
        T, H = payload.shape[0], self._hidden_of(payload)
        scales = self._check_scales(scales, T, H)
        g = np.broadcast_to(np.asarray(global_scales, np.float32).reshape(-1, 1, 1), (T, 1, 1))
        values = e2m1_value(self.codes(payload)).reshape(T, H // NVFP4_BLOCK, NVFP4_BLOCK)
        with np.errstate(invalid="ignore", over="ignore", under="ignore"):
            out = (values * scales.view(_E4M3).astype(np.float32)[:, :, None]).astype(np.float32) * g
        return out.astype(np.float32).reshape(T, H)

    def pack_messages(self, payload: np.ndarray, scales: np.ndarray, global_scales=None) -> np.ndarray:
        """As :meth:`TokenFormat.pack_messages`, the global scale of each row (``global_scales``:
        a float32 scalar or ``[T]``; required) after the block scales."""
        if global_scales is None:
            raise EPInputError(f"token format {self.name!r}: pack_messages needs global_scales")
        out = super().pack_messages(payload, scales).view(np.uint8)
        G = self.global_scale_offset_bytes(self._hidden_of(np.asarray(payload)))
        g = np.broadcast_to(np.asarray(global_scales, np.float32).reshape(-1), (out.shape[0],))
        out[:, G:G + NVFP4_GLOBAL_BYTES] = np.ascontiguousarray(g).view(np.uint8).reshape(-1, NVFP4_GLOBAL_BYTES)
        return out.view(np.uint64)

    def unpack_global_scales(self, messages: np.ndarray, hidden: int) -> np.ndarray:
        """``[T]`` float32: the global scale each of ``[T, message_words]`` messages carries."""
        self.unpack_messages(messages, hidden)  # (checks them)
        G = self.global_scale_offset_bytes(hidden)
        raw = np.ascontiguousarray(messages).view(np.uint8)
        return raw[:, G:G + NVFP4_GLOBAL_BYTES].copy().view(np.float32).reshape(-1)


NVFP4 = Nvfp4Format("nvfp4", np.dtype(np.uint8), NVFP4_BLOCK, None, CodecSpec("ep_runtime.kernels.codecs.nvfp4"))

#: Every format by name: the built-in ones and those added by :func:`register_format`.
FORMATS = {f.name: f for f in (BF16, FP8_E4M3, FP8_E4M3_UE8M0, NVFP4)}


def register_format(fmt: TokenFormat) -> TokenFormat:
    """Make ``fmt`` a token format of this process: ``EPConfig(token_dtype=fmt.name)`` then takes
    it, and the kernels are built with its codec (``fmt.codec``: docs/formats.md, "Adding a
    format"). Every process of a job registers it before it builds a runtime. Registering a
    name again with an equal format is a no-op; with another format it raises
    :class:`EPConfigError`. Returns ``fmt``."""
    known = FORMATS.get(fmt.name)
    if known is not None and known != fmt:
        raise EPConfigError(f"register_format: a token format named {fmt.name!r} is already registered "
                            f"({known!r}); give the new one another name")
    FORMATS[fmt.name] = fmt
    return fmt


def token_dtype_names() -> tuple:
    """The ``EPConfig.token_dtype`` names this process knows: ``"bfloat16"`` (the format
    ``"bf16"``) and every other registered format's name."""
    return ("bfloat16",) + tuple(name for name in FORMATS if name != BF16.name)


def get_format(name: str | TokenFormat) -> TokenFormat:
    """The format called ``name`` (a :class:`TokenFormat` is returned as is).

    Raises :class:`EPConfigError` for an unknown name, listing the known ones.
    """
    if isinstance(name, TokenFormat):
        return name
    try:
        return FORMATS[name]
    except (KeyError, TypeError):
        raise EPConfigError(f"unknown token format {name!r}; known formats: {', '.join(FORMATS)}") from None


__all__ = ["TokenFormat", "ScaleEncoding", "BF16", "FP8_E4M3", "FP8_E4M3_UE8M0", "NVFP4", "Nvfp4Format",
           "FORMATS", "get_format", "e2m1_codes", "e2m1_value", "e4m3_saturated", "nvfp4_global_scale",
           "NVFP4_BLOCK", "NVFP4_HIDDEN_MULTIPLE", "NVFP4_GLOBAL_BYTES", "NVFP4_GLOBAL_RANGE", "E2M1_MAX",
           "E2M1_VALUES",
           "register_format", "token_dtype_names", "FLOAT32_SCALE", "UE8M0_SCALE", "ue8m0_value", "MESSAGE_ALIGN",
           "QUANTIZED_MESSAGE_ALIGN", "FP8_BLOCK",
           "E4M3_MAX", "E4M3_NAN", "UE8M0_NAN", "UE8M0_ONE"]
