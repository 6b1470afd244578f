"""GPU backend of the SHMEM facade for kernels built with numba-cuda-mlir: nvshmem4py's device
bindings for numba-cuda-mlir (``nvshmem.core.device.numba_cuda_mlir``, nvshmem4py's ``[mlir]``
extra), re-exported, with the same names and semantics as :mod:`ep_runtime.kernels._shmem_nvshmem`.

Import :mod:`ep_runtime.kernels.shmem`, not this module. The differences it hides:

- the signal operations and comparisons are NVSHMEM's enums (``SignalOp``, ``ComparisonType``:
  the bindings read their ``.value``), exported here under the facade's constant names;
- ``quiet``, ``fence`` and ``signal_fetch`` come from the low-level bindings
  (``nvshmem.bindings.device.numba_cuda_mlir``), as for numba-cuda;
- ``globaltimer_ns`` and the acquire load of ``wait_signal_ge`` are inline PTX
  (:mod:`ep_runtime.kernels.mlir_intrinsics`).
"""

import cffi

import nvshmem.core.device.numba_cuda_mlir as _shd
from nvshmem.bindings.device.numba_cuda_mlir import fence, quiet
from nvshmem.bindings.device.numba_cuda_mlir import signal_fetch as _signal_fetch_ptr
from nvshmem.core import ComparisonType, SignalOp

from ep_runtime.kernels.cuda_api import cuda, uint64
from ep_runtime.kernels.mlir_intrinsics import globaltimer_ns, load_acquire_u64

SIGNAL_SET = SignalOp.SIGNAL_SET
SIGNAL_ADD = SignalOp.SIGNAL_ADD
CMP_EQ, CMP_NE, CMP_GT = ComparisonType.CMP_EQ, ComparisonType.CMP_NE, ComparisonType.CMP_GT
CMP_LE, CMP_LT, CMP_GE = ComparisonType.CMP_LE, ComparisonType.CMP_LT, ComparisonType.CMP_GE

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


@cuda.jit(device=True)
def signal_fetch(sig):
    """Read ``sig[0]`` (uint64 symmetric signal) with NVSHMEM's signal-fetch semantics. One thread."""
    return _signal_fetch_ptr(_ffi.from_buffer(sig))


@cuda.jit(device=True)
def wait_signal_ge(sig, value, timeout_ns):
    """As :func:`ep_runtime.kernels._shmem_nvshmem.wait_signal_ge`: poll ``sig[0]`` with acquire
    loads until it is >= ``value`` or ``timeout_ns`` passed (0: no limit); returns the last
    value seen. One thread."""
    want = uint64(value)
    seen = load_acquire_u64(sig)
    if seen >= want:
        return seen
    start = globaltimer_ns()
    limit = uint64(timeout_ns)
    while seen < want:
        if limit > 0 and globaltimer_ns() - start > limit:
            break
        cuda.nanosleep(100)
        seen = load_acquire_u64(sig)
    return seen


__all__ = [
    "put", "put_nbi", "put_warp", "put_nbi_warp", "put_block", "put_nbi_block",
    "put_signal", "put_signal_nbi", "put_signal_warp", "put_signal_nbi_warp",
    "put_signal_block", "put_signal_nbi_block", "signal_op", "signal_wait", "signal_fetch",
    "wait_signal_ge", "quiet", "fence", "atomic_add", "atomic_set", "atomic_fetch",
    "atomic_fetch_add", "atomic_compare_swap", "atomic_inc", "atomic_fetch_inc", "my_pe",
    "n_pes", "globaltimer_ns",
]
