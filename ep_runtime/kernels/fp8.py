"""FP8 E4M3 (``float8_e4m3fn``) encoding and block scales, as device functions.

Numba has no FP8 type and no FP8 intrinsic: codes are computed from float32 bit patterns with
integer arithmetic (Numba widens some of it to 64 bits; nothing here can overflow either way),
without float64 and without fast-math (the only float operations are one IEEE division, a
multiplication by 2**-9 and a negation), so the same source gives the same bits on a GPU and in
Numba's CUDA simulator. :mod:`ep_runtime.core.formats` states the quantization rule these
functions implement and holds its NumPy reference.

E4M3 (``fn``: finite, no infinities) is an 8-bit code ``s eeee mmm`` with exponent bias 7:
normals ``(1 + m/8) 2**(e-7)`` for e = 1..15 (largest 448 = code 0x7E), subnormals
``m 2**-9`` (e = 0), and NaN at ``s 1111 111`` (0x7F / 0xFF); there is no infinity.
:func:`e4m3_bits` converts exactly like ``ml_dtypes.float8_e4m3fn`` converts float32 (checked for
every bf16 pattern and the rounding boundaries by tests/test_formats.py):

- round to nearest, ties to even, once, from the float32 value (subnormals included: the
  smallest code 2**-9, and 2**-10 exactly rounds to +-0);
- a magnitude that rounds above 448 becomes NaN with the input's sign: values in (464, inf],
  infinities and NaNs give ``s 1111 111``; 464 itself (the tie between 448 and the missing
  480) rounds to even, 448;
- the sign is kept, so -0.0 and negative values that round to zero give 0x80 (-0).

Normal E4M3 values (4 significant bits), the power-of-two scales and the NaN are bfloat16
values too: they are built from 16-bit patterns with :func:`bf16_to_f32`, the float32 bit cast
the kernels already have.

Codes travel packed little-endian, code ``i`` of a word in bits ``8 i .. 8 i + 7`` (the bytes
of a uint8 row): :func:`pack4` makes a uint32 of 4 codes, :func:`pack8` a uint64 of two of those,
:func:`code_at` reads code ``i`` of a word.

:func:`quantize4` encodes a bf16 token word (4 values) in a block of a given scale. On a GPU it
converts with the hardware (``cvt.rn.satfinite.e4m3x2.f32``, sm_89 and later: round to nearest
even, two values per instruction), which agrees with :func:`e4m3_bits` for every quotient of
magnitude at most 464; a word with a larger (or NaN) quotient, possible only for a
float32-subnormal scale, takes :func:`e4m3_bits` (the hardware saturates to 448 where ml_dtypes
gives NaN). The software conversion was the encoder's cost: a long instruction sequence per
element (docs/plans.md). In the simulator, :func:`quantize4` is :func:`e4m3_bits`.
"""

from ep_runtime.kernels.protocol import E4M3_MAX, E4M3_NAN, UE8M0_NAN
from ep_runtime.kernels.bits import bf16_to_f32, f32_bits, word_f32
from ep_runtime.kernels.cuda_api import SIMULATED, cuda, float32, int32, uint32, uint64
from ep_runtime.kernels.vec import max_u16x2

#: Largest quotient magnitude the hardware conversion rounds as ml_dtypes does (464 rounds to
#: even, 448; above it ml_dtypes gives NaN, the hardware's satfinite 448).
_HW_SAFE_MAX = 464.0
#: Four NaN codes (a block with a NaN scale).
_NAN4 = E4M3_NAN * 0x01010101

#: float32 bits of 464.0, the tie between 448 and 480 (which E4M3 lacks): larger magnitudes
#: (infinities and NaNs included, whose bits are larger still) convert to NaN.
_F32_BITS_464 = 0x43E80000
#: Spacing of the E4M3 subnormals, 2**-9 (also the smallest positive code, 0x01).
_E4M3_SUBNORMAL_STEP = 2.0 ** -9
#: float32 bits of 2**-6, the smallest normal E4M3 magnitude.
_F32_BITS_MIN_NORMAL = 0x3C800000
#: float32 bits >> 20 of an E4M3 normal minus its code: exponent bias 127 - 7 = 120, times 8.
_REBIAS = 120 << 3
#: float32 mantissa field of 1.75 (448 = 1.75 * 2**8): a larger mantissa needs the next power.
_F32_MANTISSA_1_75 = 0x600000
#: Upper 16 bits of float32 2**-127 (bits 0x00400000, a float32 subnormal): UE8M0 code 0.
_BF16_BITS_2_POW_M127 = 0x0040
#: Upper 16 bits of the quiet float32 NaN 0x7FC00000, the scale of a non-finite block.
_BF16_BITS_NAN = 0x7FC0


@cuda.jit(device=True)
def e4m3_bits(x):
    """E4M3 code (uint32, 0..255) of float32 ``x``: round to nearest even, overflow and
    non-finite to NaN with the sign of ``x``; bit-exact with ``ml_dtypes.float8_e4m3fn``."""
    u = f32_bits(x)
    sign = (u >> uint32(24)) & uint32(0x80)
    a = u & uint32(0x7FFFFFFF)
    if a > uint32(_F32_BITS_464):
        return uint32(sign | uint32(E4M3_NAN))
    if a >= uint32(_F32_BITS_MIN_NORMAL):
        # Keep 3 of float32's 23 mantissa bits, rounding to nearest even (add just under half,
        # plus one when the kept part is odd); a carry out of the mantissa moves into the
        # exponent, which is right. Below 464 no result passes 0x7E.
        r = a + uint32(0x7FFFF) + ((a >> uint32(20)) & uint32(1))
        return uint32(sign | ((r >> uint32(20)) - uint32(_REBIAS)))
    # Subnormal E4M3: the code is round(|x| / 2**-9). A float32 normal |x| = m 2**(E - 150)
    # (m with its implicit bit, 24 bits) gives m >> (141 - E), rounded to nearest even; a
    # shift past 24 leaves less than half (m < 2**24); float32 subnormals are < 2**-126.
    E = a >> uint32(23)
    shift = uint32(141) - E
    if E == uint32(0) or shift > uint32(24):
        return uint32(sign)
    m = (a & uint32(0x7FFFFF)) | uint32(0x800000)
    q = m >> shift
    rem = m & ((uint32(1) << shift) - uint32(1))
    half = uint32(1) << (shift - uint32(1))
    if rem > half or (rem == half and (q & uint32(1)) == uint32(1)):
        q += uint32(1)
    return uint32(sign | q)


@cuda.jit(device=True)
def e4m3_value(code):
    """float32 value of E4M3 code ``code`` (its low 8 bits). NaN codes give the quiet float32
    NaN with their sign (0x7FC00000 / 0xFFC00000), as ``ml_dtypes`` does."""
    c = uint32(code)
    sign16 = (c & uint32(0x80)) << uint32(8)
    mag = c & uint32(0x7F)
    if mag == uint32(E4M3_NAN):
        return bf16_to_f32(sign16 | uint32(_BF16_BITS_NAN))
    if mag >= uint32(8):
        # normal: float32 bits (mag + (120 << 3)) << 20, whose low 16 bits are zero
        return bf16_to_f32(sign16 | ((mag + uint32(_REBIAS)) << uint32(4)))
    # subnormal or zero: mag * 2**-9, exact
    v = float32(mag) * float32(_E4M3_SUBNORMAL_STEP)
    return -v if sign16 != uint32(0) else v


@cuda.jit(device=True)
def e4m3_quantize(x, scale):
    """E4M3 code (uint32) of ``x`` in a block of scale ``scale``: ``e4m3_bits(x / scale)``, the
    division in float32 (IEEE), or the NaN code 0x7F when ``scale`` is NaN (a block with a
    non-finite element: :func:`e4m3_scale`, :func:`ue8m0_scale`)."""
    if (f32_bits(scale) & uint32(0x7FFFFFFF)) > uint32(0x7F800000):
        return uint32(E4M3_NAN)
    return e4m3_bits(float32(x) / float32(scale))


@cuda.jit(device=True)
def e4m3_scale(amax):
    """float32 scale of a block whose largest magnitude is float32 ``amax`` (>= 0): ``amax / 448``
    (IEEE division); 1.0 when ``amax`` is 0; NaN (0x7FC00000) when ``amax`` is inf or NaN."""
    a = f32_bits(amax) & uint32(0x7FFFFFFF)
    if a >= uint32(0x7F800000):
        return bf16_to_f32(uint32(_BF16_BITS_NAN))
    if a == uint32(0):
        return float32(1.0)
    return float32(amax) / float32(E4M3_MAX)


@cuda.jit(device=True)
def ue8m0_scale(amax):
    """Power-of-two scale of a block whose largest magnitude is float32 ``amax`` (>= 0):
    ``(scale float32, code uint32)`` with ``scale = 2**(code - 127)`` the smallest power of two
    with ``amax <= 448 * scale`` (exact: no division, no log2), at least 2**-127 (code 0).
    ``amax`` 0 gives (1.0, 127); inf or NaN gives (NaN 0x7FC00000, 255).

    ``amax = 1.f * 2**(E - 127)`` (E its biased exponent) needs ``2**(E - 135)`` when
    ``1.f <= 1.75`` (448 = 1.75 * 2**8), else ``2**(E - 134)``: code E - 8 or E - 7.
    """
    a = f32_bits(amax) & uint32(0x7FFFFFFF)
    if a >= uint32(0x7F800000):
        return bf16_to_f32(uint32(_BF16_BITS_NAN)), uint32(UE8M0_NAN)
    if a == uint32(0):
        return float32(1.0), uint32(127)
    code = int32(a >> uint32(23)) - int32(8)
    if (a & uint32(0x7FFFFF)) > uint32(_F32_MANTISSA_1_75):
        code += int32(1)
    if code <= int32(0):
        return bf16_to_f32(uint32(_BF16_BITS_2_POW_M127)), uint32(0)
    return bf16_to_f32(uint32(code) << uint32(7)), uint32(code)


@cuda.jit(device=True)
def ue8m0_value(code):
    """float32 scale ``2**(code - 127)`` of UE8M0 code ``code`` (0..254; 255 is NaN)."""
    c = uint32(code)
    if c == uint32(UE8M0_NAN):
        return bf16_to_f32(uint32(_BF16_BITS_NAN))
    if c == uint32(0):
        return bf16_to_f32(uint32(_BF16_BITS_2_POW_M127))
    return bf16_to_f32(c << uint32(7))


@cuda.jit(device=True)
def e4m3_inverse(amax):
    """FP8_E4M3's multiplier for a block whose largest magnitude is float32 ``amax`` (>= 0):
    ``448 / amax`` (IEEE division, once per block), 1.0 when ``amax`` is 0, and 0.0 (meaning:
    divide by the scale instead) when ``amax`` is not finite or the quotient overflows
    (``amax`` below about 2**-119.2). The rule (ep_runtime/core/formats.py) quantizes ``x * inv``."""
    a = f32_bits(amax) & uint32(0x7FFFFFFF)
    if a >= uint32(0x7F800000):
        return float32(0.0)
    if a == uint32(0):
        return float32(1.0)
    inv = float32(E4M3_MAX) / float32(amax)
    if (f32_bits(inv) & uint32(0x7FFFFFFF)) >= uint32(0x7F800000):
        return float32(0.0)
    return inv


@cuda.jit(device=True)
def ue8m0_inverse(code):
    """float32 ``2**(127 - code)``, the exact reciprocal of UE8M0 scale ``code`` (0..254: from
    2**127 down to 2**-127, a float32 subnormal); NaN for code 255. Multiplying by it gives
    bit for bit the IEEE quotient by the scale (both are the exact product rounded once), so
    :func:`quantize4_by` needs no division (FP8_E4M3_UE8M0's rule is unchanged by it)."""
    c = uint32(code)
    if c == uint32(UE8M0_NAN):
        return bf16_to_f32(uint32(_BF16_BITS_NAN))
    if c == uint32(254):
        return bf16_to_f32(uint32(_BF16_BITS_2_POW_M127))
    return bf16_to_f32((uint32(254) - c) << uint32(7))


@cuda.jit(device=True)
def bf16_abs_max(acc, word):
    """Largest of ``acc`` (uint32) and the magnitude patterns (``bits & 0x7FFF``) of the four
    bf16 values of uint64 ``word``. Magnitude patterns order like the magnitudes, with every
    NaN above inf, so folding a block's words from 0 gives the pattern of its amax, NaN if any
    element is NaN; ``bf16_to_f32`` of it is the float32 amax."""
    w = uint64(word)
    m = uint32(acc)
    for i in range(4):
        v = uint32((w >> uint64(16 * i)) & uint64(0x7FFF))
        if v > m:
            m = v
    return m


@cuda.jit(device=True)
def bf16_abs_max4(w0, w1, w2, w3):
    """:func:`bf16_abs_max` of the sixteen bf16 values of uint64 words ``w0..w3`` from 0 (uint32
    magnitude pattern), two values per operation: each 32-bit half word masked to its two
    magnitudes, folded with ``max_u16x2``, then the larger half."""
    mask = uint32(0x7FFF7FFF)
    m = max_u16x2(uint32(w0) & mask, uint32(uint64(w0) >> uint64(32)) & mask)
    m = max_u16x2(m, uint32(w1) & mask)
    m = max_u16x2(m, uint32(uint64(w1) >> uint64(32)) & mask)
    m = max_u16x2(m, uint32(w2) & mask)
    m = max_u16x2(m, uint32(uint64(w2) >> uint64(32)) & mask)
    m = max_u16x2(m, uint32(w3) & mask)
    m = max_u16x2(m, uint32(uint64(w3) >> uint64(32)) & mask)
    return max(m & uint32(0xFFFF), m >> uint32(16))


@cuda.jit(device=True)
def block_scale(amax, ue8m0):
    """``(scale, code, inv)`` of a block whose largest magnitude is float32 ``amax``: FP8_E4M3's
    (``ue8m0`` false: :func:`e4m3_scale`, its float32 bits, :func:`e4m3_inverse`) or
    FP8_E4M3_UE8M0's (:func:`ue8m0_scale`, its code, :func:`ue8m0_inverse`: the exact
    reciprocal, whose products are the division's quotients). ``code`` is what the message
    stores; ``inv`` is what :func:`quantize4_by` / :func:`quantize4_scaled` multiply by."""
    if ue8m0:
        scale, code = ue8m0_scale(amax)
        return scale, code, ue8m0_inverse(code)
    scale = e4m3_scale(amax)
    return scale, f32_bits(scale), e4m3_inverse(amax)


@cuda.jit(device=True)
def scaled_directly(scale, inv):
    """Whether a block of scale ``scale`` and multiplier ``inv`` (:func:`e4m3_inverse`, or
    :func:`ue8m0_inverse` of the scale's code) quantizes as ``x * inv`` with every quotient
    within the hardware's exact range, so :func:`quantize4_scaled` applies: the scale is not
    NaN and ``inv`` is not 0. Then ``|x| <= amax`` gives ``|x * inv| <= 448 (1 + 2**-24)``
    rounded (E4M3: ``inv = 448 / amax`` rounded once) or ``<= 448`` (UE8M0: ``scale >= amax /
    448`` and ``inv`` its exact reciprocal), below 464."""
    return (f32_bits(scale) & uint32(0x7FFFFFFF)) <= uint32(0x7F800000) and inv != float32(0.0)


@cuda.jit(device=True)
def pack4(c0, c1, c2, c3):
    """uint32 of four codes (low 8 bits each), ``c0`` in the lowest byte."""
    return uint32((uint32(c0) & uint32(0xFF)) | ((uint32(c1) & uint32(0xFF)) << uint32(8))
                  | ((uint32(c2) & uint32(0xFF)) << uint32(16)) | ((uint32(c3) & uint32(0xFF)) << uint32(24)))


@cuda.jit(device=True)
def pack8(lo, hi):
    """uint64 of eight codes from two :func:`pack4` words, ``lo`` holding codes 0..3."""
    return uint64(lo) | (uint64(hi) << uint64(32))


@cuda.jit(device=True)
def code_at(word, i):
    """Code ``i`` (uint32) of a packed word: bits ``8 i .. 8 i + 7``."""
    return uint32((uint64(word) >> uint64(8 * i)) & uint64(0xFF))


@cuda.jit(device=True)
def quantize4_software(word, scale):
    """uint32 of the E4M3 codes of the four bf16 values of uint64 ``word`` in a block of scale
    ``scale`` (:func:`e4m3_quantize` each, value 0 in the lowest byte)."""
    return pack4(e4m3_quantize(word_f32(word, 0), scale), e4m3_quantize(word_f32(word, 1), scale),
                 e4m3_quantize(word_f32(word, 2), scale), e4m3_quantize(word_f32(word, 3), scale))


@cuda.jit(device=True)
def quantize4_scaled_software(word, inv):
    """The E4M3 codes of ``x * inv`` for the four bf16 values of uint64 ``word`` (no scale
    checks: the caller's block passed :func:`scaled_directly`)."""
    s = float32(inv)
    return pack4(e4m3_bits(word_f32(word, 0) * s), e4m3_bits(word_f32(word, 1) * s),
                 e4m3_bits(word_f32(word, 2) * s), e4m3_bits(word_f32(word, 3) * s))


@cuda.jit(device=True)
def quantize4_by_software(word, scale, inv):
    """The codes of the four bf16 values of uint64 ``word`` (as :func:`quantize4_software`)
    with the quotients taken as products ``x * inv`` (``inv``: :func:`e4m3_inverse`, or
    :func:`ue8m0_inverse`, whose products equal the division's), or, when ``inv`` is 0, as
    IEEE quotients ``x / scale``; converted in software. A NaN ``scale`` gives NaN codes."""
    if (f32_bits(scale) & uint32(0x7FFFFFFF)) > uint32(0x7F800000):
        return uint32(_NAN4)
    if inv == float32(0.0):
        return quantize4_software(word, scale)
    return quantize4_scaled_software(word, inv)


if SIMULATED:
    quantize4 = quantize4_software
    quantize4_by = quantize4_by_software
    quantize4_scaled = quantize4_scaled_software
else:
    from ep_runtime.kernels.vec import f32_pair_conversion

    #: E4M3 codes of lo (bits 0-7) and hi (8-15), saturated to +-448
    _cvt_e4m3x2 = f32_pair_conversion("cvt.rn.satfinite.e4m3x2.f32", 16)

    @cuda.jit(device=True)
    def quantize4(word, scale):
        """As :func:`quantize4_software`, with the hardware conversion: the four IEEE
        quotients, then two ``cvt.rn.satfinite.e4m3x2.f32``. Bit-identical: a NaN scale gives
        the NaN codes, and a word with a quotient beyond 464 in magnitude (or NaN) is converted
        in software."""
        if (f32_bits(scale) & uint32(0x7FFFFFFF)) > uint32(0x7F800000):
            return uint32(_NAN4)
        s = float32(scale)
        q0 = word_f32(word, 0) / s
        q1 = word_f32(word, 1) / s
        q2 = word_f32(word, 2) / s
        q3 = word_f32(word, 3) / s
        lim = float32(_HW_SAFE_MAX)
        if not (abs(q0) <= lim and abs(q1) <= lim and abs(q2) <= lim and abs(q3) <= lim):
            return quantize4_software(word, scale)
        return _cvt_e4m3x2(q0, q1) | (_cvt_e4m3x2(q2, q3) << uint32(16))

    @cuda.jit(device=True)
    def quantize4_by(word, scale, inv):
        """As :func:`quantize4_by_software`, with the hardware conversion: four multiplications
        (instead of four IEEE divisions, each an instruction sequence with its special-case check),
        or :func:`quantize4` when ``inv`` is 0."""
        if (f32_bits(scale) & uint32(0x7FFFFFFF)) > uint32(0x7F800000):
            return uint32(_NAN4)
        if inv == float32(0.0):
            return quantize4(word, scale)
        s = float32(inv)
        q0 = word_f32(word, 0) * s
        q1 = word_f32(word, 1) * s
        q2 = word_f32(word, 2) * s
        q3 = word_f32(word, 3) * s
        lim = float32(_HW_SAFE_MAX)
        if not (abs(q0) <= lim and abs(q1) <= lim and abs(q2) <= lim and abs(q3) <= lim):
            return quantize4_by_software(word, scale, inv)
        return _cvt_e4m3x2(q0, q1) | (_cvt_e4m3x2(q2, q3) << uint32(16))

    @cuda.jit(device=True)
    def quantize4_scaled(word, inv):
        """As :func:`quantize4_scaled_software`, with the hardware conversion: four
        multiplications and two conversions, nothing else (the block passed
        :func:`scaled_directly`, so every quotient is within 464 and the hardware's rounding is
        ml_dtypes')."""
        s = float32(inv)
        return (_cvt_e4m3x2(word_f32(word, 0) * s, word_f32(word, 1) * s)
                | (_cvt_e4m3x2(word_f32(word, 2) * s, word_f32(word, 3) * s) << uint32(16)))


__all__ = ["E4M3_MAX", "E4M3_NAN", "UE8M0_NAN", "e4m3_bits", "e4m3_value", "e4m3_quantize", "e4m3_scale",
           "e4m3_inverse", "ue8m0_scale", "ue8m0_value", "ue8m0_inverse", "bf16_abs_max", "pack4", "pack8", "code_at",
           "quantize4", "quantize4_software", "quantize4_by", "quantize4_by_software", "bf16_abs_max4",
           "block_scale", "scaled_directly", "quantize4_scaled", "quantize4_scaled_software"]
