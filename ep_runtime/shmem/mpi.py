"""This process in its MPI job, read without starting MPI where no launcher started it: its rank
and size, its rank on its node, and mpi4py's ``MPI`` module with an error naming the extra that
installs it. The launchers (:mod:`ep_runtime.shmem.launch`) and the bootstrap groups
(:mod:`ep_runtime.shmem.bootstrap`) both read it.
"""

from __future__ import annotations

import os
import sys

from ep_runtime.core.errors import MissingDependencyError

#: (rank variable, size variable) set by MPI launchers: Open MPI, MPICH/Intel MPI (Hydra),
#: MVAPICH. PMIx gives only the rank (PMIX_RANK): its size comes from mpi4py. Then the variables
#: of a process's rank on its node.
_RANK_SIZE_VARS = (
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
    ("PMI_RANK", "PMI_SIZE"),
    ("MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE"),
)
_LOCAL_RANK_VARS = ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "MV2_COMM_WORLD_LOCAL_RANK")


def mpi_rank_size() -> tuple[int, int] | None:
    """``(rank, size)`` of this process in its MPI job, or ``None`` if no MPI launcher
    started it.

    Read from the launcher's environment (Open MPI, MPICH/Intel MPI Hydra, MVAPICH); under
    PMIx (``PMIX_RANK`` only) or once mpi4py has initialized MPI, from ``COMM_WORLD``. Never
    initializes MPI in a process that no launcher started.
    """
    for rank_var, size_var in _RANK_SIZE_VARS:
        if rank_var in os.environ and size_var in os.environ:
            return int(os.environ[rank_var]), int(os.environ[size_var])
    if "PMIX_RANK" in os.environ or mpi_initialized():
        MPI = mpi_module("mpi_rank_size under a PMIx launcher")
        return MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    return None


def local_rank() -> int:
    """This process's rank among the job's processes on its node (it picks the GPU): from
    the launcher's environment, else from mpi4py under MPI, else 0."""
    for var in _LOCAL_RANK_VARS:
        if var in os.environ:
            return int(os.environ[var])
    if mpi_rank_size() is None:
        return 0
    MPI = mpi_module("local_rank under mpirun")
    return MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED).Get_rank()


def mpi_module(what: str):
    """mpi4py's ``MPI`` module; :class:`MissingDependencyError` naming the extras that install
    it if mpi4py is absent."""
    try:
        from mpi4py import MPI
    except ImportError as exc:
        raise MissingDependencyError(
            f"{what}: this process runs under an MPI launcher and needs mpi4py, which is not installed: "
            "pip install -e \".[mpi]\" (mpi4py and MPICH's mpiexec, for simulated ranks on a CPU) or "
            "\".[gpu]\" (the GPU stack)") from exc
    return MPI


def mpi_initialized() -> bool:
    """Whether this process imported mpi4py.MPI and MPI is initialized."""
    mpi = sys.modules.get("mpi4py.MPI")
    return mpi is not None and mpi.Is_initialized()


__all__ = ["local_rank", "mpi_initialized", "mpi_module", "mpi_rank_size"]
