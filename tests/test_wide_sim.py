"""Wide expert parallelism on the simulator (#66): a round trip on logical nodes of 8 PEs at many
ranks, bit for bit the reference's, with the hierarchical transport (what each PE puts and
signals to each other PE the traffic model's, bytes and operations) and with flat puts; and what
keeps a PE cheap (the kernels imported once, before the PEs fork; waits that sleep longer where
the PEs outnumber the cores).

64 ranks (8 x 8) keep the 64-bit destination masks; 72 (9 x 8) and 128 (16 x 8) are the same
test with another rank count, on the destination lists the plan takes past 64 ranks. The round
trips are under the ``wide`` marker (15 s to minutes each on 2 cores), which the default run leaves
out, but for 72 ranks as 9 x 8 logical nodes: ``pytest -m wide tests/test_wide_sim.py`` runs the
others; the cost guards below run by default. Tiny sizes (hidden 8, two tokens a rank, one call)
so that a PE costs little more than its process; docs/plans.md, "The simulator at many PEs (#66)",
has what such a run costs.

Each PE combines the expert outputs of the batch it received (``testing.wide_round_trip_pe``: no
PE computes the reference's batches of every rank); the launcher checks every batch and every
combine against the reference once.
"""

from __future__ import annotations

import os

import pytest

from ep_runtime.core.config import EPConfig
from ep_runtime.core.layout import BufferLayout
from ep_runtime.shmem.launch import run_pes
from ep_runtime.shmem.sim_heap import poll_pause_cap
from ep_runtime.testing import (assert_calls_are_the_reference, assert_traffic_is_the_model, call_inputs,
                                wide_round_trip_pe)

SEED = 66
NODE_SIZE = 8
RUN_TIMEOUT_S = 900
#: 64 PEs keep the masks, 72 and 128 take the destination lists (docs/plans.md has their cost)
RANKS = [64, 72, 128]


def wide_cfg(R: int) -> EPConfig:
    """Two experts a rank, top-4 (a token's experts on up to four nodes), hidden 8, two tokens a
    rank, the expanded layout only."""
    return EPConfig(n_ranks=R, n_experts=2 * R, top_k=4, hidden=8, max_tokens_per_rank=2, layouts=("expanded",),
                    wait_timeout_s=600.0)


#: (ranks, transport): 72 ranks as 9 x 8 logical nodes run by default (about 10 s on 2 cores: a
#: round trip past 64 ranks, destination lists, partials by sender and the traffic in every CI run),
#: the rest under the ``wide`` marker
WIDE_CASES = [pytest.param(R, transport, id=f"{transport}-{R}",
                           marks=() if (R, transport) == (72, "hierarchical") else pytest.mark.wide)
              for transport in ("hierarchical", "puts") for R in RANKS]


@pytest.mark.parametrize("R, transport", WIDE_CASES)
def test_wide_round_trip_on_nodes_of_eight_is_the_reference(R, transport):
    cfg = wide_cfg(R)
    hierarchical = transport == "hierarchical"
    runs = run_pes(wide_round_trip_pe, R, args=(R // NODE_SIZE if hierarchical else 1, cfg,
                                                {} if hierarchical else {"transport": "puts"}, SEED),
                   timeout_s=RUN_TIMEOUT_S, heap_bytes=BufferLayout(cfg).symmetric_bytes)
    for r, got in enumerate(runs):
        assert got["plan"]["transport"] == transport, f"rank {r}: {got['plan']}"
        if hierarchical:
            assert got["plan"]["node_size"] == NODE_SIZE, f"rank {r}: {got['plan']}"
    assert sum(int(got["calls"][0]["expert_counts"].sum()) for got in runs) > 0, "no rank received a row"
    assert_calls_are_the_reference(cfg, runs, 1, SEED, f"{R // NODE_SIZE} x {NODE_SIZE} ({transport})",
                                   node_size=NODE_SIZE if hierarchical else 0)
    if hierarchical:  # what each PE put and signalled to each other PE: the traffic model's bytes and operations
        assert_traffic_is_the_model(cfg, runs, [call_inputs(cfg, 0, SEED)[1]], NODE_SIZE, True)


@pytest.mark.wide
@pytest.mark.parametrize("plan", [{"receiver": "land"}, {"receiver": "route_first"},
                                  {"receiver": "land", "transport": "puts"}],
                         ids=["land-stores", "route_first-stores", "land-puts"])
def test_every_receiver_past_64_ranks_is_the_reference(plan):
    """72 ranks on one node through the landing and route-first receivers (the round trips above
    take the plan's ``wait``): their per-source shared arrays and scans past 64 sources, exact."""
    cfg = wide_cfg(72)
    runs = run_pes(wide_round_trip_pe, 72, args=(1, cfg, plan, SEED), timeout_s=RUN_TIMEOUT_S,
                   heap_bytes=BufferLayout(cfg).symmetric_bytes)
    for r, got in enumerate(runs):
        assert got["plan"]["dest_list"], f"rank {r}: {got['plan']}"
        assert {k: got["plan"][k] for k in plan} == plan, f"rank {r}: {got['plan']}"
    assert_calls_are_the_reference(cfg, runs, 1, SEED, f"72 ranks {plan}")


def new_modules_pe(session, n_nodes: int, cfg: EPConfig, plan: dict) -> list[str]:
    """The ep_runtime modules this PE imported itself during a round trip (``wide_round_trip_pe``)."""
    import sys

    before = set(sys.modules)
    wide_round_trip_pe(session, n_nodes, cfg, plan, SEED)
    return sorted(m for m in set(sys.modules) - before if m.startswith("ep_runtime"))


@pytest.mark.parametrize("n_nodes, plan", [(2, {}), (1, {"transport": "puts"}), (1, {})],
                         ids=["hierarchical", "puts", "stores"])
def test_pes_fork_with_every_module_of_a_round_trip_imported(n_nodes, plan, monkeypatch):
    """The PE server imports the kernels once (``launch._PE_PRELOAD``): a PE imports no
    ep_runtime module of its own for a round trip on any transport (a module missing from the
    preload is imported once per PE)."""
    monkeypatch.delenv("EP_RUNTIME_TRACE", raising=False)  # set, it makes the PEs spawn (launch._pe_context)
    cfg = EPConfig(n_ranks=4, n_experts=8, top_k=4, hidden=8, max_tokens_per_rank=2, layouts=("expanded",))
    imported = run_pes(new_modules_pe, 4, args=(n_nodes, cfg, plan), timeout_s=RUN_TIMEOUT_S,
                       heap_bytes=BufferLayout(cfg).symmetric_bytes)
    assert imported == [[]] * 4, f"imported by the PEs, not by the server: {imported}"


def test_waits_sleep_longer_where_the_pes_outnumber_the_cores():
    """A wait's longest sleep: 2 ms while the PEs are a few a core, then growing with the PEs a
    core, so that 128 PEs on 2 cores do not fill them with wake-ups."""
    cores = len(os.sched_getaffinity(0))
    assert poll_pause_cap(1) == poll_pause_cap(2) == 2e-3
    assert poll_pause_cap(128 * cores) == pytest.approx(2 * poll_pause_cap(64 * cores)) == pytest.approx(0.032)
