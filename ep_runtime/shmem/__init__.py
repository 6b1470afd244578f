"""Host side of the SHMEM layer: sessions (``nvshmem`` on GPUs, ``sim`` on a CPU) and launchers.

- :func:`open_session` opens this process's session over the job's group: an mpi4py
  communicator (``mpirun``) or a torch.distributed process group (``torchrun``); collective.
- :func:`session_for` does so once per process and returns that session again for the same group.
- :func:`ep_runtime.shmem.launch.run_pes` runs a function on N simulated PEs as processes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ep_runtime.core.errors import EPInputError, EPStateError
from ep_runtime.shmem.session import Session

#: Symmetric heap per PE when none is asked for.
DEFAULT_SESSION_HEAP_BYTES = 1 << 30


def open_session(backend: str = "auto", heap_bytes: int = DEFAULT_SESSION_HEAP_BYTES, comm=None,
                 group=None, logical_nodes: int | None = None) -> Session:
    """Collective over the group: this process's session, one PE per member of the job's group.

    Parameters
    ----------
    backend : ``"nvshmem"`` (GPUs), ``"sim"`` (CPU simulator, needs NUMBA_ENABLE_CUDASIM=1
        before Numba is imported), or ``"auto"`` (nvshmem if a GPU is visible).
    heap_bytes : symmetric heap per PE; use ``BufferLayout(cfg).symmetric_bytes``.
    comm : an mpi4py communicator (the job's, or a Split of it); the same as ``group=comm``.
    group : the processes of the session, as :func:`~ep_runtime.shmem.bootstrap.bootstrap_group`
        takes them: an mpi4py communicator, a torch.distributed ProcessGroup
        (``torch.distributed.group.WORLD`` or one from ``new_group``; on nccl each rank must have
        called ``torch.cuda.set_device``), a BootstrapGroup, or None (the job's group:
        MPI.COMM_WORLD under mpirun, else torch.distributed's default group). PE index = group
        rank. Its host collectives carry the bootstrap (NVSHMEM's unique id, the simulator's job
        id) and the session's ``allgather_object``.
    logical_nodes : a testing topology (``Session.use_logical_nodes``, collective, right after
        opening): the PEs split into this many nodes of consecutive PEs, peers of another one
        reached by NVSHMEM puts only, as across real nodes (e.g. 2 on a host of 4 GPUs: 2 x 2).

    One session per process: NVSHMEM is initialized once per process, and simulated kernels use
    their process's one current heap. :func:`session_for` keeps that session for its group.
    """
    if comm is not None and group is not None:
        raise EPInputError("open_session: pass comm= or group=, not both (comm is the older name of an mpi4py group)")
    group = comm if group is None else group
    if backend == "auto":
        backend = "nvshmem" if gpu_visible() else "sim"
    if backend == "nvshmem":
        require_gpu("open_session('nvshmem')")
        from ep_runtime.shmem.nvshmem_session import NvshmemSession

        session = NvshmemSession.open(heap_bytes, group)
    elif backend == "sim":
        from ep_runtime.shmem.launch import open_sim_session

        session = open_sim_session(group, heap_bytes)
    else:
        raise ValueError(f"backend must be 'auto', 'nvshmem' or 'sim'; got {backend!r}")
    if logical_nodes is not None:
        try:
            session.use_logical_nodes(logical_nodes)
        except Exception:
            session.close()  # collective: every PE raised the same checked error
            raise
    return session


@dataclass
class _HeldSession:
    """The session :func:`session_for` opened in this process and the group object it is for."""

    group: object
    session: Session


_held: _HeldSession | None = None


def session_for(group=None, heap_bytes: int = DEFAULT_SESSION_HEAP_BYTES, backend: str = "auto") -> Session:
    """This process's session over ``group``: opened at the first call (collective over the group,
    :func:`open_session`), the same object at later calls for the same group.

    Parameters
    ----------
    group : as :func:`open_session` takes it; the cache is keyed by the identity of the group object
        (None: the job's group, resolved to its object, e.g. ``torch.distributed.group.WORLD``).
    heap_bytes : symmetric heap per PE. The heap is fixed when the session opens (NVSHMEM sizes it
        at init), so the first call must ask for the most any later call needs: e.g. the largest
        ``BufferLayout(cfg).symmetric_bytes`` of the buffers the job will build
        (:func:`ep_runtime.integrations.torch.get_buffer` grows its runtime inside this heap). A later call
        asking for more raises.
    backend : as :func:`open_session`.

    Use the result with :func:`ep_runtime.integrations.torch.get_buffer` (one runtime per session, grown to fit)
    for Megatron-style ``get_buffer(group, ...)``. Do not open other sessions in this process.

    Raises
    ------
    EPInputError
        A session of another group is open in this process (one per process: close it first, on
        ``sim``), the held session is of another backend, or ``heap_bytes`` exceeds its heap.
    EPStateError
        The held ``nvshmem`` session was closed: NVSHMEM is not initialized twice in a process.
    """
    global _held
    from ep_runtime.shmem.bootstrap import bootstrap_group

    boot = bootstrap_group(group)
    if _held is not None and _held.session.closed and _held.session.backend == "sim":
        _held = None  # a closed simulated session leaves nothing behind: open another
    if _held is None:
        _held = _HeldSession(boot.group, open_session(backend, heap_bytes, group=boot))
        return _held.session
    session = _held.session
    if session.closed:
        raise EPStateError("session_for: this process's nvshmem session was closed, and NVSHMEM is initialized "
                           "once per process; keep the session open for the life of the job")
    if _held.group is not boot.group:
        raise EPInputError(f"session_for: this process already has a {session.backend} session over "
                           f"{session.bootstrap.describe()}; asked for one over {boot.describe()}. A process holds "
                           "one session (NVSHMEM initializes once per process; the simulator's kernels use one heap): "
                           "open it over the expert-parallel group, the same group object every time"
                           + (", or close it first" if session.backend == "sim" else ""))
    if backend not in ("auto", session.backend):
        raise EPInputError(f"session_for: backend={backend!r}, but this process's session over "
                           f"{boot.describe()} is {session.backend!r}")
    if heap_bytes > session.heap_bytes:
        raise EPInputError(f"session_for: heap_bytes={heap_bytes} exceeds the {session.heap_bytes} bytes per PE of "
                           f"this process's session over {boot.describe()}, fixed when it opened. Pass the largest "
                           "heap the job needs at the first session_for call (e.g. the largest "
                           "BufferLayout(cfg).symmetric_bytes of its buffers).")
    return session


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
    from ep_runtime.core.errors import GPUUnavailableError, MissingDependencyError

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


__all__ = ["DEFAULT_SESSION_HEAP_BYTES", "Session", "gpu_visible", "open_session", "require_gpu", "session_for"]
