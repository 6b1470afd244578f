"""NVFP4 through the real kernels on the simulator: dispatch quantizes bf16 tokens in
dispatch_async (under the caller's global scale, or the rule's, computed on the stream first) or
takes pre-quantized codes and scales with their global scale, and dispatch_wait returns packed
E2M1 codes, E4M3 scales (row- or column-major) and each row's global scale, in the expanded and
compact layouts, equal to the reference bit for bit: blocks of zeros, of -0.0, holding inf or
NaN, with E4M3-subnormal scales, and (a global scale a tenth of the rule's) saturating scales
and codes included; a rank with no tokens, top-k 1, padding rows, token parts cut across warps
(``n_sms=8``), a token count on the device with rows past it that would change the global
scale. The codec's device conversions, run on the simulator as plain functions, equal the
reference's for every bf16 pattern and on exact rounding ties. Combine (bf16 expert outputs) is
exact against the reference. Both transports at 2 ranks (stores: encoded straight into the
peers' slots; puts: staged and put), stores at 4, and the hierarchical transport (2 x 2 logical
nodes: messages packed into its chunks, encoded or pre-quantized). Bad NVFP4 arguments are
refused before launch.
"""

from __future__ import annotations

import numpy as np
import pytest

from ep_runtime.core import reference
from ep_runtime.core.config import EPConfig
from ep_runtime.core.reference import BF16
from ep_runtime.shmem.launch import run_pes
from ep_runtime.testing import assert_fp8_calls_are_the_reference, fp8_plan_pe, input_error_of, make_inputs
from test_nvfp4_format import awkward_tokens, boundary_values, tie_tokens

RUN_TIMEOUT_S = 300
POISON_BF16 = 0x7FC0
#: Rows past a device token count: finite and larger than any real token, so a global scale
#: computed over them would differ.
PAST_COUNT = 1.0e4


def cases(R: int) -> list:
    """(name, config dict, scenario, seed, input, scales layout); input: "computed" (bf16 tokens,
    no global scale), "given" (bf16 tokens, a tenth of the rule's global scale), "prequantized",
    "device_count" (computed, T on the device)."""
    base = dict(n_ranks=R, n_experts=2 * R, top_k=2, hidden=256, max_tokens_per_rank=6, token_dtype="nvfp4")
    out = [("computed_row", base, "random", 1, "computed", "row"),
           ("prequantized_column", base, "random", 2, "prequantized", "column")]
    if R == 2:
        out += [("given_saturating_column", base, "random", 3, "given", "column"),
                ("zero_rank_top1_pad4_h128", {**base, "top_k": 1, "pad_multiple": 4, "hidden": 128}, "zero_rank", 4,
                 "computed", "row"),
                # 8 blocks of one warp for at most 6 tokens: each token in 2 parts of 8 blocks
                ("parts_n_sms_8", {**base, "n_sms": 8}, "random", 5, "computed", "row"),
                ("prequantized_parts_n_sms_8", {**base, "n_sms": 8}, "random", 6, "prequantized", "row"),
                ("device_count_row", base, "random", 7, "device_count", "row")]
    return out


def inputs(cfg: EPConfig, scenario: str, seed: int):
    """Tokens with awkward blocks where they exist: token 0's block 1 zeros and block 2 -0.0 and
    a 40.0 (its rank's largest magnitude), token 1 an inf, token 2 a NaN, token 3's block 3 tiny
    (an E4M3-subnormal scale)."""
    xs, ids, ws = make_inputs(cfg, scenario, seed)
    rng = np.random.default_rng(seed)
    for x in xs:
        f = x.astype(np.float32)
        plant = [(0, slice(16, 32), 0.0), (0, slice(32, 48), -0.0), (1, 5, np.inf), (2, -3, np.nan),
                 (3, slice(48, 64), 3e-4 * rng.standard_normal(16)), (0, 70, 40.0)]
        for t, cols, v in plant:
            if t < len(f):
                f[t, cols] = v
        x[...] = f.astype(BF16)
    return xs, ids, ws


def global_scales(cfg: EPConfig, xs, kind: str):
    """Each rank's global scale the case's dispatch uses (None: the rule's, computed by both)."""
    if kind not in ("given", "prequantized"):
        return None
    rule = [cfg.token_format.global_scale(x.view(np.uint16)) for x in xs]
    return [g / np.float32(10) for g in rule] if kind == "given" else rule


def case_reference(cfg: EPConfig, xs, ids, ws, kind: str) -> list:
    """Every rank's reference batch of a case (pre-quantized: from the codes and scales)."""
    gs = global_scales(cfg, xs, kind)
    if kind == "prequantized":
        enc = [cfg.token_format.quantize(x.view(np.uint16), g) for x, g in zip(xs, gs)]
        return reference.dispatch([c for c, _ in enc], ids, ws, cfg, [s for _, s in enc], gs)
    return reference.dispatch(xs, ids, ws, cfg, global_scales_per_rank=gs)


def expert_outputs(cfg: EPConfig, ref: reference.ExpertBatchRef, rank: int) -> np.ndarray:
    """bf16 outputs of rank ``rank``: the decoded rows times (rank + 1); NaN on padding rows and
    past the batch (combine must never read them); non-finite decoded rows become zeros."""
    y = np.full((cfg.recv_rows_capacity, cfg.hidden), POISON_BF16, np.uint16)
    dec = cfg.token_format.dequantize(ref.x, ref.scales, ref.global_scales) * np.float32(rank + 1)
    dec[~np.isfinite(dec)] = 0.0
    y[:ref.n_rows] = dec.astype(BF16).view(np.uint16)
    y[:ref.n_rows][ref.src_rank < 0] = POISON_BF16
    return y


def dispatch_args(cfg: EPConfig, xs, r: int, kind: str) -> tuple:
    """Rank r's ``(tokens, dispatch_async keywords)`` of a case."""
    tokens, gs = xs[r].view(np.uint16), global_scales(cfg, xs, kind)
    if kind == "given":
        return tokens, {"token_global_scale": np.array([gs[r]], np.float32)}
    if kind == "prequantized":
        codes, scales = cfg.token_format.quantize(tokens, gs[r])
        return codes, {"token_scales": scales, "token_global_scale": np.array([gs[r]], np.float32)}
    if kind == "device_count":
        T = cfg.max_tokens_per_rank
        padded = np.full((T, cfg.hidden), PAST_COUNT, np.float32).astype(BF16).view(np.uint16)
        padded[:len(tokens)] = tokens
        return padded, {"n_tokens": np.array([len(tokens)], np.int32)}
    return tokens, {}


def nvfp4_pe(session, R: int) -> dict:
    from ep_runtime.core.runtime import EPRuntime

    r, out = session.rank, {}
    for name, cfg_d, scenario, seed, kind, scales in cases(R):
        cfg = EPConfig(**cfg_d)
        xs, ids, ws = inputs(cfg, scenario, seed)
        tokens, kw = dispatch_args(cfg, xs, r, kind)
        i, w = ids[r], ws[r]
        if kind == "device_count":  # the rows past the count route like real ones
            i = np.vstack([i, np.tile(np.arange(cfg.top_k, dtype=np.int32), (len(tokens) - len(i), 1))])
            w = np.vstack([w, np.ones((len(tokens) - len(ws[r]), cfg.top_k), np.float32)])
        with EPRuntime(cfg, session) as rt:
            b = rt.dispatch_wait(rt.dispatch_async(tokens, i, w, **kw), scales=scales)
            rt.synchronize()
            res = {"x": b.x.copy(), "scales": b.scales.copy(), "global_scales": b.global_scales.copy(),
                   "row_offsets": b.row_offsets.copy()}
            ref = case_reference(cfg, xs, ids, ws, kind)[r]
            res["out"] = rt.combine(expert_outputs(cfg, ref, r), b.handle).copy()[:len(xs[r])]
            cb = rt.dispatch_wait(rt.dispatch_async(tokens, i, w, **kw), layout="compact")
            rt.synchronize()
            res.update(compact_x=cb.x.copy(), compact_scales=cb.scales.copy(), compact_global=cb.global_scales.copy())
        out[name] = res

    cfg = EPConfig(**cases(R)[0][1])
    xs, ids, ws = inputs(cfg, "random", 9)
    codes, scs = cfg.token_format.quantize(xs[r].view(np.uint16))
    g = np.array([cfg.token_format.global_scale(xs[r].view(np.uint16))], np.float32)
    with EPRuntime(cfg, session) as rt:
        bad = {
            "codes_wrong_width": lambda: rt.dispatch_async(codes[:, :-8], ids[r], ws[r], token_scales=scs,
                                                           token_global_scale=g),
            "scales_wrong_shape": lambda: rt.dispatch_async(codes, ids[r], ws[r], token_scales=scs[:, :2],
                                                            token_global_scale=g),
            "prequantized_without_global": lambda: rt.dispatch_async(codes, ids[r], ws[r], token_scales=scs),
            "global_wrong_dtype": lambda: rt.dispatch_async(xs[r], ids[r], ws[r], token_global_scale=g.astype(float)),
            "global_wrong_shape": lambda: rt.dispatch_async(xs[r], ids[r], ws[r],
                                                            token_global_scale=np.ones(2, np.float32)),
        }
        errors = {what: input_error_of(call) for what, call in bad.items()}
    fp8 = EPConfig(**{**cases(R)[0][1], "token_dtype": "fp8_e4m3"})
    with EPRuntime(fp8, session) as rt:
        errors["global_in_fp8_config"] = input_error_of(lambda: rt.dispatch_async(xs[r], ids[r], ws[r],
                                                                                  token_global_scale=g))
    return {"cases": out, "errors": errors}


#: (ranks, the plan's transport)
RUNS = [(2, "stores"), (2, "puts"), (4, "stores")]


@pytest.fixture(scope="module", params=RUNS, ids=lambda p: f"R{p[0]}-{p[1]}")
def sim(request):
    R, transport = request.param
    with pytest.MonkeyPatch.context() as mp:  # the PEs are spawned with this environment
        mp.setenv("EP_RUNTIME_PLAN", f"transport={transport}")
        return R, run_pes(nvfp4_pe, R, args=(R,), timeout_s=RUN_TIMEOUT_S)


def each_case(R: int):
    """Every case with its config, inputs and reference batches."""
    for name, cfg_d, scenario, seed, kind, scales in cases(R):
        cfg = EPConfig(**cfg_d)
        xs, ids, ws = inputs(cfg, scenario, seed)
        yield name, cfg, xs, ids, ws, kind, scales, case_reference(cfg, xs, ids, ws, kind)


def test_codes_scales_and_global_scales_equal_the_reference_bit_for_bit(sim):
    R, per_rank = sim
    for name, cfg, xs, ids, ws, kind, scales, refs in each_case(R):
        C, S, H = cfg.recv_rows_capacity, cfg.hidden // 16, cfg.hidden
        for r, res in enumerate(per_rank):
            got, ref, at = res["cases"][name], refs[r], f"{name}: rank {r}"
            n = ref.n_rows
            assert n > 0 or kind == "computed", at
            assert got["x"].dtype == np.uint8 and got["x"].shape == (C, H // 2), at
            assert got["scales"].shape == ((C, S) if scales == "row" else (S, C)), at
            assert got["global_scales"].dtype == np.float32 and got["global_scales"].shape == (C,), at
            np.testing.assert_array_equal(got["row_offsets"], ref.row_offsets, err_msg=at)
            np.testing.assert_array_equal(got["x"][:n], ref.x, err_msg=f"{at}: codes")
            sc = got["scales"] if scales == "row" else got["scales"].T
            np.testing.assert_array_equal(sc[:n], ref.scales, err_msg=f"{at}: scales ({scales}-major)")
            np.testing.assert_array_equal(got["global_scales"][:n].view(np.uint32),
                                          ref.global_scales.view(np.uint32), err_msg=f"{at}: global scales")
            pad = np.flatnonzero(ref.src_rank < 0)
            assert not got["x"][pad].any() and not sc[pad].any() and not got["global_scales"][pad].any(), at


def test_awkward_blocks_reach_the_batch_as_documented(sim):
    """Zero block: scale 0, codes 0 (0x8 for -0.0); inf / NaN: scale 0x7F, codes 0; a tiny block:
    an E4M3-subnormal scale; a global scale a tenth of the rule's: saturated scales and codes."""
    R, per_rank = sim
    seen = set()
    for name, cfg, xs, ids, ws, kind, scales, refs in each_case(R):
        for r, res in enumerate(per_rank):
            got, b = res["cases"][name], refs[r]
            sc = got["scales"] if scales == "row" else got["scales"].T
            codes = cfg.token_format.codes(got["x"][:b.n_rows])
            for row in range(b.n_rows):
                t = b.src_token[row]
                if t == 0 and cfg.hidden >= 128:
                    seen.add("zero")
                    assert sc[row, 1] == sc[row, 2] == 0 and (codes[row, 16:32] == 0).all() \
                        and (codes[row, 32:48] == 8).all(), (name, r, row)
                if t in (1, 2):
                    seen.add("nonfinite")
                    blk = 0 if t == 1 else cfg.hidden // 16 - 1
                    assert sc[row, blk] == 0x7F and (codes[row, 16 * blk:16 * blk + 16] == 0).all(), (name, r, row)
                if t == 3 and kind != "given":
                    seen.add("subnormal")
                    assert 0 < sc[row, 3] < 8, (name, r, row)
            if kind == "given" and b.n_rows:
                seen.add("saturated")
                assert (sc[:b.n_rows] == 0x7E).any() and ((codes & 7) == 7).any(), name
    assert seen == ({"zero", "nonfinite", "subnormal", "saturated"} if R == 2 else {"zero", "nonfinite", "subnormal"})


def test_compact_layout_holds_the_reference_messages(sim):
    R, per_rank = sim
    for name, cfg, xs, ids, ws, kind, scales, refs in each_case(R):
        gs = global_scales(cfg, xs, kind)
        if kind == "prequantized":
            enc = [cfg.token_format.quantize(x.view(np.uint16), g) for x, g in zip(xs, gs)]
            recv = reference.receive_rows([c for c, _ in enc], ids, cfg, [s for _, s in enc], True, gs)
        else:
            recv = reference.receive_rows(xs, ids, cfg, with_scales=True, global_scales_per_rank=gs)
        recv_g = reference.receive_global_scales(xs, ids, cfg, gs)
        for r, res in enumerate(per_rank):
            (x, defined, sc), (g, _) = recv[r], recv_g[r]
            got = res["cases"][name]
            np.testing.assert_array_equal(got["compact_x"][defined], x[defined], err_msg=name)
            np.testing.assert_array_equal(got["compact_scales"][defined], sc[defined], err_msg=name)
            np.testing.assert_array_equal(got["compact_global"][defined], g[defined], err_msg=name)


def test_combine_equals_the_reference(sim):
    R, per_rank = sim
    for name, cfg, xs, ids, ws, kind, scales, refs in each_case(R):
        want = reference.combine([expert_outputs(cfg, b, r) for r, b in enumerate(refs)], refs, ids, cfg)
        for r, res in enumerate(per_rank):
            np.testing.assert_array_equal(res["cases"][name]["out"], want[r].view(np.uint16), err_msg=name)


def test_bad_nvfp4_arguments_are_refused_before_launch(sim):
    R, per_rank = sim
    for res in per_rank:
        e = res["errors"]
        assert e["codes_wrong_width"] and "tokens must have shape [*, 128]" in e["codes_wrong_width"] \
            and "two E2M1 codes a byte" in e["codes_wrong_width"], e
        assert e["scales_wrong_shape"] and "hidden / 16 = 16" in e["scales_wrong_shape"], e
        assert e["prequantized_without_global"] and "needs token_global_scale" in e["prequantized_without_global"], e
        assert e["global_wrong_dtype"] and "token_global_scale must have dtype float32" in e["global_wrong_dtype"], e
        assert e["global_wrong_shape"] and "token_global_scale must have shape [1]" in e["global_wrong_shape"], e
        assert e["global_in_fp8_config"] and "token_global_scale given" in e["global_in_fp8_config"], e


def device_pe(session) -> dict:
    """The codec's conversions as the simulator runs them (plain functions): E2M1 and saturating
    E4M3 codes of every bf16 pattern and the boundaries, and whole tokens' code words and
    scales (``encode_block``) under several global scales."""
    from ep_runtime.kernels.codecs.nvfp4 import e2m1_code, e4m3_saturated_bits, encode_block

    q = np.concatenate([(np.arange(65536, dtype=np.uint32) << 16).view(np.float32), boundary_values()])
    q = q[~np.isnan(q)]  # the rule never converts a NaN to E2M1
    out = {"q": q, "e2m1": np.array([e2m1_code(v) for v in q], np.uint8),
           "e4m3": np.array([e4m3_saturated_bits(v) for v in q], np.uint8)}
    from ep_runtime.core.formats import NVFP4

    ties, tie_g = tie_tokens()
    awkward = awkward_tokens()
    rule = NVFP4.global_scale(awkward)
    blocks = {}
    for name, tokens, gs in (("ties", ties, (tie_g,)),
                             ("awkward", awkward, (rule, rule / np.float32(10), np.nan, 0.0))):
        for g in map(np.float32, gs):
            words = tokens.view(np.uint64)
            codes = np.zeros((len(tokens), words.shape[1] // 4), np.uint64)
            scales = np.zeros(codes.shape, np.uint8)
            for t in range(len(tokens)):
                for b in range(codes.shape[1]):
                    w = words[t, 4 * b:4 * b + 4]
                    codes[t, b], scales[t, b] = encode_block(w[0], w[1], w[2], w[3], np.float32(6.0) * g, g)
            blocks[name, float(g)] = (codes.view(np.uint8), scales)
    out["blocks"] = blocks
    return out


@pytest.fixture(scope="module")
def device():
    return run_pes(device_pe, 1, timeout_s=RUN_TIMEOUT_S)[0]


def test_device_conversions_equal_the_reference_for_every_bf16_pattern(device):
    from ep_runtime.core.formats import e2m1_codes, e4m3_saturated

    np.testing.assert_array_equal(device["e2m1"], e2m1_codes(device["q"]))
    np.testing.assert_array_equal(device["e4m3"], e4m3_saturated(device["q"]))


def test_device_blocks_equal_the_reference_ties_included(device):
    from ep_runtime.core.formats import NVFP4

    ties, _ = tie_tokens()
    for (name, g), (codes, scales) in device["blocks"].items():
        tokens = ties if name == "ties" else awkward_tokens()
        want_codes, want_scales = NVFP4.quantize(tokens, np.float32(g))
        np.testing.assert_array_equal(scales, want_scales, err_msg=f"{name} g={g}")
        np.testing.assert_array_equal(codes, want_codes, err_msg=f"{name} g={g}")
    got = NVFP4.codes(device["blocks"]["ties", 2.0 ** -8][0])[0, :16]
    assert got.tolist() == [0, 2, 2, 4, 4, 6, 6, 7, 8, 10, 10, 12, 12, 14, 14, 1]  # ties to even


#: The hierarchical run: 2 nodes of 2 PEs, messages packed into chunks (``pack_row``); seed.
HIER_SEED = 11


def hierarchical_pe(session, cfg: EPConfig) -> dict:
    """As 2 x 2 logical nodes: the calls of ``testing.FP8_CALLS`` with bf16 tokens (stores within
    a node) and with pre-quantized ones (puts within a node)."""
    session.use_logical_nodes(2)
    return {pre: fp8_plan_pe(session, {"node_stores": not pre}, cfg, HIER_SEED, prequantized=pre)
            for pre in (False, True)}


def test_hierarchical_transport_packs_exact_messages():
    cfg = EPConfig(n_ranks=4, n_experts=16, top_k=6, hidden=128, max_tokens_per_rank=16, token_dtype="nvfp4",
                   wait_timeout_s=60.0)
    pes = run_pes(hierarchical_pe, 4, args=(cfg,), timeout_s=RUN_TIMEOUT_S)
    for pre in (False, True):
        runs = [pe[pre] for pe in pes]
        assert (runs[0]["plan"]["transport"], runs[0]["plan"]["node_stores"]) == ("hierarchical", not pre)
        assert_fp8_calls_are_the_reference(cfg, runs, HIER_SEED, pre, f"nvfp4, 2 x 2 nodes, prequantized={pre}",
                                           node_size=2)
