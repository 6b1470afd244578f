"""Combine rows as they land (docs/protocol.md, "Combine rows as they land"), on the simulator:
the real kernels, one process per rank.

A call whose largest batch reaches ``EP_RUNTIME_COMBINE_ROW_FLAGS_FROM`` tokens flags every
partial row on arrival (``combine_row_flag``) and combine_wait claims rows one at a time and
waits for each row's flags instead of the last block's signal. The tests force the path on
small batches (threshold 1) and check:

- both layouts' combine, bit-identical to the reference and to the signalled path (threshold
  0), over calls mixing the awkward routings (a rank with no tokens, an expert with none, every
  token to one expert), three ranks included;
- the flags: after a call, the parts of ``combine_row_flag[r, t]`` hold that call's number + 1
  exactly where token t went to rank r (the compact layout's own rows excepted: combine_wait
  reads them in place), the same parts for every such row, several of them; the signalled path
  writes none; every part was claimed (``combine_wait_claims``);
- a peer that never sends its rows times combine_wait out naming the flag, the rank and the
  token; ranks that disagree on the threshold are refused when the runtime is built;
- the knobs (``ep_runtime.combine_overlap``): defaults, the sender's grid, bad values refused.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from ep_runtime import reference
from ep_runtime.combine_overlap import ROW_FLAGS_ENV
from ep_runtime.config import EPConfig
from ep_runtime.shmem.launch import run_pes
from ep_runtime.testing import expert_outputs, knob_disagreement_pe, make_inputs

RUN_TIMEOUT_S = 240
SCENARIOS = ("random", "zero_rank", "empty_expert", "one_expert")
CALLS = 5
BF16 = reference.BF16


def base_cfg(R: int, **changes) -> EPConfig:
    """hidden 256: 64 words a row, so a small call's rows are cut into several parts (8 with the
    simulator's 8-lane warps; the other parts of the 16 are empty and never flagged)."""
    return EPConfig(n_ranks=R, n_experts=2 * R, top_k=2, hidden=256, max_tokens_per_rank=6, **changes)


def call_inputs(cfg: EPConfig, call: int):
    return make_inputs(cfg, SCENARIOS[call % len(SCENARIOS)], 700 + call)


def layout_of(call: int) -> str:
    return "compact" if call % 2 == 0 else "expanded"


def compact_rows(cfg: EPConfig, xs, ids, rank: int) -> np.ndarray:
    """The compact combine input of ``rank``: row ``s * T + t`` = (rank + 2) / 3 * x_s[t] where
    token (s, t) came here, zero elsewhere: float32 with float32 partials, else bf16 bits."""
    x, defined = reference.receive_rows(xs, ids, cfg)[rank]
    rows = x.astype(np.float32) * np.float32(rank + 2) / np.float32(3)
    rows[~defined] = 0
    return rows if cfg.combine_dtype == "float32" else rows.astype(BF16).view(np.uint16)


def went_to(ids: np.ndarray, cfg: EPConfig, r: int) -> np.ndarray:
    """[T] bool: the tokens with an expert on rank r."""
    return (np.asarray(ids) // cfg.n_local_experts == r).any(axis=1)


# -- per-rank bodies ------------------------------------------------------------------------------
def cycle_pe(session, R: int, flags_from: int, combine_dtype: str) -> dict:
    """CALLS round trips, compact and expanded alternating; each call's combine result, and
    the row flags and claims after it."""
    from ep_runtime.runtime import EPRuntime

    os.environ[ROW_FLAGS_ENV] = str(flags_from)
    r, cfg = session.rank, base_cfg(R, combine_dtype=combine_dtype)
    calls = []
    with EPRuntime(cfg, session) as rt:
        for call in range(CALLS):
            xs, ids, ws = call_inputs(cfg, call)
            layout = layout_of(call)
            batch = rt.dispatch_wait(rt.dispatch_async(xs[r].view(np.uint16), ids[r], ws[r]), layout=layout)
            if layout == "compact":
                y = compact_rows(cfg, xs, ids, r)
            else:
                y = expert_outputs(cfg, reference.dispatch(xs, ids, ws, cfg)[r], r)
            out = session.to_host(rt.combine(y, batch.handle, layout=layout)).copy()
            calls.append({"out": out, "flags": session.to_host(rt.buffers["combine_row_flag"]).copy(),
                          "claims": session.to_host(rt.buffers["combine_wait_claims"]).copy()})
    return {"calls": calls}


def silent_peer_pe(session) -> dict:
    """Rank 0 dispatches but never combines; rank 1 combines: its combine_wait times out."""
    from ep_runtime.errors import EPTimeoutError
    from ep_runtime.runtime import EPRuntime

    os.environ[ROW_FLAGS_ENV] = "1"
    r, cfg = session.rank, base_cfg(2, wait_timeout_s=1.0)
    xs, ids, ws = make_inputs(cfg, "random", 31, n_tokens=[6, 6])
    res = {"error": None}
    with EPRuntime(cfg, session) as rt:
        batch = rt.dispatch_wait(rt.dispatch_async(xs[r].view(np.uint16), ids[r], ws[r]), layout="compact")
        if r == 1:
            try:
                rt.combine(compact_rows(cfg, xs, ids, r), batch.handle, layout="compact")
            except EPTimeoutError as exc:
                res["error"] = str(exc)
        session.barrier()
    return res


# -- parent side ------------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=[(2, "bfloat16"), (3, "bfloat16"), (3, "float32")],
                ids=["R2", "R3", "R3-f32"])
def cycles(request):
    """float32 partials: the compact rows kernel (one build for both formats) cuts partial words,
    combine_wait token words: their parts must still match."""
    R, combine_dtype = request.param
    flagged = run_pes(cycle_pe, R, args=(R, 1, combine_dtype), timeout_s=RUN_TIMEOUT_S)
    signalled = run_pes(cycle_pe, R, args=(R, 0, combine_dtype), timeout_s=RUN_TIMEOUT_S)
    return R, flagged, signalled, base_cfg(R, combine_dtype=combine_dtype)


def test_flagged_combine_equals_the_reference_and_the_signalled_path(cycles):
    R, flagged, signalled, cfg = cycles
    for call in range(CALLS):
        xs, ids, ws = call_inputs(cfg, call)
        if layout_of(call) == "compact":
            want = reference.combine_rows([compact_rows(cfg, xs, ids, r) for r in range(R)], ids, cfg)
        else:
            refs = reference.dispatch(xs, ids, ws, cfg)
            want = reference.combine([expert_outputs(cfg, refs[s], s) for s in range(R)], refs, ids, cfg)
        for r in range(R):
            what = f"rank {r} call {call} ({layout_of(call)})"
            got = flagged[r]["calls"][call]["out"]
            np.testing.assert_array_equal(got[:len(xs[r])], want[r].view(np.uint16), what)
            np.testing.assert_array_equal(got, signalled[r]["calls"][call]["out"], what + ": flagged != signalled")


def test_flags_mark_exactly_the_rows_that_came_and_every_row_is_claimed(cycles):
    R, flagged, signalled, cfg = cycles
    for call in range(CALLS):
        xs, ids, ws = call_inputs(cfg, call)
        for me in range(R):
            flags = flagged[me]["calls"][call]["flags"]  # [R, Tmax, parts]
            T = len(xs[me])
            for r in range(R):
                want = went_to(ids[me], cfg, r)
                if layout_of(call) == "compact" and r == me:
                    want[:] = False  # own partials are read in place: never sent, never flagged
                now = flags[r, :T] == call + 1  # [T, parts]
                what = f"rank {me} call {call}: flags from rank {r}"
                np.testing.assert_array_equal(now.any(axis=1), want, what)
                if want.any():  # every row that came: the same parts, several of them
                    parts = now[want]
                    assert (parts == parts[0]).all() and parts[0].sum() > 1, (what, parts[0])
                assert (flags[r] <= call + 1).all(), f"rank {me} call {call}: a flag ahead of the call"
            assert not signalled[me]["calls"][call]["flags"].any(), f"rank {me}: the signalled path set a flag"
            claims = flagged[me]["calls"][call]["claims"]  # every part claimed (then one failed claim per warp)
            assert claims[call % 2] >= T, f"rank {me} call {call}: claims {claims.tolist()}"
    # some call must have flagged rows from a peer, or the check proves nothing
    assert any((c["flags"] > 0).any() for c in flagged[0]["calls"])


def test_a_silent_peer_times_the_flagged_wait_out_naming_the_flag_and_token():
    per_rank = run_pes(silent_peer_pe, 2, timeout_s=RUN_TIMEOUT_S)
    message = per_rank[1]["error"]
    assert message is not None, "rank 1's combine did not time out"
    assert "rank 1: combine_wait of call 0 timed out after 1 s waiting for rank 0: combine_row_flag[0, token " \
        in message, message


def test_ranks_that_disagree_on_the_threshold_are_refused():
    res_all = run_pes(knob_disagreement_pe, 2, args=(ROW_FLAGS_ENV, ("1", "2"), base_cfg(2)), timeout_s=RUN_TIMEOUT_S)
    for r, res in enumerate(res_all):
        assert res["error"] is not None and ROW_FLAGS_ENV in res["error"] and "[1, 2]" in res["error"], (r, res)


def test_the_knobs_and_the_senders_grid(monkeypatch):
    """``combine_overlap``: combine_async leaves EP_RUNTIME_COMBINE_WAIT_SMS SMs (at most half its
    grid) to combine_wait only on the whole GPU with PDL; bad values are refused with the name."""
    from ep_runtime.combine_overlap import (DEFAULT_ROW_FLAGS_FROM, DEFAULT_WAIT_SMS_EXPANDED, WAIT_SMS_ENV,
                                            combine_send_grid, row_flags_from)
    from ep_runtime.errors import EPConfigError

    monkeypatch.delenv(ROW_FLAGS_ENV, raising=False)
    monkeypatch.delenv(WAIT_SMS_ENV, raising=False)
    assert row_flags_from() == DEFAULT_ROW_FLAGS_FROM == 1
    assert combine_send_grid(132, whole_gpu=True, pdl_on=True) == 108
    assert combine_send_grid(132, whole_gpu=False, pdl_on=True) == 132  # n_sms set: the caller's limit
    assert combine_send_grid(132, whole_gpu=True, pdl_on=False) == 132  # no early start to make room for
    assert combine_send_grid(10, whole_gpu=True, pdl_on=True) == 5      # at least half kept
    # the expanded layout's sender reads every expert row: it keeps more of the GPU
    assert combine_send_grid(132, True, True, "expanded") == 132 - DEFAULT_WAIT_SMS_EXPANDED == 124
    assert combine_send_grid(132, False, True, "expanded") == 132
    monkeypatch.setenv(WAIT_SMS_ENV, "0")
    assert combine_send_grid(132, whole_gpu=True, pdl_on=True) == 132
    monkeypatch.setenv(WAIT_SMS_ENV, "40")  # when set, the value for both layouts
    assert combine_send_grid(132, True, True, "compact") == combine_send_grid(132, True, True, "expanded") == 92
    monkeypatch.setenv(ROW_FLAGS_ENV, "0")
    assert row_flags_from() == 0
    for name, bad in ((ROW_FLAGS_ENV, "-1"), (WAIT_SMS_ENV, "many")):
        monkeypatch.setenv(name, bad)
        with pytest.raises(EPConfigError, match=name):
            row_flags_from() if name == ROW_FLAGS_ENV else combine_send_grid(132, True, True)
