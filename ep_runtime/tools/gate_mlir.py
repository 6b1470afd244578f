"""The compile gate's builds with numba-cuda-mlir (``compile_gate --compiler numba-cuda-mlir``).

The same entries as with numba-cuda (the kernels build with numba-cuda-mlir once the process
selected it: :mod:`ep_runtime.kernels.compiler`), each compiled and linked by
``numba_cuda_mlir.cuda.compile_cubin`` for sm_90a: typing, MLIR lowering, NVVM, then nvJitLink
over the kernel and nvshmem4py's shim (compiled by NVRTC, memoized per process:
:mod:`ep_runtime.shmem.shim_memo`). The cubin is read as numba-cuda's is (registers, SASS
instructions, frame, NVSHMEM transfer routines, code digest), so the two compilers' reports
compare entry by entry (docs/plans.md, "numba-cuda-mlir").

Private numba-cuda-mlir API
---------------------------
``compile_cubin`` asks the CUDA driver for the host's compute capability even when the target
chip is given (``numba_cuda_mlir.tools.resolve_gpu_target``), and there is no driver here. The
answer is cached in ``numba_cuda_mlir.tools._cached_cc``; :func:`_fixed_compute_capability`
sets that cache while a build runs (``WAR:``). It exists in numba-cuda-mlir==0.6.0
(:data:`PINNED_NUMBA_CUDA_MLIR`). A kernel's ``shared_memory_carveout`` is left out of its build
(:func:`_without_carveout`): numba-cuda-mlir sets it through the driver once the cubin is built.
A build runs what ``compile_cubin`` runs (``numba_cuda_mlir.compiler._compile_and_optimize``) and
keeps the compile result, whose PTX after link-time optimization
(``numba_cuda_mlir.mlir_optimization.get_lto_ptx``, one more nvJitLink pass) the gate's atomics check
reads (:mod:`ep_runtime.tools.gate_atomics`).
"""

from __future__ import annotations

import contextlib
import importlib.util
import time

#: The numba-cuda-mlir release whose private API the patch below targets.
PINNED_NUMBA_CUDA_MLIR = "0.6.0"
#: Exception types (by module) that come from the link: NVRTC over the shim, nvJitLink.
_LINK_ERROR_MODULES = ("cuda.bindings.nvjitlink", "cuda.bindings.nvrtc", "cuda.core._linker")


def numba_cuda_mlir_version() -> str | None:
    """The installed numba-cuda-mlir's version, or None."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("numba-cuda-mlir")
    except PackageNotFoundError:
        return None


def bindings_installed() -> bool:
    """Whether nvshmem4py's device bindings for numba-cuda-mlir (its ``[mlir]`` extra) and cffi
    are present (files only: :func:`compile_gate.nvshmem_device_bindings_present`)."""
    from ep_runtime.tools import compile_gate as gate

    return gate.nvshmem_device_bindings_present("numba_cuda_mlir")


def missing() -> str | None:
    """What this environment lacks for a numba-cuda-mlir gate, with the fix; None if nothing."""
    if importlib.util.find_spec("numba_cuda_mlir") is None:
        return 'numba-cuda-mlir is not installed: pip install -e ".[gpu-mlir]"'
    if not bindings_installed():
        return ("nvshmem4py's device bindings for numba-cuda-mlir are not installed (need "
                "nvshmem4py-cu13[mlir] and cffi): pip install -e \".[gpu-mlir]\"")
    return None


@contextlib.contextmanager
def _fixed_compute_capability(cc: tuple):
    """Answer numba-cuda-mlir's host compute-capability question with ``cc[:2]`` while the
    ``with`` block runs (this process); the cached answer before is restored on exit."""
    from numba_cuda_mlir import tools

    # WAR: resolve_gpu_target calls get_gpu_compute_capability() (a driver context) even with
    # chip= given; it returns tools._cached_cc when set. With the host's cc equal to the
    # target's, the linker targets the chip, arch-specific "a" included, as on an H100/H200.
    saved = tools._cached_cc
    tools._cached_cc = tuple(cc[:2])
    try:
        yield
    finally:
        tools._cached_cc = saved


@contextlib.contextmanager
def _without_carveout(kernel):
    """``kernel`` without its ``shared_memory_carveout`` option while the ``with`` block runs."""
    options = getattr(kernel, "targetoptions", None)
    carveout = options.pop("shared_memory_carveout", None) if options is not None else None
    try:
        yield
    finally:
        if carveout is not None:
            options["shared_memory_carveout"] = carveout


def _stage(exc: Exception) -> str:
    """"link" for an error of NVRTC (the shim) or nvJitLink, else "compile"."""
    module = type(exc).__module__ or ""
    text = str(exc)
    if module.startswith(_LINK_ERROR_MODULES) or "nvJitLink" in text or "NVRTC" in text:
        return "link"
    return "compile"


def build(name: str, kernel, argtypes: tuple, target_cc: tuple):
    """Compile and link one entry to an sm_90a cubin; a :class:`compile_gate.CompileResult`
    (never raises for kernel errors: they come back as ``ok=False`` with the error text)."""
    # what cuda.compile_cubin runs, keeping the compile result for its PTX after link-time optimization
    from numba_cuda_mlir.compiler import _compile_and_optimize
    from numba_cuda_mlir.mlir_optimization import get_lto_ptx

    from ep_runtime.tools import compile_gate as gate, gate_atomics

    chip = "sm_%d%d%s" % target_cc
    start = time.perf_counter()
    try:
        # WAR: numba-cuda-mlir applies shared_memory_carveout as soon as a kernel is built, by loading
        # the cubin into the driver (cuFuncSetAttribute), and there is no driver here. The carveout is
        # an attribute of the loaded function, not of its code: the cubin is the same without it.
        with _fixed_compute_capability(target_cc), _without_carveout(kernel):
            cres = _compile_and_optimize(kernel, tuple(argtypes), {"chip": chip})
            data = bytes(cres.metadata["cubin"])
            if not data:
                raise RuntimeError("compile_cubin returned an empty cubin")
            ptx = get_lto_ptx(cres)
    except Exception as exc:  # noqa: BLE001 - every kernel error is a gate FAIL
        return gate._failure(name, _stage(exc), start, exc)
    misplaced = gate_atomics.global_atomics_on_shared(ptx)
    if misplaced:
        return gate.CompileResult(name, False, time.perf_counter() - start, len(data), stage="atomics",
                                  error=gate.ATOMICS_ERROR + "\n".join(misplaced))
    options = getattr(kernel, "targetoptions", {}) or {}
    return gate.CompileResult(name, True, time.perf_counter() - start, len(data), cooperative=None,
                              registers=gate.cubin_registers(data), max_registers=options.get("max_registers"),
                              instructions=gate.cubin_instructions(data), frame_bytes=gate.cubin_frame_bytes(data),
                              nvshmem_transfers=gate.cubin_nvshmem_transfers(data),
                              text_sha256=gate.cubin_text_sha256(data))


def run(entries, target_cc: tuple) -> list:
    """Build each ``(name, kernel, argtypes)`` entry in this process; results in entry order."""
    from ep_runtime.shmem import shim_memo

    shim_memo.install()
    return [build(name, kernel, argtypes, target_cc) for name, kernel, argtypes in entries]


__all__ = ["PINNED_NUMBA_CUDA_MLIR", "numba_cuda_mlir_version", "bindings_installed", "missing", "build", "run"]
