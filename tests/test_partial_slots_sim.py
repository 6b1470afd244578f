"""Partials by destination slot (issue #66 step 4, docs/wide_ep.md): a list build on the stores
and puts transports keeps a token's partials on its home in ``combine_partials [G, S, T, H]``
and their flags in ``combine_row_flag [S, T, parts]``, ``S = min(top_k, n_ranks)``: rank d's
partial in slot j, d's position among the token's ascending destination ranks
(``destinations.rank_position`` on the sender, the home's own list on the home).

The layout sizes the regions by the plan (slots for those list builds; a row a rank for the mask
builds and the weights at home; the hierarchical transport's list builds keep them by sender:
tests/test_sender_rows_sim.py). Through the real kernels on the
simulator, the list forced at 4 and 8 ranks: each layout's combine (expanded, compact, dense),
``reduce=False``'s per-rank partials, bf16 and float32 partials, on random routing, a rank
without tokens, masked (-1) slots, every token to one expert and top-k 1, each call twice, bit for
bit the reference's. The default run keeps one case (stores, 4 ranks); ``pytest -m wide`` runs
the rest.
"""

from __future__ import annotations

import numpy as np
import pytest

from ep_runtime.core import reference
from ep_runtime.core.config import EPConfig
from ep_runtime.core.layout import BufferLayout
from ep_runtime.core.plan import Topology, choose_plan
from ep_runtime.kernels import destinations
from ep_runtime.shmem.launch import run_pes
from ep_runtime.testing import BF16, expert_outputs, make_inputs

RUN_TIMEOUT_S = 300
SEED = 6604
#: the routings each case runs, each call twice
SCENARIOS = ("random", "zero_rank", "masked", "one_expert")
LAYOUTS = ("expanded", "compact", "dense")


def cfg_of(R: int, **changes) -> EPConfig:
    """Two experts a rank, top-2, hidden 64, 5 tokens a rank, every layout whose combine sends
    partials (the batched layout's is the expanded one's)."""
    return EPConfig(**{**dict(n_ranks=R, n_experts=2 * R, top_k=2, hidden=64, max_tokens_per_rank=5,
                              layouts=LAYOUTS, wait_timeout_s=60.0), **changes})


def py(device_function):
    """A device function's Python source (callable on the host)."""
    return getattr(device_function, "py_func", device_function)


# -- the layout -----------------------------------------------------------------------------------
def plan_of(cfg: EPConfig, overrides: dict, node_of=None):
    if node_of is None:
        return choose_plan(cfg, Topology(cfg.n_ranks, True, 2, pdl=False, simulated=True), overrides)
    topology = Topology(cfg.n_ranks, False, 2, pdl=False, simulated=True, node_of=node_of, node_peers_mapped=True)
    return choose_plan(cfg, topology, overrides)


def partial_shapes(cfg: EPConfig, plan) -> tuple:
    layout = BufferLayout(cfg, plan)
    return layout.region("combine_partials").shape, layout.region("combine_row_flag").shape


def test_list_builds_on_stores_and_puts_size_the_partials_by_slot_the_others_by_rank():
    G, T, H, F = 2, 5, 64, 16  # buffer groups, tokens, hidden, flag parts
    for R, K in ((8, 2), (4, 4), (8, 1)):
        cfg = cfg_of(R, top_k=K)
        S = min(R, K)
        for transport in ("stores", "puts"):
            plan = plan_of(cfg, {"dest_list": True, "transport": transport})
            assert plan.combine_variant(cfg).partial_slots == S, (R, K, transport)
            assert partial_shapes(cfg, plan) == ((G, S, T, H), (S, T, F)), (R, K, transport)
            mask = plan_of(cfg, {"transport": transport})
            assert not mask.dest_list and mask.combine_variant(cfg).partial_slots == 0
            assert partial_shapes(cfg, mask) == ((G, R, T, H), (R, T, F)), (R, K, transport)
        f32 = cfg_of(R, top_k=K, combine_dtype="float32")
        region = BufferLayout(f32, plan_of(f32, {"dest_list": True})).region("combine_partials")
        assert (region.shape, region.dtype) == ((G, S, T, H), np.float32), region
    cfg = cfg_of(8)
    hier = plan_of(cfg, {}, node_of=tuple(p // 4 for p in range(8)))
    assert hier.transport.value == "hierarchical" and hier.combine_variant(cfg).partial_slots == 0
    assert partial_shapes(cfg, hier) == ((G, 8, T, H), (8, T, F))  # its list builds: tests/test_sender_rows_sim.py
    home = cfg_of(8, layouts=("batched",), combine_weights="home")
    plan = plan_of(home, {"dest_list": True})
    assert plan.combine_variant(home).partial_slots == 0 and partial_shapes(home, plan) == ((G, 2, T, H), (2, T, F))
    assert partial_shapes(cfg, None) == ((G, 8, T, H), (8, T, F))  # no plan: the most any plan takes


def test_a_senders_slot_is_its_place_in_the_homes_list(monkeypatch):
    """``rank_position`` (its Python source on the host, ``udiv32``, a GPU intrinsic, as the
    simulator's) against the home's list, the ascending distinct ranks of the ids in ``[0, R L)``
    (``holders_of``'s, built here in NumPy), past 64 ranks."""
    monkeypatch.setattr(destinations, "udiv32", lambda a, b: (int(a) & 0xFFFFFFFF) // (int(b) & 0xFFFFFFFF))
    rng = np.random.default_rng(SEED)
    R, L, K = 1024, 2, 8
    for _ in range(300):
        ids = rng.integers(-1, R * L + 3, K).astype(np.int32)  # -1 and past the experts: no rank
        ids[rng.integers(1, K)] = ids[0] ^ 1  # the other expert of ids[0]'s rank (L = 2): a rank twice
        listed = sorted({int(x) // L for x in ids if 0 <= x < R * L})
        for j, d in enumerate(listed):
            assert py(destinations.rank_position)(ids, L, d) == j, (ids, listed, d)


# -- round trips through the kernels ----------------------------------------------------------------
def partial_dtype(cfg: EPConfig):
    return np.float32 if cfg.combine_dtype == "float32" else BF16


def compact_rows(cfg: EPConfig, xs, ids, rank: int) -> np.ndarray:
    """The compact combine input of ``rank``: [R T, H] in the partial dtype, row ``s T + t`` =
    ``x_s[t] (rank + 2) / 3`` where token (s, t) came here, 0 elsewhere (never read)."""
    x, defined = reference.receive_rows(xs, ids, cfg)[rank]
    rows = x.astype(np.float32) * np.float32(rank + 2) / np.float32(3)
    rows[~defined] = 0
    return rows.astype(partial_dtype(cfg))


def dense_rows(cfg: EPConfig, ref: reference.DenseRowsRef, rank: int) -> np.ndarray:
    """The dense combine input of ``rank``: [rows, H] in the partial dtype, row i = ``(rank + 1) +
    slot[i] / 16 + col / 256 + 1 / 3``: each value names the rank and the (source, token)."""
    cols = np.arange(cfg.hidden, dtype=np.float32) / 256
    rows = np.float32(rank + 1) + ref.slot.astype(np.float32)[:, None] / 16 + cols[None, :] + np.float32(1 / 3)
    return rows.astype(partial_dtype(cfg))


def bits(a) -> np.ndarray:
    a = np.asarray(a)
    return a.view(np.uint32) if a.dtype == np.float32 else a.view(np.uint16)


def round_trips(session, rt, cfg: EPConfig, xs, ids, ws, partials: bool = True) -> dict:
    """This rank's combine outputs of one routing in each layout, and (``partials``)
    ``reduce=False``'s per-rank partials (expanded), as host bits."""
    r = session.rank
    out = {}
    batch = rt.dispatch(xs[r].view(np.uint16), ids[r], ws[r])
    y = expert_outputs(cfg, reference.dispatch(xs, ids, ws, cfg)[r], r)
    out["expanded"] = bits(session.to_host(rt.combine(y, batch.handle)).copy())
    if partials:
        batch = rt.dispatch(xs[r].view(np.uint16), ids[r], ws[r])
        out["partials"] = bits(session.to_host(rt.combine(y, batch.handle, reduce=False)).copy())
    batch = rt.dispatch(xs[r].view(np.uint16), ids[r], ws[r], layout="compact")
    rows = compact_rows(cfg, xs, ids, r)
    out["compact"] = bits(session.to_host(rt.combine(rows, batch.handle, layout="compact")).copy())
    batch = rt.dispatch(xs[r].view(np.uint16), ids[r], ws[r], layout="dense")
    rows = dense_rows(cfg, reference.dense(xs, ids, ws, cfg)[r], r)
    out["dense"] = bits(session.to_host(rt.combine(rows, batch.handle, layout="dense")).copy())
    return out


def slots_pe(session, plan: dict, cfg: EPConfig, scenarios=SCENARIOS) -> dict:
    """Each routing of ``scenarios`` (of :data:`SCENARIOS`) twice on one runtime under plan
    overrides ``plan``."""
    from ep_runtime.core.runtime import EPRuntime

    with EPRuntime(cfg, session, plan=plan) as rt:
        runs = {}
        for scenario in scenarios:
            xs, ids, ws = make_inputs(cfg, scenario, SEED + SCENARIOS.index(scenario))
            runs[scenario] = [round_trips(session, rt, cfg, xs, ids, ws) for _ in range(2)]
        return {"runs": runs, "plan": rt.plan.as_dict(),
                "shape": rt.layout.region("combine_partials").shape}


def want_of(cfg: EPConfig, scenario: str, i: int, node_size: int = 0) -> dict:
    """Every rank's reference outputs of :func:`round_trips` (``node_size``: the hierarchical
    transport's node sums, and no ``reduce=False`` partials, which it refuses)."""
    xs, ids, ws = make_inputs(cfg, scenario, SEED + i)
    refs = reference.dispatch(xs, ids, ws, cfg)
    R, N = cfg.n_ranks, node_size
    ys = [expert_outputs(cfg, refs[s], s) for s in range(R)]
    dense = reference.dense(xs, ids, ws, cfg)
    want = {"expanded": reference.combine(ys, refs, ids, cfg, node_size=N),
            "compact": reference.combine_rows([compact_rows(cfg, xs, ids, r) for r in range(R)], ids, cfg, N),
            "dense": reference.combine_dense([dense_rows(cfg, dense[r], r) for r in range(R)], dense, ids, cfg, N)}
    if not N:
        want["partials"] = reference.combine(ys, refs, ids, cfg, reduce=False)
    return want


def assert_layouts_are_the_reference(cfg: EPConfig, res: list, what: str, node_size: int = 0) -> None:
    """Every rank's :func:`round_trips` of each routing it ran (``res[r]["runs"][scenario]``, two
    calls) bit for bit :func:`want_of`'s, the second call the first's bits."""
    for scenario in res[0]["runs"]:
        want = want_of(cfg, scenario, SCENARIOS.index(scenario), node_size)
        for r in range(cfg.n_ranks):
            first, again = res[r]["runs"][scenario]
            for layout, got in first.items():
                at = f"{what}, {scenario}, rank {r}, {layout}"
                np.testing.assert_array_equal(got, bits(want[layout][r]), err_msg=at)
                np.testing.assert_array_equal(again[layout], got, err_msg=f"{at}: the call again")


#: (transport, ranks, config changes); the default run keeps the first (CI's time)
ALL_RUNS = [("stores", 4, {}), ("puts", 4, {}), ("stores", 8, {"combine_dtype": "float32"}),
            ("puts", 8, {"top_k": 1}), ("puts", 4, {"top_k": 3, "combine_dtype": "float32"}),
            ("stores", 4, {"top_k": 4, "n_experts": 16})]
RUNS = ALL_RUNS[:1] + [pytest.param(*run, marks=pytest.mark.wide) for run in ALL_RUNS[1:]]


@pytest.mark.parametrize("transport, R, changes", RUNS,
                         ids=[f"{t}-R{R}" + "".join(f"-{k}={x}" for k, x in c.items()) for t, R, c in ALL_RUNS])
def test_partials_by_slot_combine_bit_for_bit_as_the_reference(transport, R, changes):
    cfg = cfg_of(R, **changes)
    res = run_pes(slots_pe, R, args=({"dest_list": True, "transport": transport}, cfg), timeout_s=RUN_TIMEOUT_S)
    S = min(cfg.top_k, R)
    assert all(r["plan"]["dest_list"] and r["plan"]["transport"] == transport for r in res), res[0]["plan"]
    assert all(tuple(r["shape"])[:2] == (2, S) for r in res), res[0]["shape"]
    assert_layouts_are_the_reference(cfg, res, f"{transport} at {R} ranks, {changes}")


@pytest.mark.wide
def test_compact_and_dense_past_64_ranks_are_the_reference():
    """72 ranks on stores (the plan's destination lists; the receivers' per-source shared arrays
    past 64 words): the expanded, compact and dense combines and ``reduce=False``, masked slots, a
    call twice, bit for bit the reference's (about two minutes on 2 cores)."""
    cfg = cfg_of(72, hidden=8, max_tokens_per_rank=2, top_k=4, wait_timeout_s=600.0)
    res = run_pes(slots_pe, 72, args=({}, cfg, ("masked",)), timeout_s=900,
                  heap_bytes=BufferLayout(cfg).symmetric_bytes)
    assert all(r["plan"]["dest_list"] and r["plan"]["transport"] == "stores" for r in res), res[0]["plan"]
    assert_layouts_are_the_reference(cfg, res, "72 ranks on stores")
