"""Which compiler builds the kernels: numba-cuda or numba-cuda-mlir.

The kernels are written once, against :mod:`ep_runtime.kernels.cuda_api` (``cuda``, the scalar
types, ``kernel_jit``, ``inlined``), and decorated when their modules are imported. So the
compiler is fixed for a process when ``cuda_api`` is first imported:

- :func:`select` names it first (``python -m ep_runtime.tools.compile_gate --compiler
  numba-cuda-mlir`` does), before any kernel module is imported;
- otherwise it is the package that is installed: numba-cuda when it is (the pinned, tested
  compiler, and the only one with a CUDA simulator), else numba-cuda-mlir.

numba-cuda-mlir has no simulator: a process with ``NUMBA_ENABLE_CUDASIM`` set simulates with
numba-cuda. docs/compilers.md says what each compiler builds and what moving to
numba-cuda-mlir would take.
"""

from __future__ import annotations

import importlib.util
import os

from ep_runtime.core.errors import EPConfigError, EPStateError, MissingDependencyError

NUMBA_CUDA = "numba-cuda"
NUMBA_CUDA_MLIR = "numba-cuda-mlir"
#: Each compiler's importable module and how to install it.
COMPILERS = {
    NUMBA_CUDA: ("numba_cuda", 'pip install -e ".[sim]" (or ".[gpu]", ".[gpu-cu12]")'),
    NUMBA_CUDA_MLIR: ("numba_cuda_mlir", 'pip install -e ".[gpu-mlir]"'),
}

_selected: str | None = None
_bound: str | None = None


def installed(name: str) -> bool:
    """Whether compiler ``name``'s package can be imported here (imports nothing)."""
    module = COMPILERS[_known(name)][0]
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a finder that refuses it, or a half-imported module
        return False


def _known(name: str) -> str:
    if name not in COMPILERS:
        raise EPConfigError(f"compiler {name!r} is not one of {sorted(COMPILERS)}: name one of them")
    return name


def _simulating() -> bool:
    # numba's rule: an integer, unset, empty or 0 is off
    return os.environ.get("NUMBA_ENABLE_CUDASIM", "").strip() not in ("", "0")


def select(name: str) -> str:
    """Build this process's kernels with compiler ``name`` (``"numba-cuda"`` or
    ``"numba-cuda-mlir"``). Call it before the first kernel module is imported; selecting the
    compiler already bound again does nothing.

    Raises ``EPConfigError`` for an unknown name, ``MissingDependencyError`` for a compiler that
    is not installed (the message names the install command), and ``EPStateError`` once the
    kernels were imported with the other compiler."""
    global _selected
    _known(name)
    if _bound is not None and _bound != name:
        raise EPStateError(f"the kernels of this process are already built with {_bound}: select the "
                           f"compiler before importing any ep_runtime.kernels module (or start another process)")
    if not installed(name):
        raise MissingDependencyError(f"compiler {name!r} is not installed: {COMPILERS[name][1]}")
    _selected = name
    return name


def chosen() -> str:
    """The compiler this process builds with: the selected one, else the one installed
    (numba-cuda first). Raises ``MissingDependencyError`` when neither is installed."""
    if _bound is not None:
        return _bound
    if _selected is not None:
        return _selected
    for name in (NUMBA_CUDA, NUMBA_CUDA_MLIR):
        if installed(name):
            return name
    raise MissingDependencyError("no kernel compiler is installed: "
                                 + "; or ".join(hint for _, hint in COMPILERS.values()))


def bind() -> str:
    """Fix this process's compiler (called by :mod:`ep_runtime.kernels.cuda_api` at import) and
    return it. Raises ``EPConfigError`` when numba-cuda-mlir is chosen under the simulator."""
    global _bound
    name = chosen()
    if name == NUMBA_CUDA_MLIR and _simulating():
        raise EPConfigError("NUMBA_ENABLE_CUDASIM is set, and numba-cuda-mlir has no simulator: unset it to "
                            "build with numba-cuda-mlir, or select numba-cuda to simulate")
    _bound = name
    return name


__all__ = ["NUMBA_CUDA", "NUMBA_CUDA_MLIR", "COMPILERS", "installed", "select", "chosen", "bind"]
