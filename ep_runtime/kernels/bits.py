"""bfloat16 <-> float32 conversions on 16-bit patterns (NVSHMEM moves bf16 as uint16).

``bf16_to_f32(bits)`` widens exactly; ``f32_to_bf16(x)`` rounds to nearest even, keeps
infinities, and maps NaN to a quiet NaN with the input's sign: the same results as
``ml_dtypes.bfloat16`` for every finite input, which the reference uses.
On a GPU the bit casts are LLVM bitcasts (PTX moves with numba-cuda-mlir:
:mod:`ep_runtime.kernels.mlir_intrinsics`); in the simulator they are NumPy scalar views.

Token rows travel as *words* of ``pack`` bf16 values (uint64: 4, uint32: 2, uint16: 1; see
:func:`ep_runtime.core.layout.token_word`), element ``i`` of a word in bits ``16 i .. 16 i + 15``
(little-endian: the same bytes as the bf16 row). ``word_f32(word, i)`` reads element ``i``;
``bf16_bits_at(x, i)`` places the rounded ``x`` at element ``i`` of a uint64 to OR into a word.

float32 combine partials travel as uint64 words of 2 float32 values, element ``i`` in bits
``32 i .. 32 i + 31`` (the same bytes as the float32 row): ``f32_word_at(word, i)`` reads element
``i`` and ``f32_bits_at(x, i)`` places float32 ``x`` (unrounded) at element ``i``.
"""

import numpy as np

from ep_runtime.kernels.cuda_api import MLIR, SIMULATED, cuda, float32, types, uint16, uint32, uint64

if SIMULATED:

    def bf16_to_f32(bits):
        """float32 value of the bf16 pattern ``bits`` (uint16)."""
        return np.uint32(int(bits) << 16).view(np.float32)

    def f32_bits(x):
        """The IEEE bit pattern (uint32) of float32 ``x``."""
        return np.float32(x).view(np.uint32)

    def f32_to_bf16(x):
        """bf16 pattern (uint16) of float32 ``x``, rounded to nearest even."""
        u = int(np.float32(x).view(np.uint32))
        if (u & 0x7FFFFFFF) > 0x7F800000:
            return np.uint16(((u >> 16) & 0x8000) | 0x7FC0)
        return np.uint16(((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF)

    def word_f32(word, i):
        """float32 value of bf16 element ``i`` of ``word``."""
        return bf16_to_f32((int(word) >> (16 * i)) & 0xFFFF)

    def bf16_bits_at(x, i):
        """uint64 with the bf16 rounding of float32 ``x`` at element ``i`` (bits 16 i ..)."""
        return np.uint64(int(f32_to_bf16(x)) << (16 * i))

    def f32_word_at(word, i):
        """float32 element ``i`` (0 or 1) of the uint64 ``word`` (bits 32 i .. 32 i + 31)."""
        return np.uint32((int(word) >> (32 * i)) & 0xFFFFFFFF).view(np.float32)

    def f32_bits_at(x, i):
        """uint64 with the bits of float32 ``x`` at element ``i`` (0 or 1; bits 32 i ..)."""
        return np.uint64(int(np.float32(x).view(np.uint32)) << (32 * i))

elif MLIR:
    from ep_runtime.kernels.mlir_intrinsics import f32_as_u32_bits as _f32_as_u32_bits
    from ep_runtime.kernels.mlir_intrinsics import u32_bits_as_f32 as _u32_bits_as_f32
else:
    from llvmlite import ir
    from numba.core.extending import intrinsic

    @intrinsic
    def _u32_bits_as_f32(typingctx, u):
        """Reinterpret the low 32 bits of an integer as float32."""
        if not isinstance(u, types.Integer):
            return None

        def codegen(context, builder, signature, args):
            v = args[0]
            if v.type.width > 32:
                v = builder.trunc(v, ir.IntType(32))
            elif v.type.width < 32:
                v = builder.zext(v, ir.IntType(32))
            return builder.bitcast(v, ir.FloatType())

        return types.float32(u), codegen

    @intrinsic
    def _f32_as_u32_bits(typingctx, x):
        """Reinterpret a float32 as uint32."""
        if x != types.float32:
            return None

        def codegen(context, builder, signature, args):
            return builder.bitcast(args[0], ir.IntType(32))

        return types.uint32(x), codegen


if not SIMULATED:

    @cuda.jit(device=True)
    def bf16_to_f32(bits):
        """float32 value of the bf16 pattern ``bits`` (uint16)."""
        return _u32_bits_as_f32(uint32(bits) << uint32(16))

    @cuda.jit(device=True)
    def f32_bits(x):
        """The IEEE bit pattern (uint32) of float32 ``x``."""
        return _f32_as_u32_bits(x)

    @cuda.jit(device=True)
    def f32_to_bf16(x):
        """bf16 pattern (uint16) of float32 ``x``, rounded to nearest even."""
        u = _f32_as_u32_bits(x)
        if (u & uint32(0x7FFFFFFF)) > uint32(0x7F800000):
            return uint16(((u >> uint32(16)) & uint32(0x8000)) | uint32(0x7FC0))
        return uint16((u + uint32(0x7FFF) + ((u >> uint32(16)) & uint32(1))) >> uint32(16))

    @cuda.jit(device=True)
    def word_f32(word, i):
        """float32 value of bf16 element ``i`` of ``word``."""
        return bf16_to_f32((uint64(word) >> uint64(16 * i)) & uint64(0xFFFF))

    @cuda.jit(device=True)
    def bf16_bits_at(x, i):
        """uint64 with the bf16 rounding of float32 ``x`` at element ``i`` (bits 16 i ..)."""
        return uint64(f32_to_bf16(x)) << uint64(16 * i)

    @cuda.jit(device=True)
    def f32_word_at(word, i):
        """float32 element ``i`` (0 or 1) of the uint64 ``word`` (bits 32 i .. 32 i + 31)."""
        return _u32_bits_as_f32(uint64(word) >> uint64(32 * i))

    @cuda.jit(device=True)
    def f32_bits_at(x, i):
        """uint64 with the bits of float32 ``x`` at element ``i`` (0 or 1; bits 32 i ..)."""
        return uint64(_f32_as_u32_bits(float32(x))) << uint64(32 * i)

__all__ = ["bf16_to_f32", "f32_to_bf16", "f32_bits", "word_f32", "bf16_bits_at", "f32_word_at", "f32_bits_at"]
