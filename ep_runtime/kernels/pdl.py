"""Programmatic dependent launch (PDL): a kernel's blocks start while the kernel before it on
the stream is finishing, and wait on the device, not in the launch queue.

Between two kernels launched on a stream the GPU leaves a gap (traced: docs/plans.md; PDL
shortens it; inside a CUDA graph, where the gap is already small, it changed nothing
measurable): the next grid is launched only after the previous one has fully completed and
flushed. With PDL (sm_90 and later) a kernel launched with the attribute
``CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION`` may be scheduled as soon as every block
of the previous kernel has executed ``griddepcontrol.launch_dependents`` (or exited); it must
execute ``griddepcontrol.wait`` before it touches anything the previous kernel writes: that
waits until the previous grid has completed and its memory is visible. Without the attribute
(Numba's own launch path, or before sm_90) both instructions do nothing and the stream orders
the kernels as usual.

- Whether a build uses it is the plan's choice (``Plan.pdl``: compute capability 9.0 or later and
  the session's fast launcher, which sets the attribute), passed to :func:`make_pdl` when the
  kernels are built; the kernel cache keys the builds apart.
- :func:`make_pdl`: the two device functions, ``pdl_wait`` and ``pdl_trigger``, called by every
  thread at the very start of each EP kernel, trigger first (every block of the previous kernel has already started:
  the trigger of a grid fires only once all of its blocks have executed it, so a dependent never
  takes an SM a block of its predecessor still needs) and wait before the first load of
  anything stream-ordered.
- :func:`programmatic`: marks a kernel (a dispatcher) built with PDL as one that waits first, so
  the session's fast launcher launches it with the attribute (:mod:`ep_runtime.shmem.fast_launch`).
  Only marked kernels get it: an unmarked kernel launched with it could read its predecessor's
  output before it is written.
"""

import functools

from ep_runtime.kernels.cuda_api import MLIR, SIMULATED, cuda, types

#: attribute set on marked dispatchers (read by the session's fast launcher)
MARK = "ep_runtime_programmatic"


def programmatic(dispatcher, enabled: bool):
    """Mark ``dispatcher`` (a kernel that calls ``pdl_wait`` before its first stream-ordered
    load, built by :func:`make_pdl` with ``enabled``) as launchable with PDL when ``enabled``.
    Returns it."""
    setattr(dispatcher, MARK, bool(enabled))
    return dispatcher


def is_programmatic(dispatcher) -> bool:
    """Whether ``dispatcher`` was marked by :func:`programmatic` with PDL on."""
    return bool(getattr(dispatcher, MARK, False))


if SIMULATED:

    def _wait():
        """The simulator runs one kernel at a time: nothing to wait for."""

    def _trigger():
        """The simulator runs one kernel at a time: nothing to trigger."""

elif MLIR:
    from ep_runtime.kernels.mlir_intrinsics import pdl_trigger as _trigger
    from ep_runtime.kernels.mlir_intrinsics import pdl_wait as _wait
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


@functools.lru_cache(maxsize=None)
def make_pdl(enabled: bool):
    """``(pdl_wait, pdl_trigger)``: device functions every thread of an EP kernel calls, trigger
    first, wait before its first stream-ordered load. With ``enabled`` (a closure constant, so
    the branches are pruned when off) ``pdl_wait`` is ``griddepcontrol.wait`` (until the
    previous kernel on the stream has completed and its memory is visible; at once when not
    launched with PDL) and ``pdl_trigger`` is ``griddepcontrol.launch_dependents`` (the next
    kernel, launched with PDL, may be scheduled once every block of this one has executed it);
    without, both do nothing. One pair per value, shared by every build."""
    ON = bool(enabled) and not SIMULATED  # the simulator runs one kernel at a time

    @cuda.jit(device=True)
    def pdl_wait():
        if ON:
            _wait()

    @cuda.jit(device=True)
    def pdl_trigger():
        if ON:
            _trigger()

    return pdl_wait, pdl_trigger
