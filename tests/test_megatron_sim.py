"""`ep_runtime.megatron` on the CPU simulator: Megatron-core's ``fused_a2a`` functions (DeepEP's
pair on the compact layout, HybridEP's on the expanded one) in a toy MoE layer written the way
Megatron's flex dispatcher uses them, against the same layer written densely in float64 torch
(``tests/test_torch_sim.py``'s reference).

The layer: each local expert ``f_e(X) = bf16(a_e X + b_e)`` multiplied by its probability on
the expert's side (Megatron's experts apply the probabilities), the combine summing rows
unweighted. Per rank and case, checked:

- the dispatch outputs exactly against :func:`ep_runtime.core.reference.dispatch` (DeepEP's
  ``recv_x``, ``recv_token_indices`` and ``recv_token_probs``; HybridEP's rows, their
  probabilities and the per-expert counts);
- ``out`` within ``3 * 2**-7 * sum_k |w_tk| * max|y|``: the reference's two bf16 roundings (partial,
  output) plus the row's ``bf16(f * p)``;
- ``dL/dx`` within ``2**-6 * sum_k |a_e w_tk c_t|`` (four bf16 roundings of 2**-9 on the way);
- ``dL/dprobs`` within ``4e-6 * sum_h |y c|``: float32 dot products, home as float32 slot values;
- the runtime calls: forward 1 dispatch + 1 combine, backward 1 dispatch + 1 combine, plus one
  slot return (``slot_values_async``: ``T x K`` floats) that carries the probabilities' gradient
  home on the backward's dispatch.

Both layers also train with each rank its own logical node (the hierarchical transport). The
layer runs on ``run_pes`` sessions bound with :func:`ep_runtime.megatron.use_session`; the
path through a torch.distributed group's own session (``session_for``, what Megatron calls) runs
in tests/test_megatron_core_sim.py, inside Megatron-core's MoE layer.
"""

from __future__ import annotations

import functools
import sys
import types

import numpy as np
import pytest
import torch
from test_torch_sim import Case, cfg2, dense_reference, expert_scale_shift

from ep_runtime.core import reference
from ep_runtime.shmem.launch import run_pes

RUN_TIMEOUT_S = 240
CASES = (
    Case("random", cfg2(), seed=21),
    Case("zero_rank_top_k_1", cfg2(top_k=1), "zero_rank", seed=22),
    Case("masked", cfg2(), "masked", seed=26),  # 6 live slots of 12 on rank 0; the last rank masks every token
)
HYBRID_CASES = CASES + (Case("pad_4_num_permuted_tokens", cfg2(pad_multiple=4), seed=24, num_permuted_tokens=30),)


def _bf16(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16)


def _expert(e: int, rows: torch.Tensor) -> torch.Tensor:
    a, b = expert_scale_shift(e)
    return (rows.float() * float(a) + float(b)).to(torch.bfloat16)


def _counting(rt, counts: dict) -> None:
    for name in ("dispatch_async", "combine_async", "slot_values_async"):
        method = getattr(rt, name)

        def counted(*args, _m=method, _n=name, **kw):
            counts[_n] = counts.get(_n, 0) + 1
            return _m(*args, **kw)

        setattr(rt, name, counted)


def deepep_pe(session, cases, nodes: int = 1) -> dict:
    """The DeepEP-style layer of each case (on ``nodes`` logical nodes)."""
    from ep_runtime import megatron

    if nodes > 1:
        session.use_logical_nodes(nodes)
    torch.set_num_threads(1)
    megatron.use_session(session)
    group = None  # the session bound to the default group
    r, results = session.rank, {}
    for case in cases:
        cfg = case.config()
        xs, ids, ws, cs = case.inputs()
        L = cfg.n_local_experts
        rt = megatron.get_buffer(group, cfg.hidden * 2, cfg.n_experts, cfg.top_k, cfg.max_tokens_per_rank)
        counts = {}
        _counting(rt, counts)
        x = _bf16(xs[r]).clone().requires_grad_()
        probs = torch.from_numpy(ws[r]).requires_grad_()
        recv_x, indices, recv_probs, tokens_per_expert, handle = megatron.fused_dispatch(
            x, torch.from_numpy(ids[r]).long(), probs, cfg.n_experts, group)
        # Megatron's permute / experts / unpermute, densely: each row's sum over its local experts
        partial = torch.zeros(recv_x.shape, dtype=torch.float32)
        for e in range(L):
            p = (recv_probs * (indices == e)).sum(dim=1, keepdim=True)
            partial = partial + _expert(r * L + e, recv_x).float() * p
        out, none = megatron.fused_combine(partial.to(torch.bfloat16), group, handle)
        (out.float() * torch.from_numpy(cs[r])).sum().backward()
        results[case.name] = dict(
            out=out.detach().float().numpy(), x_grad=x.grad.float().numpy(), w_grad=probs.grad.numpy(), none=none,
            recv_x=recv_x.detach().view(torch.int16).numpy().view(np.uint16), indices=indices.numpy(),
            recv_probs=recv_probs.detach().numpy(), tokens_per_expert=tokens_per_expert.numpy(),
            counts_device=str(tokens_per_expert.device), calls=counts, transport=rt.plan.transport.value)
    megatron.close_buffers()
    return results


def hybrid_pe(session, cases, nodes: int = 1) -> dict:
    """The HybridEP-style layer of each case (on ``nodes`` logical nodes)."""
    from ep_runtime import megatron

    if nodes > 1:
        session.use_logical_nodes(nodes)
    torch.set_num_threads(1)
    megatron.use_session(session)
    group = None  # the session bound to the default group
    r, results = session.rank, {}
    for case in cases:
        cfg = case.config()
        xs, ids, ws, cs = case.inputs()
        L, E, T = cfg.n_local_experts, cfg.n_experts, len(xs[r])
        megatron.close_buffers()  # each case builds its runtime from its own routing map (top_k, pad_multiple)
        megatron.init_hybrid_ep_buffer(group, cfg.hidden, cfg.max_tokens_per_rank, L, 24, 24, False)
        routing_map = torch.zeros(T, E, dtype=torch.bool)
        dense = torch.zeros(T, E, dtype=torch.float32)
        live = ids[r] >= 0
        rows_t = np.nonzero(live)[0]
        routing_map[rows_t, ids[r][live]] = True
        dense[rows_t, ids[r][live]] = torch.from_numpy(ws[r][live])
        dense.requires_grad_()
        x = _bf16(xs[r]).clone().requires_grad_()
        pad = cfg.pad_multiple if cfg.pad_multiple > 1 else None
        hidden, row_probs, scaling, tokens_per_expert, handle = megatron.hybrid_ep_dispatch(
            x, routing_map, dense, group, L, num_permuted_tokens=case.num_permuted_tokens, pad_multiple=pad)
        counts = {}
        _counting(handle.runtime, counts)
        # the experts: f_e per segment times the row's probability (padding rows: probability 0)
        offsets = np.concatenate([[0], np.cumsum(tokens_per_expert.numpy())])  # padded counts when pad is given
        y = torch.zeros(hidden.shape, dtype=torch.bfloat16)
        for e in range(L):
            lo, hi = int(offsets[e]), int(offsets[e + 1])
            y[lo:hi] = (_expert(r * L + e, hidden[lo:hi]).float() * row_probs[lo:hi, None]).to(torch.bfloat16)
        out = megatron.hybrid_ep_combine(y, handle, case.num_permuted_tokens, pad)
        (out.float() * torch.from_numpy(cs[r])).sum().backward()
        results[case.name] = dict(
            out=out.detach().float().numpy(), x_grad=x.grad.float().numpy(), dense_grad=dense.grad.numpy(),
            hidden=hidden.detach().view(torch.int16).numpy().view(np.uint16), row_probs=row_probs.detach().numpy(),
            tokens_per_expert=tokens_per_expert.numpy(), scaling=scaling, top_k=handle.runtime.cfg.top_k,
            calls={**counts, "dispatch_async": 1 + counts.get("dispatch_async", 0)},  # (counted from the combine)
            transport=handle.runtime.plan.transport.value)
    megatron.close_buffers()
    return results


@functools.lru_cache(maxsize=None)
def sim(kind: str) -> list:
    if kind == "deepep":
        return run_pes(deepep_pe, 2, args=(CASES,), timeout_s=RUN_TIMEOUT_S)
    return run_pes(hybrid_pe, 2, args=(HYBRID_CASES,), timeout_s=RUN_TIMEOUT_S)


def _check_against_dense(case, got_per_rank, grad_key):
    xs, ids, ws, cs = case.inputs()
    cfg = case.config()
    for r, ref in enumerate(dense_reference(case, xs, ids, ws, cs)):
        got = got_per_rank[r][case.name]
        live = ids[r] >= 0
        S = (np.abs(ws[r]) * live).sum(axis=1, keepdims=True) * ref["y_max"]
        assert got["out"].shape == xs[r].shape
        assert (np.abs(got["out"] - ref["out"]) <= 3 * 2.0**-7 * S).all(), f"rank {r}: out"
        err_x = np.abs(got["x_grad"] - ref["x_grad"])
        assert (err_x <= 2.0**-6 * ref["x_scale"]).all(), f"rank {r}: dL/dx off by up to {err_x.max()}"
        w_grad = got[grad_key]
        if grad_key == "dense_grad":  # [T, E]: the slots' gradients at their experts, zero elsewhere
            slot = np.zeros(ids[r].shape, np.float32)
            slot[live] = w_grad[np.nonzero(live)[0], ids[r][live]]
            off_map = w_grad.copy()
            off_map[np.nonzero(live)[0], ids[r][live]] = 0
            assert not off_map.any(), f"rank {r}: a probability gradient off the routing map"
            w_grad = slot
        err_w = np.abs(w_grad - np.where(live, ref["w_grad"], 0))
        assert (err_w <= 4e-6 * ref["w_scale"] + 1e-30).all(), f"rank {r}: dL/dprobs off by up to {err_w.max()}"
        assert np.isfinite(got["x_grad"]).all() and np.isfinite(w_grad).all()
        assert cfg.top_k == ids[r].shape[1]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_deepep_dispatch_outputs_are_the_reference_batch(case):
    cfg = case.config()
    xs, ids, ws, _ = case.inputs()
    C, K, L = cfg.max_tokens_per_rank, cfg.top_k, cfg.n_local_experts
    for r, ref in enumerate(reference.dispatch(xs, ids, ws, cfg)):
        got = sim("deepep")[r][case.name]
        want_x = np.zeros((cfg.n_ranks * C, cfg.hidden), np.uint16)
        want_idx = np.full((cfg.n_ranks * C, K), -1, np.int64)
        want_p = np.zeros((cfg.n_ranks * C, K), np.float32)
        for i in range(ref.n_rows):
            row = ref.src_rank[i] * C + ref.src_token[i]
            want_x[row] = xs[ref.src_rank[i]][ref.src_token[i]].view(np.uint16)
            want_idx[row, ref.src_k[i]] = np.searchsorted(ref.row_offsets, i, side="right") - 1
            want_p[row, ref.src_k[i]] = ref.weight[i]
        np.testing.assert_array_equal(got["recv_x"], want_x, err_msg=f"rank {r}: recv_x")
        np.testing.assert_array_equal(got["indices"], want_idx, err_msg=f"rank {r}: recv_token_indices")
        np.testing.assert_array_equal(got["recv_probs"].view(np.uint32), want_p.view(np.uint32))
        np.testing.assert_array_equal(got["tokens_per_expert"], ref.expert_counts)
        assert got["counts_device"] == "cpu" and got["none"] is None and got["tokens_per_expert"].shape == (L,)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_deepep_layer_forward_and_gradients_match_dense_torch(case):
    _check_against_dense(case, sim("deepep"), "w_grad")


def test_deepep_backward_is_one_dispatch_and_one_combine_plus_the_probabilities():
    for run in sim("deepep"):
        for case in CASES:  # forward 1 + 1; backward 1 + 1 and the probabilities' gradient (T x K floats)
            assert run[case.name]["calls"] == {"dispatch_async": 2, "combine_async": 2, "slot_values_async": 1}, \
                case.name


@pytest.mark.parametrize("case", HYBRID_CASES, ids=[c.name for c in HYBRID_CASES])
def test_hybrid_ep_dispatch_outputs_are_the_reference_batch(case):
    cfg = case.config()
    xs, ids, ws, _ = case.inputs()
    for r, ref in enumerate(reference.dispatch(xs, ids, ws, cfg)):
        got = sim("hybridep")[r][case.name]
        n = ref.n_rows
        assert got["hidden"].shape[0] == (case.num_permuted_tokens or n)
        np.testing.assert_array_equal(got["hidden"][:n], ref.x.view(np.uint16), err_msg=f"rank {r}")
        np.testing.assert_array_equal(got["row_probs"][:n].view(np.uint32), ref.weight.view(np.uint32))
        assert not got["hidden"][n:].any() and not got["row_probs"][n:].any()
        want = np.diff(ref.row_offsets) if cfg.pad_multiple > 1 else ref.expert_counts
        np.testing.assert_array_equal(got["tokens_per_expert"], want, err_msg=f"rank {r}")
        # the buffer's top_k: the most experts of any token on any rank in the first call's routing map
        assert got["scaling"] is None and got["top_k"] == max(int((i >= 0).sum(axis=1).max(initial=0)) for i in ids)


@pytest.mark.parametrize("case", HYBRID_CASES, ids=[c.name for c in HYBRID_CASES])
def test_hybrid_ep_layer_forward_and_gradients_match_dense_torch(case):
    _check_against_dense(case, sim("hybridep"), "dense_grad")


def test_hybrid_ep_backward_is_one_dispatch_and_one_combine_plus_the_probabilities():
    for run in sim("hybridep"):
        for case in HYBRID_CASES:
            assert run[case.name]["calls"] == {"dispatch_async": 2, "combine_async": 2, "slot_values_async": 1}, \
                case.name


@pytest.mark.parametrize("kind", ["deepep", "hybridep"])
def test_both_layers_train_across_logical_nodes(kind):
    """Each rank its own logical node (2 x 1: the hierarchical transport, every row crossing
    "nodes" through a proxy): the forward and both gradients as on one node, the backward a kept
    routing's dispatch, slot values and a combine."""
    pe, cases, grad = (deepep_pe, CASES, "w_grad") if kind == "deepep" else (hybrid_pe, HYBRID_CASES, "dense_grad")
    runs = run_pes(pe, 2, args=(cases, 2), timeout_s=RUN_TIMEOUT_S)
    for case in cases:
        assert all(run[case.name]["transport"] == "hierarchical" for run in runs), case.name
        assert all(run[case.name]["calls"] == {"dispatch_async": 2, "combine_async": 2, "slot_values_async": 1}
                   for run in runs), case.name
        _check_against_dense(case, runs, grad)


def test_install_points_megatron_s_modules_at_these_functions(monkeypatch):
    from ep_runtime import megatron

    fused_a2a = types.ModuleType("megatron.core.transformer.moe.fused_a2a")
    dispatcher = types.ModuleType("megatron.core.transformer.moe.token_dispatcher")
    fused_a2a.HAVE_DEEP_EP = fused_a2a.HAVE_HYBRIDEP = False
    fused_a2a.fused_dispatch = fused_a2a.hybrid_ep_dispatch = None
    dispatcher.fused_dispatch = dispatcher.fused_combine = dispatcher.hybrid_ep_dispatch = None
    dispatcher.hybrid_ep_combine = dispatcher.set_deepep_num_sms = None
    dispatcher.unrelated = "kept"
    monkeypatch.setitem(sys.modules, fused_a2a.__name__, fused_a2a)
    monkeypatch.setitem(sys.modules, dispatcher.__name__, dispatcher)
    replaced = megatron.install()
    assert fused_a2a.fused_dispatch is megatron.fused_dispatch and fused_a2a.HAVE_DEEP_EP is True
    assert fused_a2a.init_hybrid_ep_buffer is megatron.init_hybrid_ep_buffer and fused_a2a.HAVE_HYBRIDEP is True
    assert dispatcher.hybrid_ep_combine is megatron.hybrid_ep_combine and dispatcher.fused_combine is megatron.fused_combine
    assert dispatcher.unrelated == "kept" and not hasattr(dispatcher, "HybridEPDispatch")
    assert "megatron.core.transformer.moe.token_dispatcher.fused_dispatch" in replaced


def test_install_without_megatron_names_the_package(monkeypatch):
    from ep_runtime import megatron
    from ep_runtime.core.errors import EPInputError

    for name in megatron.MEGATRON_MODULES:
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(EPInputError, match=r'pip install -e "\.\[megatron\]"'):
        megatron.install()


def test_hidden_bytes_follow_megatron():
    from ep_runtime import megatron

    assert megatron.get_hidden_bytes(torch.zeros(3, 16, dtype=torch.bfloat16)) == 32
    assert megatron.get_hidden_bytes(torch.zeros(3, 16, dtype=torch.float32)) == 64
    assert megatron.get_hidden_bytes(torch.zeros(3, 16, dtype=torch.uint8)) == 32
