"""Destination lists (issue #66, docs/wide_ep.md): a token's destination ranks kept as an ascending
int32 list and its count (ep_runtime/kernels/destinations.py) instead of a 64-bit mask, the build
variant every runtime past 64 ranks takes.

The list variant forced (the plan's ``dest_list``) at 4 and 8 ranks on the stores and puts
transports under each receiver, over calls of random routing, a rank with no tokens, masked (-1)
slots and no token anywhere, and at top-k 1: batches and combine bit for bit the reference's.
Also across logical nodes (the hierarchical transport, stores and puts within a node). The plan
takes the list past 64 ranks, in every token format (tests/test_dest_lists_quantized_sim.py runs
the FP8 and NVFP4 codecs over it). 72-rank round
trips, flat and over 9 x 8 logical nodes, run the list where it is needed. The default run keeps
one case of each kind (wait on stores and on puts at 4 ranks, 2 x 2 logical nodes); ``pytest -m
wide`` runs every case, for CI's time.
"""

from __future__ import annotations

import numpy as np
import pytest

from ep_runtime.core.config import EPConfig
from ep_runtime.core.errors import EPConfigError
from ep_runtime.core.plan import Topology, choose_plan
from ep_runtime.kernels.destinations import insert_rank
from ep_runtime.shmem.launch import run_pes
from ep_runtime.testing import assert_calls_are_the_reference, plan_pe

RUN_TIMEOUT_S = 300
CALLS = 4  # random routing, a rank with no tokens, masked slots, no token anywhere (testing.call_inputs)
SEED = 660

#: name -> plan overrides: the list forced under each transport and receiver
VARIANTS = {
    "wait": {"dest_list": True, "receiver": "wait"},
    "wait-puts": {"dest_list": True, "receiver": "wait", "transport": "puts"},
    "land": {"dest_list": True, "receiver": "land"},
    "land-puts": {"dest_list": True, "receiver": "land", "transport": "puts"},
    "route_first": {"dest_list": True, "receiver": "route_first"},
}


def cfg_of(R: int, **changes) -> EPConfig:
    """Two experts a rank, top-2, hidden 64 (16 uint64 words: rows cut into parts), 6 tokens a rank."""
    return EPConfig(**{**dict(n_ranks=R, n_experts=2 * R, top_k=2, hidden=64, max_tokens_per_rank=6,
                              wait_timeout_s=60.0), **changes})


#: the default run keeps the first two (stores and puts); ``pytest -m wide`` runs the rest (CI's time)
ALL_RUNS = [(v, 4, {}) for v in VARIANTS] + [
    ("wait", 8, {}), ("land-puts", 8, {}),
    ("wait-puts", 4, {"top_k": 1}), ("land", 8, {"top_k": 1, "combine_dtype": "float32"}),
    ("wait", 4, {"top_k": 4, "n_experts": 16}),
]
RUNS = ALL_RUNS[:2] + [pytest.param(*run, marks=pytest.mark.wide) for run in ALL_RUNS[2:]]


@pytest.mark.parametrize("variant, R, changes", RUNS,
                         ids=[f"{v}-R{R}" + "".join(f"-{k}={x}" for k, x in c.items()) for v, R, c in ALL_RUNS])
def test_destination_lists_forced_are_the_reference_bit_for_bit(variant, R, changes):
    cfg = cfg_of(R, **changes)
    res = run_pes(plan_pe, R, args=(VARIANTS[variant], cfg, CALLS, SEED), timeout_s=RUN_TIMEOUT_S)
    assert all(r["plan"]["dest_list"] for r in res), [r["plan"] for r in res]
    assert_calls_are_the_reference(cfg, res, CALLS, SEED, f"{variant} at {R} ranks, destination lists")


def nodes_pe(session, n_nodes: int, plan: dict, cfg: EPConfig, calls: int, seed: int) -> dict:
    """As ``n_nodes`` logical nodes (the hierarchical transport): :func:`plan_pe`."""
    session.use_logical_nodes(n_nodes)
    return plan_pe(session, plan, cfg, calls, seed)


#: (ranks, nodes, plan overrides, config changes): logical nodes, stores and puts within a node
ALL_NODE_RUNS = [
    (4, 2, {}, {}), (8, 2, {"node_stores": False}, {}), (8, 4, {}, {"top_k": 1}),
    (8, 2, {}, {"top_k": 6, "n_experts": 32, "max_tokens_per_rank": 20, "combine_dtype": "float32"}),
]
NODE_RUNS = ALL_NODE_RUNS[:1] + [pytest.param(*run, marks=pytest.mark.wide) for run in ALL_NODE_RUNS[1:]]


@pytest.mark.parametrize("R, nodes, plan, changes", NODE_RUNS,
                         ids=[f"{R}x{n}" + "".join(f"-{k}={x}" for k, x in {**p, **c}.items())
                              for R, n, p, c in ALL_NODE_RUNS])
def test_destination_lists_forced_across_logical_nodes_are_the_reference(R, nodes, plan, changes):
    cfg = cfg_of(R, **changes)
    res = run_pes(nodes_pe, R, args=(nodes, {"dest_list": True, **plan}, cfg, CALLS, SEED),
                  timeout_s=RUN_TIMEOUT_S)
    assert all(r["plan"]["dest_list"] and r["plan"]["transport"] == "hierarchical" for r in res), res[0]["plan"]
    assert_calls_are_the_reference(cfg, res, CALLS, SEED, f"{nodes} logical nodes of {R // nodes}, lists",
                                   node_size=R // nodes)


def test_a_list_keeps_its_ranks_ascending_once_each_whatever_their_number():
    insert = getattr(insert_rank, "py_func", insert_rank)  # the device function's Python source
    dl = np.zeros(7, np.int32)
    for d in (70, 3, 1023, 3, 64, 0, 70):  # any rank number: no mask bit
        insert(dl, d)
    assert dl[0] == 5 and dl[1:6].tolist() == [0, 3, 64, 70, 1023], dl


def test_the_plan_takes_lists_past_64_ranks_in_every_token_format():
    flat = Topology(72, True, 2, pdl=False, simulated=True)
    plan = choose_plan(EPConfig(n_ranks=72, n_experts=72, top_k=2, hidden=64, max_tokens_per_rank=2), flat)
    assert plan.dest_list and any(r.startswith("dest_list: 72 > 64 ranks") for r in plan.reasons), plan.reasons
    v = plan.dispatch_variant(EPConfig(n_ranks=72, n_experts=72, top_k=2, hidden=64, max_tokens_per_rank=2))
    assert (v.dest_slots, v.rank_slots) == (2, 72), v
    small = choose_plan(EPConfig(n_ranks=8, n_experts=16, top_k=4, hidden=64, max_tokens_per_rank=2),
                        Topology(8, True, 2, pdl=False, simulated=True))
    assert not small.dest_list and small.dispatch_variant(
        EPConfig(n_ranks=8, n_experts=16, top_k=4, hidden=64, max_tokens_per_rank=2)).dest_slots == 0
    with pytest.raises(EPConfigError, match=r"plan rule 'dest_list': dest_list=0 with 72 ranks"):
        choose_plan(EPConfig(n_ranks=72, n_experts=72, top_k=2, hidden=64, max_tokens_per_rank=2), flat,
                    {"dest_list": False})
    nodes = Topology(72, False, 2, pdl=False, simulated=True, node_of=tuple(p // 8 for p in range(72)),
                     node_peers_mapped=True)
    hier = choose_plan(EPConfig(n_ranks=72, n_experts=72, top_k=2, hidden=64, max_tokens_per_rank=2), nodes)
    assert hier.transport.value == "hierarchical" and hier.node_size == 8 and hier.dest_list, hier
    for fmt in ("fp8_e4m3", "fp8_e4m3_ue8m0", "nvfp4"):  # their codecs send over the list too
        cfg = EPConfig(n_ranks=72, n_experts=72, top_k=2, hidden=128, max_tokens_per_rank=2, token_dtype=fmt)
        for topology in (flat, nodes):
            plan = choose_plan(cfg, topology)
            assert plan.dest_list and plan.dispatch_variant(cfg).dest_slots == 2, (fmt, plan)


def wide_cfg(R: int) -> EPConfig:
    """One expert a rank, top-2, hidden 64, 2 tokens a rank: the smallest round trip past 64 ranks
    (the simulator runs a process per rank); waits bounded by ten minutes on a loaded machine."""
    return EPConfig(n_ranks=R, n_experts=R, top_k=2, hidden=64, max_tokens_per_rank=2, wait_timeout_s=600.0)


@pytest.mark.wide
def test_a_72_rank_flat_round_trip_is_the_reference():
    cfg = wide_cfg(72)
    res = run_pes(plan_pe, 72, args=({"transport": "puts"}, cfg, 1, SEED), timeout_s=1800)
    assert all(r["plan"]["dest_list"] and r["plan"]["transport"] == "puts" for r in res), res[0]["plan"]
    assert_calls_are_the_reference(cfg, res, 1, SEED, "72 ranks, flat, destination lists")


@pytest.mark.wide
def test_a_72_rank_round_trip_over_9_logical_nodes_of_8_is_the_reference():
    cfg = wide_cfg(72)
    res = run_pes(nodes_pe, 72, args=(9, {}, cfg, 1, SEED), timeout_s=1800)
    assert all(r["plan"]["dest_list"] and r["plan"]["node_size"] == 8 for r in res), res[0]["plan"]
    assert_calls_are_the_reference(cfg, res, 1, SEED, "72 ranks, 9 x 8 logical nodes, destination lists",
                                   node_size=8)
