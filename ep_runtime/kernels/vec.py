"""Wide memory access and packed bf16 rounding for the kernels' streaming loops.

Why: Nsight Compute (docs/plans.md) found the copy and reduce loops bound by integer
instructions, not by memory: every ``row[i] = v`` through a Numba array costs 64-bit index
arithmetic, a negative-index (wraparound) select and a divergent branch, many SASS
instructions per 8-byte store in dispatch_copy; combine_wait's instructions per output
element were almost all integer ones. The helpers here address a
row with one pointer offset and move **two words per access** (16 bytes for uint64 words:
one ``LDG.E.128`` / ``STG.E.128``), and round two float32 values to bf16 in one
instruction (``cvt.rn.bf16x2.f32``).

- ``load_pair(row, i) -> (row[i], row[i + 1])``, ``store_pair(row, i, a, b)``: ``row`` a
  1-D C-contiguous array of words, ``i`` even and ``0 <= i``, ``i + 1 < row.size`` (not
  checked: the caller's loop bounds guarantee it), the row's data ``2 * itemsize``-aligned
  (check with ``pairs_aligned``).
- ``pairs_aligned(ary) -> bool``: whether ``ary``'s data pointer is ``2 * itemsize``
  aligned (with an even row length in words, every row of a C-contiguous 2-D array then is).
- ``address_of(ary) -> uint64``: the address of ``ary``'s first element (any array).
- ``store_pair_at(addr, i, a, b)``: uint64 words ``a, b`` stored at byte address
  ``addr + 8 i`` (16-byte aligned): a row of another PE's symmetric array reached through
  its NVLink mapping (``Session.peer_addresses``; the same offset from the region's base on
  every PE). Plain stores: publish them as ``Session.peer_view`` says (fence, barrier, signal).
- ``load_u32_at(addr, i) -> uint32``: the uint32 at ``addr + 4 i`` (a flat element of a
  C-contiguous array: ``address_of(ary)`` and its flat index).
- ``load_u32x4_at(addr, i) -> (uint32, uint32, uint32, uint32)``: the four uint32 at ``addr +
  16 i`` (16-byte aligned) in one ``LDG.E.128``: flat elements ``4 i .. 4 i + 3`` (a run of
  expert ids read four to a load).
- ``store_u32_at(addr, i, v)``, ``store_u8_at(addr, i, v)``: one uint32 at ``addr + 4 i``
  (4-byte aligned) or one byte at ``addr + i``, the same way (FP8 messages encoded straight
  into peers' receive slots: four E4M3 codes, a float32 scale, a UE8M0 scale code).
- ``store_word_at(addr, i, v)``: one unsigned word ``v`` (uint16, uint32 or uint64: a token
  word) at ``addr + i * size(v)``, aligned to its size (token rows stored into peers' slots
  a word at a time where their word pairs are not 16-byte aligned).
- ``max_u16x2(a, b) -> uint32``: the larger unsigned 16-bit half of each pair of halves (one
  ``max.u16x2``: the FP8 encoder's block amax over bf16 magnitude patterns, two at a time).
- ``pack_bf16x2(lo, hi) -> uint32``: ``lo`` and ``hi`` (float32) rounded to bf16, ``lo`` in
  bits 0-15: the same bits as :func:`ep_runtime.kernels.bits.f32_to_bf16` for every input
  (the hardware's canonical NaN is replaced by ml_dtypes' quiet NaN with the input's sign).
- ``pack_bf16x4(a, b, c, d) -> uint64``: four values, ``a`` in bits 0-15 (a uint64 token
  word). ``pack_f32x2(a, b) -> uint64``: two float32 values unrounded, ``a`` in bits 0-31
  (a float32 partial word).

On a GPU these are LLVM intrinsics (a vector load/store with its alignment, inline PTX for
the conversion; with numba-cuda-mlir, inline PTX throughout: :mod:`ep_runtime.kernels.mlir_intrinsics`);
in the simulator, plain Python with the same results.

:func:`make_pair_loops` builds the loops every kernel runs over them: a lane's ``n`` pairs of
a row part, loaded all before any is stored (memory-level parallelism), then stored to a row
or to rows at addresses.
"""

import ctypes

import numpy as np

from ep_runtime.kernels.bits import f32_bits, f32_to_bf16
from ep_runtime.kernels.cuda_api import MLIR, SIMULATED, cuda, float32, types, uint32, uint64

if SIMULATED:

    def load_pair(row, i):
        """``(row[i], row[i + 1])``."""
        return row[i], row[i + 1]

    def store_pair(row, i, a, b):
        """``row[i], row[i + 1] = a, b``."""
        row[i] = a
        row[i + 1] = b

    def pairs_aligned(ary):
        """Whether ``ary``'s data is aligned to two of its elements."""
        return ary.ctypes.data % (2 * ary.dtype.itemsize) == 0

    def address_of(ary):
        """The address of ``ary``'s first element (this process's mapping)."""
        return np.uint64(ary.ctypes.data)

    def store_pair_at(addr, i, a, b):
        """uint64 ``a, b`` at address ``addr + 8 i``: a peer's heap is mapped in this process."""
        (ctypes.c_uint64 * 2).from_address(int(addr) + 8 * int(i))[:] = (int(a), int(b))

    def store_u32_at(addr, i, v):
        """uint32 ``v`` at address ``addr + 4 i``."""
        ctypes.c_uint32.from_address(int(addr) + 4 * int(i)).value = int(v) & 0xFFFFFFFF

    def store_u8_at(addr, i, v):
        """The low byte of ``v`` at address ``addr + i``."""
        ctypes.c_uint8.from_address(int(addr) + int(i)).value = int(v) & 0xFF

    _WORD_TYPES = {1: ctypes.c_uint8, 2: ctypes.c_uint16, 4: ctypes.c_uint32, 8: ctypes.c_uint64}

    def store_word_at(addr, i, v):
        """Word ``v`` (a NumPy unsigned integer) at address ``addr + i * v.itemsize``."""
        size = np.asarray(v).dtype.itemsize
        _WORD_TYPES[size].from_address(int(addr) + size * int(i)).value = int(v)

    def load_u32_at(addr, i):
        """The uint32 at address ``addr + 4 i``."""
        return np.uint32(ctypes.c_uint32.from_address(int(addr) + 4 * int(i)).value)

    def load_u32x4_at(addr, i):
        """The four uint32 at address ``addr + 16 i``."""
        v = (ctypes.c_uint32 * 4).from_address(int(addr) + 16 * int(i))
        return np.uint32(v[0]), np.uint32(v[1]), np.uint32(v[2]), np.uint32(v[3])

    def max_u16x2(a, b):
        """Per 16-bit half, the larger of uint32 ``a``'s and ``b``'s (unsigned)."""
        a, b = int(a), int(b)
        return np.uint32(max(a & 0xFFFF, b & 0xFFFF) | (max(a >> 16, b >> 16) << 16))

    def pack_bf16x2(lo, hi):
        """bf16(lo) | bf16(hi) << 16, as uint32."""
        return np.uint32(int(f32_to_bf16(lo)) | (int(f32_to_bf16(hi)) << 16))

    def pack_bf16x4(a, b, c, d):
        """bf16 of a, b, c, d in bits 0, 16, 32, 48 of a uint64."""
        return np.uint64(int(pack_bf16x2(a, b)) | (int(pack_bf16x2(c, d)) << 32))

    def pack_f32x2(a, b):
        """float32 a, b (unrounded) in bits 0 and 32 of a uint64."""
        return np.uint64(int(f32_bits(a)) | (int(f32_bits(b)) << 32))

elif MLIR:
    from ep_runtime.kernels.mlir_intrinsics import (  # noqa: F401 (this module's interface)
        address_of, f32_pair_conversion, load_pair, load_u32_at, load_u32x4_at, max_u16x2, pairs_aligned, store_pair,
        store_pair_at, store_u8_at, store_u32_at, store_word_at)
else:
    from llvmlite import ir
    from numba.core.extending import intrinsic

    def _element_pointer(context, builder, aryty, ary, index, indexty):
        """Pointer to ``ary[index]`` of a 1-D C-contiguous array: data + index (no checks)."""
        data = context.make_array(aryty)(context, builder, ary).data
        idx = context.cast(builder, index, indexty, types.intp)
        return builder.gep(data, [idx])

    def _pair_type(aryty):
        return ir.VectorType(ir.IntType(aryty.dtype.bitwidth), 2)

    def _is_word_row(ary):
        return (isinstance(ary, types.Array) and ary.ndim == 1 and ary.layout == "C"
                and isinstance(ary.dtype, types.Integer))

    @intrinsic
    def load_pair(typingctx, row, i):
        """``(row[i], row[i + 1])`` in one aligned vector load (no bounds or sign checks)."""
        if not (_is_word_row(row) and isinstance(i, types.Integer)):
            return None
        sig = types.UniTuple(row.dtype, 2)(row, i)

        def codegen(context, builder, signature, args):
            ptr = _element_pointer(context, builder, signature.args[0], args[0], args[1], signature.args[1])
            vty = _pair_type(signature.args[0])
            v = builder.load(builder.bitcast(ptr, vty.as_pointer()), align=2 * row.dtype.bitwidth // 8)
            zero, one = ir.Constant(ir.IntType(32), 0), ir.Constant(ir.IntType(32), 1)
            return context.make_tuple(builder, signature.return_type,
                                      [builder.extract_element(v, zero), builder.extract_element(v, one)])

        return sig, codegen

    @intrinsic
    def store_pair(typingctx, row, i, a, b):
        """``row[i], row[i + 1] = a, b`` in one aligned vector store (no bounds or sign checks)."""
        if not (_is_word_row(row) and isinstance(i, types.Integer)):
            return None
        sig = types.void(row, i, row.dtype, row.dtype)

        def codegen(context, builder, signature, args):
            ptr = _element_pointer(context, builder, signature.args[0], args[0], args[1], signature.args[1])
            vty = _pair_type(signature.args[0])
            v = ir.Constant(vty, ir.Undefined)
            v = builder.insert_element(v, args[2], ir.Constant(ir.IntType(32), 0))
            v = builder.insert_element(v, args[3], ir.Constant(ir.IntType(32), 1))
            builder.store(v, builder.bitcast(ptr, vty.as_pointer()), align=2 * row.dtype.bitwidth // 8)
            return context.get_dummy_value()

        return sig, codegen

    def _data_address(context, builder, aryty, ary):
        """The address of an array's first element, as an i64 value."""
        return builder.ptrtoint(context.make_array(aryty)(context, builder, ary).data, ir.IntType(64))

    @intrinsic
    def pairs_aligned(typingctx, ary):
        """Whether ``ary``'s data pointer is aligned to two of its elements."""
        if not isinstance(ary, types.Array):
            return None
        sig = types.boolean(ary)

        def codegen(context, builder, signature, args):
            addr = _data_address(context, builder, signature.args[0], args[0])
            mask = ir.Constant(ir.IntType(64), 2 * signature.args[0].dtype.bitwidth // 8 - 1)
            return builder.icmp_unsigned("==", builder.and_(addr, mask), ir.Constant(ir.IntType(64), 0))

        return sig, codegen

    @intrinsic
    def address_of(typingctx, ary):
        """The address of ``ary``'s first element, as uint64."""
        if not isinstance(ary, types.Array):
            return None

        def codegen(context, builder, signature, args):
            return _data_address(context, builder, signature.args[0], args[0])

        return types.uint64(ary), codegen

    @intrinsic
    def store_pair_at(typingctx, addr, i, a, b):
        """uint64 ``a, b`` stored at byte address ``addr + 8 i`` in one 16-byte vector store."""
        if not (isinstance(addr, types.Integer) and isinstance(i, types.Integer)):
            return None
        sig = types.void(types.uint64, types.int64, types.uint64, types.uint64)

        def codegen(context, builder, signature, args):
            i64 = ir.IntType(64)
            byte = builder.add(args[0], builder.mul(args[1], ir.Constant(i64, 8)))
            vty = ir.VectorType(i64, 2)
            v = ir.Constant(vty, ir.Undefined)
            v = builder.insert_element(v, args[2], ir.Constant(ir.IntType(32), 0))
            v = builder.insert_element(v, args[3], ir.Constant(ir.IntType(32), 1))
            builder.store(v, builder.inttoptr(byte, vty.as_pointer()), align=16)
            return context.get_dummy_value()

        return sig, codegen

    def _store_codegen(bits: int):
        """Codegen of ``(addr, i, v)``: ``v`` stored as a ``bits``-bit integer at byte address
        ``addr + i * bits / 8`` (aligned to its size)."""
        size = bits // 8

        def codegen(context, builder, signature, args):
            byte = builder.add(args[0], builder.mul(args[1], ir.Constant(ir.IntType(64), size)))
            builder.store(args[2], builder.inttoptr(byte, ir.IntType(bits).as_pointer()), align=size)
            return context.get_dummy_value()

        return codegen

    def _scalar_store_at(bits: int):
        """An intrinsic ``(addr: uint64, i: int64, v)`` storing ``v`` as a ``bits``-bit integer
        at byte address ``addr + i * bits / 8`` (aligned to its size)."""
        nty = types.uint32 if bits == 32 else types.uint8

        @intrinsic
        def store_at(typingctx, addr, i, v):
            if not (isinstance(addr, types.Integer) and isinstance(i, types.Integer)
                    and isinstance(v, types.Integer)):
                return None
            return types.void(types.uint64, types.int64, nty), _store_codegen(bits)

        return store_at

    @intrinsic
    def load_u32_at(typingctx, addr, i):
        """The uint32 at byte address ``addr + 4 i`` (4-byte aligned): an array's flat element
        without Numba's per-index arithmetic (many instructions per element: docs/plans.md)."""
        if not (isinstance(addr, types.Integer) and isinstance(i, types.Integer)):
            return None
        sig = types.uint32(types.uint64, types.int64)

        def codegen(context, builder, signature, args):
            i64 = ir.IntType(64)
            byte = builder.add(args[0], builder.mul(args[1], ir.Constant(i64, 4)))
            return builder.load(builder.inttoptr(byte, ir.IntType(32).as_pointer()), align=4)

        return sig, codegen

    @intrinsic
    def load_u32x4_at(typingctx, addr, i):
        """The four uint32 at byte address ``addr + 16 i`` (16-byte aligned), in one vector load."""
        if not (isinstance(addr, types.Integer) and isinstance(i, types.Integer)):
            return None
        sig = types.UniTuple(types.uint32, 4)(types.uint64, types.int64)

        def codegen(context, builder, signature, args):
            i64 = ir.IntType(64)
            vty = ir.VectorType(ir.IntType(32), 4)
            byte = builder.add(args[0], builder.mul(args[1], ir.Constant(i64, 16)))
            v = builder.load(builder.inttoptr(byte, vty.as_pointer()), align=16)
            parts = [builder.extract_element(v, ir.Constant(ir.IntType(32), u)) for u in range(4)]
            return context.make_tuple(builder, signature.return_type, parts)

        return sig, codegen

    @intrinsic
    def store_word_at(typingctx, addr, i, v):
        """Unsigned word ``v`` (16, 32 or 64 bits) stored at byte address ``addr + i * size(v)``."""
        if not (isinstance(addr, types.Integer) and isinstance(i, types.Integer) and isinstance(v, types.Integer)
                and not v.signed and v.bitwidth in (16, 32, 64)):
            return None
        return types.void(types.uint64, types.int64, v), _store_codegen(v.bitwidth)

    #: uint32 ``v`` at byte address ``addr + 4 i``
    store_u32_at = _scalar_store_at(32)
    #: byte ``v`` at byte address ``addr + i``
    store_u8_at = _scalar_store_at(8)

    def f32_pair_conversion(instruction: str, bits: int):
        """An intrinsic ``(lo: float32, hi: float32) -> uint32`` running the PTX conversion
        ``instruction`` (a ``cvt ... x2.f32 d, a, b``, which writes ``cvt(a)`` to the high half
        of its ``bits``-bit result and ``cvt(b)`` to the low half) on ``(hi, lo)``, the result
        zero-extended: ``lo``'s conversion in the low half."""
        constraint = {16: "h", 32: "r"}[bits]

        @intrinsic
        def convert(typingctx, lo, hi):
            if lo != types.float32 or hi != types.float32:
                return None
            sig = types.uint32(lo, hi)

            def codegen(context, builder, signature, args):
                fnty = ir.FunctionType(ir.IntType(bits), [ir.FloatType(), ir.FloatType()])
                asm = ir.InlineAsm(fnty, f"{instruction} $0, $1, $2;", f"={constraint},f,f")
                pair = builder.call(asm, [args[1], args[0]])
                return pair if bits == 32 else builder.zext(pair, ir.IntType(32))

            return sig, codegen

        return convert

    @intrinsic
    def max_u16x2(typingctx, a, b):
        """Per 16-bit half, the larger of ``a``'s and ``b``'s low 32 bits (unsigned halves):
        one ``max.u16x2`` (sm_90)."""
        if not (isinstance(a, types.Integer) and isinstance(b, types.Integer)):
            return None

        def codegen(context, builder, signature, args):
            i32 = ir.IntType(32)
            ops = [builder.trunc(v, i32) if v.type.width > 32 else builder.zext(v, i32) if v.type.width < 32 else v
                   for v in args]  # the low 32 bits (Numba widens integer arithmetic to 64)
            asm = ir.InlineAsm(ir.FunctionType(i32, [i32, i32]), "max.u16x2 $0, $1, $2;", "=r,r,r")
            return builder.call(asm, ops)

        return types.uint32(a, b), codegen


if not SIMULATED:
    #: bf16(hi) << 16 | bf16(lo), NaN as the hardware's canonical NaN
    _cvt_bf16x2 = f32_pair_conversion("cvt.rn.bf16x2.f32", 32)

    @cuda.jit(device=True)
    def pack_bf16x2(lo, hi):
        """bf16(lo) | bf16(hi) << 16 (uint32), rounded to nearest even; NaN as ml_dtypes."""
        lo = float32(lo)
        hi = float32(hi)
        r = _cvt_bf16x2(lo, hi)
        if lo != lo:  # rare: the hardware writes its canonical NaN, ml_dtypes keeps the sign
            r = (r & uint32(0xFFFF0000)) | uint32(f32_to_bf16(lo))
        if hi != hi:
            r = (r & uint32(0xFFFF)) | (uint32(f32_to_bf16(hi)) << uint32(16))
        return r

    @cuda.jit(device=True)
    def pack_bf16x4(a, b, c, d):
        """bf16 of a, b, c, d in bits 0, 16, 32, 48 of a uint64 (a token word)."""
        return uint64(pack_bf16x2(a, b)) | (uint64(pack_bf16x2(c, d)) << uint64(32))

    @cuda.jit(device=True)
    def pack_f32x2(a, b):
        """float32 a, b (unrounded) in bits 0 and 32 of a uint64 (a float32 partial word)."""
        return uint64(f32_bits(float32(a))) | (uint64(f32_bits(float32(b))) << uint64(32))


def make_pair_loops(n: int, warp: int):
    """``(load_pairs, store_pairs, store_pairs_at)`` for a lane's ``n`` word pairs of a row part,
    with the warp's ``warp`` lanes interleaved: the lane's pairs start at words ``w + 2 u warp``
    (``u < n``), those below ``w1`` taken (``w`` and ``w1`` even, ``w`` = the part's first word
    + 2 lane, advanced by ``2 n warp`` per pass).

    - ``load_pairs(row, w, w1, lo, hi)``: ``lo[u], hi[u] = row[w + 2 u warp], row[... + 1]``;
    - ``store_pairs(row, w, w1, lo, hi)``: the reverse;
    - ``store_pairs_at(addr, w, w1, lo, hi)``: the same words at byte address ``addr`` (a row
      reached through a peer's mapping, uint64 words: :func:`store_pair_at`).

    ``lo``, ``hi``: local arrays of at least ``n`` words (registers, once inlined)."""
    step = 2 * warp

    @cuda.jit(device=True)
    def load_pairs(row, w, w1, lo, hi):
        for u in range(n):
            if w + u * step < w1:
                pair = load_pair(row, w + u * step)
                lo[u] = pair[0]
                hi[u] = pair[1]

    @cuda.jit(device=True)
    def store_pairs(row, w, w1, lo, hi):
        for u in range(n):
            if w + u * step < w1:
                store_pair(row, w + u * step, lo[u], hi[u])

    @cuda.jit(device=True)
    def store_pairs_at(addr, w, w1, lo, hi):
        for u in range(n):
            if w + u * step < w1:
                store_pair_at(addr, w + u * step, lo[u], hi[u])

    return load_pairs, store_pairs, store_pairs_at


def make_peer_copy(n: int, warp: int):
    """``copy_to_peers(src, w0, w1, dests, d0, d1, peer_bases, region, slot, pairs, lane, lo, hi)``:
    every lane of a warp copies words ``[w0, w1)`` of the row ``src`` into the same words of the
    row at byte ``slot`` past ``peer_bases[region, d]`` (a peer's region through its mapping) for
    every PE d in ``[d0, d1)`` whose bit is set in ``dests`` (uint64), each word loaded once: with
    ``pairs`` (uint64 words, 16-byte aligned on both sides, ``w0`` even) ``n`` word pairs per
    lane in flight (:func:`make_pair_loops`), else a word per lane per step. ``lo``, ``hi``:
    local arrays of at least ``n`` words."""
    load_pairs, _, store_pairs_at = make_pair_loops(n, warp)

    @cuda.jit(device=True)
    def copy_to_peers(src, w0, w1, dests, d0, d1, peer_bases, region, slot, pairs, lane, lo, hi):
        if pairs:
            w = w0 + 2 * lane
            while w < w1:
                load_pairs(src, w, w1, lo, hi)
                for d in range(d0, d1):
                    if (dests >> uint64(d)) & uint64(1):
                        store_pairs_at(peer_bases[region, d] + slot, w, w1, lo, hi)
                w += 2 * n * warp
        else:
            for w in range(w0 + lane, w1, warp):
                val = src[w]
                for d in range(d0, d1):
                    if (dests >> uint64(d)) & uint64(1):
                        store_word_at(peer_bases[region, d] + slot, w, val)

    return copy_to_peers



def make_listed_peer_copy(n: int, warp: int):
    """``copy_to_listed(src, w0, w1, dl, peer_bases, region, slot, pairs, lane, lo, hi)``:
    :func:`make_peer_copy`'s copy to the PEs of the destination list ``dl`` (int32, count first:
    ep_runtime/kernels/destinations.py) instead of a mask's bits, each word loaded once."""
    load_pairs, _, store_pairs_at = make_pair_loops(n, warp)

    @cuda.jit(device=True)
    def copy_to_listed(src, w0, w1, dl, peer_bases, region, slot, pairs, lane, lo, hi):
        if pairs:
            w = w0 + 2 * lane
            while w < w1:
                load_pairs(src, w, w1, lo, hi)
                for j in range(dl[0]):
                    store_pairs_at(peer_bases[region, dl[1 + j]] + slot, w, w1, lo, hi)
                w += 2 * n * warp
        else:
            for w in range(w0 + lane, w1, warp):
                val = src[w]
                for j in range(dl[0]):
                    store_word_at(peer_bases[region, dl[1 + j]] + slot, w, val)

    return copy_to_listed

__all__ = ["load_pair", "store_pair", "pairs_aligned", "address_of", "store_pair_at", "load_u32_at", "store_u32_at",
           "store_u8_at", "max_u16x2", "pack_bf16x2", "pack_bf16x4", "pack_f32x2", "make_pair_loops",
           "make_peer_copy", "make_listed_peer_copy"]
