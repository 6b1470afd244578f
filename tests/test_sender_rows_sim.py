"""Partials by sender under the hierarchical transport (issue #66 steps 4 and 5, docs/wide_ep.md): a
list build keeps a token's partials on its home by sender, not a row a rank: a PE of the home's
node writes row ``combine_partials [G, N, T, H]`` of its local index, and the proxy of the x-th
other node puts a chunk's sums, one put, where the home staged the chunk's rows for that node
(``combine_sums [G, T min(K, X), H]``, a chunk's rows for every other node in turn: a token goes to
at most ``min(K, X)`` other nodes); their flags are ``combine_row_flag [N, T, parts]`` (the node's
PEs) and ``combine_chunk_flag [N + X, C]``, the proxy's in row ``N + x`` (``nodes.sender_index``)
(``N`` PEs a node, ``X`` other nodes).

The layout sizes the regions by the plan (senders for the hierarchical list builds, a row a rank
for its mask builds); every home's senders take the rows ``[0, N + X)`` once each, and the proxy's
row is the one the home reads. Through the real kernels on the simulator, the list forced as 2 x 2,
2 x 4, 4 x 2 and 4 x 1 logical nodes, stores and puts within a node: random routing, a rank without
tokens, masked (-1) slots, every token to one expert (expanded and compact layouts), top-k 1 and
float32 partials, each call twice, batches and combine bit for bit the reference's in the
hierarchical order, and the traffic the model's. The default run keeps one case (4 x 1: a proxy's
rows after other nodes' in the stage); ``pytest -m wide`` runs the rest.
"""

from __future__ import annotations

import numpy as np
import pytest

from ep_runtime.core.config import EPConfig
from ep_runtime.core.layout import BufferLayout
from ep_runtime.core.plan import Topology, choose_plan
from ep_runtime.kernels import nodes
from ep_runtime.kernels.protocol import COMBINE_FLAG_PARTS, RELAY_CHUNK_MIN
from ep_runtime.shmem.launch import run_pes
from ep_runtime.testing import (assert_calls_are_the_reference, assert_traffic_is_the_model, call_inputs,
                                plan_round_trips)

RUN_TIMEOUT_S = 300
SEED = 6605
#: testing.call_inputs' calls: random routing, a rank with no tokens, masked slots, no token anywhere,
#: then the same routings with varying counts (call 7: every token to one expert)
CALLS = 8


def cfg_of(R: int, **changes) -> EPConfig:
    """Four experts a rank, top-3 (a token's experts on several PEs of a node and on several
    nodes), hidden 64, up to 20 tokens a rank (more than one chunk), expanded and compact layouts."""
    return EPConfig(**{**dict(n_ranks=R, n_experts=4 * R, top_k=3, hidden=64, max_tokens_per_rank=20,
                              layouts=("expanded", "compact"), wait_timeout_s=60.0), **changes})


def py(device_function):
    """A device function's Python source (callable on the host)."""
    return getattr(device_function, "py_func", device_function)


# -- the layout and the index ---------------------------------------------------------------------
def hierarchical_plan(cfg: EPConfig, n_nodes: int, overrides: dict):
    size = cfg.n_ranks // n_nodes
    topology = Topology(cfg.n_ranks, False, 2, pdl=False, simulated=True,
                        node_of=tuple(p // size for p in range(cfg.n_ranks)), node_peers_mapped=True)
    return choose_plan(cfg, topology, overrides)


def test_hierarchical_list_builds_size_the_partials_by_sender_the_mask_builds_by_rank():
    G, T, H, F, C = 2, 20, 64, COMBINE_FLAG_PARTS, -(-20 // RELAY_CHUNK_MIN)
    for R, n_nodes in ((4, 2), (8, 2), (8, 4), (72, 9)):
        N, X = R // n_nodes, n_nodes - 1
        cfg = cfg_of(R) if R <= 64 else cfg_of(R, n_experts=R, top_k=2, max_tokens_per_rank=20)
        for stores in (True, False):
            plan = hierarchical_plan(cfg, n_nodes, {"dest_list": True, "node_stores": stores})
            assert plan.transport.value == "hierarchical" and plan.node_size == N, plan
            assert plan.combine_variant(cfg).partial_slots == N + X, (R, n_nodes)
            layout = BufferLayout(cfg, plan)
            shapes = [layout.region(name).shape for name in ("combine_partials", "combine_sums", "combine_row_flag",
                                                             "combine_chunk_flag")]
            KX = min(cfg.top_k, X)
            assert shapes == [(G, N, T, H), (G, T * KX, H), (N, T, F), (N + X, C)], (R, n_nodes, stores, shapes)
            if R > 64:
                continue  # past 64 ranks every build takes the list
            mask = hierarchical_plan(cfg, n_nodes, {"node_stores": stores})
            assert not mask.dest_list and mask.combine_variant(cfg).partial_slots == 0
            layout = BufferLayout(cfg, mask)
            shapes = [layout.region(name).shape for name in ("combine_partials", "combine_row_flag",
                                                             "combine_chunk_flag")]
            assert shapes == [(G, R, T, H), (R, T, F), (R, C)], (R, n_nodes, stores, shapes)
            assert not layout.has("combine_sums")
    f32 = cfg_of(8, combine_dtype="float32")
    layout = BufferLayout(f32, hierarchical_plan(f32, 4, {"dest_list": True}))
    for name, shape in (("combine_partials", (G, 2, T, H)), ("combine_sums", (G, T * 3, H))):
        region = layout.region(name)
        assert (region.shape, region.dtype) == (shape, np.float32), region


def test_a_proxy_keeps_its_sources_counts_flags_and_partials_by_other_node():
    """``relay_counts [G, X, N, L + 1]`` and ``relay_chunk_flag [X, C]``: a proxy's sources are the
    PEs of its local index on the X other nodes, a row each (``other_index``); its partials
    ``relay_partials`` / ``relay_flag [X N, T, ...]``, a row per (other node, PE of this node); list
    or mask build."""
    G, C = 2, -(-20 // RELAY_CHUNK_MIN)
    for R, n_nodes in ((4, 2), (8, 2), (8, 4), (72, 9), (1024, 128)):
        N, X = R // n_nodes, n_nodes - 1
        cfg = cfg_of(R) if R <= 64 else cfg_of(R, n_experts=R, top_k=2, max_tokens_per_rank=20)
        L = cfg.n_experts // R
        for overrides in ({"dest_list": True}, {}):
            if R > 64 and not overrides:
                continue  # past 64 ranks every build takes the list
            layout = BufferLayout(cfg, hierarchical_plan(cfg, n_nodes, overrides))
            shapes = [layout.region(name).shape[:2] if name.startswith("relay_partials") else layout.region(name).shape
                      for name in ("relay_counts", "relay_chunk_flag", "relay_partials")]
            assert shapes == [(G, X, N, L + 1), (X, C), (X * N, 20)], (R, n_nodes, overrides, shapes)
            assert layout.region("relay_flag").shape[:2] == (X * N, 20), (R, n_nodes, overrides)


def test_every_homes_senders_take_its_rows_once_and_a_proxy_puts_where_the_home_reads(monkeypatch):
    """``sender_index`` (its Python source on the host) over every home of several widths."""
    index, other = py(nodes.sender_index), py(nodes.other_index)
    monkeypatch.setattr(nodes, "other_index", other)  # what sender_index calls, on the host
    for R, N in ((4, 2), (8, 4), (8, 2), (72, 8), (1024, 8)):
        for home in range(R):
            mine = home // N
            senders = [q for q in range(mine * N, mine * N + N)]  # its node's PEs
            senders += [node * N + home % N for node in range(R // N) if node != mine]  # its proxies
            rows = [index(home, q, N) for q in senders]
            assert sorted(rows) == list(range(N + R // N - 1)), (R, N, home, rows)
            for proxy in senders[N:]:  # combine_relay's row: N + this node's index among the home's others
                assert N + other(proxy // N, mine) == index(home, proxy, N), (R, N, home, proxy)


# -- round trips through the kernels ----------------------------------------------------------------
def twice_pe(session, n_nodes: int, plan: dict, cfg: EPConfig) -> dict:
    """As ``n_nodes`` logical nodes, :data:`CALLS` round trips (``testing.plan_round_trips``)
    on one runtime under plan overrides ``plan``, the traffic of the first pass, then the same
    calls again."""
    from ep_runtime.core.runtime import EPRuntime

    session.use_logical_nodes(n_nodes)
    with EPRuntime(cfg, session, plan=plan) as rt:
        session.traffic(reset=True)
        first = plan_round_trips(session, rt, cfg, CALLS, SEED, False)
        traffic = session.traffic(reset=True)
        again = plan_round_trips(session, rt, cfg, CALLS, SEED, False)
        return {"calls": first, "again": again, "traffic": traffic, "plan": rt.plan.as_dict(),
                "shape": [rt.layout.region(name).shape[:2] for name in ("combine_partials", "combine_sums")]}


#: (ranks, nodes, plan overrides, config changes); the default run keeps the first (CI's time): 4
#: nodes of one PE, where a chunk's proxies find their rows after other nodes' in the source's stage
#: (``relay.rows_before`` > 0; a token to up to 3 other nodes). test_wide_sim's 9 x 8 round trip
#: (default too) runs the list builds with 8 PEs a node.
ALL_RUNS = [
    (4, 4, {}, {}), (4, 2, {}, {}), (4, 2, {"node_stores": False}, {}), (8, 2, {}, {}), (8, 2, {"node_stores": False}, {}),
    (8, 4, {}, {"top_k": 1}), (8, 4, {"node_stores": False}, {"combine_dtype": "float32"}),
    (4, 2, {}, {"combine_dtype": "float32", "top_k": 4}),
]
RUNS = ALL_RUNS[:1] + [pytest.param(*run, marks=pytest.mark.wide) for run in ALL_RUNS[1:]]


@pytest.mark.parametrize("R, n_nodes, plan, changes", RUNS,
                         ids=[f"{n}x{R // n}" + "".join(f"-{k}={x}" for k, x in {**p, **c}.items())
                              for R, n, p, c in ALL_RUNS])
def test_partials_by_sender_combine_bit_for_bit_as_the_reference(R, n_nodes, plan, changes):
    cfg, size = cfg_of(R, **changes), R // n_nodes
    res = run_pes(twice_pe, R, args=(n_nodes, {"dest_list": True, **plan}, cfg), timeout_s=RUN_TIMEOUT_S)
    assert all(r["plan"]["dest_list"] and r["plan"]["node_size"] == size for r in res), res[0]["plan"]
    rows = cfg.max_tokens_per_rank * min(cfg.top_k, n_nodes - 1)  # a chunk's rows for every other node
    assert all([tuple(x) for x in r["shape"]] == [(2, size), (2, rows)] for r in res), res[0]["shape"]
    what = f"{n_nodes} x {size} logical nodes, partials by sender, {plan} {changes}"
    assert_calls_are_the_reference(cfg, res, CALLS, SEED, what, node_size=size)
    for r, got in enumerate(res):
        for call, (first, again) in enumerate(zip(got["calls"], got["again"])):
            np.testing.assert_array_equal(again["out"], first["out"], err_msg=f"{what}: rank {r} call {call} again")
    assert_traffic_is_the_model(cfg, res, [call_inputs(cfg, c, SEED)[1] for c in range(CALLS)], size,
                                plan.get("node_stores", True))


# -- every layout over the hierarchical list builds -------------------------------------------------
def layouts_pe(session, n_nodes: int, plan: dict, cfg: EPConfig) -> dict:
    """As ``n_nodes`` logical nodes, each routing of ``test_partial_slots_sim.SCENARIOS`` through
    the expanded, compact and dense layouts (``test_partial_slots_sim.round_trips``, no
    ``reduce=False``), twice."""
    from test_partial_slots_sim import SCENARIOS as ROUTINGS, SEED as ROUTING_SEED, round_trips

    from ep_runtime.core.runtime import EPRuntime
    from ep_runtime.testing import make_inputs

    session.use_logical_nodes(n_nodes)
    with EPRuntime(cfg, session, plan=plan) as rt:
        runs = {}
        for i, scenario in enumerate(ROUTINGS):
            xs, ids, ws = make_inputs(cfg, scenario, ROUTING_SEED + i)
            runs[scenario] = [round_trips(session, rt, cfg, xs, ids, ws, partials=False) for _ in range(2)]
        return {"runs": runs, "plan": rt.plan.as_dict()}


@pytest.mark.parametrize("node_stores", [True, pytest.param(False, marks=pytest.mark.wide)])
def test_every_layout_over_the_hierarchical_lists_is_the_reference(node_stores):
    """The compact and dense combines (and the expanded one) of a hierarchical build with
    destination lists, 2 x 2 logical nodes: bit for bit the reference's with the node's sums
    (``node_size``), the second call the first's bits. (``reduce=False`` is refused there: the
    proxies sum.)"""
    from test_partial_slots_sim import assert_layouts_are_the_reference

    R, n_nodes, N = 4, 2, 2
    cfg = cfg_of(R, layouts=("expanded", "compact", "dense"))
    res = run_pes(layouts_pe, R, args=(n_nodes, {"dest_list": True, "node_stores": node_stores}, cfg),
                  timeout_s=RUN_TIMEOUT_S)
    assert all(r["plan"]["dest_list"] and r["plan"]["node_size"] == N for r in res), res[0]["plan"]
    assert_layouts_are_the_reference(cfg, res, f"2 x 2 nodes, node_stores={node_stores}", node_size=N)
