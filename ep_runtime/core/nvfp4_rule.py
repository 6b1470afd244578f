"""The NVFP4 rule's element and scale conversions, in NumPy (:mod:`ep_runtime.core.formats` states
the rule and holds the format, ``Nvfp4Format``; the device codec, ep_runtime/kernels/codecs/nvfp4.py,
gives the same bits)."""

from __future__ import annotations

import ml_dtypes
import numpy as np

from ep_runtime.kernels.protocol import E4M3_MAX, E4M3_NAN

#: Elements per NVFP4 block scale.
NVFP4_BLOCK = 16
#: NVFP4's hidden: a multiple of 64, so its block scales fill whole 4-byte words and the global
#: scale after them is aligned (NVFP4 GEMMs' scale layouts tile 4 scales along K too).
NVFP4_HIDDEN_MULTIPLE = 64
#: Bytes of the float32 global scale a message carries after its block scales.
NVFP4_GLOBAL_BYTES = 4
#: Largest E2M1 magnitude.
E2M1_MAX = 6.0
#: E2M1 magnitudes of codes 0..7 (code | 8: the negative ones).
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)
#: The rounding thresholds between codes k and k + 1 (midpoints) and whether a tie goes up (to
#: the even code k + 1: k odd): ``code = sum(|q| > t or (up and |q| == t))``.
E2M1_THRESHOLDS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True),
                   (5.0, False))
#: The global scale maps the tensor's amax to E2M1_MAX * E4M3_MAX.
NVFP4_GLOBAL_RANGE = E2M1_MAX * E4M3_MAX
_E4M3_SATURATED = 0x7E
_E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)


def e2m1_codes(q: np.ndarray) -> np.ndarray:
    """uint8 E2M1 codes (0..15) of float32 ``q``: round to nearest, ties to even, magnitudes above
    6 (inf included) saturate to 6 (code 7), the sign bit kept (-0.0 gives 0x8); NaN gives 0 or
    8 (the rule never converts one)."""
    q = np.asarray(q, np.float32)
    a = np.abs(q)
    code = np.zeros(q.shape, np.uint8)
    for t, up in E2M1_THRESHOLDS:
        code += ((a >= np.float32(t)) if up else (a > np.float32(t))).astype(np.uint8)
    return code | (np.signbit(q).astype(np.uint8) << 3)


def e2m1_value(codes: np.ndarray) -> np.ndarray:
    """float32 values of E2M1 codes (their low 4 bits)."""
    c = np.asarray(codes).astype(np.uint8) & np.uint8(15)
    v = E2M1_VALUES[c & 7]
    return np.where(c & 8, -v, v).astype(np.float32)


def e4m3_saturated(x: np.ndarray) -> np.ndarray:
    """uint8 E4M3 codes of float32 ``x``, rounded to nearest even as ``ml_dtypes`` rounds, but
    magnitudes above 448 (inf included) saturate to 448 (0x7E with the sign); NaN gives 0x7F."""
    x = np.asarray(x, np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        codes = x.astype(_E4M3).view(np.uint8)
    over = np.abs(x) > np.float32(E4M3_MAX)
    return np.where(np.isnan(x), np.uint8(E4M3_NAN),
                    np.where(over, (codes & np.uint8(0x80)) | np.uint8(_E4M3_SATURATED), codes)).astype(np.uint8)


def nvfp4_global_scale(tokens: np.ndarray) -> np.float32:
    """The NVFP4 rule's global scale of bf16 ``tokens`` (uint16 bits, any shape): the largest
    finite magnitude over 2688 (6 x 448), 1.0 when there is none (all zero or non-finite)."""
    mag = np.asarray(tokens, np.uint16) & np.uint16(0x7FFF)
    amax = np.uint32(int(np.where(mag < 0x7F80, mag, 0).max(initial=0)) << 16).view(np.float32)
    return np.float32(1.0) if amax == 0 else np.float32(amax / np.float32(NVFP4_GLOBAL_RANGE))



__all__ = ["NVFP4_BLOCK", "NVFP4_HIDDEN_MULTIPLE", "NVFP4_GLOBAL_BYTES", "E2M1_MAX", "E2M1_VALUES", "E2M1_THRESHOLDS",
           "NVFP4_GLOBAL_RANGE", "e2m1_codes", "e2m1_value", "e4m3_saturated", "nvfp4_global_scale"]
