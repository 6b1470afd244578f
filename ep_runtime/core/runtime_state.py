"""The order of an :class:`~ep_runtime.core.runtime.EPRuntime`'s calls, and the int64 scalar
arguments its calls pass.

A runtime is in one :class:`State` between calls; each call checks it (``EPRuntime._require``),
moves it on, and refuses a call out of this order or with another call's handle.
"""

from __future__ import annotations

from enum import Enum

import numpy as np

#: int64 scalar arguments 0 and 1, one object each: the fast launch path rewrites an argument
#: only when its object changes (ep_runtime.shmem.fast_launch).
INT64 = (np.int64(0), np.int64(1))


class State(Enum):
    """Where a runtime is between two calls (its value names it in errors)."""

    IDLE = "idle"                    # next: dispatch_async
    DISPATCH_SENT = "dispatch sent"  # next: dispatch_wait
    DISPATCHED = "dispatched"        # next: combine_async (or dispatch_async, skipping combine, or slot_values_async)
    SLOTS_SENT = "slot values sent"  # next: slot_values_wait (then DISPATCHED again)
    COMBINE_SENT = "combine sent"    # next: combine_wait


#: Position of each state within one call, to tell a reused handle from a premature one.
STEP = {State.DISPATCH_SENT: 1, State.DISPATCHED: 2, State.SLOTS_SENT: 2, State.COMBINE_SENT: 3, State.IDLE: 4}
