"""The job's own process group as the bootstrap of a SHMEM session: mpi4py or torch.distributed.

A session needs a few host collectives before its transport exists: rank and size, the rank
among the processes of this node (it picks the GPU), one broadcast (NVSHMEM's unique id, or
the simulator's job id) and, later, construction-time checks (``allgather_object``) and
barriers. A job started with ``mpirun`` already has a communicator, and one started with
``torchrun`` a process group: :func:`bootstrap_group` wraps either as a
:class:`BootstrapGroup`, so opening a session needs no other setup.

Every method of a :class:`BootstrapGroup` except the ``rank``/``size`` attributes is
collective over its group: every member calls it, in the same order, with the same ``root``.
Neither mpi4py nor torch is imported unless the group passed (or found) is theirs.
"""

from __future__ import annotations

import abc
import functools
import os
import socket
import sys

import numpy as np

from ep_runtime.core.errors import EPInputError

#: What :func:`bootstrap_group` accepts, for its error message.
ACCEPTED = ("None (the job's group: mpi4py's COMM_WORLD under an MPI launcher, else torch.distributed's default "
            "group once init_process_group ran), an mpi4py intracommunicator (MPI.COMM_WORLD, or one from "
            "Split/Create), a torch.distributed ProcessGroup (torch.distributed.group.WORLD, or one from new_group) "
            "of which this process is a member, or a BootstrapGroup")


def local_rank_among(hosts: list[str], rank: int) -> int:
    """The local rank of member ``rank`` given every member's host name (``hosts[r]``, in group rank
    order): how many members before it run on its host."""
    return sum(1 for host in hosts[:rank] if host == hosts[rank])


class BootstrapGroup(abc.ABC):
    """The processes of a job as a session bootstraps over them.

    Attributes
    ----------
    kind : str
        ``"mpi4py communicator"`` or ``"torch.distributed group"``.
    group : object
        The wrapped communicator or process group (its identity keys
        :func:`ep_runtime.shmem.session_for`'s cache).
    rank : int
        This process's rank in the group, ``[0, size)``: the PE index of a session opened over it.
    size : int
        Number of processes in the group: the PEs of a session opened over it.
    """

    kind: str
    group: object
    rank: int
    size: int

    @functools.cached_property
    def local_rank(self) -> int:
        """This process's rank among the group's processes on this node (``[0, ranks on the node)``,
        in group rank order). Collective the first time it is read (see the subclass), then cached."""
        return self._local_rank()

    @abc.abstractmethod
    def _local_rank(self) -> int:
        """Compute :attr:`local_rank` (collective)."""

    @abc.abstractmethod
    def broadcast_bytes(self, buf: np.ndarray, root: int = 0) -> None:
        """Collective: overwrite ``buf`` on every member with its contents on member ``root``.

        ``buf``: a writable, C-contiguous NumPy array (e.g. ``[n]`` int8 bytes), of the same size on
        every member; it is updated in place.
        """

    @abc.abstractmethod
    def allgather_object(self, obj) -> list:
        """Collective: every member's picklable ``obj``, in group rank order (host side)."""

    @abc.abstractmethod
    def barrier(self) -> None:
        """Collective: returns once every member has called it (host side)."""

    def describe(self) -> str:
        """What the group is and this process's place in it, for messages."""
        return f"{self.kind} {_name(self.group)} (rank {self.rank} of {self.size})"

    @staticmethod
    def _check_buffer(buf, root: int, size: int) -> np.ndarray:
        if not isinstance(buf, np.ndarray) or not buf.flags.c_contiguous or not buf.flags.writeable:
            raise EPInputError(f"broadcast_bytes: buf must be a writable, C-contiguous NumPy array; got "
                               f"{_name(buf)}")
        if not 0 <= root < size:
            raise EPInputError(f"broadcast_bytes: root={root} is not a rank of a group of {size}")
        return buf.reshape(-1).view(np.uint8)


class MpiBootstrap(BootstrapGroup):
    """An mpi4py intracommunicator. :attr:`local_rank` comes from
    ``Split_type(COMM_TYPE_SHARED)`` (collective over the communicator)."""

    kind = "mpi4py communicator"

    def __init__(self, comm):
        self.group = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()

    def _local_rank(self) -> int:
        from mpi4py import MPI

        node = self.group.Split_type(MPI.COMM_TYPE_SHARED)
        try:
            return node.Get_rank()
        finally:
            node.Free()

    def broadcast_bytes(self, buf: np.ndarray, root: int = 0) -> None:
        self.group.Bcast(self._check_buffer(buf, root, self.size), root=root)

    def allgather_object(self, obj) -> list:
        return self.group.allgather(obj)

    def barrier(self) -> None:
        self.group.Barrier()


class TorchBootstrap(BootstrapGroup):
    """A torch.distributed ProcessGroup (gloo, nccl, or a CPU and a CUDA backend together).

    Collectives go through torch's object collectives (``broadcast_object_list``,
    ``all_gather_object``), which pick the device the backend needs: on an nccl group that is
    ``torch.cuda.current_device()``, so each rank must have called ``torch.cuda.set_device`` (its
    own GPU) first, as torchrun jobs do. :attr:`local_rank` is ``LOCAL_RANK`` (set by torchrun) for
    the default group, and otherwise counted from every member's host name (an
    ``all_gather_object``, collective over the group).
    """

    kind = "torch.distributed group"

    def __init__(self, group):
        import torch.distributed as dist

        self._dist = dist
        self.group = group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        if self.rank < 0:
            raise EPInputError(f"bootstrap_group: this process (global rank {dist.get_rank()}) is not a member of "
                               f"the torch.distributed group {_name(group)}; open a session only on its members")

    def _local_rank(self) -> int:
        if self.group is self._dist.GroupMember.WORLD and "LOCAL_RANK" in os.environ:
            return int(os.environ["LOCAL_RANK"])
        return local_rank_among(self.allgather_object(socket.gethostname()), self.rank)

    def broadcast_bytes(self, buf: np.ndarray, root: int = 0) -> None:
        data = self._check_buffer(buf, root, self.size)
        box = [data.tobytes() if self.rank == root else None]
        self._dist.broadcast_object_list(box, src=self._dist.get_global_rank(self.group, root), group=self.group)
        if len(box[0]) != data.nbytes:
            raise EPInputError(f"broadcast_bytes: rank {root} sent {len(box[0])} bytes into a buffer of "
                               f"{data.nbytes} on rank {self.rank}: buf must have the same size on every member")
        data[...] = np.frombuffer(box[0], np.uint8)

    def allgather_object(self, obj) -> list:
        out = [None] * self.size
        self._dist.all_gather_object(out, obj, group=self.group)
        return out

    def barrier(self) -> None:
        self._dist.barrier(group=self.group)


def bootstrap_group(group=None) -> BootstrapGroup:
    """The job's process group ``group`` as a :class:`BootstrapGroup` (not collective).

    Parameters
    ----------
    group : None, mpi4py ``Comm``, torch.distributed ``ProcessGroup`` or :class:`BootstrapGroup`
        ``None`` finds the job's group: ``MPI.COMM_WORLD`` when an MPI launcher started this process
        (``mpirun``/``mpiexec``), else torch.distributed's default group when it is initialized
        (torchrun after ``init_process_group``), else, with mpi4py installed, ``MPI.COMM_WORLD`` of
        a job of this one process. A BootstrapGroup is returned as it is.

    Raises
    ------
    EPInputError
        ``group`` is none of those (the message names what was passed and what is accepted), this
        process is not a member of it, or ``None`` was passed in a torchrun job of several
        processes whose torch.distributed is not initialized.
    MissingDependencyError
        ``None`` under an MPI launcher without mpi4py installed.
    """
    if isinstance(group, BootstrapGroup):
        return group
    if group is None:
        return _job_group()
    if type(group).__module__.startswith("mpi4py"):
        from mpi4py import MPI

        if isinstance(group, MPI.Intracomm) and group != MPI.COMM_NULL:
            return MpiBootstrap(group)
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available():
        if isinstance(group, dist.ProcessGroup):
            return TorchBootstrap(group)
        outside = dist.GroupMember.NON_GROUP_MEMBER  # what new_group returns on a non-member
        if type(group) is type(outside) and group == outside and dist.is_initialized():
            raise EPInputError(f"bootstrap_group: got torch.distributed.GroupMember.NON_GROUP_MEMBER: this process "
                               f"(global rank {dist.get_rank()}) is not a member of the group new_group made; open "
                               f"a session only on its members")
    raise EPInputError(f"bootstrap_group: got {_name(group)}; expected {ACCEPTED}")


def _job_group() -> BootstrapGroup:
    """The group of ``bootstrap_group(None)``."""
    from ep_runtime.shmem.mpi import mpi_module, mpi_rank_size

    if mpi_rank_size() is not None:
        return MpiBootstrap(mpi_module("bootstrap_group(None) under an MPI launcher").COMM_WORLD)
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return TorchBootstrap(dist.group.WORLD)
    world = int(os.environ.get("WORLD_SIZE", "1"))  # torchrun's
    if world > 1:
        raise EPInputError(f"bootstrap_group(None): this process belongs to a torchrun job of {world} processes "
                           "(WORLD_SIZE), but torch.distributed is not initialized: call "
                           "torch.distributed.init_process_group() first, or pass group=")
    try:
        from mpi4py import MPI
    except ImportError:
        raise EPInputError("bootstrap_group(None): found no group of this job (no MPI launcher, torch.distributed "
                           f"not initialized, mpi4py not installed); pass one of: {ACCEPTED}") from None
    return MpiBootstrap(MPI.COMM_WORLD)


def _name(obj) -> str:
    """``obj``'s type and a short repr, for messages."""
    text = repr(obj)
    if len(text) > 80:
        text = text[:77] + "..."
    return f"{type(obj).__module__}.{type(obj).__qualname__} {text}"


__all__ = ["BootstrapGroup", "MpiBootstrap", "TorchBootstrap", "bootstrap_group", "local_rank_among"]
