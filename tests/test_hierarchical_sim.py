"""The hierarchical transport on the simulator (ep_runtime/kernels/relay.py, ep_runtime/kernels/nodes.py).

Nodes are blocks of consecutive PEs (here logical nodes of one host: ``use_logical_nodes``).
Within a node every PE puts to every other; across nodes a token goes once to each destination
node, to the proxy there (the PE with the sender's local index), which forwards it to its node's
PEs into the slots the sender would have written, and the combine sums each node's partials on
that node's proxy, which sends one partial per (token, node) home.

- 2 x 2, 2 x 4 and 4 x 2 nodes: round trips over the awkward routings (random, a rank with no
  tokens, masked slots, every token to one expert), both layouts: every batch bit for bit the
  reference's, every combine bit for bit the reference's summed in the hierarchical order (a
  sum over nodes of sums within a node), which differs from the flat order on these inputs.
- Traffic, counted by the simulated SHMEM: no PE sends anything to a PE of another node but its
  proxy there, and fewer bytes cross nodes than with puts to every peer.
- FP8 messages; ids outside ``[-1, n_experts)`` with the routing check off; a 100-call soak; a
  node that withholds its call (the other node's proxies time out naming their sources) or its
  combine (the other node's homes time out naming their proxy's chunk flag and a token);
  ``reduce=False``, which the transport does not carry, refused before any launch; the plan's
  rules. Kept routings and slot values: tests/test_kept_routing_sim.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from ep_runtime.core import reference
from ep_runtime.core.config import EPConfig
from ep_runtime.core.errors import EPConfigError
from ep_runtime.core.plan import Receiver, Topology, Transport, choose_plan
from ep_runtime.shmem.launch import run_pes
from ep_runtime.testing import (assert_batch_is_the_reference, assert_calls_are_the_reference,
                                assert_fp8_calls_are_the_reference, assert_traffic_is_the_model, call_inputs, expert_outputs, fp8_plan_pe,
                                input_error_of, make_inputs, plan_pe, round_trip_with_error, silent_peer_pe)
from test_masked_ids_sim import PLANTED, planted_inputs

SEED = 41
#: round trips a topology: testing.CALL_SCENARIOS (random, a rank with no tokens, masked slots, every token
#: to one expert; the layouts alternate) on 2 x 2, the first two (both layouts) on 8 PEs
CALLS = {4: 4, 8: 2}
SOAK_CALLS = 100
RUN_TIMEOUT_S = 300


def hier_cfg(R: int, **changes) -> EPConfig:
    """4 experts a PE, top-6 (a token's experts spread over several PEs of a node, so the order
    of the combine's sum shows), hidden 64, up to 16 tokens a PE."""
    return EPConfig(**{**dict(n_ranks=R, n_experts=4 * R, top_k=6, hidden=64, max_tokens_per_rank=16,
                              wait_timeout_s=60.0), **changes})


def round_trips_pe(session, n_nodes: int, cfg: EPConfig, compare_flat: bool, plan: dict) -> dict:
    """As ``n_nodes`` logical nodes: :data:`CALLS` round trips on the default plan (with the
    overrides ``plan``) and the traffic they sent; with ``compare_flat``, the traffic of the
    same calls with puts to every peer (``transport=puts``)."""
    session.use_logical_nodes(n_nodes)
    session.traffic(reset=True)
    got = plan_pe(session, plan, cfg, CALLS[cfg.n_ranks], SEED)
    got["traffic"] = session.traffic(reset=True)
    if compare_flat:
        plan_pe(session, {"transport": "puts"}, cfg, CALLS[cfg.n_ranks], SEED)
        got["flat_traffic"] = session.traffic(reset=True)
    return got


#: 2 x 2 with several chunks a call (up to 72 tokens, 8 a chunk: the last one short) and
#: top-3 of 16, so that a chunk's tokens bound for the other node have gaps between them (and
#: under "one_expert" a chunk has none bound there: no put)
CHUNKS = dict(top_k=3, hidden=32, max_tokens_per_rank=72)
#: float32 partials: stored into the proxies' relay partials two words a value
F32 = dict(combine_dtype="float32")


@pytest.mark.parametrize("R, n_nodes, changes, node_stores",
                         [(4, 2, {}, True), (8, 2, {}, True), (8, 4, {}, True), (4, 2, CHUNKS, True),
                          (4, 2, {}, False), (4, 2, CHUNKS, False), (4, 2, F32, True)],
                         ids=["2x2", "2x4", "4x2", "2x2-chunks", "2x2-puts-within", "2x2-chunks-puts-within",
                              "2x2-f32-partials"])
def test_round_trips_are_the_reference_in_the_hierarchical_order_and_cross_nodes_only_to_proxies(R, n_nodes,
                                                                                                  changes,
                                                                                                  node_stores):
    cfg, size = hier_cfg(R, **changes), R // n_nodes
    plan = {} if node_stores else {"node_stores": False}
    runs = run_pes(round_trips_pe, R, args=(n_nodes, cfg, R == 4 and not changes and node_stores, plan),
                   timeout_s=RUN_TIMEOUT_S)
    for r, got in enumerate(runs):
        assert (got["plan"]["transport"], got["plan"]["receiver"], got["plan"]["node_size"],
                got["plan"]["node_stores"]) == ("hierarchical", "wait", size, node_stores), got["plan"]
        assert ("combine_stage" in got["regions"]) == (not node_stores), got["regions"]
    what = f"{n_nodes} x {size} nodes"
    assert_calls_are_the_reference(cfg, runs, CALLS[R], SEED, what, node_size=size)
    # the inputs tell the two orders apart, so a flat sum would have failed above
    differs = 0
    for call in range(CALLS[R]):
        xs, ids, ws = call_inputs(cfg, call, SEED)
        refs = reference.dispatch(xs, ids, ws, cfg)
        ys = [expert_outputs(cfg, refs[s], s) for s in range(R)]
        flat, hier = reference.combine(ys, refs, ids, cfg), reference.combine(ys, refs, ids, cfg, node_size=size)
        differs += sum(int(np.any(flat[s].view(np.uint16) != hier[s].view(np.uint16))) for s in range(R))
    # (float32 partials round once, at the end: there the orders agree on these inputs)
    assert differs > 0 or cfg.combine_dtype == "float32", \
        "no output depends on the summation order: the test cannot tell hierarchical from flat"
    for r, got in enumerate(runs):
        ops, sent = got["traffic"][:, 0], got["traffic"][:, 1]
        for d in range(R):
            if d // size == r // size:
                continue
            if d % size == r % size:
                assert sent[d] > 0, f"rank {r} sent nothing to its proxy {d}"
            else:
                assert ops[d] == 0 and sent[d] == 0, f"rank {r} sent {ops[d]} operations ({sent[d]} bytes) to {d}, " \
                                                     f"a PE of another node that is not its proxy"
    assert_traffic_is_the_model(cfg, runs, [call_inputs(cfg, c, SEED)[1] for c in range(CALLS[R])], size, node_stores)
    if "flat_traffic" in runs[0]:
        across = [sum(int(g[key][d, 1]) for r, g in enumerate(runs) for d in range(R) if d // size != r // size)
                  for key in ("traffic", "flat_traffic")]
        assert 0 < across[0] < across[1], f"bytes across nodes: hierarchical {across[0]}, to every peer {across[1]}"


def fp8_pe(session, cfg: EPConfig) -> dict:
    """FP8 round trips as 2 x 2, storing within a node, then putting there, each with its traffic."""
    session.use_logical_nodes(2)
    out = {}
    for node_stores in (True, False):
        session.traffic(reset=True)
        got = fp8_plan_pe(session, {"node_stores": node_stores}, cfg, SEED)
        got["traffic"] = session.traffic(reset=True)
        out[node_stores] = got
    return out


def test_fp8_messages_are_forwarded_exactly_and_the_model_counts_their_padding():
    cfg = hier_cfg(4, token_dtype="fp8_e4m3", hidden=128)
    pes = run_pes(fp8_pe, 4, args=(cfg,), timeout_s=RUN_TIMEOUT_S)
    # packed chunks and the proxies' forwards move whole messages (132 bytes padded to 256 here)
    assert cfg.slot_bytes > cfg.token_bytes
    for node_stores in (True, False):
        runs = [pe[node_stores] for pe in pes]
        assert (runs[0]["plan"]["transport"], runs[0]["plan"]["node_stores"]) == ("hierarchical", node_stores)
        assert_fp8_calls_are_the_reference(cfg, runs, SEED, False, f"fp8, 2 x 2 nodes, node_stores={node_stores}",
                                           node_size=2)
        routings = [call_inputs(cfg, c, SEED)[1] for c in range(len(runs[0]["calls"]))]
        assert_traffic_is_the_model(cfg, runs, routings, 2, node_stores)


def planted_pe(session, cfg: EPConfig) -> dict:
    """With the routing check off: a call with planted ids, reset(), a clean call (2 x 2)."""
    from ep_runtime.core.runtime import EPRuntime

    session.use_logical_nodes(2)
    with EPRuntime(cfg, session, debug=False) as rt:
        res = {"planted": round_trip_with_error(session, rt, cfg, *planted_inputs(cfg, SEED), "compact")}
        rt.reset()
        res["clean"] = round_trip_with_error(session, rt, cfg, *make_inputs(cfg, "random", SEED + 1), "expanded")
    return res


def test_planted_ids_are_dropped_named_and_reset_with_the_check_off():
    cfg = hier_cfg(4)
    runs = run_pes(planted_pe, 4, args=(cfg,), timeout_s=RUN_TIMEOUT_S)
    for key, inputs, layout in (("planted", planted_inputs(cfg, SEED), "compact"),
                                ("clean", make_inputs(cfg, "random", SEED + 1), "expanded")):
        xs, ids, ws = inputs
        refs = reference.dispatch(xs, ids, ws, cfg)
        outs = reference.combine([expert_outputs(cfg, refs[s], s) for s in range(4)], refs, ids, cfg, node_size=2)
        for r, res in enumerate(runs):
            got = res[key]
            assert_batch_is_the_reference(got, refs[r], layout, xs, cfg, f"{key}: rank {r}")
            np.testing.assert_array_equal(got["out"], outs[r].view(np.uint16), err_msg=f"{key}: rank {r}: combine")
    named = {rank % 4: (t, k) for rank, t, k, _ in PLANTED}
    for r, res in enumerate(runs):
        err = res["planted"]["error"]
        if r in named:
            assert err and f"rank {r}: topk_ids[{named[r][0]}, {named[r][1]}]" in err, err
        else:
            assert err is None, err
        assert res["clean"]["error"] is None, res["clean"]["error"]


def soak_pe(session, cfg: EPConfig) -> dict:
    """:data:`SOAK_CALLS` round trips alternating two inputs and the two layouts (2 x 2): each
    call's outputs, then the refusals (after a dispatch, before its combine)."""
    from ep_runtime.core.runtime import EPRuntime

    session.use_logical_nodes(2)
    r, dev = session.rank, session.to_device
    inputs = [make_inputs(cfg, scenario, SEED + 7) for scenario in ("random", "masked")]
    refs = [reference.dispatch(xs, ids, ws, cfg) for xs, ids, ws in inputs]
    outs = []
    with EPRuntime(cfg, session, debug=False) as rt:
        for call in range(SOAK_CALLS):
            (xs, ids, ws), ref = inputs[call % 2], refs[call % 2]
            layout = ("expanded", "compact")[(call // 2) % 2]
            batch = rt.dispatch(xs[r].view(np.uint16), ids[r], ws[r], layout=layout)
            x = session.to_host(batch.x).copy()
            y = dev(expert_outputs(cfg, ref[r], r))
            outs.append((layout, x, session.to_host(rt.combine(y, batch.handle)).copy()[:len(xs[r])]))
        xs, ids, ws = inputs[0]
        batch = rt.dispatch(xs[r].view(np.uint16), ids[r], ws[r])
        handle = rt.combine_async(dev(expert_outputs(cfg, refs[0][r], r)), batch.handle)
        refused = {"reduce": input_error_of(lambda: rt.combine_wait(handle, reduce=False))}
        rt.combine_wait(handle)
    return {"outs": outs, "refused": refused}


def test_a_100_call_soak_is_bit_identical_and_what_the_transport_does_not_carry_is_refused():
    cfg = hier_cfg(4, top_k=4, hidden=8, max_tokens_per_rank=6, n_sms=1)  # the protocol across calls, not size
    runs = run_pes(soak_pe, 4, args=(cfg,), timeout_s=RUN_TIMEOUT_S)
    inputs = [make_inputs(cfg, scenario, SEED + 7) for scenario in ("random", "masked")]
    for i, (xs, ids, ws) in enumerate(inputs):
        refs = reference.dispatch(xs, ids, ws, cfg)
        outs = reference.combine([expert_outputs(cfg, refs[s], s) for s in range(4)], refs, ids, cfg, node_size=2)
        for r, res in enumerate(runs):
            layout, x, out = res["outs"][i]
            assert layout == "expanded"
            np.testing.assert_array_equal(x[:refs[r].n_rows], refs[r].x.view(np.uint16), err_msg=f"rank {r}")
            np.testing.assert_array_equal(out, outs[r].view(np.uint16), err_msg=f"rank {r} input {i}: combine")
    for r, res in enumerate(runs):
        first = {}
        for call, (layout, x, out) in enumerate(res["outs"]):
            key = (call % 2, layout)
            if key not in first:
                first[key] = (x, out)
                continue
            assert np.array_equal(x, first[key][0]) and np.array_equal(out, first[key][1]), \
                f"rank {r} call {call} ({layout}) differs from the first call of the same inputs"
        for call, text in res["refused"].items():
            assert text and "hierarchical" in text and ("transport=puts" in text), f"rank {r} {call}: {text}"


def withheld_pe(session, cfg: EPConfig) -> dict:
    """One round trip on all four PEs (2 x 2), then node 1 withholds its second call: node 0's
    dispatch raises what its proxy's relay recorded (``testing.silent_peer_pe``)."""
    session.use_logical_nodes(2)
    return silent_peer_pe(session, {}, cfg, SEED, callers=(0, 1))


def test_a_node_that_withholds_its_call_is_named_by_the_proxies_of_the_other():
    cfg = hier_cfg(4, wait_timeout_s=3.0)
    runs = run_pes(withheld_pe, 4, args=(cfg,), timeout_s=RUN_TIMEOUT_S)
    assert_node_0_names_its_proxies(runs, lambda r: (f"rank {r}: dispatch_relay of call 1 timed out",
                                                     f"waiting for rank {r + 2}: relay_signal[1][{r + 2}]"))


def assert_node_0_names_its_proxies(runs: list, wanted) -> None:
    """Node 0's ranks (0, 1) raised an error holding each text of ``wanted(r)`` (their proxy
    on node 1 is rank r + 2); node 1's ranks raised none."""
    for r in (0, 1):
        err = runs[r]["error"]
        assert err and all(text in err for text in wanted(r)), err
    assert runs[2]["error"] is None and runs[3]["error"] is None


def withheld_combine_pe(session, cfg: EPConfig) -> dict:
    """2 x 2 nodes, one round trip: every rank dispatches, only node 0's ranks combine. Their
    combine_wait waits for the sums of their proxy on node 1, whose combine_relay never ran:
    ``{"error": message}`` of the EPTimeoutError (None on node 1's ranks)."""
    from ep_runtime.core.errors import EPTimeoutError
    from ep_runtime.core.runtime import EPRuntime

    session.use_logical_nodes(2)
    r = session.rank
    xs, ids, ws = make_inputs(cfg, "random", SEED)
    res = {"error": None}
    with EPRuntime(cfg, session) as rt:
        batch = rt.dispatch(xs[r].view(np.uint16), ids[r], ws[r])
        if r < 2:
            try:
                rt.combine(expert_outputs(cfg, reference.dispatch(xs, ids, ws, cfg)[r], r), batch.handle)
            except EPTimeoutError as exc:
                res["error"] = str(exc)
        session.barrier()
    return res


def test_a_node_that_withholds_its_combine_is_named_by_the_homes_of_the_other_with_a_token():
    cfg = hier_cfg(4, wait_timeout_s=3.0)
    runs = run_pes(withheld_combine_pe, 4, args=(cfg,), timeout_s=RUN_TIMEOUT_S)
    assert_node_0_names_its_proxies(runs, lambda r: (f"rank {r}: combine_wait of call 0 timed out",
                                                     f"waiting for rank {r + 2}: combine_chunk_flag[{r + 2}, token "))


def test_the_plan_takes_the_hierarchical_transport_across_regular_nodes_only_and_stores_within_mapped_ones():
    cfg = hier_cfg(4, max_tokens_per_rank=4096)
    regular = Topology(4, False, 132, True, False, (0, 0, 1, 1))
    assert regular.node_size == 2
    plan = choose_plan(cfg, regular)
    assert (plan.transport, plan.receiver, plan.node_size) == (Transport.HIERARCHICAL, Receiver.WAIT, 2), plan
    assert "transport: the PEs are on 2 nodes of 2" in "\n".join(plan.reasons)
    interleaved = Topology(4, False, 132, True, False, (0, 1, 0, 1))
    assert interleaved.node_size == 0 and choose_plan(cfg, interleaved).transport is Transport.PUTS
    assert choose_plan(cfg, regular, {"transport": "puts"}).node_size == 0
    one_node = Topology(4, True, 132, True, False, (0, 0, 0, 0))
    with pytest.raises(EPConfigError, match="transport=hierarchical needs PEs on 2 or more nodes"):
        choose_plan(cfg, one_node, {"transport": "hierarchical"})
    with pytest.raises(EPConfigError, match="receiver=land with transport=hierarchical"):
        choose_plan(cfg, regular, {"receiver": "land"})
    # within a node: stores where every PE maps its node's heaps, else puts; an override can put
    assert plan.node_stores is False and "node_stores: some PE of a node does not map" in "\n".join(plan.reasons)
    mapped = Topology(4, False, 132, True, False, (0, 0, 1, 1), node_peers_mapped=True)
    stores = choose_plan(cfg, mapped)
    assert stores.node_stores is True and "(2 PEs a node, stores within)" in stores.describe(), stores.describe()
    assert stores.dispatch_variant(cfg).node_stores and stores.combine_variant(cfg).node_stores
    assert not choose_plan(cfg, mapped, {"node_stores": 0}).dispatch_variant(cfg).node_stores
    assert choose_plan(cfg, mapped, {"transport": "puts"}).node_stores is False
    with pytest.raises(EPConfigError, match="node_stores=1 needs the hierarchical transport .* mapping its node's "
                                            "heaps .*: no"):
        choose_plan(cfg, regular, {"node_stores": 1})
    with pytest.raises(EPConfigError, match=r"node_stores=1 needs the hierarchical transport \(this plan's: puts\)"):
        choose_plan(cfg, mapped, {"transport": "puts", "node_stores": 1})


def test_the_bench_table_shows_each_rank_s_bytes_between_and_within_nodes():
    from ep_runtime.tools.bench.measure import SPANS
    from ep_runtime.tools.bench.run import _result, table
    from ep_runtime.tools.bench.traffic import node_traffic, rank_traffic

    cfg = hier_cfg(4)
    _, ids, _ = make_inputs(cfg, "random", SEED)
    spans = {k: [1.0, 2.0, 3.0] for k in SPANS}
    ceil = {"nvlink_gbps": 100.0, "hbm_gbps": 1000.0}
    res = _result(cfg, rank_traffic(ids, 1, cfg.n_local_experts, cfg.hidden), spans, {}, ceil,
                  plan={"receiver": "wait", "node_size": 2})
    n = node_traffic(ids, 1, cfg.n_local_experts, 2, cfg.token_bytes, cfg.partial_bytes)
    res["node_traffic"] = {"node_size": 2, **n.__dict__}
    text = table([[], [res]])
    assert "hierarchical transport, one call" in text
    assert (f"across {n.across_out / 1e6:>8.3f} out {n.across_in / 1e6:>8.3f} in | within "
            f"{n.within_out / 1e6:>8.3f} out {n.within_in / 1e6:>8.3f} in | {n.ops_across} ops") in text
    # what one rank sends equals what the others receive from it, PE to PE
    per = [node_traffic(ids, r, cfg.n_local_experts, 2, cfg.token_bytes, cfg.partial_bytes) for r in range(4)]
    assert sum(p.across_out for p in per) == sum(p.across_in for p in per) > 0
    assert sum(p.within_out for p in per) == sum(p.within_in for p in per) > 0


def test_a_chunk_holds_8_tokens_below_2048_then_16_below_4096_then_32_by_one_rule_for_kernels_and_model():
    from ep_runtime.kernels import nodes
    from ep_runtime.kernels.protocol import relay_chunk_tokens

    # the kernels compile the function the traffic model calls (a copy could drift from it)
    assert getattr(nodes.chunk_tokens, "py_func", nodes.chunk_tokens) is relay_chunk_tokens
    sizes = [relay_chunk_tokens(T) for T in range(10000)]
    assert sizes[:2048] == [8] * 2048 and sizes[2048:4096] == [16] * 2048 and set(sizes[4096:]) == {32}


def test_the_projection_for_a_cluster_prints_the_table_of_the_docs(capsys):
    from pathlib import Path

    from ep_runtime.tools.bench.traffic import main

    main([])
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("| nodes x GPUs | tokens/GPU | MB across out / in (NIC)") and len(out) == 6
    cells = [c.strip() for c in out[2].split("|")[1:-1]]
    assert cells[:2] == ["2x8", "128"] and float(cells[2].split(" / ")[0]) > 0 and int(cells[4]) > 0
    docs = (Path(__file__).resolve().parents[1] / "docs" / "cluster.md").read_text().splitlines()
    assert [line for line in out if line not in docs] == [], "docs/cluster.md's projection table is stale"
