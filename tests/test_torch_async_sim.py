"""`ep_runtime.torch_async` on the simulator: the runtime's four calls on torch tensors, each half on
its own, in every token format and both layouts, against the NumPy reference bit for bit (the
same checks as the plan tests: :func:`ep_runtime.testing.assert_calls_are_the_reference` and
:func:`~ep_runtime.testing.assert_fp8_calls_are_the_reference`), with torch work between each
``*_async`` and its ``*_wait`` (what a caller overlaps with the transfer: shared experts)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ep_runtime.core.config import EPConfig
from ep_runtime.shmem.launch import run_pes
from ep_runtime.testing import (FP8_CALLS, assert_calls_are_the_reference, assert_fp8_calls_are_the_reference,
                                call_inputs, call_layout, expert_outputs, input_error_of)

RUN_TIMEOUT_S = 240
SEED = 31
CALLS = 4  # random, zero_rank, masked, one_expert (call 3: no tokens anywhere)


def bf16_config(R: int) -> EPConfig:
    return EPConfig(n_ranks=R, n_experts=2 * R, top_k=2, hidden=64, max_tokens_per_rank=6)


def fp8_config(fmt: str) -> EPConfig:
    return EPConfig(n_ranks=2, n_experts=4, top_k=2, hidden=256, max_tokens_per_rank=6, token_dtype=fmt)


def _bf16(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16)


def _host(t: torch.Tensor) -> np.ndarray:
    """A NumPy copy of a batch field (bf16 as its uint16 bits, FP8 codes as uint8)."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16).copy()
    if t.dtype == torch.float8_e4m3fn:
        return t.view(torch.uint8).numpy().copy()
    return t.numpy().copy()


def async_pe(session, cfg_fields: dict, prequantized: bool) -> dict:
    from ep_runtime.core import reference
    from ep_runtime.core.runtime import EPRuntime
    from ep_runtime.torch_async import PendingDispatch, combine_async, combine_wait, dispatch_async, dispatch_wait
    from ep_runtime.testing import BATCH_FIELDS

    torch.set_num_threads(1)
    cfg = EPConfig(**cfg_fields)
    r, calls = session.rank, []
    fp8 = cfg.token_format.quantized
    plan = [c for c in FP8_CALLS if c[0] in cfg.layouts] if fp8 else [(call_layout(cfg, c), "row") for c in range(CALLS)]
    with EPRuntime(cfg, session) as rt:
        for call, (layout, scales) in enumerate(plan):
            xs, ids, ws = call_inputs(cfg, call, SEED)
            tokens, token_scales = _bf16(xs[r]), None
            if prequantized:
                codes, sc = cfg.token_format.quantize(xs[r].view(np.uint16))
                tokens, token_scales = torch.from_numpy(codes).view(torch.float8_e4m3fn), torch.from_numpy(sc)
            ids_t = torch.from_numpy(ids[r]).long() if call % 2 else torch.from_numpy(ids[r])  # int64 converted
            pending = dispatch_async(tokens, ids_t, torch.from_numpy(ws[r]), rt, token_scales=token_scales)
            shared = tokens.float().sum() if not prequantized else None  # torch work between the halves
            batch = dispatch_wait(pending, layout=layout, scales=scales)
            got = {k: _host(getattr(batch, k)) for k in BATCH_FIELDS + (("scales",) if fp8 else ())}
            if layout == "compact":
                got["gather"], got["recv_tokens"] = _host(batch.gather), _host(batch.recv_tokens)
            got["layout"], got["scale_layout"] = layout, scales
            got["dtypes"] = (str(batch.x.dtype), str(batch.expert_counts.dtype), None if batch.scales is None
                             else str(batch.scales.dtype))
            refs = reference.dispatch(xs, ids, ws, cfg)
            y = _bf16(expert_outputs(cfg, refs[r], r))
            out = combine_wait(combine_async(y, batch))
            got["out"] = _host(out)[:len(xs[r])]
            got["shared_kept"] = shared is None or bool(torch.isfinite(shared))
            calls.append(got)
        got_errors = {"dispatch_wait": input_error_of(lambda: dispatch_wait("not a handle")),
                      "dense": input_error_of(lambda: dispatch_wait(PendingDispatch(rt, None, 0), layout="dense")),
                      "combine_wait": input_error_of(lambda: combine_wait(object()))}
    return {"calls": calls, "errors": got_errors}


@pytest.mark.parametrize("R", [2])
def test_bf16_halves_on_torch_tensors_equal_the_reference(R):
    cfg = bf16_config(R)
    runs = run_pes(async_pe, R, args=(cfg.as_dict(), False), timeout_s=RUN_TIMEOUT_S)
    assert_calls_are_the_reference(cfg, runs, CALLS, SEED, f"torch_async bf16, {R} ranks")
    for run in runs:
        assert all(c["shared_kept"] for c in run["calls"])
        assert {c["dtypes"] for c in run["calls"]} == {("torch.bfloat16", "torch.int32", None)}
        assert "expected the PendingDispatch of dispatch_async; got str" in run["errors"]["dispatch_wait"]
        assert "expected the PendingCombine of combine_async; got object" in run["errors"]["combine_wait"]
        assert "layout='dense'; torch_async serves 'expanded' and 'compact'" in run["errors"]["dense"]


@pytest.mark.parametrize("fmt,prequantized", [("fp8_e4m3", False), ("fp8_e4m3_ue8m0", True)],
                         ids=["e4m3_quantized_in_dispatch", "ue8m0_prequantized_codes_and_scales"])
def test_fp8_codes_and_scales_come_back_as_tensors_equal_to_the_reference(fmt, prequantized):
    cfg = fp8_config(fmt)
    runs = run_pes(async_pe, 2, args=(cfg.as_dict(), prequantized), timeout_s=RUN_TIMEOUT_S)
    assert_fp8_calls_are_the_reference(cfg, runs, SEED, prequantized, f"torch_async {fmt}")
    scale_dtype = "torch.float32" if fmt == "fp8_e4m3" else "torch.uint8"
    for run in runs:
        assert {c["dtypes"] for c in run["calls"]} == {("torch.float8_e4m3fn", "torch.int32", scale_dtype)}


def nvfp4_pe(session, cfg_fields: dict) -> dict:
    """NVFP4 through the torch halves: bf16 tokens (the rule's global scale, computed on the
    stream) into the expanded layout with row-major scales, then torch's own NVFP4 types
    pre-quantized (``float4_e2m1fn_x2`` codes, ``float8_e4m3fn`` scale codes and the global
    scale) into the expanded layout with column-major scales and into the compact layout."""
    from ep_runtime.core import reference
    from ep_runtime.core.runtime import EPRuntime
    from ep_runtime.torch_async import combine_async, combine_wait, dispatch_async, dispatch_wait

    torch.set_num_threads(1)
    cfg = EPConfig(**cfg_fields)
    fmt, r, got = cfg.token_format, session.rank, {}
    xs, ids, ws = call_inputs(cfg, 0, SEED)
    ids_t, ws_t = torch.from_numpy(ids[r]), torch.from_numpy(ws[r])
    g = fmt.global_scale(xs[r].view(np.uint16))
    codes, scales = fmt.quantize(xs[r].view(np.uint16), g)
    prequantized = dict(token_scales=torch.from_numpy(scales).view(torch.float8_e4m3fn),
                        token_global_scale=torch.tensor([g], dtype=torch.float32))
    with EPRuntime(cfg, session) as rt:
        for name, tokens, kw, layout, scale_layout in (
                ("bf16", _bf16(xs[r]), {}, "expanded", "row"),
                ("prequantized", torch.from_numpy(codes).view(torch.float4_e2m1fn_x2), prequantized, "expanded",
                 "column"),
                ("prequantized_compact", torch.from_numpy(codes).view(torch.float4_e2m1fn_x2), prequantized,
                 "compact", "row")):
            batch = dispatch_wait(dispatch_async(tokens, ids_t, ws_t, rt, **kw), layout=layout, scales=scale_layout)
            res = {"dtypes": (str(batch.x.dtype), str(batch.scales.dtype), str(batch.global_scales.dtype)),
                   "x": batch.x.view(torch.uint8).numpy().copy(), "scales": batch.scales.numpy().copy(),
                   "global_scales": batch.global_scales.numpy().copy(),
                   "row_offsets": batch.row_offsets.numpy().copy()}
            if layout == "expanded":
                ref = reference.dispatch(xs, ids, ws, cfg)[r]
                dec = fmt.dequantize(ref.x, ref.scales, ref.global_scales)
                dec[~np.isfinite(dec)] = 0.0
                y = np.zeros((cfg.recv_rows_capacity, cfg.hidden), np.float32)
                y[:ref.n_rows] = dec
                res["out"] = combine_wait(combine_async(_bf16(y.astype(reference.BF16)), batch)).view(
                    torch.int16).numpy().view(np.uint16).copy()
            got[name] = res
    return got


def test_nvfp4_codes_scales_and_global_scales_come_back_as_torch_s_nvfp4_types():
    cfg = EPConfig(n_ranks=2, n_experts=4, top_k=2, hidden=256, max_tokens_per_rank=6, token_dtype="nvfp4",
                   layouts=("expanded", "compact"))
    runs = run_pes(nvfp4_pe, 2, args=(cfg.as_dict(),), timeout_s=RUN_TIMEOUT_S)
    from ep_runtime.core import reference

    xs, ids, ws = call_inputs(cfg, 0, SEED)
    refs = reference.dispatch(xs, ids, ws, cfg)  # the rule's global scale, as both inputs carry
    recv = reference.receive_rows(xs, ids, cfg, with_scales=True)
    recv_g = reference.receive_global_scales(xs, ids, cfg, None)
    fmt = cfg.token_format
    ys = []
    for ref in refs:
        dec = fmt.dequantize(ref.x, ref.scales, ref.global_scales)
        dec[~np.isfinite(dec)] = 0.0
        y = np.zeros((cfg.recv_rows_capacity, cfg.hidden), np.float32)
        y[:ref.n_rows] = dec
        ys.append(y.astype(reference.BF16).view(np.uint16))
    want_out = reference.combine(ys, refs, ids, cfg)
    for r, got in enumerate(runs):
        ref, n = refs[r], refs[r].n_rows
        assert n > 0
        for name in ("bf16", "prequantized"):
            res, at = got[name], f"rank {r} {name}"
            assert res["dtypes"] == ("torch.float4_e2m1fn_x2", "torch.uint8", "torch.float32"), at
            sc = res["scales"] if name == "bf16" else res["scales"].T
            np.testing.assert_array_equal(res["row_offsets"], ref.row_offsets, err_msg=at)
            np.testing.assert_array_equal(res["x"][:n], ref.x, err_msg=at)
            np.testing.assert_array_equal(sc[:n], ref.scales, err_msg=at)
            np.testing.assert_array_equal(res["global_scales"][:n], ref.global_scales, err_msg=at)
            np.testing.assert_array_equal(res["out"][:len(xs[r])], want_out[r].view(np.uint16), err_msg=at)
        (x, defined, sc), (g, _) = recv[r], recv_g[r]
        res = got["prequantized_compact"]
        assert res["dtypes"] == ("torch.float4_e2m1fn_x2", "torch.uint8", "torch.float32")
        np.testing.assert_array_equal(res["x"][defined], x[defined])
        np.testing.assert_array_equal(res["scales"][defined], sc[defined])
        np.testing.assert_array_equal(res["global_scales"][defined], g[defined])
