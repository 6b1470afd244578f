"""``cuda`` for device code: numba.cuda on a GPU, a context-forwarding proxy in the simulator.

Kernel modules and device helpers write ``from ep_runtime.kernels.cuda_api import cuda``
instead of ``from numba import cuda``.

WAR: Numba's CUDA simulator makes ``cuda.threadIdx``, ``cuda.atomic``, ``cuda.shared`` ...
work by swapping every module global that *is* ``numba.cuda`` for the running kernel's fake
module when a kernel or device function is entered, and swapping it back on exit. A device
function in another module than its kernel, entered by many simulated threads at once, is
swapped back by the first thread to leave while the others still run, and they then find
the plain simulator module, which has no ``threadIdx`` or ``atomic``. The proxy below is not
``numba.cuda``, so nothing swaps it; it forwards to the running kernel's context (one kernel
per process in the simulator) and otherwise to numba.cuda (for ``jit``, ``local`` ...).
"""

from numba import cuda as _numba_cuda
from numba.cuda import config as _config

SIMULATED = bool(_config.ENABLE_CUDASIM)

if SIMULATED:
    from numba.cuda.simulator.kernel import _get_kernel_context

    class _SimulatedCuda:
        """Forwards attribute access to the running simulated kernel's fake ``cuda`` module."""

        def __getattr__(self, name):
            ctx = _get_kernel_context()
            if ctx is not None and hasattr(ctx, name):
                return getattr(ctx, name)
            return getattr(_numba_cuda, name)

    cuda = _SimulatedCuda()
else:
    cuda = _numba_cuda

__all__ = ["cuda", "SIMULATED"]
