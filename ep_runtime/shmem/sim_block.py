"""How the simulator runs a block: a barrier the threads keep, not a poller, and cheap calls.

Numba's CUDA simulator runs each block of a launch as one Python thread per CUDA thread,
managed by ``numba.cuda.simulator.kernel.BlockManager``. Its ``run`` polls every thread in a
tight loop (``syncthreads_blocked``, ``is_alive``) to find when all of them sit in
``syncthreads`` and then wakes them: the poller holds the GIL most of the time, so the threads
it waits for crawl, and each ``Thread.start`` waits for a GIL that the started threads keep.
On the simulator the EP kernels' wall time was mostly that.

:func:`install` replaces the block's execution (in this process, once) by an equivalent one
driven by a condition variable:

- ``syncthreads`` is a barrier over the block's *live* threads: the last thread to arrive
  releases the others, and a thread that exits counts as arrived (as the simulator's poller
  and the hardware treat exited threads). ``syncthreads_count/and/or`` keep the simulator's
  own code, which calls ``syncthreads``.
- The threads of a block are started first and then released together, so no ``start`` waits
  for a running thread to give up the GIL.
- Each thread runs in a copy of the launching thread's context variables, NumPy's error
  state (``np.errstate``) among them: a kernel launched under ``np.errstate(all="ignore")``
  computes without warnings, as the launcher asked (the simulator's threads started with
  NumPy's defaults, whatever the caller set).
- A device function's module has its ``cuda`` swapped for the launch's fake module once per
  block, while the block runs, instead of around every call (the simulator scans the module's
  globals under two locks that all the block's threads contend for, on each call).
- ``cuda.shared.array`` finds the block's array by its caller's file and line from the
  caller's frame, as the simulator does, without extracting (and reading the source of) the
  whole stack on every call.
- A numba scalar type called on a number (``uint64(x)``) makes the NumPy scalar directly
  (:func:`_fast_scalar_casts`), as numba's own cast does, skipping its per-call import and
  checks.
- The block's manager sleeps until every thread has exited or one has raised. As before, the
  first exception is re-raised with its thread and block in the message, and the threads
  still waiting in ``syncthreads`` are aborted (a thread in a loop that never reaches one is
  left running, daemonic, as the simulator leaves it).

What a kernel computes does not change: the same threads run the same code with the same
barrier semantics; only who wakes whom does. Relies on numba-cuda 0.30.4's simulator layout
(pinned in pyproject.toml): ``BlockManager.run(grid_point, *args)``, ``BlockThread`` with
``syncthreads``, ``exception``, ``threadIdx``/``blockIdx``.
"""

from __future__ import annotations

import contextvars
import functools
import sys
import threading

import numpy as np

_lock = threading.Lock()
_installed = False


class _Block:
    """The shared state of one simulated block: live threads, barrier arrivals, abort."""

    def __init__(self, n_threads: int):
        self.cond = threading.Condition()
        self.go = threading.Event()
        self.live = n_threads
        self.arrived = 0
        self.generation = 0
        self.error = None  # (exception, traceback) of the first thread that raised
        #: id(module globals) -> the simulator's swap of ``cuda`` in them, held for the block
        self.swapped: dict = {}
        self.swap_lock = threading.Lock()
        self.ended = False

    def restore_modules(self) -> None:
        """Undo the block's swaps of ``cuda`` in device functions' modules (newest first)."""
        with self.swap_lock:
            swaps, self.swapped = list(self.swapped.values()), {}
            self.ended = True  # a thread left running after an error swaps per call again
        for swap in reversed(swaps):
            swap.__exit__(None, None, None)

    def release_if_complete(self) -> None:
        """Open the barrier when every live thread has arrived (hold ``cond``)."""
        if self.arrived and self.arrived >= self.live:
            self.arrived = 0
            self.generation += 1
            self.cond.notify_all()


def _syncthreads(thread) -> None:
    block = thread._ep_block
    with block.cond:
        if block.error is not None:
            raise RuntimeError("abort flag set on syncthreads call")
        generation = block.generation
        block.arrived += 1
        block.release_if_complete()
        while block.generation == generation and block.error is None:
            block.cond.wait()
        if block.generation == generation:
            raise RuntimeError("abort flag set on syncthreads clear")


def _thread_run(thread, run) -> None:
    block = thread._ep_block
    block.go.wait()
    try:
        run(thread)  # the simulator's: records an exception with tid/ctaid in thread.exception
    finally:
        with block.cond:
            block.live -= 1
            if thread.exception is not None and block.error is None:
                block.error = thread.exception
            block.release_if_complete()
            block.cond.notify_all()


def _block_run(manager, grid_point, *args) -> None:
    from numba.cuda.simulator.kernel import BlockThread

    points = list(np.ndindex(*manager._block_dim))
    block = _Block(len(points))
    threads = []
    for block_point in points:
        # each thread in a copy of the launcher's context: NumPy's error state (np.errstate)
        # is a context variable, so a kernel runs under the caller's
        context = contextvars.copy_context()
        thread = BlockThread(functools.partial(context.run, manager._f, *args), manager, grid_point, block_point,
                             manager._debug)
        thread._ep_block = block
        threads.append(thread)
    for thread in threads:
        thread.start()
    block.go.set()
    try:
        with block.cond:
            while block.live and block.error is None:
                block.cond.wait()
            error = block.error
    finally:
        block.restore_modules()
    if error is not None:
        raise error[0].with_traceback(error[1])


def _device_call(kernel, original, *args):
    """A device function called by a simulated thread: its module's ``cuda`` is swapped for
    the launch's fake module once per block (and restored when the block ends), not around
    every call as the simulator does (a scan of the module's globals under two locks that
    every thread of the block contends for)."""
    block = getattr(threading.current_thread(), "_ep_block", None)
    if block is None:
        return original(kernel, *args)
    fn = kernel.fn
    key = id(fn.__globals__)
    if key not in block.swapped:
        from numba.cuda.simulator import kernel as sim_kernel
        from numba.cuda.simulator.kernelapi import swapped_cuda_module

        with block.swap_lock:
            ended = block.ended
            if not ended and key not in block.swapped:
                swap = swapped_cuda_module(fn, sim_kernel._get_kernel_context())
                swap.__enter__()
                block.swapped[key] = swap
        if ended:
            return original(kernel, *args)
    return fn(*args)


def _shared_array_of(original):
    """``cuda.shared.array``: the simulator's rule (one array per block and call site, the call
    site being the caller's file and line), with the call site read from the caller's frame.

    The block's threads reach a call site at once, so the array is inserted with one atomic
    ``dict.setdefault``: with a look-up then a store (the simulator's own code), two threads that
    both missed would each keep an array of their own, and a flag one of them set would read as
    uninitialized memory in the other (a sender thread returning early, its rows never stored)."""
    from numba.cuda import types
    from numba.cuda.np import numpy_support

    def array(shared, shape, dtype, alignment=None):
        if shape == 0 or alignment is not None:  # dynamic shared memory, or the simulator's error
            return original(shared, shape, dtype, alignment)
        if isinstance(dtype, types.Type):
            dtype = numpy_support.as_dtype(dtype)
        frame = sys._getframe(1)
        caller = (frame.f_code.co_filename, frame.f_lineno)
        found = shared._allocations.get(caller)
        if found is None:  # the first thread here makes it; one atomic insert, so all share one
            found = shared._allocations.setdefault(caller, np.empty(shape, dtype))
        return found

    return array


def install() -> bool:
    """Make the simulator run blocks as described above, in this process (idempotent).
    Returns whether the simulator's block execution is the one this module installs; False
    where numba-cuda's simulator does not have the layout it relies on."""
    global _installed
    with _lock:
        if _installed:
            return True
        try:
            from numba.cuda.simulator import kernel as sim_kernel
        except ImportError:
            return False
        thread_cls, manager_cls = getattr(sim_kernel, "BlockThread", None), getattr(sim_kernel, "BlockManager", None)
        if not (thread_cls and manager_cls and callable(getattr(thread_cls, "syncthreads", None))):
            return False
        from numba.cuda.simulator import kernelapi

        kernel_cls, shared_cls = getattr(sim_kernel, "FakeCUDAKernel", None), getattr(kernelapi, "FakeCUDAShared", None)
        if not (kernel_cls and shared_cls and hasattr(sim_kernel, "_get_kernel_context")
                and hasattr(kernelapi, "swapped_cuda_module")):
            return False  # checked before anything is patched: all or nothing
        original_run = thread_cls.run
        thread_cls.run = lambda thread: _thread_run(thread, original_run)
        thread_cls.syncthreads = _syncthreads
        manager_cls.run = _block_run
        original_call = kernel_cls.__call__

        def call(kernel, *args):
            if kernel._device or sim_kernel._get_kernel_context() is not None:
                return _device_call(kernel, original_call, *args)
            return original_call(kernel, *args)

        kernel_cls.__call__ = call
        shared_cls.array = _shared_array_of(shared_cls.array)
        _fast_scalar_casts()
        _installed = True
        return True


def _fast_scalar_casts() -> None:
    """A numba integer or float type called on one number (the kernels' ``uint64(x)``,
    ``int32(x)``, ``float32(x)``) returns the NumPy scalar of the type, as numba's
    ``cast_python_value`` does, without the import, the ABC check and the look-up that
    ``Type.__call__`` makes on every call (the EP kernels cast in their inner loops). Any other
    call (a signature, a non-number) takes numba's path."""
    from numba.core import types

    numbers = (int, float, bool, np.integer, np.floating, np.bool_)
    constructors: dict = {}

    def for_type(original):
        def call(self, *args):
            if len(args) == 1 and isinstance(args[0], numbers):
                make = constructors.get(self.name)
                if make is None:
                    make = constructors.setdefault(self.name, getattr(np, self.name))
                return make(args[0])
            return original(self, *args)
        return call

    for cls in (types.Integer, types.Float):
        cls.__call__ = for_type(cls.__call__)
