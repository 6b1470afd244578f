"""FP8 token formats through the real kernels on the simulator: dispatch quantizes bf16 tokens in
dispatch_async (per 128-element block, :mod:`ep_runtime.core.formats`) or takes pre-quantized codes
and scales, and dispatch_wait returns E4M3 codes and their scales (row- or column-major), in the
expanded and compact layouts. Codes and scales must equal the reference bit for bit, padding rows
zero, blocks whose amax is 0 (scale 1) and blocks holding inf / NaN (NaN scale, NaN codes)
included; hidden 384 is a multiple of 128 but not of 1024. Combine (bf16 expert outputs) is
exact against the reference in these configs too. Bad FP8 arguments are refused before launch.

Both transports run at 2 ranks (the plan's ``transport``): messages encoded straight into the
peers' receive slots (pre-quantized codes as word pairs; codes 8 bytes off a 16-byte boundary
take the puts), and encoded into a stage then put.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from ep_runtime.core import reference
from ep_runtime.core.config import EPConfig
from ep_runtime.kernels.codecs.fp8 import HELD_SCALES
from ep_runtime.core.reference import BF16
from ep_runtime.shmem.launch import run_pes
from ep_runtime.testing import input_error_of, make_inputs, off_boundary, off_by_8

RUN_TIMEOUT_S = 300
POISON_BF16 = 0x7FC0
FORMATS = ("fp8_e4m3", "fp8_e4m3_ue8m0")


def cases(R: int) -> list:
    """(name, config dict, scenario, seed, prequantized, scales layout)."""
    base = dict(n_ranks=R, n_experts=2 * R, top_k=2, hidden=384, max_tokens_per_rank=6)
    out = []
    for fmt in FORMATS:
        f = fmt.replace("fp8_e4m3", "e4m3")
        out += [
            (f"{f}_random_row", {**base, "token_dtype": fmt}, "random", 1, False, "row"),
            (f"{f}_prequantized_column", {**base, "token_dtype": fmt}, "random", 2, True, "column"),
        ]
        if R == 2:
            out += [
                (f"{f}_one_expert_pad4_column", {**base, "token_dtype": fmt, "pad_multiple": 4}, "one_expert", 3,
                 False, "column"),
                (f"{f}_zero_rank_top1_h128", {**base, "token_dtype": fmt, "top_k": 1, "hidden": 128}, "zero_rank", 4,
                 False, "row"),
                (f"{f}_prequantized_float8_dtype_row", {**base, "token_dtype": fmt}, "random", 5, "float8", "row"),
                # 8 blocks of one warp for 6 tokens: each token is cut into 2 parts (blocks [0, 2)
                # and [2, 3)), encoded and put by different warps
                (f"{f}_token_parts_n_sms_8", {**base, "token_dtype": fmt, "n_sms": 8}, "random", 6, False, "row"),
                (f"{f}_prequantized_parts_n_sms_8", {**base, "token_dtype": fmt, "n_sms": 8}, "random", 7, True,
                 "column"),
                (f"{f}_prequantized_misaligned_row", {**base, "token_dtype": fmt}, "random", 8, "misaligned", "row"),
            ]
        if R == 2 and fmt == "fp8_e4m3":
            # a token part longer than the encoder's held scales (codecs.fp8.HELD_SCALES blocks):
            # its scales go out a step at a time instead of together after the codes
            out.append((f"{f}_scales_past_held_h{128 * (HELD_SCALES + 1)}",
                        {**base, "token_dtype": fmt, "hidden": 128 * (HELD_SCALES + 1), "max_tokens_per_rank": 2},
                        "random", 9, False, "row"))
    return out


def inputs(cfg: EPConfig, scenario: str, seed: int):
    """Tokens with awkward blocks: token 0's block 1 all zero (amax 0), token 1's block 0 holds
    an inf and token 2's last block a NaN (non-finite blocks), where those exist."""
    xs, ids, ws = make_inputs(cfg, scenario, seed)
    for x in xs:
        f = x.astype(np.float32)
        if len(f) > 0 and cfg.hidden >= 256:
            f[0, 128:256] = 0.0
        if len(f) > 1:
            f[1, 5] = np.inf
        if len(f) > 2:
            f[2, -3] = np.nan
        x[...] = f.astype(BF16)
    return xs, ids, ws


def prequantized_inputs(cfg: EPConfig, xs, kind):
    """Codes and scales of every rank's tokens; ``kind``: True (uint8 codes), ``"float8"``
    (float8_e4m3fn codes) or ``"misaligned"`` (uint8 codes 8 bytes past a 16-byte boundary, and
    the scales 2 bytes past a 4-byte one: float32 scales then go a byte per store, not a word
    per block)."""
    fmt = cfg.token_format
    enc = [fmt.quantize(x.view(np.uint16)) for x in xs]
    payloads = [p.view(ml_dtypes.float8_e4m3fn) if kind == "float8" else p for p, _ in enc]
    scales = [s for _, s in enc]
    if kind == "misaligned":
        payloads = [off_by_8(p) for p in payloads]
        scales = [off_boundary(s, 4, 2) for s in scales]
    return payloads, scales


def expert_outputs(cfg: EPConfig, ref: reference.ExpertBatchRef, rank: int) -> np.ndarray:
    """bf16 outputs of rank ``rank``: the decoded rows times (rank + 1); NaN on padding rows and
    past the batch (combine must never read them); non-finite decoded rows become zeros."""
    y = np.full((cfg.recv_rows_capacity, cfg.hidden), POISON_BF16, np.uint16)
    n = ref.n_rows
    dec = cfg.token_format.dequantize(ref.x, ref.scales) * np.float32(rank + 1)
    dec[~np.isfinite(dec)] = 0.0
    y[:n] = dec.astype(BF16).view(np.uint16)
    y[:n][ref.src_rank < 0] = POISON_BF16
    return y


def fp8_pe(session, R: int) -> dict:
    from ep_runtime.core.runtime import EPRuntime

    r = session.rank
    out = {}
    for name, cfg_d, scenario, seed, pre, scales in cases(R):
        cfg = EPConfig(**cfg_d)
        xs, ids, ws = inputs(cfg, scenario, seed)
        kw = {}
        tokens = xs[r].view(np.uint16)
        if pre:
            payloads, scs = prequantized_inputs(cfg, xs, pre)
            tokens, kw = payloads[r], {"token_scales": scs[r]}
        with EPRuntime(cfg, session) as rt:
            b = rt.dispatch(tokens, ids[r], ws[r], scales=scales, **kw)
            res = {"x": b.x.copy(), "scales": b.scales.copy(), "row_offsets": b.row_offsets.copy()}
            ref = reference.dispatch(xs, ids, ws, cfg)[r]
            res["out"] = rt.combine(expert_outputs(cfg, ref, r), b.handle).copy()
            cb = rt.dispatch(tokens, ids[r], ws[r], layout="compact", **kw)
            res["compact_x"], res["compact_scales"] = cb.x.copy(), cb.scales.copy()
        out[name] = res

    cfg = EPConfig(**cases(R)[0][1])
    xs, ids, ws = inputs(cfg, "random", 9)
    with EPRuntime(cfg, session) as rt:
        payloads, scs = prequantized_inputs(cfg, xs, True)
        bad = {
            "scales_wrong_shape": lambda: rt.dispatch_async(payloads[r], ids[r], ws[r], token_scales=scs[r][:, :2]),
            "scales_wrong_dtype": lambda: rt.dispatch_async(payloads[r], ids[r], ws[r],
                                                            token_scales=scs[r].astype(np.float64)),
            "codes_without_scales": lambda: rt.dispatch_async(payloads[r], ids[r], ws[r]),
            "bf16_with_scales": lambda: rt.dispatch_async(xs[r], ids[r], ws[r], token_scales=scs[r]),
        }
        errors = {what: input_error_of(call) for what, call in bad.items()}
        h = rt.dispatch_async(xs[r], ids[r], ws[r])
        errors["scales_layout"] = input_error_of(lambda: rt.dispatch_wait(h, scales="diagonal"))
        rt.dispatch_wait(h)
    bf16 = EPConfig(**{**cases(R)[0][1], "token_dtype": "bfloat16"})
    with EPRuntime(bf16, session) as rt:
        errors["scales_in_bf16_config"] = input_error_of(
            lambda: rt.dispatch_async(xs[r], ids[r], ws[r], token_scales=scs[r]))
    return {"cases": out, "errors": errors}


#: (ranks, the plan's transport)
RUNS = [(2, "stores"), (2, "puts"), (4, "stores")]


@pytest.fixture(scope="module", params=RUNS, ids=lambda p: f"R{p[0]}-{p[1]}")
def sim(request):
    R, transport = request.param
    with pytest.MonkeyPatch.context() as mp:  # the PEs are spawned with this environment
        mp.setenv("EP_RUNTIME_PLAN", f"transport={transport}")
        return R, run_pes(fp8_pe, R, args=(R,), timeout_s=RUN_TIMEOUT_S)


def test_fp8_dispatch_codes_and_scales_equal_the_reference_bit_for_bit(sim):
    R, per_rank = sim
    for name, cfg_d, scenario, seed, pre, scales in cases(R):
        cfg = EPConfig(**cfg_d)
        xs, ids, ws = inputs(cfg, scenario, seed)
        for r, res in enumerate(per_rank):
            got = res["cases"][name]
            ref = reference.dispatch(xs, ids, ws, cfg)[r]
            n, C, S = ref.n_rows, cfg.recv_rows_capacity, cfg.token_format.scale_count(cfg.hidden)
            assert got["x"].dtype == np.uint8 and got["x"].shape == (C, cfg.hidden), name
            np.testing.assert_array_equal(got["row_offsets"], ref.row_offsets, err_msg=name)
            np.testing.assert_array_equal(got["x"][:n], ref.x, err_msg=f"{name}: rank {r} codes")
            sc = got["scales"] if scales == "row" else got["scales"].T
            assert got["scales"].shape == ((C, S) if scales == "row" else (S, C)), name
            np.testing.assert_array_equal(np.ascontiguousarray(sc[:n]).view(np.uint8), ref.scales.view(np.uint8),
                                          err_msg=f"{name}: rank {r} scales ({scales}-major)")


def test_fp8_awkward_blocks_are_encoded_as_documented(sim):
    """amax 0 -> scale 1 (code 127 for UE8M0) and zero codes; inf / NaN -> NaN scale, 0x7F codes."""
    R, per_rank = sim
    name, cfg_d, scenario, seed, _, _ = cases(R)[0]
    cfg = EPConfig(**cfg_d)
    xs, ids, ws = inputs(cfg, scenario, seed)
    ref = reference.dispatch(xs, ids, ws, cfg)
    seen = set()
    for r, res in enumerate(per_rank):
        b, got = ref[r], res["cases"][name]
        for row in range(b.n_rows):
            t, s = b.src_token[row], b.src_rank[row]
            sc = got["scales"][row]
            if t == 0:
                seen.add("zero")
                assert not got["x"][row, 128:256].any()
                assert (sc[1] == 127) if cfg.token_format.scale_dtype == np.uint8 else (sc[1] == 1.0)
            if t in (1, 2):
                seen.add("nonfinite")
                blk = 0 if t == 1 else cfg.hidden // 128 - 1
                assert (got["x"][row, 128 * blk:128 * (blk + 1)] == 0x7F).all(), f"rank {r} row {row} (src {s})"
                assert (sc[blk] == 255) if cfg.token_format.scale_dtype == np.uint8 else np.isnan(sc[blk])
    assert seen == {"zero", "nonfinite"}


def test_fp8_padding_rows_have_zero_codes_and_scales(sim):
    R, per_rank = sim
    for name, cfg_d, scenario, seed, pre, scales in cases(R):
        cfg = EPConfig(**cfg_d)
        xs, ids, ws = inputs(cfg, scenario, seed)
        for r, res in enumerate(per_rank):
            ref = reference.dispatch(xs, ids, ws, cfg)[r]
            pad = np.flatnonzero(ref.src_rank < 0)
            got = res["cases"][name]
            sc = got["scales"] if scales == "row" else got["scales"].T
            assert not got["x"][pad].any() and not np.ascontiguousarray(sc[pad]).view(np.uint8).any(), name


def test_fp8_compact_layout_holds_the_reference_messages(sim):
    R, per_rank = sim
    for name, cfg_d, scenario, seed, pre, scales in cases(R):
        cfg = EPConfig(**cfg_d)
        xs, ids, ws = inputs(cfg, scenario, seed)
        for r, res in enumerate(per_rank):
            x, defined, sc = reference.receive_rows(xs, ids, cfg, with_scales=True)[r]
            got = res["cases"][name]
            np.testing.assert_array_equal(got["compact_x"][defined], x[defined], err_msg=name)
            np.testing.assert_array_equal(np.ascontiguousarray(got["compact_scales"][defined]).view(np.uint8),
                                          sc[defined].view(np.uint8),
                                          err_msg=name)


def test_fp8_combine_equals_the_reference(sim):
    R, per_rank = sim
    for name, cfg_d, scenario, seed, pre, scales in cases(R):
        cfg = EPConfig(**cfg_d)
        xs, ids, ws = inputs(cfg, scenario, seed)
        refs = reference.dispatch(xs, ids, ws, cfg)
        want = reference.combine([expert_outputs(cfg, b, r) for r, b in enumerate(refs)], refs, ids, cfg)
        for r, res in enumerate(per_rank):
            np.testing.assert_array_equal(res["cases"][name]["out"], want[r].view(np.uint16), err_msg=name)


def test_fp8_bad_arguments_are_refused_before_launch(sim):
    R, per_rank = sim
    for res in per_rank:
        e = res["errors"]
        assert e["scales_wrong_shape"] and "token_scales must have shape [" in e["scales_wrong_shape"] \
            and "hidden / 128 = 3" in e["scales_wrong_shape"], e
        assert e["scales_wrong_dtype"] and "token_scales must have dtype" in e["scales_wrong_dtype"], e
        assert e["codes_without_scales"] and "tokens must have dtype bfloat16" in e["codes_without_scales"] \
            and "token_scales" in e["codes_without_scales"], e
        assert e["bf16_with_scales"] and "tokens must have dtype uint8" in e["bf16_with_scales"], e
        assert e["scales_layout"] and "scales='diagonal'" in e["scales_layout"], e
        assert e["scales_in_bf16_config"] and "token_scales given" in e["scales_in_bf16_config"], e
