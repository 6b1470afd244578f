"""Programmatic dependent launch (PDL): a kernel's blocks start while the kernel before it on
the stream is finishing, and wait on the device, not in the launch queue.

Between two kernels launched on a stream the GPU left 2.1-2.4 us (traced on one H200:
docs/throughput.md, "v10"; 0.9-1.0 us with PDL; inside a CUDA graph, where the gap is already
small, it changed nothing measurable): the next grid is launched only after the previous one
has fully completed and flushed. With PDL (sm_90 and later) a kernel launched with the attribute
``CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION`` may be scheduled as soon as every block
of the previous kernel has executed ``griddepcontrol.launch_dependents`` (or exited); it must
execute ``griddepcontrol.wait`` before it touches anything the previous kernel writes: that
waits until the previous grid has completed and its memory is visible. Without the attribute
(Numba's own launch path, or before sm_90) both instructions do nothing and the stream orders
the kernels as usual.

- :data:`ENABLED`: whether the EP kernels are built with the two instructions and launched with
  the attribute. ``EP_RUNTIME_PDL`` = ``auto`` (default: on when device 0's compute capability
  is 9.0 or later, off in the simulator), ``1`` or ``0``, read when this module is first
  imported (before the kernels are built; the kernel cache keys the builds apart).
- :func:`dependency_wait` and :func:`trigger_dependents`: called by every thread at the very
  start of each EP kernel, trigger first (every block of the previous kernel has already started:
  the trigger of a grid fires only once all of its blocks have executed it, so a dependent never
  takes an SM a block of its predecessor still needs) and wait before the first load of
  anything stream-ordered.
- :func:`programmatic`: marks a kernel (a dispatcher) as one that waits first, so the session's
  fast launcher may launch it with the attribute (:mod:`ep_runtime.shmem.fast_launch`). Only
  marked kernels get it: an unmarked kernel launched with it could read its predecessor's
  output before it is written.
"""

import os

from numba import types

from ep_runtime.kernels.cuda_api import SIMULATED, cuda

ENV = "EP_RUNTIME_PDL"


def _enabled() -> bool:
    """:data:`ENABLED` from ``EP_RUNTIME_PDL`` (raises EPConfigError for another value)."""
    value = os.environ.get(ENV, "auto").strip().lower()
    if value not in ("auto", "1", "on", "true", "yes", "0", "off", "false", "no"):
        from ep_runtime.errors import EPConfigError

        raise EPConfigError(f"{ENV}={value!r}: expected auto, 1 or 0 (programmatic dependent launch of the "
                            f"EP kernels; auto turns it on for compute capability 9.0 and later).")
    if SIMULATED or value in ("0", "off", "false", "no"):
        return False  # the simulator runs one kernel at a time
    return value != "auto" or _device_cc_major() >= 9


def _device_cc_major() -> int:
    """Compute capability major of device 0, from the driver (no CUDA context is made); 0 when
    no GPU can be queried."""
    try:
        from cuda.bindings import driver

        (err,) = driver.cuInit(0)
        if err != driver.CUresult.CUDA_SUCCESS:
            return 0
        err, major = driver.cuDeviceGetAttribute(
            driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, 0)
        return int(major) if err == driver.CUresult.CUDA_SUCCESS else 0
    except Exception:  # noqa: BLE001 (no driver, no device: no PDL)
        return 0


ENABLED = _enabled()

#: attribute set on marked dispatchers (read by the session's fast launcher)
MARK = "ep_runtime_programmatic"


def programmatic(dispatcher):
    """Mark ``dispatcher`` (a kernel that calls :func:`dependency_wait` before its first
    stream-ordered load) as launchable with PDL when :data:`ENABLED`. Returns it."""
    setattr(dispatcher, MARK, ENABLED)
    return dispatcher


def is_programmatic(dispatcher) -> bool:
    """Whether ``dispatcher`` was marked by :func:`programmatic` with PDL enabled."""
    return bool(getattr(dispatcher, MARK, False))


if SIMULATED:

    def _wait():
        """The simulator runs one kernel at a time: nothing to wait for."""

    def _trigger():
        """The simulator runs one kernel at a time: nothing to trigger."""

else:
    from llvmlite import ir
    from numba.core.extending import intrinsic

    def _statement(builder, text):
        """Emit the PTX statement ``text`` with a memory clobber (no load or store moves
        across it)."""
        fnty = ir.FunctionType(ir.VoidType(), [])
        builder.call(ir.InlineAsm(fnty, text, "~{memory}", side_effect=True), [])

    @intrinsic
    def _wait(typingctx):
        def codegen(context, builder, signature, args):
            _statement(builder, "griddepcontrol.wait;")
            return context.get_dummy_value()

        return types.void(), codegen

    @intrinsic
    def _trigger(typingctx):
        def codegen(context, builder, signature, args):
            _statement(builder, "griddepcontrol.launch_dependents;")
            return context.get_dummy_value()

        return types.void(), codegen


# ENABLED is read inside the functions: a compile-time constant (the branch is pruned when off),
# and a global the kernel cache's key records, so builds with and without PDL are keyed apart
# (a cached kernel without the wait, launched with the attribute, would race its predecessor).
@cuda.jit(device=True)
def dependency_wait():
    """``griddepcontrol.wait`` when :data:`ENABLED`: until the previous kernel on the stream has
    completed and its memory is visible (at once when not launched with PDL). Every thread."""
    if ENABLED:
        _wait()


@cuda.jit(device=True)
def trigger_dependents():
    """``griddepcontrol.launch_dependents`` when :data:`ENABLED`: the next kernel (launched
    with PDL) may be scheduled once every block of this one has executed this. Every thread."""
    if ENABLED:
        _trigger()
