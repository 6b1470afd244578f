"""The host's reading of the device error record (``ep_runtime.core.status.error_from_status``): each
timeout names the rank, the kernel, the counter (with its group and peer) and what it held, and
the route-first copy's own flag (``dispatch_placed``) is named as this rank's placing block,
not a peer. CPU only: the records are built here as the kernels' ``record_error`` writes them."""

from __future__ import annotations

import numpy as np
import pytest

from ep_runtime.core.errors import EPCapacityError, EPTimeoutError
from ep_runtime.core.layout import (STATUS_CALL, STATUS_CODE, STATUS_COUNTER, STATUS_EXPECTED, STATUS_KERNEL,
                                    STATUS_LEN, STATUS_OBSERVED, STATUS_PEER, STATUS_RANK)
from ep_runtime.core.status import (COUNTER_DISPATCH_PLACED, COUNTER_DISPATCH_SIGNAL, COUNTER_RECV_ROWS, COUNTER_NAMES,
                                    ERR_CAPACITY, ERR_TIMEOUT, KERNEL_DISPATCH_WAIT, UNGROUPED_COUNTERS,
                                    error_from_status)


def record(code, kernel, rank, peer, counter, expected, observed, call) -> np.ndarray:
    status = np.zeros(STATUS_LEN, np.int64)
    for slot, value in ((STATUS_CODE, code), (STATUS_KERNEL, kernel), (STATUS_RANK, rank), (STATUS_PEER, peer),
                        (STATUS_COUNTER, counter), (STATUS_EXPECTED, expected), (STATUS_OBSERVED, observed),
                        (STATUS_CALL, call)):
        status[slot] = value
    return status


def test_no_error_is_none():
    assert error_from_status(np.zeros(STATUS_LEN, np.int64), 1.0) is None


def test_a_peer_signal_timeout_names_the_rank_kernel_counter_group_and_peer():
    # call 4 (recorded as 5), group 0, rank 1's dispatch signal stuck at call 3
    err = error_from_status(record(ERR_TIMEOUT, KERNEL_DISPATCH_WAIT, 0, 1, COUNTER_DISPATCH_SIGNAL, 5, 4, 5), 2.0)
    assert isinstance(err, EPTimeoutError)
    msg = str(err)
    assert msg.startswith("rank 0: dispatch_wait of call 4 timed out after 2 s waiting for rank 1"), msg
    assert "dispatch_signal[0][1] expected >= 5, observed 4" in msg, msg


def test_the_placed_flag_names_the_placing_block_not_a_peer():
    # rank 1's copying blocks of call 2 (recorded as 3) saw the flag of call 1 only
    err = error_from_status(record(ERR_TIMEOUT, KERNEL_DISPATCH_WAIT, 1, 1, COUNTER_DISPATCH_PLACED, 3, 2, 3), 0.5)
    assert isinstance(err, EPTimeoutError)
    msg = str(err)
    assert COUNTER_NAMES[COUNTER_DISPATCH_PLACED] == "dispatch_placed" and COUNTER_DISPATCH_PLACED in UNGROUPED_COUNTERS
    assert msg.startswith("rank 1: dispatch_wait of call 2 timed out after 1.5 s waiting for its placing block"), msg
    assert "dispatch_placed[0] expected >= 3" in msg and "observed 2" in msg, msg
    assert "waiting for rank" not in msg, msg


@pytest.mark.parametrize("observed", [24, 1000])
def test_a_capacity_error_names_the_rows_needed(observed):
    err = error_from_status(record(ERR_CAPACITY, KERNEL_DISPATCH_WAIT, 0, -1, COUNTER_RECV_ROWS, 4, observed, 1), 1.0)
    assert isinstance(err, EPCapacityError)
    assert f"needed {observed} expert-batch rows but the capacity is 4" in str(err), str(err)
