"""The ``sim`` session: one PE of a job simulated on a CPU (Numba's CUDA simulator).

Device arrays of this backend are NumPy arrays: :meth:`SimSession.alloc_symmetric` returns
views of this PE's simulated heap (:mod:`ep_runtime.shmem.sim_heap`). The simulator copies
NumPy kernel arguments in and out, which would hide the heap from a kernel and, on copy-out,
overwrite what peers wrote meanwhile; :meth:`SimSession.as_kernel_arg` wraps an array in the
simulator's ``FakeCUDAArray`` instead (no copy), and :meth:`SimSession.launch` does so for
every array argument.

One process per PE: use :func:`ep_runtime.shmem.launch.run_pes` (tests) or
:func:`ep_runtime.shmem.launch.open_sim_session` (jobs under ``mpiexec`` or torchrun).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

from ep_runtime.core.errors import EPStateError, ShmemError
from ep_runtime.shmem import sim_block
from ep_runtime.shmem.session import Session
from ep_runtime.shmem.sim_heap import DEFAULT_HEAP_BYTES, SimHeap, set_current_heap

# The simulator runs one block at a time and reports max_cooperative_grid_blocks == 1, so one
# "SM" is the persistent grid that can never wait on a block that has not started.
SIM_SM_COUNT = 1


def _check_simulator_enabled() -> None:
    from numba.cuda import config

    if not config.ENABLE_CUDASIM:
        raise ShmemError(
            "the sim SHMEM backend runs kernels under Numba's CUDA simulator, which is off in "
            "this process: set NUMBA_ENABLE_CUDASIM=1 in the environment before numba is "
            "imported (run_pes does this for its PEs)")


def _ndarray(array) -> np.ndarray:
    """The ndarray behind a ``FakeCUDAArray``, or the ndarray itself."""
    return array._ary if isinstance(array, FakeCUDAArray) else np.asarray(array)


class SimSession(Session):
    """One PE of a simulated SHMEM job; see :class:`~ep_runtime.shmem.session.Session`.

    Open with :meth:`open`. Arrays from :meth:`alloc_symmetric` and :meth:`peer_view` stay
    valid (mapped) after :meth:`close`, but peers no longer see them.
    """

    backend = "sim"

    def __init__(self, heap: SimHeap, bootstrap=None):
        """Use :meth:`open`."""
        self.heap = heap
        self.rank = heap.rank
        self.n_ranks = heap.n_ranks
        self.heap_bytes = heap.heap_bytes
        #: the job's group the job id came over (a BootstrapGroup), or None (run_pes)
        self.bootstrap = bootstrap
        self._closed = False

    @classmethod
    def open(cls, rank: int, n_ranks: int, job: str, heap_bytes: int = DEFAULT_HEAP_BYTES,
             timeout_s: float = 60.0, bootstrap=None) -> SimSession:
        """Join job ``job`` as PE ``rank`` of ``n_ranks``. Collective.

        ``heap_bytes`` is each PE's symmetric heap (sparse /dev/shm file); ``timeout_s``
        bounds bring-up and every barrier. ``bootstrap``: the
        :class:`~ep_runtime.shmem.bootstrap.BootstrapGroup` that carried ``job``, if any (kept
        as :attr:`bootstrap`). Makes this session's heap the one simulated kernels of this
        process use. Raises :class:`ShmemError` if the CUDA simulator is off.
        """
        _check_simulator_enabled()
        sim_block.install()  # the simulator's blocks without its poller
        session = cls(SimHeap.open(rank, n_ranks, job, heap_bytes, timeout_s), bootstrap)
        set_current_heap(session.heap)
        return session

    # -- memory ---------------------------------------------------------------------------
    def alloc_symmetric(self, name: str, shape: tuple[int, ...], dtype: Any, fill: int | float = 0):
        """A C-contiguous ndarray view of this PE's heap, ``shape``/``dtype``, filled with
        ``fill``. Collective (ends with a barrier; checks that every PE allocated the same
        region)."""
        self._check_open("alloc_symmetric")
        return self.heap.alloc(name, shape, dtype, fill)

    def free_symmetric(self, array) -> None:
        """Free an array from :meth:`alloc_symmetric`. Collective, same order on every PE
        (checked); a view, a foreign array or a second free raises."""
        self._check_open("free_symmetric")
        self.heap.free(_ndarray(array))

    def alloc_local(self, name: str, shape: tuple[int, ...], dtype: Any, fill: int | float | None = 0):
        """A new ndarray of ``shape``/``dtype`` filled with ``fill``. Not collective.
        ``fill=None`` ("uninitialized") fills every byte with 0xA5, so an element a kernel
        should have written and did not shows up in tests as garbage, not as a lucky zero."""
        if fill is None:
            out = np.empty(shape, dtype=dtype)
            out.view(np.uint8)[...] = 0xA5
            return out
        return np.full(shape, fill, dtype=dtype)

    def fill(self, array, value) -> None:
        """Set every element of ``array`` (an ndarray or a heap view) to ``value``."""
        _ndarray(array)[...] = value

    def peer_view(self, array, pe: int):
        """PE ``pe``'s copy of the symmetric ``array`` (ndarray, same shape and strides).
        Stores into it are visible to PE ``pe`` at once. A PE on another (logical) node is
        refused (:meth:`use_logical_nodes`)."""
        self._check_same_node(pe, "peer_view")
        return self.heap.peer_view(_ndarray(array), pe)

    def traffic(self, reset: bool = False) -> np.ndarray:
        """``[n_ranks, 2]`` int64: the operations and bytes this PE's kernels put or signalled
        to each PE since the session opened (or the last ``reset``), its own included; stores
        through peer views are not counted. What the transport sends, measured on the
        simulator (tests, the traffic model in docs/cluster.md)."""
        out = self.heap.traffic.copy()
        if reset:
            self.heap.traffic[...] = 0
        return out

    def peers_mapped(self) -> bool:
        """Every PE's heap is mapped in every PE process, unless the session has logical nodes
        (collective the first time: :meth:`node_of`). Reported once: the topology is fixed from
        then on."""
        self._peers_mapped = not self.spans_nodes()
        return self._peers_mapped

    def _mapped_address(self, array, pe):
        """Every PE's heap is mapped in every PE process: the address of ``pe``'s mapping."""
        return int(self.heap.peer_view(_ndarray(array), pe).ctypes.data)

    # -- host/device transfer ---------------------------------------------------------------
    def to_device(self, host: np.ndarray):
        """A C-contiguous copy of ``host``."""
        return np.array(host, order="C", copy=True)

    def to_host(self, array) -> np.ndarray:
        """A copy of ``array``."""
        return np.array(_ndarray(array), copy=True)

    # -- kernels ----------------------------------------------------------------------------
    def as_kernel_arg(self, array):
        """``array`` wrapped in the simulator's ``FakeCUDAArray``: the kernel works on the
        array's memory (no copy in or out)."""
        return array if isinstance(array, FakeCUDAArray) else FakeCUDAArray(np.asarray(array))

    def launch(self, kernel, grid: int, block: int, args: tuple) -> None:
        """Run ``kernel[grid, block](*args)`` to completion; array arguments are passed with
        :meth:`as_kernel_arg` (no copy)."""
        kernel[grid, block](*[self.as_kernel_arg(a) if isinstance(a, np.ndarray) and a.ndim
                              else a for a in args])

    def precompile(self, kernel, argtypes: tuple) -> None:
        """Nothing to compile: the simulator runs the kernel's Python source."""

    def sm_count(self) -> int:
        """:data:`SIM_SM_COUNT`."""
        return SIM_SM_COUNT

    # -- ordering ---------------------------------------------------------------------------
    @property
    def stream(self):
        """``0``: the simulator has no streams (a launch returns when the kernel finished)."""
        return 0

    def synchronize(self) -> None:
        """Nothing to wait for: simulated launches are synchronous."""

    def barrier(self) -> None:
        """Deliver this PE's queued puts, then wait for every PE. Collective."""
        self._check_open("barrier")
        self.heap.deliver_puts()
        self.heap.barrier("Session.barrier")

    def stream_barrier(self) -> None:
        """:meth:`barrier` (the simulator has no streams: everything before it has run)."""
        self.barrier()

    def allgather_object(self, obj) -> list:
        """Every PE's picklable ``obj`` in rank order. Collective; host-side only (like an
        MPI allgather it does not deliver queued puts)."""
        self._check_open("allgather_object")
        return self.heap.allgather(obj)

    # -- lifetime ---------------------------------------------------------------------------
    def close(self) -> None:
        """Deliver queued puts, final barrier, remove this PE's /dev/shm files. Collective,
        idempotent."""
        if self._closed:
            return
        self._closed = True
        self.heap.close()

    def _check_open(self, op: str) -> None:
        if self._closed:
            raise EPStateError(f"PE {self.rank}: {op} on a closed SimSession (job {self.heap.job})")
