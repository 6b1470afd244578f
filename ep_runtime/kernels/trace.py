"""Phase time stamps inside the kernels, to find where a kernel's fixed cost goes.

Off unless ``EP_RUNTIME_TRACE=1`` is in the environment when this module is first imported
(before the kernels are built). ``TRACE`` is then a compile-time constant: with it off every
stamp below compiles to nothing, and the kernel cache keys the two builds apart (the constant
is part of the kernels' key). With it on, the kernels write ``%globaltimer`` nanoseconds into
the trace words of the ``status`` region (``status[TRACE_BASE + slot]``, ``TRACE_LEN`` of them,
:mod:`ep_runtime.core.layout`); ``tests/gpu/trace_phases.py`` clears them before a call and reads
them after it. Slots are named in :data:`SLOTS`.

- :func:`stamp_first`: block 0, thread 0 stores the time (block 0 starts first in practice:
  the kernel's start).
- :func:`stamp_last`: thread 0 of every block raises the slot to its time (atomic max): when
  the last block passed that point.
"""

import os

from ep_runtime.kernels import shmem
from ep_runtime.kernels.cuda_api import cuda, int64
from ep_runtime.kernels.protocol import TRACE_BASE, TRACE_LEN

TRACE = os.environ.get("EP_RUNTIME_TRACE", "").strip().lower() in ("1", "true", "yes", "on")

#: slot -> (kernel, point). A kernel's points are measured from its ``start`` slot.
SLOTS = {
    0: ("dispatch_async", "start"),
    30: ("dispatch_async", "started (last block)"),
    5: ("dispatch_async", "token credits seen (block 0)"),
    4: ("dispatch_async", "routing rows sent (last block)"),
    31: ("dispatch_async", "token rows begun (last token block)"),
    1: ("dispatch_async", "tokens sent (last block)"),
    19: ("dispatch_async", "ranks computed and staged (routing block)"),
    2: ("dispatch_async", "ranks and counts sent (last block)"),
    3: ("dispatch_async", "ticket taken (last block)"),
    6: ("dispatch_async", "signalled (end)"),
    8: ("dispatch_wait", "start"),
    23: ("dispatch_wait", "started (last block)"),
    15: ("dispatch_wait", "signals seen (block 0)"),
    9: ("dispatch_wait", "signals seen (last block)"),
    14: ("dispatch_wait", "offsets scanned (last block)"),
    10: ("dispatch_wait", "offsets written (last block)"),
    11: ("dispatch_wait", "end (last block)"),
    # (12 and 13 also stamp the copy of a copying route-first dispatch_wait, gather_rows: 12 when its
    # first copying block starts)
    12: ("dispatch_copy", "start"),
    13: ("dispatch_copy", "end (last block)"),
    16: ("combine_async", "start"),
    17: ("combine_async", "partials sent (last block)"),
    18: ("combine_async", "end (last block)"),
    20: ("combine_wait", "start"),
    22: ("combine_wait", "end (last block)"),
    29: ("dispatch_async", "routing signalled (land: last route ticket; route first: routing block)"),
    35: ("dispatch_wait", "routing seen (route first)"),
    36: ("dispatch_wait", "rows placed (route first)"),
    37: ("dispatch_wait", "rows counted (route first)"),
    38: ("dispatch_wait", "first rows scanned (route first)"),
    39: ("dispatch_wait", "segments written (route first)"),
    24: ("dispatch_land", "start"),
    25: ("dispatch_land", "routing seen (last block)"),
    26: ("dispatch_land", "segments written (last block)"),
    27: ("dispatch_land", "rows placed and landed (last block)"),
    28: ("dispatch_land", "end (last block)"),
    32: ("dispatch_dense", "start"),
    33: ("dispatch_dense", "rows placed and copied (last block)"),
    34: ("dispatch_dense", "end (last block)"),
    7: ("dispatch_batched", "start"),
    21: ("dispatch_batched", "end (last block)"),
}
assert max(SLOTS) < TRACE_LEN


@cuda.jit(device=True)
def stamp_first(status, slot):
    """Block 0, thread 0: ``status[TRACE_BASE + slot] = now`` (when TRACE)."""
    if TRACE:
        if cuda.blockIdx.x == 0 and cuda.threadIdx.x == 0:
            status[TRACE_BASE + slot] = int64(shmem.globaltimer_ns())


@cuda.jit(device=True)
def stamp_last(status, slot):
    """Thread 0 of each block: raise ``status[TRACE_BASE + slot]`` to now (when TRACE)."""
    if TRACE:
        if cuda.threadIdx.x == 0:
            cuda.atomic.max(status, TRACE_BASE + slot, int64(shmem.globaltimer_ns()))
