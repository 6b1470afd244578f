"""The simulated symmetric heap: one OS process per PE, every PE's heap mapped by every PE.

Numba's CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``) runs kernels as Python threads, one
kernel per process, so each PE of a simulated job is an OS process. PE ``p``'s heap is the
file ``/dev/shm/ep_sim_<job>_<p>`` which every PE maps, so PE ``q`` reads and writes PE
``p``'s copy of an object by the same offset.

File layout (every PE, ``gather_offset(heap_bytes) + 2 * GATHER_SLOT_BYTES`` bytes)::

    [0, CONTROL_BYTES)                         control area, uint64 words written only by the
                                               owner: 0 = barrier arrival epoch, 1 = process id,
                                               2 = process start time (liveness of peers)
    [CONTROL_BYTES, CONTROL_BYTES+heap_bytes)  allocatable range (bump allocator, 256-byte
                                               aligned, identical on every PE)
    [gather_offset, +2*GATHER_SLOT_BYTES)      mailbox of :meth:`SimHeap.allgather`: two slots
                                               used by alternate calls, each a uint64 length
                                               then the pickled object

Offsets are counted from the start of the file, so the first allocation is at heap offset
``CONTROL_BYTES``. The barrier is an arrival-epoch barrier (the monotonic form of a
sense-reversing one): barrier ``k`` publishes ``k`` in the caller's word 0 and waits until
every PE's word is ``>= k``, so nothing is ever reset and a timeout names the PEs that did not
arrive. The job's one cross-process lock is ``ep_sim_<job>_lock`` (an ``fcntl.flock`` taken
together with a ``threading.Lock`` because the simulator's threads share the descriptor).

Lifetime of the /dev/shm files: they exist only during bring-up (:meth:`SimHeap.open`). Once
every PE has mapped every heap file and opened the lock file, each PE unlinks its own heap
file and PE 0 the lock file: the memory stays shared through the mappings and is freed by the
kernel when the last PE process exits, however it exits (SIGKILL included), so a finished,
failed or killed job leaves nothing in /dev/shm. Files left by a job that dies during
bring-up are removed by :func:`~ep_runtime.shmem.sim_job_files.remove_job_files` (the launcher
calls it, and a PE whose bring-up fails calls it for its job). :mod:`ep_runtime.shmem.sim_job_files`
names, publishes, maps and removes the files.

Each PE also watches its peers' processes (a pidfd per peer, opened at bring-up:
:mod:`ep_runtime.shmem.sim_peers`): a wait of this process (a barrier, a simulated signal wait)
whose peer process has exited fails at once with :class:`~ep_runtime.core.errors.PEFailure`
naming that PE, instead of at its timeout.

Limits of the simulator (what a passing simulated test does not prove)
-----------------------------------------------------------------------
- Blocks run one at a time, in blockIdx order, their threads as Python threads: a block that
  waits for a later block of the same kernel on the same PE never gets it (the wait times out
  with :class:`~ep_runtime.core.errors.ShmemTimeoutError`). ``grid.sync()`` is only a block
  barrier and ``max_cooperative_grid_blocks`` is 1.
- One kernel per process at a time, so PEs are processes, never threads. Streams are ignored:
  a launch returns when the kernel has finished.
- ``cuda.threadfence*`` do nothing; ``cuda.syncwarp`` and ``cuda.nanosleep`` do not exist.
  Lanes of a warp are not in lockstep and the ``_warp`` SHMEM variants do not synchronize
  them: lane 0 copies ``src`` when it calls, so publish ``src`` with ``cuda.syncthreads()``.
- Plain and ``_nbi`` puts are queued per process and delivered only at ``quiet()``,
  ``fence()`` or a session barrier, never at kernel end; ``put_signal*`` delivers its own data
  at once, then the signal. A missing fence between puts and a ``signal_op`` therefore shows
  as wrong data. Stores through peer views are visible at once: a missing fence after them
  is *not* detected.
- One lock serializes every atomic and signal update and read of the whole job: there is
  no weak ordering, no torn word and no lost update to discover.
- Nothing is type-checked: the facade checks dtypes, contiguity and heap placement of its
  own arguments at run time; everything else the GPU compiler rejects runs here.
- NumPy arrays passed to a simulated kernel are copied in and out by the simulator: pass
  heap arrays through ``SimSession.as_kernel_arg``/``SimSession.launch`` (``FakeCUDAArray``,
  no copy), or the kernel works on a copy and its copy-out overwrites what peers wrote.
- Bring-up, barriers and every /dev/shm file assume all PEs on one machine.
- Timing says nothing about the GPU.
"""

from __future__ import annotations

import bisect
import os
import pickle
import re
import threading
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ep_runtime.core.errors import (EPInputError, EPStateError, PEFailure, ShmemError, ShmemTimeoutError,
                      SymmetricAddressError)
from ep_runtime.shmem.sim_job_files import (SHM_DIR, JobLock, job_path, map_file, publish_heap_file, remove_job_file,
                                            remove_job_files)
from ep_runtime.shmem.sim_peers import PeerWatch, start_time

# Control area before the allocatable range; one page keeps the first allocation page-aligned.
CONTROL_BYTES = 4096
# Allocation alignment (bytes): what nvshmem_malloc guarantees, and enough for any dtype.
ALIGN = 256
# Files are sparse: only pages that are written use memory.
DEFAULT_HEAP_BYTES = 64 << 20
# Poll backoff: start short (a signal usually arrives within milliseconds), cap the sleep so
# a waiter reacts within ~2 ms and other processes get the CPU.
_POLL_MIN_S = 50e-6
_POLL_MAX_S = 2e-3
# Wake-ups a second and core that the waiting PEs of a job take together at most: with many
# PEs a core (64 on 2), polls every 2 ms would fill the cores with wake-ups and starve the PEs
# that work (and the launcher starting them), so the cap grows with the PEs a core
# (:func:`poll_pause_cap`).
_WAKEUPS_PER_CORE_S = 4000
# Limit (seconds) of the simulated device-side waits of the PEs (ep_runtime.kernels._shmem_sim).
WAIT_TIMEOUT_ENV = "EP_SIM_WAIT_TIMEOUT"
_JOB_RE = re.compile(r"^[A-Za-z0-9-]+$")
# Control-area words (uint64), each written only by the PE that owns the file.
_ARRIVAL_WORD = 0  # barrier arrival epoch
_PID_WORD = 1      # process id of the owner, for its peers' liveness checks
_START_WORD = 2    # start time of that process (/proc/<pid>/stat), so a reused pid is not taken for it
# Bytes of one allgather mailbox slot (a uint64 length, then the pickled object). The runtime
# gathers small records (flags, modes, configs); the file is sparse, so unused slot pages cost
# no memory.
GATHER_SLOT_BYTES = 4 << 20

_current: SimHeap | None = None


def set_current_heap(heap: SimHeap | None) -> None:
    """Make ``heap`` the one the device facade (:mod:`ep_runtime.kernels._shmem_sim`) uses.

    Called by :class:`~ep_runtime.shmem.sim_session.SimSession`; the simulator runs one kernel
    per process, so one heap per process is enough.
    """
    global _current
    _current = heap


def current_heap() -> SimHeap:
    """The heap of the session open in this process; :class:`EPStateError` if none is."""
    if _current is None:
        raise EPStateError(
            "no simulated SHMEM session is open in this process: open one with "
            "SimSession.open (ep_runtime.shmem.launch.run_pes does this for each PE) before "
            "launching kernels that call shmem.*")
    return _current


def gather_offset(heap_bytes: int) -> int:
    """Byte offset of the allgather mailbox in a heap file with ``heap_bytes`` allocatable."""
    return _align(CONTROL_BYTES + heap_bytes)


def poll_pause_cap(n_ranks: int) -> float:
    """The longest sleep (seconds) between two checks of a wait of a job of ``n_ranks`` PEs on
    this machine: 2 ms, or more where the PEs outnumber the cores, so that their wake-ups
    together stay near ``_WAKEUPS_PER_CORE_S`` a core (16 ms for 128 PEs on 2 cores)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(_POLL_MAX_S, n_ranks / (cores * _WAKEUPS_PER_CORE_S))


def poll(check: Callable[[], bool], timeout_s: float, heap: SimHeap | None = None,
         pause_cap_s: float | None = None) -> bool:
    """Call ``check()`` until it returns True or ``timeout_s`` passed.

    Sleeps between calls with exponential backoff, from 50 us to ``pause_cap_s`` (default: the
    watched heap's :attr:`SimHeap.pause_cap_s`, else 2 ms). Returns whether ``check``
    succeeded. While it waits, a peer PE of ``heap`` (default: this process's current heap, if
    a session is open) whose process has exited ends the wait with :class:`PEFailure` naming
    that PE, unless ``check()`` succeeds once more after the exit was seen.
    """
    deadline = time.monotonic() + timeout_s
    pause = _POLL_MIN_S
    if pause_cap_s is None:
        watched = heap if heap is not None else _current
        pause_cap_s = watched.pause_cap_s if watched is not None else _POLL_MAX_S
    while not check():
        watched = heap if heap is not None else _current
        if watched is not None:
            watched.raise_if_peer_exited(check)
        if time.monotonic() > deadline:
            return False
        time.sleep(pause)
        pause = min(2 * pause, pause_cap_s)
    return True


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class Region:
    """One symmetric allocation: the same ``offset`` on every PE."""

    name: str
    offset: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def end(self) -> int:
        return self.offset + self.nbytes

    def label(self, offset: int) -> str:
        """``'name'[i, j]``: the element of this region at heap ``offset``."""
        if not self.shape:
            return f"'{self.name}'"
        flat = (offset - self.offset) // self.dtype.itemsize
        index = np.unravel_index(flat, self.shape)
        return f"'{self.name}'[{', '.join(str(int(i)) for i in index)}]"


class SimHeap:
    """This PE's view of the job's simulated symmetric heaps.

    Collective calls (every PE, same order, same arguments): :meth:`open`, :meth:`alloc`,
    :meth:`free`, :meth:`barrier`, :meth:`allgather`, :meth:`close`.

    Attributes
    ----------
    rank, n_ranks : int
        This PE and the number of PEs.
    job : str
        The job id naming the /dev/shm files.
    heap_bytes : int
        Size of the allocatable range of each PE.
    timeout_s : float
        Limit of bring-up and of each barrier (:class:`ShmemTimeoutError` past it).
    """

    def __init__(self, rank: int, n_ranks: int, job: str, heap_bytes: int, timeout_s: float,
                 lock: JobLock, maps: list[np.ndarray]):
        """Use :meth:`open`."""
        self.rank = rank
        self.n_ranks = n_ranks
        self.job = job
        self.heap_bytes = heap_bytes
        self.timeout_s = timeout_s
        #: the longest sleep between two checks of a wait of this process (:func:`poll_pause_cap`)
        self.pause_cap_s = poll_pause_cap(n_ranks)
        self.lock = lock
        self._maps = maps
        self._bases = [m.__array_interface__["data"][0] for m in maps]
        self._words = [m[:CONTROL_BYTES].view(np.uint64) for m in maps]
        self._regions: list[Region] = []
        self._top = CONTROL_BYTES
        self._epoch = 0
        self._gathers = 0
        self._pending: list[tuple[np.ndarray, np.ndarray]] = []
        self._pending_lock = threading.Lock()
        #: [pe] = (operations, bytes) this process put or signalled to PE pe (:meth:`count`)
        self.traffic = np.zeros((n_ranks, 2), np.int64)
        self._closed = False
        self._peers = PeerWatch.open(rank, [int(w[_PID_WORD]) for w in self._words],
                                     [int(w[_START_WORD]) for w in self._words])

    # -- bring-up and teardown --------------------------------------------------------------
    @classmethod
    def open(cls, rank: int, n_ranks: int, job: str, heap_bytes: int = DEFAULT_HEAP_BYTES,
             timeout_s: float = 60.0) -> SimHeap:
        """Create this PE's heap file, wait for all ``n_ranks`` files, map them. Collective.

        When every PE has mapped every file, this PE unlinks its own heap file (PE 0 also the
        lock file), so nothing of the job stays in /dev/shm past bring-up. If bring-up fails
        here, every file of the job is removed (the job cannot start without this PE).

        Raises :class:`ShmemTimeoutError` naming the PEs whose files did not appear within
        ``timeout_s``, :class:`ShmemError` if a peer's file has another size, and
        :class:`PEFailure` if a peer's process exited during bring-up.
        """
        _check_open_args(rank, n_ranks, job, heap_bytes, timeout_s)
        file_bytes = gather_offset(heap_bytes) + 2 * GATHER_SLOT_BYTES
        # The lock is opened before this PE's heap file appears, so by the time every heap
        # file exists every PE holds the same lock file open.
        lock = JobLock(job_path(job, "lock"))
        heap = None
        try:
            publish_heap_file(job_path(job, str(rank)), file_bytes, _control_words())
            paths = [job_path(job, str(pe)) for pe in range(n_ranks)]
            _wait_for_files(paths, file_bytes, rank, job, timeout_s)
            heap = cls(rank, n_ranks, job, heap_bytes, timeout_s, lock,
                       [map_file(path, file_bytes) for path in paths])
            heap.barrier("open")
        except BaseException:
            lock.close()
            if heap is not None:
                heap._peers.close()
            remove_job_files(job)
            raise
        # Every PE passed the barrier, so every PE has mapped every heap file and opened the
        # lock file: the names are no longer needed, and without them the memory goes back to
        # the system when the job's last process exits, however it exits.
        remove_job_file(job, str(rank))
        if rank == 0:
            remove_job_file(job, "lock")
        return heap

    def close(self) -> None:
        """Deliver queued puts, final barrier, stop being the current heap. Collective,
        idempotent.

        The mappings stay valid while arrays returned by :meth:`alloc` are alive.
        """
        if self._closed:
            return
        self._closed = True
        try:
            self.deliver_puts()
            self.barrier("close")
        finally:
            self.lock.close()
            self._peers.close()
            if _current is self:
                set_current_heap(None)

    # -- allocation -------------------------------------------------------------------------
    def alloc(self, name: str, shape: tuple[int, ...], dtype, fill=0) -> np.ndarray:
        """Allocate ``shape``/``dtype`` at the same offset on every PE, filled with ``fill``.

        Collective: ends with a barrier, so no peer writes into the region before its owner
        filled it, and checks that every PE allocated the same size at the same offset.
        Returns this PE's copy (C-contiguous ndarray on the heap).
        """
        dtype = np.dtype(dtype)
        shape = (int(shape),) if np.ndim(shape) == 0 else tuple(int(s) for s in shape)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        offset = self._top
        if offset + nbytes > CONTROL_BYTES + self.heap_bytes:
            raise ShmemError(
                f"PE {self.rank}: alloc_symmetric('{name}', shape={shape}, dtype={dtype}) needs "
                f"{nbytes} bytes but only {CONTROL_BYTES + self.heap_bytes - offset} of "
                f"heap_bytes={self.heap_bytes} are left: open the session with a larger heap_bytes")
        region = Region(name, offset, nbytes, shape, dtype)
        self._regions.append(region)
        self._top = _align(offset + max(nbytes, 1))
        array = np.ndarray(shape, dtype, buffer=self._maps[self.rank], offset=offset)
        array[...] = fill
        self._check_same_everywhere("alloc_symmetric", dict(name=name, offset=offset, nbytes=nbytes,
                                                            shape=shape, dtype=dtype.str))
        return array

    def free(self, array: np.ndarray) -> None:
        """Free an array returned by :meth:`alloc`. Collective: every PE frees the same region
        (checked). Space is reused once every region above it is freed too."""
        offset, label = self.locate(array, "free_symmetric")
        region = self._region_at(offset)
        if offset != region.offset or array.nbytes != region.nbytes:
            raise SymmetricAddressError(
                f"PE {self.rank}: free_symmetric got a view ({array.nbytes} bytes from {label}) "
                f"of '{region.name}', not the array alloc_symmetric returned: free that array")
        self._check_same_everywhere("free_symmetric", dict(name=region.name, offset=region.offset))
        self._regions.remove(region)
        self._top = _align(self._regions[-1].end) if self._regions else CONTROL_BYTES

    # -- address translation ----------------------------------------------------------------
    def locate(self, array: np.ndarray, op: str) -> tuple[int, str]:
        """``(heap offset, region label)`` of ``array``'s first element, e.g.
        ``(4104, "'dispatch_signal'[1]")``.

        Raises :class:`SymmetricAddressError` naming ``op`` unless the whole array lies
        inside one live allocation of this PE's heap.
        """
        address = array.__array_interface__["data"][0]
        offset = address - self._bases[self.rank]
        if not CONTROL_BYTES <= offset <= offset + array.nbytes <= CONTROL_BYTES + self.heap_bytes:
            raise SymmetricAddressError(self._off_heap_message(op, address, array.nbytes))
        region = self._region_at(offset)
        if region is None:
            raise SymmetricAddressError(
                f"PE {self.rank}: {op}: the array ({array.nbytes} bytes at heap offset {offset}) "
                "is not inside a live symmetric allocation (freed, or between allocations). "
                f"Live: {self.describe()}")
        if offset + array.nbytes > region.end:
            raise SymmetricAddressError(
                f"PE {self.rank}: {op}: the array ({array.nbytes} bytes from {region.label(offset)} "
                f"at heap offset {offset}) runs past the end of '{region.name}' "
                f"[{region.offset}, {region.end})")
        return offset, region.label(offset)

    def peer_view(self, array: np.ndarray, pe: int, op: str = "peer_view") -> np.ndarray:
        """PE ``pe``'s copy of the symmetric ``array``: same shape, dtype and strides."""
        self._check_pe(pe, op)
        offset, _ = self.locate(array, op)
        return np.ndarray(array.shape, array.dtype, buffer=self._maps[pe], offset=offset,
                          strides=array.strides)

    def describe(self) -> str:
        """The live regions as ``'name' [offset, end)`` text, for error messages."""
        return ", ".join(f"'{r.name}' [{r.offset}, {r.end})" for r in self._regions) or "none"

    # -- queued puts --------------------------------------------------------------------------
    def count(self, pe: int, nbytes: int) -> None:
        """Add one operation of ``nbytes`` bytes to PE ``pe`` to :attr:`traffic` (every put and
        signal of the simulated SHMEM facade; a signal counts 8 bytes)."""
        with self._pending_lock:
            self.traffic[pe, 0] += 1
            self.traffic[pe, 1] += nbytes

    def enqueue_put(self, dst: np.ndarray, data: np.ndarray) -> None:
        """Queue the copy of ``data`` into ``dst`` (1-D, same size; ``dst`` a peer view)."""
        with self._pending_lock:
            self._pending.append((dst, data))

    def deliver_puts(self) -> None:
        """Deliver every put this process queued (``quiet``/``fence``/barrier semantics)."""
        with self._pending_lock:
            for dst, data in self._pending:
                dst[...] = data
            self._pending.clear()

    # -- collectives ------------------------------------------------------------------------
    def barrier(self, what: str = "barrier") -> None:
        """Wait until every PE reached this barrier. Collective; does not deliver puts.

        ``what`` names the calling operation in the timeout message.
        """
        self._epoch += 1
        epoch = self._epoch
        with self.lock:
            self._words[self.rank][_ARRIVAL_WORD] = epoch
        if not poll(_Arrivals(self._words, epoch).all_arrived, self.timeout_s, heap=self):
            missing = self._missing(epoch)
            raise ShmemTimeoutError(
                f"PE {self.rank}: barrier #{epoch} ({what}) timed out after {self.timeout_s} s "
                f"waiting for PE(s) {missing} of {self.n_ranks} (job {self.job}): they failed, "
                "hang in a kernel, or skipped a collective call (alloc_symmetric, "
                "free_symmetric, barrier, allgather_object and close must be called by every "
                "PE in the same order)")
        # The arrivals were read without the lock; taking it once orders this PE's reads after
        # the barrier behind the peers' writes before it (each peer published its arrival
        # under the lock).
        with self.lock:
            pass

    def allgather(self, obj, what: str = "allgather_object") -> list:
        """Every PE's picklable ``obj`` in rank order, through the heap files' mailboxes.
        Collective; does not deliver queued puts.

        Raises :class:`ShmemError` on every PE if some PE's pickled object is larger than a
        mailbox slot (:data:`GATHER_SLOT_BYTES` less its 8-byte length).
        """
        # Two slots used alternately: a PE rewrites slot k % 2 only after the barrier of call
        # k + 1, which every PE enters after reading the slots of call k.
        data = pickle.dumps(obj)
        start = gather_offset(self.heap_bytes) + (self._gathers % 2) * GATHER_SLOT_BYTES
        self._gathers += 1
        capacity = GATHER_SLOT_BYTES - 8
        mine = self._maps[self.rank]
        if len(data) <= capacity:
            mine[start + 8:start + 8 + len(data)] = np.frombuffer(data, np.uint8)
        # The length is written even when the object does not fit, so every PE sees it and
        # raises the same error instead of waiting at the next collective.
        mine[start:start + 8].view(np.uint64)[0] = len(data)
        self.barrier(what)
        sizes = [int(m[start:start + 8].view(np.uint64)[0]) for m in self._maps]
        too_big = {pe: size for pe, size in enumerate(sizes) if size > capacity}
        if too_big:
            raise ShmemError(
                f"PE {self.rank}: {what}: the pickled objects of PE(s) {sorted(too_big)} have "
                f"{sorted(set(too_big.values()))} bytes; the simulated heap's mailbox holds "
                f"{capacity} per PE and call: gather something smaller (a digest, a shape), or "
                "move large data through symmetric memory")
        return [pickle.loads(m[start + 8:start + 8 + size].tobytes()) for m, size in zip(self._maps, sizes)]

    def raise_if_peer_exited(self, check: Callable[[], bool] | None = None) -> None:
        """Raise :class:`PEFailure` if a peer PE's process has exited (killed, crashed, or
        left without closing its session), unless ``check()`` now succeeds (the peer did
        what was waited for before it exited)."""
        gone = self._peers.exited()
        if not gone or (check is not None and check()):
            return
        names = ", ".join(f"PE {pe} (pid {self._peers.pid(pe)})" for pe in gone)
        raise PEFailure(
            f"PE {self.rank}: {names} of job {self.job} exited while this PE waited for it: it "
            "was killed, crashed, or left without closing its session, so the job cannot go "
            "on. Its launcher (run_pes, mpiexec) reports how it ended")

    # -- helpers ----------------------------------------------------------------------------
    def _missing(self, epoch: int) -> list[int]:
        with self.lock:
            return [pe for pe in range(self.n_ranks) if self._words[pe][_ARRIVAL_WORD] < epoch]

    def _check_same_everywhere(self, op: str, record: dict) -> None:
        """Collective: raise :class:`ShmemError` unless every PE passed an equal ``record``."""
        for pe, other in enumerate(self.allgather(record, op)):
            if other != record:
                raise ShmemError(
                    f"PE {self.rank}: {op} differs between PEs: PE {self.rank} did {record}, "
                    f"PE {pe} did {other}. Every PE must allocate and free the same regions in "
                    "the same order")

    def _region_at(self, offset: int) -> Region | None:
        i = bisect.bisect_right([r.offset for r in self._regions], offset) - 1
        if i >= 0 and offset < max(self._regions[i].end, self._regions[i].offset + 1):
            return self._regions[i]
        return None

    def _off_heap_message(self, op: str, address: int, nbytes: int) -> str:
        base = self._bases[self.rank]
        message = (
            f"PE {self.rank}: {op}: the array at address {address:#x} ({nbytes} bytes) is not on "
            f"this PE's symmetric heap (allocatable range {base + CONTROL_BYTES:#x}-"
            f"{base + CONTROL_BYTES + self.heap_bytes:#x}). Allocate it with Session.alloc_symmetric; "
            "if it was, pass it to the kernel through Session.launch or Session.as_kernel_arg "
            "(the simulator copies NumPy arguments)")
        for pe, peer_base in enumerate(self._bases):
            if pe != self.rank and peer_base <= address < peer_base + len(self._maps[pe]):
                message += (f"; it is inside PE {pe}'s copy (a peer view): pass the local "
                            f"symmetric array and pe={pe} instead")
        return message

    def _check_pe(self, pe: int, op: str) -> None:
        if not 0 <= pe < self.n_ranks:
            raise EPInputError(f"PE {self.rank}: {op}: pe={pe} is not in [0, {self.n_ranks})")


class _Arrivals:
    """Whether every PE has reached barrier ``epoch``, read from their arrival words.

    A PE's arrival word only grows, so a PE seen arrived stays arrived: each check resumes at
    the first PE not yet seen, and a barrier reads each word about once plus once per poll,
    not every word on every poll (PEs x polls, which at many PEs is most of a barrier's CPU).
    The words are read without the job's lock (an aligned 8-byte word written by its owner
    only); :meth:`SimHeap.barrier` takes the lock once afterwards.
    """

    def __init__(self, words: list[np.ndarray], epoch: int):
        self._words = words
        self._epoch = epoch
        self._next = 0  # the first PE not yet seen at the barrier

    def all_arrived(self) -> bool:
        while self._next < len(self._words) and self._words[self._next][_ARRIVAL_WORD] >= self._epoch:
            self._next += 1
        return self._next == len(self._words)


def _check_open_args(rank: int, n_ranks: int, job: str, heap_bytes: int, timeout_s: float) -> None:
    if not 0 <= rank < n_ranks:
        raise EPInputError(f"SimHeap.open: rank={rank} is not in [0, n_ranks={n_ranks})")
    if not _JOB_RE.match(job):
        raise EPInputError(f"SimHeap.open: job={job!r} must be letters, digits and '-' only")
    if heap_bytes <= 0:
        raise EPInputError(f"SimHeap.open: heap_bytes={heap_bytes} must be positive")
    if timeout_s <= 0:
        raise EPInputError(f"SimHeap.open: timeout_s={timeout_s} must be positive")


def _control_words() -> np.ndarray:
    """This process's words of its heap file's control area, written once at bring-up: its
    process id and start time (its peers watch it by them)."""
    words = np.zeros(_START_WORD + 1, np.uint64)
    words[_PID_WORD] = os.getpid()
    words[_START_WORD] = start_time(os.getpid())
    return words


def _wait_for_files(paths: list[str], file_bytes: int, rank: int, job: str, timeout_s: float) -> None:
    def sizes() -> list[int | None]:
        out = []
        for path in paths:
            try:
                out.append(os.stat(path).st_size)
            except FileNotFoundError:
                out.append(None)
        return out

    # A published file stays until every PE has mapped it, so each poll resumes at the first
    # file not yet seen: about one stat a file, not one a file and poll.
    seen = [0]

    def all_published() -> bool:
        while seen[0] < len(paths) and os.path.exists(paths[seen[0]]):
            seen[0] += 1
        return seen[0] == len(paths)

    if not poll(all_published, timeout_s, pause_cap_s=poll_pause_cap(len(paths))):
        missing = [pe for pe, size in enumerate(sizes()) if size is None]
        raise ShmemTimeoutError(
            f"PE {rank}: simulated heap bring-up of job {job} timed out after {timeout_s} s: "
            f"PE(s) {missing} never created their heap file in {SHM_DIR} (not started, "
            "crashed, or given another job id)")
    wrong = {pe: size for pe, size in enumerate(sizes()) if size != file_bytes}
    if wrong:
        raise ShmemError(
            f"PE {rank}: heap files of PE(s) {sorted(wrong)} have {sorted(set(wrong.values()))} "
            f"bytes, this PE's has {file_bytes}: every PE must open with the same heap_bytes")
