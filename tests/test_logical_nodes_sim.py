"""Logical nodes: a session's node map and the testing topology that splits one host's PEs into
nodes reached from each other by NVSHMEM puts only (``Session.use_logical_nodes``,
``open_session(logical_nodes=...)``, :mod:`ep_runtime.shmem.nodes`).

An mpiexec job of 4 simulated PEs opens its session as 2 x 2 logical nodes: the node map, no peer
mapping across nodes (``peer_view`` refuses a PE of the other node, ``peer_addresses`` is None,
``node_peer_addresses`` has its own node's only),
the plan's transport (puts, its reason naming the nodes) and round trips in both layouts, bit for
bit the reference's. Eight PEs as 2 x 4 and 4 x 2 map only their own node. The node-map helpers
and the refusals run on their own.
"""

from __future__ import annotations

import sys

import pytest

from ep_runtime.core.errors import EPInputError
from ep_runtime.core.plan import Topology, choose_plan
from ep_runtime.shmem import open_session
from ep_runtime.shmem.launch import run_pes
from ep_runtime.shmem.nodes import logical_nodes, nodes_of_hosts
from ep_runtime.testing import assert_calls_are_the_reference, input_error_of, plan_pe
from test_sessions_sim import _mpiexec, _write, ep_config, heap_bytes, run_job

SEED = 23
CALLS = 2  # an expanded call, then a compact one (testing.call_layout)


def logical_rank_main(out_dir: str) -> None:
    """One rank of an mpiexec job of 4: a session of 2 logical nodes, what it reports, round trips."""
    from mpi4py import MPI

    n = MPI.COMM_WORLD.Get_size()
    session = open_session("sim", heap_bytes(n), comm=MPI.COMM_WORLD, logical_nodes=2)
    me = session.rank
    probe = session.alloc_symmetric("test.probe", (8,), "int32")
    mate, other = me ^ 1, (me + 2) % n  # the other PE of its node, a PE of the other node
    got = {"rank": me, "node_of": session.node_of(), "mapped": session.peers_mapped(),
           "addresses": session.peer_addresses(probe), "mate_view": session.peer_view(probe, mate).shape,
           "node_addresses": session.node_peer_addresses(probe), "node_mapped": session.node_peers_mapped(),
           "mate_address": int(session.peer_view(probe, mate).ctypes.data)}
    try:
        session.peer_view(probe, other)
        got["other_view"] = None
    except EPInputError as e:
        got["other_view"] = str(e)
    session.free_symmetric(probe)
    got["reasons"] = choose_plan(ep_config(n), Topology.of(session)).reasons
    got["run"] = plan_pe(session, {}, ep_config(n), CALLS, SEED)
    session.close()
    _write(out_dir, me, got)


@pytest.mark.skipif(_mpiexec() is None, reason="no mpiexec (pip install mpich mpi4py)")
def test_two_logical_nodes_of_two_reach_each_other_by_puts_and_round_trip_exactly(tmp_path):
    pytest.importorskip("mpi4py")
    n = 4
    results = run_job([_mpiexec(), "-n", str(n), sys.executable, "-c",
                       f"import test_logical_nodes_sim as t; t.logical_rank_main({str(tmp_path / 'out')!r})"],
                      tmp_path, n)
    for r, got in enumerate(results):
        assert got["node_of"] == (0, 0, 1, 1), got["node_of"]
        assert got["mapped"] is False and got["addresses"] is None, f"rank {r}: a peer of another node is mapped"
        assert got["mate_view"] == (8,), f"rank {r}: its own node's peer view"
        # its own node's addresses (its own mapping and its mate's), 0 for the other node's PEs
        node = got["node_addresses"]
        assert got["node_mapped"] is True and len(node) == n, got
        assert node[r ^ 1] == got["mate_address"] and node[r] != 0 and node[r] != node[r ^ 1], node
        assert [node[p] for p in range(n) if p // 2 != r // 2] == [0, 0], node
        assert got["other_view"] and f"PE {(r + 2) % n} is on node {1 - r // 2}" in got["other_view"] and \
            "reach it with NVSHMEM puts" in got["other_view"], got["other_view"]
        plan = got["run"]["plan"]
        assert plan["transport"] == "hierarchical" and plan["node_size"] == 2 and plan["node_stores"], plan
        assert any("transport: the PEs are on 2 nodes of 2" in line for line in got["reasons"]), got["reasons"]
    assert_calls_are_the_reference(ep_config(n), [got["run"] for got in results], CALLS, SEED, "2 x 2 logical nodes",
                                   node_size=2)


@pytest.mark.parametrize("hosts, nodes", [
    (["a"], (0,)),
    (["a", "a", "b", "b"], (0, 0, 1, 1)),
    (["b", "a", "b", "a"], (0, 1, 0, 1)),
])
def test_the_node_map_numbers_nodes_by_their_first_pe(hosts, nodes):
    assert nodes_of_hosts(hosts) == nodes


@pytest.mark.parametrize("real, n, want", [
    ((0, 0, 0, 0), 2, (0, 0, 1, 1)),
    ((0,) * 8, 4, (0, 0, 1, 1, 2, 2, 3, 3)),
    ((0,) * 8, 2, (0, 0, 0, 0, 1, 1, 1, 1)),
    ((0, 0, 1, 1), 2, (0, 0, 1, 1)),
    ((0, 0, 1, 1), 4, (0, 1, 2, 3)),
])
def test_logical_nodes_split_the_real_ones_into_consecutive_pes(real, n, want):
    assert logical_nodes(real, n) == want


@pytest.mark.parametrize("real, n, match", [
    ((0, 0, 0, 0), 3, r"n_nodes=3; expected a positive int dividing the session's 4 PEs"),
    ((0, 0, 0, 0), 0, r"n_nodes=0; expected a positive int"),
    ((0, 0, 0, 0), True, r"n_nodes=True; expected a positive int"),
    ((0, 0, 1, 1), 1, r"PEs 0..3 in logical node 0, but they are on real nodes \[0, 1\]"),
    ((0, 1, 0, 1), 2, r"a logical node must lie inside one real node"),
])
def test_a_logical_topology_that_cannot_be_is_refused_naming_the_argument(real, n, match):
    with pytest.raises(EPInputError, match=match):
        logical_nodes(real, n)


def refusals_pe(session) -> dict:
    """Each way ``use_logical_nodes`` refuses, on a session of 2 PEs, and the map left unchanged."""
    got = {"odd": input_error_of(lambda: session.use_logical_nodes(3)),
           "differ": input_error_of(lambda: session.use_logical_nodes(1 + session.rank)),
           "after_odd": session.node_of(), "mapped": session.peers_mapped()}
    got["late"] = input_error_of(lambda: session.use_logical_nodes(2))  # the mappings were reported
    return got


def test_use_logical_nodes_refuses_before_changing_anything():
    got = run_pes(refusals_pe, 2, timeout_s=120)
    for r, g in enumerate(got):
        assert "n_nodes=3; expected a positive int dividing the session's 2 PEs" in g["odd"], g
        assert "the PEs asked for different node counts [1, 2]" in g["differ"], g
        assert g["after_odd"] == (0, 0) and g["mapped"] is True, f"rank {r}: {g}"
        assert "already reported its peer mappings" in g["late"], g


def logical_map_pe(session, n_nodes: int) -> dict:
    """The node map and the mappings a session of ``n_nodes`` logical nodes reports on this PE."""
    session.use_logical_nodes(n_nodes)
    probe = session.alloc_symmetric("test.probe", (4,), "int32")
    node_of = session.node_of()
    refused = [pe for pe in range(session.n_ranks)
               if input_error_of(lambda: session.peer_view(probe, pe)) is not None]
    got = {"node_of": node_of, "mapped": session.peers_mapped(), "refused": refused}
    session.free_symmetric(probe)
    return got


@pytest.mark.parametrize("n_nodes, want", [(2, (0, 0, 0, 0, 1, 1, 1, 1)), (4, (0, 0, 1, 1, 2, 2, 3, 3))],
                         ids=["2x4", "4x2"])
def test_eight_pes_as_2x4_and_4x2_map_only_their_own_node(n_nodes, want):
    got = run_pes(logical_map_pe, 8, args=(n_nodes,), timeout_s=120)
    for r, g in enumerate(got):
        assert g["node_of"] == want and g["mapped"] is False, f"rank {r}: {g}"
        assert g["refused"] == [pe for pe in range(8) if want[pe] != want[r]], f"rank {r}: {g['refused']}"
