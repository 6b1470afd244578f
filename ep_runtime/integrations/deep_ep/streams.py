"""Where a call of the layer runs: the runtime's stream, DeepEP's communication stream.

DeepEP enqueues each dispatch and combine on its communication stream, after ``previous_event``
when one is given and otherwise after the caller's current stream. With ``async_finish=False``
the caller's stream then waits for the communication stream; with ``async_finish=True`` it does
not, and the call returns an event to wait on later (``EventOverlap.current_stream_wait``), so
work the caller enqueues meanwhile overlaps the exchange. :class:`CommCall` does the same around
one call of the layer: the layer's own tensor work (the gathers of
:mod:`~ep_runtime.integrations.deep_ep.dense`) and the runtime's kernels run on the runtime's
stream, with CuPy's current device set for the runtime (autograd may call from another thread).

Tensors made during the call belong to the communication stream; :meth:`CommCall.finish`
records the ones returned on the caller's stream, and with ``async_finish`` the inputs on the
communication stream, so the caching allocator reuses neither too early (DeepEP's
``record_stream`` calls).

On the simulator there are no streams (every call has finished when it returns): nothing is
ordered, and ``async_finish`` returns an event whose wait returns at once.
"""

from __future__ import annotations

import torch

from ep_runtime.integrations.deep_ep.utils import EventHandle, EventOverlap


class CommCall:
    """Context manager for one call of the layer on ``session``'s stream (see the module docstring).

    Parameters
    ----------
    session : the runtimes' session (its ``stream`` is the communication stream).
    device : the runtimes' torch device.
    previous_event : an :class:`EventOverlap` (or None) the communication stream waits for
        instead of the caller's current stream.
    async_finish : DeepEP's ``async_finish``.
    """

    def __init__(self, session, device: torch.device, previous_event, async_finish: bool):
        self.gpu = device.type == "cuda"
        self.async_finish = async_finish
        self.previous_event = previous_event
        self._contexts = []
        if self.gpu:
            self.compute = torch.cuda.current_stream(device)
            self.comm = torch.cuda.ExternalStream(session.stream.ptr, device=device)
            self.device = device

    def __enter__(self) -> CommCall:
        if not self.gpu:
            return self
        import cupy

        event = getattr(self.previous_event, "event", None)
        if event is not None:
            event.wait_on(self.comm)
        else:
            self.comm.wait_stream(self.compute)
        self._contexts = [cupy.cuda.Device(self.device.index), torch.cuda.stream(self.comm)]
        for c in self._contexts:
            c.__enter__()
        return self

    def __exit__(self, *exc) -> bool:
        for c in reversed(self._contexts):
            c.__exit__(*exc)
        self._contexts = []
        return False

    def finish(self, outputs, inputs=()) -> EventOverlap:
        """After the call's work is enqueued: ``outputs`` recorded on the caller's stream; with
        ``async_finish`` the event of the communication stream (and ``inputs`` recorded on it),
        else the caller's stream waits for it and the returned EventOverlap holds no event."""
        if not self.gpu:
            return EventOverlap(EventHandle() if self.async_finish else None)
        for t in outputs:
            if isinstance(t, torch.Tensor) and t.is_cuda:
                t.record_stream(self.compute)
        if self.async_finish:
            for t in inputs:
                if isinstance(t, torch.Tensor) and t.is_cuda:
                    t.record_stream(self.comm)
            return EventOverlap(EventHandle(self.comm))
        self.compute.wait_stream(self.comm)
        return EventOverlap(None)
