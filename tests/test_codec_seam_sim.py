"""Adding a token format is its format entry and its codec module (docs/formats.md, "Adding a
format"): the toy format of tests/toy_codec.py, registered with ``formats.register_format`` and
built with its own device codec, runs through the real kernels on the simulator like the FP8
formats: dispatch encodes in dispatch_async (or takes pre-quantized codes and scales) and returns
codes and scales equal to its reference bit for bit, in both layouts, row- and column-major
scales, on both transports; combine (bf16 expert outputs) equals the reference. Nothing of the
project knows the toy format by name."""

from __future__ import annotations

import numpy as np
import pytest

import toy_codec
from ep_runtime.core import formats, reference
from ep_runtime.core.config import EPConfig
from ep_runtime.core.errors import EPConfigError
from ep_runtime.core.reference import BF16
from ep_runtime.shmem.launch import run_pes
from ep_runtime.testing import make_inputs

RUN_TIMEOUT_S = 300
POISON_BF16 = 0x7FC0


def cases(R: int) -> list:
    """(name, config dict, scenario, seed, prequantized, scales layout)."""
    base = dict(n_ranks=R, n_experts=2 * R, top_k=2, hidden=256, max_tokens_per_rank=5, token_dtype="toy_i8")
    return [("random_row", base, "random", 1, False, "row"),
            ("prequantized_column", base, "random", 2, True, "column"),
            ("zero_rank_top1_pad4", {**base, "top_k": 1, "pad_multiple": 4}, "zero_rank", 3, False, "column")]


def expert_outputs(cfg: EPConfig, ref: reference.ExpertBatchRef, rank: int) -> np.ndarray:
    """bf16 outputs of rank ``rank``: the decoded rows times (rank + 1); NaN past the rows."""
    y = np.full((cfg.recv_rows_capacity, cfg.hidden), POISON_BF16, np.uint16)
    y[:ref.n_rows] = (cfg.token_format.dequantize(ref.x, ref.scales) * np.float32(rank + 1)).astype(BF16).view(
        np.uint16)
    y[:ref.n_rows][ref.src_rank < 0] = POISON_BF16
    return y


def toy_pe(session, R: int) -> dict:
    import toy_codec  # noqa: F401 (registers the format in this process)
    from ep_runtime.core.runtime import EPRuntime

    r = session.rank
    out = {}
    for name, cfg_d, scenario, seed, pre, scales in cases(R):
        cfg = EPConfig(**cfg_d)
        xs, ids, ws = make_inputs(cfg, scenario, seed)
        tokens, kw = xs[r].view(np.uint16), {}
        if pre:
            codes, scs = cfg.token_format.quantize(tokens)
            tokens, kw = codes, {"token_scales": scs}
        with EPRuntime(cfg, session) as rt:
            b = rt.dispatch(tokens, ids[r], ws[r], scales=scales, **kw)
            res = {"x": b.x.copy(), "scales": b.scales.copy(), "row_offsets": b.row_offsets.copy(),
                   "plan": rt.plan.summary()}
            ref = reference.dispatch(xs, ids, ws, cfg)[r]
            res["out"] = rt.combine(expert_outputs(cfg, ref, r), b.handle).copy()
            cb = rt.dispatch(tokens, ids[r], ws[r], layout="compact", **kw)
            res["compact_x"], res["compact_scales"] = cb.x.copy(), cb.scales.copy()
        out[name] = res
    return out


@pytest.fixture(scope="module", params=["stores", "puts"])
def sim(request):
    R = 2
    with pytest.MonkeyPatch.context() as mp:  # the PEs are spawned with this environment
        mp.setenv("EP_RUNTIME_PLAN", f"transport={request.param}")
        return R, run_pes(toy_pe, R, args=(R,), timeout_s=RUN_TIMEOUT_S)


def test_the_toy_format_is_built_with_its_own_codec():
    cfg = EPConfig(n_ranks=2, n_experts=4, top_k=2, hidden=256, max_tokens_per_rank=5, token_dtype="toy_i8")
    assert cfg.token_format is toy_codec.TOY_I8 and cfg.token_format.codec.module == "toy_codec"
    from ep_runtime.core.plan import Topology, choose_plan

    plan = choose_plan(cfg, Topology.nvlink_gpus(2))
    assert plan.dispatch_variant(cfg).codec == toy_codec.TOY_I8.codec


def test_dispatch_codes_and_scales_equal_the_toy_reference(sim):
    R, per_rank = sim
    for name, cfg_d, scenario, seed, pre, scales in cases(R):
        cfg = EPConfig(**cfg_d)
        xs, ids, ws = make_inputs(cfg, scenario, seed)
        for r, res in enumerate(per_rank):
            got, ref = res[name], reference.dispatch(xs, ids, ws, cfg)[r]
            n, S = ref.n_rows, cfg.hidden // toy_codec.BLOCK
            assert n > 0 or scenario == "zero_rank", name
            np.testing.assert_array_equal(got["row_offsets"], ref.row_offsets, err_msg=name)
            np.testing.assert_array_equal(got["x"][:n], ref.x, err_msg=f"{name}: rank {r} codes")
            sc = got["scales"] if scales == "row" else got["scales"].T
            assert sc.shape[1] == S, name
            np.testing.assert_array_equal(np.ascontiguousarray(sc[:n]), ref.scales, err_msg=f"{name}: rank {r}")
            x, defined, rsc = reference.receive_rows(xs, ids, cfg, with_scales=True)[r]
            np.testing.assert_array_equal(got["compact_x"][defined], x[defined], err_msg=f"{name}: compact")
            np.testing.assert_array_equal(got["compact_scales"][defined], rsc[defined], err_msg=f"{name}: compact")


def test_the_toy_codes_are_not_the_tokens(sim):
    """The kernels ran the toy's encoder: its codes are int8, nothing like the bf16 bytes."""
    R, per_rank = sim
    name, cfg_d, scenario, seed, _, _ = cases(R)[0]
    cfg = EPConfig(**cfg_d)
    xs, ids, ws = make_inputs(cfg, scenario, seed)
    ref = reference.dispatch(xs, ids, ws, cfg)[0]
    codes = per_rank[0][name]["x"][:ref.n_rows].view(np.int8)
    assert np.abs(codes).max() == toy_codec.QMAX  # every block's amax codes to 127


def test_combine_equals_the_reference(sim):
    R, per_rank = sim
    for name, cfg_d, scenario, seed, pre, scales in cases(R):
        cfg = EPConfig(**cfg_d)
        xs, ids, ws = make_inputs(cfg, scenario, seed)
        refs = reference.dispatch(xs, ids, ws, cfg)
        want = reference.combine([expert_outputs(cfg, b, r) for r, b in enumerate(refs)], refs, ids, cfg)
        for r, res in enumerate(per_rank):
            np.testing.assert_array_equal(res[name]["out"], want[r].view(np.uint16), err_msg=name)


def test_registration_refuses_a_second_format_under_a_known_name():
    assert formats.register_format(toy_codec.TOY_I8) is toy_codec.TOY_I8  # the same one again: a no-op
    other = toy_codec.ToyInt8Format("toy_i8", np.dtype(np.uint8), 64, toy_codec.TOY_SCALE, toy_codec.TOY_I8.codec)
    with pytest.raises(EPConfigError, match="a token format named 'toy_i8' is already registered"):
        formats.register_format(other)
    with pytest.raises(EPConfigError, match=r"token_dtype.*must be one of the strings .*'toy_i8'"):
        EPConfig(n_ranks=2, n_experts=4, top_k=2, hidden=256, max_tokens_per_rank=5, token_dtype="toy_i9")
