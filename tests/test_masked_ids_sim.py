"""Masked, out-of-range and repeated expert ids with the routing check off (``debug=False``, as
on GPUs), on the simulator: the real kernels, one process per rank, exact against the NumPy
reference (``reference.routed_ids`` states the rules).

- ``-1`` masks a slot: nothing is sent for it, its weight is ignored, a token whose slots are
  all masked combines to a zero row, and a rank may mask every token (the ``masked`` routing
  scenario; the plan-variant suites run it too, with the check on).
- An id outside ``[-1, n_experts)`` (planted: ``n_experts + 3`` and ``-7``) never reaches
  address arithmetic: the call completes on every rank as if the slot were masked, and the
  next ``synchronize()`` of the rank that passed it raises ``EPInputError`` naming the rank,
  the token, the slot and the id; after ``reset()`` on every rank the next call is exact.
- A repeated id in one token's row counts once, with its first slot's weight (no error with
  the check off; ``debug=True`` rejects it: tests/test_ep_sim.py).
"""

from __future__ import annotations

import numpy as np
import pytest

from ep_runtime.core import reference
from ep_runtime.core.config import EPConfig
from ep_runtime.shmem.launch import run_pes
from ep_runtime.testing import assert_batch_is_the_reference, expert_outputs, make_inputs, round_trip_with_error

RUN_TIMEOUT_S = 240
WORLD_SIZES = (2, 3)
SEED = 31
#: (rank, token, slot, id) planted in the routing: rank 0 an id past the last expert, the last
#: rank a negative one other than -1. {E}: n_experts.
PLANTED = ((0, 1, 0, "{E} + 3"), (-1, 2, 1, "-7"))
#: (ranks, plan) run: the simulator's default plan (``wait``), a plain route-first one and, at
#: R=2, a landing one and a chunked route-first one whose routing block sends the ids
#: (``routed_id``'s repeats).
RUN_PLANS = ([(R, None) for R in WORLD_SIZES] + [(R, "route_first") for R in WORLD_SIZES]
             + [(2, "land"), (2, "route_first_chunked")])
#: (rank, token, slot, earlier slot): a repeat of an earlier slot's id.
REPEATS = ((0, 3, 1, 0), (-1, 0, 1, 0))


def case_cfg(R: int, **changes) -> EPConfig:
    return EPConfig(**{**dict(n_ranks=R, n_experts=2 * R, top_k=2, hidden=32, max_tokens_per_rank=6,
                              wait_timeout_s=60.0), **changes})


def planted_inputs(cfg: EPConfig, seed: int, planted=PLANTED, repeats=()):
    """The ``masked`` routing of ``seed`` with every token present, then ``planted`` ids and
    ``repeats`` written in."""
    R = cfg.n_ranks
    xs, ids, ws = make_inputs(cfg, "masked", seed, n_tokens=[cfg.max_tokens_per_rank] * R)
    ids = [i.copy() for i in ids]
    for rank, t, k, value in planted:
        ids[rank % R][t, k] = eval(value.format(E=cfg.n_experts))  # noqa: S307 - the table's own expressions
    for rank, t, k, first in repeats:
        ids[rank % R][t, first] = rank % R  # an expert id, not -1
        ids[rank % R][t, k] = ids[rank % R][t, first]
    return xs, ids, ws


#: Plans besides the simulator's default (``wait``): a plain route-first sender sends repeats as
#: they are and its receivers mask them (``ranking.rank_round``); thresholds as the plan suite's.
#: The chunked one is never split (its routing block sends the routing, as ``routed_id`` reads it).
PLANS = {"route_first": {"receiver": "route_first", "share_from_tokens": 4, "chunk_from_tokens": 8,
                         "split_from_tokens": 4},
         "route_first_chunked": {"receiver": "route_first_chunked", "share_from_tokens": 4, "chunk_from_tokens": 2,
                                 "split_from_tokens": 64},
         "land": {"receiver": "land"}}
#: Config changes of a plan's runs: the ranking senders (``wait``, the default, and ``land``) on a
#: grid of 3 SMs, so two routing blocks rank a chunk of the tokens each, the second from a count of
#: the first chunk's (where the last rank's repeat at token 0 must count once).
PLAN_CFG = {None: {"n_sms": 3}, "land": {"n_sms": 3}}
#: Repeats past the ids a receiver loads together (``ranking.ID_BATCH`` = 8): top-k 10, slot 9
#: repeating slot 8 and slot 8 repeating slot 2 (rank, token, slot, earlier slot; applied in order).
WIDE_REPEATS = ((0, 1, 9, 8), (0, 4, 8, 2), (-1, 0, 9, 3), (-1, 0, 3, 1))


def ids_pe(session, cfg: EPConfig, seed: int, plan=None, repeats=REPEATS) -> dict:
    """Per layout: a call with planted ids, reset(), a clean call; then a call with repeated ids."""
    from ep_runtime.core.runtime import EPRuntime

    res = {}
    with EPRuntime(cfg, session, debug=False, plan=plan) as rt:
        for layout in ("expanded", "compact"):
            res["planted", layout] = round_trip_with_error(session, rt, cfg, *planted_inputs(cfg, seed), layout)
            rt.reset()  # collective: the ranks that raised, and the others
            xs, ids, ws = make_inputs(cfg, "random", seed + 1)
            res["after_reset", layout] = round_trip_with_error(session, rt, cfg, xs, ids, ws, layout)
            res["repeats", layout] = round_trip_with_error(session, rt, cfg,
                                                           *planted_inputs(cfg, seed + 2, (), repeats), layout)
    return res


@pytest.fixture(scope="module")
def runs():
    cache = {}

    def get(R: int, token_dtype: str = "bfloat16", plan: str | None = None, top_k: int = 2):
        key = (R, token_dtype, plan, top_k)
        if key not in cache:
            cfg = case_cfg(R, token_dtype=token_dtype, hidden=256 if token_dtype != "bfloat16" else 32, top_k=top_k,
                           n_experts=max(2 * R, 6 * top_k // 5), **PLAN_CFG.get(plan, {}))
            repeats = WIDE_REPEATS if top_k > 8 else REPEATS
            cache[key] = (cfg, run_pes(ids_pe, R, args=(cfg, SEED, PLANS.get(plan), repeats),
                                       timeout_s=RUN_TIMEOUT_S))
        return cache[key]

    return get


def check_round_trip(cfg: EPConfig, per_rank: list, key, inputs, what: str) -> None:
    """Every rank's batch and combine output of ``key`` against the reference of ``inputs``."""
    xs, ids, ws = inputs
    refs = reference.dispatch(xs, ids, ws, cfg)
    outs = reference.combine([expert_outputs(cfg, refs[s], s) for s in range(cfg.n_ranks)], refs, ids, cfg)
    layout = key[1]
    for r, res in enumerate(per_rank):
        got, at = res[key], f"{what}: rank {r} ({layout})"
        if cfg.token_format.quantized:  # the codes: checked bit for bit by the FP8 suites; here the rows' places
            np.testing.assert_array_equal(got["row_offsets"], refs[r].row_offsets, err_msg=at)
            for k in ("src_rank", "src_token", "src_k"):
                np.testing.assert_array_equal(got[k][:refs[r].n_rows], getattr(refs[r], k), err_msg=f"{at}: {k}")
        else:
            assert_batch_is_the_reference(got, refs[r], layout, xs, cfg, at)
        np.testing.assert_array_equal(got["out"], outs[r].view(np.uint16), err_msg=f"{at}: combine")


@pytest.mark.parametrize("layout", ["expanded", "compact"])
@pytest.mark.parametrize("R, plan", RUN_PLANS)
def test_planted_ids_are_dropped_and_named_by_the_rank_that_passed_them(runs, R, plan, layout):
    cfg, per_rank = runs(R, plan=plan)
    check_round_trip(cfg, per_rank, ("planted", layout), planted_inputs(cfg, SEED), "planted ids")
    named = {rank % R: (t, k, eval(v.format(E=cfg.n_experts))) for rank, t, k, v in PLANTED}  # noqa: S307
    for r, res in enumerate(per_rank):
        err = res["planted", layout]["error"]
        if r not in named:
            assert err is None, f"rank {r} raised for another rank's ids: {err}"
            continue
        t, k, x = named[r]
        assert err is not None, f"rank {r}: the planted topk_ids[{t}, {k}] = {x} raised nothing"
        for frag in (f"rank {r}: topk_ids[{t}, {k}] = {x} in call ", f"outside [-1, n_experts={cfg.n_experts})",
                     "dispatch_async dropped that slot", "reset() on every rank"):
            assert frag in err, f"rank {r}: {frag!r} not in {err!r}"


@pytest.mark.parametrize("layout", ["expanded", "compact"])
@pytest.mark.parametrize("R, plan", RUN_PLANS)
def test_after_reset_the_next_call_is_exact(runs, R, plan, layout):
    cfg, per_rank = runs(R, plan=plan)
    assert [res["after_reset", layout]["error"] for res in per_rank] == [None] * R
    check_round_trip(cfg, per_rank, ("after_reset", layout), make_inputs(cfg, "random", SEED + 1), "after reset")


@pytest.mark.parametrize("layout", ["expanded", "compact"])
@pytest.mark.parametrize("R, plan", RUN_PLANS)
def test_a_repeated_id_counts_once_with_its_first_slot_weight(runs, R, plan, layout):
    cfg, per_rank = runs(R, plan=plan)
    inputs = planted_inputs(cfg, SEED + 2, (), REPEATS)
    assert [res["repeats", layout]["error"] for res in per_rank] == [None] * R
    check_round_trip(cfg, per_rank, ("repeats", layout), inputs, "repeated ids")
    # the reference's rule, seen in the batch: rank 0's token 3 has one row for its repeated expert, from slot 0
    owner = per_rank[0]["repeats", layout]  # expert 0 lives on rank 0
    n = int(owner["row_offsets"][-1])
    rows = (owner["src_rank"][:n] == 0) & (owner["src_token"][:n] == 3)
    assert owner["src_k"][:n][rows].tolist() == [0], owner["src_k"][:n][rows]


@pytest.mark.parametrize("plan", [None, "route_first"])
def test_repeats_past_the_ids_loaded_together(runs, plan):
    """Top-k 10: repeats at slots 8 and 9, past the 8 ids a route-first receiver loads together
    and masks in registers (it masks these in memory, as it finds them)."""
    cfg, per_rank = runs(2, plan=plan, top_k=10)
    inputs = planted_inputs(cfg, SEED + 2, (), WIDE_REPEATS)
    for layout in ("expanded", "compact"):
        assert [res["repeats", layout]["error"] for res in per_rank] == [None, None]
        check_round_trip(cfg, per_rank, ("repeats", layout), inputs, "repeated ids past slot 8")
    rows = reference.dispatch(*inputs, cfg)[0]
    assert ((rows.src_rank == 0) & (rows.src_token == 1)).sum() < (inputs[1][0][1] // cfg.n_local_experts == 0).sum(), \
        "the case has a repeat on rank 0"


def test_fp8_masked_and_planted_ids(runs):
    cfg, per_rank = runs(2, "fp8_e4m3")
    for layout in ("expanded", "compact"):
        check_round_trip(cfg, per_rank, ("planted", layout), planted_inputs(cfg, SEED), "FP8 planted ids")
        assert per_rank[0]["planted", layout]["error"] is not None
        check_round_trip(cfg, per_rank, ("repeats", layout), planted_inputs(cfg, SEED + 2, (), REPEATS),
                         "FP8 repeated ids")


def test_the_masked_routing_has_what_it_promises():
    cfg = case_cfg(3)
    xs, ids, ws = make_inputs(cfg, "masked", SEED, n_tokens=[6, 6, 6])
    assert (ids[-1] == -1).all(), "the last rank masks every token"
    assert (ids[0][::7] == -1).all() and (ids[0] == -1).any(axis=1).sum() >= 1
    outs = reference.combine([expert_outputs(cfg, b, s) for s, b in enumerate(reference.dispatch(xs, ids, ws, cfg))],
                             reference.dispatch(xs, ids, ws, cfg), ids, cfg)
    for s in range(3):
        fully = (ids[s] == -1).all(axis=1)
        assert not outs[s].view(np.uint16)[fully].any(), "a fully masked token combines to a zero row"


#: Weights planted on masked (-1) slots, which debug mode must ignore as dispatch does.
MASKED_SLOT_WEIGHTS = (np.nan, np.inf, -np.inf, -1.0)


def masked_weights_pe(session, cfg: EPConfig, seed: int) -> dict:
    """Debug mode (the routing check on), negative weights refused: a round trip whose masked
    slots carry NaN, infinities and a negative weight, then a call with a NaN on a live slot."""
    from ep_runtime.core.errors import EPInputError
    from ep_runtime.core.runtime import EPRuntime

    xs, ids, ws = masked_slot_inputs(cfg, seed)
    res = {}
    with EPRuntime(cfg, session, debug=True) as rt:
        res["masked", "compact"] = round_trip_with_error(session, rt, cfg, xs, ids, ws, "compact")
        live = [w.copy() for w in ws]
        t, k = np.argwhere(ids[0] >= 0)[0]
        live[0][t, k] = np.nan
        try:
            round_trip_with_error(session, rt, cfg, xs, ids, live, "compact")
            res["live_nan"] = None
        except EPInputError as e:  # rank 0 raises in dispatch_async; its peer's wait times out
            res["live_nan"] = str(e)
        except Exception as e:  # noqa: BLE001 - the peer's timeout, whatever its class
            res["live_nan"] = f"{type(e).__name__}: {e}"
    return res


def masked_slot_inputs(cfg: EPConfig, seed: int):
    """The ``masked`` routing of ``seed`` with :data:`MASKED_SLOT_WEIGHTS` written into its masked
    slots, in turn."""
    xs, ids, ws = make_inputs(cfg, "masked", seed, n_tokens=[cfg.max_tokens_per_rank] * cfg.n_ranks)
    ws = [w.copy() for w in ws]
    for w, i in zip(ws, ids):
        masked = np.argwhere(i < 0)
        for n, (t, k) in enumerate(masked):
            w[t, k] = MASKED_SLOT_WEIGHTS[n % len(MASKED_SLOT_WEIGHTS)]
    return xs, ids, ws


def test_debug_mode_ignores_the_weights_of_masked_slots():
    """The routing check accepts NaN, infinite and (with allow_negative_weights=False) negative
    weights on ``-1`` slots, as dispatch ignores them (README, docs/protocol.md): the round trip
    is exact; a NaN on a live slot is still refused, naming the rank and the weight."""
    cfg = case_cfg(2, allow_negative_weights=False, wait_timeout_s=5.0)
    xs, ids, ws = masked_slot_inputs(cfg, SEED)
    planted = sum(int((i < 0).sum()) for i in ids)
    assert planted >= len(MASKED_SLOT_WEIGHTS) and any(np.isnan(w).any() for w in ws)
    per_rank = run_pes(masked_weights_pe, 2, args=(cfg, SEED), timeout_s=RUN_TIMEOUT_S)
    check_round_trip(cfg, per_rank, ("masked", "compact"), (xs, ids, ws), "NaN/inf/negative weights on masked slots")
    assert all(res["masked", "compact"]["error"] is None for res in per_rank)
    assert "rank 0" in per_rank[0]["live_nan"] and "weight" in per_rank[0]["live_nan"], per_rank[0]["live_nan"]
