"""``ep_runtime.deep_ep.HybridEPBuffer`` on the simulator (a gloo job of 2 ranks), against
:func:`ep_runtime.core.reference.dispatch` / ``combine``:

- Megatron-core ``core_v0.19.0``'s calls (read in ``megatron/core/transformer/moe/fused_a2a.py``
  and ``token_dispatcher.py`` at that tag, commit 5be9626709af2722333bf54797c954c09edeada3): the
  buffer built with ``num_blocks_permute=``, ``num_blocks_unpermute=``,
  ``num_sms_preprocessing_api=``; ``fuse_permute_dispatch`` found in
  ``dispatch_with_permute``'s signature (0.19 checks it before passing ``fused=True``); the
  forward dispatch and combine, the backward's cached dispatch and combine with the
  probabilities' gradient, each with ``fuse_permute_dispatch`` / ``fuse_unpermute_combine``;
  ``handle[-1] != 0`` (0.19's over-budget check) on the handle;
- the fix of the routing's width: a blocking call whose tokens have more experts than any
  earlier call's is routed in full (HybridEP's routing map has no top-k; the layer's width
  follows each call), with the ``topk_idx`` form of the routing too;
- non-blocking calls (``num_permuted_tokens``): rows past it are not sent and ``overflow_flag``
  is set; a token with more experts than the width is reported there (``debug=False``) or
  refused (debug mode), never cut silently.
"""

from __future__ import annotations

import inspect

import numpy as np
import pytest

from ep_runtime.core import reference
from ep_runtime.core.config import EPConfig

torch = pytest.importorskip("torch")

R, T, H, E = 2, 8, 32, 8
L = E // R
JOB_TIMEOUT_S = 600


def routing(seed: int, rank: int, most: int):
    """``(x [T, H] bf16 bits, ids [T, most] int32 ascending with -1 after, weights float32)``:
    token ``t`` of ``rank`` picks ``1 + (t + seed) % most`` distinct experts."""
    rng = np.random.default_rng([seed, rank])
    x = rng.standard_normal((T, H)).astype(reference.BF16)
    ids = np.full((T, most), -1, np.int32)
    for t in range(T):
        k = 1 + (t + seed) % most
        ids[t, :k] = np.sort(rng.permutation(E)[:k])
    weights = np.where(ids >= 0, rng.uniform(0.1, 1.0, ids.shape), 0).astype(np.float32)
    return x.view(np.uint16), ids, weights


def _dense_map(ids, weights):
    rm = torch.zeros(T, E, dtype=torch.bool)
    probs = torch.zeros(T, E, dtype=torch.float32)
    for t, row in enumerate(ids):
        for k, e in enumerate(row):
            if e >= 0:
                rm[t, e], probs[t, e] = True, float(weights[t, k])
    return rm, probs


def _bf16(bits):
    return torch.from_numpy(np.ascontiguousarray(bits).view(np.int16)).view(torch.bfloat16)


def _bits(t):
    return t.detach().contiguous().view(torch.int16).numpy().view(np.uint16).copy()


def _experts(rows, tokens_per_expert, probs, rank: int):
    """Expert ``e`` (global) scales its rows by ``e + 1`` and their probability, in bf16."""
    y = torch.zeros(rows.shape, dtype=torch.bfloat16)
    off = np.concatenate([[0], np.cumsum(np.asarray(tokens_per_expert))])
    for e in range(L):
        lo, hi = int(off[e]), int(off[e + 1])
        y[lo:hi] = (rows[lo:hi].float() * (rank * L + e + 1) * probs[lo:hi, None]).bfloat16()
    return y


def _megatron_0_19(buf, rank: int) -> dict:
    """Megatron-core core_v0.19.0's HybridEPDispatch / HybridEPCombine calls, forward and backward."""
    x, ids, w = routing(1, rank, 2)
    rm, probs = _dense_map(ids, w)
    hidden, row_probs, scaling, tokens_per_expert, handle = buf.dispatch_with_permute(
        hidden=_bf16(x), routing_map=rm, probs=probs, scaling_factor=None, num_of_experts_per_rank=L,
        pad_multiple=None, num_permuted_tokens=None, non_blocking=False, fuse_permute_dispatch=True)
    over_budget = handle[-1] != 0
    y = _experts(hidden, tokens_per_expert.to(torch.int64), row_probs, rank)
    out, _ = buf.combine_with_unpermute(hidden=y, handle=handle, pad_multiple=None, fuse_unpermute_combine=True)
    grad_out = _bf16(x)  # the backward: a cached dispatch of dL/dout, then a combine with the probs' gradient
    grad_rows, _, _, _, _ = buf.dispatch_with_permute(hidden=grad_out, scaling_factor=None, handle=handle,
                                                      pad_multiple=None, num_permuted_tokens=None,
                                                      fuse_permute_dispatch=True)
    grad_probs_rows = torch.arange(len(hidden), dtype=torch.float32) + 1
    grad_x, grad_probs = buf.combine_with_unpermute(hidden=grad_rows, probs=grad_probs_rows, handle=handle,
                                                    pad_multiple=None, fuse_unpermute_combine=True)
    return dict(hidden=_bits(hidden), row_probs=row_probs.numpy().copy(), scaling=scaling,
                tokens_per_expert=tokens_per_expert.numpy().copy(), tpe_device=str(tokens_per_expert.device),
                over_budget=over_budget.tolist(), y=_bits(y), out=_bits(out), grad_rows=_bits(grad_rows),
                grad_x=_bits(grad_x), grad_probs=grad_probs.numpy().copy(), handle_len=len(handle))


def _widening(buf, rank: int) -> dict:
    """A blocking call of one expert a token, then one of up to three (map and top-k forms)."""
    got = {}
    for name, seed, most, form in (("narrow", 2, 1, "map"), ("wide", 3, 3, "map"), ("wide_topk", 4, 3, "topk")):
        x, ids, w = routing(seed, rank, most)
        if form == "map":
            rm, probs = _dense_map(ids, w)
            kw = dict(routing_map=rm, probs=probs)
        else:
            kw = dict(topk_idx=torch.from_numpy(ids).long(), topk_weights=torch.from_numpy(w), num_of_experts=E)
        hidden, row_probs, _, tpe, handle = buf.dispatch_with_permute(hidden=_bf16(x), num_of_experts_per_rank=L, **kw)
        out, _ = buf.combine_with_unpermute(hidden=hidden, handle=handle)
        got[name] = dict(hidden=_bits(hidden), row_probs=row_probs.numpy().copy(), tokens_per_expert=tpe.numpy().copy(),
                         out=_bits(out), width=handle.state.routing.ids.shape[1], overflow=int(handle[-1]))
    return got


def _non_blocking(buf, strict, rank: int) -> dict:
    """Non-blocking calls: rows past num_permuted_tokens, a routing wider than the width (flagged
    with debug off, refused in debug mode)."""
    got = {}
    x, ids, w = routing(5, rank, 3)
    rm, probs = _dense_map(ids, w)
    for name, rows in (("roomy", 64), ("short", 4)):
        hidden, row_probs, _, tpe, handle = buf.dispatch_with_permute(
            hidden=_bf16(x), routing_map=rm, probs=probs, num_of_experts_per_rank=L, num_permuted_tokens=rows,
            non_blocking=True)
        out, _ = buf.combine_with_unpermute(hidden=hidden, handle=handle)
        got[name] = dict(hidden=_bits(hidden), tokens_per_expert=tpe.numpy().copy(), tpe_device=str(tpe.device),
                         out=_bits(out), overflow=int(handle[-1]))
    x, ids, w = routing(6, rank, 4)
    ids[0, :4] = np.arange(4) * 2  # token 0 of every rank: 4 experts, one more than the width
    rm, probs = _dense_map(ids, w)
    handle = buf.dispatch_with_permute(hidden=_bf16(x), routing_map=rm, probs=probs, num_of_experts_per_rank=L,
                                       num_permuted_tokens=64, non_blocking=True)[-1]
    got["wider"] = dict(overflow=int(handle[-1]), width=handle.state.routing.ids.shape[1])
    try:
        strict.dispatch_with_permute(hidden=_bf16(x), routing_map=rm, probs=probs, num_of_experts_per_rank=L,
                                     num_permuted_tokens=64, non_blocking=True)
        got["wider_debug"] = None
    except Exception as e:  # noqa: BLE001 - the test checks the message
        got["wider_debug"] = f"{type(e).__name__}: {e}"
    return got


def torch_rank_main(rank: int, n: int, store: str, out_dir: str) -> None:
    import datetime
    import os
    import pickle

    import torch.distributed as dist

    import ep_runtime.deep_ep as deep_ep

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=n,
                            timeout=datetime.timedelta(seconds=JOB_TIMEOUT_S))
    try:
        group = dist.new_group(list(range(n)))
        kwargs = dict(num_sms_dispatch_api=20, num_sms_combine_api=20, num_blocks_permute=4, num_blocks_unpermute=4,
                      num_sms_preprocessing_api=108)
        buf = deep_ep.HybridEPBuffer(group=group, hidden_dim=H, max_num_of_tokens_per_rank=T, num_local_experts=L,
                                     use_fp8=False, **kwargs)
        got = {"fused_in_signature": "fuse_permute_dispatch" in inspect.signature(
            deep_ep.HybridEPBuffer.dispatch_with_permute).parameters}
        got["megatron_0_19"] = _megatron_0_19(buf, rank)
        got["widening"] = _widening(deep_ep.HybridEPBuffer(group, H, T, L), rank)
        quiet = deep_ep.HybridEPBuffer(group, H, T, L, debug=False)
        strict = deep_ep.HybridEPBuffer(group, H, T, L, debug=True)
        x, ids, w = routing(7, rank, 3)
        for b in (quiet, strict):  # a blocking first call sets the width: 3
            b.dispatch_with_permute(hidden=_bf16(x), routing_map=_dense_map(ids, w)[0], num_of_experts_per_rank=L)
        got["non_blocking"] = _non_blocking(quiet, strict, rank)
    finally:
        dist.destroy_process_group()
    with open(os.path.join(out_dir, f"{rank}.pkl"), "wb") as f:
        pickle.dump(got, f)


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    from test_sessions_sim import run_torch_job

    return run_torch_job("test_deep_ep_hybrid_sim", R, tmp_path_factory.mktemp("deep_ep_hybrid"), JOB_TIMEOUT_S)


def _reference(seed: int, most: int, pad: int = 1):
    """The reference batches and the inputs of a routing (every rank's)."""
    inputs = [routing(seed, r, most) for r in range(R)]
    xs = [i[0].view(reference.BF16) for i in inputs]
    ids, ws = [i[1] for i in inputs], [i[2] for i in inputs]
    cfg = EPConfig(n_ranks=R, n_experts=E, top_k=most, hidden=H, max_tokens_per_rank=T, pad_multiple=pad)
    return cfg, xs, ids, ws, reference.dispatch(xs, ids, ws, cfg)


def _combined(cfg, refs, ids, rows_per_rank) -> list:
    """Each token's sum of ``rows_per_rank`` (the ranks' expanded rows, bf16 bits), unweighted."""
    return [o.view(np.uint16) for o in reference.combine([r.view(reference.BF16) for r in rows_per_rank], refs, ids,
                                                         cfg, weights=None)]


def test_megatron_core_0_19_s_calls_forward_and_backward(job):
    cfg, xs, ids, ws, refs = _reference(1, 2)
    for r, ref in enumerate(refs):
        got = job[r]["megatron_0_19"]
        assert job[r]["fused_in_signature"] and got["handle_len"] == 11 and got["over_budget"] == [False]
        np.testing.assert_array_equal(got["hidden"], ref.x.view(np.uint16), err_msg=f"rank {r}")
        np.testing.assert_array_equal(got["row_probs"].view(np.uint32), ref.weight.view(np.uint32))
        np.testing.assert_array_equal(got["tokens_per_expert"], ref.expert_counts)
        assert got["tpe_device"] == "cpu" and got["scaling"] is None
        np.testing.assert_array_equal(got["grad_rows"], ref.x.view(np.uint16), err_msg="the cached dispatch")
    outs = _combined(cfg, refs, ids, [job[r]["megatron_0_19"]["y"] for r in range(R)])
    grads = _combined(cfg, refs, ids, [job[r]["megatron_0_19"]["grad_rows"] for r in range(R)])
    for r in range(R):
        got = job[r]["megatron_0_19"]
        np.testing.assert_array_equal(got["out"], outs[r], err_msg=f"rank {r}: combine")
        np.testing.assert_array_equal(got["grad_x"], grads[r], err_msg=f"rank {r}: the backward's combine")
        want = np.zeros((T, E), np.float32)  # each row's value (its index + 1 on the rank it went to) at its slot
        for dst in range(R):
            ref = refs[dst]
            for i in range(ref.n_rows):
                if ref.src_rank[i] == r:
                    want[ref.src_token[i], ids[r][ref.src_token[i], ref.src_k[i]]] = i + 1
        np.testing.assert_array_equal(got["grad_probs"], want, err_msg=f"rank {r}: probabilities home")


@pytest.mark.parametrize("name, seed, most", [("narrow", 2, 1), ("wide", 3, 3), ("wide_topk", 4, 3)])
def test_the_routing_width_follows_each_blocking_call(job, name, seed, most):
    cfg, xs, ids, ws, refs = _reference(seed, most)
    assert max(int((i >= 0).sum(1).max()) for i in ids) == most, "the routing has tokens of `most` experts"
    outs = _combined(cfg, refs, ids, [job[r]["widening"][name]["hidden"] for r in range(R)])
    for r, ref in enumerate(refs):
        got = job[r]["widening"][name]
        assert got["width"] == most and got["overflow"] == 0, f"rank {r}: {name}"
        np.testing.assert_array_equal(got["hidden"], ref.x.view(np.uint16), err_msg=f"rank {r}: {name}")
        np.testing.assert_array_equal(got["row_probs"].view(np.uint32), ref.weight.view(np.uint32))
        np.testing.assert_array_equal(got["tokens_per_expert"], ref.expert_counts)
        np.testing.assert_array_equal(got["out"], outs[r], err_msg=f"rank {r}: {name} combine")


def test_non_blocking_rows_past_num_permuted_tokens_are_flagged(job):
    cfg, xs, ids, ws, refs = _reference(5, 3)
    roomy = [job[r]["non_blocking"]["roomy"] for r in range(R)]
    outs = _combined(cfg, refs, ids, [g["hidden"] for g in roomy])
    for r, ref in enumerate(refs):
        n = ref.n_rows
        assert roomy[r]["overflow"] == 0 and roomy[r]["tpe_device"] == "cpu"
        np.testing.assert_array_equal(roomy[r]["hidden"][:n], ref.x.view(np.uint16), err_msg=f"rank {r}")
        assert roomy[r]["hidden"].shape[0] == 64 and not roomy[r]["hidden"][n:].any()
        np.testing.assert_array_equal(roomy[r]["tokens_per_expert"], ref.expert_counts)
        np.testing.assert_array_equal(roomy[r]["out"], outs[r], err_msg=f"rank {r}: combine")
        short = job[r]["non_blocking"]["short"]
        assert short["overflow"] == int(n > 4) and short["hidden"].shape[0] == 4, f"rank {r}"
        np.testing.assert_array_equal(short["hidden"], ref.x.view(np.uint16)[:4], err_msg=f"rank {r}: short")


def test_a_non_blocking_routing_wider_than_the_width_is_never_cut_silently(job):
    for r in range(R):
        got = job[r]["non_blocking"]
        assert got["wider"] == {"overflow": 1, "width": 3}, f"rank {r}: {got['wider']}"
        assert got["wider_debug"].startswith("EPInputError") and "4 experts" in got["wider_debug"] \
            and "blocking call" in got["wider_debug"], got["wider_debug"]
