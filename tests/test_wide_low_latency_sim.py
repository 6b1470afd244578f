"""DeepEP's low-latency shape past 64 ranks (#66): the batched layout with the router weights
applied at home (``EPConfig(layouts="batched", combine_weights="home")``, what the deep_ep layer's
``low_latency_dispatch`` / ``low_latency_combine`` run; decode on an NVL72 domain is 72 ranks on
one flat transport). Past 64 ranks the plan takes destination lists on a flat transport, stores
where every PE is mapped, else puts (the hierarchical one refuses the weights at home by a plan
rule); the combine sends each (token, slot) row home by its top-k slot, which no rank count bounds.

On the simulator (the real kernel source, one process a rank), bit for bit the reference's: each
rank's batched counts, and each home's output against
:func:`~ep_runtime.core.reference_batched.combine_batched_home`, twice on one runtime (the second
call the first's bits), bf16 and FP8 rows, on one node and on logical nodes (where the plan puts
to every peer). The default run forces the lists at 4 ranks (one node, stores; 2 x 2 nodes, puts);
``pytest -m wide`` runs 72 ranks (15 to 30 s each on 2 cores).
"""

from __future__ import annotations

import numpy as np
import pytest

from ep_runtime.core.config import EPConfig
from ep_runtime.core.layout import BufferLayout
from ep_runtime.core.reference import BF16, routed_ids
from ep_runtime.core.reference_batched import batched, combine_batched_home
from ep_runtime.shmem.launch import run_pes
from ep_runtime.testing import make_inputs

RUN_TIMEOUT_S = 900
SEED = 72


def ll_cfg(R: int, **changes) -> EPConfig:
    """Two experts a rank, top-4 (a token on up to four ranks), two tokens a rank, hidden 8."""
    return EPConfig(**{**dict(n_ranks=R, n_experts=2 * R, top_k=4, hidden=8, max_tokens_per_rank=2,
                              layouts="batched", combine_weights="home", wait_timeout_s=600.0), **changes})


def slot_outputs(cfg: EPConfig, counts: np.ndarray, rank: int) -> np.ndarray:
    """Rank ``rank``'s expert outputs [L, M, H] bf16 bits: slot (e, pos) below its count holds
    bf16((rank + 1) / 64 + e / 8 + pos / 256 + col / 1024); the slots past the count hold NaN
    (a slot read past its count makes the output NaN)."""
    L, M, H = cfg.n_local_experts, cfg.n_ranks * cfg.max_tokens_per_rank, cfg.hidden
    e, pos, col = np.meshgrid(np.arange(L), np.arange(M), np.arange(H), indexing="ij")
    y = (np.float32(rank + 1) / 64 + e / 8 + pos / 256 + col / 1024).astype(np.float32).astype(BF16).view(np.uint16)
    return np.where(pos < counts[:, None, None], y, np.uint16(0x7FC0))


def home_weights(cfg: EPConfig, topk_ids: np.ndarray, rank: int) -> np.ndarray:
    """Rank ``rank``'s combine weights [T, K] float32, one per token and slot; NaN at a masked
    slot (never read)."""
    T, K = topk_ids.shape
    t, k = np.meshgrid(np.arange(T), np.arange(K), indexing="ij")
    w = (0.5 + k / 4 + t / 16 + rank / 128).astype(np.float32)
    return np.where(routed_ids(topk_ids, cfg.n_experts) >= 0, w, np.float32(np.nan)).astype(np.float32)


def low_latency_pe(session, cfg: EPConfig, plan: dict, scenario: str, n_nodes: int) -> dict:
    """Two low-latency round trips of one routing on one runtime, as ``n_nodes`` logical nodes:
    each call's batched counts and combined output, and the plan."""
    from ep_runtime.core.runtime import EPRuntime

    r = session.rank
    if n_nodes > 1:
        session.use_logical_nodes(n_nodes)
    xs, ids, ws = make_inputs(cfg, scenario, SEED)
    calls = []
    with EPRuntime(cfg, session, plan=plan) as rt:
        for _ in range(2):
            batch = rt.dispatch(xs[r].view(np.uint16), ids[r], ws[r], layout="batched", scales="column")
            counts = session.to_host(batch.counts).copy()
            y = slot_outputs(cfg, counts, r)
            out = rt.combine(y, batch.handle, layout="batched", weights=home_weights(cfg, ids[r], r))
            calls.append((counts, session.to_host(out).copy()[:len(xs[r])]))
        return {"calls": calls, "plan": rt.plan.as_dict(),
                "partials": rt.layout.region("combine_partials").shape}


def assert_low_latency_is_the_reference(cfg: EPConfig, scenario: str, runs: list, what: str) -> None:
    xs, ids, ws = make_inputs(cfg, scenario, SEED)
    refs = batched(xs, ids, ws, cfg)
    ys = [slot_outputs(cfg, ref.counts, r) for r, ref in enumerate(refs)]
    want = combine_batched_home(ys, refs, ids, [home_weights(cfg, ids[r], r) for r in range(cfg.n_ranks)], cfg)
    assert sum(int(ref.counts.sum()) for ref in refs) > 0, f"{what}: no rank received a row"
    for r, got in enumerate(runs):
        assert got["plan"]["dest_list"], f"{what}: rank {r} built without destination lists: {got['plan']}"
        # the weights at home keep their partials by top-k slot: [G, K, T, H], whatever the rank count
        assert got["partials"][1] == cfg.top_k, f"{what}: rank {r}: partials {got['partials']}"
        for call, (counts, out) in enumerate(got["calls"]):
            np.testing.assert_array_equal(counts, refs[r].counts, err_msg=f"{what}: rank {r} call {call}: counts")
            assert not np.isnan(out.view(BF16).astype(np.float32)).any(), f"{what}: rank {r} call {call}: NaN"
            np.testing.assert_array_equal(out, want[r].view(np.uint16), err_msg=f"{what}: rank {r} call {call}")


#: (ranks, logical nodes, config changes, plan overrides, scenario): 4 ranks with the lists forced
#: (one node, and 2 x 2 nodes, where the plan takes puts) by default; 72 ranks (the plan's lists:
#: stores on the simulator's one node, puts where asked or across 9 x 8 nodes) under ``wide``
CASES = [
    pytest.param(4, 1, {}, {"dest_list": True, "transport": "stores"}, "masked", id="4-stores-lists"),
    pytest.param(4, 2, {}, {"dest_list": True}, "random", id="2x2-puts-lists"),
    pytest.param(4, 1, {}, {"dest_list": True, "transport": "puts"}, "random", id="4-puts-lists",
                 marks=pytest.mark.wide),
    pytest.param(72, 1, {}, {}, "random", id="72-bf16-stores", marks=pytest.mark.wide),
    pytest.param(72, 1, {}, {"transport": "puts"}, "masked", id="72-bf16-puts", marks=pytest.mark.wide),
    pytest.param(72, 9, {"hidden": 128, "token_dtype": "fp8_e4m3"}, {}, "random", id="9x8-fp8-puts",
                 marks=pytest.mark.wide),
]


@pytest.mark.parametrize("R, n_nodes, changes, plan, scenario", CASES)
def test_low_latency_round_trip_over_destination_lists_is_the_reference(R, n_nodes, changes, plan, scenario):
    cfg = ll_cfg(R, **changes)
    runs = run_pes(low_latency_pe, R, args=(cfg, plan, scenario, n_nodes), timeout_s=RUN_TIMEOUT_S,
                   heap_bytes=BufferLayout(cfg).symmetric_bytes)
    # the simulator maps every PE of one node (stores unless asked); across nodes the plan puts
    want = plan.get("transport", "stores" if n_nodes == 1 else "puts")
    assert all(got["plan"]["transport"] == want for got in runs), runs[0]["plan"]
    what = f"{R} ranks on {n_nodes} nodes {changes} {plan} {scenario}"
    assert_low_latency_is_the_reference(cfg, scenario, runs, what)
