"""Dispatch rows as they land (docs/protocol.md, "Dispatch rows as they land"), on the simulator:
the real kernels, one process per rank.

With ``EP_RUNTIME_DISPATCH_LAND=1`` dispatch_async signals each rank's routing on its own
(``dispatch_route_signal``) and flags every part of every bf16 token row on arrival
(``dispatch_row_flag``), and dispatch_wait enqueues ``dispatch_land``, which places the rows
once the routing is in and copies each part once its flag is set. The simulator runs a rank's
kernels in stream order (no early start; the ranks' processes run concurrently, so a kernel may
still wait for a peer), so these tests check the protocol's data and bookkeeping:

- both layouts' batches (every field) and the combine after them, bit-identical to the reference
  and to the dispatch_wait path, over calls mixing the awkward routings (a rank with no tokens,
  no token anywhere, an expert with none, every token to one expert), at 2 and 3 ranks, on peer
  stores and on puts, with the token count from a device scalar (as a CUDA graph passes it),
  top-k 1, padding, rows cut into several parts (empty ones among them), grids of 3 and 4 blocks
  (two routing blocks: each ranks a chunk of the tokens);
- the flags: after call c, ``dispatch_row_flag[s, t, p]`` holds c + 1 exactly where token t of
  rank s came to this rank, for the parts the senders' rule gives (several at hidden 256), and
  nowhere else; the route signals carry each source's call and token count; the receive count
  and the claims advance;
- FP8 (E4M3) tokens: dispatch_land places, dispatch_copy lays out codes and scales, exact;
- parts that land after dispatch_land claimed them (flags erased, then set again by a host
  thread): awaited, and the batches and combine exact;
- a rank that never dispatches times dispatch_land out naming ``dispatch_route_signal`` and the
  rank; too many rows is a capacity error; ranks that disagree are refused; the knobs.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from ep_runtime import reference
from ep_runtime.config import EPConfig
from ep_runtime.dispatch_overlap import LAND_ENV
from ep_runtime.layout import dispatch_signal_value, token_word
from ep_runtime.shmem.launch import run_pes
from ep_runtime.testing import (BATCH_FIELDS, KNOB_SCENARIOS, assert_batch_is_the_reference,
                                assert_fp8_runs_agree, assert_runs_agree, capacity_pe, expert_outputs, fp8_knob_pe,
                                knob_disagreement_pe, knob_inputs, knob_round_trips, make_inputs, silent_peer_pe)
from ep_runtime.testing import knob_layout as layout_of

RUN_TIMEOUT_S = 300
CALLS = 6
FP8_SEED = 950


def base_cfg(R: int, **changes) -> EPConfig:
    """hidden 256: 64 uint64 words a row, so a call of 6 tokens cuts rows into 8 parts of an
    8-lane simulated warp's 8 words (the senders' rule; the other 8 of the 16 are never used)."""
    return EPConfig(**{**dict(n_ranks=R, n_experts=2 * R, top_k=2, hidden=256, max_tokens_per_rank=6), **changes})


def call_inputs(cfg: EPConfig, call: int):
    return knob_inputs(cfg, call, 900)


# -- per-rank bodies ------------------------------------------------------------------------------
def cycle_pe(session, land: str, cfg: EPConfig, device_count: bool) -> dict:
    """CALLS round trips on one runtime (layouts mixed): each call's batch, combine output, and
    the landing bookkeeping after it. ``device_count``: the inputs are capacity-sized and the
    token count is a device scalar (``n_tokens``), as a captured CUDA graph passes it."""
    from ep_runtime.runtime import EPRuntime

    os.environ[LAND_ENV] = land
    with EPRuntime(cfg, session) as rt:
        assert rt.dispatch_land == (land == "1")
        calls = knob_round_trips(session, rt, cfg, CALLS, call_inputs, layout_of, device_count,
                                 ("dispatch_row_flag", "dispatch_route_signal", "dispatch_land_sync"))
    return {"calls": calls}


def fp8_cfg() -> EPConfig:
    return EPConfig(n_ranks=2, n_experts=4, top_k=2, hidden=256, max_tokens_per_rank=5, token_dtype="fp8_e4m3")


def round_trip(rt, session, cfg: EPConfig, xs, ids, ws) -> None:
    """One dispatch and combine of this rank's inputs (its combine grants the peers the next
    call's token credits)."""
    r = session.rank
    batch = rt.dispatch(xs[r].view(np.uint16), ids[r], ws[r])
    rt.combine(expert_outputs(cfg, reference.dispatch(xs, ids, ws, cfg)[r], r), batch.handle)


def lost_flags_pe(session) -> dict:
    """Call 1 sent by both ranks, then rank 0 erases the part flags rank 1 set in it (a fault
    injected by the host, as if they were lost) before its dispatch_land: that must wait for
    them, and time out naming the flag, the rank and a token, instead of copying the rows."""
    from ep_runtime.errors import EPTimeoutError
    from ep_runtime.runtime import EPRuntime

    os.environ[LAND_ENV] = "1"
    r, cfg = session.rank, base_cfg(2, wait_timeout_s=1.0)
    xs, ids, ws = make_inputs(cfg, "one_expert", 33, n_tokens=[6, 6])  # every token to rank 0
    res = {"error": None}
    with EPRuntime(cfg, session) as rt:
        round_trip(rt, session, cfg, xs, ids, ws)
        handle = rt.dispatch_async(xs[r].view(np.uint16), ids[r], ws[r])
        session.barrier()  # both ranks' call 1 sent
        if r == 0:
            session.fill(rt.buffers["dispatch_row_flag"][1], 0)
            try:
                rt.dispatch_wait(handle)
            except EPTimeoutError as exc:
                res["error"] = str(exc)
        else:
            rt.dispatch_wait(handle)
        session.barrier()
    return res


def late_flags_pe(session, delay_s: float) -> dict:
    """Both ranks send, then rank 0 erases the part flags rank 1 set (as if its rows had not
    landed yet) and a host thread sets them again ``delay_s`` later, while rank 0's dispatch_land
    runs: its warps claim parts that have not landed and wait for them, as on a GPU while the
    rows fly. (In the simulator a sender's rows are all flagged before its routing is signalled,
    so without this no part is ever awaited.) Expanded, compact, expanded."""
    import threading
    import time

    from ep_runtime.runtime import EPRuntime

    os.environ[LAND_ENV] = "1"
    r, cfg = session.rank, base_cfg(2, wait_timeout_s=60.0)
    out = []
    with EPRuntime(cfg, session) as rt:
        for call, layout in enumerate(("expanded", "compact", "expanded")):
            xs, ids, ws = make_inputs(cfg, "random", 970 + call)
            handle = rt.dispatch_async(xs[r].view(np.uint16), ids[r], ws[r])
            session.barrier()  # both ranks' rows of this call sent and flagged
            if r == 0:
                flags = rt.buffers["dispatch_row_flag"][1]
                session.fill(flags, 0)
                later = threading.Timer(delay_s, session.fill, (flags, call + 1))
                later.start()
            batch = rt.dispatch_wait(handle, layout=layout)
            if r == 0:
                later.join()
            got = {k: session.to_host(getattr(batch, k)).copy() for k in BATCH_FIELDS}
            if layout == "compact":
                got["gather"] = session.to_host(batch.gather).copy()
                got["recv_tokens"] = session.to_host(batch.recv_tokens).copy()
            refs = reference.dispatch(xs, ids, ws, cfg)
            got["out"] = session.to_host(rt.combine(expert_outputs(cfg, refs[r], r), batch.handle)).copy()
            session.barrier()
            out.append(got)
    return {"calls": out}


# -- parent side ------------------------------------------------------------------------------------
CYCLE_CASES = {
    "R2": (2, {}, "1", False),
    "R3": (3, {}, "1", False),
    "R2-puts": (2, {}, "0", False),
    "R2-device-count": (2, {}, "1", True),
    "R3-top1-pad4": (3, {"top_k": 1, "pad_multiple": 4}, "1", False),
    "R2-hidden5": (2, {"hidden": 5}, "1", False),  # uint16 words: no word pairs, one part a row
    # 138 words a row: several passes of the copy loop per part, 16 parts of 16 words (the last 7
    # empty: neither sent nor awaited), a grid of 3 blocks
    "R2-hidden552-nsms3": (2, {"hidden": 552, "n_sms": 3}, "1", False),
    # 2 routing blocks (each ranks half the tokens), on puts and on stores
    "R3-nsms4-puts": (3, {"n_sms": 4}, "0", False),
    "R3-nsms4-top1-pad4": (3, {"n_sms": 4, "top_k": 1, "pad_multiple": 4}, "1", False),
}


@pytest.fixture(scope="module", params=list(CYCLE_CASES))
def cycles(request):
    R, changes, peer_stores, device_count = CYCLE_CASES[request.param]
    cfg = base_cfg(R, **changes)
    with pytest.MonkeyPatch.context() as mp:  # the PEs are spawned with this environment
        mp.setenv("EP_RUNTIME_PEER_STORES", peer_stores)
        landed = run_pes(cycle_pe, R, args=("1", cfg, device_count), timeout_s=RUN_TIMEOUT_S)
        waited = run_pes(cycle_pe, R, args=("0", cfg, device_count), timeout_s=RUN_TIMEOUT_S)
    return cfg, landed, waited


def test_landing_batches_equal_the_reference_and_dispatch_wait(cycles):
    cfg, landed, waited = cycles
    # the receive buffer's rows no expert gathers are unspecified (a landing runtime writes its
    # own rows only when asked, v28): the compact x is checked where gathered, not whole
    assert_runs_agree(cfg, landed, waited, CALLS, call_inputs, layout_of, "landing", same_compact_x=False)


def test_combine_after_landing_equals_the_reference(cycles):
    cfg, landed, waited = cycles
    for call in range(CALLS):
        xs, ids, ws = call_inputs(cfg, call)
        refs = reference.dispatch(xs, ids, ws, cfg)
        want = reference.combine([expert_outputs(cfg, refs[s], s) for s in range(cfg.n_ranks)], refs, ids, cfg)
        for r in range(cfg.n_ranks):
            got = landed[r]["calls"][call]["out"]
            np.testing.assert_array_equal(got, want[r].view(np.uint16), err_msg=f"rank {r} call {call}")
            np.testing.assert_array_equal(got, waited[r]["calls"][call]["out"], err_msg=f"rank {r} call {call}")


def sender_parts(T: int, words: int, warp: int = 8) -> tuple[int, int]:
    """The senders' rule (``kernels/block.flag_rule``) for T tokens of ``words`` words, at most
    16 parts, worked out here for the simulator's 8-lane warps: ``(parts, parts with words)``;
    a part spans ``ceil(words / parts)`` words rounded up to whole warps, so the last parts of a
    row may be empty (never sent, never flagged)."""
    parts = 1 if T == 0 else max(1, min(16, -(-words // warp), -(-2048 // T)))
    span = -(-(-(-words // parts)) // warp) * warp
    return parts, -(-words // span)


def test_flags_route_signals_and_counters(cycles):
    cfg, landed, waited = cycles
    R, L = cfg.n_ranks, cfg.n_local_experts
    words = cfg.hidden * 2 // token_word(cfg.hidden).itemsize
    several = False
    for call in range(CALLS):
        xs, ids, ws = call_inputs(cfg, call)
        for r in range(R):
            got = landed[r]["calls"][call]
            flags = got["dispatch_row_flag"]
            for s in range(R):
                T = len(xs[s])
                _, parts = sender_parts(T, words)  # the parts with words: the flagged ones
                several |= parts > 1
                here = (np.asarray(ids[s]) // L == r).any(axis=1)  # [T]: token t of s came to r
                if s == r:  # a rank's own rows are never sent (dispatch_land reads the caller's, v28)
                    assert (flags[s] <= call).all(), f"rank {r} call {call}: its own rows flagged"
                    continue
                assert (flags[s, :T, :parts][here] == call + 1).all(), f"rank {r} call {call} src {s}: unflagged"
                assert (flags[s, :T, :parts][~here] <= call).all(), f"rank {r} call {call} src {s}: flagged, not sent"
                assert (flags[s, :, parts:] <= call).all() and (flags[s, T:] <= call).all(), (r, call, s)
            route = got["dispatch_route_signal"][call % 2]
            assert route.tolist() == [dispatch_signal_value(call, len(x)) for x in xs], (r, call)
            sync = got["dispatch_land_sync"]
            assert sync[0] == 0 and sync[1] == call + 1, (r, call, sync)  # ticket reset, receive count
            for s in range(R):
                assert (waited[r]["calls"][call]["dispatch_row_flag"] == 0).all(), "dispatch_wait path flagged rows"
    if cfg.hidden == 256:
        assert several, "no call cut its rows into several parts"


def test_fp8_landing_equals_the_reference():
    cfg = fp8_cfg()
    landed, waited = (run_pes(fp8_knob_pe, 2, args=(LAND_ENV, v, cfg, KNOB_SCENARIOS, FP8_SEED, "dispatch_land"),
                              timeout_s=RUN_TIMEOUT_S) for v in ("1", "0"))
    assert_fp8_runs_agree(cfg, landed, waited, KNOB_SCENARIOS, FP8_SEED)


def test_a_silent_rank_times_dispatch_land_out_naming_the_route_signal():
    res = run_pes(silent_peer_pe, 2, args=(LAND_ENV, "1", base_cfg(2, wait_timeout_s=1.0), 31),
                  timeout_s=RUN_TIMEOUT_S)
    msg = res[0]["error"]
    assert msg is not None, "no timeout"
    assert "dispatch_land of call 1" in msg and "dispatch_route_signal[1][1]" in msg and "rank 1" in msg, msg


def test_dispatch_land_waits_for_each_part_flag():
    res = run_pes(lost_flags_pe, 2, timeout_s=RUN_TIMEOUT_S)
    msg = res[0]["error"]
    assert msg is not None, "dispatch_land copied rows whose flags were never set"
    assert "dispatch_land of call 1" in msg and "dispatch_row_flag[1, token 0]" in msg and "rank 1" in msg, msg
    assert res[1]["error"] is None, res[1]


def test_parts_that_land_late_are_awaited_and_exact():
    cfg = base_cfg(2)
    res = run_pes(late_flags_pe, 2, args=(1.0,), timeout_s=RUN_TIMEOUT_S)
    for call, layout in enumerate(("expanded", "compact", "expanded")):
        xs, ids, ws = make_inputs(cfg, "random", 970 + call)
        refs = reference.dispatch(xs, ids, ws, cfg)
        want = reference.combine([expert_outputs(cfg, refs[s], s) for s in range(2)], refs, ids, cfg)
        for r in range(2):
            got, ref, what = res[r]["calls"][call], refs[r], f"rank {r} call {call} ({layout})"
            assert_batch_is_the_reference(got, ref, layout, xs, cfg, what)
            np.testing.assert_array_equal(got["out"][:len(xs[r])], want[r].view(np.uint16), err_msg=what)


def test_too_many_rows_is_a_capacity_error():
    res = run_pes(capacity_pe, 2, args=(LAND_ENV, "1", base_cfg(2, max_recv_rows=4), 32),
                  timeout_s=RUN_TIMEOUT_S)
    # experts 0 and 1 (every token's) live on rank 0: 2 x 12 rows for a capacity of 4; rank 1 gets none
    msg = res[0]["error"]
    assert msg is not None and "dispatch_land" in msg and "needed 24" in msg and "capacity is 4" in msg, msg
    assert res[1]["error"] is None, res[1]


def test_ranks_that_disagree_are_refused():
    res = run_pes(knob_disagreement_pe, 2, args=(LAND_ENV, ("0", "1"), base_cfg(2)),
                  timeout_s=RUN_TIMEOUT_S)
    for r in range(2):
        assert res[r]["error"] is not None and LAND_ENV in res[r]["error"], res[r]


def test_knobs(monkeypatch):
    """``dispatch_overlap``: ``auto`` by default (bf16 tokens, two ranks or more, the whole GPU,
    at least LAND_AUTO_MIN_TOKENS tokens per rank; never with the copy engine); 0 off, 1 on;
    other values and 1 with the copy engine refused; dispatch_async leaves
    EP_RUNTIME_DISPATCH_LAND_SMS SMs (at most half its grid) only on a whole GPU with PDL."""
    from ep_runtime.dispatch_overlap import (DEFAULT_LAND_SMS, LAND_AUTO_MIN_TOKENS, LAND_SMS_ENV, dispatch_send_grid,
                                            landing)
    from ep_runtime.errors import EPConfigError

    def cfg(**kw):
        base = dict(n_ranks=2, n_experts=8, top_k=2, hidden=256, max_tokens_per_rank=LAND_AUTO_MIN_TOKENS)
        return EPConfig(**{**base, **kw})

    big, small = cfg(), cfg(max_tokens_per_rank=LAND_AUTO_MIN_TOKENS - 1)
    monkeypatch.delenv(LAND_SMS_ENV, raising=False)
    for unset in (None, "", "auto", " AUTO "):
        if unset is None:
            monkeypatch.delenv(LAND_ENV, raising=False)
        else:
            monkeypatch.setenv(LAND_ENV, unset)
        assert landing(big, copy_engine=False) is True
        assert landing(small, copy_engine=False) is False
        assert landing(big, copy_engine=True) is False  # auto never lands the copy engine's rows
        assert landing(cfg(token_dtype="fp8_e4m3"), copy_engine=False) is False
        assert landing(cfg(n_ranks=1, n_experts=4), copy_engine=False) is False
        assert landing(cfg(n_sms=16), copy_engine=False) is False
    monkeypatch.setenv(LAND_ENV, "0")
    assert landing(big, copy_engine=False) is False
    monkeypatch.setenv(LAND_ENV, "1")
    assert landing(small, copy_engine=False) is True
    assert landing(cfg(token_dtype="fp8_e4m3"), copy_engine=False) is True
    with pytest.raises(EPConfigError, match="copy_engine"):
        landing(small, copy_engine=True)
    for bad in ("2", "-1", "yes"):
        monkeypatch.setenv(LAND_ENV, bad)
        with pytest.raises(EPConfigError, match=LAND_ENV):
            landing(small, copy_engine=False)
    assert dispatch_send_grid(132, whole_gpu=True, pdl_on=True) == 132 - DEFAULT_LAND_SMS == 84
    assert dispatch_send_grid(132, whole_gpu=False, pdl_on=True) == 132
    assert dispatch_send_grid(132, whole_gpu=True, pdl_on=False) == 132
    assert dispatch_send_grid(10, whole_gpu=True, pdl_on=True) == 5
    monkeypatch.setenv(LAND_SMS_ENV, "0")
    assert dispatch_send_grid(132, whole_gpu=True, pdl_on=True) == 132
    monkeypatch.setenv(LAND_SMS_ENV, "few")
    with pytest.raises(EPConfigError, match=LAND_SMS_ENV):
        dispatch_send_grid(132, True, True)
