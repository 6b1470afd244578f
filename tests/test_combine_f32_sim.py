"""float32 combine partials (``EPConfig.combine_dtype="float32"``) through the real kernels on the
simulator, one process per rank, at 2 and 4 ranks.

- Both layouts equal :func:`ep_runtime.core.reference.combine` / :func:`~ep_runtime.core.reference.combine_rows`
  in float32 mode bit for bit (the simulator has no FMA), hence within
  ``combine_tolerance(..., "float32")``, on routing scenarios with rows that encode their
  origin (:func:`ep_runtime.testing.make_inputs`, ``linear_experts``), the awkward ones
  included (a rank with no tokens, an expert with none, every token to one expert, top-1, no
  tokens anywhere, rows cut into parts, multi-pass rows, FP8 tokens); the compact rows are
  float32 values that bf16 cannot hold (``x (rank + 2) / 3``), so a rounding would show.
- ``combine_wait(reduce=False)`` returns float32 partials ``[R, T, H]``, the reference's
  unrounded partials bit for bit (zeros where a token did not go: the output starts as NaN).
- Run to run (a second runtime) the output is bit-identical; an epilogue sees the float32 sum.
- Precision: with partials that cancel across ranks (many local experts per token, outputs of
  magnitudes 2**0 .. 2**12), the float32 mode's error against the float64 exact combine is far
  below the bf16 mode's, and each is within :func:`ep_runtime.core.reference.combine_error_bound`.
- Wrong dtypes are refused before launch (bf16 compact rows in float32 mode and the reverse,
  the partials' output array), and so is a hidden size float32 partials cannot move.
"""

from __future__ import annotations

import numpy as np
import pytest

from ep_runtime.core import reference
from ep_runtime.core.config import EPConfig
from ep_runtime.core.errors import EPConfigError
from ep_runtime.core.layout import BufferLayout
from ep_runtime.core.reference import BF16
from ep_runtime.shmem.launch import run_pes
from ep_runtime.testing import POISON_BF16, expert_outputs, input_error_of, linear_experts, make_inputs

WORLD_SIZES = (2, 4)
RUN_TIMEOUT_S = 300
#: float32 quiet NaN: compact rows of tokens that did not come here.
POISON_F32 = np.uint32(0x7FC00000).view(np.float32)
#: float32 NaN with a payload: what reduce=False's output holds before the kernel writes it.
UNWRITTEN_F32 = np.uint32(0x7FC0BEEF).view(np.float32)


def base_cfg(R: int, **changes) -> dict:
    return {**dict(n_ranks=R, n_experts=2 * R, top_k=2, hidden=16, max_tokens_per_rank=6,
                   combine_dtype="float32"), **changes}


def cases(R: int) -> list:
    """(name, config dict, scenario, seed, token counts or None)."""
    out = [
        ("random", base_cfg(R), "random", 1, None),
        ("random_3_local_experts_top3", base_cfg(R, n_experts=3 * R, top_k=3), "random", 2, None),
        ("zero_rank", base_cfg(R), "zero_rank", 3, None),
        ("empty_expert", base_cfg(R), "empty_expert", 4, None),
        ("one_expert", base_cfg(R), "one_expert", 5, None),
        ("top_k_1", base_cfg(R, top_k=1), "random", 6, None),
        ("pad_4", base_cfg(R, pad_multiple=4), "random", 9, None),
        # 5 token words, 10 partial words per row: odd word counts
        ("hidden_20", base_cfg(R, hidden=20), "random", 12, None),
        # rows longer than one pass of every words-in-flight loop (138 token words, 276 partial words)
        ("hidden_552_n_sms_3", base_cfg(R, hidden=552, n_sms=3), "random", 15, (6,) * R),
        # 3 rows on 8 one-warp blocks: rows cut into parts, each part's partial words put alone
        ("row_parts_wide_rows", base_cfg(R, hidden=256, max_tokens_per_rank=3, n_sms=8), "random", 24, (3,) * R),
        ("no_tokens_anywhere", base_cfg(R), "random", 17, (0,) * R),
    ]
    if R == 2:  # combine does not depend on the token format; one FP8 case shows the kernels pair up
        out.append(("fp8_tokens", base_cfg(R, hidden=128, token_dtype="fp8_e4m3"), "random", 18, None))
    return out


def inputs(cfg: EPConfig, scenario, seed, counts):
    return make_inputs(cfg, scenario, seed, None if counts is None else list(counts))


def compact_rows(cfg: EPConfig, xs, ids, rank: int) -> np.ndarray:
    """The compact combine input of ``rank``: [R * T, H] float32, row ``s * T + t`` =
    ``f32(x_s[t]) * (rank + 2) / 3`` (not a bf16 value) where token (s, t) came here,
    POISON_F32 elsewhere."""
    x, defined = reference.receive_rows(xs, ids, cfg)[rank]
    rows = x.astype(np.float32) * np.float32(rank + 2) / np.float32(3)
    rows[~defined] = POISON_F32
    return rows


def aux_for(rank: int, n_tokens: int, hidden: int) -> np.ndarray:
    """The epilogue's residual of rank ``rank``: [T, H] float32."""
    return np.random.default_rng(2000 + rank).standard_normal((n_tokens, hidden)).astype(np.float32)


def residual_add(value, token, col, aux):
    """Epilogue body (made a Numba device function in the PEs): value + aux[token, col]."""
    return value + aux[token, col]


# -- the precision inputs ---------------------------------------------------------------------------
#: Local expert i of every rank scales its rows by PRECISION_SIGN(rank) * 2**PRECISION_EXPONENTS[i]
#: (exact in bf16): outputs of magnitudes 2**0 .. 2**12 times the token's values.
PRECISION_EXPONENTS = (12, 8, 4, 0)


def precision_cfg(R: int, combine_dtype: str) -> EPConfig:
    """4 local experts per rank, top-8: every token hits all 4 experts of 2 ranks."""
    return EPConfig(n_ranks=R, n_experts=4 * R, top_k=8, hidden=16, max_tokens_per_rank=6,
                    combine_dtype=combine_dtype)


def precision_inputs(R: int):
    """Tokens (:func:`make_inputs`, origin-encoding), and routing where each token's two
    ranks q, q + 1 (opposite signs) have weights w and w' on their experts i = 0..3. Even
    tokens: w' = w except for i = 3 (the 2**0 expert), so the two partials, about 2**12 |x|
    each, cancel to about |x|: a bf16 rounding of a partial costs ~2**4 |x|, of the result
    ~2**-9 |x|. Odd tokens: independent weights (mixed magnitudes, little cancellation)."""
    cfg = precision_cfg(R, "float32")
    xs, _, _ = make_inputs(cfg, "random", 77, [cfg.max_tokens_per_rank] * R)
    rng = np.random.default_rng(78)
    L, ids, ws = cfg.n_local_experts, [], []
    for s, x in enumerate(xs):
        i_s = np.zeros((len(x), 8), np.int32)
        w_s = np.zeros((len(x), 8), np.float32)
        for t in range(len(x)):
            q = (s + t) % R
            q2 = (q + 1) % R
            w = rng.uniform(0.25, 1.0, 4).astype(np.float32)
            w2 = w.copy() if t % 2 == 0 else rng.uniform(0.25, 1.0, 4).astype(np.float32)
            w2[3] = rng.uniform(0.25, 1.0)
            i_s[t] = [q * L + i for i in range(L)] + [q2 * L + i for i in range(L)]
            w_s[t] = np.concatenate([w, w2])
        ids.append(i_s)
        ws.append(w_s)
    return xs, ids, ws


def precision_outputs(cfg: EPConfig, ref: reference.ExpertBatchRef, rank: int) -> np.ndarray:
    """[capacity, H] bf16 bits: row of local expert i = bf16(sign(rank) 2**PRECISION_EXPONENTS[i] x)
    (exact), sign + on even ranks, - on odd; POISON_BF16 on padding and past the batch."""
    y = np.full((cfg.recv_rows_capacity, cfg.hidden), POISON_BF16, np.uint16)
    n = ref.n_rows
    sign = 1.0 if rank % 2 == 0 else -1.0
    scale = np.repeat(np.array([sign * 2.0**k for k in PRECISION_EXPONENTS], np.float32),
                      np.diff(ref.row_offsets))[:, None]
    y[:n] = (ref.x.astype(np.float32) * scale).astype(BF16).view(np.uint16)
    y[:n][ref.src_rank < 0] = POISON_BF16
    return y


# -- per-rank bodies (run in the PE processes) -----------------------------------------------------
def f32_pe(session, R: int) -> dict:
    """Every case on this rank: per case one runtime, three calls (expanded, expanded with
    reduce=False, compact); the repeat, the epilogue, the refused inputs and the precision runs."""
    from numba import cuda

    from ep_runtime.core.runtime import EPRuntime

    r = session.rank

    def expanded(rt, cfg, xs, ids, ws, **kwargs):
        batch = rt.dispatch(xs[r].view(np.uint16), ids[r], ws[r])
        y = expert_outputs(cfg, reference.dispatch(xs, ids, ws, cfg)[r], r)
        return session.to_host(rt.combine(y, batch.handle, **kwargs))

    def partials(rt, cfg, xs, ids, ws):
        batch = rt.dispatch(xs[r].view(np.uint16), ids[r], ws[r])
        y = expert_outputs(cfg, reference.dispatch(xs, ids, ws, cfg)[r], r)
        out = np.full((R, len(xs[r]), cfg.hidden), UNWRITTEN_F32, np.float32)
        returned = rt.combine_wait(rt.combine_async(y, batch.handle), out=out, reduce=False)
        rt.synchronize()
        allocated = rt.combine(y, rt.dispatch(xs[r].view(np.uint16), ids[r], ws[r]).handle, reduce=False)
        return {"out": session.to_host(out), "returned_is_out": returned is out,
                "allocated": session.to_host(allocated)}

    def compact(rt, cfg, xs, ids, ws):
        batch = rt.dispatch(xs[r].view(np.uint16), ids[r], ws[r], layout="compact")
        return session.to_host(rt.combine(compact_rows(cfg, xs, ids, r), batch.handle, layout="compact"))

    results = {}
    for name, cfg_d, scenario, seed, counts in cases(R):
        cfg = EPConfig(**cfg_d)
        xs, ids, ws = inputs(cfg, scenario, seed, counts)
        with EPRuntime(cfg, session) as rt:
            results[name] = {"expanded": expanded(rt, cfg, xs, ids, ws), "partials": partials(rt, cfg, xs, ids, ws),
                             "compact": compact(rt, cfg, xs, ids, ws)}
        if name == "random":  # run to run: a fresh runtime, the same call
            with EPRuntime(cfg, session) as rt:
                results[name]["repeat"] = expanded(rt, cfg, xs, ids, ws)

    cfg = EPConfig(**base_cfg(R, n_experts=3 * R, top_k=3, hidden=20))
    xs, ids, ws = inputs(cfg, "random", 41, None)
    with EPRuntime(cfg, session) as rt:
        results["epilogue"] = expanded(rt, cfg, xs, ids, ws, epilogue=cuda.jit(device=True)(residual_add),
                                       aux=aux_for(r, len(xs[r]), cfg.hidden))

    results["refused"] = refused_inputs(session, R)
    results["precision"] = {}
    for mode in ("bfloat16", "float32"):
        cfg = precision_cfg(R, mode)
        xs, ids, ws = precision_inputs(R)
        with EPRuntime(cfg, session) as rt:
            batch = rt.dispatch(xs[r].view(np.uint16), ids[r], ws[r])
            y = precision_outputs(cfg, reference.dispatch(xs, ids, ws, cfg)[r], r)
            results["precision"][mode] = session.to_host(rt.combine(y, batch.handle))
    return results


def refused_inputs(session, R: int) -> dict:
    """Wrong partial dtypes in each mode, each refused before launch, then a good call on the
    same runtime (it stays usable)."""
    from ep_runtime.core.runtime import EPRuntime

    r, errors, after = session.rank, {}, {}
    for mode in ("float32", "bfloat16"):
        cfg = EPConfig(**base_cfg(R, combine_dtype=mode))
        xs, ids, ws = inputs(cfg, "random", 51, None)
        rows = compact_rows(cfg, xs, ids, r)
        wrong_rows = rows.astype(BF16) if mode == "float32" else rows
        good_rows = rows if mode == "float32" else rows.astype(BF16)
        shape = (R, len(xs[r]), cfg.hidden)
        wrong_out = np.zeros(shape, np.uint16 if mode == "float32" else np.float32)
        with EPRuntime(cfg, session) as rt:
            batch = rt.dispatch(xs[r], ids[r], ws[r], layout="compact")
            errors[mode, "compact_rows"] = input_error_of(
                lambda: rt.combine_async(wrong_rows, batch.handle, layout="compact"))
            y = expert_outputs(cfg, reference.dispatch(xs, ids, ws, cfg)[r], r)
            errors[mode, "expanded_float32_outputs"] = input_error_of(
                lambda: rt.combine_async(y.view(BF16).astype(np.float32), batch.handle))
            chandle = rt.combine_async(good_rows, batch.handle, layout="compact")
            errors[mode, "partials_out"] = input_error_of(lambda: rt.combine_wait(chandle, out=wrong_out, reduce=False))
            out = rt.combine_wait(chandle, reduce=False)
            rt.synchronize()
            after[mode] = {"dtype": np.dtype(out.dtype).name, "out": session.to_host(out),
                           "rows_dtype": np.dtype(good_rows.dtype).name}
    return {"errors": errors, "after": after}


@pytest.fixture(scope="module", params=WORLD_SIZES)
def sim(request):
    R = request.param
    return R, run_pes(f32_pe, R, args=(R,), timeout_s=RUN_TIMEOUT_S)


# -- checks -------------------------------------------------------------------------------------------
def bits32(a) -> np.ndarray:
    return np.ascontiguousarray(a, np.float32).view(np.uint32)


def case_reference(cfg: EPConfig, xs, ids, ws, reduce: bool = True):
    refs = reference.dispatch(xs, ids, ws, cfg)
    return reference.combine([expert_outputs(cfg, b, r) for r, b in enumerate(refs)], refs, ids, cfg, reduce=reduce)


def mismatches(got_bits: np.ndarray, want_bits: np.ndarray, what: str) -> str:
    bad = np.argwhere(got_bits != want_bits)
    return f"{what}: {len(bad)} elements differ, first (index, got, want): " + ", ".join(
        f"({tuple(i)}, {got_bits[tuple(i)]:#x}, {want_bits[tuple(i)]:#x})" for i in bad[:6])


def test_expanded_combine_equals_the_float32_reference_bit_for_bit_and_within_tolerance(sim):
    R, per_rank = sim
    for name, cfg_d, scenario, seed, counts in cases(R):
        cfg = EPConfig(**cfg_d)
        xs, ids, ws = inputs(cfg, scenario, seed, counts)
        want = case_reference(cfg, xs, ids, ws)
        y_max = max(float(np.abs(expert_outputs(cfg, b, r).view(BF16)[:b.n_rows][b.src_rank >= 0]
                                 .astype(np.float32)).max(initial=0))
                    for r, b in enumerate(reference.dispatch(xs, ids, ws, cfg)))
        for r, res in enumerate(per_rank):
            got = res[name]["expanded"]
            assert got.dtype == np.uint16 and got.shape == want[r].shape, name
            np.testing.assert_array_equal(got, want[r].view(np.uint16), err_msg=f"{name}: rank {r}")
            err = np.abs(got.view(BF16).astype(np.float32) - want[r].astype(np.float32))
            assert (err <= reference.combine_tolerance(ws[r], y_max, "float32")).all(), f"{name}: rank {r}"


def test_the_float32_reference_differs_from_the_bf16_one(sim):
    """The cases can tell the modes apart: bf16 partial rounding changes some outputs."""
    R, _ = sim
    differ = 0
    for name, cfg_d, scenario, seed, counts in cases(R):
        cfg = EPConfig(**cfg_d)
        xs, ids, ws = inputs(cfg, scenario, seed, counts)
        f32 = case_reference(cfg, xs, ids, ws)
        bf16 = case_reference(EPConfig(**{**cfg_d, "combine_dtype": "bfloat16"}), xs, ids, ws)
        differ += sum(int((a.view(np.uint16) != b.view(np.uint16)).sum()) for a, b in zip(f32, bf16))
    assert differ > 0


def test_reduce_false_returns_the_unrounded_float32_partials(sim):
    R, per_rank = sim
    for name, cfg_d, scenario, seed, counts in cases(R):
        cfg = EPConfig(**cfg_d)
        xs, ids, ws = inputs(cfg, scenario, seed, counts)
        want = case_reference(cfg, xs, ids, ws, reduce=False)
        for r, res in enumerate(per_rank):
            p = res[name]["partials"]
            assert p["returned_is_out"], f"{name}: rank {r}: combine_wait(out=...) must return out"
            for key in ("out", "allocated"):
                got = p[key]
                assert got.dtype == np.float32 and got.shape == (R, len(xs[r]), cfg.hidden), (name, key, got.dtype)
                assert want[r].dtype == np.float32
                assert np.array_equal(bits32(got), bits32(want[r])), \
                    mismatches(bits32(got), bits32(want[r]), f"{name} ({key}): rank {r}")


def test_compact_combine_equals_the_float32_reference_bit_for_bit(sim):
    """Compact rows not for a rank hold NaN there: reading one would show."""
    R, per_rank = sim
    for name, cfg_d, scenario, seed, counts in cases(R):
        cfg = EPConfig(**cfg_d)
        xs, ids, ws = inputs(cfg, scenario, seed, counts)
        rows = [compact_rows(cfg, xs, ids, r) for r in range(R)]
        want = reference.combine_rows(rows, ids, cfg)
        rounded = reference.combine_rows([x.astype(BF16) for x in rows], ids, EPConfig(**{**cfg_d, "combine_dtype":
                                                                                          "bfloat16"}))
        for r, res in enumerate(per_rank):
            np.testing.assert_array_equal(res[name]["compact"], want[r].view(np.uint16), err_msg=f"{name}: rank {r}")
        if name == "random":  # the rows are not bf16 values: sending them rounded would change the output
            assert any((w.view(np.uint16) != b.view(np.uint16)).any() for w, b in zip(want, rounded))


def test_combine_is_bit_identical_run_to_run(sim):
    _, per_rank = sim
    for r, res in enumerate(per_rank):
        assert np.array_equal(res["random"]["repeat"], res["random"]["expanded"]), f"rank {r}"


def test_epilogue_sees_the_float32_sum_of_float32_partials(sim):
    R, per_rank = sim
    cfg = EPConfig(**base_cfg(R, n_experts=3 * R, top_k=3, hidden=20))
    xs, ids, ws = inputs(cfg, "random", 41, None)
    partials = case_reference(cfg, xs, ids, ws, reduce=False)
    L = cfg.n_local_experts
    for r, res in enumerate(per_rank):
        acc = np.zeros((len(xs[r]), cfg.hidden), np.float32)
        for q in range(R):
            went = np.any(ids[r] // L == q, axis=1)[:, None]
            acc = np.where(went, acc + partials[r][q], acc)
        want = (acc + aux_for(r, len(xs[r]), cfg.hidden)).astype(BF16)
        np.testing.assert_array_equal(res["epilogue"], want.view(np.uint16), err_msg=f"rank {r}")


def test_float32_partials_are_more_precise_than_bf16_and_within_their_bounds(sim):
    R, per_rank = sim
    xs, ids, ws = precision_inputs(R)
    errors, beyond_f32_bound = {}, {}
    for mode in ("bfloat16", "float32"):
        cfg = precision_cfg(R, mode)
        refs = reference.dispatch(xs, ids, ws, cfg)
        ys = [precision_outputs(cfg, b, r) for r, b in enumerate(refs)]
        exact = reference.combine_exact(ys, refs, ids, cfg)
        abs_terms = reference.combine_exact(ys, refs, ids, cfg, absolute=True)
        want = reference.combine(ys, refs, ids, cfg)
        worst, beyond = 0.0, 0
        for r, res in enumerate(per_rank):
            got = res["precision"][mode]
            np.testing.assert_array_equal(got, want[r].view(np.uint16), err_msg=f"{mode}: rank {r}")
            err = np.abs(got.view(BF16).astype(np.float64) - exact[r])
            bound = reference.combine_error_bound(exact[r], abs_terms[r], cfg.top_k, mode)
            assert (err <= bound).all(), f"{mode}: rank {r}: error {err.max()} beyond its bound"
            beyond += int((err > reference.combine_error_bound(exact[r], abs_terms[r], cfg.top_k, "float32")).sum())
            # the error relative to the result's own scale (|exact| + 1: x is O(1))
            worst = max(worst, float((err / (np.abs(exact[r]) + 1)).max()))
        errors[mode], beyond_f32_bound[mode] = worst, beyond
    # float32's error is the output's rounding, far below bf16's (figures: docs/plans.md)
    assert errors["float32"] < errors["bfloat16"] / 16, errors
    # the bf16 partials' rounding is what the float32 bound leaves out: bf16 outputs break it
    assert beyond_f32_bound["bfloat16"] > 0 and beyond_f32_bound["float32"] == 0, beyond_f32_bound


def test_wrong_partial_dtypes_are_refused_before_launch(sim):
    R, per_rank = sim
    for r, res in enumerate(per_rank):
        e, after = res["refused"]["errors"], res["refused"]["after"]
        msg = e["float32", "compact_rows"]
        assert msg and all(f in msg for f in ("combine_async: expert_out has dtype bfloat16 (uint16 bits)",
                                              "combine_dtype is 'float32'", "pass float32",
                                              "combine_dtype='bfloat16'")), msg
        msg = e["bfloat16", "compact_rows"]
        assert msg and all(f in msg for f in ("expert_out has dtype float32", "combine_dtype is 'bfloat16'",
                                              "pass bfloat16", "combine_dtype='float32'")), msg
        for mode in ("float32", "bfloat16"):
            msg = e[mode, "expanded_float32_outputs"]  # expert outputs are bf16 in both modes
            assert msg and "expert_out must have dtype bfloat16" in msg, msg
        msg = e["float32", "partials_out"]
        assert msg and "combine_wait: out has dtype bfloat16 (uint16 bits)" in msg and "reduce=False's partials" \
            in msg, msg
        msg = e["bfloat16", "partials_out"]
        assert msg and "combine_wait: out has dtype float32" in msg, msg
        # the runtime went on: the good call's partials are the reference's, in the mode's dtype
        for mode, dtype in (("float32", "float32"), ("bfloat16", "uint16")):
            assert after[mode]["dtype"] == dtype, after[mode]
            cfg = EPConfig(**base_cfg(R, combine_dtype=mode))
            xs, ids, ws = inputs(cfg, "random", 51, None)
            L, T = cfg.n_local_experts, cfg.max_tokens_per_rank
            rows = [compact_rows(cfg, xs, ids, q) for q in range(R)]
            rows = rows if mode == "float32" else [x.astype(BF16).view(np.uint16) for x in rows]
            for q in range(R):
                went = np.any(ids[r] // L == q, axis=1)[:, None]
                want = np.where(went, rows[q][r * T:r * T + len(xs[r])], 0)
                got = after[mode]["out"][q]
                assert np.array_equal(got.view(np.uint32 if mode == "float32" else np.uint16),
                                      want.view(np.uint32 if mode == "float32" else np.uint16)), (mode, r, q)


# -- host only: config, layout, reference, traffic ------------------------------------------------------
@pytest.mark.parametrize("hidden", [2, 6, 18, 7170])
def test_hidden_not_a_multiple_of_4_is_refused_with_float32_partials(hidden):
    with pytest.raises(EPConfigError) as info:
        EPConfig(n_ranks=2, n_experts=4, top_k=2, hidden=hidden, max_tokens_per_rank=4, combine_dtype="float32")
    msg = str(info.value)
    up = -(-hidden // 4) * 4
    assert all(f in msg for f in (f"EPConfig.hidden={hidden} with combine_dtype='float32'", "multiple of 4",
                                  f"pad hidden to {up}", "combine_dtype='bfloat16'")), msg
    EPConfig(n_ranks=2, n_experts=4, top_k=2, hidden=hidden, max_tokens_per_rank=4)  # bf16 partials: fine


def test_layout_holds_float32_partials_of_twice_the_bytes():
    kw = dict(n_ranks=2, n_experts=4, top_k=2, hidden=12, max_tokens_per_rank=5)
    bf16, f32 = BufferLayout(EPConfig(**kw)), BufferLayout(EPConfig(**kw, combine_dtype="float32"))
    # (the last three: the hierarchical transport's)
    partials = ("combine_partials", "combine_stage", "relay_partials", "relay_sums", "combine_sums")
    for name in partials:
        a, b = bf16.region(name), f32.region(name)
        assert (a.dtype, b.dtype) == (np.dtype(np.uint16), np.dtype(np.float32)) and a.shape == b.shape
        assert b.nbytes == 2 * a.nbytes and "float32" in b.doc and "bf16 bits" in a.doc
    same = [r.name for r in bf16.regions if r.name not in partials]
    assert all(bf16.region(n).nbytes == f32.region(n).nbytes for n in same)
    assert "combine_partials" in f32.describe() and "float32" in f32.describe()


def test_reference_modes_differ_only_by_the_rounding_of_the_partials():
    cfg = EPConfig(n_ranks=3, n_experts=9, top_k=3, hidden=8, max_tokens_per_rank=5, combine_dtype="float32")
    bcfg = EPConfig(**{**cfg.as_dict(), "combine_dtype": "bfloat16"})
    xs, ids, ws = make_inputs(cfg, "random", 5)
    refs = reference.dispatch(xs, ids, ws, cfg)
    ys = [linear_experts(b.x, b.row_offsets, cfg.n_local_experts, r) for r, b in enumerate(refs)]
    p32 = reference.combine(ys, refs, ids, cfg, reduce=False)
    p16 = reference.combine(ys, refs, ids, bcfg, reduce=False)
    L = cfg.n_local_experts
    for s in range(cfg.n_ranks):
        assert p32[s].dtype == np.float32 and p16[s].dtype == BF16
        np.testing.assert_array_equal(p32[s].astype(BF16).view(np.uint16), p16[s].view(np.uint16))
        # reduced = the float32 sum in rank order of the partials (rounded or not), rounded once
        for c, parts in ((cfg, p32[s]), (bcfg, p16[s].astype(np.float32))):
            acc = np.zeros(parts.shape[1:], np.float32)
            for r in range(cfg.n_ranks):
                went = np.any(ids[s] // L == r, axis=1)[:, None]
                acc = np.where(went, acc + parts[r], acc)
            np.testing.assert_array_equal(reference.combine(ys, refs, ids, c)[s].view(np.uint16),
                                          acc.astype(BF16).view(np.uint16))
    with pytest.raises(ValueError, match="compact rows must be float32"):
        reference.combine_rows([np.zeros((15, 8), np.uint16)] * 3, ids, cfg)


def test_tolerance_and_bound_of_each_mode():
    w = np.array([[0.5, 0.25], [1.0, 1.0]], np.float32)
    bf16 = reference.combine_tolerance(w, 4.0)
    f32 = reference.combine_tolerance(w, 4.0, "float32")
    np.testing.assert_allclose(bf16[:, 0], 2 * 2.0**-7 * np.array([3.0, 8.0]))
    np.testing.assert_allclose(f32[:, 0], (2.0**-7 + 2 * 2.0**-21) * np.array([3.0, 8.0]))
    exact, terms = np.array([1.0, -0.5]), np.array([1024.0, 3.0])
    b32 = reference.combine_error_bound(exact, terms, 8, "float32")
    b16 = reference.combine_error_bound(exact, terms, 8, "bfloat16")
    np.testing.assert_allclose(b32, 2.0**-8 * np.abs(exact) + 8 * 2.0**-22 * terms)
    np.testing.assert_allclose(b16 - b32, 2.0**-8 * (1 + 2.0**-6) * terms)


def test_traffic_counts_float32_partials_twice():
    from ep_runtime.tools.bench.traffic import rank_traffic

    ids0 = np.array([[0, 1], [0, 2], [2, 3]])
    ids1 = np.array([[3, 1]])
    t = rank_traffic([ids0, ids1], 0, n_local_experts=2, hidden=8)
    f = rank_traffic([ids0, ids1], 0, n_local_experts=2, hidden=8, partial_bytes=32)
    assert f.combine_nvlink_bytes == 2 * t.combine_nvlink_bytes == 2 * 32
    # expert outputs (4 rows) and the result (3 rows) stay bf16; the 4 partials of this rank's
    # tokens, written here and read by combine_wait, double
    assert f.combine_hbm_bytes == (4 + 3) * 16 + 2 * 4 * 32
    assert f.compact_combine_hbm_bytes == 3 * 16 + (3 + 2 * 2) * 32  # own partials read in place
    assert (f.dispatch_hbm_bytes, f.logical_bytes) == (t.dispatch_hbm_bytes, t.logical_bytes)
