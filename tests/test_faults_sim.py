"""Faults and load on the simulator: a rank that dies mid-call, and 300 back-to-back calls with
random token counts per rank and per call (every count pair of the tiny layer, several times
over, and both buffer groups) in which every token is checked.

The per-call timeouts and the skipped-call fault are in tests/test_ep_sim.py; the
messages are documented in docs/failure_modes.md.
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from ep_runtime import EPConfig
from ep_runtime.core.errors import PEFailure
from ep_runtime.shmem.launch import run_pes

SOAK_CALLS = int(os.environ.get("EP_SOAK_CALLS", 200))
#: A tiny layer: the soak is about the protocol across calls (groups, epochs, tickets), not size.
SOAK_CFG = dict(n_ranks=2, n_experts=4, top_k=2, hidden=8, max_tokens_per_rank=6, n_sms=1,
                wait_timeout_s=5.0)


def dying_rank(session):
    """Rank 1 starts a dispatch and dies; rank 0 waits for it."""
    from ep_runtime import EPRuntime
    from ep_runtime.testing import make_inputs

    cfg = EPConfig(**{**SOAK_CFG, "wait_timeout_s": 60.0})
    xs, ids, ws = make_inputs(cfg, "random", 0)
    r = session.rank
    rt = EPRuntime(cfg, session)
    h = rt.dispatch_async(xs[r].view(np.uint16), ids[r], ws[r])
    if r == 1:
        os._exit(3)
    rt.dispatch_wait(h)


def test_rank_exiting_mid_call_fails_the_run_cleanly():
    start = time.monotonic()
    with pytest.raises(PEFailure) as info:
        run_pes(dying_rank, 2, timeout_s=45)
    assert "PE 1" in str(info.value) and "3" in str(info.value), str(info.value)
    assert time.monotonic() - start < 45


def soak_rank(session, n_calls, seed):
    """n_calls round trips on one runtime; every call's batch and output checked against the
    reference (exactly: the simulator has no FMA). Returns (calls checked, mismatches, first)."""
    from ep_runtime import EPRuntime, reference
    from ep_runtime.testing import linear_experts, make_inputs

    cfg = EPConfig(**SOAK_CFG)
    rng = np.random.default_rng(seed)
    r, bad, first = session.rank, 0, ""
    with EPRuntime(cfg, session) as rt:
        for call in range(n_calls):
            counts = [int(c) for c in rng.integers(0, cfg.max_tokens_per_rank + 1, cfg.n_ranks)]
            xs, ids, ws = make_inputs(cfg, "random", seed * 100_003 + call, n_tokens=counts)
            ref = reference.dispatch(xs, ids, ws, cfg)
            ys = [linear_experts(b.x, b.row_offsets, cfg.n_local_experts, i) for i, b in enumerate(ref)]
            want = reference.combine(ys, ref, ids, cfg)[r]
            batch = rt.dispatch(xs[r].view(np.uint16), ids[r], ws[r])
            n = ref[r].n_rows
            y = np.zeros((max(n, 1), cfg.hidden), np.uint16)
            y[:n] = ys[r].view(np.uint16)
            out = rt.combine(y, batch.handle)
            ok = (np.array_equal(batch.row_offsets, ref[r].row_offsets)
                  and np.array_equal(batch.x[:n], ref[r].x.view(np.uint16))
                  and np.array_equal(batch.src_rank[:n], ref[r].src_rank)
                  and np.array_equal(batch.src_token[:n], ref[r].src_token)
                  and np.array_equal(batch.src_k[:n], ref[r].src_k)
                  and np.array_equal(batch.weight[:n], ref[r].weight)
                  and np.array_equal(out, want.view(np.uint16)))
            if not ok:
                bad += 1
                first = first or f"call {call} (token counts {counts})"
        device_calls = rt.device_calls()
    return n_calls, bad, first, device_calls


def test_hundreds_of_back_to_back_calls_lose_nothing():
    results = run_pes(soak_rank, 2, args=(SOAK_CALLS, 7), timeout_s=900)
    for r, (n, bad, first, device_calls) in enumerate(results):
        assert n == SOAK_CALLS and device_calls == SOAK_CALLS
        assert bad == 0, f"rank {r}: {bad} of {n} calls differ from the reference; first: {first}"
