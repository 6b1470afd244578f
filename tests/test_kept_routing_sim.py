"""Kept routing (``keep_routing`` / ``dispatch_async(tokens, routing=kept)``) on the simulator: the
real kernels, one process per rank, exact against the NumPy reference.

A backward dispatches its gradients with its forward's routing. Each run keeps the routing of call
0 (masked slots, a repeated id, a rank with no tokens), dispatches another routing at call 1 (other
layers share the runtime; its slot values fill call 3's buffer group), then dispatches new tokens
with the kept routing at calls 2 and 3 (call 0's buffer group, then the other one), and a fresh
routing at call 4. Every batch (either layout), every combine and the slot values after a reusing
dispatch must be the reference's for
those tokens with that routing, bit for bit, on every receiver and transport (the hierarchical
one as 2 x 2 logical nodes, storing and putting within a node), with the token count
given on the host and on the device (inputs padded to capacity, as a captured CUDA graph passes
them). Then the protocol's promise: a reusing dispatch_async writes no routing region on any rank
(no routing is sent), and what the host refuses (routing arguments beside a kept routing, a kept
routing of another runtime or from before a ``reset()``, a wrong token count, no routing at all).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from test_plans_sim import VARIANTS as PLAN_VARIANTS

from ep_runtime.core import reference
from ep_runtime.core.config import EPConfig
from ep_runtime.core.errors import EPInputError, EPStateError
from ep_runtime.core.layout import BufferLayout
from ep_runtime.shmem.launch import run_pes
from ep_runtime.testing import (BATCH_FIELDS, POISON_BF16, assert_batch_is_the_reference, call_inputs, expert_outputs,
                                make_inputs, make_tokens, padded_to_capacity)

RUN_TIMEOUT_S = 300
SEED = 5200
#: name -> plan overrides: every receiver on every transport it runs on (the plan suite's, its
#: route-first thresholds lowered so some calls here split, share and chunk), and the
#: hierarchical transport (2 logical nodes: :data:`NODES`), storing or putting within a node
VARIANTS = {**{k: v for k, v in PLAN_VARIANTS.items() if k != "route_first-copy"},
            "hierarchical": {}, "hierarchical-puts": {"node_stores": False}}
#: variant -> logical nodes of its session (1: none)
NODES = {"hierarchical": 2, "hierarchical-puts": 2}
#: (call, layout) of the dispatches that reuse call 0's routing: call 0's buffer group, then the other
REUSES = ((2, "compact"), (3, "expanded"))


def cfg_of(R: int, **changes) -> EPConfig:
    return EPConfig(**{**dict(n_ranks=R, n_experts=2 * R, top_k=3, hidden=32, max_tokens_per_rank=6,
                              pad_multiple=2, wait_timeout_s=60.0), **changes})


def kept_inputs(cfg: EPConfig):
    """Call 0's inputs: the masked routing (fully masked tokens, a rank masking every token) with
    rank 0 sending none, and token 0's slot 1 repeating its slot 0 on the ranks with tokens."""
    xs, ids, ws = make_inputs(cfg, "masked", SEED, n_tokens=[0] + [cfg.max_tokens_per_rank] * (cfg.n_ranks - 1))
    for i in ids[1:-1]:
        i[0, 0] = 0
        i[0, 1] = 0
    return xs, ids, ws


def reused_tokens(cfg: EPConfig, call: int, xs) -> list:
    """New tokens for a reusing call: as many as call 0's per rank, encoding (rank, token)."""
    rng = np.random.default_rng(SEED + call)
    return [make_tokens(s, len(x), cfg.hidden, rng) for s, x in enumerate(xs)]


def slot_row_values(session, cfg: EPConfig, batch) -> np.ndarray:
    """float32 [capacity]: each row's value ``src_rank * 1e4 + src_token * 1e2 + src_k`` (NaN on
    padding rows and past the batch)."""
    src = [session.to_host(getattr(batch, k)).astype(np.float32) for k in ("src_rank", "src_token", "src_k")]
    v = src[0] * 1e4 + src[1] * 1e2 + src[2]
    v[src[2] < 0] = np.nan
    return v.astype(np.float32)


def to_host(session, batch, layout: str) -> dict:
    got = {k: session.to_host(getattr(batch, k)).copy() for k in BATCH_FIELDS}
    if layout == "compact":
        got["gather"] = session.to_host(batch.gather).copy()
        got["recv_tokens"] = session.to_host(batch.recv_tokens).copy()
    return got


def kept_pe(session, plan: dict, cfg: EPConfig, device_count: bool, nodes: int = 1) -> dict:
    """Calls 0-4 (module docstring) on a session of ``nodes`` logical nodes: per call the batch's
    fields and the combine output; the slot values of call 3."""
    from ep_runtime.core.runtime import EPRuntime

    if nodes > 1:
        session.use_logical_nodes(nodes)
    r, dev = session.rank, session.to_device
    res = {}
    with EPRuntime(cfg, session, plan=plan, debug=False) as rt:
        xs, ids, ws = kept_inputs(cfg)
        x, i, w, n = xs[r].view(np.uint16), ids[r], ws[r], None
        if device_count:
            x, i, w, n = padded_to_capacity(session, cfg, x, i, w)
        batch = rt.dispatch_wait(rt.dispatch_async(dev(x), dev(i), dev(w), n_tokens=n), layout="expanded")
        res[0] = to_host(session, batch, "expanded")
        kept = rt.keep_routing(batch.handle)
        refs = reference.dispatch(xs, ids, ws, cfg)
        res[0]["out"] = session.to_host(rt.combine(dev(expert_outputs(cfg, refs[r], r)), batch.handle)).copy()
        xs1, ids1, ws1 = call_inputs(cfg, 0, SEED + 1)
        batch = rt.dispatch_wait(rt.dispatch_async(dev(xs1[r].view(np.uint16)), dev(ids1[r]), dev(ws1[r])))
        # slot values in call 3's buffer group: a slot call 3 must not return (a repeat) holds one
        res[1] = {"slots": session.to_host(rt.slot_values(dev(slot_row_values(session, cfg, batch)),
                                                          batch.handle)).copy()}
        rt.combine(dev(expert_outputs(cfg, reference.dispatch(xs1, ids1, ws1, cfg)[r], r)), batch.handle)
        for call, layout in REUSES:
            ys = reused_tokens(cfg, call, xs)
            y = ys[r].view(np.uint16)
            if device_count:  # as many rows as call 0 passed: its capacity (the count is the kept one)
                y = np.vstack([y, np.full((cfg.max_tokens_per_rank - len(y), cfg.hidden), POISON_BF16, np.uint16)])
            batch = rt.dispatch_wait(rt.dispatch_async(dev(y), routing=kept), layout=layout)
            res[call] = to_host(session, batch, layout)
            if call == 3:
                res[call]["slots"] = session.to_host(rt.slot_values(dev(slot_row_values(session, cfg, batch)),
                                                                    batch.handle)).copy()
            y_out = expert_outputs(cfg, reference.dispatch(ys, ids, ws, cfg)[r], r)
            res[call]["out"] = session.to_host(rt.combine(dev(y_out), batch.handle)).copy()
        xs4, ids4, ws4 = call_inputs(cfg, 2, SEED + 4)
        batch = rt.dispatch_wait(rt.dispatch_async(dev(xs4[r].view(np.uint16)), dev(ids4[r]), dev(ws4[r])))
        res[4] = to_host(session, batch, "expanded")
        rt.synchronize()
    return res


RUNS = [(v, 2, False) for v in VARIANTS if v not in NODES] + [
    ("wait", 3, False), ("route_first", 3, False), ("land", 2, True), ("route_first", 2, True),
    ("hierarchical", 4, True), ("hierarchical-puts", 4, False)]


@pytest.fixture(scope="module", params=RUNS, ids=[f"{v}-R{R}" + ("-device-count" if d else "") for v, R, d in RUNS])
def run(request):
    variant, R, device_count = request.param
    cfg = cfg_of(R)
    return variant, cfg, run_pes(kept_pe, R, args=(VARIANTS[variant], cfg, device_count, NODES.get(variant, 1)),
                                 timeout_s=RUN_TIMEOUT_S)


def test_a_kept_routing_dispatches_new_tokens_as_its_own_dispatch_did(run):
    variant, cfg, per_rank = run
    xs, ids, ws = kept_inputs(cfg)
    R = cfg.n_ranks
    node_size = R // NODES[variant] if variant in NODES else 0  # (the hierarchical order of the sum)
    for call, layout in ((0, "expanded"),) + REUSES:
        toks = xs if call == 0 else reused_tokens(cfg, call, xs)
        refs = reference.dispatch(toks, ids, ws, cfg)
        outs = reference.combine([expert_outputs(cfg, refs[s], s) for s in range(R)], refs, ids, cfg,
                                 node_size=node_size)
        for r in range(R):
            got, at = per_rank[r][call], f"{variant}: rank {r} call {call} ({layout})"
            assert_batch_is_the_reference(got, refs[r], layout, toks, cfg, at)
            np.testing.assert_array_equal(got["out"][:len(toks[r])], outs[r].view(np.uint16), err_msg=f"{at}: out")
    # the batch of a reusing call is placed as the kept call's was (rows, offsets, weights)
    for r in range(R):
        n = int(per_rank[r][0]["row_offsets"][-1])
        for k in ("row_offsets", "src_rank", "src_token", "src_k", "weight"):
            np.testing.assert_array_equal(per_rank[r][3][k][:n], per_rank[r][0][k][:n], err_msg=f"rank {r}: {k}")


@pytest.mark.wide
@pytest.mark.parametrize("variant, nodes", [("wait", 1), ("hierarchical", 9)], ids=["72-wait", "9x8-hierarchical"])
def test_a_kept_routing_past_64_ranks_is_exact(variant, nodes, monkeypatch):
    """72 ranks with the plan's destination lists, on one node and as 9 x 8 logical nodes: the
    kept routing's dispatches, their slot values and the dispatch after them as at 2 to 4 ranks
    (the checks above; about a minute each on 2 cores)."""
    if nodes > 1:
        monkeypatch.setitem(NODES, variant, nodes)  # the checks' node size (the hierarchical sum order)
    cfg = cfg_of(72, hidden=8, max_tokens_per_rank=2, wait_timeout_s=600.0)
    run = (variant, cfg, run_pes(kept_pe, 72, args=(VARIANTS[variant], cfg, False, nodes), timeout_s=900,
                                 heap_bytes=BufferLayout(cfg).symmetric_bytes))
    test_a_kept_routing_dispatches_new_tokens_as_its_own_dispatch_did(run)
    test_slot_values_after_a_reusing_dispatch_come_home(run)
    test_the_dispatch_after_the_reusing_ones_is_exact(run)


def expected_slots(cfg: EPConfig, xs, ids, r: int) -> np.ndarray:
    """Rank r's slot values home: ``r * 1e4 + t * 1e2 + k`` where slot k of token t made a row."""
    routed = reference.routed_ids(ids[r], cfg.n_experts)
    t = np.arange(len(xs[r]), dtype=np.float32)[:, None]
    k = np.arange(cfg.top_k, dtype=np.float32)[None, :]
    return np.where(routed >= 0, r * 1e4 + t * 1e2 + k, 0.0).astype(np.float32)


def test_slot_values_after_a_reusing_dispatch_come_home(run):
    """Call 3's routing repeats an expert of another rank in token 0 (ranks 1 .. R - 2): the
    home rank's receiver does not see it, and slot 1 of token 0 held call 1's value in that
    buffer group: it must come home as 0.0."""
    variant, cfg, per_rank = run
    xs1, ids1, _ = call_inputs(cfg, 0, SEED + 1)
    xs, ids, _ = kept_inputs(cfg)
    for r in range(cfg.n_ranks):
        np.testing.assert_array_equal(per_rank[r][1]["slots"][:len(xs1[r])], expected_slots(cfg, xs1, ids1, r),
                                      err_msg=f"{variant}: rank {r} call 1")
        np.testing.assert_array_equal(per_rank[r][3]["slots"][:len(xs[r])], expected_slots(cfg, xs, ids, r),
                                      err_msg=f"{variant}: rank {r} call 3")


def test_the_dispatch_after_the_reusing_ones_is_exact(run):
    variant, cfg, per_rank = run
    xs, ids, ws = call_inputs(cfg, 2, SEED + 4)
    refs = reference.dispatch(xs, ids, ws, cfg)
    for r in range(cfg.n_ranks):
        assert_batch_is_the_reference(per_rank[r][4], refs[r], "expanded", xs, cfg, f"{variant}: rank {r} call 4")


# -- no routing on the wire; what the host refuses ------------------------------------------------
ROUTING_REGIONS = ("dispatch_topk_ids", "dispatch_topk_weights", "dispatch_counts", "dispatch_ranks")


def unsent_pe(session, plan: dict, cfg: EPConfig) -> dict:
    """Call 0 dispatched, kept and combined; then every rank poisons call 1's buffer group of
    every routing region and dispatch_async runs with the kept routing but without its restore
    (replaced by a second copy aside): whatever the senders wrote into the routing regions would
    show. Returns, per region, whether call 1's group is still the poison on this rank."""
    from ep_runtime.core.runtime import EPRuntime

    r, dev = session.rank, session.to_device
    with EPRuntime(cfg, session, plan=plan, debug=False) as rt:
        xs, ids, ws = call_inputs(cfg, 0, SEED)
        batch = rt.dispatch_wait(rt.dispatch_async(dev(xs[r].view(np.uint16)), dev(ids[r]), dev(ws[r])))
        kept = rt.keep_routing(batch.handle)
        rt.combine(dev(expert_outputs(cfg, reference.dispatch(xs, ids, ws, cfg)[r], r)), batch.handle)
        other = {f"kept_{k}": session.alloc_local(k, getattr(kept, k).shape, getattr(kept, k).dtype)
                 for k in ("ids", "weights", "counts", "ranks")}
        no_restore = dataclasses.replace(kept, restore=rt._prepare("routing_copy", restore=np.int64(0), **other))
        names = [n for n in ROUTING_REGIONS if rt.layout.has(n)]
        for n in names:
            session.fill(rt.buffers[n][1], 7)
        session.synchronize()
        session.barrier()
        rt.dispatch_async(dev(xs[r].view(np.uint16)), routing=no_restore)
        rt.session.synchronize()
        session.barrier()
        poisoned = {n: bool((session.to_host(rt.buffers[n][1]) == 7).all()) for n in names}
        signal = int(session.to_host(rt.buffers["dispatch_signal"])[1].min()) >> 32
        session.barrier()
        rt.reset()
    return {"poisoned": poisoned, "signal_call": signal}


@pytest.mark.parametrize("variant", ["wait-puts", "land", "route_first"])
def test_a_reusing_dispatch_sends_no_routing(variant):
    cfg = cfg_of(2)
    res = run_pes(unsent_pe, 2, args=(VARIANTS[variant], cfg), timeout_s=RUN_TIMEOUT_S)
    for r, got in enumerate(res):
        assert got["poisoned"] and all(got["poisoned"].values()), (r, got["poisoned"])
        assert got["signal_call"] == 2, f"rank {r}: the token rows' signal of call 1 did not arrive: {got}"


def refusals_pe(session, cfg: EPConfig) -> dict:
    """What the host refuses around kept routings (each a message, or None if it was accepted)."""
    from ep_runtime.core.runtime import EPRuntime

    r, dev = session.rank, session.to_device
    out = {}

    def refused(key, fn):
        try:
            fn()
            out[key] = None
        except (EPInputError, EPStateError) as e:
            out[key] = f"{type(e).__name__}: {e}"

    with EPRuntime(cfg, session, debug=False) as rt, EPRuntime(cfg, session, debug=False) as other:
        xs, ids, ws = call_inputs(cfg, 0, SEED)
        x = dev(xs[r].view(np.uint16))
        refused("another runtime's handle", lambda: rt.keep_routing(other.dispatch_async(x, dev(ids[r]),
                                                                                          dev(ws[r]))))
        other.reset()
        batch = rt.dispatch_wait(rt.dispatch_async(x, dev(ids[r]), dev(ws[r])))
        kept = rt.keep_routing(batch.handle)
        refused("ids beside routing", lambda: rt.dispatch_async(x, dev(ids[r]), routing=kept))
        refused("wrong token count", lambda: rt.dispatch_async(dev(np.zeros((len(xs[r]) + 1, cfg.hidden),
                                                                             np.uint16)), routing=kept))
        refused("not a kept routing", lambda: rt.dispatch_async(x, routing=batch.handle))
        refused("no routing at all", lambda: rt.dispatch_async(x))
        refused("into not a kept routing", lambda: rt.keep_routing(batch.handle, into=batch))
        again = rt.keep_routing(batch.handle, into=kept)  # the same arrays: kept is retired
        refused("overwritten by into", lambda: rt.dispatch_async(x, routing=kept))
        rt.combine(dev(expert_outputs(cfg, reference.dispatch(xs, ids, ws, cfg)[r], r)), batch.handle)
        refused("another runtime's routing", lambda: other.dispatch_async(x, routing=again))
        rt.reset()
        refused("kept before reset", lambda: rt.dispatch_async(x, routing=again))
    return out


def test_the_host_refuses_misused_kept_routings():
    cfg = cfg_of(2)
    res = run_pes(refusals_pe, 2, args=(cfg,), timeout_s=RUN_TIMEOUT_S)
    for r, got in enumerate(res):
        want = {"another runtime's handle": "got a handle from another EPRuntime",
                "ids beside routing": "pass topk_ids, topk_weights and n_tokens only without it",
                "wrong token count": "dispatched", "not a kept routing": "routing must be a KeptRouting",
                "into not a kept routing": "into must be a KeptRouting",
                "another runtime's routing": "routing kept by another EPRuntime", "kept before reset": "before reset()",
                "no routing at all": "pass topk_ids and topk_weights (the routing), or routing=",
                "overwritten by into": "a later keep_routing(into=...) overwrote"}
        for key, frag in want.items():
            assert got[key] is not None and frag in got[key], (r, key, got[key])
