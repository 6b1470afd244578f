"""Combine rows as they land: the choices the runtime makes for it (docs/protocol.md,
"Combine rows as they land").

combine_async flags every part of every partial row on arrival (``combine_row_flag``) and
combine_wait, launched with programmatic dependent launch (PDL), starts on the SMs
combine_async leaves free and reduces each part as soon as it is there, instead of after the
last block's signal. Two knobs, read when a runtime is built, the same on every rank:

- ``EP_RUNTIME_COMBINE_ROW_FLAGS_FROM`` (default :data:`DEFAULT_ROW_FLAGS_FROM`): a call flags
  its parts when some rank dispatched at least this many tokens; 0: never (every call then
  waits for the last block's signal, the protocol before v17, kept as the reference path).
- ``EP_RUNTIME_COMBINE_WAIT_SMS`` (default :data:`DEFAULT_WAIT_SMS` for the compact layout's
  combine_async_rows, :data:`DEFAULT_WAIT_SMS_EXPANDED` for the expanded layout's
  combine_async; when set, the value for both): SMs combine_async leaves
  free for combine_wait's first blocks, when the runtime's grid is the whole GPU
  (``EPConfig.n_sms`` None) and PDL is on (``EP_RUNTIME_PDL``, and the session's fast launcher,
  which sets PDL's launch attribute). With ``n_sms`` set, or without PDL, combine_async keeps
  the whole grid (a caller who limits SMs gets no more than that at any time).
"""

from __future__ import annotations

import os

from .errors import EPConfigError

ROW_FLAGS_ENV = "EP_RUNTIME_COMBINE_ROW_FLAGS_FROM"
WAIT_SMS_ENV = "EP_RUNTIME_COMBINE_WAIT_SMS"
#: Tokens from which a call's parts are flagged: every call with a token. Measured on one H100,
#: one rank, graph replay (docs/throughput.md, "v17"): combine at T=128 18.4 us flagged against
#: 24.0 signalled (compact), 33.5 against 45.8 (expanded); T=4096 expanded 273.1 against 289.8.
DEFAULT_ROW_FLAGS_FROM = 1
#: SMs left to combine_wait's early blocks in the compact layout (2 x H200: combine_async_rows
#: on 108 of 132 SMs; T=4096 combine 201.9 us with 24 left, 220.1 with 8).
DEFAULT_WAIT_SMS = 24
#: ... and in the expanded layout, where the sender reads every expert row (0.47 GB at T=4096)
#: and is the longer half: 2 x H200, T=4096, combine 291.5 / 293.2 us with 24 SMs left against
#: 274.3 with 8 (and 359.3 with 48; docs/throughput.md, "v27").
DEFAULT_WAIT_SMS_EXPANDED = 8


def env_int(name: str, default: int) -> int:
    """Environment variable ``name`` as an integer >= 0 (``default`` when unset or empty); raises
    EPConfigError naming the variable for anything else."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise EPConfigError(f"{name}={text!r}: expected an integer >= 0 (unset means {default}).")
    return value


def row_flags_from() -> int:
    """The ``row_flags_from`` kernel argument (int, >= 0; 0: never flag rows)."""
    return env_int(ROW_FLAGS_ENV, DEFAULT_ROW_FLAGS_FROM)


def sender_grid(grid: int, whole_gpu: bool, pdl_on: bool, sms_env: str, default_sms: int) -> int:
    """A sending kernel's grid when its receiving kernel starts early on the SMs it leaves free:
    ``grid`` less ``sms_env`` SMs (``default_sms`` when unset) when the grid is the whole GPU and
    PDL is on (at least half of ``grid`` kept); else ``grid``."""
    if not (whole_gpu and pdl_on):
        return grid
    return max(grid - env_int(sms_env, default_sms), (grid + 1) // 2)


def combine_send_grid(grid: int, whole_gpu: bool, pdl_on: bool, layout: str = "compact") -> int:
    """The sending kernel's grid for expert outputs in ``layout`` (``"compact"``:
    combine_async_rows, ``"expanded"``: combine_async): ``grid`` less the SMs left to
    combine_wait's early blocks when the grid is the whole GPU and PDL is on (at least half of
    ``grid`` kept); else ``grid``."""
    default = DEFAULT_WAIT_SMS_EXPANDED if layout == "expanded" else DEFAULT_WAIT_SMS
    return sender_grid(grid, whole_gpu, pdl_on, WAIT_SMS_ENV, default)
