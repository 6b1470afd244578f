"""The ``nvshmem`` backend of :class:`~ep_runtime.shmem.session.Session`: real GPUs.

Bring-up (collective over the job's group: an mpi4py communicator or a torch.distributed
process group, :mod:`ep_runtime.shmem.bootstrap`): bind this process to GPU ``local_rank`` (its
rank among the group's processes on this node, modulo the GPUs visible: with more ranks than
GPUs, ranks share GPUs round-robin, NVSHMEM's "multiple processes per GPU"; kernels of ranks that
wait on each other then need CUDA MPS with each rank's share of the GPU limited, e.g.
``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``, so that their cooperative grids are co-resident; for
correctness runs on few GPUs, not speed), set NVSHMEM's environment
(:func:`ep_runtime.shmem.env.configure_nvshmem_env`), broadcast NVSHMEM's unique id from rank 0
over the group and initialize with ``initializer_method="uid"`` (this works with Open MPI, MPICH
and torch.distributed alike; NVSHMEM's own MPI plugin is linked against Open MPI only).
Symmetric arrays are CuPy arrays from ``nvshmem.core.array``; kernels run on one stream
created with cuda.core, shared with Numba and made CuPy's current stream in this thread. The
stream is *blocking* (ordered with the legacy default stream), so a caller's work on the
default stream orders with the kernels even where CuPy's current stream was changed.

Kernels: :meth:`NvshmemSession.precompile` takes a kernel's linked cubin from the on-disk kernel
cache when it can (:mod:`ep_runtime.shmem.kernel_cache`; directory ``$EP_RUNTIME_KERNEL_CACHE``,
``off`` disables it) and otherwise compiles and stores it; :meth:`NvshmemSession.launch` launches
precompiled signatures through the driver (:mod:`ep_runtime.shmem.fast_launch`) and everything
else through Numba. ``EP_RUNTIME_FAST_LAUNCH=0`` (read at :meth:`NvshmemSession.open`) or
``session.fast_launch = False`` (at any time) sends every launch through Numba. Kernels built by
numba-cuda-mlir (the process's compiler: :mod:`ep_runtime.kernels.compiler`) are compiled in the
process and launched through its dispatcher, without the fast launcher or the kernel cache
(:mod:`ep_runtime.shmem.mlir_launch`).
"""

from __future__ import annotations

import contextlib
import logging
import os

import numpy as np

from ep_runtime.core.errors import EPConfigError, MissingDependencyError, ShmemError
from ep_runtime.kernels import pdl
from ep_runtime.kernels.cuda_api import MLIR, cuda as kernel_cuda
from ep_runtime.shmem.env import HEAP_SLACK_BYTES, configure_nvshmem_env
from ep_runtime.shmem.fast_launch import FastLauncher, Unsupported
from ep_runtime.shmem import mlir_launch, shim_memo
from ep_runtime.shmem.kernel_cache import KernelCache
from ep_runtime.shmem.session import Session

log = logging.getLogger("ep_runtime.shmem")

#: Environment variable: ``0`` (or ``off``) sends every launch through Numba's dispatcher.
FAST_LAUNCH_ENV = "EP_RUNTIME_FAST_LAUNCH"


def _is_cupy(a) -> bool:
    return type(a).__module__.startswith("cupy")


def _fast_launch_from_env() -> bool:
    return os.environ.get(FAST_LAUNCH_ENV, "1").strip().lower() not in ("0", "off", "false", "no")


def _check_driver(result, call: str) -> None:
    """Raise ShmemError unless a cuda.bindings driver call returned CUDA_SUCCESS."""
    err = result[0] if type(result) is tuple else result
    if int(err) != 0:
        raise ShmemError(f"{call} failed: {err!r}")


def check_heap_fits_gpu(heap_bytes: int, gpu_bytes: int, rank: int, device_index: int) -> None:
    """Raise :class:`~ep_runtime.core.errors.EPConfigError` if a symmetric heap of ``heap_bytes``
    per PE (plus NVSHMEM's slack) cannot fit the ``gpu_bytes`` of GPU ``device_index``: NVSHMEM
    reserves the heap in device memory at initialization, and a heap past it fails there with
    no word of why (wide expert parallelism at many tokens a rank gets there first)."""
    want = int(heap_bytes) + HEAP_SLACK_BYTES
    if want > gpu_bytes:
        gib = 1 << 30
        raise EPConfigError(
            f"NvshmemSession.open: rank {rank}: a symmetric heap of {want / gib:,.1f} GiB per PE "
            f"(heap_bytes={heap_bytes} plus NVSHMEM's slack) cannot fit GPU {device_index}'s {gpu_bytes / gib:,.1f} "
            "GiB. The heap is BufferLayout(cfg, plan).symmetric_bytes of the job's buffers, and most of its "
            "regions grow with n_ranks x max_tokens_per_rank (docs/wide_ep.md, \"Memory\"): lower "
            "max_tokens_per_rank or serve fewer layouts (EPConfig.layouts)")


def _cuda_core_device(index: int):
    try:
        from cuda.core import Device
    except ImportError:  # cuda.core < 1.0
        from cuda.core.experimental import Device
    return Device(index)


def _blocking_stream_options():
    """cuda.core options for a stream that orders with the legacy default stream."""
    try:
        from cuda.core import StreamOptions
    except ImportError:  # cuda.core < 1.0
        from cuda.core.experimental import StreamOptions
    return StreamOptions(nonblocking=False)


class NvshmemSession(Session):
    """One PE on NVSHMEM. Build with :meth:`open`."""

    backend = "nvshmem"

    @classmethod
    def open(cls, heap_bytes: int, group=None) -> "NvshmemSession":
        """Collective over ``group``: join the NVSHMEM job of its processes, one PE each (PE index:
        group rank), with a symmetric heap of at least ``heap_bytes`` per PE.

        ``group``: what :func:`~ep_runtime.shmem.bootstrap.bootstrap_group` accepts (``None``: the
        job's group, MPI.COMM_WORLD under mpirun; an mpi4py communicator; a torch.distributed
        ProcessGroup, whose ranks must have called ``torch.cuda.set_device`` on an nccl group).
        Its host collectives carry NVSHMEM's unique id and :meth:`allgather_object`. NVSHMEM is
        initialized once per process: one such session per process.

        Raises :class:`~ep_runtime.core.errors.GPUUnavailableError` (no CUDA driver or GPU; it names
        the simulator) or :class:`~ep_runtime.core.errors.MissingDependencyError` (the ``gpu`` extra
        is not installed) before it starts anything.
        """
        from ep_runtime.shmem import require_gpu
        from ep_runtime.shmem.bootstrap import bootstrap_group

        n_gpus = require_gpu("NvshmemSession.open")
        try:
            import nvshmem.core as nvshmem
        except ImportError as exc:
            raise MissingDependencyError(
                f"NvshmemSession.open: {exc.name or exc} is not installed; the nvshmem backend needs "
                "nvshmem4py: pip install -e \".[gpu]\"") from exc
        import cupy

        self = cls.__new__(cls)
        #: the job's group this session bootstrapped over (its host collectives)
        self.bootstrap = bootstrap_group(group)
        self.rank, self.n_ranks = self.bootstrap.rank, self.bootstrap.size
        self.local_rank = self.bootstrap.local_rank
        self.heap_bytes = heap_bytes
        configure_nvshmem_env(heap_bytes)
        #: the GPU this rank uses: local_rank modulo the GPUs visible (see the module docstring)
        self.device_index = self.local_rank % n_gpus
        self._device = _cuda_core_device(self.device_index)
        self._device.set_current()
        cupy.cuda.Device(self.device_index).use()
        check_heap_fits_gpu(heap_bytes, cupy.cuda.runtime.memGetInfo()[1], self.rank, self.device_index)
        uid = nvshmem.get_unique_id(empty=self.rank != 0)
        self.bootstrap.broadcast_bytes(uid._data.view(np.int8), root=0)
        nvshmem.init(device=self._device, uid=uid, rank=self.rank, nranks=self.n_ranks,
                     initializer_method="uid")
        self._nvshmem = nvshmem
        # A *blocking* stream (ordered with the legacy default stream, both ways): measured on
        # the GPU machine, CuPy's current stream did not stay the session stream in every
        # script (ep_check.py found it was not, on one rank of two, after building the runtime),
        # and inputs made by cupy.asarray on the legacy stream then raced with the kernels of a
        # non-blocking stream. Blocking, the caller's work on the default stream (CuPy's when no
        # stream is current, PyTorch's default stream) is ordered with the kernels whatever
        # stream CuPy considers current (README, "Streams").
        self._core_stream = self._device.create_stream(options=_blocking_stream_options())
        handle = int(self._core_stream.handle)
        self._cupy_stream = cupy.cuda.ExternalStream(handle)
        self._cupy_stream.use()  # the caller's CuPy work orders with the kernels by default
        #: the session stream as the kernel compiler's stream object (what its dispatcher launches on)
        self._numba_stream = kernel_cuda.external_stream(handle)
        self._symmetric = []
        self._closed = False
        #: Launch precompiled signatures through the driver (see the module docstring). With
        #: EP_RUNTIME_FAST_LAUNCH=0, or on numba-cuda-mlir, no fast launcher is built and this stays False.
        self.fast_launch = self._build_launchers = _fast_launch_from_env() and not MLIR
        #: The on-disk kernel cache, or None when disabled (and on numba-cuda-mlir).
        self.kernel_cache = None if MLIR else KernelCache.from_env()
        if MLIR:
            log.info("rank %d: %s", self.rank, mlir_launch.WHY_DISPATCHER)
        #: Launches so far by path: ``fast`` (driver) and ``numba`` (dispatcher).
        self.launch_counts = {"fast": 0, "numba": 0}
        self._fast = {}  # id(dispatcher) -> [(dispatcher, FastLauncher)]
        self._mlir_loaded = set()  # (dispatcher, argtypes) whose module numba-cuda-mlir loaded
        log.info("rank %d/%d: NVSHMEM initialized on GPU %d", self.rank, self.n_ranks, self.device_index)
        return self

    @contextlib.contextmanager
    def _on_stream(self):
        """Run CuPy work on the session stream, then restore the caller's current stream.

        WAR: leaving CuPy's own ``with stream:`` block left the *null* stream current (seen on
        the GPU machine with CuPy 14.2: after the runtime's construction, CuPy work the caller
        enqueued after ``dispatch_wait`` ran concurrently with it). ``use()`` and an explicit
        restore keep whatever was current, the session stream by default.
        """
        import cupy

        prev = cupy.cuda.get_current_stream()
        self._cupy_stream.use()
        try:
            yield
        finally:
            prev.use()

    # -- memory ---------------------------------------------------------------------------------
    def alloc_symmetric(self, name, shape, dtype, fill=0):
        arr = self._nvshmem.array(tuple(shape), dtype=np.dtype(dtype))
        with self._on_stream():
            arr.fill(fill)
        self._symmetric.append(arr)
        return arr

    def free_symmetric(self, array):
        for i, a in enumerate(self._symmetric):
            if a is array:
                del self._symmetric[i]
                self.synchronize()
                self._forget_launch_args()  # no launcher keeps views of freed memory alive
                self._nvshmem.free_array(array)
                return
        raise ShmemError(f"rank {self.rank}: free_symmetric got an array this session did not allocate "
                         f"(or freed already)")

    def alloc_local(self, name, shape, dtype, fill=0):  # fill=None: uninitialized
        import cupy

        with self._on_stream():
            if fill is None:
                return cupy.empty(tuple(shape), dtype=np.dtype(dtype))
            return cupy.full(tuple(shape), fill, dtype=np.dtype(dtype))

    def fill(self, array, value):
        with self._on_stream():
            array.fill(value)

    def peer_view(self, array, pe):
        self._check_same_node(pe, "peer_view")
        return self._nvshmem.get_peer_array(array, pe)

    def _mapped_address(self, array, pe):
        try:
            view = self._nvshmem.get_peer_array(array, pe)
        except Exception as exc:  # noqa: BLE001 - a PE without a load/store mapping (another node)
            log.info("no NVLink mapping of PE %d's heap (%s): peer stores off", pe, exc)
            return None
        return None if view is None else int(view.data.ptr)

    def to_device(self, host):
        import cupy

        with self._on_stream():
            return cupy.asarray(host)

    def to_host(self, array):
        import cupy

        with self._on_stream():
            out = cupy.asnumpy(array)
        self._cupy_stream.synchronize()
        return out

    # -- kernels --------------------------------------------------------------------------------
    def as_kernel_arg(self, array):
        return kernel_cuda.as_cuda_array(array, sync=False)

    def launch(self, kernel, grid, block, args):
        if self.fast_launch:
            for _, launcher in self._fast.get(id(kernel), ()):
                if launcher.launch(grid, block, args):
                    self.launch_counts["fast"] += 1
                    return
        self.launch_counts["numba"] += 1
        kernel[grid, block, self._numba_stream](*[self.as_kernel_arg(a) if _is_cupy(a) else a for a in args])

    def precompile(self, kernel, argtypes):
        """Compile ``kernel`` for ``argtypes`` (or load it from the kernel cache), and prepare its
        fast launcher unless ``EP_RUNTIME_FAST_LAUNCH=0`` was set at :meth:`open`. On
        numba-cuda-mlir: compile it and load its module (:mod:`ep_runtime.shmem.mlir_launch`)."""
        shim_memo.install()  # the kernels of this process link one NVRTC compile of the shim
        if MLIR:
            kernel.compile(argtypes)
            if (kernel, tuple(argtypes)) not in self._mlir_loaded:
                mlir_launch.load_module(kernel, argtypes, self._numba_stream, self.as_kernel_arg)
                self._mlir_loaded.add((kernel, tuple(argtypes)))
            return
        if self.kernel_cache is not None:
            compiled = self.kernel_cache.load_or_compile(kernel, argtypes)
        else:
            compiled = kernel.compile(argtypes)
        if not self._build_launchers:
            return
        entries = self._fast.setdefault(id(kernel), [])
        if any(launcher.kernel is compiled for _, launcher in entries):
            return
        try:
            entries.append((kernel, FastLauncher(compiled, int(self._core_stream.handle),
                                                 programmatic=pdl.is_programmatic(kernel))))
        except Unsupported as exc:
            log.info("rank %d: %s launches through Numba: %s", self.rank,
                     getattr(kernel, "__qualname__", kernel), exc)

    def _forget_launch_args(self):
        """Drop the argument objects the fast launchers keep for identity caching."""
        for entries in self._fast.values():
            for _, launcher in entries:
                launcher.forget_args()

    def pdl_capable(self):
        """Compute capability 9.0 or later and the fast launcher (the path that sets PDL's launch
        attribute; off with EP_RUNTIME_FAST_LAUNCH=0 and on numba-cuda-mlir)."""
        return self._build_launchers and self.compute_capability()[0] >= 9

    def compute_capability(self) -> tuple[int, int]:
        import cupy

        return tuple(int(c) for c in cupy.cuda.Device(self.device_index).compute_capability)

    def sm_count(self):
        import cupy

        return int(cupy.cuda.Device(self.device_index).attributes["MultiProcessorCount"])

    # -- ordering -------------------------------------------------------------------------------
    @property
    def stream(self):
        return self._cupy_stream

    @property
    def core_stream(self):
        """The session stream as a cuda.core Stream (what nvshmem.core host collectives take)."""
        return self._core_stream

    def synchronize(self):
        self._cupy_stream.synchronize()

    def barrier(self):
        self.stream_barrier()
        self._core_stream.sync()

    def stream_barrier(self):
        self._nvshmem.barrier_all(stream=self._core_stream)

    def allgather_object(self, obj):
        return self.bootstrap.allgather_object(obj)

    # -- lifetime -------------------------------------------------------------------------------
    def close(self):
        if self._closed:
            return
        self._closed = True
        self.synchronize()
        self.barrier()
        for arr in self._symmetric:
            self._nvshmem.free_array(arr)
        self._symmetric.clear()
        self._fast.clear()
        self._mlir_loaded.clear()
        self._nvshmem.finalize()
