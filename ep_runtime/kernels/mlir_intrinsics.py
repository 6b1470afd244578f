"""The kernels' intrinsics for numba-cuda-mlir: what numba-cuda builds from llvmlite IR in
:mod:`ep_runtime.kernels.bits`, :mod:`~ep_runtime.kernels.vec`, :mod:`~ep_runtime.kernels.block`,
:mod:`~ep_runtime.kernels.pdl` and :mod:`~ep_runtime.kernels._shmem_nvshmem`, with the same names,
arguments and results (those modules document them), as inline PTX.

numba-cuda-mlir lowers to MLIR, not LLVM IR, so llvmlite intrinsics do not apply there.
:func:`asm` makes a device-callable function of one PTX statement, with the text (LLVM operand
syntax, ``$0`` ...) and constraints of the llvmlite version, through numba-cuda-mlir's low-level
extension API: a typing template, and a lowering that emits ``llvm.inline_asm`` with side
effects, so nothing is hoisted or removed. Vector loads and stores, which numba-cuda emits as
LLVM vector loads and stores, are ``ld.v2`` / ``st.v2`` statements here. numba-cuda-mlir's own
``inline_ptx`` is not used: it rewrites ``%`` into ``$``, so a PTX special register such as
``%globaltimer`` cannot be read through it (docs/compilers.md).

It also lowers what numba-cuda-mlir 0.6.0 types but cannot lower (a compiler error) and the kernels
use: ``cuda.threadfence()`` and ``cuda.threadfence_system()``, as what numba-cuda emits for them
(``membar.gl``, ``membar.sys``), an array's ``itemsize`` (a constant of its type) and ``min`` of three
numbers (its ``min`` of two, twice). And :data:`shared_atomic`: atomics on a shared array as
``atom.shared`` (numba-cuda-mlir makes a device function's atomic on one a global atomic).

Import only in a process that builds with numba-cuda-mlir (:data:`ep_runtime.kernels.cuda_api.MLIR`).
"""

from types import ModuleType

from numba_cuda_mlir import cuda, types
from numba_cuda_mlir._mlir import ir
from numba_cuda_mlir._mlir.dialects import arith, llvm
from numba_cuda_mlir.extending import lowering_registry, overload, refresh_registries, typing_registry
from numba_cuda_mlir.lowering_utilities import coerce_numpy_scalars_for_binary_op, i64_of
from numba_cuda_mlir.numba_cuda import stubs
from numba_cuda_mlir.numba_cuda.typing import signature
from numba_cuda_mlir.numba_cuda.typing.templates import ConcreteTemplate
from numba_cuda_mlir.types import float32, int32, int64, uint16, uint32, uint64

_U16, _U32, _U64, _F32, _I32 = types.uint16, types.uint32, types.uint64, types.float32, types.int32


def asm(name: str, text: str, constraints: str, result, params: tuple):
    """A device function ``name(*params) -> result`` that runs the PTX statement ``text``.

    ``constraints``: LLVM's inline-assembly constraints, outputs first (``"=l,l,~{memory}"``).
    ``result``: a Numba scalar type, a ``types.UniTuple`` of one (several outputs, returned as
    a tuple) or ``types.none``. ``params``: the Numba types of the operands; callers pass values
    of exactly these types (the lowering converts only between MLIR types of the same kind).
    """

    def stub(*args):
        raise NotImplementedError(f"{name} runs only in device code built with numba-cuda-mlir")

    stub.__name__ = stub.__qualname__ = name

    class _Typing(ConcreteTemplate):
        key = stub
        cases = [signature(result, *params)]

    typing_registry.register_global(stub, types.Function(_Typing))

    @lowering_registry.lower(stub, types.VarArg(types.Any))
    def _lower(builder, target, args, kwargs):
        operands = [builder.mlir_convert(builder.load_var(a), builder.get_mlir_type(p)) for a, p in zip(args, params)]
        if result == types.none:
            llvm.inline_asm(None, operands, text, constraints, has_side_effects=True)
            return
        if isinstance(result, types.UniTuple):
            element = builder.get_mlir_type(result.dtype)
            struct = llvm.StructType.get_literal([element] * result.count)
            out = llvm.inline_asm(struct, operands, text, constraints, has_side_effects=True)
            builder.store_var(target, tuple(
                llvm.extractvalue(res=element, container=out, position=ir.DenseI64ArrayAttr.get([i]))
                for i in range(result.count)))
            return
        builder.store_var(target, llvm.inline_asm(builder.get_mlir_type(result), operands, text, constraints,
                                                  has_side_effects=True))

    refresh_registries()
    return stub


def _lower_fence(text: str):
    def lower(builder, target, args, kwargs):
        llvm.inline_asm(None, [], text, "~{memory}", has_side_effects=True)

    return lower


# WAR: numba-cuda-mlir 0.6.0 has typing for cuda.threadfence() and cuda.threadfence_system() but no
# lowering ("NotImplemented lowering call to <class '...stubs.threadfence'>"); numba-cuda lowers them to
# llvm.nvvm.membar.gl / .sys, which are these PTX instructions.
lowering_registry.lower(stubs.threadfence)(_lower_fence("membar.gl;"))
lowering_registry.lower(stubs.threadfence_system)(_lower_fence("membar.sys;"))


# WAR: numba-cuda-mlir 0.6.0 types ``ary.itemsize`` but does not lower it ("NotImplementedError:
# getattr(array(uint64, 2d, C), attr='itemsize')"): the element size of the array's type.
@lowering_registry.lower_getattr(types.Array, "itemsize")
def _array_itemsize(context, builder, target, ary):
    builder.store_var(target, i64_of(builder.get_numba_type(ary.name).dtype.bitwidth // 8))


# WAR: numba-cuda-mlir 0.6.0 lowers min() of two numbers only ("NotImplemented lowering call to <built-in
# function min>" for three): its rule for two (NumPy's promotion, then minnumf or minsi), applied twice.
@lowering_registry.lower(min, types.Number, types.Number, types.Number)
def _min_of_three(builder, target, args, kwargs):
    result = builder.load_var(args[0])
    for arg in args[1:]:
        a, b = coerce_numpy_scalars_for_binary_op(result, builder.load_var(arg))
        result = arith.minnumf(a, b) if isinstance(a.type, ir.FloatType) else arith.minsi(a, b)
    builder.store_var(target, result)


refresh_registries()


# -- bits ------------------------------------------------------------------------------------------
_mov_u32_to_f32 = asm("mov_u32_to_f32", "mov.b32 $0, $1;", "=f,r", _F32, (_U32,))
_mov_f32_to_u32 = asm("mov_f32_to_u32", "mov.b32 $0, $1;", "=r,f", _U32, (_F32,))


@cuda.jit(device=True)
def u32_bits_as_f32(u):
    """The low 32 bits of the integer ``u`` as a float32."""
    return _mov_u32_to_f32(uint32(u))


@cuda.jit(device=True)
def f32_as_u32_bits(x):
    """The bits of the float32 ``x`` as a uint32."""
    return _mov_f32_to_u32(float32(x))


# -- block -----------------------------------------------------------------------------------------
_div_u32 = asm("div_u32", "div.u32 $0, $1, $2;", "=r,r,r", _U32, (_U32, _U32))


@cuda.jit(device=True)
def udiv32(a, b):
    """``uint32(a) // uint32(b)`` as one 32-bit unsigned division."""
    return _div_u32(uint32(a), uint32(b))


# -- pdl -------------------------------------------------------------------------------------------
pdl_wait = asm("pdl_wait", "griddepcontrol.wait;", "~{memory}", types.none, ())
pdl_trigger = asm("pdl_trigger", "griddepcontrol.launch_dependents;", "~{memory}", types.none, ())

# -- the NVSHMEM backend ---------------------------------------------------------------------------
globaltimer_ns = asm("globaltimer_ns", "mov.u64 $0, %globaltimer;", "=l", _U64, ())
_ld_acquire_u64 = asm("ld_acquire_u64", "ld.acquire.sys.global.u64 $0, [$1];", "=l,l,~{memory}", _U64, (_U64,))


@cuda.jit(device=True)
def load_acquire_u64(sig):
    """``sig[0]`` (a uint64 array) by ``ld.acquire.sys``."""
    return _ld_acquire_u64(uint64(sig.ctypes.data))


# -- vec -------------------------------------------------------------------------------------------
#: (PTX type, register constraint, Numba type) of each word width
_WIDTHS = {16: ("u16", "h", _U16), 32: ("u32", "r", _U32), 64: ("u64", "l", _U64)}
_LOAD_V2 = {bits: asm(f"load_v2_{t}", f"ld.v2.{t} {{$0, $1}}, [$2];", f"={c},={c},l", types.UniTuple(nt, 2), (_U64,))
            for bits, (t, c, nt) in _WIDTHS.items()}
_STORE_V2 = {bits: asm(f"store_v2_{t}", f"st.v2.{t} [$0], {{$1, $2}};", f"l,{c},{c},~{{memory}}", types.none,
                       (_U64, nt, nt)) for bits, (t, c, nt) in _WIDTHS.items()}
_STORE = {bits: asm(f"store_{t}", f"st.{t} [$0], $1;", f"l,{c},~{{memory}}", types.none, (_U64, nt))
          for bits, (t, c, nt) in _WIDTHS.items()}
_store_v2_u64, _store_u32 = _STORE_V2[64], _STORE[32]  # module names: device code cannot index the tables
_STORE_U8 = asm("store_u8", "st.u8 [$0], $1;", "l,h,~{memory}", types.none, (_U64, _U16))
_LOAD_U32 = asm("load_u32", "ld.u32 $0, [$1];", "=r,l", _U32, (_U64,))
_LOAD_V4_U32 = asm("load_v4_u32", "ld.v4.u32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,l", types.UniTuple(_U32, 4),
                   (_U64,))
_MAX_U16X2 = asm("max_u16x2", "max.u16x2 $0, $1, $2;", "=r,r,r", _U32, (_U32, _U32))


def _word_row(row) -> bool:
    return (isinstance(row, types.Array) and row.ndim == 1 and row.layout == "C"
            and isinstance(row.dtype, types.Integer) and row.dtype.bitwidth in _WIDTHS)


def load_pair(row, i):
    """See :mod:`ep_runtime.kernels.vec`."""


@overload(load_pair, inline="always", typing_registry=typing_registry)
def _load_pair(row, i):
    if not _word_row(row):
        return None
    load, size = _LOAD_V2[row.dtype.bitwidth], row.dtype.bitwidth // 8

    def impl(row, i):
        return load(uint64(row.ctypes.data) + uint64(i) * uint64(size))

    return impl


def store_pair(row, i, a, b):
    """See :mod:`ep_runtime.kernels.vec`."""


@overload(store_pair, inline="always", typing_registry=typing_registry)
def _store_pair(row, i, a, b):
    if not _word_row(row):
        return None
    store, word, size = _STORE_V2[row.dtype.bitwidth], row.dtype, row.dtype.bitwidth // 8

    def impl(row, i, a, b):
        store(uint64(row.ctypes.data) + uint64(i) * uint64(size), word(a), word(b))

    return impl


def store_word_at(addr, i, v):
    """See :mod:`ep_runtime.kernels.vec`."""


@overload(store_word_at, inline="always", typing_registry=typing_registry)
def _store_word_at(addr, i, v):
    if not (isinstance(v, types.Integer) and not v.signed and v.bitwidth in _WIDTHS):
        return None
    store, size = _STORE[v.bitwidth], v.bitwidth // 8

    def impl(addr, i, v):
        store(uint64(addr) + uint64(i) * uint64(size), v)

    return impl


@cuda.jit(device=True)
def address_of(ary):
    """The address of ``ary``'s first element, as uint64."""
    return uint64(ary.ctypes.data)


@cuda.jit(device=True)
def pairs_aligned(ary):
    """Whether ``ary``'s data pointer is aligned to two of its elements."""
    return (uint64(ary.ctypes.data) & uint64(2 * ary.itemsize - 1)) == uint64(0)


@cuda.jit(device=True)
def store_pair_at(addr, i, a, b):
    """uint64 ``a, b`` at byte address ``addr + 8 i`` in one 16-byte store."""
    _store_v2_u64(uint64(addr) + uint64(int64(i) * 8), uint64(a), uint64(b))


@cuda.jit(device=True)
def store_u32_at(addr, i, v):
    """uint32 ``v`` at byte address ``addr + 4 i``."""
    _store_u32(uint64(addr) + uint64(int64(i) * 4), uint32(v))


@cuda.jit(device=True)
def store_u8_at(addr, i, v):
    """The low byte of ``v`` at byte address ``addr + i``."""
    _STORE_U8(uint64(addr) + uint64(int64(i)), uint16(uint32(v) & uint32(0xFF)))


@cuda.jit(device=True)
def load_u32_at(addr, i):
    """The uint32 at byte address ``addr + 4 i``."""
    return _LOAD_U32(uint64(addr) + uint64(int64(i) * 4))


@cuda.jit(device=True)
def load_u32x4_at(addr, i):
    """The four uint32 at byte address ``addr + 16 i``, in one vector load."""
    return _LOAD_V4_U32(uint64(addr) + uint64(int64(i) * 16))


@cuda.jit(device=True)
def max_u16x2(a, b):
    """Per 16-bit half, the larger of ``a``'s and ``b``'s low 32 bits (unsigned halves)."""
    return _MAX_U16X2(uint32(a), uint32(b))


# -- shared-memory atomics -------------------------------------------------------------------------
# WAR: numba-cuda-mlir 0.6.0 lowers cuda.atomic.<op> on an array argument of a device function as a
# global atomic (the callee converts the array's generic address with cvta.to.global, or, inlined,
# issues atom.global on it), so an atomic on a shared array that reaches a device function updates
# no shared memory (docs/upstream/numba-cuda-mlir-shared-atomic.md). These convert the array's
# generic address to the shared window and issue atom.shared, numba-cuda's instruction for a shared
# array. Drop them (cuda_api.shared_atomic becomes cuda.atomic again) once numba-cuda-mlir keeps the
# address space of an array argument.
_ATOM_SHARED_OR_B32 = asm("atom_shared_or_b32",
                          "{ .reg .u64 %sa; cvta.to.shared.u64 %sa, $1; atom.shared.or.b32 $0, [%sa], $2; }",
                          "=r,l,r,~{memory}", _U32, (_U64, _U32))
_ATOM_SHARED_ADD_S32 = asm("atom_shared_add_s32",
                           "{ .reg .u64 %sa; cvta.to.shared.u64 %sa, $1; atom.shared.add.s32 $0, [%sa], $2; }",
                           "=r,l,r,~{memory}", _I32, (_U64, _I32))


@cuda.jit(device=True)
def _shared_atomic_or(ary, i, v):
    """``cuda.atomic.or_(ary, i, v)`` for a uint32 shared array ``ary``: the word before."""
    return _ATOM_SHARED_OR_B32(uint64(ary.ctypes.data) + uint64(int64(i) * 4), uint32(v))


@cuda.jit(device=True)
def _shared_atomic_add(ary, i, v):
    """``cuda.atomic.add(ary, i, v)`` for an int32 shared array ``ary``: the word before."""
    return _ATOM_SHARED_ADD_S32(uint64(ary.ctypes.data) + uint64(int64(i) * 4), int32(v))


#: ``shared_atomic.or_`` / ``shared_atomic.add``: :data:`ep_runtime.kernels.cuda_api.shared_atomic` here.
#: A module, as ``cuda.atomic`` is to the compiler: device code reads its functions as attributes.
shared_atomic = ModuleType("shared_atomic", "Atomics on shared arrays for numba-cuda-mlir (atom.shared).")
shared_atomic.or_, shared_atomic.add = _shared_atomic_or, _shared_atomic_add


def f32_pair_conversion(instruction: str, bits: int):
    """``convert(lo, hi) -> uint32``: the PTX conversion ``instruction`` on ``(hi, lo)``, as
    :func:`ep_runtime.kernels.vec.f32_pair_conversion`."""
    _, constraint, result = _WIDTHS[bits]
    pair = asm(instruction.replace(".", "_"), f"{instruction} $0, $1, $2;", f"={constraint},f,f", result, (_F32, _F32))

    @cuda.jit(device=True)
    def convert(lo, hi):
        return uint32(pair(float32(hi), float32(lo)))

    return convert


__all__ = ["asm", "u32_bits_as_f32", "f32_as_u32_bits", "udiv32", "pdl_wait", "pdl_trigger", "globaltimer_ns",
           "load_acquire_u64", "load_pair", "store_pair", "store_word_at", "address_of", "pairs_aligned",
           "store_pair_at", "store_u32_at", "store_u8_at", "load_u32_at", "load_u32x4_at", "max_u16x2",
           "shared_atomic", "f32_pair_conversion"]
