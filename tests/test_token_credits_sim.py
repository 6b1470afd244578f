"""One receive buffer for the token rows, guarded by credits (docs/protocol.md, "Token rows: one
buffer, credits"), on the simulator: the real kernels, one process per rank, peer stores.

- The compact batch is the same memory every call (what lets one CUDA graph serve every step),
  and each call's rows are exact against the reference, calls of both layouts mixed, with the
  awkward routings (a rank with no tokens, an expert with none, every token to one expert).
- A slow reader: rank 1 reads its compact batch long after rank 0 has started its next
  dispatch (dispatch only, no combine between): rank 0's dispatch_async waits for rank 1's
  grant, so rank 1 reads its own call's rows, not rank 0's next ones.
- The credits count the calls: the next one once a combine granted it.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from ep_runtime.core import reference
from ep_runtime.core.config import EPConfig
from ep_runtime.shmem.launch import run_pes
from ep_runtime.testing import expert_outputs, make_inputs

RUN_TIMEOUT_S = 240
SCENARIOS = ("random", "zero_rank", "empty_expert", "one_expert")
CALLS = 6
#: How long the slow reader holds its compact batch before reading it (s).
HOLD_S = 2.0


def base_cfg(R: int) -> EPConfig:
    return EPConfig(n_ranks=R, n_experts=2 * R, top_k=2, hidden=16, max_tokens_per_rank=6)


def call_inputs(cfg: EPConfig, call: int):
    return make_inputs(cfg, SCENARIOS[call % len(SCENARIOS)], 500 + call)


def address(a) -> int:
    return a.__array_interface__["data"][0]


# -- per-rank bodies ------------------------------------------------------------------------------
def cycle_pe(session, R: int) -> dict:
    """CALLS round trips (dispatch -> combine), compact and expanded alternating (two compact
    calls in a row at the start), each compact batch's x, gather, recv_tokens and address."""
    from ep_runtime.core.runtime import EPRuntime

    r, cfg = session.rank, base_cfg(R)
    calls = []
    with EPRuntime(cfg, session) as rt:
        for call in range(CALLS):
            xs, ids, ws = call_inputs(cfg, call)
            layout = "compact" if call in (0, 1) or call % 2 == 0 else "expanded"
            batch = rt.dispatch_wait(rt.dispatch_async(xs[r].view(np.uint16), ids[r], ws[r]), layout=layout)
            got = {"layout": layout, "x": session.to_host(batch.x).copy(), "x_at": address(batch.x)}
            if layout == "compact":
                got["gather"] = session.to_host(batch.gather).copy()
                got["recv_tokens"] = session.to_host(batch.recv_tokens).copy()
                got["recv_tokens_at"] = address(batch.recv_tokens)
            y = expert_outputs(cfg, reference.dispatch(xs, ids, ws, cfg)[r], r)
            got["out"] = session.to_host(rt.combine(y, batch.handle)).copy()
            calls.append(got)
        # a peer's last combine_async grants its credit whether or not this rank waits on its
        # partials (a call may send this rank nothing): read once every rank's last call is done
        session.synchronize()
        session.barrier()
        credit = session.to_host(rt.buffers["dispatch_token_credit"]).tolist()
    return {"calls": calls, "credit": credit}


def slow_reader_pe(session) -> dict:
    """Two ranks, dispatch only (no combine): call 0 compact on both; then rank 1 holds its
    batch HOLD_S seconds before reading it, while rank 0 starts call 1 at once."""
    from ep_runtime.core.runtime import EPRuntime

    r, cfg = session.rank, base_cfg(2)
    res = {}
    with EPRuntime(cfg, session) as rt:
        xs, ids, ws = call_inputs(cfg, 0)
        batch = rt.dispatch_wait(rt.dispatch_async(xs[r].view(np.uint16), ids[r], ws[r]), layout="compact")
        session.synchronize()
        session.barrier()
        xs1, ids1, ws1 = make_inputs(cfg, "random", 900, n_tokens=[cfg.max_tokens_per_rank] * 2)
        if r == 1:
            time.sleep(HOLD_S)
            res["x0"] = session.to_host(batch.x).copy()  # read late: rank 0 is in call 1 by now
        start = time.monotonic()
        handle = rt.dispatch_async(xs1[r].view(np.uint16), ids1[r], ws1[r])
        res["async_s"] = time.monotonic() - start  # the simulator runs the kernel inside the call
        batch = rt.dispatch_wait(handle, layout="compact")
        res["x1"] = session.to_host(batch.x).copy()
        session.synchronize()
        res["credit"] = session.to_host(rt.buffers["dispatch_token_credit"]).tolist()
    return res


# -- parent side ------------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=[2, 3], ids=["R2", "R3"])
def cycles(request):
    R = request.param
    return R, run_pes(cycle_pe, R, args=(R,), timeout_s=RUN_TIMEOUT_S)


def test_the_compact_batch_is_the_same_memory_every_call(cycles):
    R, per_rank = cycles
    for r, res in enumerate(per_rank):
        compact = [c for c in res["calls"] if c["layout"] == "compact"]
        assert len(compact) >= 3, "the sequence must hold several compact calls"
        assert len({c["x_at"] for c in compact}) == 1, f"rank {r}: compact x moved between calls"
        assert len({c["recv_tokens_at"] for c in compact}) == 1, f"rank {r}: recv_tokens moved between calls"


def test_each_call_reads_its_own_rows_through_the_one_buffer(cycles):
    R, per_rank = cycles
    cfg = base_cfg(R)
    for r, res in enumerate(per_rank):
        for call, got in enumerate(res["calls"]):
            xs, ids, ws = call_inputs(cfg, call)
            refs = reference.dispatch(xs, ids, ws, cfg)
            ref, what = refs[r], f"rank {r} call {call} ({got['layout']})"
            n = ref.n_rows
            if got["layout"] == "compact":
                np.testing.assert_array_equal(got["gather"][:n], reference.gather_index(ref, cfg), what)
                real = ref.src_rank >= 0
                np.testing.assert_array_equal(got["x"][got["gather"][:n][real]], ref.x.view(np.uint16)[real], what)
                assert got["recv_tokens"].tolist() == [len(x) for x in xs], what
            else:
                np.testing.assert_array_equal(got["x"][:n], ref.x.view(np.uint16), what)
            want = reference.combine([expert_outputs(cfg, refs[s], s) for s in range(R)], refs, ids, cfg)[r]
            np.testing.assert_array_equal(got["out"][:len(xs[r])], want.view(np.uint16), what)


def test_credits_count_the_calls_and_the_last_combine_granted_the_next(cycles):
    R, per_rank = cycles
    for r, res in enumerate(per_rank):
        assert res["credit"] == [0 if d == r else CALLS + 1 for d in range(R)], f"rank {r}: {res['credit']}"


def test_a_peer_waits_for_a_slow_reader_before_writing_its_next_rows():
    per_rank = run_pes(slow_reader_pe, 2, timeout_s=RUN_TIMEOUT_S)
    cfg = base_cfg(2)
    T = cfg.max_tokens_per_rank
    xs0, ids0, _ = call_inputs(cfg, 0)
    xs1, ids1, _ = make_inputs(cfg, "random", 900, n_tokens=[T] * 2)
    x_ref0, defined0 = reference.receive_rows(xs0, ids0, cfg)[1]
    from_rank0 = np.zeros(2 * T, bool)  # rank 0's rows on rank 1: the ones rank 0 rewrites in call 1
    from_rank0[:T] = defined0[:T]
    assert from_rank0.any(), "rank 0 sent rank 1 nothing in call 0: the check proves nothing"
    # what rank 1 read late is call 0's rows from rank 0, not call 1's
    np.testing.assert_array_equal(per_rank[1]["x0"][from_rank0], x_ref0.view(np.uint16)[from_rank0])
    # rank 0's next dispatch_async waited for rank 1's grant (given when rank 1 started call 1)
    assert per_rank[0]["async_s"] >= 0.5 * HOLD_S, f"rank 0's dispatch_async took {per_rank[0]['async_s']:.2f} s"
    # and call 1 then arrived whole on both ranks
    for r in range(2):
        x_ref1, defined1 = reference.receive_rows(xs1, ids1, cfg)[r]
        np.testing.assert_array_equal(per_rank[r]["x1"][defined1], x_ref1.view(np.uint16)[defined1], f"rank {r}")
        assert per_rank[r]["credit"] == [0 if d == r else 2 for d in range(2)], per_rank[r]["credit"]
