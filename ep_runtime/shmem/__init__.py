"""Host side of the SHMEM layer: sessions (``nvshmem`` on GPUs, ``sim`` on a CPU) and launchers.

- :func:`open_session` opens this process's session under ``mpirun`` (collective).
- :func:`ep_runtime.shmem.launch.run_pes` runs a function on N simulated PEs as processes.
"""

from __future__ import annotations

import os

from .session import Session


def open_session(backend: str = "auto", heap_bytes: int = 1 << 30, comm=None) -> Session:
    """Collective: this process's session in a job launched with ``mpirun``.

    Parameters
    ----------
    backend : ``"nvshmem"`` (GPUs), ``"sim"`` (CPU simulator, needs NUMBA_ENABLE_CUDASIM=1
        before Numba is imported), or ``"auto"`` (nvshmem if a GPU is visible).
    heap_bytes : symmetric heap per PE; use ``BufferLayout(cfg).symmetric_bytes``.
    comm : the mpi4py communicator of the job (default COMM_WORLD); nvshmem only.
    """
    if backend == "auto":
        backend = "nvshmem" if gpu_visible() else "sim"
    if backend == "nvshmem":
        require_gpu("open_session('nvshmem')")
        from .nvshmem_session import NvshmemSession

        return NvshmemSession.open(heap_bytes, comm)
    if backend == "sim":
        from .launch import open_sim_session_from_mpi

        return open_sim_session_from_mpi(heap_bytes)
    raise ValueError(f"backend must be 'auto', 'nvshmem' or 'sim'; got {backend!r}")


def gpu_visible() -> bool:
    """Whether CuPy is installed and sees at least one CUDA GPU (never raises)."""
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


_RUN_ON_A_CPU = ("To run on a CPU, use the simulator (pip install -e \".[sim]\"): python -m ep_runtime demo "
                 "--backend sim, run_pes(...) from ep_runtime.shmem.launch, or open_session('sim') in ranks "
                 "started with mpiexec and NUMBA_ENABLE_CUDASIM=1 (add \".[mpi]\" for mpiexec).")


def require_gpu(what: str) -> int:
    """The number of CUDA GPUs this process sees, checked before the ``nvshmem`` backend
    starts anything.

    Parameters
    ----------
    what : str
        The caller, named in the messages (e.g. ``"open_session('nvshmem')"``).

    Raises
    ------
    MissingDependencyError
        CuPy (part of the ``gpu`` extra) is not installed.
    GPUUnavailableError
        No CUDA driver, a driver too old for the CUDA runtime, or no GPU visible. The
        message names the simulator as the way to run on a CPU.
    """
    from ..errors import GPUUnavailableError, MissingDependencyError

    try:
        import cupy
    except ImportError as exc:
        raise MissingDependencyError(
            f"{what}: the nvshmem backend needs the GPU stack (CuPy, nvshmem4py, numba-cuda, mpi4py) "
            f"and {exc.name or 'cupy'} is not installed: pip install -e \".[gpu]\" on a machine with "
            f"NVIDIA GPUs. {_RUN_ON_A_CPU}") from exc
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except cupy.cuda.runtime.CUDARuntimeError as exc:
        raise GPUUnavailableError(
            f"{what}: no CUDA driver or GPU found: the CUDA runtime reports {exc} (no NVIDIA driver "
            "on this machine, one older than the CUDA 13 runtime, or no GPU visible). The nvshmem "
            f"backend runs on NVIDIA GPUs. {_RUN_ON_A_CPU}") from exc
    if count == 0:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        hint = f" (CUDA_VISIBLE_DEVICES={visible!r} hides them)" if visible is not None else ""
        raise GPUUnavailableError(f"{what}: the CUDA driver sees no GPU{hint}. The nvshmem backend runs on "
                                  f"NVIDIA GPUs. {_RUN_ON_A_CPU}")
    return count


__all__ = ["Session", "open_session", "gpu_visible", "require_gpu"]
