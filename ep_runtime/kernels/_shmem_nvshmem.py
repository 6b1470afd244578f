"""GPU backend of the SHMEM facade: nvshmem4py's Numba device API, re-exported.

Import :mod:`ep_runtime.kernels.shmem`, not this module. What nvshmem4py lacks is built here
from its low-level bindings: ``signal_fetch`` on an array, a bounded ``wait_signal_ge`` and a
``globaltimer_ns`` clock.
"""

import cffi
from llvmlite import ir
from numba import cuda, types, uint64
from numba.core.extending import intrinsic

import nvshmem.core.device.numba as _shd
from nvshmem.bindings.device.numba import fence, quiet
from nvshmem.bindings.device.numba import signal_fetch as _signal_fetch_ptr

put = _shd.put
put_nbi = _shd.put_nbi
put_warp = _shd.put_warp
put_nbi_warp = _shd.put_nbi_warp
put_block = _shd.put_block
put_nbi_block = _shd.put_nbi_block
put_signal = _shd.put_signal
put_signal_nbi = _shd.put_signal_nbi
put_signal_warp = _shd.put_signal_warp
put_signal_nbi_warp = _shd.put_signal_nbi_warp
put_signal_block = _shd.put_signal_block
put_signal_nbi_block = _shd.put_signal_nbi_block
signal_op = _shd.signal_op
signal_wait = _shd.signal_wait
atomic_add = _shd.atomic_add
atomic_set = _shd.atomic_set
atomic_fetch = _shd.atomic_fetch
atomic_fetch_add = _shd.atomic_fetch_add
atomic_compare_swap = _shd.atomic_compare_swap
atomic_inc = _shd.atomic_inc
atomic_fetch_inc = _shd.atomic_fetch_inc
my_pe = _shd.my_pe
n_pes = _shd.n_pes

_ffi = cffi.FFI()


@intrinsic
def globaltimer_ns(typingctx):
    """The GPU's global nanosecond timer (PTX ``%globaltimer``). Any thread."""
    sig = types.uint64()

    def codegen(context, builder, signature, args):
        fnty = ir.FunctionType(ir.IntType(64), [])
        asm = ir.InlineAsm(fnty, "mov.u64 $0, %globaltimer;", "=l", side_effect=True)
        return builder.call(asm, [])

    return sig, codegen


@cuda.jit(device=True)
def signal_fetch(sig):
    """Read ``sig[0]`` (uint64 symmetric signal) with NVSHMEM's signal-fetch semantics. One thread."""
    return _signal_fetch_ptr(_ffi.from_buffer(sig))


@intrinsic
def _load_acquire_u64(typingctx, sig):
    """``sig[0]`` (uint64 array) by ``ld.acquire.sys``: no later load or store of this thread is
    performed before it. One instruction, faster than a GPU-scope fence after a volatile load
    (measured: docs/plans.md)."""
    if not (isinstance(sig, types.Array) and sig.dtype == types.uint64):
        return None

    def codegen(context, builder, signature, args):
        ary = context.make_array(signature.args[0])(context, builder, args[0])
        fnty = ir.FunctionType(ir.IntType(64), [ary.data.type])
        asm = ir.InlineAsm(fnty, "ld.acquire.sys.global.u64 $0, [$1];", "=l,l,~{memory}", side_effect=True)
        return builder.call(asm, [ary.data])

    return types.uint64(sig), codegen


@cuda.jit(device=True)
def wait_signal_ge(sig, value, timeout_ns):
    """Poll ``sig[0]`` until it is >= ``value`` or ``timeout_ns`` passed (0: no limit).

    Returns the last observed value: the caller compares it with ``value`` to tell success
    from a timeout. One thread calls it. Every poll is an acquire load, so once the value is
    seen this thread's later loads see what the signaller published before it (the signaller
    fenced at system scope before the signal); a barrier after the wait extends that to the
    block or warp. No separate fence is needed (NVSHMEM's ``signal_wait_until`` polls with
    volatile loads and then fences).
    """
    want = uint64(value)
    seen = _load_acquire_u64(sig)
    if seen >= want:
        return seen
    start = globaltimer_ns()
    limit = uint64(timeout_ns)
    while seen < want:
        if limit > 0 and globaltimer_ns() - start > limit:
            break
        cuda.nanosleep(100)
        seen = _load_acquire_u64(sig)
    return seen


__all__ = [
    "put", "put_nbi", "put_warp", "put_nbi_warp", "put_block", "put_nbi_block",
    "put_signal", "put_signal_nbi", "put_signal_warp", "put_signal_nbi_warp",
    "put_signal_block", "put_signal_nbi_block", "signal_op", "signal_wait", "signal_fetch",
    "wait_signal_ge", "quiet", "fence", "atomic_add", "atomic_set", "atomic_fetch",
    "atomic_fetch_add", "atomic_compare_swap", "atomic_inc", "atomic_fetch_inc", "my_pe",
    "n_pes", "globaltimer_ns",
]
