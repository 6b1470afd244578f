"""Slot values home (``slot_values_async`` / ``slot_values_wait``) on the simulator: the real
kernels, one process per rank, against values that encode where each row came from.

Each expert row's value is computed from what arrived (the row's own token data: its source rank
and token in the first columns) and from where it was placed (the global expert of its segment):
``src_rank * 1e6 + src_token * 1e3 + expert``. The value home at ``[t, k]`` must then be
``rank * 1e6 + t * 1e3 + routed_id[t, k]``, or 0.0 for a masked slot and a repeated id's later
slot; a row that went to the wrong token, slot or rank shows as a wrong number. The calls cover
the awkward routings (masked slots, a rank with no tokens, no token anywhere, every token to one
expert), a planted repeated id, both layouts, a token count on the device (inputs padded to
capacity, as a captured CUDA graph passes them: the slots past the count come home as 0), and the
same batch's combine after the slot values (the runtime stays dispatched), exact against the
reference; both transports. Then what the host refuses (a second
slot return for one dispatch, a combine before slot_values_wait, wrong dtypes and shapes) and the
device errors: values shorter than the batch, named on its rank, and the peers' waits timing out
naming that rank's slot signal.
"""

from __future__ import annotations

import numpy as np
import pytest

from ep_runtime.core import reference
from ep_runtime.core.config import EPConfig
from ep_runtime.core.errors import EPInputError, EPStateError, EPTimeoutError
from ep_runtime.core.layout import BufferLayout
from ep_runtime.shmem.launch import run_pes
from ep_runtime.testing import call_inputs, call_layout, expert_outputs, padded_to_capacity

SEED = 4100
CALLS = 6  # random, zero_rank, masked, one_expert (no token anywhere at call 3), random, zero_rank
#: its tokens padded to capacity, their count a device scalar; the routing rows and slot values past
#: the count are an earlier call's of the same buffer group (call 1), which must not come home
DEVICE_COUNT_CALL = 5


def cfg_of(R: int, **changes) -> EPConfig:
    return EPConfig(**{**dict(n_ranks=R, n_experts=2 * R, top_k=3, hidden=16, max_tokens_per_rank=6,
                              pad_multiple=2, wait_timeout_s=60.0), **changes})


def planted_inputs(cfg: EPConfig, call: int):
    """:func:`call_inputs` with token 0's slot 1 repeating its slot 0 on every rank with tokens
    (the repeat counts once: its slot makes no row)."""
    xs, ids, ws = call_inputs(cfg, call, SEED)
    for i in ids:
        if len(i):
            i[0, 1] = i[0, 0]
    return xs, ids, ws


def row_values(session, cfg: EPConfig, batch, layout: str) -> np.ndarray:
    """float32 [capacity] (host): each real row's value from its token data and its segment's
    expert; NaN on padding rows and past the batch's end (they must not be read)."""
    me, L = session.rank, cfg.n_experts // cfg.n_ranks
    offsets = session.to_host(batch.row_offsets)
    rows = int(offsets[L])
    src_k = session.to_host(batch.src_k)[:rows]
    at = session.to_host(batch.gather)[:rows] if layout == "compact" else np.arange(rows)
    head = reference.as_bf16(session.to_host(batch.x)[at][:, :3]).astype(np.float32)  # rank, t // 128, t % 128
    expert = me * L + np.searchsorted(offsets, np.arange(rows), side="right") - 1
    values = np.full(cfg.recv_rows_capacity, np.nan, np.float32)
    values[:rows] = np.where(src_k >= 0, head[:, 0] * 1e6 + (head[:, 1] * 128 + head[:, 2]) * 1e3 + expert, np.nan)
    return values


def expected_home(cfg: EPConfig, rank: int, ids: np.ndarray) -> np.ndarray:
    routed = reference.routed_ids(ids, cfg.n_experts)
    t = np.arange(len(ids), dtype=np.float32)[:, None]
    return np.where(routed >= 0, rank * 1e6 + t * 1e3 + routed, 0.0).astype(np.float32)


def expected_home_of_call(cfg: EPConfig, rank: int, call: int) -> np.ndarray:
    """:func:`expected_home` of call ``call``'s routing on ``rank``, with zero rows up to capacity on
    the device-count call (its slots past the count)."""
    want = expected_home(cfg, rank, planted_inputs(cfg, call)[1][rank])
    if call == DEVICE_COUNT_CALL:
        want = np.vstack([want, np.zeros((cfg.max_tokens_per_rank - len(want), cfg.top_k), np.float32)])
    return want


def slot_pe(session, cfg: EPConfig, plan=None, nodes: int = 1) -> list:
    """:data:`CALLS` calls of slot values and a combine of the same batch, as ``nodes`` logical
    nodes (1: one node)."""
    from ep_runtime.core.runtime import EPRuntime

    if nodes > 1:
        session.use_logical_nodes(nodes)
    r, out = session.rank, []
    with EPRuntime(cfg, session, debug=False, plan=plan) as rt:  # (debug mode refuses the planted repeat)
        for call in range(CALLS):
            xs, ids, ws = planted_inputs(cfg, call)
            layout = call_layout(cfg, call)
            x, i, w, n_tokens = xs[r].view(np.uint16), ids[r], ws[r], None
            if call == DEVICE_COUNT_CALL:  # padded to capacity, the count on the device (a graph's call)
                x, i, w, n_tokens = padded_to_capacity(session, cfg, x, i, w)
            x, i, w = (session.to_device(a) for a in (x, i, w))
            batch = rt.dispatch_wait(rt.dispatch_async(x, i, w, n_tokens=n_tokens), layout=layout)
            values = session.to_device(row_values(session, cfg, batch, layout))
            refs = reference.dispatch(xs, ids, ws, cfg)
            y = session.to_device(expert_outputs(cfg, refs[r], r))
            refused = []
            if call == 0:  # refused before any launch: the dtype, the shape, a combine before the wait
                for bad in (values.astype(np.float64), values.reshape(-1, 1)):
                    try:
                        rt.slot_values_async(bad, batch.handle)
                    except EPInputError as e:
                        refused.append(str(e))
                h = rt.slot_values_async(values, batch.handle)
                try:
                    rt.combine_async(y, batch.handle, layout="expanded")
                except EPStateError as e:
                    refused.append(str(e))
                home = session.to_host(rt.slot_values_wait(h)).copy()
                rt.synchronize()
                try:
                    rt.slot_values_async(values, batch.handle)
                except EPStateError as e:
                    refused.append(str(e))
            else:
                home = session.to_host(rt.slot_values(values, batch.handle)).copy()
            combined = session.to_host(rt.combine(y, batch.handle)).copy()[:len(xs[r])]
            out.append({"home": home, "combined": combined, "layout": layout, "refused": refused})
    return out


@pytest.fixture(scope="module", params=["stores", "puts"])
def runs(request):
    """Both transports: stores through the peers' mappings, NVSHMEM puts."""
    cfg = cfg_of(3)
    return cfg, run_pes(slot_pe, 3, args=(cfg, {"transport": request.param}), timeout_s=300)


def test_every_slot_value_reaches_its_token_and_slot(runs):
    cfg, res = runs
    assert {c["layout"] for c in res[0]} == {"expanded", "compact"}
    for call in range(CALLS):
        xs, ids, ws = planted_inputs(cfg, call)
        for r in range(cfg.n_ranks):
            got, want = res[r][call]["home"], expected_home_of_call(cfg, r, call)
            assert got.shape == want.shape and got.dtype == np.float32
            np.testing.assert_array_equal(got, want, err_msg=f"call {call} rank {r}")
    masked = [ids for call in range(CALLS) for ids in planted_inputs(cfg, call)[1] if len(ids)]
    assert any((i < 0).any() for i in masked), "no masked slot was exercised"


def test_the_same_batch_combines_exactly_after_its_slot_values(runs):
    cfg, res = runs
    for call in range(CALLS):
        xs, ids, ws = planted_inputs(cfg, call)
        refs = reference.dispatch(xs, ids, ws, cfg)
        ys = [expert_outputs(cfg, refs[r], r) for r in range(cfg.n_ranks)]
        want = reference.combine(ys, refs, ids, cfg)
        for r in range(cfg.n_ranks):
            np.testing.assert_array_equal(res[r][call]["combined"], want[r].view(np.uint16),
                                          err_msg=f"call {call} rank {r}")


def test_the_host_refuses_bad_values_and_a_second_return(runs):
    _, res = runs
    for rank_calls in res:
        dtype, shape, early, twice = rank_calls[0]["refused"]
        assert "values must have dtype float32" in dtype
        assert "values must have shape [*]" in shape
        assert "combine_async called out of order" in early and "expects slot_values_wait next" in early
        assert "already went home" in twice and "at most once per dispatch" in twice


def short_values_pe(session, cfg: EPConfig) -> dict:
    from ep_runtime.core.runtime import EPRuntime

    r = session.rank
    with EPRuntime(cfg, session, debug=False) as rt:
        xs, ids, ws = call_inputs(cfg, 0, SEED)
        x, i, w = (session.to_device(a) for a in (xs[r].view(np.uint16), ids[r], ws[r]))
        batch = rt.dispatch_wait(rt.dispatch_async(x, i, w))
        rows = int(session.to_host(batch.row_offsets)[-1])
        values = session.to_device(np.zeros(max(rows - 1, 0) if r == 0 else cfg.recv_rows_capacity, np.float32))
        try:
            rt.slot_values(values, batch.handle)
        except (EPInputError, EPTimeoutError) as e:
            error = f"{type(e).__name__}: {e}"
        else:
            error = None
        session.barrier()
        return {"rows": rows, "error": error}


def test_short_values_are_refused_on_the_device_and_the_peers_time_out_naming_the_rank():
    cfg = cfg_of(2, wait_timeout_s=1.0, max_tokens_per_rank=4)
    res = run_pes(short_values_pe, 2, args=(cfg,), timeout_s=300)
    assert res[0]["rows"] > 0, "rank 0 received no rows: the test needs some"
    assert res[0]["error"].startswith("EPInputError: rank 0: slot_values_async of call 0: values has "
                                      f"{res[0]['rows'] - 1} rows but the expert batch has {res[0]['rows']}")
    assert res[1]["error"].startswith("EPTimeoutError: rank 1: slot_values_wait of call 0 timed out"), res[1]
    assert "waiting for rank 0: slot_signal[0][0] expected >= 1, observed 0" in res[1]["error"], res[1]


@pytest.mark.wide
@pytest.mark.parametrize("plan, nodes", [({}, 1), ({}, 9)], ids=["72-stores", "9x8-nodes"])
def test_slot_values_past_64_ranks_reach_their_slots(plan, nodes):
    """72 ranks with the plan's destination lists, on one node (stores) and as 9 x 8 logical nodes
    (the hierarchical transport: slots held on other nodes come through ``slot_across``): every
    slot value home exactly and the same batch combined exactly after it (a minute or so each on 2
    cores)."""
    cfg = cfg_of(72, hidden=8, max_tokens_per_rank=2, wait_timeout_s=600.0)
    res = run_pes(slot_pe, 72, args=(cfg, plan, nodes), timeout_s=900, heap_bytes=BufferLayout(cfg).symmetric_bytes)
    for call in range(CALLS):
        xs, ids, ws = planted_inputs(cfg, call)
        refs = reference.dispatch(xs, ids, ws, cfg)
        ys = [expert_outputs(cfg, refs[r], r) for r in range(cfg.n_ranks)]
        want = reference.combine(ys, refs, ids, cfg, node_size=8 if nodes > 1 else 0)
        for r in range(cfg.n_ranks):
            np.testing.assert_array_equal(res[r][call]["home"], expected_home_of_call(cfg, r, call),
                                          err_msg=f"{nodes} node(s): call {call} rank {r}")
            np.testing.assert_array_equal(res[r][call]["combined"], want[r].view(np.uint16),
                                          err_msg=f"{nodes} node(s): call {call} rank {r}: combine")

