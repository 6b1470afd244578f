"""Destination lists (issue #66, docs/wide_ep.md) with quantized tokens: the FP8 (E4M3 with
float32 or UE8M0 scales) and NVFP4 codecs' senders over a token's destination list
(ep_runtime/kernels/destinations.py), the build every runtime past 64 ranks takes.

The list variant forced (the plan's ``dest_list``) at 4 and 8 ranks on the stores transport
(messages encoded straight into the peers' slots), the puts transport (encoded into a stage, then
put) and 2 x 2 logical nodes (the hierarchical transport: messages packed into chunks), each
format with bf16 tokens quantized in dispatch_async and with pre-quantized codes and scales, over
the calls of ``testing.FP8_CALLS`` (random routing, a rank without tokens, masked (-1) slots; the
expanded and compact layouts, row- and column-major scales): codes, scales, global scales and
combine bit for bit the reference's (``testing.assert_fp8_calls_are_the_reference``). One FP8
round trip at 72 ranks (flat puts, where the plan takes the list itself). The default run keeps
one case (FP8 E4M3 on the stores at 4 ranks); ``pytest -m wide`` runs every case, for CI's time.
"""

from __future__ import annotations

import numpy as np
import pytest

from ep_runtime.core.config import EPConfig
from ep_runtime.shmem.launch import run_pes
from ep_runtime.testing import (BATCH_FIELDS, assert_fp8_calls_are_the_reference, call_inputs, expert_outputs,
                                fp8_plan_pe)

RUN_TIMEOUT_S = 300
SEED = 661

#: name -> (logical nodes, plan overrides besides the forced list)
TRANSPORTS = {
    "stores": (1, {}),
    "puts": (1, {"transport": "puts"}),
    "nodes": (2, {}),  # 2 x 2: stores within a node, the messages packed into chunks across
    "nodes-puts": (2, {"node_stores": False}),
}
FORMATS = ("fp8_e4m3", "fp8_e4m3_ue8m0", "nvfp4")


def cfg_of(R: int, token_dtype: str) -> EPConfig:
    """Two experts a rank, top-2, hidden 256 (2 FP8 blocks, 16 NVFP4 blocks), 6 tokens a rank."""
    return EPConfig(n_ranks=R, n_experts=2 * R, top_k=2, hidden=256, max_tokens_per_rank=6, token_dtype=token_dtype,
                    wait_timeout_s=60.0)


def formats_pe(session, n_nodes: int, plan: dict, cases: tuple) -> list:
    """As ``n_nodes`` logical nodes (1: one node), :func:`fp8_plan_pe` of each ``(cfg,
    prequantized)`` of ``cases`` under the plan overrides ``plan``."""
    if n_nodes > 1:
        session.use_logical_nodes(n_nodes)
    return [fp8_plan_pe(session, plan, cfg, SEED, prequantized=pre) for cfg, pre in cases]


#: (transport, ranks, formats): every format with bf16 and with pre-quantized input
ALL_RUNS = [("stores", 4, FORMATS[:1]), ("stores", 4, FORMATS[1:]), ("puts", 4, FORMATS), ("nodes", 4, FORMATS),
            ("nodes-puts", 4, FORMATS), ("stores", 8, FORMATS), ("puts", 8, FORMATS)]
RUNS = ALL_RUNS[:1] + [pytest.param(*run, marks=pytest.mark.wide) for run in ALL_RUNS[1:]]


@pytest.mark.parametrize("transport, R, formats", RUNS,
                         ids=[f"{t}-R{R}-" + "-".join(f) for t, R, f in ALL_RUNS])
def test_quantized_tokens_over_destination_lists_are_the_reference_bit_for_bit(transport, R, formats):
    n_nodes, plan = TRANSPORTS[transport]
    cases = tuple((cfg_of(R, fmt), pre) for fmt in formats for pre in (False, True))
    pes = run_pes(formats_pe, R, args=(n_nodes, {"dest_list": True, **plan}, cases), timeout_s=RUN_TIMEOUT_S)
    for i, (cfg, pre) in enumerate(cases):
        runs = [pe[i] for pe in pes]
        p = runs[0]["plan"]
        assert p["dest_list"] and (p["transport"] == "hierarchical") == (n_nodes > 1), p
        assert_fp8_calls_are_the_reference(cfg, runs, SEED, pre, f"{cfg.token_dtype} on {transport} at {R} ranks, "
                                           f"destination lists, prequantized={pre}",
                                           node_size=R // n_nodes if n_nodes > 1 else 0)


def wide_fp8_pe(session, cfg: EPConfig, seed: int) -> dict:
    """One round trip of call 0's inputs (``testing.call_inputs``) on flat puts, the expanded
    layout with row-major scales, combining the expert outputs of the batch this rank received
    (no PE computes every rank's reference batches): what ``assert_fp8_calls_are_the_reference``
    takes."""
    from ep_runtime.core import reference
    from ep_runtime.core.runtime import EPRuntime

    r = session.rank
    xs, ids, ws = call_inputs(cfg, 0, seed)
    with EPRuntime(cfg, session, plan={"transport": "puts"}) as rt:
        dev = [session.to_device(np.ascontiguousarray(a)) for a in (xs[r].view(np.uint16), ids[r], ws[r])]
        batch = rt.dispatch_wait(rt.dispatch_async(*dev), layout="expanded", scales="row")
        got = {k: session.to_host(getattr(batch, k)).copy() for k in BATCH_FIELDS + ("scales",)}
        n = int(got["row_offsets"][-1])
        received = reference.ExpertBatchRef(row_offsets=got["row_offsets"], expert_counts=got["expert_counts"],
                                            **{k: got[k][:n] for k in ("x", "src_rank", "src_token", "src_k",
                                                                       "weight", "scales")})
        y = session.to_device(expert_outputs(cfg, received, r))
        got["out"] = session.to_host(rt.combine(y, batch.handle)).copy()
        got["layout"], got["scale_layout"] = "expanded", "row"
        return {"calls": [got], "plan": rt.plan.as_dict()}


@pytest.mark.wide
def test_a_72_rank_fp8_round_trip_on_flat_puts_is_the_reference():
    """One expert a rank, top-2, hidden 128 (one block), 2 tokens a rank: the smallest FP8 round
    trip past 64 ranks; waits bounded by ten minutes on a loaded machine."""
    cfg = EPConfig(n_ranks=72, n_experts=72, top_k=2, hidden=128, max_tokens_per_rank=2, token_dtype="fp8_e4m3",
                   wait_timeout_s=600.0)
    runs = run_pes(wide_fp8_pe, 72, args=(cfg, SEED), timeout_s=1800)
    assert all(r["plan"]["dest_list"] and r["plan"]["transport"] == "puts" for r in runs), runs[0]["plan"]
    assert_fp8_calls_are_the_reference(cfg, runs, SEED, False, "fp8_e4m3, 72 ranks, flat puts, destination lists")
