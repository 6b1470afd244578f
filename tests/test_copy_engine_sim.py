"""The copy-engine token transfer (:mod:`ep_runtime.transfer`) on the simulator: the real
kernels (dispatch_async storing rows to this rank only and trading credits, dispatch_signal,
dispatch_wait, dispatch_copy) with the session's copy stream, one process per rank.

- A sequence of calls on one runtime, layouts alternating, awkward routings (a rank with no
  tokens, an expert with none, every token to one expert, top-k = 1) and token counts from a
  device scalar: dispatch exact against the reference, combine bit for bit (the simulator
  has no FMA contraction).
- The copy engine really carried the rows: a peer's slot holds the sender's whole batch,
  rows of tokens with no expert there included (the warps' stores never write those).
- Credits: each peer's ``dispatch_token_credit`` counts its calls (plus the next one, granted
  by the last combine); the copy flag is reset.
- A rank that skips a dispatch: the other's dispatch_async times out naming dispatch_async,
  the rank and ``dispatch_token_credit``.
- The policy (``EP_RUNTIME_TOKEN_TRANSFER``), without a simulator.
"""

from __future__ import annotations

import numpy as np
import pytest

from ep_runtime import reference
from ep_runtime.config import EPConfig
from ep_runtime.errors import EPConfigError
from ep_runtime.shmem.launch import run_pes
from ep_runtime.testing import expert_outputs, make_inputs
from ep_runtime.transfer import TOKEN_TRANSFER_ENV, choose_copy_engine

RUN_TIMEOUT_S = 240
CALLS = 8
SCENARIOS = ("random", "zero_rank", "empty_expert", "one_expert")
FIELDS = ("row_offsets", "expert_counts", "src_rank", "src_token", "src_k", "weight")
TIMEOUT_S = 1.0


def base_cfg(R: int, **changes) -> dict:
    return {**dict(n_ranks=R, n_experts=2 * R, top_k=2, hidden=16, max_tokens_per_rank=6), **changes}


def call_inputs(cfg: EPConfig, call: int):
    """Call ``call``'s inputs of every rank: scenario, seed and token counts change per call."""
    return make_inputs(cfg, SCENARIOS[call % len(SCENARIOS)], 300 + call)


def padded(cfg: EPConfig, x, ids, ws):
    """Capacity-sized copies of one rank's inputs (rows past the batch: poison tokens, valid
    distinct ids) and the valid count, for the device-scalar path."""
    T, n = cfg.max_tokens_per_rank, len(x)
    xp = np.full((T, cfg.hidden), 0x7FC1, np.uint16)
    xp[:n] = x.view(np.uint16)
    ip = np.tile(np.arange(cfg.top_k, dtype=np.int32), (T, 1))
    ip[:n] = ids
    wp = np.zeros((T, cfg.top_k), np.float32)
    wp[:n] = ws
    return xp, ip, wp, np.array([n], np.int32)


def transfer_pe(session, R: int, top_k: int) -> dict:
    from ep_runtime.runtime import EPRuntime

    r = session.rank
    cfg = EPConfig(**base_cfg(R, top_k=top_k))
    calls = []
    with EPRuntime(cfg, session) as rt:
        for call in range(CALLS):
            xs, ids, ws = call_inputs(cfg, call)
            layout = ("compact", "expanded")[call % 2]
            if call % 3 == 2:  # the valid count from a device scalar, inputs at capacity
                x, i, w, n = padded(cfg, xs[r], ids[r], ws[r])
                handle = rt.dispatch_async(x, i, w, n_tokens=session.to_device(n))
            else:
                handle = rt.dispatch_async(xs[r].view(np.uint16), ids[r], ws[r])
            batch = rt.dispatch_wait(handle, layout=layout)
            got = {k: session.to_host(getattr(batch, k)) for k in FIELDS}
            got["x"] = session.to_host(batch.x)
            y = expert_outputs(cfg, reference.dispatch(xs, ids, ws, cfg)[r], r)
            got["out"] = session.to_host(rt.combine(y, batch.handle))
            got["layout"] = layout
            calls.append(got)
        state = {"copy_engine": rt.copy_engine,
                 "credit": session.to_host(rt.buffers["dispatch_token_credit"]).tolist(),
                 "go": int(session.to_host(rt.buffers["dispatch_copy_go"])[0])}
    return {"calls": calls, **state}


def skip_pe(session, R: int) -> dict:
    """Rank 1 skips the dispatch; the others' dispatch_async must time out on its credit."""
    from ep_runtime.runtime import EPRuntime

    cfg = EPConfig(**base_cfg(R, wait_timeout_s=TIMEOUT_S))
    error = None
    with EPRuntime(cfg, session) as rt:
        if session.rank != 1:
            xs, ids, ws = call_inputs(cfg, 0)
            try:
                rt.dispatch_async(xs[session.rank].view(np.uint16), ids[session.rank], ws[session.rank])
            except Exception as exc:  # noqa: BLE001 - the test inspects it
                error = f"{type(exc).__name__}: {exc}"
        session.barrier()
        rt.reset()
    return {"error": error}


@pytest.fixture(scope="module", params=[(2, 2), (3, 2), (2, 1)], ids=["R2", "R3", "R2_top1"])
def sim(request, tmp_path_factory):
    R, top_k = request.param
    mp = pytest.MonkeyPatch()
    mp.setenv(TOKEN_TRANSFER_ENV, "copy_engine")  # the PEs inherit it
    try:
        yield R, top_k, run_pes(transfer_pe, R, args=(R, top_k), timeout_s=RUN_TIMEOUT_S)
    finally:
        mp.undo()


def test_dispatch_exact_and_combine_bit_identical_on_the_simulator(sim):
    R, top_k, per_rank = sim
    cfg = EPConfig(**base_cfg(R, top_k=top_k))
    for r, res in enumerate(per_rank):
        assert res["copy_engine"], f"rank {r}: the runtime did not take the copy engine"
        for call, got in enumerate(res["calls"]):
            xs, ids, ws = call_inputs(cfg, call)
            ref = reference.dispatch(xs, ids, ws, cfg)[r]
            what = f"rank {r} call {call} ({got['layout']})"
            n = ref.n_rows
            assert got["row_offsets"][-1] == n, what
            np.testing.assert_array_equal(got["src_rank"][:n], ref.src_rank, what)
            np.testing.assert_array_equal(got["src_token"][:n], ref.src_token, what)
            np.testing.assert_array_equal(got["src_k"][:n], ref.src_k, what)
            np.testing.assert_array_equal(got["weight"][:n], ref.weight, what)
            if got["layout"] == "expanded":
                np.testing.assert_array_equal(got["x"][:n], ref.x.view(np.uint16), what)
            else:
                x_ref, defined = reference.receive_rows(xs, ids, cfg)[r]
                np.testing.assert_array_equal(got["x"][defined], x_ref.view(np.uint16)[defined], what)
            refs = reference.dispatch(xs, ids, ws, cfg)
            want = reference.combine([expert_outputs(cfg, refs[s], s) for s in range(R)], refs, ids, cfg)[r]
            # bit for bit on the simulator (no FMA contraction; on a GPU: combine_tolerance)
            np.testing.assert_array_equal(got["out"][:len(xs[r])], want.view(np.uint16), what)


def test_the_copy_engine_carried_every_row_of_each_peer(sim):
    """A compact batch's x is the receive buffer: with the copy engine, the slot of each peer s
    holds all of s's rows t < T_s, including tokens with no expert here (the warps' stores would
    leave those rows untouched); at least one such row exists in these inputs."""
    R, top_k, per_rank = sim
    cfg = EPConfig(**base_cfg(R, top_k=top_k))
    T, L = cfg.max_tokens_per_rank, cfg.n_local_experts
    unrouted = 0
    for r, res in enumerate(per_rank):
        for call, got in enumerate(res["calls"]):
            if got["layout"] != "compact":
                continue
            xs, ids, _ = call_inputs(cfg, call)
            for s in range(R):
                if s == r:
                    continue
                rows = got["x"][s * T:s * T + len(xs[s])]
                np.testing.assert_array_equal(rows, xs[s].view(np.uint16), f"rank {r} call {call} source {s}")
                unrouted += int(((np.asarray(ids[s]) // L) != r).all(axis=1).sum())
    assert unrouted > 0, "no token without an expert on its peer: the check proves nothing"


def test_credits_count_the_calls_and_the_copy_flag_is_reset(sim):
    """Every call ended with a combine, whose combine_async granted the next call: CALLS + 1."""
    R, _, per_rank = sim
    for r, res in enumerate(per_rank):
        assert res["credit"] == [0 if d == r else CALLS + 1 for d in range(R)], f"rank {r}: {res['credit']}"
        assert res["go"] == 0, f"rank {r}: copy flag left at {res['go']}"


def test_a_skipped_dispatch_times_out_on_the_credit_naming_the_rank():
    mp = pytest.MonkeyPatch()
    mp.setenv(TOKEN_TRANSFER_ENV, "copy_engine")
    try:
        per_rank = run_pes(skip_pe, 2, args=(2,), timeout_s=RUN_TIMEOUT_S)
    finally:
        mp.undo()
    assert per_rank[1]["error"] is None
    err = per_rank[0]["error"]
    assert err is not None and err.startswith("EPTimeoutError"), err
    for frag in ("rank 0: dispatch_async of call 0", "waiting for rank 1", "dispatch_token_credit[1]"):
        assert frag in err, f"{frag!r} not in {err!r}"


# -- the policy -----------------------------------------------------------------------------------
BIG = dict(n_ranks=2, n_experts=256, top_k=8, hidden=7168, max_tokens_per_rank=4096)


def test_auto_and_stores_keep_the_stores_and_copy_engine_takes_it(monkeypatch):
    monkeypatch.delenv(TOKEN_TRANSFER_ENV, raising=False)
    assert not choose_copy_engine(EPConfig(**BIG), peer_mapped=True)  # measured slower today (v15)
    monkeypatch.setenv(TOKEN_TRANSFER_ENV, "stores")
    assert not choose_copy_engine(EPConfig(**BIG), peer_mapped=True)
    monkeypatch.setenv(TOKEN_TRANSFER_ENV, "copy_engine")
    assert choose_copy_engine(EPConfig(**BIG), peer_mapped=True)
    assert choose_copy_engine(EPConfig(**{**BIG, "n_ranks": 8}), peer_mapped=True)
    assert not choose_copy_engine(EPConfig(**{**BIG, "n_ranks": 1, "n_experts": 256}), peer_mapped=True)


def test_copy_engine_where_it_cannot_work_is_refused_with_the_reason(monkeypatch):
    monkeypatch.setenv(TOKEN_TRANSFER_ENV, "copy_engine")
    with pytest.raises(EPConfigError, match="encoded inside dispatch_async"):
        choose_copy_engine(EPConfig(**{**BIG, "token_dtype": "fp8_e4m3"}), peer_mapped=True)
    with pytest.raises(EPConfigError, match="not mapped"):
        choose_copy_engine(EPConfig(**BIG), peer_mapped=False)
    monkeypatch.setenv(TOKEN_TRANSFER_ENV, "dma")
    with pytest.raises(EPConfigError, match="expected auto, stores or copy_engine"):
        choose_copy_engine(EPConfig(**BIG), peer_mapped=True)
