"""The batched layout on the simulator (real kernels, one process per rank): dispatch_wait(layout=
"batched") returns DeepEP's low-latency batch, local expert e's row at slot pos at ``x[e, pos]``
(M = R T slots per expert; source-major, then token order), with the per-expert counts, each
slot's source token, each (expert, source rank)'s slot range and FP8 scales column-major per
expert (float32, or UE8M0 packed four to an int32), written by dispatch_batched. Exact against
:func:`ep_runtime.core.reference_batched.batched` over the awkward routings (a rank with no
tokens, an expert with none, every token to one expert, top-k 1, -1 ids, valid tokens below the
capacity), bf16 / fp8_e4m3 / fp8_e4m3_ue8m0 rows, stores and puts, every receiver, a runtime
serving other layouts too and calls in a row; bad arguments are refused before any launch.
"""

from __future__ import annotations

import numpy as np
import pytest

from ep_runtime.core.config import EPConfig
from ep_runtime.core.errors import EPConfigError
from ep_runtime.core.formats import ue8m0_value
from ep_runtime.core.reference import BF16, dispatch
from ep_runtime.core.reference_batched import batched, combine_batched
from ep_runtime.shmem.launch import run_pes
from ep_runtime.testing import input_error_of, make_inputs

RUN_TIMEOUT_S = 300
FIELDS = ("x", "counts", "src_token", "layout_range", "row_offsets", "expert_counts")
#: The weights of each case's second call (its first: the dispatch's router weights): an explicit
#: weight per slot in a few cases, no weight (1) in one, else the dispatch's again.
WEIGHTS = {"random": "array", "masked": "array", "fp8_e4m3": "array", "one_expert": None}


def base_cfg(R: int, **changes) -> dict:
    return {**dict(n_ranks=R, n_experts=2 * R, top_k=2, hidden=16, max_tokens_per_rank=5, layouts="batched"),
            **changes}


def cases(R: int) -> list:
    """(name, config dict, scenario, seed, token counts or None, plan overrides, valid tokens or
    None, the scales of each of the case's two calls)."""
    col, fp8, ue8 = ("column", "column"), dict(hidden=256, token_dtype="fp8_e4m3"), \
        dict(hidden=512, token_dtype="fp8_e4m3_ue8m0")
    return [
        ("random", base_cfg(R), "random", 1, None, None, None, col),
        ("zero_rank", base_cfg(R), "zero_rank", 3, None, None, None, col),
        ("empty_expert", base_cfg(R), "empty_expert", 4, None, None, None, col),
        ("one_expert", base_cfg(R), "one_expert", 5, (5,) * R, None, None, col),
        ("top_k_1", base_cfg(R, top_k=1), "random", 6, None, None, None, col),
        ("masked", base_cfg(R, n_experts=4 * R, top_k=3), "masked", 7, None, None, None, col),
        ("no_tokens_anywhere", base_cfg(R), "random", 8, (0,) * R, None, None, col),
        ("valid_tokens_below_capacity", base_cfg(R), "random", 9, (5,) * R, None, 3, col),
        ("hidden_5_pad_4", base_cfg(R, hidden=5, pad_multiple=4), "random", 10, None, None, None, col),
        ("fp8_e4m3", base_cfg(R, **fp8), "masked", 12, None, None, None, col),
        ("fp8_e4m3_puts", base_cfg(R, **fp8), "random", 13, None, "transport=puts", None, col),
        ("ue8m0_float_then_packed", base_cfg(R, **ue8), "random", 14, None, None, None, ("column", "packed")),
        ("ue8m0_packed_land", base_cfg(R, **ue8), "masked", 15, None, "receiver=land", None, ("packed", "packed")),
        ("bf16_puts", base_cfg(R), "masked", 16, None, "transport=puts", None, col),
        ("route_first", base_cfg(R), "random", 17, None, "receiver=route_first", None, col),
        ("with_expanded_land", base_cfg(R, layouts=("expanded", "batched")), "random", 18, None, "receiver=land",
         None, col),
    ]


def slot_outputs(cfg: EPConfig, counts: np.ndarray, rank: int) -> np.ndarray:
    """Rank ``rank``'s expert outputs [L, M, H] bf16 bits: slot (e, pos) below the count holds
    bf16((rank + 1) + e / 8 + pos / 64 + col / 256), naming where it stands; the slots past the
    count hold NaN (the combine must not read them)."""
    L, M, H = cfg.n_local_experts, cfg.n_ranks * cfg.max_tokens_per_rank, cfg.hidden
    e, pos, col = np.meshgrid(np.arange(L), np.arange(M), np.arange(H), indexing="ij")
    y = (np.float32(rank + 1) + e / 8 + pos / 64 + col / 256).astype(np.float32).astype(BF16).view(np.uint16)
    return np.where(pos < counts[:, None, None], y, np.uint16(0x7FC0))


def slot_weights(cfg: EPConfig) -> np.ndarray:
    """Explicit per-slot weights [L, M] float32: 0.5 + e / 16 + pos / 128."""
    L, M = cfg.n_local_experts, cfg.n_ranks * cfg.max_tokens_per_rank
    return (0.5 + np.arange(L)[:, None] / 16 + np.arange(M)[None, :] / 128).astype(np.float32)


def inputs(cfg: EPConfig, scenario, seed, counts, valid):
    """Every rank's inputs as passed, and as the reference sees them (the first ``valid`` rows)."""
    xs, ids, ws = make_inputs(cfg, scenario, seed, None if counts is None else list(counts))
    if valid is None:
        return (xs, ids, ws), (xs, ids, ws)
    return (xs, ids, ws), ([x[:valid] for x in xs], [i[:valid] for i in ids], [w[:valid] for w in ws])


# -- per-rank body ------------------------------------------------------------------------------
def batched_pe(session, R: int) -> dict:
    from ep_runtime.core.runtime import EPRuntime

    r = session.rank

    def round_trip(rt, cfg, passed, valid, scales, weights="dispatch"):
        xs, ids, ws = passed
        n_tokens = None if valid is None else session.to_device(np.array([valid], np.int32))
        h = rt.dispatch_async(xs[r].view(np.uint16), ids[r], ws[r], n_tokens=n_tokens)
        batch = rt.dispatch_wait(h, layout="batched", scales=scales)
        rt.synchronize()
        got = {k: session.to_host(getattr(batch, k)).copy() for k in FIELDS}
        got["scales"] = None if batch.scales is None else np.array(session.to_host(batch.scales))
        got["scales_strides"] = None if batch.scales is None else batch.scales.strides
        got["address"] = batch.x.__array_interface__["data"][0]  # (the simulator's arrays are NumPy's)
        y = slot_outputs(cfg, got["counts"], r)
        w = slot_weights(cfg) if weights == "array" else weights
        got["out"] = session.to_host(rt.combine(y, batch.handle, layout="batched", weights=w)).copy()
        return got

    results = {}
    for name, cfg_d, scenario, seed, counts, plan, valid, scales in cases(R):
        cfg = EPConfig(**cfg_d)
        passed, _ = inputs(cfg, scenario, seed, counts, valid)
        with EPRuntime(cfg, session, plan=plan) as rt:
            results[name] = [round_trip(rt, cfg, passed, valid, s, w) for s, w in zip(scales, ("dispatch", WEIGHTS.get(
                name, "dispatch")))]

    # calls in a row on a runtime serving every layout: batched between expanded and compact calls
    cfg = EPConfig(**base_cfg(R, layouts=("expanded", "compact", "dense", "batched")))
    seq, errors = [], {}
    with EPRuntime(cfg, session) as rt:
        for call in range(5):
            counts = tuple((2 * call + r2 + 1) % (cfg.max_tokens_per_rank + 1) for r2 in range(R))
            passed, _ = inputs(cfg, "masked" if call % 2 else "random", 300 + call, counts, None)
            xs, ids, ws = passed
            if call % 2:
                batch = rt.dispatch(xs[r].view(np.uint16), ids[r], ws[r], layout="compact")
                rt.combine(np.zeros((R * cfg.max_tokens_per_rank, cfg.hidden), np.uint16), batch.handle,
                           layout="compact")
                seq.append(None)
                continue
            seq.append(round_trip(rt, cfg, passed, None, "column"))
        h = rt.dispatch_async(xs[r].view(np.uint16), ids[r], ws[r])
        for what, s in {"scales_packed_bf16": "packed", "scales_other": "cols"}.items():
            errors[what] = input_error_of(lambda: rt.dispatch_wait(h, layout="batched", scales=s))
        batch = rt.dispatch_wait(h, layout="compact")
        L, M, H = cfg.n_local_experts, R * cfg.max_tokens_per_rank, cfg.hidden
        y = np.zeros((L, M, H), np.uint16)
        for what, call in {
            "combine_without_batched_dispatch": lambda: rt.combine_async(y, batch.handle, layout="batched"),
        }.items():
            errors[what] = input_error_of(call)
        rt.combine(np.zeros((M, H), np.uint16), batch.handle, layout="compact")
        batch = rt.dispatch(xs[r].view(np.uint16), ids[r], ws[r], layout="batched")  # (default scales="row": bf16)
        for what, call in {
            "combine_batched_wrong_slots": lambda: rt.combine_async(y[:, :-1], batch.handle, layout="batched"),
            "combine_batched_float32": lambda: rt.combine_async(y.astype(np.float32), batch.handle, layout="batched"),
            "combine_batched_weights_shape": lambda: rt.combine_async(y, batch.handle, layout="batched",
                                                                      weights=np.ones((L, M + 1), np.float32)),
        }.items():
            errors[what] = input_error_of(call)
        rt.combine(y, batch.handle, layout="batched")
    with EPRuntime(EPConfig(**base_cfg(R, hidden=256, token_dtype="fp8_e4m3")), session) as rt:
        h = rt.dispatch_async(xs[r].view(np.uint16)[:, :1].repeat(256, axis=1), ids[r], ws[r])
        errors["scales_row_fp8"] = input_error_of(lambda: rt.dispatch_wait(h, layout="batched"))
        errors["scales_packed_fp8"] = input_error_of(lambda: rt.dispatch_wait(h, layout="batched", scales="packed"))
        rt.dispatch_wait(h, layout="batched", scales="column")
    with EPRuntime(EPConfig(**base_cfg(R, layouts="compact")), session) as rt:
        h = rt.dispatch_async(xs[r].view(np.uint16), ids[r], ws[r])
        errors["not_served"] = input_error_of(lambda: rt.dispatch_wait(h, layout="batched", scales="column"))
        errors["views_not_served"] = input_error_of(lambda: rt.batched_views())
        rt.dispatch_wait(h, layout="compact")
    return {"cases": results, "sequence": seq, "errors": errors}


@pytest.fixture(scope="module", params=[2, 3])
def sim(request):
    R = request.param
    return R, run_pes(batched_pe, R, args=(R,), timeout_s=RUN_TIMEOUT_S)


# -- checks -----------------------------------------------------------------------------------
def check_batched(got: dict, cfg: EPConfig, seen, r: int, scales: str, what: str) -> None:
    """Every expert's rows exact (words, source tokens, scales in the asked layout), its count and
    each source's slot range; the scales a column-major view of the last two dimensions."""
    ref = batched(*seen, cfg)[r]
    L, M = cfg.n_local_experts, cfg.n_ranks * cfg.max_tokens_per_rank
    assert got["x"].shape[:2] == (L, M) and got["src_token"].shape == (L, M), what
    np.testing.assert_array_equal(got["counts"], ref.counts, err_msg=f"{what}: rank {r}: counts")
    np.testing.assert_array_equal(got["expert_counts"], ref.counts, err_msg=f"{what}: rank {r}: expert_counts")
    np.testing.assert_array_equal(got["layout_range"], ref.layout_range, err_msg=f"{what}: rank {r}: layout_range")
    for e in range(L):
        c = int(ref.counts[e])
        bad = np.flatnonzero((got["x"][e, :c] != ref.x[e, :c].view(got["x"].dtype)).any(axis=1))
        assert not len(bad), (f"{what}: rank {r}: expert {e}: slots {bad[:8]} (rank {ref.src_rank[e, bad[:8]]}, "
                              f"token {ref.src_token[e, bad[:8]]}) differ")
        np.testing.assert_array_equal(got["src_token"][e, :c], ref.src_token[e, :c], err_msg=f"{what}: src_token")
        if ref.scales is None:
            continue
        if scales == "packed":
            assert got["scales"].dtype == np.int32 and got["scales"].shape == (L, M, ref.scales.shape[2] // 4), what
            codes = np.ascontiguousarray(got["scales"][e, :c]).view(np.uint8)  # little-endian: block 4j + i, byte i
            np.testing.assert_array_equal(codes, ref.scales[e, :c], err_msg=f"{what}: expert {e}: packed scales")
        else:
            want = ue8m0_value(ref.scales[e, :c]) if ref.scales.dtype == np.uint8 else ref.scales[e, :c]
            assert got["scales"].dtype == np.float32, what
            np.testing.assert_array_equal(got["scales"][e, :c].view(np.uint32), want.view(np.uint32),
                                          err_msg=f"{what}: expert {e}: scales")
    if ref.scales is None:
        assert got["scales"] is None, what
    else:
        item = got["scales"].dtype.itemsize
        S = got["scales"].shape[2]
        assert got["scales_strides"] == (S * M * item, item, M * item), f"{what}: not column-major per expert"


def test_batched_dispatch_equals_the_reference_exactly(sim):
    R, per_rank = sim
    for name, cfg_d, scenario, seed, counts, plan, valid, scales in cases(R):
        cfg = EPConfig(**cfg_d)
        _, seen = inputs(cfg, scenario, seed, counts, valid)
        for r, res in enumerate(per_rank):
            for call, s in enumerate(scales):
                check_batched(res["cases"][name][call], cfg, seen, r, s, f"{name} call {call} ({s})")


def want_combine(cfg: EPConfig, seen, weights) -> list:
    refs = batched(*seen, cfg)
    ys = [slot_outputs(cfg, ref.counts, r) for r, ref in enumerate(refs)]
    w = [slot_weights(cfg)] * cfg.n_ranks if weights == "array" else weights
    return combine_batched(ys, dispatch(*seen, cfg), seen[1], cfg, weights=w)


def test_batched_combine_equals_the_reference(sim):
    """Exact on the simulator (no FMA contraction; the reference's summation order): each
    token's partial sums its slots' outputs read through batched_token_rows, times the dispatch's
    router weights, an explicit weight per slot or 1, and no slot past a count is read (NaN)."""
    R, per_rank = sim
    for name, cfg_d, scenario, seed, counts, plan, valid, scales in cases(R):
        cfg = EPConfig(**cfg_d)
        passed, seen = inputs(cfg, scenario, seed, counts, valid)
        for call, weights in enumerate(("dispatch", WEIGHTS.get(name, "dispatch"))):
            want = want_combine(cfg, seen, weights)
            for r, res in enumerate(per_rank):
                got = res["cases"][name][call]["out"]
                assert got.shape == (len(passed[0][r]), cfg.hidden), name
                got = got[:len(seen[0][r])]  # (valid tokens below the capacity: the first valid rows)
                assert not np.isnan(got.view(BF16).astype(np.float32)).any(), f"{name}: rank {r}: NaN"
                np.testing.assert_array_equal(got, want[r].view(np.uint16),
                                              err_msg=f"{name} call {call} ({weights}): rank {r}")


def test_batched_calls_repeat_into_the_same_memory(sim):
    R, per_rank = sim
    for name, *_ in cases(R):
        for r, res in enumerate(per_rank):
            first, second = res["cases"][name]
            assert first["address"] == second["address"], name
            np.testing.assert_array_equal(first["counts"], second["counts"], err_msg=name)


def test_batched_calls_in_a_row_on_a_runtime_serving_every_layout(sim):
    R, per_rank = sim
    cfg = EPConfig(**base_cfg(R, layouts=("expanded", "compact", "dense", "batched")))
    for call in range(0, 5, 2):
        counts = tuple((2 * call + r2 + 1) % (cfg.max_tokens_per_rank + 1) for r2 in range(R))
        _, seen = inputs(cfg, "random", 300 + call, counts, None)
        want = want_combine(cfg, seen, "dispatch")
        for r, res in enumerate(per_rank):
            check_batched(res["sequence"][call], cfg, seen, r, "column", f"call {call}")
            np.testing.assert_array_equal(res["sequence"][call]["out"], want[r].view(np.uint16),
                                          err_msg=f"call {call}: rank {r}")
    for res in per_rank:
        assert len({res["sequence"][c]["address"] for c in (0, 2, 4)}) == 1


def test_bad_batched_calls_are_refused_before_launch(sim):
    _, per_rank = sim
    for res in per_rank:
        e = res["errors"]
        assert e["scales_packed_bf16"] and "'fp8_e4m3_ue8m0'" in e["scales_packed_bf16"], e
        assert e["scales_other"] and "scales='cols'" in e["scales_other"], e
        assert e["scales_row_fp8"] and "column-major per expert" in e["scales_row_fp8"], e
        assert e["scales_packed_fp8"] and "hidden a multiple of 512" in e["scales_packed_fp8"], e
        assert e["not_served"] and "including 'batched'" in e["not_served"], e
        assert e["views_not_served"] and "'batched' in EPConfig.layouts" in e["views_not_served"], e
        assert e["combine_without_batched_dispatch"] and "dispatch_wait(handle, layout='batched')" in \
            e["combine_without_batched_dispatch"], e
        assert e["combine_batched_wrong_slots"] and "M = n_ranks * max_tokens_per_rank" in \
            e["combine_batched_wrong_slots"], e
        assert e["combine_batched_float32"] and "expert_out must have dtype" in e["combine_batched_float32"], e
        assert e["combine_batched_weights_shape"] and "a weight per batched slot" in \
            e["combine_batched_weights_shape"], e


def test_the_batched_layout_refuses_nvfp4():
    with pytest.raises(EPConfigError, match="batched layout"):
        EPConfig(**base_cfg(2, hidden=64, token_dtype="nvfp4"))
