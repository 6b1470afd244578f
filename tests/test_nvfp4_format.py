"""The NVFP4 token format's NumPy reference (ep_runtime/core/formats.py, ep_runtime/core/nvfp4_rule.py)
against an independent second implementation written here another way:

- E2M1 and E4M3 rounding by enumerating each code table and picking the nearest value, ties to
  the even code (no thresholds, no ml_dtypes), over every bf16 bit pattern as the quotient and
  the rounding boundaries; E2M1 also against ``ml_dtypes.float4_e2m1fn``;
- the global scale from the exact rational ``amax / 2688`` rounded to float32 by hand;
- whole tokens quantized element by element in Python scalars (the rule's float32 steps,
  converted by the tables above), for blocks that are zero, negative zero, hold inf or NaN,
  saturate, or get E4M3-subnormal scales, and an all-zero tensor;
- the message layout byte by byte, the decode, and the stated error bound.
"""

from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest

from ep_runtime.core import formats as F
from ep_runtime.core.errors import EPConfigError, EPInputError
from ep_runtime.core.nvfp4_rule import E2M1_THRESHOLDS

BF16 = np.dtype(ml_dtypes.bfloat16)
E2M1_TABLE = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def e4m3_table() -> list[float]:
    """The magnitudes of E4M3 codes 0..126 (0x7F is NaN), from the format's definition."""
    out = []
    for code in range(127):
        e, m = code >> 3, code & 7
        out.append(m * 2.0 ** -9 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    return out


E4M3_TABLE = e4m3_table()


def nearest_code(value: float, table: list[float]) -> int:
    """The code of ``table`` nearest to magnitude ``value`` (exact float64 distances: every table
    value and float32 input is exact in float64), ties to the even code."""
    best, best_d = 0, abs(value - table[0])
    for code, v in enumerate(table[1:], start=1):
        d = abs(value - v)
        if d < best_d or (d == best_d and code % 2 == 0 and best % 2 == 1):
            best, best_d = code, d
    return best


def e2m1_independent(q: float) -> int:
    """E2M1 code of float32 ``q``: the nearest table value, saturating above 6, sign bit kept."""
    sign = 8 if np.signbit(np.float32(q)) else 0
    a = abs(float(q))
    return sign | (7 if a > 6.0 else nearest_code(a, E2M1_TABLE))


def e4m3_sat_independent(x: float) -> int:
    """Saturating E4M3 code of float32 ``x``: NaN 0x7F, above 448 0x7E, else the nearest."""
    if np.isnan(x):
        return 0x7F
    sign = 0x80 if np.signbit(np.float32(x)) else 0
    a = abs(float(x))
    return sign | (0x7E if a > 448.0 else nearest_code(a, E4M3_TABLE))


def f32_round(q: Fraction) -> np.float32:
    """``q`` (> 0, in float32's normal or subnormal range) rounded to float32, ties to even."""
    e = q.numerator.bit_length() - q.denominator.bit_length()
    e = e if Fraction(2) ** e <= q else e - 1  # 2**e <= q < 2**(e + 1)
    step = Fraction(2) ** (max(e, -126) - 23)
    n, rem = divmod(q, step)
    if rem * 2 > step or (rem * 2 == step and n % 2 == 1):
        n += 1
    return np.float32(float(n * step))


def all_bf16() -> np.ndarray:
    """Every bf16 bit pattern's float32 value (NaNs included)."""
    return (np.arange(65536, dtype=np.uint32) << 16).view(np.float32)


def boundary_values() -> np.ndarray:
    """float32 values on and next to every E2M1 rounding threshold and at the ends."""
    pts = [t for t, _ in E2M1_THRESHOLDS] + [0.0, 6.0, 7.0, 1e30]
    out = []
    for p in pts:
        p = np.float32(p)
        out += [p, np.nextafter(p, np.float32(np.inf)), np.nextafter(p, np.float32(-np.inf))]
    out = np.array(out, np.float32)
    return np.concatenate([out, -out, np.array([np.inf, -np.inf, 1e-45, -1e-45], np.float32)])


def test_e2m1_rounding_of_every_bf16_pattern_and_boundary():
    q = np.concatenate([all_bf16(), boundary_values()])
    q = q[~np.isnan(q)]  # the rule never converts a NaN
    got = F.e2m1_codes(q)
    want = np.array([e2m1_independent(v) for v in q], np.uint8)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got, q.astype(ml_dtypes.float4_e2m1fn).view(np.uint8))
    assert F.e2m1_codes(np.float32([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.0, 1e9])).tolist() == \
        [0, 2, 2, 4, 4, 6, 6, 8, 7]  # the documented ties, -0 and saturation


def test_e2m1_values_decode_every_code():
    want = np.array(E2M1_TABLE + [-v for v in E2M1_TABLE], np.float32)
    np.testing.assert_array_equal(F.e2m1_value(np.arange(16)), want)
    np.testing.assert_array_equal(F.e2m1_value(np.arange(16)), np.arange(16, dtype=np.uint8).view(
        ml_dtypes.float4_e2m1fn).astype(np.float32))


def test_saturating_e4m3_of_every_bf16_pattern():
    x = np.concatenate([all_bf16(), np.float32([448, 449, 464, 465, 2.0 ** -10, 2.0 ** -10 * 3, 2.0 ** -9 * 1.5])])
    got = F.e4m3_saturated(x)
    want = np.array([e4m3_sat_independent(v) for v in x], np.uint8)
    np.testing.assert_array_equal(got, want)


def test_global_scale_is_the_exact_quotient_rounded_once():
    mags = np.arange(1, 0x7F80, dtype=np.uint16)  # every finite nonzero bf16 magnitude
    for m in mags[::7].tolist() + [1, 0x7F7F]:
        tokens = np.array([[0x8000 | m, 0x8000, 0x7FC0, 0xFF80]], np.uint16)  # NaN and -inf do not count
        amax = Fraction(float(np.uint32(m << 16).view(np.float32)))
        assert F.nvfp4_global_scale(tokens) == f32_round(amax / 2688), hex(m)
    assert F.nvfp4_global_scale(np.zeros((3, 64), np.uint16)) == 1.0
    assert F.nvfp4_global_scale(np.full((2, 64), 0x7F80, np.uint16)) == 1.0  # only non-finite: none
    assert F.nvfp4_global_scale(np.zeros((0, 64), np.uint16)) == 1.0


def quantize_independent(tokens: np.ndarray, g: np.float32):
    """The rule, element by element in float32 scalars, converted by the tables above:
    ``(codes [T, H] uint8 unpacked, scales [T, H / 16] uint8)``."""
    T, H = tokens.shape
    x = (tokens.astype(np.uint32) << 16).view(np.float32)
    codes, scales = np.zeros((T, H), np.uint8), np.zeros((T, H // 16), np.uint8)
    six_g = np.float32(6.0) * g
    with np.errstate(all="ignore"):
        for t in range(T):
            for b in range(H // 16):
                blk = x[t, 16 * b:16 * b + 16]
                if not np.isfinite(blk).all():
                    scales[t, b] = 0x7F
                    continue
                a = np.float32(np.abs(blk).max())
                sc = e4m3_sat_independent(np.float32(a / six_g))
                scales[t, b] = sc
                S = np.float32(np.nan if sc & 0x7F == 0x7F else E4M3_TABLE[sc & 0x7F] * (-1 if sc & 0x80 else 1))
                m = np.float32(np.float32(1.0) / np.float32(S * g))
                m = m if np.isfinite(m) else np.float32(0.0)
                for i in range(16):
                    codes[t, 16 * b + i] = e2m1_independent(np.float32(blk[i] * m))
    return codes, scales


def awkward_tokens(H: int = 128, seed: int = 0) -> np.ndarray:
    """Random tokens with planted blocks: all zero, all -0.0, an inf, a NaN, a -inf, tiny (E4M3-
    subnormal scales), one huge value (the tensor's amax), exact E2M1 ties."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((6, H)).astype(np.float32)
    x[0, 16:32] = 0.0
    x[0, 32:48] = -0.0
    x[1, 5] = np.inf
    x[2, -3] = np.nan
    x[3, 70] = -np.inf
    x[4, 0:16] = rng.standard_normal(16) * 3e-4
    x[4, 16:32] = rng.standard_normal(16) * 1e-6
    x[5, 100] = 40.0
    x[5, 48:64] = np.float32([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -0.75, -5.0, -6.0, 0.5, 1, 2, 4])
    return x.astype(BF16).view(np.uint16)


def tie_tokens() -> tuple[np.ndarray, np.float32]:
    """Blocks whose quotients are exactly E2M1's rounding ties (and the values around them) under
    global scale 2**-8: amax 6 * 2**-8 gives scale 1 and ``m = 2**8``, so ``x * m`` is exact."""
    ties = np.float32([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0,
                       0.5])
    tie16 = (ties * np.float32(2.0 ** -8)).astype(BF16).view(np.uint16)
    near16 = tie16 - np.uint16(1)  # the bf16 values just below each tie in magnitude
    return np.concatenate([tie16, near16, near16 ^ np.uint16(0x8000), tie16[::-1]])[None, :], np.float32(2.0 ** -8)


def test_exact_ties_round_to_even():
    tokens, g = tie_tokens()
    packed, scales = F.NVFP4.quantize(tokens, g)
    codes, want_scales = quantize_independent(tokens, g)
    assert (scales == 0x38).all()  # scale 1.0: each quotient is x * 2**8, exact
    np.testing.assert_array_equal(F.NVFP4.codes(packed), codes)
    assert codes[0, :16].tolist() == [0, 2, 2, 4, 4, 6, 6, 7, 8, 10, 10, 12, 12, 14, 14, 1]


@pytest.mark.parametrize("scale", ["rule", "tiny", "half", "nan", "zero"])
def test_quantize_matches_the_independent_rule(scale):
    """Codes and scales of the awkward tokens under the rule's global scale and under given ones
    (a tenth of it: block scales and codes saturate; half; NaN: every block NaN; 0)."""
    tokens = awkward_tokens()
    rule = F.NVFP4.global_scale(tokens)
    g = {"rule": rule, "tiny": rule / np.float32(10), "half": rule / np.float32(2), "nan": np.float32(np.nan),
         "zero": np.float32(0.0)}[scale]
    packed, scales = F.NVFP4.quantize(tokens, None if scale == "rule" else g)
    codes, want_scales = quantize_independent(tokens, np.float32(g))
    np.testing.assert_array_equal(scales, want_scales)
    np.testing.assert_array_equal(F.NVFP4.codes(packed), codes)
    np.testing.assert_array_equal(packed, codes[:, 0::2] | (codes[:, 1::2] << 4))
    if scale == "tiny":
        assert (scales == 0x7E).any() and (F.NVFP4.codes(packed) & 7 == 7).any()  # both saturate


def test_awkward_blocks_are_encoded_as_documented():
    tokens = awkward_tokens()
    packed, scales = F.NVFP4.quantize(tokens)
    codes = F.NVFP4.codes(packed)
    assert scales[0, 1] == 0 and (codes[0, 16:32] == 0).all()  # zero block: scale 0, codes 0
    assert scales[0, 2] == 0 and (codes[0, 32:48] == 8).all()  # -0.0: codes 0x8
    for t, b in ((1, 0), (2, 7), (3, 4)):  # inf, NaN, -inf: NaN scale, zero codes
        assert scales[t, b] == 0x7F and (codes[t, 16 * b:16 * b + 16] == 0).all()
    assert 0 < scales[4, 0] < 8 and scales[4, 1] == 0  # an E4M3-subnormal scale, one rounding to 0
    assert scales[5, 6] == 0x7E  # the tensor's amax (40) maps to 448 x 6
    dec = F.NVFP4.dequantize(packed, scales, F.NVFP4.global_scale(tokens))
    assert np.isnan(dec[1, :16]).all() and np.isnan(dec[2, -16:]).all() and np.isfinite(dec[1, 16:]).all()
    assert (dec[0, 16:48] == 0).all() and np.signbit(dec[0, 32:48]).all()


def test_all_zero_tensor():
    tokens = np.zeros((3, 64), np.uint16)
    g = F.NVFP4.global_scale(tokens)
    packed, scales = F.NVFP4.quantize(tokens)
    assert g == 1.0 and not packed.any() and not scales.any()
    assert not F.NVFP4.dequantize(packed, scales, g).any()


@pytest.mark.parametrize("hidden", [64, 192, 7168])
def test_decode_error_bound(hidden):
    """``|d - x| <= S g (1 + 2**-20)`` wherever the block's scale is an E4M3 normal."""
    rng = np.random.default_rng(hidden)
    x = (rng.standard_normal((8, hidden)) * np.exp(rng.uniform(-4, 4, (8, 1)))).astype(BF16)
    tokens = x.view(np.uint16)
    g = F.NVFP4.global_scale(tokens)
    packed, scales = F.NVFP4.quantize(tokens)
    dec = F.NVFP4.dequantize(packed, scales, g).astype(np.float64)
    S = np.repeat(scales.view(ml_dtypes.float8_e4m3fn).astype(np.float64), 16, axis=1)
    normal = np.repeat(scales >= 8, 16, axis=1)
    err = np.abs(dec - x.astype(np.float64))
    assert normal.mean() > 0.9
    assert (err[normal] <= (S * float(g) * (1 + 2.0 ** -20))[normal]).all()


def test_message_layout_byte_by_byte():
    tokens = awkward_tokens(H=192, seed=3)
    g = F.NVFP4.global_scale(tokens)
    packed, scales = F.NVFP4.quantize(tokens, g)
    gs = np.float32([1.5, -2.0, 3.0, 0.125, 7.0, 9.0])
    msgs = F.NVFP4.pack_messages(packed, scales, gs)
    raw = msgs.view(np.uint8)
    assert msgs.shape == (6, 16) and raw.shape[1] == 128  # 96 + 12 + 4 = 112 bytes in one 128-byte line
    np.testing.assert_array_equal(raw[:, :96], packed)
    np.testing.assert_array_equal(raw[:, 96:108], scales)
    np.testing.assert_array_equal(raw[:, 108:112].copy().view(np.float32)[:, 0], gs)
    assert not raw[:, 112:].any()
    p2, s2 = F.NVFP4.unpack_messages(msgs, 192)
    np.testing.assert_array_equal(p2, packed)
    np.testing.assert_array_equal(s2, scales)
    np.testing.assert_array_equal(F.NVFP4.unpack_global_scales(msgs, 192), gs)
    codes = F.NVFP4.codes(packed)  # element 2i in the low nibble of byte i
    assert (packed[:, 3] & 15 == codes[:, 6]).all() and (packed[:, 3] >> 4 == codes[:, 7]).all()


def test_sizes_and_attributes():
    f = F.get_format("nvfp4")
    assert f is F.NVFP4 and f.quantized and f.has_global_scale and f.scale_dtype == np.uint8
    assert (f.payload_bytes(7168), f.scale_count(7168), f.scale_bytes(7168), f.extras_bytes(7168)) == \
        (3584, 448, 448, 452)
    assert (f.message_bytes(7168), f.message_words(7168), f.global_scale_offset_bytes(7168)) == (4096, 512, 4032)
    assert f.payload_width(7168) == 3584 and f.codec.module == "ep_runtime.kernels.codecs.nvfp4"
    assert not F.FP8_E4M3.has_global_scale and F.FP8_E4M3.payload_width(7168) == 7168


@pytest.mark.parametrize("hidden, fix", [(96, "pad hidden to 128"), (16, "pad hidden to 64"),
                                         (200, "pad hidden to 256")])
def test_hidden_must_be_a_multiple_of_64(hidden, fix):
    with pytest.raises(EPConfigError, match=f"must be a multiple of 64.*{fix}"):
        F.NVFP4.validate_hidden(hidden)


def test_argument_errors():
    packed, scales = F.NVFP4.quantize(np.zeros((2, 64), np.uint16))
    with pytest.raises(EPInputError, match="global_scales"):
        F.NVFP4.dequantize(packed, scales)
    with pytest.raises(EPInputError, match="global_scales"):
        F.NVFP4.pack_messages(packed, scales)
    with pytest.raises(EPInputError, match="scales must be"):
        F.NVFP4.dequantize(packed, scales[:, :2], 1.0)
    with pytest.raises(EPInputError, match="tokens must be"):
        F.NVFP4.quantize(np.zeros((2, 64), np.float32))
