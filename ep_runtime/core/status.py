"""The device error record: codes the kernels write and the host's translation into errors.

Any kernel that fails (a wait past its timeout, a capacity overflow) claims the int64
``status`` region once (compare-and-swap of the code from 0) and fills the fields indexed
by ``ep_runtime.core.layout.STATUS_*``. The first error wins. Later kernels of every call see a
non-zero code and return without sending or signalling, so the failure reaches every peer
as a timeout that names this rank, instead of as silently wrong data.

A second record, at ``DROPPED_SLOT``, holds the first expert id outside ``[-1, n_experts)`` that
dispatch_async dropped (debug off: no routing check ran). It stops no kernel: the call
completes on every rank as if that slot were masked (-1), and the host raises it at the next
synchronization, so a bad router output is named, never silently routed.
"""

from __future__ import annotations

import numpy as np

from ep_runtime.core.errors import EPCapacityError, EPError, EPInputError, EPTimeoutError
from ep_runtime.kernels.protocol import (DROPPED_SLOT, STATUS_CALL, STATUS_CODE, STATUS_COUNTER, STATUS_EXPECTED,
                                         STATUS_KERNEL, STATUS_LEN, STATUS_OBSERVED, STATUS_PEER, STATUS_RANK)

from ep_runtime.kernels.protocol import (COUNTER_COMBINE_CHUNK, COUNTER_COMBINE_ROW_FLAG,  # noqa: F401
                                         COUNTER_DISPATCH_PLACED, COUNTER_DISPATCH_ROW_FLAG,
                                         COUNTER_DISPATCH_SIGNAL, COUNTER_RECV_ROWS, COUNTER_RELAY_CHUNK,
                                         COUNTER_RELAY_FLAG, COUNTER_RELAY_SIGNAL, COUNTER_ROUTE_SIGNAL,
                                         COUNTER_SLOT_SIGNAL, COUNTER_TOKEN_CREDIT, ERR_BAD_EXPERT_ID, ERR_BAD_WEIGHT,
                                         ERR_CAPACITY, ERR_DUPLICATE_EXPERT, ERR_NONE, ERR_SHORT_ROWS, ERR_TIMEOUT,
                                         KERNEL_COMBINE_ASYNC, KERNEL_COMBINE_RELAY, KERNEL_COMBINE_WAIT,
                                         KERNEL_DISPATCH_ASYNC, KERNEL_DISPATCH_LAND, KERNEL_DISPATCH_RELAY,
                                         KERNEL_DISPATCH_WAIT, KERNEL_SLOT_VALUES_ASYNC, KERNEL_SLOT_VALUES_WAIT,
                                         KERNEL_VALIDATE_ROUTING)

KERNEL_NAMES = {KERNEL_DISPATCH_ASYNC: "dispatch_async", KERNEL_DISPATCH_WAIT: "dispatch_wait",
                KERNEL_COMBINE_ASYNC: "combine_async", KERNEL_COMBINE_WAIT: "combine_wait",
                KERNEL_VALIDATE_ROUTING: "validate_routing", KERNEL_DISPATCH_LAND: "dispatch_land",
                KERNEL_SLOT_VALUES_ASYNC: "slot_values_async", KERNEL_SLOT_VALUES_WAIT: "slot_values_wait",
                KERNEL_DISPATCH_RELAY: "dispatch_relay", KERNEL_COMBINE_RELAY: "combine_relay"}

COUNTER_NAMES = {COUNTER_DISPATCH_SIGNAL: "dispatch_signal", COUNTER_RECV_ROWS: "expert-batch rows",
                 COUNTER_TOKEN_CREDIT: "dispatch_token_credit", COUNTER_COMBINE_ROW_FLAG: "combine_row_flag",
                 COUNTER_ROUTE_SIGNAL: "dispatch_route_signal", COUNTER_DISPATCH_ROW_FLAG: "dispatch_row_flag",
                 COUNTER_DISPATCH_PLACED: "dispatch_placed", COUNTER_SLOT_SIGNAL: "slot_signal",
                 COUNTER_RELAY_SIGNAL: "relay_signal", COUNTER_RELAY_FLAG: "relay_flag",
                 COUNTER_RELAY_CHUNK: "relay_chunk_flag", COUNTER_COMBINE_CHUNK: "combine_chunk_flag"}
#: Counters without a group axis (cumulative over calls): a timeout names them without ``[g]``.
UNGROUPED_COUNTERS = (COUNTER_TOKEN_CREDIT, COUNTER_COMBINE_ROW_FLAG, COUNTER_DISPATCH_ROW_FLAG,
                      COUNTER_DISPATCH_PLACED, COUNTER_RELAY_FLAG, COUNTER_RELAY_CHUNK, COUNTER_COMBINE_CHUNK)
#: Per-row flags: a timeout's observed value holds the token in its high 32 bits.
ROW_FLAG_COUNTERS = (COUNTER_COMBINE_ROW_FLAG, COUNTER_DISPATCH_ROW_FLAG, COUNTER_RELAY_FLAG, COUNTER_RELAY_CHUNK,
                     COUNTER_COMBINE_CHUNK)


def error_from_status(status: np.ndarray, timeout_s: float) -> EPError | None:
    """The error a host-side copy of the ``status`` region describes, or None: its error record,
    else its dropped-slot record (when ``status`` holds one)."""
    code = int(status[STATUS_CODE])
    if code == ERR_NONE:
        dropped = status[DROPPED_SLOT:DROPPED_SLOT + STATUS_LEN]
        if len(dropped) == STATUS_LEN and int(dropped[STATUS_CODE]) != ERR_NONE:
            return _dropped_slot_error(dropped)
        return None
    kernel = KERNEL_NAMES.get(int(status[STATUS_KERNEL]), f"kernel {int(status[STATUS_KERNEL])}")
    rank, peer = int(status[STATUS_RANK]), int(status[STATUS_PEER])
    counter = COUNTER_NAMES.get(int(status[STATUS_COUNTER]), f"counter {int(status[STATUS_COUNTER])}")
    expected, observed = int(status[STATUS_EXPECTED]), int(status[STATUS_OBSERVED])
    call = int(status[STATUS_CALL])
    if code == ERR_TIMEOUT:
        group = "" if int(status[STATUS_COUNTER]) in UNGROUPED_COUNTERS else f"[{(call - 1) % 2}]"
        where = f"[{peer}]"
        if int(status[STATUS_COUNTER]) in ROW_FLAG_COUNTERS:  # the token: observed's high bits
            where = f"[{peer}, token {observed >> 32}]"
            observed &= 0xFFFFFFFF
        if int(status[STATUS_COUNTER]) == COUNTER_DISPATCH_PLACED:  # a block of this rank, not a peer
            return EPTimeoutError(
                f"rank {rank}: {kernel} of call {call - 1} timed out after {3 * timeout_s:g} s waiting for its "
                f"placing block: {counter}[0] expected >= {expected} (call {call - 1} placed), observed "
                f"{observed}. The placing block publishes even when it fails, so it never ran: a block "
                f"scheduling fault, or the kernel was launched without the route-first dispatch_async. The "
                f"runtime refuses further calls until reset() or close().")
        return EPTimeoutError(
            f"rank {rank}: {kernel} of call {call - 1} timed out after {timeout_s:g} s waiting for rank "
            f"{peer}: {counter}{group}{where} expected >= {expected}, observed {observed}. "
            f"Likely causes: rank {peer} did not make this call (every rank must call dispatch and "
            f"combine the same number of times, in the same order), rank {peer} failed earlier (see its "
            f"own error), or the ranks were built with different configs. The runtime refuses further "
            f"calls until reset() or close().")
    if code == ERR_CAPACITY:
        return EPCapacityError(
            f"rank {rank}: {kernel} of call {call - 1} needed {observed} expert-batch rows but the "
            f"capacity is {expected} (EPConfig.max_recv_rows); no row was written. Raise max_recv_rows "
            f"to at least {observed}, or use None for the worst case.")
    if code == ERR_SHORT_ROWS:
        return EPInputError(
            f"rank {rank}: {kernel} of call {call - 1}: values has {expected} rows but the expert batch has "
            f"{observed}; nothing was sent, so the other ranks' slot_values_wait time out naming rank {rank}. Pass "
            f"one float32 value per batch row (e.g. [capacity] = [EPConfig.recv_rows_capacity]), then call "
            f"reset() on every rank.")
    after = (f"(checked on the device before dispatch_async; nothing was sent, so the other ranks' waits "
             f"time out naming rank {rank}). Fix the router's output, then call reset() on every rank.")
    if code == ERR_BAD_EXPERT_ID:
        return EPInputError(f"rank {rank}: topk_ids[{peer}, {int(status[STATUS_COUNTER])}] = {observed} is outside "
                            f"[-1, n_experts={expected}) (-1 masks a slot) {after}")
    if code == ERR_DUPLICATE_EXPERT:
        return EPInputError(f"rank {rank}: token {peer} lists expert {observed} twice in topk_ids (slots "
                            f"{int(status[STATUS_COUNTER])} and {expected}); top-k ids must be distinct {after}")
    if code == ERR_BAD_WEIGHT:
        w = float(np.uint32(observed & 0xFFFFFFFF).view(np.float32))
        rule = "finite" if expected else "finite and >= 0 (EPConfig.allow_negative_weights=False)"
        return EPInputError(f"rank {rank}: topk_weights[{peer}, {int(status[STATUS_COUNTER])}] = {w} must be "
                            f"{rule} {after}")
    return EPError(f"rank {rank}: {kernel} reported unknown error code {code} (status {list(status)})")


def _dropped_slot_error(record: np.ndarray) -> EPError:
    """The error of a dropped-slot record (dispatch_async, debug off)."""
    rank, token, slot = int(record[STATUS_RANK]), int(record[STATUS_PEER]), int(record[STATUS_COUNTER])
    n_experts, expert, call = int(record[STATUS_EXPECTED]), int(record[STATUS_OBSERVED]), int(record[STATUS_CALL])
    return EPInputError(
        f"rank {rank}: topk_ids[{token}, {slot}] = {expert} in call {call - 1} is outside [-1, n_experts={n_experts}) "
        f"(-1 masks a slot). dispatch_async dropped that slot: the call completed on every rank as if it were -1 "
        f"(the token's other slots were dispatched and combined). Fix the router's output, then call reset() on "
        f"every rank (EPRuntime(debug=True) checks every routing before it is sent).")
