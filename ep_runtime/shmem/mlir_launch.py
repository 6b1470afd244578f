"""How the ``nvshmem`` session compiles and launches kernels built by numba-cuda-mlir.

numba-cuda-mlir (``ep_runtime.kernels.compiler``, docs/compilers.md) launches through its own
dispatcher, ``kernel[grid, block, stream](*args)``, as numba-cuda's does:

- **compile**: ``MLIRDispatcher.compile(argtypes)`` builds and links the kernel for the runtime's
  argument types (its types, from ``ep_runtime.kernels.cuda_api``) and keeps it as an overload;
  a launch whose arguments type the same reuses it;
- **arguments**: ``numba_cuda_mlir.cuda.as_cuda_array(array, sync=False)`` views a CuPy array
  (its ``__cuda_array_interface__``) as the compiler's device array, as numba-cuda's
  ``as_cuda_array`` does: the dispatcher then neither copies it nor synchronizes the stream
  the interface names (a synchronize would be an error inside a CUDA graph capture);
- **stream**: ``numba_cuda_mlir.cuda.external_stream(handle)`` of the session stream;
- **cooperative launch**: the dispatcher's, for builds whose NVSHMEM calls ask for it
  (nvshmem4py's bindings set ``use_cooperative`` on the build);
- **NVSHMEM in the loaded module**: nvshmem4py's shim carries a module set-up callback
  (``nvshmem.core.library_init``, the ``nvshmemx_cumodule_init`` numba-cuda's builds run); the
  build lists it and the dispatcher runs it when it loads the module, before the first launch.

What numba-cuda's path has and this one does not: the fast launcher
(:mod:`ep_runtime.shmem.fast_launch` packs numba-cuda's argument layout; numba-cuda-mlir passes an
array as an MLIR memref), hence no PDL attribute either (``Session.pdl_capable`` is False and the
plans build without PDL), and the on-disk kernel cache (:mod:`ep_runtime.shmem.kernel_cache`
stores numba-cuda's builds). Each process compiles its kernels.
"""

from __future__ import annotations

import logging
import warnings

import numpy as np

log = logging.getLogger("ep_runtime.shmem")

#: Why a numba-cuda-mlir process launches through the dispatcher and compiles every start (logged once
#: a session).
WHY_DISPATCHER = ("kernels built by numba-cuda-mlir launch through its dispatcher and are compiled in "
                  "this process: the fast launcher packs numba-cuda's argument layout, and the kernel "
                  "cache stores numba-cuda's builds")

#: Raised by the launch of an empty grid after the dispatcher has loaded the module.
_REFUSED_LAUNCH = "Failed to launch CUDA kernel"


def _cupy_empty(shape, dtype):
    import cupy

    return cupy.empty(shape, dtype=dtype)


def empty_args(argtypes: tuple, empty=None) -> list:
    """Arguments that type as ``argtypes`` (the runtime's: C-contiguous arrays and integer
    scalars, :func:`ep_runtime.core.kernel_args.argtypes`): an empty array of each array's dtype
    and dimensions (C-contiguous, as every empty array is; ``empty(shape, dtype=)`` makes it,
    default ``cupy.empty``), zero of each scalar's type (a NumPy scalar). Raises ``TypeError``
    naming the argument for any other type."""
    from ep_runtime.kernels.cuda_api import types

    empty = empty or _cupy_empty
    out = []
    for i, ty in enumerate(argtypes):
        if isinstance(ty, types.Array) and ty.layout == "C":
            out.append(empty((0,) * ty.ndim, dtype=np.dtype(str(ty.dtype))))
        elif isinstance(ty, types.Integer):
            out.append(np.dtype(str(ty)).type(0))
        else:
            raise TypeError(f"argument {i}: {ty!r} is neither a C-contiguous array nor an integer: the runtime's "
                            f"kernels take only those (ep_runtime.core.kernel_args.argtypes)")
    return out


def load_module(kernel, argtypes: tuple, stream, as_kernel_arg) -> None:
    """Load ``kernel``'s build for ``argtypes`` into this process's context now, with NVSHMEM's
    module set-up, as numba-cuda's path does when it precompiles.

    WAR: numba-cuda-mlir 0.6.0's dispatcher loads a build's module (and runs its set-up callbacks)
    at the first launch of those argument types, and has no call that loads it earlier. A first
    launch inside a CUDA graph capture would load it there, and NVSHMEM's module set-up copies its
    device state into the module synchronously, which a capture does not allow. So a launch of an
    empty grid with arguments of the same types: the dispatcher picks the build and loads its
    module, and the driver refuses the grid (nothing runs); that refusal is expected here, any
    other error is raised. ``stream``: the session's (the compiler's stream object);
    ``as_kernel_arg``: the session's, for the empty arrays. Call it once per build (a loaded
    build loads nothing more).

    That the dispatcher loads the module before the driver refuses the grid is read from its C++
    launcher's source (``launch``: compile, ``cuLibraryLoadData``, the post-load callback, then
    ``cuLaunchKernel``; the loaded kernel is kept per argument dtypes and dimensions, so the real
    launches reuse it), not seen on a GPU: for a build with set-up callbacks the dispatcher records
    the module it loads in the context (private API of numba-cuda-mlir 0.6.0), and a build that
    loaded none is logged as a warning, so a GPU run tells."""
    from numba_cuda_mlir.numba_cuda.cudadrv import devices

    name = getattr(getattr(kernel, "py_func", kernel), "__qualname__", repr(kernel))
    modules = devices.get_context().modules
    before = len(modules)
    args = [a if isinstance(a, np.generic) else as_kernel_arg(a) for a in empty_args(argtypes)]
    try:
        with warnings.catch_warnings():  # the dispatcher's low-occupancy warning, about this empty grid
            warnings.filterwarnings("ignore", message="Grid size 0 ")
            kernel[(0, 1, 1), (1, 1, 1), stream](*args)
    except Exception as exc:  # noqa: BLE001 - the refusal's class is cuda.core's CUDAError
        if _REFUSED_LAUNCH not in str(exc):
            raise
        log.debug("%s: empty grid refused: %s", name, exc)
    if kernel._module_setup_callbacks and len(modules) == before:
        log.warning("%s: the launch of an empty grid loaded no module: its first launch will load it and run "
                    "NVSHMEM's module set-up, which a CUDA graph capture does not allow", name)


__all__ = ["WHY_DISPATCHER", "empty_args", "load_module"]
