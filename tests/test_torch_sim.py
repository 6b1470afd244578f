"""`ep_runtime.torch` on the CPU simulator: FusedDispatch / FusedCombine forward and backward,
zero copy, get_buffer.

Each case runs the layer ``out = FusedCombine(f(FusedDispatch(x)), w)`` on every rank with an
elementwise expert ``f_e(X) = bf16(a_e X + b_e)`` (``a_e`` a power of two, ``b_e`` non-zero, so
padding rows come out non-zero and must be ignored) and the loss ``sum(out * c)`` (``c`` exact in
bf16), then compares with the same layer written densely in float64 torch autograd (the bf16
rounding of ``f_e`` as a constant, a straight-through copy):

- dispatch outputs against :func:`ep_runtime.core.reference.dispatch`, exactly, after the backward ran
  (so they are copies, not views of buffers the backward's dispatches overwrote);
- ``out`` within :func:`ep_runtime.core.reference.combine_tolerance`;
- ``dL/dx`` within ``2**-7 * sum_k |a_e w_tk c_t|`` per element: three bf16 roundings of at most
  2**-9 each (the row ``w * c``, the combine's partial, its result); a weighted combine where an
  unweighted one belongs is off by a factor w (0.2 - 0.9) of a term;
- ``dL/dw`` within ``4e-6 * sum_h |y c|`` per element: only float32 dot-product rounding
  (``hidden * 2**-24`` relative to that sum): the weight gradient travels home as a float32 slot
  value (``EPRuntime.slot_values``), unrounded; a bf16 on the way would be off by up to 2**-9.

Weights are random in [0.2, 0.9], not normalized, so top-1 routing still tells a weighted
combine from an unweighted one.
"""

import functools
import importlib
import sys
from dataclasses import dataclass

import numpy as np
import pytest

import torch  # the test extra installs it (torch==2.13.0): no skip  # noqa: E402

from ep_runtime.core import reference  # noqa: E402
from ep_runtime.core.config import EPConfig  # noqa: E402
from ep_runtime.shmem.launch import run_pes  # noqa: E402
from ep_runtime.testing import make_inputs  # noqa: E402

RUN_TIMEOUT_S = 240


@dataclass(frozen=True)
class Case:
    name: str
    cfg: dict
    scenario: str = "random"
    seed: int = 0
    num_permuted_tokens: int | None = None
    int64_ids: bool = False
    weights_grad: bool = True  # False: a router whose weights need no gradient (backward: 1 dispatch + 1 combine)

    def config(self) -> EPConfig:
        return EPConfig(**self.cfg)

    def inputs(self):
        """tokens [T, H] bf16, ids [T, K] int32, weights [T, K] float32 in [0.2, 0.9], cotangent
        c [T, H] float32 exact in bf16; lists over ranks."""
        cfg = self.config()
        xs, ids, _ = make_inputs(cfg, self.scenario, self.seed)
        rng = np.random.default_rng(self.seed + 100)
        ws = [rng.uniform(0.2, 0.9, i.shape).astype(np.float32) for i in ids]
        cs = [rng.standard_normal(x.shape).astype(reference.BF16).astype(np.float32) for x in xs]
        return xs, ids, ws, cs


def expert_scale_shift(e):
    """f_e(X) = X * 2**(e % 3 - 1) + (e + 1) / 8."""
    return np.float32(2.0 ** (e % 3 - 1)), np.float32((e + 1) / 8)


def cfg2(**changes):
    return {**dict(n_ranks=2, n_experts=4, top_k=2, hidden=16, max_tokens_per_rank=6), **changes}


CASES_2 = (
    Case("random", cfg2(), seed=1),
    Case("zero_rank", cfg2(), "zero_rank", seed=2),
    Case("top_k_1_int64_ids", cfg2(top_k=1), seed=3, int64_ids=True),
    Case("pad_4_num_permuted_tokens", cfg2(pad_multiple=4), seed=4, num_permuted_tokens=30),
    Case("top_k_all_hidden_8", cfg2(top_k=4, hidden=8), seed=5),  # every token to every expert; hidden 8 < 3 * top_k
    # float32 combine partials: the module passes bf16 expert outputs (expanded layout), as in bf16 mode
    Case("random_float32_partials", cfg2(combine_dtype="float32"), seed=7),
    Case("weights_without_gradient", cfg2(), seed=9, weights_grad=False),
    Case("masked", cfg2(), "masked", seed=8),  # -1 slots, fully masked tokens, a rank masking every token
)
CASES_4 = (Case("random_4_ranks", dict(cfg2(n_ranks=4, n_experts=8), top_k=3), seed=6),)


# -- per-rank bodies (run in the PE processes) ------------------------------------------------------
def _ptr(a) -> int:
    return a.__array_interface__["data"][0]


def _record_pointers(rt, log: list):
    """Wrap the runtime's calls to log the data pointers of the arrays they receive."""
    da, ca, cw = rt.dispatch_async, rt.combine_async, rt.combine_wait

    def dispatch_async(tokens, topk_ids=None, topk_weights=None, **kw):
        if kw.get("routing") is not None:  # a kept routing: no ids or weights pass
            log.append(("dispatch with a kept routing", _ptr(tokens)))
        else:
            log.append(("dispatch", _ptr(tokens), _ptr(topk_ids), _ptr(topk_weights)))
        return da(tokens, topk_ids, topk_weights, **kw)

    def combine_async(expert_out, handle, **kw):
        log.append(("combine_in", _ptr(expert_out)))
        return ca(expert_out, handle, **kw)

    def combine_wait(handle, out=None, **kw):
        log.append(("combine_out", _ptr(out)))
        return cw(handle, out=out, **kw)

    rt.dispatch_async, rt.combine_async, rt.combine_wait = dispatch_async, combine_async, combine_wait
    return da, ca, cw


def _bf16(a: np.ndarray):
    return torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16)


def grads_pe(session, cases) -> dict:
    import torch

    from ep_runtime.core.errors import EPInputError
    from ep_runtime.torch import close_buffers, fused_combine, fused_dispatch, get_buffer, get_hidden_bytes

    torch.set_num_threads(1)
    r, results = session.rank, {}
    for case in cases:
        cfg = case.config()
        xs, ids, ws, cs = case.inputs()
        rt = get_buffer(session, cfg.hidden * 2, cfg.n_experts, cfg.top_k, cfg.max_tokens_per_rank,
                        pad_multiple=cfg.pad_multiple, combine_dtype=cfg.combine_dtype)
        log, calls_before = [], rt.calls
        originals = _record_pointers(rt, log)
        x = _bf16(xs[r]).clone().requires_grad_()
        w = torch.from_numpy(ws[r]).requires_grad_(case.weights_grad)
        idt = torch.from_numpy(ids[r].astype(np.int64) if case.int64_ids else ids[r])
        assert get_hidden_bytes(x) == cfg.hidden * 2
        expert_x, row_weight, tokens_per_expert, h = fused_dispatch(x, idt, w, rt, case.num_permuted_tokens)
        # the expert: f_e per segment; padding and trailing rows use the last expert's map (non-zero)
        scale = torch.empty(h.n_rows)
        shift = torch.empty(h.n_rows)
        offsets = h.row_offsets.tolist()
        for e in range(cfg.n_local_experts):
            a, b = expert_scale_shift(r * cfg.n_local_experts + e)
            end = offsets[e + 1] if e + 1 < cfg.n_local_experts else h.n_rows
            scale[offsets[e]:end], shift[offsets[e]:end] = float(a), float(b)
        y = (expert_x.float() * scale[:, None] + shift[:, None]).to(torch.bfloat16)
        try:
            fused_combine(y, w.detach().clone(), h)
            wrong_weights = None
        except EPInputError as exc:
            wrong_weights = str(exc)
        out = fused_combine(y, w, h)
        forward_log = list(log)
        (out.float() * torch.from_numpy(cs[r])).sum().backward()
        backward_log = [entry[0] for entry in log[len(forward_log):]]
        results[case.name] = dict(
            out=out.detach().float().numpy(), x_grad=x.grad.float().numpy(),
            w_grad=w.grad.numpy() if case.weights_grad else None,
            expert_x=expert_x.detach().view(torch.int16).numpy().view(np.uint16), row_weight=row_weight.numpy(),
            tokens_per_expert=tokens_per_expert.numpy(), row_offsets=h.row_offsets.numpy(),
            row_src_k=h.row_src_k.numpy(), n_rows=h.n_rows, wrong_weights=wrong_weights,
            forward_log=forward_log, backward_log=backward_log, n_runtime_calls=rt.calls - calls_before,
            pointers=dict(x=x.data_ptr(), ids=idt.data_ptr(), w=w.data_ptr(), y=y.data_ptr(), out=out.data_ptr(),
                          expert_x=expert_x.data_ptr(),
                          heap=(_ptr(rt.buffers["expert_x"]), rt.buffers["expert_x"].nbytes)))
        rt.dispatch_async, rt.combine_async, rt.combine_wait = originals
    close_buffers(session)
    return results


def buffer_pe(session) -> dict:
    from ep_runtime.torch import close_buffers, get_buffer

    a = get_buffer(session, 32, 4, 2, 6)
    b = get_buffer(session, 32, 4, 2, 6)
    c = get_buffer(session, 32, 4, 2, 8)         # grows
    d = get_buffer(session, 32, 4, 2, 4)         # never shrinks
    e = get_buffer(session, 64, 4, 2, 4)         # another hidden: exactly as asked
    out = dict(same=a is b, grew=c is not a and c.cfg.max_tokens_per_rank == 8, kept=d is c,
               rebuilt=(e is not d, e.cfg.hidden, e.cfg.max_tokens_per_rank), old_closed=a._closed and c._closed)
    close_buffers(session)
    out["closed"] = e._closed
    return out


@functools.lru_cache(maxsize=None)
def sim(n_ranks: int) -> list:
    cases = CASES_2 if n_ranks == 2 else CASES_4
    return run_pes(grads_pe, n_ranks, args=(cases,), timeout_s=RUN_TIMEOUT_S)


# -- the dense reference ----------------------------------------------------------------------------
def dense_reference(case: Case, xs, ids, ws, cs):
    """Per rank: out, dL/dx, dL/dw (float64 autograd) and the per-element scales of the tolerances."""
    cfg = case.config()
    res = []
    for x, i, w, c in zip(xs, ids, ws, cs):
        x32 = torch.from_numpy(x.astype(np.float32))
        a = torch.tensor([[expert_scale_shift(e)[0] for e in row] for row in i], dtype=torch.float32)
        b = torch.tensor([[expert_scale_shift(e)[1] for e in row] for row in i], dtype=torch.float32)
        a, b = a.reshape(len(x), cfg.top_k, 1), b.reshape(len(x), cfg.top_k, 1)
        y32 = (x32[:, None, :] * a + b).to(torch.bfloat16).float()  # what the expert computes
        x64 = x32.double().requires_grad_()
        w64 = torch.from_numpy(w).double().requires_grad_()
        y = x64[:, None, :] * a.double() + b.double()
        y = y + (y32.double() - y).detach()  # the bf16 rounding as a constant
        c64 = torch.from_numpy(c).double()
        live = torch.from_numpy((i >= 0).astype(np.float64))  # a masked slot (-1) adds nothing, its weight no gradient
        out = ((w64 * live)[:, :, None] * y).sum(1)
        (out * c64).sum().backward()
        res.append(dict(out=out.detach().numpy(), x_grad=x64.grad.numpy(), w_grad=w64.grad.numpy(),
                        x_scale=(a.double() * (w64.detach() * live)[:, :, None]).abs().sum(1).numpy() * np.abs(c),
                        w_scale=(y32.double().abs() * c64.abs()[:, None, :]).sum(2).numpy(),
                        y_max=float(y32.abs().max()) if len(x) else 0.0))
    return res


ALL = [(2, c) for c in CASES_2] + [(4, c) for c in CASES_4]


def _per_rank(R, case):
    xs, ids, ws, cs = case.inputs()
    return sim(R), xs, ids, ws, cs, dense_reference(case, xs, ids, ws, cs)


@pytest.mark.parametrize("R,case", ALL, ids=[c.name for _, c in ALL])
def test_dispatch_outputs_match_the_reference_after_backward(R, case):
    runs, xs, ids, ws, _, _ = _per_rank(R, case)
    cfg = case.config()
    batches = reference.dispatch(xs, ids, ws, cfg)
    for r, ref in enumerate(batches):
        got, n = runs[r][case.name], ref.n_rows
        assert got["n_rows"] == (case.num_permuted_tokens or n)
        np.testing.assert_array_equal(got["row_offsets"], ref.row_offsets, err_msg=f"rank {r}")
        np.testing.assert_array_equal(got["tokens_per_expert"], ref.expert_counts, err_msg=f"rank {r}")
        np.testing.assert_array_equal(got["expert_x"][:n], ref.x.view(np.uint16), err_msg=f"rank {r}")
        np.testing.assert_array_equal(got["row_weight"][:n].view(np.uint32), ref.weight.view(np.uint32))
        np.testing.assert_array_equal(got["row_src_k"][:n], ref.src_k, err_msg=f"rank {r}")
        assert not got["expert_x"][n:].any() and not got["row_weight"][n:].any()  # past the end: zero
        assert (got["row_src_k"][n:] == -1).all()


@pytest.mark.parametrize("R,case", ALL, ids=[c.name for _, c in ALL])
def test_forward_and_gradients_match_dense_torch(R, case):
    runs, xs, ids, ws, _, refs = _per_rank(R, case)
    for r, ref in enumerate(refs):
        got = runs[r][case.name]
        assert got["out"].shape == ref["out"].shape == xs[r].shape
        tol = reference.combine_tolerance(ws[r], ref["y_max"])
        assert (np.abs(got["out"] - ref["out"]) <= tol).all(), f"rank {r}: out"
        err_x = np.abs(got["x_grad"] - ref["x_grad"])
        assert (err_x <= 2.0**-7 * ref["x_scale"]).all(), f"rank {r}: dL/dx off by up to {err_x.max()}"
        assert np.isfinite(got["x_grad"]).all()
        if not case.weights_grad:
            assert got["w_grad"] is None
            continue
        err_w = np.abs(got["w_grad"] - ref["w_grad"])
        assert (err_w <= 4e-6 * ref["w_scale"] + 1e-30).all(), f"rank {r}: dL/dw off by up to {err_w.max()}"
        assert np.isfinite(got["w_grad"]).all()


def test_a_rank_without_tokens_still_takes_part_and_gets_empty_gradients():
    got = sim(2)[0]["zero_rank"]
    assert got["out"].shape == (0, 16) and got["x_grad"].shape == (0, 16) and got["w_grad"].shape == (0, 2)
    assert sim(2)[1]["zero_rank"]["x_grad"].any()  # its peer's gradients came through


@pytest.mark.parametrize("R,case", ALL, ids=[c.name for _, c in ALL])
def test_backward_dispatches_once_with_or_without_the_weights_gradient(R, case):
    # forward: 1 dispatch (+ 1 rejected combine, + 1 combine); backward: 1 dispatch, its slot values
    # home when the weights need a gradient, then the combine of dL/dx on it
    assert all(run[case.name]["n_runtime_calls"] == 2 for run in sim(R))
    # ... with the forward's routing, kept: no ids or weights go again
    for run in sim(R):
        assert run[case.name]["backward_log"] == ["dispatch with a kept routing", "combine_in", "combine_out"], \
            run[case.name]["backward_log"]


def test_combine_rejects_weights_other_than_the_dispatched_tensor():
    for run in sim(2):
        assert "not the tensor given to the dispatch" in run["random"]["wrong_weights"]


@pytest.mark.parametrize("name", [c.name for c in CASES_2])
def test_zero_copy_on_the_simulator(name):
    """Inputs and the combine output are the tensors' own memory; dispatch outputs are copies
    (checked by value after the backward overwrote the runtime's buffers, and by address here)."""
    case = next(c for c in CASES_2 if c.name == name)
    for r, run in enumerate(sim(2)):
        got = run[name]
        p, log = got["pointers"], got["forward_log"]
        dispatch, combine_in, combine_out = log[0], log[-2], log[-1]
        assert dispatch[0] == "dispatch" and combine_in[0] == "combine_in" and combine_out[0] == "combine_out"
        if len(got["out"]):  # NumPy gives empty arrays their own address
            assert dispatch[1] == p["x"] and dispatch[3] == p["w"] and combine_out[1] == p["out"], f"rank {r}"
            assert (dispatch[2] == p["ids"]) != case.int64_ids, f"rank {r}: int32 ids shared, int64 converted"
        assert combine_in[1] == p["y"]
        lo, nbytes = p["heap"]
        assert not lo <= p["expert_x"] < lo + nbytes, "expert_x must not be a view of the runtime's buffer"


def test_get_buffer_builds_reuses_grows_and_closes():
    for got in run_pes(buffer_pe, 2, timeout_s=RUN_TIMEOUT_S):
        assert got == dict(same=True, grew=True, kept=True, rebuilt=(True, 32, 4), old_closed=True, closed=True)


def test_importing_without_torch_names_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)
    monkeypatch.delitem(sys.modules, "ep_runtime.torch", raising=False)
    monkeypatch.delitem(sys.modules, "ep_runtime.integrations.torch", raising=False)
    import ep_runtime.integrations

    monkeypatch.delattr(ep_runtime.integrations, "torch", raising=False)  # (an earlier test may have imported it)
    with pytest.raises(ImportError, match=r'PyTorch: pip install -e "\.\[torch\]"'):
        importlib.import_module("ep_runtime.torch")
