"""Placement during the transfer (docs/protocol.md, "Placement during the transfer", v26), on the
simulator: the real kernels, one process per rank.

With ``EP_RUNTIME_DISPATCH_PLACE=1`` dispatch_async's routing blocks send their chunks' routing,
flag each chunk on every rank (``dispatch_route_chunk``), wait for every source's chunks 0 and
their own, and write the batch's row descriptions themselves; dispatch_wait only waits for the
token rows (the expanded copy is dispatch_copy's). The simulator runs a kernel's blocks one
at a time in index order, so these tests also show that no routing block waits for a block
that waits. They check:

- both layouts' batches (every field) and the combine after them, bit-identical to the reference
  and to the dispatch_wait path (``EP_RUNTIME_DISPATCH_PLACE=0``), over calls mixing the awkward
  routings (a rank with no tokens, no token anywhere, an expert with none, every token to one
  expert), at 2 and 3 ranks, with the token count from a device scalar, top-k 1, padding, rows
  without word pairs, the dispatch_wait path with its copy fused and not, and grids of 4 blocks
  (two routing blocks: each places its chunk of every source);
- the chunk flags: after call c, ``dispatch_route_chunk[s, b]`` is c + 1 for every source s and
  routing block b, and 0 beyond the routing blocks;
- FP8 (E4M3) tokens placed this way: exact against the reference and the dispatch_wait path;
- a rank that never dispatches times dispatch_async out naming ``dispatch_route_chunk``, the
  rank and the chunk; too many rows is a capacity error naming dispatch_async; ranks that
  disagree are refused; the knob.
"""

from __future__ import annotations

import os

import pytest

from ep_runtime.config import EPConfig
from ep_runtime.dispatch_overlap import PLACE_ENV
from ep_runtime.shmem.launch import run_pes
from ep_runtime.testing import (KNOB_SCENARIOS, assert_fp8_runs_agree, assert_runs_agree, capacity_pe, fp8_knob_pe,
                                knob_disagreement_pe, knob_inputs, knob_round_trips, silent_peer_pe)
from ep_runtime.testing import knob_layout as layout_of

RUN_TIMEOUT_S = 300
CALLS = 6
FP8_SEED = 750


def base_cfg(R: int, **changes) -> EPConfig:
    return EPConfig(**{**dict(n_ranks=R, n_experts=2 * R, top_k=2, hidden=64, max_tokens_per_rank=6), **changes})


def call_inputs(cfg: EPConfig, call: int):
    return knob_inputs(cfg, call, 700)


# -- per-rank bodies ------------------------------------------------------------------------------
def cycle_pe(session, place: str, cfg: EPConfig, device_count: bool) -> dict:
    """CALLS round trips on one runtime (layouts mixed): each call's batch, its combine output and
    the chunk flags after it. ``device_count``: capacity-sized inputs, the token count a device
    scalar (``n_tokens``), as a captured CUDA graph passes it."""
    from ep_runtime.runtime import EPRuntime

    os.environ[PLACE_ENV] = place
    with EPRuntime(cfg, session) as rt:
        assert rt.dispatch_place == (place == "1") and not rt.dispatch_land
        assert not (rt.dispatch_place and rt.fused_copy), "a placing runtime fused the expanded copy"
        calls = knob_round_trips(session, rt, cfg, CALLS, call_inputs, layout_of, device_count,
                                 ("dispatch_route_chunk",))
    from ep_runtime.kernels.dispatch import ROUTE_BLOCKS, ROUTE_GRID_SHARE  # the simulator's, in this PE

    return {"calls": calls, "routing_blocks": max(1, min(ROUTE_BLOCKS, (rt._grid - 1) // ROUTE_GRID_SHARE))}


def fp8_cfg() -> EPConfig:
    return EPConfig(n_ranks=2, n_experts=4, top_k=2, hidden=256, max_tokens_per_rank=5, token_dtype="fp8_e4m3")


# -- parent side ------------------------------------------------------------------------------------
#: name: (ranks, config changes, EP_RUNTIME_FUSED_COPY, device count); a placing runtime never
#: fuses the copy, whatever EP_RUNTIME_FUSED_COPY asks (asserted in cycle_pe)
CYCLE_CASES = {
    "R2": (2, {}, "auto", False),
    "R3-top1-pad4": (3, {"top_k": 1, "pad_multiple": 4}, "auto", False),
    "R2-device-count": (2, {}, "auto", True),
    "R2-copy-kernel": (2, {}, "0", False),  # the expanded copy in dispatch_copy, not in dispatch_wait
    "R2-hidden5": (2, {"hidden": 5}, "auto", False),  # uint16 words: no word pairs
    # 2 routing blocks (each places its chunk of every source), 3 ranks, padding
    "R3-nsms4-pad3": (3, {"n_sms": 4, "pad_multiple": 3}, "auto", False),
}


@pytest.fixture(scope="module", params=list(CYCLE_CASES))
def cycles(request):
    R, changes, fused, device_count = CYCLE_CASES[request.param]
    cfg = base_cfg(R, **changes)
    with pytest.MonkeyPatch.context() as mp:  # the PEs are spawned with this environment
        mp.setenv("EP_RUNTIME_FUSED_COPY", fused)
        placed = run_pes(cycle_pe, R, args=("1", cfg, device_count), timeout_s=RUN_TIMEOUT_S)
        waited = run_pes(cycle_pe, R, args=("0", cfg, device_count), timeout_s=RUN_TIMEOUT_S)
    return cfg, placed, waited


def test_placed_batches_equal_the_reference_and_dispatch_wait(cycles):
    cfg, placed, waited = cycles
    assert_runs_agree(cfg, placed, waited, CALLS, call_inputs, layout_of, "placed")


def test_every_routing_chunk_is_flagged_each_call(cycles):
    cfg, placed, waited = cycles
    blocks = placed[0]["routing_blocks"]  # kernels/dispatch.py route_blocks, as the PE computed it
    for call in range(CALLS):
        for r in range(cfg.n_ranks):
            chunks = placed[r]["calls"][call]["dispatch_route_chunk"]
            assert (chunks[:, :blocks] == call + 1).all(), (r, call, chunks)
            assert (chunks[:, blocks:] == 0).all(), (r, call, chunks)
            unflagged = waited[r]["calls"][call]["dispatch_route_chunk"] == 0
            assert unflagged.all(), "the dispatch_wait path flagged chunks"
    if cfg.n_sms == 4:
        assert blocks == 2, "the 4-block grid was meant to have two routing blocks"


def test_fp8_placed_equals_the_reference():
    cfg = fp8_cfg()
    placed, waited = (run_pes(fp8_knob_pe, 2, args=(PLACE_ENV, v, cfg, KNOB_SCENARIOS, FP8_SEED, "dispatch_place"),
                              timeout_s=RUN_TIMEOUT_S) for v in ("1", "0"))
    assert_fp8_runs_agree(cfg, placed, waited, KNOB_SCENARIOS, FP8_SEED)


def test_a_silent_rank_times_dispatch_async_out_naming_the_route_chunk():
    res = run_pes(silent_peer_pe, 2, args=(PLACE_ENV, "1", base_cfg(2, wait_timeout_s=1.0), 41),
                  timeout_s=RUN_TIMEOUT_S)
    msg = res[0]["error"]
    assert msg is not None, "no timeout"
    assert ("rank 0: dispatch_async of call 1" in msg and "dispatch_route_chunk[1, chunk 0] expected >= 2, observed 1"
            in msg and "waiting for rank 1" in msg), msg


def test_too_many_rows_is_a_capacity_error_of_dispatch_async():
    res = run_pes(capacity_pe, 2, args=(PLACE_ENV, "1", base_cfg(2, max_recv_rows=4), 42),
                  timeout_s=RUN_TIMEOUT_S)
    # experts 0 and 1 (every token's) live on rank 0: 2 x 12 rows for a capacity of 4; rank 1 gets none
    msg = res[0]["error"]
    assert msg is not None and "rank 0: dispatch_async of call 0 needed 24" in msg and "capacity is 4" in msg, msg
    assert res[1]["error"] is None, res[1]


def test_ranks_that_disagree_are_refused():
    res = run_pes(knob_disagreement_pe, 2, args=(PLACE_ENV, ("0", "1"), base_cfg(2)),
                  timeout_s=RUN_TIMEOUT_S)
    for r in range(2):
        assert res[r]["error"] is not None and PLACE_ENV in res[r]["error"], res[r]


def test_knob(monkeypatch):
    """``auto`` places bf16 runtimes of two ranks or more on the whole GPU from
    PLACE_AUTO_MIN_TOKENS tokens per rank on the peer-store path without landing or the copy engine; 0 never; 1 wherever the send
    path can place (FP8 included), refused where it cannot; other values refused."""
    from ep_runtime.dispatch_overlap import PLACE_AUTO_MIN_TOKENS, placing
    from ep_runtime.errors import EPConfigError

    def cfg(**kw):
        base = dict(n_ranks=2, n_experts=8, top_k=2, hidden=256, max_tokens_per_rank=PLACE_AUTO_MIN_TOKENS)
        return EPConfig(**{**base, **kw})

    big, small = cfg(), cfg(max_tokens_per_rank=PLACE_AUTO_MIN_TOKENS - 1)
    for unset in (None, "", "auto", " AUTO "):
        if unset is None:
            monkeypatch.delenv(PLACE_ENV, raising=False)
        else:
            monkeypatch.setenv(PLACE_ENV, unset)
        assert placing(big, True, False, False) is True
        assert placing(small, True, False, False) is False
        assert placing(big, False, False, False) is False  # puts
        assert placing(big, True, True, False) is False  # copy engine
        assert placing(big, True, False, True) is False  # landing
        assert placing(cfg(token_dtype="fp8_e4m3"), True, False, False) is False
        assert placing(cfg(n_ranks=1, n_experts=4), True, False, False) is False
        assert placing(cfg(n_sms=16), True, False, False) is False
    monkeypatch.setenv(PLACE_ENV, "0")
    assert placing(big, True, False, False) is False
    monkeypatch.setenv(PLACE_ENV, "1")
    assert placing(small, True, False, False) is True
    assert placing(cfg(token_dtype="fp8_e4m3"), True, False, False) is True
    for paths, why in (((False, False, False), "puts"), ((True, True, False), "copy"), ((True, False, True), "land")):
        with pytest.raises(EPConfigError, match=why):
            placing(small, *paths)
    for bad in ("2", "-1", "yes"):
        monkeypatch.setenv(PLACE_ENV, bad)
        with pytest.raises(EPConfigError, match=PLACE_ENV):
            placing(small, True, False, False)
