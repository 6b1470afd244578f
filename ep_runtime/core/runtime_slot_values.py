"""The slot-value calls of :class:`~ep_runtime.core.runtime.EPRuntime`: ``slot_values_async`` /
``slot_values_wait`` (and ``slot_values``, the two then a synchronize) bring one float32 per
expert-batch row home to the (token, top-k slot) it came from: a backward's gradient of the router
weights, on its dispatch, before its combine (docs/plans.md, "One layer's backward").

Mixed into :class:`~ep_runtime.core.runtime.EPRuntime`: its methods use the regions, plan and
prepared launches the runtime's constructor makes, and its ``_require`` (the call order),
``_prepare`` (a launch's arguments) and ``_run`` (the launch).
"""

from __future__ import annotations

import numpy as np

from ep_runtime.core import arrays
from ep_runtime.core.errors import EPStateError
from ep_runtime.core.handles import DispatchHandle, SlotValuesHandle, from_fields
from ep_runtime.core.runtime_state import State


class SlotValueCalls:
    """The slot-value calls of :class:`~ep_runtime.core.runtime.EPRuntime` (a mixin: see the module)."""

    def slot_values_async(self, values, handle: DispatchHandle) -> SlotValuesHandle:
        """Start sending one float32 per expert-batch row home, to the (token, top-k slot) the row
        came from. Collective; enqueued on the stream; at most once per dispatch, between
        ``dispatch_wait`` and ``combine_async`` (the runtime stays dispatched: the combine of the
        same batch may follow ``slot_values_wait``).

        What a backward returns for the router weights: ``values[i]`` = the dot product of row
        i's expert output with the gradient of its token's combine output, ``T x K`` floats a
        rank where a combine would move ``T x K`` rows of ``hidden`` values.

        Parameters
        ----------
        values : float32 ``[rows]``, row-aligned with the batch of ``handle`` (either layout's
            rows: ``batch.src_rank`` / ``src_token`` / ``src_k`` say where each came from),
            ``rows >= row_offsets[L]`` (e.g. the batch's capacity, ``EPConfig.recv_rows_capacity``;
            padding rows are not read; a shorter array is a device error that
            :meth:`synchronize` raises, and nothing is sent). Must stay unmodified until
            :meth:`slot_values_wait` has run on the stream.
        handle : the dispatch's handle (``batch.handle``).
        """
        self._require(State.DISPATCHED, call="slot_values_async", handle=handle, handle_type=DispatchHandle)
        if self._slots_call == handle.call:
            raise EPStateError(f"rank {self.rank}: slot_values_async: the slot values of call {handle.call} already "
                               f"went home; it runs at most once per dispatch.")
        values = arrays.to_backend(values, self.session.backend, "slot_values_async", "values")
        arrays.check_array(values, "slot_values_async", "values", np.float32, (None,),
                           "Expected float32 [rows], one value per expert-batch row (row-aligned with the batch).")
        self._run(self._prepare("slot_values_async", row_values=values))
        self._slots_call = handle.call
        self._state = State.SLOTS_SENT
        return from_fields(SlotValuesHandle, {"owner": self._owner, "call": handle.call, "n_tokens": handle.n_tokens})

    def slot_values_wait(self, handle: SlotValuesHandle, out=None):
        """Complete :meth:`slot_values_async`. Collective; enqueued on the stream.

        Returns ``out`` float32 ``[T, top_k]`` (allocated when None): for each of this rank's
        tokens and top-k slots, the value of the expert row the slot went to; 0.0 for a masked
        (-1) or dropped slot and a repeated id's later slots (they made no row). The runtime is
        dispatched again: ``combine_async`` of the same batch may follow.
        """
        self._require(State.SLOTS_SENT, call="slot_values_wait", handle=handle, handle_type=SlotValuesHandle)
        shape = (handle.n_tokens, self.cfg.top_k)
        if out is None:
            out = self.session.alloc_local("slot_values_out", shape, np.float32, fill=None)
        out = arrays.to_backend(out, self.session.backend, "slot_values_wait", "out")
        arrays.check_array(out, "slot_values_wait", "out", np.float32, shape, "Pass None to allocate it.")
        self._run(self._prepare("slot_values_wait", slot_out=out, timeout_ns=self._timeout_ns))
        self._state = State.DISPATCHED
        return out

    def slot_values(self, values, handle: DispatchHandle, out=None):
        """``slot_values_async`` then ``slot_values_wait``, then :meth:`synchronize`. Collective."""
        out = self.slot_values_wait(self.slot_values_async(values, handle), out=out)
        self.synchronize()
        return out
