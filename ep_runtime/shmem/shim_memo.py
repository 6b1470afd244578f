"""One NVRTC compile of nvshmem4py's shim per process, not one per kernel.

Every kernel that calls NVSHMEM links nvshmem4py's shim: CUDA source that includes NVSHMEM's
device headers and wraps the functions the kernels call. numba-cuda's linker compiles it with
NVRTC at every kernel's link (``Linker.add_cu`` -> ``numba.cuda.cudadrv.nvrtc.compile``), and
that compile is most of a kernel's build on a CPU (docs/plans.md). The shim's source only
grows while new NVSHMEM functions are lowered, so the kernels of one process link the same
source again and again. :func:`install` memoizes ``nvrtc.compile`` by its arguments: the same
source, file name, target and options give the same PTX or LTO-IR, so a later link reuses the
first compile's object (read-only, like every object the linker is given).

:func:`install` is called before the project compiles a kernel (the runtime's sessions, the
kernel cache, prebuild and the compile gate); it is idempotent and process-wide. It relies on
numba-cuda 0.30.4's module layout (pinned in pyproject.toml, as the compile gate's other
internals are): where ``nvrtc.compile`` is missing, it does nothing.
"""

from __future__ import annotations

import functools
import threading

_lock = threading.Lock()
_installed = False


def memoize(compile_fn):
    """``compile_fn`` (``nvrtc.compile``'s signature: ``(src, name, cc, ltoir=False,
    lineinfo=False, debug=False) -> (object, log)``) with its results kept by argument. A
    failing compile raises each time and is not kept."""
    memo: dict = {}

    @functools.wraps(compile_fn)
    def compile(src, name, cc, ltoir=False, lineinfo=False, debug=False):
        key = (src, name, tuple(cc), bool(ltoir), bool(lineinfo), bool(debug))
        with _lock:
            hit = memo.get(key)
        if hit is None:
            hit = compile_fn(src, name, cc, ltoir=ltoir, lineinfo=lineinfo, debug=debug)
            with _lock:
                memo[key] = hit
        return hit

    compile.memo = memo
    return compile


def install() -> bool:
    """Memoize the NVRTC compile of the compiler the kernels build with (numba-cuda's, or the
    copy numba-cuda-mlir carries, ``numba_cuda_mlir.numba_cuda.cudadrv.nvrtc``, which its linker
    calls the same way) in this process (idempotent). Returns whether the memo is in place."""
    global _installed
    with _lock:
        if _installed:
            return True
        from ep_runtime.kernels.cuda_api import MLIR

        try:
            if MLIR:
                from numba_cuda_mlir.numba_cuda.cudadrv import nvrtc
            else:
                from numba.cuda.cudadrv import nvrtc
        except ImportError:
            return False
        if not callable(getattr(nvrtc, "compile", None)):
            return False
        nvrtc.compile = memoize(nvrtc.compile)
        _installed = True
        return True
