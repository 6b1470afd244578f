"""The host-side SHMEM session: one interface, two backends.

A :class:`Session` is one processing element (PE, a rank) of a job. It owns the symmetric
heap of this PE and the stream the runtime orders its kernels on. Two backends implement
it:

- ``nvshmem`` (:mod:`ep_runtime.shmem.nvshmem_session`): CuPy arrays from
  ``nvshmem.core.array`` on the NVSHMEM symmetric heap, bring-up under mpirun;
- ``sim`` (:mod:`ep_runtime.shmem.sim_session`): NumPy arrays wrapping a simulated heap in
  /dev/shm shared by one OS process per PE, for Numba's CUDA simulator on a CPU.

Collective calls (every PE must make them, in the same order, with the same arguments):
``alloc_symmetric``, ``free_symmetric``, ``barrier``, ``close``.
"""

from __future__ import annotations

import abc
import socket
from typing import Any

import numpy as np

from ep_runtime.core.errors import EPInputError
from ep_runtime.shmem.nodes import logical_nodes, nodes_of_hosts


class Session(abc.ABC):
    """One PE of a SHMEM job.

    Attributes
    ----------
    backend : str
        ``"nvshmem"`` or ``"sim"``.
    rank : int
        This PE's index in ``[0, n_ranks)``.
    n_ranks : int
        Number of PEs in the job.
    heap_bytes : int
        The symmetric heap per PE asked for at opening (allocations may use this much).
    bootstrap : BootstrapGroup or None
        The job's group the session bootstrapped over (:mod:`ep_runtime.shmem.bootstrap`);
        None for PEs started by :func:`~ep_runtime.shmem.launch.run_pes`.
    """

    backend: str
    rank: int
    n_ranks: int
    heap_bytes: int
    bootstrap: Any

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    # -- memory ---------------------------------------------------------------------------
    @abc.abstractmethod
    def alloc_symmetric(self, name: str, shape: tuple[int, ...], dtype: Any, fill: int | float = 0):
        """Allocate ``shape``/``dtype`` on the symmetric heap, filled with ``fill``.

        Collective: every PE calls it in the same order with the same shape and dtype, so the
        same heap offset names the same object on every PE. ``name`` is used in error
        messages (a timed-out wait names the region it waited on). Returns a device array
        (CuPy on ``nvshmem``, a NumPy view of the heap on ``sim``), C-contiguous.
        """

    @abc.abstractmethod
    def free_symmetric(self, array) -> None:
        """Free an array from :meth:`alloc_symmetric`. Collective, same order on every PE."""

    @abc.abstractmethod
    def alloc_local(self, name: str, shape: tuple[int, ...], dtype: Any, fill: int | float | None = 0):
        """Allocate device-local (not symmetric) memory, filled with ``fill`` (``None``: left
        uninitialized, for outputs a kernel writes whole). Not collective."""

    @abc.abstractmethod
    def fill(self, array, value) -> None:
        """Set every element of a device array to ``value``, ordered on :attr:`stream`."""

    @abc.abstractmethod
    def peer_view(self, array, pe: int):
        """A view of PE ``pe``'s copy of the symmetric ``array`` that kernels can store into
        directly (NVLink peers on ``nvshmem``; the peer's mapping on ``sim``).

        Stores through a peer view are plain stores: every storing thread fences at system
        scope (``cuda.threadfence_system()``), then a barrier, then the signal that publishes
        them (see ``ep_runtime/kernels/selftest.py``, ``ring_peer_store_signal``).
        """

    def peers_mapped(self) -> bool:
        """Collective: whether every PE's symmetric heap is mapped into this process (the kernels
        can store into peers: NVLink), probed once on a small symmetric allocation. False when
        the PEs are on more than one node (:meth:`node_of`), logical ones included."""
        if getattr(self, "_peers_mapped", None) is None:
            probe = self.alloc_symmetric("ep_runtime.peer_probe", (256,), "uint8")
            try:
                self._peers_mapped = self.peer_addresses(probe) is not None
            finally:
                self.free_symmetric(probe)
        return self._peers_mapped

    # -- nodes --------------------------------------------------------------------------------
    def node_of(self) -> tuple[int, ...]:
        """Every PE's node (index: PE; nodes numbered in the order of their first PE; see
        :mod:`ep_runtime.shmem.nodes`): from the PEs' host names, or the logical nodes of
        :meth:`use_logical_nodes`. Collective the first time (an allgather of host names), then
        cached."""
        if getattr(self, "_node_of", None) is None:
            self._node_of = nodes_of_hosts(self.allgather_object(socket.gethostname()))
        return self._node_of

    def use_logical_nodes(self, n_nodes: int) -> None:
        """Collective, before any runtime is built on this session: a testing topology of
        ``n_nodes`` logical nodes of consecutive PEs, each inside one real node. Peers in another
        logical node are then not mapped (:meth:`peer_addresses` is None, :meth:`peer_view`
        refuses them), so the kernels reach them through NVSHMEM puts only, as across real
        nodes. Raises EPInputError, changing nothing, when ``n_nodes`` does not divide the PEs,
        when a logical node would span real nodes, when PEs pass different counts, or after the
        session reported its peer mappings."""
        if getattr(self, "_peers_mapped", None) is not None:
            raise EPInputError("use_logical_nodes: this session already reported its peer mappings (a runtime was "
                               "built on it); call use_logical_nodes right after opening the session.")
        asked = self.allgather_object(n_nodes)
        if len(set(map(repr, asked))) > 1:
            raise EPInputError(f"use_logical_nodes: the PEs asked for different node counts {asked} (index: PE); "
                               f"every PE passes the same n_nodes.")
        self._node_of = logical_nodes(self.node_of(), n_nodes)

    def spans_nodes(self) -> bool:
        """Whether the PEs are on more than one node (:meth:`node_of`). Collective the first time."""
        return len(set(self.node_of())) > 1

    def _check_same_node(self, pe: int, op: str) -> None:
        """Refuse a peer view of a PE on another node (it is reached by puts only), once the node
        map is known (never collective: a session without logical nodes leaves the rest to the
        backend, whose mapping of another node's PE fails anyway)."""
        node_of = getattr(self, "_node_of", None)
        if node_of is not None and node_of[pe] != node_of[self.rank]:
            raise EPInputError(f"{op}: PE {pe} is on node {node_of[pe]}, this PE ({self.rank}) on node "
                               f"{node_of[self.rank]}; a peer on another node (logical ones included) has no "
                               f"load/store mapping here: reach it with NVSHMEM puts.")

    def pdl_capable(self) -> bool:
        """Whether kernels may be launched with programmatic dependent launch here (compute
        capability 9.0 or later and a launcher that sets its attribute). False by default."""
        return False

    def peer_addresses(self, array) -> list[int] | None:
        """The address of every PE's copy of the symmetric allocation ``array`` (as
        :meth:`alloc_symmetric` returned it: NVSHMEM tracks allocations, not views of them) as
        mapped in this process (index: PE; this PE's own copy included), for kernels that store
        into peers' copies through pointers; None when some PE's copy is not mapped here (no
        NVLink path, or PEs on several nodes, logical ones included: :meth:`node_of`, collective
        the first time). A region at byte offset o of the allocation is at address + o on every
        PE. Publish such stores as :meth:`peer_view` says."""
        if self.spans_nodes():  # real or logical nodes: peers of another node are reached by puts only
            return None
        return self.node_peer_addresses(array)

    def node_peer_addresses(self, array) -> list[int] | None:
        """As :meth:`peer_addresses` for the PEs of this PE's node (:meth:`node_of`, collective
        the first time), 0 for every other PE: what the hierarchical transport stores through
        within a node. None when some PE of this node is not mapped here."""
        node_of = self.node_of()
        out = []
        for pe in range(self.n_ranks):
            if node_of[pe] != node_of[self.rank]:
                out.append(0)
                continue
            address = self._mapped_address(array, pe)
            if address is None:
                return None
            out.append(address)
        return out

    def node_peers_mapped(self) -> bool:
        """Collective: whether every PE maps the heaps of every PE of its node
        (:meth:`node_peer_addresses`), probed once on a small symmetric allocation; the answer
        is every PE's (all or none store within their nodes)."""
        if getattr(self, "_node_peers_mapped", None) is None:
            probe = self.alloc_symmetric("ep_runtime.node_probe", (256,), "uint8")
            try:
                mapped = self.node_peer_addresses(probe) is not None
            finally:
                self.free_symmetric(probe)
            self._node_peers_mapped = all(self.allgather_object(mapped))
        return self._node_peers_mapped

    @abc.abstractmethod
    def _mapped_address(self, array, pe: int) -> int | None:
        """The address of PE ``pe``'s copy of the symmetric allocation ``array`` as mapped in
        this process, or None when it is not mapped here (``pe`` on this PE's node)."""

    # -- host/device transfer ---------------------------------------------------------------
    @abc.abstractmethod
    def to_device(self, host: np.ndarray):
        """Copy a host NumPy array to a new device-local array (ordered on :attr:`stream`)."""

    @abc.abstractmethod
    def to_host(self, array) -> np.ndarray:
        """Copy a device array to a new NumPy array; synchronizes :attr:`stream`."""

    # -- kernels ----------------------------------------------------------------------------
    @abc.abstractmethod
    def as_kernel_arg(self, array):
        """``array`` as a kernel argument that shares its memory (no copy in or out): a Numba
        device array on ``nvshmem``, a simulator FakeCUDAArray on ``sim``."""

    @abc.abstractmethod
    def launch(self, kernel, grid: int, block: int, args: tuple) -> None:
        """Enqueue ``kernel[grid, block]`` on :attr:`stream` (runs to completion on ``sim``).
        ``args``: scalars, kernel args (:meth:`as_kernel_arg`) or the backend's own arrays
        (CuPy / NumPy), which the session passes without a per-call wrapper where it can."""

    @abc.abstractmethod
    def precompile(self, kernel, argtypes: tuple) -> None:
        """Compile ``kernel`` for ``argtypes`` now (a no-op on ``sim``), so no first launch
        compiles while a peer waits for it."""

    @abc.abstractmethod
    def sm_count(self) -> int:
        """Streaming multiprocessors of this PE's GPU (the default persistent grid size)."""

    # -- ordering ---------------------------------------------------------------------------
    @property
    @abc.abstractmethod
    def stream(self):
        """The stream kernels are launched on (a CuPy stream; ``0`` on ``sim``)."""

    @abc.abstractmethod
    def synchronize(self) -> None:
        """Wait until everything issued on :attr:`stream` finished."""

    @abc.abstractmethod
    def barrier(self) -> None:
        """Collective: all PEs' prior work on their streams is complete and their puts are
        delivered before any PE returns."""

    @abc.abstractmethod
    def stream_barrier(self) -> None:
        """Collective: enqueue a barrier of all PEs on :attr:`stream` and return at once (the
        host does not wait): work enqueued after it starts on each PE's GPU once every PE's
        stream reached it (their prior puts delivered). Synchronous on ``sim``."""

    @abc.abstractmethod
    def allgather_object(self, obj) -> list:
        """Collective: every PE's ``obj`` (picklable), in rank order (host-side, for
        construction-time checks such as configs that differ between ranks)."""

    # -- lifetime ---------------------------------------------------------------------------
    @abc.abstractmethod
    def close(self) -> None:
        """Collective: free what is left and leave the job. Idempotent."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False
