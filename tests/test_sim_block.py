"""The simulator's block execution as ep_runtime installs it (``ep_runtime/shmem/sim_block.py``):
the same semantics as numba-cuda's simulator, run in a simulated PE (where the session installs
it): barriers over the live threads, syncthreads_count/and/or, a raising thread that aborts the
threads waiting at a barrier (no hang) and names itself, one shared array per call site, device
functions that see the launch's ``cuda`` and leave their module's own afterwards, and the
launcher's NumPy error state in the simulated threads."""

from __future__ import annotations

import numpy as np
from numba import cuda

from ep_runtime.shmem.launch import run_pes

THREADS = 8


@cuda.jit(device=True)
def lane_times_ten():
    return cuda.threadIdx.x * 10


@cuda.jit
def early_exit_kernel(out):
    """Odd threads leave before the barriers; the even ones pass two and see each other's
    writes through shared memory."""
    t = cuda.threadIdx.x
    buf = cuda.shared.array(8, np.int64)
    if t % 2 == 1:
        out[t] = -1
        return
    buf[t] = t + 100
    cuda.syncthreads()
    total = 0
    for i in range(0, THREADS, 2):
        total += buf[i]
    cuda.syncthreads()
    out[t] = total


@cuda.jit
def vote_kernel(out):
    t = cuda.threadIdx.x
    out[0, t] = cuda.syncthreads_count(t < 3)
    out[1, t] = cuda.syncthreads_and(t < THREADS)
    out[2, t] = cuda.syncthreads_and(t < 3)
    out[3, t] = cuda.syncthreads_or(t == 5)
    out[4, t] = cuda.syncthreads_or(t > THREADS)


@cuda.jit
def shared_sites_kernel(out):
    """Two call sites, two arrays; one call site, one array for the whole block."""
    t = cuda.threadIdx.x
    a = cuda.shared.array(8, np.int32)
    b = cuda.shared.array(8, np.int32)
    a[t] = t
    b[t] = -t
    cuda.syncthreads()
    out[0, t] = a[(t + 1) % THREADS]
    out[1, t] = b[(t + 1) % THREADS]
    out[2, t] = lane_times_ten()


@cuda.jit
def raising_kernel(out):
    t = cuda.threadIdx.x
    if t == 3:
        out[100] = 1  # out of bounds: IndexError in thread 3
    cuda.syncthreads()
    out[t] = 1


@cuda.jit
def divide_kernel(x, out):
    t = cuda.threadIdx.x
    out[t] = x[t] / x[0]


def block_pe(session):
    import warnings

    import numba.cuda

    got = {}
    out = np.zeros(THREADS, np.int64)
    early_exit_kernel[1, THREADS](out)
    got["early_exit"] = out.copy()
    votes = np.zeros((5, THREADS), np.int32)
    vote_kernel[1, THREADS](votes)
    got["votes"] = votes
    sites = np.zeros((3, THREADS), np.int32)
    shared_sites_kernel[2, THREADS](sites)
    got["sites"] = sites
    got["module_restored"] = lane_times_ten.fn.__globals__["cuda"] is numba.cuda
    try:
        raising_kernel[1, THREADS](np.zeros(THREADS, np.int64))
        got["raised"] = None
    except IndexError as exc:
        got["raised"] = str(exc)
    again = np.zeros(THREADS, np.int64)
    early_exit_kernel[1, THREADS](again)  # the block after a failed one runs as before
    got["again"] = again
    x = np.zeros(THREADS, np.float32)
    with np.errstate(all="raise"):
        try:
            divide_kernel[1, THREADS](x, np.zeros(THREADS, np.float32))
            got["errstate_raise"] = None
        except FloatingPointError as exc:
            got["errstate_raise"] = str(exc)
    with np.errstate(all="ignore"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quotients = np.zeros(THREADS, np.float32)
        divide_kernel[1, THREADS](x, quotients)
    got["ignored_warnings"] = len(caught)
    got["quotients_nan"] = bool(np.isnan(quotients).all())
    return got


def test_the_block_execution_keeps_the_simulator_s_semantics():
    (got,) = run_pes(block_pe, 1, timeout_s=120)
    evens = sum(i + 100 for i in range(0, THREADS, 2))
    assert got["early_exit"].tolist() == [evens if t % 2 == 0 else -1 for t in range(THREADS)]
    assert got["again"].tolist() == got["early_exit"].tolist()
    assert got["votes"].tolist() == [[3] * THREADS, [1] * THREADS, [0] * THREADS, [1] * THREADS, [0] * THREADS]
    assert got["sites"][0].tolist() == [(t + 1) % THREADS for t in range(THREADS)]
    assert got["sites"][1].tolist() == [-((t + 1) % THREADS) for t in range(THREADS)]
    assert got["sites"][2].tolist() == [10 * t for t in range(THREADS)]
    assert got["module_restored"]
    assert got["raised"] is not None and "tid=[3, 0, 0]" in got["raised"], got["raised"]
    assert got["errstate_raise"] is not None and "encountered" in got["errstate_raise"], got["errstate_raise"]
    assert got["ignored_warnings"] == 0 and got["quotients_nan"]


@cuda.jit
def shared_flag_kernel(ids, seen):
    """Thread 0 sets a shared flag; after the barrier every thread reads it (dispatch_async's
    credit flag has this shape)."""
    t = cuda.threadIdx.x
    flag = cuda.shared.array(1, np.int32)
    ids[t] = id(flag)  # (the simulator runs Python: the array object each thread got)
    if t == 0:
        flag[0] = 1
    cuda.syncthreads()
    seen[t] = flag[0]


def racing_shared_pe(session):
    """``shared_flag_kernel`` with the block's look-up of its shared arrays made to give the GIL
    away on every miss, so all the threads reach the array's creation together (the window a
    loaded machine opens by chance)."""
    import time

    from numba.cuda.simulator import kernelapi

    class SlowMiss(dict):
        def get(self, key, default=None):
            found = super().get(key, default)
            if found is None:
                time.sleep(0.002)
            return found

    init = kernelapi.FakeCUDAShared.__init__

    def slow_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self._allocations = SlowMiss()

    kernelapi.FakeCUDAShared.__init__ = slow_init
    ids, seen = np.zeros(THREADS, np.int64), np.zeros(THREADS, np.int32)
    shared_flag_kernel[1, THREADS](ids, seen)
    return len(set(ids.tolist())), seen


def test_the_threads_of_a_block_share_one_array_even_when_they_create_it_together():
    (arrays, seen) = run_pes(racing_shared_pe, 1, timeout_s=120)[0]
    assert arrays == 1, f"{arrays} arrays for one call site: a thread kept one of its own"
    assert seen.tolist() == [1] * THREADS
