"""ep_runtime.torch_compact on the simulator: the compact layout as autograd functions, a toy MoE
layer's output and token gradients against dense float64 torch (tests/test_torch_sim.py's
reference), masked slots included, and the backward's cost: 1 dispatch + 1 combine."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from test_torch_sim import Case, cfg2, dense_reference, expert_scale_shift  # noqa: E402

from ep_runtime.core import reference  # noqa: E402
from ep_runtime.shmem.launch import run_pes  # noqa: E402

RUN_TIMEOUT_S = 240
CASES = (
    Case("random", cfg2(), seed=11),
    Case("masked", cfg2(), "masked", seed=12),  # -1 slots, fully masked tokens, a rank masking every token
    Case("zero_rank_top_k_1", cfg2(top_k=1), "zero_rank", seed=13),
)


def compact_pe(session, cases) -> dict:
    import torch

    from ep_runtime.torch import close_buffers, get_buffer
    from ep_runtime.torch_compact import fused_combine_compact, fused_dispatch_compact

    torch.set_num_threads(1)
    r, results = session.rank, {}
    for case in cases:
        cfg = case.config()
        xs, ids, ws, cs = case.inputs()
        rt = get_buffer(session, cfg.hidden * 2, cfg.n_experts, cfg.top_k, cfg.max_tokens_per_rank, layouts="compact")
        calls = rt.calls
        x = torch.from_numpy(np.ascontiguousarray(xs[r]).view(np.int16)).view(torch.bfloat16).clone().requires_grad_()
        w = torch.from_numpy(ws[r])
        xr, gather, row_weight, offsets, h = fused_dispatch_compact(x, torch.from_numpy(ids[r]), w, rt)
        # the experts: row i of expert e is f_e(xr[gather[i]]), weighted, summed per received token
        partial = torch.zeros(xr.shape, dtype=torch.float32)
        bounds = offsets.tolist()
        for e in range(cfg.n_local_experts):
            a, b = expert_scale_shift(r * cfg.n_local_experts + e)
            for i in range(bounds[e], bounds[e + 1]):
                g = int(gather[i])
                if g >= 0:
                    y = (xr[g].float() * float(a) + float(b)).to(torch.bfloat16).float()
                    partial = partial.index_add(0, torch.tensor([g]), (row_weight[i] * y)[None])
        out = fused_combine_compact(partial.to(torch.bfloat16), h)
        (out.float() * torch.from_numpy(cs[r])).sum().backward()
        results[case.name] = dict(out=out.detach().float().numpy(), x_grad=x.grad.float().numpy(),
                                  dispatches=rt.calls - calls)
    close_buffers(session)
    return results


@pytest.fixture(scope="module")
def runs():
    return run_pes(compact_pe, 2, args=(CASES,), timeout_s=RUN_TIMEOUT_S)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_compact_layer_matches_dense_torch(runs, case):
    xs, ids, ws, cs = case.inputs()
    refs = dense_reference(case, xs, ids, ws, cs)
    for r, ref in enumerate(refs):
        got = runs[r][case.name]
        assert got["out"].shape == ref["out"].shape == xs[r].shape
        tol = reference.combine_tolerance(np.where(ids[r] >= 0, ws[r], 0), ref["y_max"])
        assert (np.abs(got["out"] - ref["out"]) <= tol).all(), f"rank {r}: out"
        err_x = np.abs(got["x_grad"] - ref["x_grad"])
        assert (err_x <= 2.0**-7 * ref["x_scale"] + 1e-30).all(), f"rank {r}: dL/dx off by up to {err_x.max()}"
        if (ids[r] >= 0).any():
            assert np.abs(got["x_grad"]).max() > 0, f"rank {r}: no gradient reached its tokens"


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_compact_backward_is_one_dispatch_and_one_combine(runs, case):
    # forward: 1 dispatch; backward: the combine's 1 dispatch, and the dispatch's combine on it
    assert [run[case.name]["dispatches"] for run in runs] == [2, 2]
