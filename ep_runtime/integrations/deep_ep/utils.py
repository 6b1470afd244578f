"""``deep_ep.utils``: :class:`EventHandle` and :class:`EventOverlap`, DeepEP's stream events.

On a GPU an :class:`EventHandle` is a CUDA event recorded on a stream, and waiting on it makes
the caller's current stream wait (no host synchronization). On the simulator (no CUDA) every
call of the layer has finished when it returns, so an :class:`EventHandle` records nothing and
waiting on it returns at once: the same code runs on both.
"""

from __future__ import annotations

from typing import Any

import torch

from ep_runtime.core.errors import EPStateError


class EventHandle:
    """An event recorded on a stream: ``EventHandle()`` on the current CUDA stream (DeepEP's
    constructor), ``EventHandle(stream)`` on ``stream``. Without CUDA it holds no event.

    Attributes
    ----------
    event : torch.cuda.Event or None
        The recorded event (None without CUDA).
    """

    def __init__(self, stream=None):
        self.event = None
        if torch.cuda.is_available():
            self.event = torch.cuda.Event()
            self.event.record(stream if stream is not None else torch.cuda.current_stream())

    def current_stream_wait(self) -> None:
        """The current CUDA stream waits for the event (enqueued; the host does not wait)."""
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)

    def wait_on(self, stream) -> None:
        """``stream`` waits for the event (the layer's communication stream after a ``previous_event``)."""
        if self.event is not None:
            stream.wait_event(self.event)


class EventOverlap:
    """DeepEP's event wrapper: ``EventOverlap(event=None, extra_tensors=None)``.

    ``event`` is an :class:`EventHandle` (None when the call that returned it ran with
    ``async_finish=False``: the current stream already waited). ``extra_tensors`` are kept alive
    with the event (DeepEP's stand-in for ``record_stream`` under CUDA graphs).

    ``with event_overlap: ...`` runs the block, then makes the current stream wait for the event.
    """

    def __init__(self, event: EventHandle | None = None, extra_tensors: tuple | None = None) -> None:
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self) -> None:
        """The current stream waits for the event. Raises
        :class:`~ep_runtime.core.errors.EPStateError` when there is none (the call ran with
        ``async_finish=False`` and already ordered the current stream after itself)."""
        if self.event is None:
            raise EPStateError("EventOverlap.current_stream_wait: this EventOverlap holds no event (the call that "
                               "returned it ran with async_finish=False, so the current stream already waited for "
                               "it); call it only on the events of async_finish=True calls.")
        self.event.current_stream_wait()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> None:
        if self.event is not None:
            self.event.current_stream_wait()


__all__ = ["EventHandle", "EventOverlap"]
