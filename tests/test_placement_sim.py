"""Placement from the sender's ranks, on the simulator (the real kernels, one process per rank).

dispatch_async's routing blocks rank each (token, k) among its rank's tokens with that expert
(experts in windows of :data:`ep_runtime.kernels.dispatch_route.RANK_WINDOW`, tokens in rounds of a
block; two routing blocks in a grid of 3, each a chunk of the tokens from a histogram of the
ids before it) and the last chunk's block counts each expert's tokens; dispatch_wait gives
each received (token, k) its row from them alone: the expert's first row, plus its rows from
earlier sources, plus the rank.
The rows and counts travel by 4-byte stores into the peers' heaps or, with ``transport=puts``,
by NVSHMEM block puts and the counts row put with the signal (the ``wait`` receiver's plans).

Each path must give every row exactly the reference's position and description (expanded batch,
compact gather index), the counts each source stored must be the reference's, the combine that
follows (it finds a token's rows through ``token_rows``) must equal the reference bit for bit,
and the expanded copy (dispatch_copy) must match.
The cases have several ranking windows and rounds, more local experts than a block has threads
(runs of experts in the scan), padded segments, a grid of one block (the routing block is also
the only token block), a rank with no tokens, every token to one expert, and top-k = 1; one
runtime serves a shrinking batch, so stale ranks past a source's tokens must be ignored.
"""

from __future__ import annotations

import numpy as np
import pytest

from ep_runtime.core import reference
from ep_runtime.core.config import EPConfig
from ep_runtime.shmem.launch import run_pes
from ep_runtime.testing import expert_outputs, make_inputs

R = 2
THREADS = 8  # the simulator's block (runtime.SIM_THREADS)
FIELDS = ("row_offsets", "expert_counts", "src_rank", "src_token", "src_k", "weight")


def base_cfg(**changes) -> dict:
    # 12 experts: three ranking windows of RANK_WINDOW = 4 on the simulator; 40 tokens: 5 rounds
    return {**dict(n_ranks=R, n_experts=12, top_k=3, hidden=16, max_tokens_per_rank=40, n_sms=3), **changes}


#: (name, config, scenario, seed, token counts per rank)
CASES = [
    ("random", base_cfg(), "random", 31, (40, 37)),
    ("pad_4", base_cfg(pad_multiple=4), "random", 32, (33, 40)),
    ("one_block", base_cfg(n_sms=1), "random", 36, (29, 40)),
    ("many_local_experts", base_cfg(n_experts=22, top_k=4), "random", 37, (40, 23)),  # 11 local > 8 threads
    ("zero_rank", base_cfg(), "zero_rank", 33, None),
    ("one_expert", base_cfg(), "one_expert", 34, (40, 40)),
    ("top_k_1", base_cfg(top_k=1), "random", 35, (40, 19)),
]
#: One runtime, batches that shrink: ranks of the earlier calls stay in the buffers.
SHRINKING = ((40, 40), (17, 40), (40, 3), (1, 0))


def run_case(session, rt, cfg, xs, ids, ws) -> dict:
    r = session.rank
    ref = reference.dispatch(xs, ids, ws, cfg)[r]
    got = {}
    batch = rt.dispatch(xs[r].view(np.uint16), ids[r], ws[r])
    got["x"] = session.to_host(batch.x)[:ref.n_rows].copy()
    for f in FIELDS:
        got[f] = session.to_host(getattr(batch, f)).copy()
    got["counts"] = session.to_host(rt.buffers["dispatch_counts"])[(rt.calls - 1) % 2].copy()
    out = rt.combine(expert_outputs(cfg, ref, r), batch.handle)
    got["out"] = session.to_host(out).copy()
    compact = rt.dispatch(xs[r].view(np.uint16), ids[r], ws[r], layout="compact")
    got["gather"] = session.to_host(compact.gather)[:ref.n_rows].copy()
    return got


def placement_pe(session, plan: dict) -> dict:
    from ep_runtime.kernels.dispatch_route import RANK_WINDOW, ROUTE_BLOCKS, ROUTE_GRID_SHARE
    from ep_runtime.core.runtime import EPRuntime

    # as the simulated kernels see them
    results = {"window": RANK_WINDOW, "route_blocks": ROUTE_BLOCKS, "route_share": ROUTE_GRID_SHARE}
    for name, cfg_d, scenario, seed, counts in CASES:
        cfg = EPConfig(**cfg_d)
        xs, ids, ws = make_inputs(cfg, scenario, seed, None if counts is None else list(counts))
        with EPRuntime(cfg, session, plan=plan) as rt:
            results[name] = run_case(session, rt, cfg, xs, ids, ws)
            results["plan"] = rt.plan.as_dict()
    cfg = EPConfig(**base_cfg())
    with EPRuntime(cfg, session, plan=plan) as rt:
        for i, counts in enumerate(SHRINKING):
            xs, ids, ws = make_inputs(cfg, "random", 60 + i, list(counts))
            results[f"shrinking_{i}"] = run_case(session, rt, cfg, xs, ids, ws)
    return results


@pytest.fixture(scope="module", params=["stores", "puts"])
def sim(request):
    plan = {"receiver": "wait", "transport": request.param}
    return plan, run_pes(placement_pe, R, args=(plan,), timeout_s=300)


def expected(name: str):
    for case, cfg_d, scenario, seed, counts in CASES:
        if case == name:
            cfg = EPConfig(**cfg_d)
            return cfg, make_inputs(cfg, scenario, seed, None if counts is None else list(counts))
    i = int(name.rsplit("_", 1)[1])
    cfg = EPConfig(**base_cfg())
    return cfg, make_inputs(cfg, "random", 60 + i, list(SHRINKING[i]))


def test_the_path_is_the_one_asked_for(sim):
    plan, per_rank = sim
    assert all(res["plan"]["receiver"] == "wait" and res["plan"]["transport"] == plan["transport"]
               for res in per_rank)


def test_the_cases_have_several_windows_rounds_and_expert_runs(sim):
    """Guard the test itself: more experts than one ranking window, more tokens than one
    round, a case with more local experts than threads (runs of experts in the scan), and two
    routing blocks in the base grid (``route_blocks``: one per ROUTE_GRID_SHARE blocks beyond the
    first, at most ROUTE_BLOCKS), so the chunks' histograms are exercised."""
    cfg = EPConfig(**base_cfg())
    assert all(cfg.n_experts >= 3 * res["window"] for res in sim[1])
    assert all(min(res["route_blocks"], (cfg.n_sms - 1) // res["route_share"]) == 2 for res in sim[1])
    assert cfg.max_tokens_per_rank >= 4 * THREADS
    many = EPConfig(**{name: cfg_d for name, cfg_d, *_ in CASES}["many_local_experts"])
    assert many.n_local_experts > THREADS


@pytest.mark.parametrize("name", [c[0] for c in CASES] + [f"shrinking_{i}" for i in range(len(SHRINKING))])
def test_rows_counts_and_combine_equal_the_reference_exactly(sim, name):
    plan, per_rank = sim
    cfg, (xs, ids, ws) = expected(name)
    refs = reference.dispatch(xs, ids, ws, cfg)
    ys = [expert_outputs(cfg, refs[r], r) for r in range(R)]
    want_out = reference.combine([y.view(reference.BF16) for y in ys], refs, ids, cfg)
    L = cfg.n_local_experts
    for r, res in enumerate(per_rank):
        got, ref, what = res[name], refs[r], f"{plan['transport']} {name} rank {r}"
        n = ref.n_rows
        np.testing.assert_array_equal(got["x"], ref.x.view(np.uint16), err_msg=f"{what}: x")
        np.testing.assert_array_equal(got["row_offsets"], ref.row_offsets, err_msg=f"{what}: row_offsets")
        np.testing.assert_array_equal(got["expert_counts"], ref.expert_counts, err_msg=f"{what}: expert_counts")
        for f in ("src_rank", "src_token", "src_k"):
            np.testing.assert_array_equal(got[f][:n], getattr(ref, f), err_msg=f"{what}: {f}")
        np.testing.assert_array_equal(got["weight"][:n].view(np.uint32), ref.weight.view(np.uint32),
                                      err_msg=f"{what}: weight")
        np.testing.assert_array_equal(got["gather"], reference.gather_index(ref, cfg), err_msg=f"{what}: gather")
        np.testing.assert_array_equal(got["out"], want_out[r].view(np.uint16), err_msg=f"{what}: combine")
        # what each source stored: its tokens per local expert of this rank, and its T
        for s in range(R):
            mine = ids[s][(ids[s] >= r * L) & (ids[s] < (r + 1) * L)] - r * L
            np.testing.assert_array_equal(got["counts"][s, :L], np.bincount(mine, minlength=L),
                                          err_msg=f"{what}: counts from source {s}")
            assert got["counts"][s, L] == len(ids[s]), (what, s)
