"""Host side of the SHMEM layer: sessions (``nvshmem`` on GPUs, ``sim`` on a CPU) and launchers.

- :func:`open_session` opens this process's session under ``mpirun`` (collective).
- :func:`ep_runtime.shmem.launch.run_pes` runs a function on N simulated PEs as processes.
"""

from __future__ import annotations

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
        from .nvshmem_session import NvshmemSession

        return NvshmemSession.open(heap_bytes, comm)
    if backend == "sim":
        from .launch import open_sim_session_from_mpi

        return open_sim_session_from_mpi(heap_bytes)
    raise ValueError(f"backend must be 'auto', 'nvshmem' or 'sim'; got {backend!r}")


def gpu_visible() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


__all__ = ["Session", "open_session", "gpu_visible"]
