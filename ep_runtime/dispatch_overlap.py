"""Dispatch rows as they land: the choices the runtime makes for it (docs/protocol.md,
"Dispatch rows as they land").

In a landing runtime dispatch_async signals each rank's routing on its own
(``dispatch_route_signal``) as soon as it is out, and flags every part of every bf16 token row
on arrival (``dispatch_row_flag``); dispatch_wait enqueues one kernel, ``dispatch_land``,
launched with programmatic dependent launch (PDL) so that its first blocks start on the SMs
dispatch_async leaves free: it places the rows while they fly and, in the expanded layout,
copies each part to its expert rows as it lands (the FP8 formats keep ``dispatch_copy`` after
it). Two knobs, read when a runtime is built, the same on every rank:

- ``EP_RUNTIME_DISPATCH_LAND`` (default :data:`DEFAULT_LAND`, off): ``1`` builds a landing
  runtime; ``0`` keeps dispatch_wait (and dispatch_copy), the path measured on 2 x H200. Not
  with the copy-engine transfer (its rows are not flagged).
- ``EP_RUNTIME_DISPATCH_LAND_SMS`` (default :data:`DEFAULT_LAND_SMS`): SMs dispatch_async
  leaves free for dispatch_land's first blocks, when the runtime's grid is the whole GPU
  (``EPConfig.n_sms`` None) and PDL is on (``EP_RUNTIME_PDL`` and the session's fast launcher).
  With ``n_sms`` set, or without PDL, dispatch_async keeps the whole grid.

Off by default until it is measured on NVLink: the prediction is in docs/throughput.md, "v18".
"""

from __future__ import annotations

from .combine_overlap import env_int, sender_grid
from .errors import EPConfigError

LAND_ENV = "EP_RUNTIME_DISPATCH_LAND"
LAND_SMS_ENV = "EP_RUNTIME_DISPATCH_LAND_SMS"
#: Landing off: dispatch_wait and dispatch_copy, as measured on 2 x H200 (docs/throughput.md).
DEFAULT_LAND = 0
#: SMs left to dispatch_land's early blocks (2 x H200: dispatch_async on 108 of 132 SMs, as
#: combine_async in a flagged combine).
DEFAULT_LAND_SMS = 24


def landing(copy_engine: bool) -> bool:
    """Whether a runtime lands its dispatches (``EP_RUNTIME_DISPATCH_LAND``: 0 or 1). Raises
    EPConfigError for another value, or for 1 with the copy-engine transfer."""
    value = env_int(LAND_ENV, DEFAULT_LAND)
    if value > 1:
        raise EPConfigError(f"{LAND_ENV}={value}: expected 0 (dispatch_wait) or 1 (dispatch_land).")
    if value and copy_engine:
        raise EPConfigError(f"{LAND_ENV}=1 with EP_RUNTIME_TOKEN_TRANSFER=copy_engine: the copy engine's rows "
                            f"carry no flags; unset one of the two.")
    return bool(value)


def dispatch_send_grid(grid: int, whole_gpu: bool, pdl_on: bool) -> int:
    """dispatch_async's grid in a landing runtime: ``grid`` less the SMs left to dispatch_land's
    early blocks when the grid is the whole GPU and PDL is on (at least half kept); else ``grid``."""
    return sender_grid(grid, whole_gpu, pdl_on, LAND_SMS_ENV, DEFAULT_LAND_SMS)
