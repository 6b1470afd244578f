"""The batched layout's combine with the router weights applied at home
(``EPConfig.combine_weights="home"``) on the simulator (real kernels, one process per rank): the
expert ranks send each (token, slot) row home unweighted, and combine_wait sums ``w[t, k] * row``
over the token's routed slots in slot order. Exact against
:func:`ep_runtime.core.reference_batched.combine_batched_home` over the awkward routings (a rank
with no tokens, an expert with none, every token to one expert, top-k 1, -1 slots), bf16 and FP8
rows, stores and puts, every receiver, and calls in a row (bit for bit the same on a repeat).

Each slot's weight names its token and slot and a masked slot's weight is NaN, and the unread
batched slots hold NaN: a weight applied twice or to another slot's row changes the exact
output, and a -1 slot summed (or a slot past a count read) makes it NaN. The checks' power is
itself tested on the reference (those three mistakes give a different answer). Bad arguments
and configurations are refused naming the fix.
"""

from __future__ import annotations

import numpy as np
import pytest

from ep_runtime.core.config import EPConfig
from ep_runtime.core.errors import EPConfigError
from ep_runtime.core.reference import BF16, routed_ids
from ep_runtime.core.reference_batched import batched, combine_batched_home
from ep_runtime.shmem.launch import run_pes
from ep_runtime.testing import input_error_of, make_inputs

RUN_TIMEOUT_S = 300


def home_cfg(R: int, **changes) -> dict:
    return {**dict(n_ranks=R, n_experts=2 * R, top_k=2, hidden=16, max_tokens_per_rank=5, layouts="batched",
                   combine_weights="home"), **changes}


def cases(R: int) -> list:
    """(name, config dict, scenario, seed, token counts or None, plan overrides, scales)."""
    fp8, ue8 = dict(hidden=256, token_dtype="fp8_e4m3"), dict(hidden=512, token_dtype="fp8_e4m3_ue8m0")
    return [
        ("random", home_cfg(R), "random", 1, None, None, "column"),
        ("zero_rank", home_cfg(R), "zero_rank", 3, None, None, "column"),
        ("empty_expert", home_cfg(R), "empty_expert", 4, None, None, "column"),
        ("one_expert", home_cfg(R), "one_expert", 5, (5,) * R, None, "column"),
        ("top_k_1", home_cfg(R, top_k=1), "random", 6, None, None, "column"),
        ("masked_top_3", home_cfg(R, n_experts=4 * R, top_k=3), "masked", 7, None, None, "column"),
        ("no_tokens_anywhere", home_cfg(R), "random", 8, (0,) * R, None, "column"),
        ("hidden_5", home_cfg(R, hidden=5), "random", 10, None, None, "column"),
        ("hidden_256_pairs", home_cfg(R, hidden=256), "masked", 11, None, None, "column"),
        ("fp8_e4m3", home_cfg(R, **fp8), "masked", 12, None, None, "column"),
        ("ue8m0_packed_puts", home_cfg(R, **ue8), "random", 13, None, "transport=puts", "packed"),
        ("bf16_puts", home_cfg(R), "masked", 16, None, "transport=puts", "column"),
        ("land", home_cfg(R), "masked", 15, None, "receiver=land", "column"),
        ("route_first", home_cfg(R), "random", 17, None, "receiver=route_first", "column"),
    ]


def slot_outputs(cfg: EPConfig, counts: np.ndarray, rank: int) -> np.ndarray:
    """Rank ``rank``'s expert outputs [L, M, H] bf16 bits: slot (e, pos) below the count holds
    bf16((rank + 1) + e / 8 + pos / 64 + col / 256); the slots past the count hold NaN."""
    L, M, H = cfg.n_local_experts, cfg.n_ranks * cfg.max_tokens_per_rank, cfg.hidden
    e, pos, col = np.meshgrid(np.arange(L), np.arange(M), np.arange(H), indexing="ij")
    y = (np.float32(rank + 1) + e / 8 + pos / 64 + col / 256).astype(np.float32).astype(BF16).view(np.uint16)
    return np.where(pos < counts[:, None, None], y, np.uint16(0x7FC0))


def home_weights(cfg: EPConfig, topk_ids: np.ndarray, rank: int, call: int) -> np.ndarray:
    """Rank ``rank``'s combine weights [T, K] float32: 0.5 + k / 4 + t / 64 + rank / 8 + call / 16
    at a routed slot (a weight per token and slot), NaN at a masked one (-1, never read)."""
    T, K = topk_ids.shape
    t, k = np.meshgrid(np.arange(T), np.arange(K), indexing="ij")
    w = (0.5 + k / 4 + t / 64 + rank / 8 + call / 16).astype(np.float32)
    return np.where(routed_ids(topk_ids, cfg.n_experts) >= 0, w, np.float32(np.nan)).astype(np.float32)


# -- per-rank body ------------------------------------------------------------------------------
def home_pe(session, R: int) -> dict:
    from ep_runtime.core.runtime import EPRuntime

    r = session.rank
    results = {}
    for name, cfg_d, scenario, seed, counts, plan, scales in cases(R):
        cfg = EPConfig(**cfg_d)
        xs, ids, ws = make_inputs(cfg, scenario, seed, None if counts is None else list(counts))
        outs = []
        with EPRuntime(cfg, session, plan=plan) as rt:
            for call in range(3):  # the third repeats the second: bit for bit
                batch = rt.dispatch(xs[r].view(np.uint16), ids[r], ws[r], layout="batched", scales=scales)
                got_counts = session.to_host(batch.counts).copy()
                y = slot_outputs(cfg, got_counts, r)
                w = home_weights(cfg, ids[r], r, min(call, 1))
                outs.append((got_counts, session.to_host(rt.combine(y, batch.handle, layout="batched",
                                                                    weights=w)).copy()))
        results[name] = outs

    errors = {}
    cfg = EPConfig(**home_cfg(R))
    xs, ids, ws = make_inputs(cfg, "random", 40, None)
    L, M, H, K = cfg.n_local_experts, R * cfg.max_tokens_per_rank, cfg.hidden, cfg.top_k
    y = np.zeros((L, M, H), np.uint16)
    with EPRuntime(cfg, session) as rt:
        batch = rt.dispatch(xs[r].view(np.uint16), ids[r], ws[r], layout="batched")
        T = len(xs[r])
        for what, call in {
            "weights_dispatch": lambda: rt.combine_async(y, batch.handle, layout="batched"),
            "weights_none": lambda: rt.combine_async(y, batch.handle, layout="batched", weights=None),
            "weights_shape": lambda: rt.combine_async(y, batch.handle, layout="batched",
                                                      weights=np.ones((T, K + 1), np.float32)),
            "weights_float64": lambda: rt.combine_async(y, batch.handle, layout="batched",
                                                        weights=np.ones((T, K), np.float64)),
            "layout_compact": lambda: rt.combine_async(np.zeros((M, H), np.uint16), batch.handle, layout="compact",
                                                       weights=np.ones((T, K), np.float32)),
        }.items():
            errors[what] = input_error_of(call)
        h = rt.combine_async(y, batch.handle, layout="batched", weights=np.ones((T, K), np.float32))
        errors["reduce_false"] = input_error_of(lambda: rt.combine_wait(h, reduce=False))
        rt.combine_wait(h)
        rt.synchronize()
    return {"cases": results, "errors": errors}


@pytest.fixture(scope="module", params=[2, 3])
def sim(request):
    R = request.param
    return R, run_pes(home_pe, R, args=(R,), timeout_s=RUN_TIMEOUT_S)


# -- checks -----------------------------------------------------------------------------------
def want_home(cfg: EPConfig, scenario, seed, counts, call: int) -> list:
    """Every home rank's output of the case's call ``call`` (the reference's)."""
    xs, ids, ws = make_inputs(cfg, scenario, seed, None if counts is None else list(counts))
    refs = batched(xs, ids, ws, cfg)
    ys = [slot_outputs(cfg, ref.counts, r) for r, ref in enumerate(refs)]
    w = [home_weights(cfg, ids[r], r, min(call, 1)) for r in range(cfg.n_ranks)]
    return combine_batched_home(ys, refs, ids, w, cfg)


def test_home_weighted_combine_equals_the_reference_exactly(sim):
    """Exact on the simulator (no FMA contraction; the reference's slot order), no NaN: no masked
    slot's weight and no slot past a count was read."""
    R, per_rank = sim
    for name, cfg_d, scenario, seed, counts, plan, scales in cases(R):
        cfg = EPConfig(**cfg_d)
        for call in range(3):
            want = want_home(cfg, scenario, seed, counts, call)
            for r, res in enumerate(per_rank):
                got = res["cases"][name][call][1]
                assert got.shape == want[r].shape, name
                assert not np.isnan(got.view(BF16).astype(np.float32)).any(), f"{name}: rank {r}: NaN"
                np.testing.assert_array_equal(got, want[r].view(np.uint16), err_msg=f"{name} call {call}: rank {r}")


def test_home_weighted_combine_is_bit_for_bit_run_to_run(sim):
    R, per_rank = sim
    for name, *_ in cases(R):
        for r, res in enumerate(per_rank):
            (c1, second), (c2, third) = res["cases"][name][1], res["cases"][name][2]
            np.testing.assert_array_equal(c1, c2, err_msg=name)
            np.testing.assert_array_equal(second, third, err_msg=f"{name}: rank {r}")


def test_the_checks_catch_a_weight_twice_on_the_wrong_slot_or_a_masked_slot_summed():
    """The reference the kernels must equal differs from each mistake's answer on these inputs."""
    cfg = EPConfig(**home_cfg(2, n_experts=8, top_k=3))
    xs, ids, ws = make_inputs(cfg, "masked", 7, None)
    refs = batched(xs, ids, ws, cfg)
    ys = [slot_outputs(cfg, ref.counts, r) for r, ref in enumerate(refs)]
    w = [home_weights(cfg, ids[r], r, 0) for r in range(2)]
    want = combine_batched_home(ys, refs, ids, w, cfg)
    assert any((routed_ids(i, cfg.n_experts) < 0).any() for i in ids), "the scenario masks no slot"
    def bits(outs):
        return np.concatenate([o.view(np.uint16) for o in outs])

    twice = combine_batched_home(ys, refs, ids, [np.where(np.isnan(x), x, x * x) for x in w], cfg)
    rolled = combine_batched_home(ys, refs, ids, [np.roll(x, 1, axis=1) for x in w], cfg)
    assert not np.array_equal(bits(twice), bits(want))
    assert not np.array_equal(bits(rolled), bits(want))
    # a masked slot's NaN weight never reaches the output; summing that slot would make it NaN
    assert not np.isnan(np.concatenate(want).astype(np.float32)).any()
    unmasked = [np.where(np.isnan(x), np.float32(1.0), x) for x in w]
    assert np.array_equal(bits(combine_batched_home(ys, refs, ids, unmasked, cfg)), bits(want))


def test_bad_home_weighted_calls_are_refused_before_launch(sim):
    _, per_rank = sim
    for res in per_rank:
        e = res["errors"]
        for what in ("weights_dispatch", "weights_none"):
            assert e[what] and "EPConfig.combine_weights is 'home'" in e[what] and "float32 [T =" in e[what], e
        assert e["weights_shape"] and "this rank's router weights" in e["weights_shape"], e
        assert e["weights_float64"] and "float32" in e["weights_float64"], e
        assert e["layout_compact"] and "use layout='batched'" in e["layout_compact"], e
        assert e["reduce_false"] and "use reduce=True" in e["reduce_false"], e


def test_home_weights_need_the_batched_layout_only_and_bf16_partials():
    with pytest.raises(EPConfigError, match=r"use layouts=\('batched',\)"):
        EPConfig(**home_cfg(2, layouts=("compact", "batched")))
    with pytest.raises(EPConfigError, match="use combine_dtype='bfloat16'"):
        EPConfig(**home_cfg(2, combine_dtype="float32"))
    with pytest.raises(EPConfigError, match="combine_weights"):
        EPConfig(**home_cfg(2, combine_weights="homes"))


def test_home_weights_refuse_the_hierarchical_transport_naming_the_fix():
    from ep_runtime.core.plan import Topology, choose_plan

    cfg = EPConfig(**home_cfg(4))
    nodes = Topology(4, False, 132, True, False, (0, 0, 1, 1), True)
    with pytest.raises(EPConfigError, match="use transport=puts"):
        choose_plan(cfg, nodes, {"transport": "hierarchical", "receiver": "wait"})
    assert choose_plan(cfg, nodes, {"transport": "puts"}).transport.value == "puts"


def test_home_weights_across_nodes_take_puts_by_default():
    """DeepEP's low-latency mode across nodes (the deep_ep layer builds its runtimes with no plan):
    the plan puts to every peer rather than choosing the hierarchical transport and refusing it,
    at 2 x 2 and past 64 ranks (18 x 8, with destination lists)."""
    from ep_runtime.core.plan import Topology, choose_plan

    for R in (4, 144):
        size = 2 if R == 4 else 8
        cfg = EPConfig(**home_cfg(R))
        nodes = Topology(R, False, 132, True, False, tuple(p // size for p in range(R)), True)
        plan = choose_plan(cfg, nodes)
        assert plan.transport.value == "puts" and plan.dest_list == (R > 64), plan
        assert any("weights at home" in reason for reason in plan.reasons), plan.reasons
        # the weights at the expert ranks keep the hierarchical transport
        plain = choose_plan(EPConfig(**home_cfg(R, combine_weights="expert")), nodes)
        assert plain.transport.value == "hierarchical", plain
