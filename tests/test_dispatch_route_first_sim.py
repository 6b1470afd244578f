"""The route-first dispatch (docs/protocol.md, "Route first", v29), on the simulator: the real
kernels, one process per rank.

With ``EP_RUNTIME_DISPATCH_ROUTE_FIRST=1`` dispatch_async's routing block sends the routing rows
(ids, weights) and T to every rank and signals them (``dispatch_route_signal``) before anything
else, and ranks nothing; dispatch_wait, one block, waits for every source's routing, ranks and
places every received row from the routing rows alone, then waits for the token rows' signal.
The expanded layout's copy is dispatch_wait's own (v30: the kernel on the whole grid, its first
block placing, then every block copying token-major once it has published ``dispatch_placed``),
or dispatch_copy's with ``EP_RUNTIME_FUSED_COPY=0`` and in a chunked build (v33: above
``ROUTE_CHUNKS_ABOVE`` tokens per rank the token blocks send the routing rows and the placing
blocks rank a chunk each). The simulator's receive window is 4 local experts
and its blocks have a few warps, so its configurations take several windows and rounds (the
GPU's common case, one window and one round, reuses pass 1's masks: the configurations with at
most 4 local experts and few tokens take that branch too). They check:

- both layouts' batches (every field) and the combine after them, bit-identical to the reference
  and to the dispatch_wait path (``EP_RUNTIME_DISPATCH_ROUTE_FIRST=0``), with either copy (one
  launch, or dispatch_copy after it), over calls mixing the
  awkward routings (a rank with no tokens, no token anywhere, an expert with none, every token
  to one expert), at 2 and 3 ranks, top-k 1, padding, the token count from a device scalar,
  rows without word pairs, many local experts (several windows) and many tokens (several
  rounds), and FP8 (E4M3) tokens;
- the route signals: after call c, ``dispatch_route_signal[c % 2, s]`` is ``(c + 1) << 32 | T_s``;
  the placed flag: ``dispatch_placed`` is ``(c + 1) << 1`` after every call of a copying runtime;
- a rank that never dispatches times dispatch_wait out naming ``dispatch_route_signal``; too many
  rows is a capacity error naming dispatch_wait; ranks that disagree are refused; the knob.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from ep_runtime.config import EPConfig
from ep_runtime.dispatch_overlap import ROUTE_FIRST_ENV
from ep_runtime.runtime import FUSED_COPY_ENV
from ep_runtime.shmem.launch import run_pes
from ep_runtime.testing import (KNOB_SCENARIOS, assert_fp8_runs_agree, assert_runs_agree, capacity_pe, fp8_knob_pe,
                                knob_disagreement_pe, knob_inputs, knob_round_trips, silent_peer_pe)
from ep_runtime.testing import knob_layout as layout_of

RUN_TIMEOUT_S = 300
CALLS = 6
FP8_SEED = 950


def base_cfg(R: int, **changes) -> EPConfig:
    return EPConfig(**{**dict(n_ranks=R, n_experts=2 * R, top_k=2, hidden=64, max_tokens_per_rank=6), **changes})


def call_inputs(cfg: EPConfig, call: int):
    return knob_inputs(cfg, call, 900)


# -- per-rank bodies ------------------------------------------------------------------------------
def cycle_pe(session, first: str, fused: str, cfg: EPConfig, device_count: bool) -> dict:
    """CALLS round trips on one runtime (layouts mixed), with ``EP_RUNTIME_DISPATCH_ROUTE_FIRST``
    = ``first`` and ``EP_RUNTIME_FUSED_COPY`` = ``fused``: each call's batch, its combine output,
    the route signals and the placed flag after it. ``device_count``: capacity-sized inputs, the
    token count a device scalar (``n_tokens``), as a captured CUDA graph passes it."""
    from ep_runtime.runtime import EPRuntime

    os.environ[ROUTE_FIRST_ENV] = first
    os.environ[FUSED_COPY_ENV] = fused
    with EPRuntime(cfg, session) as rt:
        assert rt.dispatch_route_first == (first == "1") and not rt.dispatch_land and not rt.dispatch_place
        if rt.dispatch_route_first:  # auto: the route-first runtime copies in dispatch_wait (unless chunked)
            assert rt.fused_copy == (fused != "0" and not rt.send_paths.route_chunks), (fused, rt.fused_copy)
        wait_grid = rt._fixed["dispatch_wait"].grid  # the compact launch's blocks
        chunks = rt.send_paths.route_chunks
        calls = knob_round_trips(session, rt, cfg, CALLS, call_inputs, layout_of, device_count,
                                 ("dispatch_route_signal", "dispatch_placed"))
    from ep_runtime.dispatch_overlap import ROUTE_CHUNKS_ABOVE, route_first_blocks  # the simulator's
    from ep_runtime.kernels.dispatch import CHUNK_FROM_TOKENS, FIRST_SPLIT_TOKENS, SHARE_FROM_TOKENS

    return {"calls": calls, "fused_copy": rt.fused_copy, "wait_grid": wait_grid, "share_from": SHARE_FROM_TOKENS,
            "route_chunks": chunks, "chunks_above": ROUTE_CHUNKS_ABOVE, "first_blocks": route_first_blocks(cfg),
            "chunk_from": CHUNK_FROM_TOKENS, "split_from": FIRST_SPLIT_TOKENS}


def fp8_cfg() -> EPConfig:
    return EPConfig(n_ranks=2, n_experts=4, top_k=2, hidden=256, max_tokens_per_rank=5, token_dtype="fp8_e4m3")


# -- parent side ------------------------------------------------------------------------------------
#: name: (ranks, config changes, device count, also with dispatch_copy)
CYCLE_CASES = {
    "R2": (2, {}, False, True),
    "R3-top1-pad4": (3, {"top_k": 1, "pad_multiple": 4}, False, True),
    "R2-device-count": (2, {}, True, False),
    "R2-hidden5": (2, {"hidden": 5}, False, False),  # uint16 words: no word pairs
    # 6 local experts (two windows of 4) and up to 3 x 40 tokens (several rounds), padding
    "R3-windows-rounds-pad3": (3, {"n_experts": 18, "top_k": 4, "max_tokens_per_rank": 40, "pad_multiple": 3},
                               False, True),
    # call 0 (random counts up to 41 a rank) from CHUNK_FROM_TOKENS received tokens and
    # FIRST_SPLIT_TOKENS a rank, the others below: the placing blocks rank chunks, and the token
    # blocks send the routing rows (v33); padding rows written a warp per expert over the blocks;
    # 41 x 3 ids a source: only the first source's run of group 0 is 16-byte aligned (the others
    # are counted an id to a load), and runs of T x 3 ids leave 1-3 past the last four-id load
    "R2-chunks-pad2": (2, {"n_experts": 8, "top_k": 3, "max_tokens_per_rank": 41, "pad_multiple": 2}, False, True),
}


@pytest.fixture(scope="module", params=list(CYCLE_CASES))
def cycles(request):
    R, changes, device_count, split = CYCLE_CASES[request.param]
    cfg = base_cfg(R, **changes)
    first = run_pes(cycle_pe, R, args=("1", "auto", cfg, device_count), timeout_s=RUN_TIMEOUT_S)
    waited = run_pes(cycle_pe, R, args=("0", "auto", cfg, device_count), timeout_s=RUN_TIMEOUT_S)
    copied = run_pes(cycle_pe, R, args=("1", "0", cfg, device_count), timeout_s=RUN_TIMEOUT_S) if split else None
    return cfg, first, waited, copied, request.param


def test_route_first_batches_equal_the_reference_and_dispatch_wait(cycles):
    """Every batch, compact and expanded, and every combine output as the reference's and the
    dispatch_wait path's. The compact launch places in ROUTE_FIRST_BLOCKS blocks, each
    describing a share of the rows from SHARE_FROM_TOKENS received tokens, and the first block
    all of them below it: every case's calls take both ways (a block's missing or misplaced
    share would show here)."""
    from ep_runtime.dispatch_overlap import ROUTE_FIRST_BLOCKS

    cfg, first, waited, copied, case = cycles
    sent = [[len(x) for x in call_inputs(cfg, c)[0]] for c in range(CALLS)]
    received = [sum(counts) for counts in sent]
    assert min(received) < first[0]["share_from"] <= max(received), (received, first[0]["share_from"])
    if case.startswith("R2-chunks"):  # both ways of placing, and of sending the routing (v33)
        assert min(received) < first[0]["chunk_from"] <= max(received), (received, first[0]["chunk_from"])
        ts = [t for counts in sent for t in counts]
        assert min(ts) < first[0]["split_from"] <= max(ts), (ts, first[0]["split_from"])
    assert all(res["fused_copy"] == (not res["route_chunks"]) for res in first), "fused copy: not as auto says"
    assert ROUTE_FIRST_BLOCKS > 1 and all(res["wait_grid"] == res["first_blocks"] for res in first)
    assert all(res["route_chunks"] == (cfg.max_tokens_per_rank > res["chunks_above"]) for res in first)
    if case.startswith("R2-chunks"):  # a chunked build, with its placing blocks
        assert first[0]["route_chunks"] and first[0]["first_blocks"] > ROUTE_FIRST_BLOCKS
    assert_runs_agree(cfg, first, waited, CALLS, call_inputs, layout_of, "route-first")
    if copied is not None:  # the expanded rows copied by dispatch_copy after the one-block dispatch_wait
        assert not any(res["fused_copy"] for res in copied)
        assert_runs_agree(cfg, copied, waited, CALLS, call_inputs, layout_of, "route-first, dispatch_copy")


def test_the_placed_flag_carries_every_expanded_call_of_a_copying_runtime(cycles):
    """dispatch_placed is set by the placing block of every expanded call's dispatch_wait in a
    copying runtime (a compact call's few blocks leave it), and never by another path (a
    chunked build copies with dispatch_copy)."""
    cfg, first, waited, copied, _ = cycles
    expanded = [c for c in range(CALLS) if layout_of(c) == "expanded"]
    assert expanded and len(expanded) < CALLS, "the calls do not mix the layouts"
    for call in range(CALLS):
        last = max([c for c in expanded if c <= call], default=-1)
        for r in range(cfg.n_ranks):
            placed = first[r]["calls"][call]["dispatch_placed"]  # (a chunked build copies with dispatch_copy)
            assert int(placed[0]) == ((last + 1) << 1 if first[r]["fused_copy"] else 0), (r, call, placed)
            assert int(waited[r]["calls"][call]["dispatch_placed"][0]) == 0
            if copied is not None:  # one block, compact or expanded: it publishes nothing
                assert int(copied[r]["calls"][call]["dispatch_placed"][0]) == 0


def test_every_route_signal_carries_the_call_and_its_token_count(cycles):
    cfg, first, waited, _, _ = cycles
    for call in range(CALLS):
        xs, _, _ = call_inputs(cfg, call)
        want = np.array([(call + 1) << 32 | len(x) for x in xs], np.uint64)
        for r in range(cfg.n_ranks):
            route = first[r]["calls"][call]["dispatch_route_signal"]
            np.testing.assert_array_equal(route[call % 2], want, err_msg=f"rank {r} call {call}")
            unsignalled = waited[r]["calls"][call]["dispatch_route_signal"] == 0
            assert unsignalled.all(), "the dispatch_wait path signalled routing"


def test_fp8_route_first_equals_the_reference():
    cfg = fp8_cfg()
    first, waited = (run_pes(fp8_knob_pe, 2, timeout_s=RUN_TIMEOUT_S,
                             args=(ROUTE_FIRST_ENV, v, cfg, KNOB_SCENARIOS, FP8_SEED, "dispatch_route_first"))
                     for v in ("1", "0"))
    assert_fp8_runs_agree(cfg, first, waited, KNOB_SCENARIOS, FP8_SEED)


def fp8_chunks_pe(session, *args) -> dict:
    """:func:`fp8_knob_pe`, with the simulator's thresholds (this process's, not the parent's)."""
    from ep_runtime.dispatch_overlap import route_chunks
    from ep_runtime.kernels.dispatch import CHUNK_FROM_TOKENS, FIRST_SPLIT_TOKENS

    return {**fp8_knob_pe(session, *args), "chunks": route_chunks(args[2], True), "split_from": FIRST_SPLIT_TOKENS,
            "chunk_from": CHUNK_FROM_TOKENS}


@pytest.mark.parametrize("prequantized", [False, True], ids=["quantized-here", "prequantized"])
def test_fp8_chunked_route_first_equals_the_reference(prequantized):
    """A chunked route-first build (capacity above the simulator's ROUTE_CHUNKS_ABOVE, 16) with
    FP8 tokens, calls on both sides of FIRST_SPLIT_TOKENS and CHUNK_FROM_TOKENS: quantized in
    dispatch_async, a split call's token blocks publish their routing from one thread each
    (``publish_route_share``, v34); pre-quantized, with the block's ticket. Every field and the
    scales as the dispatch_wait path's, the offsets and codes as the reference's."""
    from ep_runtime.testing import FP8_CALLS, make_inputs

    cfg = EPConfig(n_ranks=2, n_experts=4, top_k=2, hidden=256, max_tokens_per_rank=20, token_dtype="fp8_e4m3")
    first, waited = (run_pes(fp8_chunks_pe, 2, timeout_s=RUN_TIMEOUT_S,
                             args=(ROUTE_FIRST_ENV, v, cfg, KNOB_SCENARIOS, FP8_SEED, "dispatch_route_first",
                                   prequantized))
                     for v in ("1", "0"))
    assert first[0]["chunks"], "not a chunked build"
    sent = [[len(x) for x in make_inputs(cfg, KNOB_SCENARIOS[c], FP8_SEED + c)[0]] for c in range(len(FP8_CALLS))]
    ts, received = [t for counts in sent for t in counts], [sum(counts) for counts in sent]
    assert min(ts) < first[0]["split_from"] <= max(ts), (sent, first[0]["split_from"])
    assert min(received) < first[0]["chunk_from"] <= max(received), (sent, first[0]["chunk_from"])
    assert_fp8_runs_agree(cfg, first, waited, KNOB_SCENARIOS, FP8_SEED)


def test_a_silent_rank_times_dispatch_wait_out_naming_the_route_signal():
    res = run_pes(silent_peer_pe, 2, args=(ROUTE_FIRST_ENV, "1", base_cfg(2, wait_timeout_s=1.0), 43),
                  timeout_s=RUN_TIMEOUT_S)
    msg = res[0]["error"]
    assert msg is not None, "no timeout"
    assert ("rank 0: dispatch_wait of call 1" in msg
            and "dispatch_route_signal[1][1] expected >= 2, observed 0" in msg), msg


def test_too_many_rows_is_a_capacity_error_of_dispatch_wait():
    res = run_pes(capacity_pe, 2, args=(ROUTE_FIRST_ENV, "1", base_cfg(2, max_recv_rows=4), 44),
                  timeout_s=RUN_TIMEOUT_S)
    # experts 0 and 1 (every token's) live on rank 0: 2 x 12 rows for a capacity of 4; rank 1 gets none
    msg = res[0]["error"]
    assert msg is not None and "rank 0: dispatch_wait of call 0 needed 24" in msg and "capacity is 4" in msg, msg
    assert res[1]["error"] is None, res[1]


def test_ranks_that_disagree_are_refused():
    res = run_pes(knob_disagreement_pe, 2, args=(ROUTE_FIRST_ENV, ("0", "1"), base_cfg(2)),
                  timeout_s=RUN_TIMEOUT_S)
    for r in range(2):
        assert res[r]["error"] is not None and ROUTE_FIRST_ENV in res[r]["error"], res[r]


def test_knob(monkeypatch):
    """``auto`` takes the route first for runtimes of two ranks or more on the whole GPU with PDL
    (``early``), bf16 up to ROUTE_FIRST_MAX_TOKENS tokens per rank and FP8 from
    ROUTE_FIRST_FP8_MIN_TOKENS (a chunked build, v34), on the peer-store path without
    landing, placing or the copy engine; 0 never; 1 wherever the send path allows (FP8 and the
    simulator included), refused where it does not; other values refused."""
    from ep_runtime.dispatch_overlap import (ROUTE_CHUNKS_ABOVE, ROUTE_FIRST_FP8_MIN_TOKENS, ROUTE_FIRST_MAX_TOKENS,
                                             routing_first)
    from ep_runtime.errors import EPConfigError

    def cfg(**kw):
        base = dict(n_ranks=2, n_experts=8, top_k=2, hidden=256, max_tokens_per_rank=ROUTE_FIRST_MAX_TOKENS)
        return EPConfig(**{**base, **kw})

    small, big = cfg(), cfg(max_tokens_per_rank=ROUTE_FIRST_MAX_TOKENS + 1)
    for unset in (None, "", "auto", " AUTO "):
        if unset is None:
            monkeypatch.delenv(ROUTE_FIRST_ENV, raising=False)
        else:
            monkeypatch.setenv(ROUTE_FIRST_ENV, unset)
        assert routing_first(small, True, False, False, False, True) is True
        assert routing_first(small, True, False, False, False, False) is False  # no early start (PDL off, sim)
        assert routing_first(big, True, False, False, False, True) is False
        assert routing_first(small, False, False, False, False, True) is False  # puts
        assert routing_first(small, True, True, False, False, True) is False  # copy engine
        assert routing_first(small, True, False, True, False, True) is False  # landing
        assert routing_first(small, True, False, False, True, True) is False  # placing
        # FP8: from ROUTE_FIRST_FP8_MIN_TOKENS (a chunked build, v34), not below it
        assert ROUTE_FIRST_FP8_MIN_TOKENS > ROUTE_CHUNKS_ABOVE
        for fmt in ("fp8_e4m3", "fp8_e4m3_ue8m0"):
            assert routing_first(cfg(token_dtype=fmt, max_tokens_per_rank=ROUTE_FIRST_FP8_MIN_TOKENS - 1), True,
                                 False, False, False, True) is False
            fp8_big = cfg(token_dtype=fmt, max_tokens_per_rank=ROUTE_FIRST_FP8_MIN_TOKENS)
            assert routing_first(fp8_big, True, False, False, False, True) is True
            assert routing_first(fp8_big, True, False, False, False, False) is False  # no early start
            assert routing_first(cfg(token_dtype=fmt, max_tokens_per_rank=4096, n_sms=16), True, False, False, False,
                                 True) is False
            assert routing_first(cfg(token_dtype=fmt, max_tokens_per_rank=4096, n_ranks=1, n_experts=4), True,
                                 False, False, False, True) is False
        assert routing_first(cfg(n_ranks=1, n_experts=4), True, False, False, False, True) is False
        assert routing_first(cfg(n_sms=16), True, False, False, False, True) is False
    monkeypatch.setenv(ROUTE_FIRST_ENV, "0")
    assert routing_first(small, True, False, False, False, True) is False
    monkeypatch.setenv(ROUTE_FIRST_ENV, "1")
    assert routing_first(big, True, False, False, False, False) is True
    assert routing_first(cfg(token_dtype="fp8_e4m3"), True, False, False, False, False) is True
    for paths, why in (((False, False, False, False), "puts"), ((True, True, False, False), "copy"),
                       ((True, False, True, False), "landing"), ((True, False, False, True), "placing")):
        with pytest.raises(EPConfigError, match=why):
            routing_first(small, *paths, True)
    for bad in ("2", "-1", "yes"):
        monkeypatch.setenv(ROUTE_FIRST_ENV, bad)
        with pytest.raises(EPConfigError, match=ROUTE_FIRST_ENV):
            routing_first(small, True, False, False, False, True)


def test_the_expanded_copy_choice(monkeypatch):
    """``EP_RUNTIME_FUSED_COPY=auto`` copies in dispatch_wait in every bf16 route-first runtime
    (its copy is dispatch_copy's token-major one, v30), otherwise only up to
    FUSED_COPY_MAX_TOKENS per rank; never for FP8 (dispatch_copy lays the scales out); 0 never,
    1 always (bf16)."""
    from ep_runtime.runtime import FUSED_COPY_MAX_TOKENS, _fused_copy

    def cfg(**kw):
        return EPConfig(**{**dict(n_ranks=2, n_experts=8, top_k=2, hidden=256, max_tokens_per_rank=128), **kw})

    decode, big, fp8 = cfg(max_tokens_per_rank=FUSED_COPY_MAX_TOKENS), cfg(), cfg(token_dtype="fp8_e4m3")
    monkeypatch.setenv(FUSED_COPY_ENV, "auto")
    assert _fused_copy(big, True) and not _fused_copy(big, False)
    assert _fused_copy(decode, False) and _fused_copy(decode, True)
    assert not _fused_copy(fp8, True)
    monkeypatch.setenv(FUSED_COPY_ENV, "0")
    assert not _fused_copy(big, True) and not _fused_copy(decode, False)
    monkeypatch.setenv(FUSED_COPY_ENV, "1")
    assert _fused_copy(big, False) and not _fused_copy(fp8, False)


def test_chunked_builds_only_above_the_decode_sizes():
    """A route-first runtime builds the chunked placement (``SendPaths.route_chunks``: the token
    blocks send the routing rows, dispatch_wait's blocks rank chunks) only above
    ROUTE_CHUNKS_ABOVE tokens per rank, and launches ROUTE_FIRST_CHUNK_BLOCKS placing blocks
    there, ROUTE_FIRST_BLOCKS below; never without route-first. The kernels refuse chunks alone."""
    from ep_runtime.dispatch_overlap import (ROUTE_CHUNKS_ABOVE, ROUTE_FIRST_BLOCKS, ROUTE_FIRST_CHUNK_BLOCKS,
                                             ROUTE_FIRST_MAX_TOKENS, route_chunks, route_first_blocks)
    from ep_runtime.kernels.dispatch import make_dispatch_kernels

    def cfg(T):
        return EPConfig(n_ranks=2, n_experts=8, top_k=2, hidden=256, max_tokens_per_rank=T)

    small, big = cfg(ROUTE_CHUNKS_ABOVE), cfg(ROUTE_CHUNKS_ABOVE + 1)
    assert ROUTE_CHUNKS_ABOVE <= ROUTE_FIRST_MAX_TOKENS and ROUTE_FIRST_CHUNK_BLOCKS > ROUTE_FIRST_BLOCKS
    assert not route_chunks(small, True) and route_chunks(big, True) and not route_chunks(big, False)
    assert route_first_blocks(small) == ROUTE_FIRST_BLOCKS and route_first_blocks(big) == ROUTE_FIRST_CHUNK_BLOCKS
    with pytest.raises(ValueError, match="route_chunks needs route_first"):
        make_dispatch_kernels(8, route_chunks=True)
