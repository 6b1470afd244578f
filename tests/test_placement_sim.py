"""dispatch_wait's two placements on the simulator (the real kernels, one process per rank):
``walk`` (a warp per (local expert, source, routing chunk)) and ``token`` (a block per (source,
routing chunk), each routing row read once, experts in windows of
:data:`ep_runtime.kernels.dispatch.PLACE_WINDOW`), chosen by ``EP_RUNTIME_PLACEMENT``.

Each must give every row exactly the reference's position and description (expanded batch,
compact gather index), the combine that follows (it finds a token's rows through the
placement's ``token_rows``) must equal the reference bit for bit, and the expanded copy must
match in both its forms (inside dispatch_wait and in dispatch_copy). The cases have several
routing chunks per source, more local experts than one window, padded segments, a rank with no
tokens, every token to one expert, and top-k = 1; one runtime serves a shrinking batch, so
stale routing rows past a source's chunks must be ignored.
"""

from __future__ import annotations

import numpy as np
import pytest

from ep_runtime import reference
from ep_runtime.config import EPConfig
from ep_runtime.errors import EPConfigError
from ep_runtime.kernels.dispatch import route_chunk_tokens
from ep_runtime.runtime import _placement
from ep_runtime.shmem.launch import run_pes
from ep_runtime.testing import expert_outputs, make_inputs

R = 2
THREADS = 8  # the simulator's block (runtime.SIM_THREADS)
FIELDS = ("row_offsets", "expert_counts", "src_rank", "src_token", "src_k", "weight")


def base_cfg(**changes) -> dict:
    # 6 local experts: two windows of PLACE_WINDOW = 4 on the simulator
    return {**dict(n_ranks=R, n_experts=12, top_k=3, hidden=16, max_tokens_per_rank=40, n_sms=3), **changes}


#: (name, config, scenario, seed, token counts per rank)
CASES = [
    ("random_three_chunks", base_cfg(), "random", 31, (40, 37)),
    ("pad_4", base_cfg(pad_multiple=4), "random", 32, (33, 40)),
    ("zero_rank", base_cfg(), "zero_rank", 33, None),
    ("one_expert", base_cfg(), "one_expert", 34, (40, 40)),
    ("top_k_1", base_cfg(top_k=1), "random", 35, (40, 19)),
]
#: One runtime, batches that shrink: chunks of the earlier calls stay in the buffers.
SHRINKING = ((40, 40), (17, 40), (40, 3), (1, 0))


def run_case(session, rt, cfg, xs, ids, ws) -> dict:
    r = session.rank
    ref = reference.dispatch(xs, ids, ws, cfg)[r]
    got = {}
    batch = rt.dispatch(xs[r].view(np.uint16), ids[r], ws[r])
    got["x"] = session.to_host(batch.x)[:ref.n_rows].copy()
    for f in FIELDS:
        got[f] = session.to_host(getattr(batch, f)).copy()
    out = rt.combine(expert_outputs(cfg, ref, r), batch.handle)
    got["out"] = session.to_host(out).copy()
    compact = rt.dispatch(xs[r].view(np.uint16), ids[r], ws[r], layout="compact")
    got["gather"] = session.to_host(compact.gather)[:ref.n_rows].copy()
    return got


def placement_pe(session) -> dict:
    from ep_runtime.kernels.dispatch import PLACE_WINDOW
    from ep_runtime.runtime import EPRuntime

    results = {"window": PLACE_WINDOW}  # as the simulated kernels see it
    for name, cfg_d, scenario, seed, counts in CASES:
        cfg = EPConfig(**cfg_d)
        xs, ids, ws = make_inputs(cfg, scenario, seed, None if counts is None else list(counts))
        with EPRuntime(cfg, session) as rt:
            results[name] = run_case(session, rt, cfg, xs, ids, ws)
            results["placement"], results["fused_copy"] = rt.placement, rt.fused_copy
    cfg = EPConfig(**base_cfg())
    with EPRuntime(cfg, session) as rt:
        for i, counts in enumerate(SHRINKING):
            xs, ids, ws = make_inputs(cfg, "random", 60 + i, list(counts))
            results[f"shrinking_{i}"] = run_case(session, rt, cfg, xs, ids, ws)
    return results


@pytest.fixture(scope="module", params=[("walk", "1"), ("walk", "0"), ("token", "1"), ("token", "0")],
                ids=lambda p: f"{p[0]}-fused_copy_{p[1]}")
def sim(request):
    placement, fused = request.param
    with pytest.MonkeyPatch.context() as mp:  # the PEs are spawned with this environment
        mp.setenv("EP_RUNTIME_PLACEMENT", placement)
        mp.setenv("EP_RUNTIME_FUSED_COPY", fused)
        return placement, fused, run_pes(placement_pe, R, timeout_s=300)


def expected(name: str):
    for case, cfg_d, scenario, seed, counts in CASES:
        if case == name:
            cfg = EPConfig(**cfg_d)
            return cfg, make_inputs(cfg, scenario, seed, None if counts is None else list(counts))
    i = int(name.rsplit("_", 1)[1])
    cfg = EPConfig(**base_cfg())
    return cfg, make_inputs(cfg, "random", 60 + i, list(SHRINKING[i]))


def test_the_placement_is_the_one_asked_for(sim):
    placement, fused, per_rank = sim
    assert all(res["placement"] == placement and res["fused_copy"] == (fused == "1") for res in per_rank)


def test_the_cases_have_several_chunks_and_windows(sim):
    """Guard the test itself: sources with several routing chunks, and more local experts than
    one placement window of the simulated kernels."""
    cfg = EPConfig(**base_cfg())
    assert -(-40 // route_chunk_tokens(THREADS, 40)) >= 3
    assert all(cfg.n_local_experts > res["window"] for res in sim[2])


@pytest.mark.parametrize("name", [c[0] for c in CASES] + [f"shrinking_{i}" for i in range(len(SHRINKING))])
def test_rows_and_combine_equal_the_reference_exactly(sim, name):
    placement, fused, per_rank = sim
    cfg, (xs, ids, ws) = expected(name)
    refs = reference.dispatch(xs, ids, ws, cfg)
    ys = [expert_outputs(cfg, refs[r], r) for r in range(R)]
    want_out = reference.combine([y.view(reference.BF16) for y in ys], refs, ids, cfg)
    for r, res in enumerate(per_rank):
        got, ref, what = res[name], refs[r], f"{placement} fused={fused} {name} rank {r}"
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


@pytest.mark.parametrize("experts,n_sms,want", [
    (256, 132, "walk"),   # 128 local x 2 sources x 8 chunks = 2,048 walks <= 132 x 16 warps
    (256, 32, "token"),   # 2,048 walks > 32 x 16 warps
    (512, 132, "token"),  # 256 local experts: 4,096 walks
    (16, 16, "walk"),     # 8 local: 128 walks <= 256 warps
])
def test_auto_walks_when_every_walk_has_a_warp(monkeypatch, experts, n_sms, want):
    monkeypatch.delenv("EP_RUNTIME_PLACEMENT", raising=False)
    cfg = EPConfig(n_ranks=2, n_experts=experts, top_k=8, hidden=7168, max_tokens_per_rank=4096)
    assert _placement(cfg, n_sms, 512) == want


def test_auto_counts_the_chunks_of_a_small_capacity(monkeypatch):
    """At capacity 64 a source has one routing chunk (64 tokens), so 128 x 2 walks fit 16 blocks."""
    monkeypatch.delenv("EP_RUNTIME_PLACEMENT", raising=False)
    cfg = EPConfig(n_ranks=2, n_experts=256, top_k=8, hidden=7168, max_tokens_per_rank=64)
    assert _placement(cfg, 16, 512) == "walk"
    assert _placement(cfg, 15, 512) == "token"


def test_bad_placement_setting_is_refused(monkeypatch):
    monkeypatch.setenv("EP_RUNTIME_PLACEMENT", "sideways")
    cfg = EPConfig(n_ranks=2, n_experts=16, top_k=2, hidden=16, max_tokens_per_rank=8)
    with pytest.raises(EPConfigError, match="EP_RUNTIME_PLACEMENT='sideways'; expected auto, walk or token"):
        _placement(cfg, 2, 8)
