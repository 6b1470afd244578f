"""Every execution plan a runtime can take, on the simulator: the real kernels, one process per
rank, exact against the NumPy reference.

The plan variants (``ep_runtime.core.plan``: receiver x transport x expanded copy, the route-first
thresholds lowered so the simulator's small batches cross them) each run CALLS round trips on
one runtime over the awkward routings (a rank with no tokens; masked slots (-1), with fully
masked tokens, a rank masking every token and experts with none; no token anywhere), in the
layouts the runtime serves (both mixed, or one), and every batch (offsets, counts, descriptions,
weights, rows or gathered rows) and every combine output must be the reference's bit for bit. Cases add 3 ranks, top-k 1, padding, a device token
count (as a captured CUDA graph passes it), rows without word pairs (hidden 5), several ranking
windows and rounds, and grids of 3 and 4 blocks. The FP8 formats (codes and scales in both scale
layouts, quantized in dispatch_async and pre-quantized) and float32 combine partials run on every
receiver.

Then what each protocol leaves behind (route signals, row flags, the placed flag, the receive
count, combine's row flags and claims), the allocation (a plan allocates only the regions it
uses), and the failures: a silent rank times out naming the counter it waits on, too many rows
is a capacity error naming the receive kernel, ranks whose plans differ are refused showing both.
"""

from __future__ import annotations

import numpy as np
import pytest

from ep_runtime.core import reference
from ep_runtime.core.config import EPConfig
from ep_runtime.core.layout import token_word
from ep_runtime.shmem.launch import run_pes
from ep_runtime.testing import (BATCH_FIELDS, assert_batch_is_the_reference, assert_calls_are_the_reference,
                                assert_fp8_calls_are_the_reference, call_inputs, call_layout, capacity_pe,
                                expert_outputs, fp8_plan_pe, make_inputs, plan_disagreement_pe, plan_pe, silent_peer_pe)

RUN_TIMEOUT_S = 300
CALLS = 4  # calls 0-2: random, zero_rank, masked (CALL_SCENARIOS); 3: no token anywhere; both groups twice
SEED = 900
#: The route-first thresholds, lowered so the simulator's batches (a few tokens a rank) are split
#: (the token blocks send the routing), shared (two placing blocks describe) and chunked (each
#: ranks a chunk) on some calls and not on others.
LOW = {"share_from_tokens": 4, "chunk_from_tokens": 8, "split_from_tokens": 4}

#: name -> plan overrides
VARIANTS = {
    "wait": {"receiver": "wait"},
    "wait-puts": {"receiver": "wait", "transport": "puts"},
    "land": {"receiver": "land"},
    "land-puts": {"receiver": "land", "transport": "puts"},
    "route_first": {"receiver": "route_first", **LOW},  # bf16 expanded: placed and copied in one launch
    "route_first-copy": {"receiver": "route_first", "expanded_copy": "dispatch_copy", **LOW},
    "route_first_chunked": {"receiver": "route_first_chunked", **LOW},
}


def base_cfg(R: int, **changes) -> EPConfig:
    """hidden 256: 64 uint64 words a row, so a call of 6 tokens cuts rows into 8 parts of an
    8-lane simulated warp's 8 words (landing's senders and combine both flag each part). Waits
    are bounded by a minute: a loaded CI machine runs a simulated kernel of a peer for seconds
    (the failure tests bound theirs by a second)."""
    return EPConfig(**{**dict(n_ranks=R, n_experts=2 * R, top_k=2, hidden=256, max_tokens_per_rank=6,
                              wait_timeout_s=60.0), **changes})


#: name -> (ranks, config changes, device token count)
CASES = {
    "R2": (2, {}, False),
    "R3-top1-pad4": (3, {"top_k": 1, "pad_multiple": 4}, False),
    "R2-device-count": (2, {}, True),
    "R2-hidden5": (2, {"hidden": 5}, False),  # uint16 words: no word pairs, one part a row
    # 6 local experts (two windows of 4) and up to 3 x 12 tokens (several rounds), padding
    "R3-windows-pad3": (3, {"n_experts": 18, "top_k": 4, "max_tokens_per_rank": 12, "pad_multiple": 3}, False),
    # 138 words a row: several passes of the copy loops per part; a grid of 3 blocks
    "R2-hidden552-nsms3": (2, {"hidden": 552, "n_sms": 3}, False),
    # two routing blocks (each ranks half the tokens)
    "R3-nsms4": (3, {"n_sms": 4}, False),
    "R2-compact-only": (2, {"layouts": "compact"}, False),
    "R2-expanded-only": (2, {"layouts": "expanded"}, False),
}

#: (variant, case) pairs run: every variant on the base case and the awkward ones, the others
#: where they exercise that variant's own code.
RUNS = [(v, c) for v in VARIANTS for c in ("R2", "R3-top1-pad4", "R2-device-count", "R2-compact-only")
        if (v, c) != ("route_first-copy", "R2-compact-only")] + [  # (a compact-only runtime copies nothing)
    ("wait", "R2-hidden5"), ("land", "R2-hidden5"), ("route_first", "R2-hidden5"),
    ("wait", "R3-windows-pad3"), ("route_first", "R3-windows-pad3"), ("route_first_chunked", "R3-windows-pad3"),
    ("wait", "R2-hidden552-nsms3"), ("land", "R2-hidden552-nsms3"), ("route_first", "R2-hidden552-nsms3"),
    ("wait-puts", "R3-nsms4"), ("land", "R3-nsms4"), ("land-puts", "R3-nsms4"),
    ("land", "R2-expanded-only"), ("route_first", "R2-expanded-only"),
]
#: regions each run records after every call
BOOKKEEPING = ("dispatch_row_flag", "dispatch_route_signal", "dispatch_placed", "receive_sync", "combine_row_flag",
               "combine_wait_claims")


@pytest.fixture(scope="module", params=RUNS, ids=[f"{v}-{c}" for v, c in RUNS])
def run(request):
    variant, case = request.param
    R, changes, device_count = CASES[case]
    cfg = base_cfg(R, **changes)
    res = run_pes(plan_pe, R, args=(VARIANTS[variant], cfg, CALLS, SEED, device_count, BOOKKEEPING),
                  timeout_s=RUN_TIMEOUT_S)
    return variant, cfg, res


def test_batches_and_combine_equal_the_reference(run):
    variant, cfg, res = run
    assert_calls_are_the_reference(cfg, res, CALLS, SEED, variant)


def test_the_runtime_takes_the_plan_asked_for_and_allocates_what_it_uses(run):
    variant, cfg, res = run
    plan, regions = res[0]["plan"], set(res[0]["regions"])
    for key, value in VARIANTS[variant].items():
        assert plan[key] == value, (key, plan[key], value)
    assert all(r["plan"] == plan for r in res), "the ranks' plans differ"
    receiver, puts, fp8 = plan["receiver"], plan["transport"] == "puts", cfg.token_format.quantized
    assert ("expert_x" in regions) == ("expanded" in cfg.layouts)
    assert ("dispatch_ranks" in regions) == (receiver in ("wait", "land"))
    assert ("dispatch_route_signal" in regions) == (receiver != "wait")
    assert ("dispatch_row_flag" in regions) == (receiver == "land" and not fp8)
    assert ("combine_stage" in regions) == ("dispatch_send_counts" in regions) == puts
    assert plan["expanded_copy"] == ("none" if "expanded" not in cfg.layouts else plan["expanded_copy"])


def sender_parts(T: int, words: int, warp: int = 8) -> int:
    """The parts with words of a landing sender's rows (``ep_runtime/kernels/block.flag_rule``) for T tokens
    of ``words`` words, at most 16 parts, with the simulator's 8-lane warps: a part spans
    ``ceil(words / parts)`` words rounded up to whole warps, so a row's last parts may be empty
    (never sent, never flagged)."""
    parts = 1 if T == 0 else max(1, min(16, -(-words // warp), -(-2048 // T)))
    span = -(-(-(-words // parts)) // warp) * warp
    return -(-words // span)


def test_the_protocols_bookkeeping(run):
    """After call c: the route signals (landing and route-first plans) carry (c + 1) << 32 | T of
    every source; a landing plan's bf16 row flags hold c + 1 exactly where a peer's token came,
    for the parts its senders cut; a copying route-first plan's placed flag carries its last
    expanded call; the receive count is c + 1; every combine part that came is flagged and
    claimed."""
    variant, cfg, res = run
    plan, R, L = res[0]["plan"], cfg.n_ranks, cfg.n_local_experts
    words = cfg.hidden * 2 // token_word(cfg.hidden).itemsize
    last_expanded = -1
    for call in range(CALLS):
        xs, ids, _ = call_inputs(cfg, call, SEED)
        if call_layout(cfg, call) == "expanded":
            last_expanded = call
        for r in range(R):
            got, at = res[r]["calls"][call], f"{variant} rank {r} call {call}"
            assert got["receive_sync"][1] == call + 1 and got["receive_sync"][0] == 0, (at, got["receive_sync"])
            if plan["receiver"] != "wait":
                want = [(call + 1) << 32 | len(x) for x in xs]
                assert got["dispatch_route_signal"][call % 2].tolist() == want, at
            if plan["receiver"] == "land":
                flags = got["dispatch_row_flag"]
                for s in range(R):
                    if s == r:  # a rank's own bf16 rows are never sent: dispatch_land reads the caller's
                        assert (flags[s] <= call).all(), at
                        continue
                    T, parts = len(xs[s]), sender_parts(len(xs[s]), words)
                    here = (np.asarray(ids[s]) // L == r).any(axis=1)
                    assert (flags[s, :T, :parts][here] == call + 1).all(), f"{at} src {s}: unflagged"
                    assert (flags[s, :T, :parts][~here] <= call).all(), f"{at} src {s}: flagged, not sent"
            if "dispatch_placed" in got:  # a route-first bf16 plan: set by expanded calls copied in one launch
                copying = plan["expanded_copy"] == "in_wait"
                want = (last_expanded + 1) << 1 if copying and last_expanded >= 0 else 0
                assert int(got["dispatch_placed"][0]) == want, (at, got["dispatch_placed"])
            cflags = got["combine_row_flag"]
            for s in range(R):
                came = (np.asarray(ids[r]) // L == s).any(axis=1)  # my tokens that went to rank s
                flagged = (cflags[s, :len(xs[r])] == call + 1).any(axis=1)
                np.testing.assert_array_equal(flagged, came, err_msg=f"{at}: combine flags from rank {s}")
            assert got["combine_wait_claims"][call % 2] >= len(xs[r]), (at, got["combine_wait_claims"])


# -- formats ---------------------------------------------------------------------------------------
FP8_RUNS = [("wait", "fp8_e4m3", False), ("wait-puts", "fp8_e4m3_ue8m0", False), ("land", "fp8_e4m3", False),
            ("route_first", "fp8_e4m3", False), ("route_first_chunked", "fp8_e4m3", False),
            ("route_first_chunked", "fp8_e4m3", True), ("route_first_chunked", "fp8_e4m3_ue8m0", True),
            ("land-puts", "fp8_e4m3_ue8m0", True)]


@pytest.mark.parametrize("variant, token_dtype, prequantized", FP8_RUNS,
                         ids=[f"{v}-{t}" + ("-pq" if p else "") for v, t, p in FP8_RUNS])
def test_fp8_codes_scales_and_combine_equal_the_reference(variant, token_dtype, prequantized):
    cfg = EPConfig(n_ranks=2, n_experts=4, top_k=2, hidden=256, max_tokens_per_rank=8, token_dtype=token_dtype,
                   wait_timeout_s=60.0)
    res = run_pes(fp8_plan_pe, 2, args=(VARIANTS[variant], cfg, 950, prequantized), timeout_s=RUN_TIMEOUT_S)
    assert res[0]["plan"]["receiver"] == VARIANTS[variant]["receiver"]
    assert_fp8_calls_are_the_reference(cfg, res, 950, prequantized, variant)


F32_RUNS = ["wait", "wait-puts", "route_first", "land"]


@pytest.mark.parametrize("variant", F32_RUNS)
def test_float32_partials_equal_the_reference(variant):
    cfg = base_cfg(2, combine_dtype="float32")
    res = run_pes(plan_pe, 2, args=(VARIANTS[variant], cfg, 4, 960), timeout_s=RUN_TIMEOUT_S)
    assert_calls_are_the_reference(cfg, res, 4, 960, f"{variant} f32 partials")


# -- failures --------------------------------------------------------------------------------------
#: receiver -> (variant, what rank 0's timeout names)
SILENT = {
    "wait": ("wait", "dispatch_wait of call 1 timed out after 1 s waiting for rank 1: dispatch_signal[1][1]"),
    "land": ("land", "dispatch_land of call 1 timed out after 1 s waiting for rank 1: dispatch_route_signal[1][1]"),
    "route_first": ("route_first", "dispatch_wait of call 1 timed out after 1 s waiting for rank 1: "
                                   "dispatch_route_signal[1][1] expected >= 2, observed 0"),
}


@pytest.mark.parametrize("receiver", list(SILENT))
def test_a_silent_rank_times_out_naming_the_counter(receiver):
    variant, want = SILENT[receiver]
    res = run_pes(silent_peer_pe, 2, args=(VARIANTS[variant], base_cfg(2, wait_timeout_s=1.0), 31),
                  timeout_s=RUN_TIMEOUT_S)
    assert res[0]["error"] is not None and want in res[0]["error"], res[0]["error"]


@pytest.mark.parametrize("variant, kernel", [("wait", "dispatch_wait"), ("land", "dispatch_land"),
                                             ("route_first", "dispatch_wait"),
                                             ("route_first_chunked", "dispatch_wait")])
def test_too_many_rows_is_a_capacity_error_naming_the_receive_kernel(variant, kernel):
    res = run_pes(capacity_pe, 2, args=(VARIANTS[variant], base_cfg(2, max_recv_rows=4), 32),
                  timeout_s=RUN_TIMEOUT_S)
    # experts 0 and 1 (every token's) live on rank 0: 2 x 12 rows for a capacity of 4; rank 1 gets none
    msg = res[0]["error"]
    assert msg is not None and f"rank 0: {kernel} of call 0 needed 24" in msg and "capacity is 4" in msg, msg
    assert res[1]["error"] is None, res[1]


def test_ranks_whose_plans_differ_are_refused_showing_both():
    res = run_pes(plan_disagreement_pe, 2, args=(({"receiver": "wait"}, {"receiver": "land"}), base_cfg(2)),
                  timeout_s=RUN_TIMEOUT_S)
    for r in range(2):
        msg = res[r]["error"]
        assert msg is not None and "execution plan differs" in msg, msg
        assert "receiver                   wait" in msg and "receiver                   land" in msg, msg


def lost_flags_pe(session) -> dict:
    """Call 1 sent by both ranks of a landing plan, then rank 0 erases the part flags rank 1 set
    in it (as if they were lost) before its dispatch_land: that must wait for them, and time out
    naming the flag, the rank and a token, instead of copying the rows."""
    from ep_runtime.core.errors import EPTimeoutError
    from ep_runtime.core.runtime import EPRuntime

    r, cfg = session.rank, base_cfg(2, wait_timeout_s=1.0)
    xs, ids, ws = make_inputs(cfg, "one_expert", 33, n_tokens=[6, 6])  # every token to rank 0
    res = {"error": None}
    with EPRuntime(cfg, session, plan={"receiver": "land"}) as rt:
        batch = rt.dispatch(xs[r].view(np.uint16), ids[r], ws[r])
        rt.combine(expert_outputs(cfg, reference.dispatch(xs, ids, ws, cfg)[r], r), batch.handle)
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


def test_dispatch_land_waits_for_each_part_flag():
    res = run_pes(lost_flags_pe, 2, timeout_s=RUN_TIMEOUT_S)
    msg = res[0]["error"]
    assert msg is not None, "dispatch_land copied rows whose flags were never set"
    assert "dispatch_land of call 1" in msg and "dispatch_row_flag[1, token 0]" in msg and "rank 1" in msg, msg
    assert res[1]["error"] is None, res[1]


def late_flags_pe(session, delay_s: float) -> dict:
    """Both ranks send, then rank 0 erases the part flags rank 1 set (as if its rows had not
    landed yet) and a host thread sets them again ``delay_s`` later, while rank 0's dispatch_land
    runs: its warps claim parts that have not landed and wait for them, as on a GPU while the
    rows fly. Expanded, compact, expanded."""
    import threading

    from ep_runtime.core.runtime import EPRuntime

    r, cfg = session.rank, base_cfg(2, wait_timeout_s=60.0)
    out = []
    with EPRuntime(cfg, session, plan={"receiver": "land"}) as rt:
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


def test_parts_that_land_late_are_awaited_and_exact():
    cfg = base_cfg(2)
    res = run_pes(late_flags_pe, 2, args=(1.0,), timeout_s=RUN_TIMEOUT_S)
    for call, layout in enumerate(("expanded", "compact", "expanded")):
        xs, ids, ws = make_inputs(cfg, "random", 970 + call)
        refs = reference.dispatch(xs, ids, ws, cfg)
        want = reference.combine([expert_outputs(cfg, refs[s], s) for s in range(2)], refs, ids, cfg)
        for r in range(2):
            got, what = res[r]["calls"][call], f"rank {r} call {call} ({layout})"
            assert_batch_is_the_reference(got, refs[r], layout, xs, cfg, what)
            np.testing.assert_array_equal(got["out"][:len(xs[r])], want[r].view(np.uint16), err_msg=what)
