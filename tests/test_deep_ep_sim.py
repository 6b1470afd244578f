"""``ep_runtime.deep_ep.Buffer`` (DeepEP v1.2.1's normal mode) on the simulator, against the NumPy
oracle of tests/deep_ep_oracle.py: DeepEP's own checks of ``tests/test_intranode.py`` (DeepEP tag
v1.2.1, commit 9af0e0d0e74f3577af1979c9b9e1ac2cad0104ee), read there and written here afresh.

One torch.distributed gloo job per group size (2 ranks; 3 ranks, one of them with no tokens),
forked by :func:`test_sessions_sim.torch_job_main`; each rank builds ``Buffer(group, ...)`` over a
``new_group`` as that test does, and runs, for bf16 tokens, FP8 tokens with float32 scales
(column-major, as the test passes them) and FP8 with UE8M0 exponents packed in int32, with and
without top-k, synchronous and with ``async_finish`` and ``previous_event``:

- ``get_dispatch_layout``: the counts and ``is_token_in_rank`` of the routing;
- ``dispatch``: rows that encode their origin, in DeepEP's order (``rank_prefix_matrix[s][rank]``
  ends source ``s``'s block), ``recv_topk_idx`` (local expert or -1), ``recv_topk_weights``, the
  per-expert counts (``expert_alignment`` too), ``recv_src_idx``;
- ``num_worst_tokens``: ``N`` rows, the received ones first and equal, the rest -1, an empty list;
- the cached dispatch (the handle of a dispatch without top-k) of the same and of other rows;
- ``combine`` of the received rows: each token summed over the ranks it went to (``x`` times
  their count, as the test checks), with ``topk_weights`` (the test's -1 slots filled with the
  row's largest), with a pair of biases; after another dispatch, through the handle of an
  earlier one;
- host reads: a dispatch with counts reads once, with ``num_worst_tokens`` never, nor a cached
  dispatch or a combine;
- what the layer refuses, with named errors.
"""

from __future__ import annotations


import numpy as np
import pytest

from deep_ep_oracle import BF16, Setup, expected_combine, expected_dispatch, expected_weights, rank_inputs

torch = pytest.importorskip("torch")

SETUPS = {2: Setup(R=2, tokens=(10, 7)), 3: Setup(R=3, tokens=(6, 0, 5), E=9)}
#: (token format, with top-k, async_finish, previous_event) of each dispatch-and-combine round.
ROUNDS = [("bf16", topk, mode, mode) for topk in (False, True) for mode in (False, True)] + \
         [(fmt, topk, False, False) for fmt in ("fp8", "fp8_ue8m0") for topk in (False, True)]
JOB_TIMEOUT_S = 600


def _bf16(bits: np.ndarray):
    return torch.from_numpy(np.ascontiguousarray(bits).view(np.int16)).view(torch.bfloat16)


def _bits(t) -> np.ndarray:
    return t.detach().contiguous().view(torch.int16).numpy().view(np.uint16).copy()


def _tokens(ins, fmt: str):
    """dispatch's ``x`` of a round's format (FP8 scales column-major, as DeepEP's test passes them)."""
    if fmt == "bf16":
        return _bf16(ins.x)
    codes = torch.from_numpy(ins.codes.copy()).view(torch.float8_e4m3fn)
    scales = torch.from_numpy(ins.scales.copy() if fmt == "fp8" else ins.packed.copy())
    return codes, scales.T.contiguous().T


def _record(recv, fmt: str) -> dict:
    if fmt == "bf16":
        return {"x": _bits(recv)}
    codes, scales = recv
    return {"codes": codes.view(torch.uint8).numpy().copy(), "scales": scales.numpy().copy(),
            "scales_dtype": str(scales.dtype)}


def _combine_rows(recv, fmt: str):
    """The rows a round combines: the received bf16 rows, or the FP8 codes as bf16 numbers."""
    return recv if fmt == "bf16" else recv[0].float().bfloat16()


def _round(buffer, ins, setup: Setup, fmt: str, with_topk: bool, async_mode: bool, previous: bool) -> dict:
    """One round of test_intranode.py's loop on this rank (see the module docstring)."""
    topk, weights = torch.from_numpy(ins.topk), torch.from_numpy(ins.weights)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk, setup.E)
    args = dict(x=_tokens(ins, fmt), num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                num_tokens_per_expert=per_expert, async_finish=async_mode)
    if with_topk:
        args.update(topk_idx=topk, topk_weights=weights)
    if previous:
        args.update(previous_event=buffer.capture())
    recv, idx, w, counts, handle, event = buffer.dispatch(**args)
    if async_mode:
        event.current_stream_wait()
    out = dict(recv=_record(recv, fmt), counts=counts, prefix=handle[0].numpy().copy(),
               src_idx=handle[3].numpy().copy(), handle_len=len(handle), event=event.event is not None,
               idx=None if idx is None else idx.numpy().copy(), w=None if w is None else w.numpy().copy())
    if with_topk:
        worst = max(setup.tokens) * setup.R
        wrecv, widx, ww, wlist, _, _ = buffer.dispatch(**args, num_worst_tokens=worst)
        out["worst"] = dict(recv=_record(wrecv, fmt), idx=widx.numpy().copy(), w=ww.numpy().copy(), list=wlist)
    else:
        cached = dict(handle=handle, async_finish=async_mode)
        again, *nones, _ = buffer.dispatch(x=_tokens(ins, fmt), **cached)
        other, *_ = buffer.dispatch(x=_bf16(ins.x2) if fmt == "bf16" else _tokens(ins, fmt), **cached)
        out["cached"] = dict(recv=_record(again, fmt), other=_record(other, fmt), nones=nones)
    rows = _combine_rows(recv, fmt)
    combine = dict(x=rows, handle=handle, async_finish=async_mode)
    if with_topk:  # the test's x case: -1 slots filled with the row's largest weight
        filled = torch.where(idx < 0, w.amax(dim=1, keepdim=True), w)
        combine["topk_weights"] = filled
        out["weights_in"] = filled.numpy().copy()
    if previous:
        combine["previous_event"] = buffer.capture()
    combined, cweights, event = buffer.combine(**combine)
    if async_mode:
        event.current_stream_wait()
    out["combine_in"], out["combined"] = _bits(rows), _bits(combined)
    out["cweights"] = None if cweights is None else cweights.numpy().copy()
    if fmt == "bf16" and not with_topk and not async_mode:
        bias = (_bf16(ins.bias[0]), _bf16(ins.bias[1]))
        out["biased"] = _bits(buffer.combine(rows, handle, bias=bias)[0])
    return out


def _host_reads(buffer, ins, setup: Setup) -> dict:
    """Host reads of each call once the runtime is built (``debug=False``: no checks that read):
    the layer's one read place, and any other ``item`` / ``tolist`` / ``bool`` / ``int`` /
    ``float`` of a tensor."""
    from ep_runtime.integrations.deep_ep import runtimes

    counts = {"layer": 0, "other": 0}
    inside = []
    original = runtimes.RuntimeCache.host_values

    def counted_host_values(t):
        counts["layer"] += 1
        inside.append(1)
        try:
            return original(t)
        finally:
            inside.pop()

    def counting(name):
        method = getattr(torch.Tensor, name)

        def wrapper(self, *a, **kw):
            if not inside:
                counts["other"] += 1
            return method(self, *a, **kw)

        return method, wrapper

    patched = {name: counting(name) for name in ("item", "tolist", "__bool__", "__int__", "__float__")}
    topk, weights = torch.from_numpy(ins.topk), torch.from_numpy(ins.weights)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk, setup.E)
    layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
    x = _bf16(ins.x)
    calls = {
        "dispatch": lambda: buffer.dispatch(x, topk_idx=topk, topk_weights=weights, **layout),
        "dispatch_worst": lambda: buffer.dispatch(x, topk_idx=topk, topk_weights=weights, **layout,
                                                  num_worst_tokens=max(setup.tokens) * setup.R),
    }
    reads = {}
    calls["dispatch"]()  # the first call of a shape builds the runtime (collective: a host gather of the batch sizes)
    runtimes.RuntimeCache.host_values = staticmethod(counted_host_values)
    for name, (_, wrapper) in patched.items():
        setattr(torch.Tensor, name, wrapper)
    try:
        for name, call in calls.items():
            counts.update(layer=0, other=0)
            result = call()
            reads[name] = dict(counts)
        recv, idx, w, _, handle, _ = result
        for name, call in {"cached_dispatch": lambda: buffer.dispatch(x, handle=handle),
                           "combine": lambda: buffer.combine(recv, handle),
                           "combine_weights": lambda: buffer.combine(recv, handle, topk_weights=w)}.items():
            counts.update(layer=0, other=0)
            call()
            reads[name] = dict(counts)
    finally:
        runtimes.RuntimeCache.host_values = staticmethod(original)
        for name, (method, _) in patched.items():
            setattr(torch.Tensor, name, method)
    return reads


def _refusals(buffer, other, ins, setup: Setup, group) -> dict:
    """The messages of calls the layer refuses (each raised before anything is sent)."""
    import ep_runtime.deep_ep as deep_ep

    x, topk = _bf16(ins.x), torch.from_numpy(ins.topk)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk, setup.E)
    recv, *_, handle, _ = other.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                         num_tokens_per_expert=per_expert)
    other.combine(recv, handle)
    cases = {
        "num_rdma_bytes": lambda: deep_ep.Buffer(group, 0, 1 << 20),
        "low_latency_dispatch": lambda: buffer.low_latency_dispatch(x, topk, 8, setup.E),
        "internode_dispatch": lambda: buffer.internode_dispatch(x),
        "local_buffer": lambda: buffer.get_local_buffer_tensor(torch.bfloat16),
        "rdma_layout": lambda: buffer.dispatch(x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rank,
                                               is_token_in_rank=in_rank, num_tokens_per_expert=per_expert),
        "fp8_scales": lambda: buffer.dispatch((x.to(torch.float8_e4m3fn), torch.ones(len(x), 3)),
                                              num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                              num_tokens_per_expert=per_expert),
        "foreign_handle": lambda: buffer.combine(recv, handle),
        "combine_rows": lambda: other.combine(recv[:-1] if len(recv) else torch.zeros(1, setup.H).bfloat16(), handle),
        "cached_topk": lambda: other.dispatch(x, handle=handle, topk_idx=topk, topk_weights=torch.ones(topk.shape)),
        "worst_without_topk": lambda: buffer.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                      num_tokens_per_expert=per_expert, num_worst_tokens=64),
        "config": lambda: deep_ep.Config(20, 8, 4),
        "set_num_sms": lambda: deep_ep.Buffer.set_num_sms(3),
        "destroy_not_explicit": lambda: other.destroy(),
        "event_without_event": lambda: deep_ep.EventOverlap().current_stream_wait(),
        "comm_on_comm": lambda: buffer.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                num_tokens_per_expert=per_expert, allocate_on_comm_stream=True),
    }
    messages = {}
    for name, call in cases.items():
        try:
            call()
            messages[name] = None
        except Exception as e:  # noqa: BLE001 - the test checks the class and the message
            messages[name] = (type(e).__name__, isinstance(e, NotImplementedError), str(e))
    return messages


def torch_rank_main(rank: int, n: int, store: str, out_dir: str) -> None:
    """One rank of the gloo job: every round, the host reads and the refusals, pickled."""
    import datetime
    import os
    import pickle

    import torch.distributed as dist

    import ep_runtime.deep_ep as deep_ep

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=n,
                            timeout=datetime.timedelta(seconds=JOB_TIMEOUT_S))
    try:
        setup = SETUPS[n]
        ins = rank_inputs(setup, rank)
        group = dist.new_group(list(range(n)))
        buffer = deep_ep.Buffer(group, int(2e6), 0, low_latency_mode=False, num_qps_per_rank=1,
                                explicitly_destroy=True)
        topk = torch.from_numpy(ins.topk)
        per_rank, rdma, per_expert, in_rank, event = buffer.get_dispatch_layout(topk, setup.E)
        got = {"layout": (per_rank.numpy().copy(), rdma, per_expert.numpy().copy(), in_rank.numpy().copy(),
                          event.event)}
        for r in ROUNDS:
            got[r] = _round(buffer, ins, setup, *r)
        aligned = buffer.dispatch(_bf16(ins.x), num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                  num_tokens_per_expert=per_expert, topk_idx=topk,
                                  topk_weights=torch.from_numpy(ins.weights), expert_alignment=4)
        got["aligned_counts"] = aligned[3]
        quiet = deep_ep.Buffer(group, 0, debug=False)
        got["reads"] = _host_reads(quiet, ins, setup)
        got["refused"] = _refusals(buffer, quiet, ins, setup, group)
        buffer.destroy()
        got["after_destroy"] = _refused_after_destroy(buffer, topk, setup)
    finally:
        dist.destroy_process_group()
    with open(os.path.join(out_dir, f"{rank}.pkl"), "wb") as f:
        pickle.dump(got, f)


def _refused_after_destroy(buffer, topk, setup) -> str | None:
    try:
        buffer.get_dispatch_layout(topk, setup.E)
    except Exception as e:  # noqa: BLE001 - the test checks the message
        return str(e)
    return None


@pytest.fixture(scope="module", params=sorted(SETUPS), ids=lambda n: f"{n}_ranks")
def job(request, tmp_path_factory):
    from test_sessions_sim import run_torch_job

    n = request.param
    results = run_torch_job("test_deep_ep_sim", n, tmp_path_factory.mktemp(f"deep_ep_{n}"), JOB_TIMEOUT_S)
    setup = SETUPS[n]
    return setup, [rank_inputs(setup, r) for r in range(n)], results


def _check_rows(got: dict, want: dict, fmt: str, what: str, field: str = "x") -> None:
    if fmt == "bf16":
        np.testing.assert_array_equal(got["x"], want[field], err_msg=f"{what}: recv_x")
        return
    np.testing.assert_array_equal(got["codes"], want["codes"], err_msg=f"{what}: recv_x codes")
    scales = want["scales"] if fmt == "fp8" else want["packed"]
    np.testing.assert_array_equal(got["scales"].view(np.uint32), scales.view(np.uint32), err_msg=f"{what}: scales")
    assert got["scales_dtype"] == ("torch.float32" if fmt == "fp8" else "torch.int32"), what


def test_dispatch_layout_is_the_routing_s(job):
    setup, ins, results = job
    for r, got in enumerate(results):
        per_rank, rdma, per_expert, in_rank, event = got["layout"]
        want_in = np.array([[q in {int(e) // setup.L for e in row if e >= 0} for q in range(setup.R)]
                            for row in ins[r].topk], bool).reshape(-1, setup.R)
        np.testing.assert_array_equal(in_rank, want_in, err_msg=f"rank {r}: is_token_in_rank")
        np.testing.assert_array_equal(per_rank, want_in.sum(0), err_msg=f"rank {r}: num_tokens_per_rank")
        np.testing.assert_array_equal(per_expert, np.bincount(ins[r].topk[ins[r].topk >= 0], minlength=setup.E))
        assert rdma is None and event is None and per_rank.dtype == per_expert.dtype == np.int32


@pytest.mark.parametrize("rnd", ROUNDS, ids=lambda r: "-".join(map(str, r)))
def test_dispatch_rows_order_routing_and_counts(job, rnd):
    setup, ins, results = job
    fmt, with_topk, async_mode, _ = rnd
    for r, res in enumerate(results):
        got, want, what = res[rnd], expected_dispatch(setup, ins, r), f"rank {r}, round {rnd}"
        assert len(want["rows"]) > 0 or r == 1, "every rank with tokens receives some"
        _check_rows(got["recv"], want, fmt, what)
        assert got["counts"] == want["counts"].tolist(), what
        np.testing.assert_array_equal(got["prefix"][:, r], want["prefix"], err_msg=f"{what}: rank_prefix_matrix")
        np.testing.assert_array_equal(got["src_idx"], want["src_idx"], err_msg=f"{what}: recv_src_idx")
        assert got["handle_len"] == 6 and got["event"] == async_mode, what
        if with_topk:
            np.testing.assert_array_equal(got["idx"], want["topk_idx"], err_msg=f"{what}: recv_topk_idx")
            np.testing.assert_array_equal(got["w"].view(np.uint32), want["topk_weights"].view(np.uint32), what)
            assert ((got["idx"] == -1) | ((got["idx"] >= 0) & (got["idx"] < setup.L))).all()
            for e, count in enumerate(got["counts"]):
                assert (got["idx"] == e).sum() == count, what
        else:
            assert got["idx"] is None and got["w"] is None, what


@pytest.mark.parametrize("rnd", [r for r in ROUNDS if r[1]], ids=lambda r: "-".join(map(str, r)))
def test_num_worst_tokens_pads_with_minus_one(job, rnd):
    setup, ins, results = job
    fmt = rnd[0]
    worst = max(setup.tokens) * setup.R
    for r, res in enumerate(results):
        got, want, what = res[rnd]["worst"], expected_dispatch(setup, ins, r), f"rank {r}, round {rnd}"
        n = len(want["rows"])
        assert got["list"] == [] and got["idx"].shape == (worst, setup.K) and got["w"].shape == (worst, setup.K)
        rows = {k: v[:n] for k, v in got["recv"].items() if k != "scales_dtype"}
        rows["scales_dtype"] = got["recv"].get("scales_dtype")
        _check_rows(rows, want, fmt, f"{what}: worst")
        first = got["recv"]["x" if fmt == "bf16" else "codes"]
        assert first.shape[0] == worst and not first[n:].any(), what
        np.testing.assert_array_equal(got["idx"][:n], want["topk_idx"], err_msg=what)
        np.testing.assert_array_equal(got["w"][:n], want["topk_weights"], err_msg=what)
        assert (got["idx"][n:] == -1).all() and not got["w"][n:].any(), what


@pytest.mark.parametrize("rnd", [r for r in ROUNDS if not r[1]], ids=lambda r: "-".join(map(str, r)))
def test_cached_dispatch_reuses_the_handle_s_routing(job, rnd):
    setup, ins, results = job
    fmt = rnd[0]
    for r, res in enumerate(results):
        got, want, what = res[rnd]["cached"], expected_dispatch(setup, ins, r), f"rank {r}, round {rnd}"
        _check_rows(got["recv"], want, fmt, f"{what}: cached")
        _check_rows(got["other"], want, fmt, f"{what}: cached other rows", field="x2")
        assert got["nones"] == [None, None, None, None], what


@pytest.mark.parametrize("rnd", ROUNDS, ids=lambda r: "-".join(map(str, r)))
def test_combine_sums_each_token_over_the_ranks_it_went_to(job, rnd):
    setup, ins, results = job
    want = expected_combine(setup, ins, [res[rnd]["combine_in"] for res in results])
    for r, res in enumerate(results):
        got, what = res[rnd], f"rank {r}, round {rnd}"
        np.testing.assert_array_equal(got["combined"], want[r], err_msg=f"{what}: combined_x")
        if rnd[0] == "bf16":  # DeepEP's check: the combined rows are x times the ranks each token went to
            ranks = np.array([len({int(e) // setup.L for e in row if e >= 0}) for row in ins[r].topk])
            live = ranks > 0
            np.testing.assert_array_equal(got["combined"].view(BF16).astype(np.float32)[live],
                                          (ins[r].x.view(BF16).astype(np.float32) * ranks[:, None])[live]
                                          .astype(BF16).astype(np.float32), err_msg=what)
            assert not got["combined"][~live].any(), f"{what}: a token sent nowhere combines to zero"


@pytest.mark.parametrize("rnd", [r for r in ROUNDS if r[1]], ids=lambda r: "-".join(map(str, r)))
def test_combined_topk_weights_sum_over_the_ranks(job, rnd):
    setup, ins, results = job
    want = expected_weights(setup, ins, [res[rnd]["weights_in"] for res in results])
    for r, res in enumerate(results):
        np.testing.assert_allclose(res[rnd]["cweights"], want[r], rtol=1e-6, err_msg=f"rank {r}, round {rnd}")


def test_combine_adds_the_biases_before_its_one_rounding(job):
    setup, ins, results = job
    rnd = ("bf16", False, False, False)
    bias = [(i.bias[0].view(BF16).astype(np.float32) + i.bias[1].view(BF16).astype(np.float32)) for i in ins]
    want = expected_combine(setup, ins, [res[rnd]["combine_in"] for res in results], bias=bias)
    for r, res in enumerate(results):
        np.testing.assert_array_equal(res[rnd]["biased"], want[r], err_msg=f"rank {r}")


def test_expert_alignment_rounds_the_counts_up(job):
    setup, ins, results = job
    for r, res in enumerate(results):
        assert res["aligned_counts"] == expected_dispatch(setup, ins, r, alignment=4)["counts"].tolist()
        assert all(c % 4 == 0 for c in res["aligned_counts"])


def test_a_dispatch_with_counts_reads_the_host_once_and_nothing_else_reads_it(job):
    _, _, results = job
    for r, res in enumerate(results):
        assert res["reads"] == {"dispatch": {"layer": 1, "other": 0}, "dispatch_worst": {"layer": 0, "other": 0},
                                "cached_dispatch": {"layer": 0, "other": 0}, "combine": {"layer": 0, "other": 0},
                                "combine_weights": {"layer": 0, "other": 0}}, f"rank {r}: {res['reads']}"


#: The refused calls: (error class, a NotImplementedError?, words the message must hold).
REFUSED = {
    "num_rdma_bytes": ("DeepEPUnsupportedError", True, ("internode", "num_rdma_bytes=0")),
    "low_latency_dispatch": ("EPStateError", False, ("low_latency_dispatch", "low_latency_mode=True")),
    "internode_dispatch": ("DeepEPUnsupportedError", True, ("internode",)),
    "local_buffer": ("DeepEPUnsupportedError", True, ("raw access",)),
    "rdma_layout": ("DeepEPUnsupportedError", True, ("num_tokens_per_rdma_rank", "pass None")),
    "fp8_scales": ("DeepEPUnsupportedError", True, ("scales", "hidden / 128")),
    "foreign_handle": ("EPInputError", False, ("another Buffer",)),
    "combine_rows": ("EPInputError", False, ("x must have shape",)),
    "cached_topk": ("EPInputError", False, ("cached dispatch",)),
    "worst_without_topk": ("EPInputError", False, ("num_worst_tokens", "topk_idx")),
    "config": ("EPInputError", False, ("num_max_nvl_chunked_send_tokens",)),
    "set_num_sms": ("EPInputError", False, ("even",)),
    "destroy_not_explicit": ("EPStateError", False, ("explicitly_destroy",)),
    "event_without_event": ("EPStateError", False, ("async_finish=False",)),
    "comm_on_comm": ("EPInputError", False, ("allocate_on_comm_stream",)),
}


def test_what_the_layer_does_not_do_raises_a_named_error(job):
    _, _, results = job
    for r, res in enumerate(results):
        for name, (cls, not_implemented, words) in REFUSED.items():
            got = res["refused"][name]
            assert got is not None, f"rank {r}: {name} was not refused"
            assert got[0] == cls and got[1] == not_implemented, f"rank {r}: {name}: {got}"
            assert all(w in got[2] for w in words), f"rank {r}: {name}: {got[2]}"
        assert "destroyed" in res["after_destroy"]
