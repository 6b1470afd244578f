"""The device-side SHMEM facade: the only way kernels reach SHMEM.

Kernels write ``from ep_runtime.kernels import shmem`` and call ``shmem.put_nbi_block(...)``.
On a GPU the names below are nvshmem4py's Numba device API (``nvshmem.core.device.numba``,
with ``quiet``/``fence`` from ``nvshmem.bindings.device.numba``; its ``numba_cuda_mlir`` modules
when the kernels build with numba-cuda-mlir: :mod:`ep_runtime.kernels._shmem_nvshmem_mlir`); under
``NUMBA_ENABLE_CUDASIM=1`` they are Python implementations over the simulated symmetric heap
(:mod:`ep_runtime.kernels._shmem_sim`) with the same names, argument order and semantics.

Argument order is NVSHMEM's: **destination first**.

=====================================  ==============================================  ==========================
operation                              arguments                                       threads that call together
=====================================  ==============================================  ==========================
put, put_nbi                           (dst, src, pe)                                  one thread
put_warp, put_nbi_warp                 (dst, src, pe)                                  every lane of the warp, same args
put_block, put_nbi_block               (dst, src, pe)                                  every thread of the block
put_signal, put_signal_nbi             (dst, src, sig, value, sig_op, pe)              one thread
put_signal{,_nbi}_warp / _block        (dst, src, sig, value, sig_op, pe)              warp / block, same args
signal_op                              (sig, value, sig_op, pe)                        one thread
signal_wait                            (sig, cmp, value) -> observed                   one thread (unbounded)
signal_fetch                           (sig) -> value                                  one thread
wait_signal_ge                         (sig, value, timeout_ns) -> observed            one thread (bounded)
quiet, fence                           ()                                              one thread
atomic_add, atomic_set                 (dst, value, pe)                                one thread
atomic_fetch_add                       (dst, value, pe) -> old                         one thread
atomic_fetch                           (dst, pe) -> value                              one thread
atomic_compare_swap                    (dst, cond, value, pe) -> old                   one thread
atomic_inc / atomic_fetch_inc          (dst, pe) [-> old]                              one thread
my_pe, n_pes                           () -> int                                       any thread
globaltimer_ns                         () -> uint64 nanoseconds                        any thread
=====================================  ==============================================  ==========================

Arrays must be C-contiguous; a put moves ``min(dst.size, src.size)`` elements. ``dst`` (and
``sig``) must lie on the symmetric heap; ``src`` may be any device memory. Signal arrays are
``uint64``; pass a one-element slice ``sig[i:i + 1]``. NVSHMEM has no bfloat16 overload: move
bf16 as ``uint16``.

Ordering: ``put_signal*`` delivers its data before its signal. Plain and ``_nbi`` puts are
complete (delivered) only after ``quiet()``; ``fence()`` orders them before later puts and
signals to the same PE. A ``signal_op`` is *not* ordered after earlier puts without a fence.
Direct stores into an NVLink peer's copy go through host-made peer views
(:meth:`ep_runtime.shmem.session.Session.peer_view`) passed as kernel arguments; publish them with
a barrier of the storing threads, then one thread's system fence (``cuda.threadfence_system()``,
or ``quiet()``, which fences on NVLink; cumulative over what the barrier ordered) and the
signal. The reader's ``wait_signal_ge`` polls with acquire loads; a barrier after it extends
the ordering to its block or warp (no fence on the reading side).

Constants: ``SIGNAL_SET``, ``SIGNAL_ADD``; ``CMP_EQ``, ``CMP_NE``, ``CMP_GT``, ``CMP_LE``,
``CMP_LT``, ``CMP_GE`` (NVSHMEM's values).
"""

from ep_runtime.kernels.cuda_api import MLIR, SIMULATED

SIGNAL_SET = 9
SIGNAL_ADD = 10
CMP_EQ, CMP_NE, CMP_GT, CMP_LE, CMP_LT, CMP_GE = 0, 1, 2, 3, 4, 5

if SIMULATED:
    from ep_runtime.kernels._shmem_sim import *  # noqa: F401,F403
    from ep_runtime.kernels._shmem_sim import __all__ as _names
elif MLIR:
    from ep_runtime.kernels._shmem_nvshmem_mlir import *  # noqa: F401,F403
    from ep_runtime.kernels._shmem_nvshmem_mlir import __all__ as _names
    # nvshmem4py's bindings for numba-cuda-mlir take NVSHMEM's enums (same values), not integers
    from ep_runtime.kernels._shmem_nvshmem_mlir import (CMP_EQ, CMP_GE, CMP_GT, CMP_LE, CMP_LT, CMP_NE,  # noqa: F811
                                                        SIGNAL_ADD, SIGNAL_SET)
else:
    from ep_runtime.kernels._shmem_nvshmem import *  # noqa: F401,F403
    from ep_runtime.kernels._shmem_nvshmem import __all__ as _names

__all__ = list(_names) + [
    "SIGNAL_SET", "SIGNAL_ADD", "CMP_EQ", "CMP_NE", "CMP_GT", "CMP_LE", "CMP_LT", "CMP_GE",
    "SIMULATED",
]
