"""Simulator backend of the SHMEM facade: NVSHMEM's device API over the simulated heap.

Import :mod:`ep_runtime.kernels.shmem`, not this module. Same names, argument order
(**destination first**) and semantics as :mod:`ep_runtime.kernels._shmem_nvshmem`, as plain
Python functions: a ``cuda.jit(device=True)`` function would make the simulator swap the
``cuda`` global of this module on every call, which races between the simulator's threads.

Array arguments may be what a simulated kernel receives (``FakeWithinKernelCUDAArray``),
``FakeCUDAArray`` or ``numpy.ndarray``; they must be C-contiguous. Destinations and signals
must lie on the simulated symmetric heap of this process's session
(:func:`ep_runtime.shmem.sim_heap.current_heap`), else :class:`SymmetricAddressError`.

Thread identity comes from the simulator's ``BlockThread`` (``threading.current_thread()``):
``_warp`` variants copy on lane 0 (``thread_id % 32 == 0``) and do not synchronize the warp;
``_block`` variants copy on thread 0 between two ``syncthreads()``. Outside a simulated kernel
the caller counts as thread 0 of a one-thread block.

Delivery: plain and ``_nbi`` puts snapshot ``src`` when called and are delivered at
``quiet()``/``fence()`` (all puts this process queued) or at a session barrier;
``put_signal*`` delivers its own data at once, then updates the signal. Every atomic and
signal access holds the job's one cross-process lock. Waits poll with a short sleep and raise
:class:`ShmemTimeoutError` after :func:`wait_timeout_s` seconds, so a deadlock fails a test
instead of hanging it. See :mod:`ep_runtime.shmem.sim_heap` for the simulator's limits.
"""

from __future__ import annotations

import operator
import os
import threading
import time

import numpy as np
from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray, FakeWithinKernelCUDAArray

from ep_runtime.core.errors import EPInputError, EPStateError, ShmemTimeoutError
from ep_runtime.shmem.sim_heap import WAIT_TIMEOUT_ENV, current_heap, poll

# NVSHMEM's values, the same as the facade's SIGNAL_* and CMP_* constants.
_SIGNAL_SET = 9
_SIGNAL_ADD = 10
_SIGNAL_OPS = (_SIGNAL_SET, _SIGNAL_ADD)
_COMPARISONS = {
    0: ("CMP_EQ", "==", operator.eq), 1: ("CMP_NE", "!=", operator.ne),
    2: ("CMP_GT", ">", operator.gt), 3: ("CMP_LE", "<=", operator.le),
    4: ("CMP_LT", "<", operator.lt), 5: ("CMP_GE", ">=", operator.ge),
}
_WARP_SIZE = 32
_U64_MASK = (1 << 64) - 1
# Long enough for a slow CI machine running 4 PEs on 2 cores, short enough to fail a test
# well before its launcher's timeout.
DEFAULT_WAIT_TIMEOUT_S = 20.0

_wait_timeout_override: float | None = None


def set_wait_timeout(seconds: float | None) -> None:
    """Limit of every unbounded simulated wait in this process (``None``: back to
    ``$EP_SIM_WAIT_TIMEOUT`` or :data:`DEFAULT_WAIT_TIMEOUT_S`)."""
    global _wait_timeout_override
    if seconds is not None and seconds <= 0:
        raise EPInputError(f"set_wait_timeout: seconds={seconds} must be positive (or None)")
    _wait_timeout_override = seconds


def wait_timeout_s() -> float:
    """The limit of unbounded waits: :func:`set_wait_timeout`, else ``$EP_SIM_WAIT_TIMEOUT``,
    else :data:`DEFAULT_WAIT_TIMEOUT_S`."""
    if _wait_timeout_override is not None:
        return _wait_timeout_override
    text = os.environ.get(WAIT_TIMEOUT_ENV)
    if text is None:
        return DEFAULT_WAIT_TIMEOUT_S
    try:
        return float(text)
    except ValueError:
        raise EPInputError(f"${WAIT_TIMEOUT_ENV}={text!r} is not a number of seconds") from None


# -- puts --------------------------------------------------------------------------------------
def put(dst, src, pe):
    """Copy ``src`` into PE ``pe``'s ``dst`` (delivered at ``quiet``/``fence``). One thread."""
    _queue_put("put", dst, src, pe)


def put_nbi(dst, src, pe):
    """Non-blocking :func:`put` (delivered at ``quiet``/``fence``). One thread."""
    _queue_put("put_nbi", dst, src, pe)


def put_warp(dst, src, pe):
    """:func:`put` by a warp: every lane calls with the same arguments; lane 0 copies."""
    if _is_lane_leader():
        _queue_put("put_warp", dst, src, pe)


def put_nbi_warp(dst, src, pe):
    """:func:`put_nbi` by a warp: every lane calls with the same arguments; lane 0 copies."""
    if _is_lane_leader():
        _queue_put("put_nbi_warp", dst, src, pe)


def put_block(dst, src, pe):
    """:func:`put` by a block: every thread calls with the same arguments; thread 0 copies
    between two ``syncthreads()``."""
    _by_block(_queue_put, "put_block", dst, src, pe)


def put_nbi_block(dst, src, pe):
    """:func:`put_nbi` by a block: every thread calls with the same arguments; thread 0 copies
    between two ``syncthreads()``."""
    _by_block(_queue_put, "put_nbi_block", dst, src, pe)


def put_signal(dst, src, sig, value, sig_op, pe):
    """Copy ``src`` into PE ``pe``'s ``dst`` now, then apply ``sig_op`` (SIGNAL_SET/ADD) with
    ``value`` to PE ``pe``'s ``sig[0]`` (uint64). Earlier queued puts are not flushed. One
    thread."""
    _put_signal_now("put_signal", dst, src, sig, value, sig_op, pe)


def put_signal_nbi(dst, src, sig, value, sig_op, pe):
    """Non-blocking :func:`put_signal` (the same in the simulator). One thread."""
    _put_signal_now("put_signal_nbi", dst, src, sig, value, sig_op, pe)


def put_signal_warp(dst, src, sig, value, sig_op, pe):
    """:func:`put_signal` by a warp: every lane calls with the same arguments; lane 0 copies
    and signals."""
    if _is_lane_leader():
        _put_signal_now("put_signal_warp", dst, src, sig, value, sig_op, pe)


def put_signal_nbi_warp(dst, src, sig, value, sig_op, pe):
    """:func:`put_signal_nbi` by a warp: every lane calls with the same arguments; lane 0
    copies and signals."""
    if _is_lane_leader():
        _put_signal_now("put_signal_nbi_warp", dst, src, sig, value, sig_op, pe)


def put_signal_block(dst, src, sig, value, sig_op, pe):
    """:func:`put_signal` by a block: every thread calls with the same arguments; thread 0
    copies and signals between two ``syncthreads()``."""
    _by_block(_put_signal_now, "put_signal_block", dst, src, sig, value, sig_op, pe)


def put_signal_nbi_block(dst, src, sig, value, sig_op, pe):
    """:func:`put_signal_nbi` by a block: every thread calls with the same arguments; thread 0
    copies and signals between two ``syncthreads()``."""
    _by_block(_put_signal_now, "put_signal_nbi_block", dst, src, sig, value, sig_op, pe)


def quiet():
    """Deliver every put this process queued. One thread."""
    current_heap().deliver_puts()


def fence():
    """Order queued puts before later puts and signals: the simulator delivers them. One
    thread."""
    current_heap().deliver_puts()


# -- signals -----------------------------------------------------------------------------------
def signal_op(sig, value, sig_op, pe):
    """Apply ``sig_op`` (SIGNAL_SET/ADD) with ``value`` to PE ``pe``'s ``sig[0]`` (uint64),
    atomically. Not ordered after earlier puts (no flush). One thread."""
    heap = current_heap()
    target = _signal_target(heap, "signal_op", sig, sig_op, pe)
    heap.count(int(pe), 8)
    _apply_signal(heap, target, value, sig_op)


def signal_fetch(sig):
    """This PE's ``sig[0]`` (uint64 scalar), read under the job lock. One thread."""
    heap = current_heap()
    word, _ = _local_signal(heap, "signal_fetch", sig)
    return _read(heap, word)


def signal_wait(sig, cmp, value):
    """Poll this PE's ``sig[0]`` until ``sig[0] <cmp> value`` holds; return the observed value.

    One thread. Unbounded on a GPU; here :class:`ShmemTimeoutError` after
    :func:`wait_timeout_s` seconds, naming the PE, the signal's region and index, the
    comparison, the expected and the observed value.
    """
    heap = current_heap()
    word, label = _local_signal(heap, "signal_wait", sig)
    if cmp not in _COMPARISONS:
        raise EPInputError(f"PE {heap.rank}: signal_wait: cmp={cmp} is not one of CMP_EQ..CMP_GE (0-5)")
    name, symbol, compare = _COMPARISONS[cmp]
    return _wait(heap, "signal_wait", word, label, lambda seen: compare(seen, int(value)),
                 f"sig {symbol} {int(value)} ({name})")


def wait_signal_ge(sig, value, timeout_ns):
    """Poll this PE's ``sig[0]`` until it is >= ``value`` or ``timeout_ns`` passed; return the
    last observed value (the caller compares it with ``value``). One thread.

    ``timeout_ns == 0`` means no limit on a GPU; here it falls back to :func:`wait_timeout_s`
    and raises :class:`ShmemTimeoutError` so the simulator never hangs.
    """
    heap = current_heap()
    word, label = _local_signal(heap, "wait_signal_ge", sig)
    want = int(value)
    if timeout_ns == 0:
        return _wait(heap, "wait_signal_ge", word, label, lambda seen: seen >= want,
                     f"sig >= {want}")
    _, seen = _poll_signal(heap, word, lambda seen: seen >= want, int(timeout_ns) / 1e9)
    return seen


def globaltimer_ns():
    """Nanoseconds of a monotonic clock (``time.monotonic_ns``). Any thread."""
    return time.monotonic_ns()


# -- atomics -----------------------------------------------------------------------------------
def atomic_add(dst, value, pe):
    """PE ``pe``'s ``dst[0] += value``, atomically across processes. One thread."""
    atomic_fetch_add(dst, value, pe)


def atomic_set(dst, value, pe):
    """PE ``pe``'s ``dst[0] = value``, atomically across processes. One thread."""
    heap, word = _atomic_target("atomic_set", dst, pe)
    with heap.lock:
        word[...] = _cast(value, word.dtype)


def atomic_fetch(dst, pe):
    """PE ``pe``'s ``dst[0]``, read atomically. One thread."""
    heap, word = _atomic_target("atomic_fetch", dst, pe)
    return _read(heap, word)


def atomic_fetch_add(dst, value, pe):
    """PE ``pe``'s ``dst[0] += value`` atomically (integers wrap); returns the old value. One
    thread."""
    heap, word = _atomic_target("atomic_fetch_add", dst, pe)
    with heap.lock:
        old = word[0]
        np.add(word, _cast(value, word.dtype), out=word)
    return old


def atomic_compare_swap(dst, cond, value, pe):
    """PE ``pe``'s ``dst[0] = value`` if it equals ``cond``, atomically; returns the old value.
    One thread."""
    heap, word = _atomic_target("atomic_compare_swap", dst, pe)
    with heap.lock:
        old = word[0]
        if old == _cast(cond, word.dtype):
            word[...] = _cast(value, word.dtype)
    return old


def atomic_inc(dst, pe):
    """PE ``pe``'s ``dst[0] += 1``, atomically. One thread."""
    atomic_fetch_add(dst, 1, pe)


def atomic_fetch_inc(dst, pe):
    """PE ``pe``'s ``dst[0] += 1`` atomically; returns the old value. One thread."""
    return atomic_fetch_add(dst, 1, pe)


# -- identity ----------------------------------------------------------------------------------
def my_pe():
    """This PE's rank. Any thread."""
    return current_heap().rank


def n_pes():
    """The number of PEs. Any thread."""
    return current_heap().n_ranks


# -- helpers -----------------------------------------------------------------------------------
def _ndarray(x, op: str, what: str) -> np.ndarray:
    """The ndarray behind a kernel argument; C-contiguous, else :class:`EPInputError`."""
    if isinstance(x, FakeWithinKernelCUDAArray):
        x = x._item
    if isinstance(x, FakeCUDAArray):
        x = x._ary
    if not isinstance(x, np.ndarray):
        raise EPInputError(f"{op}: {what} must be an array, got {type(x).__name__}")
    if not x.flags.c_contiguous:
        raise EPInputError(f"{op}: {what} (shape {x.shape}, strides {x.strides}) is not "
                           "C-contiguous: NVSHMEM copies contiguous elements")
    return x


def _thread_id() -> int:
    return getattr(threading.current_thread(), "thread_id", 0)


def _is_lane_leader() -> bool:
    return _thread_id() % _WARP_SIZE == 0


def _syncthreads() -> None:
    thread = threading.current_thread()
    if hasattr(thread, "syncthreads"):
        thread.syncthreads()


def _by_block(op, *args) -> None:
    """A block-collective operation: every thread calls; thread 0 runs ``op(*args)`` between
    two ``syncthreads()`` (so the source is complete before and the result visible after)."""
    _syncthreads()
    if _thread_id() == 0:
        op(*args)
    _syncthreads()


def _abort_check() -> None:
    """Stop a polling thread whose block was aborted (another of its threads raised)."""
    if getattr(threading.current_thread(), "abort", False):
        raise EPStateError("simulated block aborted: another thread of the block raised")


def _put_operands(heap, op: str, dst, src, pe) -> tuple[np.ndarray, np.ndarray]:
    """``(peer destination, snapshot of src)``: 1-D, ``min(dst.size, src.size)`` elements."""
    dst = _ndarray(dst, op, "dst")
    src = _ndarray(src, op, "src")
    if dst.dtype != src.dtype:
        raise EPInputError(f"PE {heap.rank}: {op}: dst is {dst.dtype} but src is {src.dtype}; "
                           "NVSHMEM puts need one element type (move bfloat16 as uint16)")
    count = min(dst.size, src.size)
    target = heap.peer_view(dst, int(pe), op).reshape(-1)[:count]
    heap.count(int(pe), target.nbytes)
    return target, src.reshape(-1)[:count].copy()


def _queue_put(op: str, dst, src, pe) -> None:
    heap = current_heap()
    heap.enqueue_put(*_put_operands(heap, op, dst, src, pe))


def _put_signal_now(op: str, dst, src, sig, value, sig_op, pe) -> None:
    heap = current_heap()
    sig_target = _signal_target(heap, op, sig, sig_op, pe)
    target, data = _put_operands(heap, op, dst, src, pe)
    target[...] = data
    _apply_signal(heap, sig_target, value, sig_op)


def _signal_array(heap, op: str, sig) -> np.ndarray:
    sig = _ndarray(sig, op, "sig")
    if sig.dtype != np.uint64 or sig.size < 1:
        raise EPInputError(f"PE {heap.rank}: {op}: sig is {sig.dtype} with {sig.size} elements; "
                           "signals are uint64: pass a one-element slice sig[i:i + 1]")
    return sig.reshape(-1)[:1]


def _signal_target(heap, op: str, sig, sig_op, pe) -> np.ndarray:
    """PE ``pe``'s copy of ``sig[0]`` as a one-element array."""
    if sig_op not in _SIGNAL_OPS:
        raise EPInputError(f"PE {heap.rank}: {op}: sig_op={sig_op} is neither SIGNAL_SET (9) "
                           "nor SIGNAL_ADD (10)")
    return heap.peer_view(_signal_array(heap, op, sig), int(pe), op)


def _local_signal(heap, op: str, sig) -> tuple[np.ndarray, str]:
    """This PE's ``sig[0]`` as a one-element array, and its label for messages."""
    word = _signal_array(heap, op, sig)
    offset, label = heap.locate(word, op)
    return word, f"{label} at heap offset {offset}"


def _apply_signal(heap, target: np.ndarray, value, sig_op) -> None:
    with heap.lock:
        if sig_op == _SIGNAL_SET:
            target[...] = _cast(value, target.dtype)
        else:
            np.add(target, _cast(value, target.dtype), out=target)


def _wait(heap, op: str, word: np.ndarray, label: str, done, condition: str):
    """Poll ``word`` until ``done(value)``; :class:`ShmemTimeoutError` after the module limit."""
    limit = wait_timeout_s()
    ok, seen = _poll_signal(heap, word, done, limit)
    if ok:
        return seen
    raise ShmemTimeoutError(
        f"PE {heap.rank}: {op} timed out after {limit} s on signal {label}: waited for "
        f"{condition}, observed {int(seen)}. Check that the sending PE runs, "
        "signals this PE and index, and that no block waits for a later block (the simulator "
        f"runs blocks one at a time). Limit: set_wait_timeout() or ${WAIT_TIMEOUT_ENV}")


def _poll_signal(heap, word: np.ndarray, done, timeout_s: float):
    """Poll ``word`` until ``done(int value)`` or ``timeout_s``; ``(succeeded, last value)``."""
    seen = [_read(heap, word)]

    def check() -> bool:
        _abort_check()
        seen[0] = _read(heap, word)
        return done(int(seen[0]))

    ok = poll(check, timeout_s)
    return ok, seen[0]


def _read(heap, word: np.ndarray):
    with heap.lock:
        return word[0]


def _atomic_target(op: str, dst, pe):
    """``(heap, PE pe's copy of dst[0] as a one-element array)``."""
    heap = current_heap()
    dst = _ndarray(dst, op, "dst")
    if dst.size < 1:
        raise EPInputError(f"PE {heap.rank}: {op}: dst is empty; pass a one-element slice")
    return heap, heap.peer_view(dst.reshape(-1)[:1], int(pe), op)


def _cast(value, dtype: np.dtype) -> np.ndarray:
    """``value`` as a 0-d array of ``dtype``; integers wrap modulo 2**bits like the GPU."""
    if dtype.kind in "iu":
        return np.array(int(value) & _U64_MASK, dtype=np.uint64).astype(dtype)
    return np.array(value, dtype=dtype)


__all__ = [
    "put", "put_nbi", "put_warp", "put_nbi_warp", "put_block", "put_nbi_block",
    "put_signal", "put_signal_nbi", "put_signal_warp", "put_signal_nbi_warp",
    "put_signal_block", "put_signal_nbi_block", "signal_op", "signal_wait", "signal_fetch",
    "wait_signal_ge", "quiet", "fence", "atomic_add", "atomic_set", "atomic_fetch",
    "atomic_fetch_add", "atomic_compare_swap", "atomic_inc", "atomic_fetch_inc", "my_pe",
    "n_pes", "globaltimer_ns",
]
