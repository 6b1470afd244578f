"""Megatron-core's own ``fused_a2a`` (0.16.1, unmodified) on ``ep_runtime.deep_ep``, on the CPU
simulator: its DeepEP pair (``fused_dispatch`` / ``fused_combine``: ``deep_ep.Buffer``) and its
HybridEP pair (``hybrid_ep_dispatch`` / ``hybrid_ep_combine``: ``deep_ep.HybridEPBuffer``) in a
toy MoE layer written the way Megatron's flex dispatcher uses them, against the same layer
written densely in float64 torch (``tests/test_torch_sim.py``'s reference).

The layer: each local expert ``f_e(X) = bf16(a_e X + b_e)`` multiplied by its probability on
the expert's side (Megatron's experts apply the probabilities), the combine summing rows
unweighted. Per rank and case, checked:

- the dispatch outputs exactly against :func:`ep_runtime.core.reference.dispatch`: DeepEP's
  ``recv_x`` with ``num_recv`` rows (one per received (token, source rank), source then token
  order; not ``R x C``), ``recv_token_indices`` and ``recv_token_probs``; HybridEP's rows, their
  probabilities and the per-expert counts;
- ``out`` within ``3 * 2**-7 * sum_k |w_tk| * max|y|``: the reference's two bf16 roundings (partial,
  output) plus the row's ``bf16(f * p)``;
- ``dL/dx`` within ``2**-6 * sum_k |a_e w_tk c_t|`` (four bf16 roundings of 2**-9 on the way);
- ``dL/dprobs`` within ``4e-6 * sum_h |y c|``: float32 dot products, home as float32;
- the calls: forward a dispatch and a combine of the layer, backward a cached dispatch and a
  combine (Megatron's autograd functions); underneath, DeepEP's backward combine takes its
  ``topk_weights`` (the probabilities' gradient) home on the float32 runtime (one more small
  dispatch and combine: DeepEP sums every slot over the ranks), HybridEP's ``probs`` as slot
  values on the backward's dispatch.

Both layers also train with each rank its own logical node (the hierarchical transport). Each
runs in a torch.distributed gloo job of 2 ranks (forked by
:func:`test_sessions_sim.torch_job_main`), ``import deep_ep`` giving the layer
(:func:`ep_runtime.megatron.fused_a2a`) before Megatron-core's module is imported.
"""

from __future__ import annotations

import functools
import importlib.util
import sys
import types

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(importlib.util.find_spec("megatron") is None,
                                reason="megatron-core is not installed (pip install -e \".[megatron]\")")

from test_torch_sim import Case, cfg2, dense_reference, expert_scale_shift  # noqa: E402

from ep_runtime.core import reference  # noqa: E402

JOB_TIMEOUT_S = 600
CASES = (
    Case("random", cfg2(), seed=21),
    Case("zero_rank_top_k_1", cfg2(top_k=1), "zero_rank", seed=22),
    Case("masked", cfg2(), "masked", seed=26),  # 6 live slots of 12 on rank 0; the last rank masks every token
)
HYBRID_CASES = CASES + (Case("pad_4_num_permuted_tokens", cfg2(pad_multiple=4), seed=24, num_permuted_tokens=32),)
#: The runtime calls counted in each case (every runtime of the process).
COUNTED = ("dispatch_async", "combine_async", "slot_values_async")


def _bf16(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16)


def _expert(e: int, rows: torch.Tensor) -> torch.Tensor:
    a, b = expert_scale_shift(e)
    return (rows.float() * float(a) + float(b)).to(torch.bfloat16)


def _counting(counts: dict):
    """Count the runtime calls of :data:`COUNTED` (all runtimes: the class's methods wrapped)."""
    from ep_runtime.core.runtime import EPRuntime

    for name in COUNTED:
        method = getattr(EPRuntime, name)

        def counted(self, *args, _m=method, _n=name, **kw):
            counts[_n] = counts.get(_n, 0) + 1
            return _m(self, *args, **kw)

        setattr(EPRuntime, name, counted)


def _warm_up(fused_a2a, group, cfg) -> None:
    """A first dispatch at the largest batch (``max_tokens_per_rank`` tokens on every rank): the
    layer sizes its buffers by the first call of a shape (docs/deep_ep.md, "Memory")."""
    T, E, K = cfg.max_tokens_per_rank, cfg.n_experts, cfg.top_k
    ids = (torch.arange(T * K).view(T, K) % E).long()
    x = torch.zeros(T, cfg.hidden, dtype=torch.bfloat16)
    recv, _, _, _, handle = fused_a2a.fused_dispatch(x, ids, torch.ones(T, K), E, group)
    fused_a2a.fused_combine(recv, group, handle)


def deepep_case(fused_a2a, group, case, rank: int, counts: dict) -> dict:
    """The DeepEP-style layer of ``case`` through Megatron's fused_dispatch / fused_combine."""
    cfg = case.config()
    xs, ids, ws, cs = case.inputs()
    L = cfg.n_local_experts
    x = _bf16(xs[rank]).clone().requires_grad_()
    probs = torch.from_numpy(ws[rank]).requires_grad_()
    counts.clear()
    recv_x, indices, recv_probs, tokens_per_expert, handle = fused_a2a.fused_dispatch(
        x, torch.from_numpy(ids[rank]).long(), probs, cfg.n_experts, group)
    # Megatron's permute / experts / unpermute, densely: each row's sum over its local experts
    partial = torch.zeros(recv_x.shape, dtype=torch.float32)
    for e in range(L):
        p = (recv_probs * (indices == e)).sum(dim=1, keepdim=True)
        partial = partial + _expert(rank * L + e, recv_x).float() * p
    out, none = fused_a2a.fused_combine(partial.to(torch.bfloat16), group, handle)
    (out.float() * torch.from_numpy(cs[rank])).sum().backward()
    return dict(out=out.detach().float().numpy(), x_grad=x.grad.float().numpy(), w_grad=probs.grad.numpy(),
                none=none, recv_x=recv_x.detach().view(torch.int16).numpy().view(np.uint16),
                indices=indices.numpy(), recv_probs=recv_probs.detach().numpy(),
                tokens_per_expert=tokens_per_expert.numpy(), counts_device=str(tokens_per_expert.device),
                calls=dict(counts), transport=handle.state.owner._cache.session.spans_nodes())


def hybrid_case(fused_a2a, group, case, rank: int, counts: dict) -> dict:
    """The HybridEP-style layer of ``case`` through Megatron's hybrid_ep_dispatch / hybrid_ep_combine."""
    cfg = case.config()
    xs, ids, ws, cs = case.inputs()
    L, E, T = cfg.n_local_experts, cfg.n_experts, len(xs[rank])
    routing_map = torch.zeros(T, E, dtype=torch.bool)
    dense = torch.zeros(T, E, dtype=torch.float32)
    live = ids[rank] >= 0
    rows_t = np.nonzero(live)[0]
    routing_map[rows_t, ids[rank][live]] = True
    dense[rows_t, ids[rank][live]] = torch.from_numpy(ws[rank][live])
    dense.requires_grad_()
    x = _bf16(xs[rank]).clone().requires_grad_()
    pad = cfg.pad_multiple if cfg.pad_multiple > 1 else None
    counts.clear()
    hidden, row_probs, scaling, tokens_per_expert, handle = fused_a2a.hybrid_ep_dispatch(
        x, routing_map, dense, group, L, num_permuted_tokens=case.num_permuted_tokens, pad_multiple=pad)
    # the experts: f_e per segment times the row's probability (padding rows: probability 0)
    offsets = np.concatenate([[0], np.cumsum(tokens_per_expert.numpy())])  # padded counts when pad is given
    y = torch.zeros(hidden.shape, dtype=torch.bfloat16)
    for e in range(L):
        lo, hi = int(offsets[e]), int(offsets[e + 1])
        y[lo:hi] = (_expert(rank * L + e, hidden[lo:hi]).float() * row_probs[lo:hi, None]).to(torch.bfloat16)
    out = fused_a2a.hybrid_ep_combine(y, handle, case.num_permuted_tokens, pad)
    (out.float() * torch.from_numpy(cs[rank])).sum().backward()
    return dict(out=out.detach().float().numpy(), x_grad=x.grad.float().numpy(), dense_grad=dense.grad.numpy(),
                hidden=hidden.detach().view(torch.int16).numpy().view(np.uint16), row_probs=row_probs.detach().numpy(),
                tokens_per_expert=tokens_per_expert.numpy(), scaling=scaling, overflow=int(handle[-1]),
                calls=dict(counts), transport=handle.state.owner._cache.session.spans_nodes())


def torch_rank_main(rank: int, n: int, store: str, out_dir: str) -> None:
    """One rank of a gloo job: the cases of the kind and node count in ``out_dir``'s name."""
    import datetime
    import os
    import pickle

    import torch.distributed as dist

    from ep_runtime import megatron
    from ep_runtime.shmem import session_for

    kind, nodes = os.path.basename(os.path.dirname(out_dir.rstrip("/"))).split("-")[1:3]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=n,
                            timeout=datetime.timedelta(seconds=JOB_TIMEOUT_S))
    try:
        group = dist.new_group(list(range(n)))
        if int(nodes) > 1:
            session_for(group).use_logical_nodes(int(nodes))
        fused_a2a = megatron.fused_a2a()
        counts: dict = {}
        results = {}
        if kind == "deepep":
            _warm_up(fused_a2a, group, CASES[0].config())
            _counting(counts)
            for case in CASES:
                results[case.name] = deepep_case(fused_a2a, group, case, rank, counts)
        else:
            cfg = CASES[0].config()
            fused_a2a.init_hybrid_ep_buffer(group, cfg.hidden, cfg.max_tokens_per_rank, cfg.n_local_experts, 24, 24,
                                            False)
            _counting(counts)
            for case in HYBRID_CASES:
                results[case.name] = hybrid_case(fused_a2a, group, case, rank, counts)
    finally:
        dist.destroy_process_group()
    with open(os.path.join(out_dir, f"{rank}.pkl"), "wb") as f:
        pickle.dump(results, f)


@functools.lru_cache(maxsize=None)
def _job(kind: str, nodes: int, tmp: str) -> list:
    from pathlib import Path

    from test_sessions_sim import run_torch_job

    root = Path(tmp) / f"job-{kind}-{nodes}"
    root.mkdir()
    return run_torch_job("test_megatron_sim", 2, root, JOB_TIMEOUT_S)


@pytest.fixture(scope="module")
def sim(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("megatron_sim"))
    return lambda kind, nodes=1: _job(kind, nodes, tmp)


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
def test_deepep_dispatch_outputs_are_deep_ep_s_dense_rows(sim, case):
    cfg = case.config()
    xs, ids, ws, _ = case.inputs()
    K, L = cfg.top_k, cfg.n_local_experts
    for r, ref in enumerate(reference.dispatch(xs, ids, ws, cfg)):
        got = sim("deepep")[r][case.name]
        received = sorted({(int(s), int(t)) for s, t in zip(ref.src_rank, ref.src_token)})
        dense = {pair: i for i, pair in enumerate(received)}
        want_x = np.stack([xs[s][t].view(np.uint16) for s, t in received]) if received else \
            np.zeros((0, cfg.hidden), np.uint16)
        want_idx = np.full((len(received), K), -1, np.int64)
        want_p = np.zeros((len(received), K), np.float32)
        for i in range(ref.n_rows):
            row = dense[int(ref.src_rank[i]), int(ref.src_token[i])]
            want_idx[row, ref.src_k[i]] = np.searchsorted(ref.row_offsets, i, side="right") - 1
            want_p[row, ref.src_k[i]] = ref.weight[i]
        assert got["recv_x"].shape == (len(received), cfg.hidden), "num_recv rows, not n_ranks * max_tokens_per_rank"
        np.testing.assert_array_equal(got["recv_x"], want_x, err_msg=f"rank {r}: recv_x")
        np.testing.assert_array_equal(got["indices"], want_idx, err_msg=f"rank {r}: recv_token_indices")
        np.testing.assert_array_equal(got["recv_probs"].view(np.uint32), want_p.view(np.uint32))
        np.testing.assert_array_equal(got["tokens_per_expert"], ref.expert_counts)
        assert got["counts_device"] == "cpu" and got["none"] is None and got["tokens_per_expert"].shape == (L,)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_deepep_layer_forward_and_gradients_match_dense_torch(sim, case):
    _check_against_dense(case, sim("deepep"), "w_grad")


def test_deepep_calls_forward_dispatch_and_combine_backward_cached_dispatch_and_weighted_combine(sim):
    for run in sim("deepep"):
        for case in CASES:  # main runtime 2 + 2; the combined topk_weights on the float32 runtime 1 + 1
            assert run[case.name]["calls"] == {"dispatch_async": 3, "combine_async": 3}, case.name


@pytest.mark.parametrize("case", HYBRID_CASES, ids=[c.name for c in HYBRID_CASES])
def test_hybrid_ep_dispatch_outputs_are_the_reference_batch(sim, case):
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
        assert got["scaling"] is None and got["overflow"] == 0


@pytest.mark.parametrize("case", HYBRID_CASES, ids=[c.name for c in HYBRID_CASES])
def test_hybrid_ep_layer_forward_and_gradients_match_dense_torch(sim, case):
    _check_against_dense(case, sim("hybridep"), "dense_grad")


def test_hybrid_ep_backward_is_one_dispatch_and_one_combine_plus_the_probabilities(sim):
    for run in sim("hybridep"):
        for case in HYBRID_CASES:
            assert run[case.name]["calls"] == {"dispatch_async": 2, "combine_async": 2, "slot_values_async": 1}, \
                case.name


@pytest.mark.parametrize("kind", ["deepep", "hybridep"])
def test_both_layers_train_across_logical_nodes(sim, kind):
    """Each rank its own logical node (2 x 1: the hierarchical transport, every row crossing
    "nodes" through a proxy): the forward and both gradients as on one node."""
    cases, grad = (CASES, "w_grad") if kind == "deepep" else (HYBRID_CASES, "dense_grad")
    runs = sim(kind, 2)
    for case in cases:
        assert all(run[case.name]["transport"] for run in runs), case.name
        _check_against_dense(case, runs, grad)


def test_fused_a2a_names_an_import_before_the_alias(monkeypatch):
    from ep_runtime import megatron
    from ep_runtime.core.errors import EPStateError

    early = types.ModuleType(megatron.FUSED_A2A)
    early.HAVE_DEEP_EP = early.HAVE_HYBRIDEP = False
    monkeypatch.setitem(sys.modules, megatron.FUSED_A2A, early)
    try:
        with pytest.raises(EPStateError, match="before importing Megatron-core's MoE modules"):
            megatron.fused_a2a()
    finally:
        from ep_runtime.integrations.deep_ep import alias

        alias.deactivate()
