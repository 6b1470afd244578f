"""``ep_runtime.deep_ep.Buffer``'s low-latency mode on the simulator: DeepEP's own checks of
``tests/test_low_latency.py`` (DeepEP tag v1.2.1), read there and written here afresh, and the
engines' low-latency call sequences.

One torch.distributed gloo job per group size (2 ranks; 3 ranks, one of them with no tokens),
forked by :func:`test_sessions_sim.torch_job_main`; each rank builds ``Buffer(group,
num_rdma_bytes=get_low_latency_rdma_size_hint(...), low_latency_mode=True, ...)`` as that test
does, and for bf16, FP8, FP8 with power-of-two scales and FP8 with packed UE8M0 scales, with the
receive hook and with ``async_finish``, once or twice in a row:

- ``low_latency_dispatch``: per local expert, ``recv_count`` equals the routed slots of every
  rank, ``cumulative_local_expert_recv_stats`` and the counts of ``recv_layout_range``; the rows
  of ``x = rank - 128`` (the last 128 columns the token index) are constant per row, each
  source's range holds its rows, and the last columns equal ``recv_src_info`` (FP8 with
  power-of-two scales: within DeepEP's ``calc_diff`` bound); scales column-major per expert;
- no call or hook reads a tensor on the host (``item``, ``tolist``, ...): graph-safe;
- ``low_latency_combine`` of the rows cast back (``per_token_cast_back``), plain and
  ``zero_copy`` through ``get_next_low_latency_combine_buffer``: ``calc_diff(x * sum(weights),
  out)`` under DeepEP's bounds (1e-5 bf16, 9e-4 FP8), no NaN, ``out=`` returned;

and replays (read to learn the calls; no code taken):

- vLLM ``vllm/model_executor/layers/fused_moe/prepare_finalize/deepep_ll.py`` at commit
  bf1a7d179021b038646caea0483d53ab58fe32ff (``DeepEPLLPrepareAndFinalize``): ``topk_ids`` int64,
  ``low_latency_dispatch(a1, ids, max_tokens_per_rank, num_experts, use_fp8=..., round_scale=
  use_ue8m0, use_ue8m0=..., async_finish=False, return_recv_hook=True)``, the handle kept per
  micro-batch (``handles[ubatch]``); finalize ``low_latency_combine(out_of_experts, ids, weights,
  handle, async_finish=False, zero_copy=False, return_recv_hook=dbo or async, out=output)``. Under
  dual-batch overlap both micro-batches dispatch, then receive by their hooks, then combine,
  then receive the combines' hooks.
- SGLang ``python/sglang/srt/layers/moe/token_dispatcher/deepep.py`` at commit
  003a81bf2870c07b110de13641ad4f0ba63b1fa1 (``_DeepEPDispatcherImplLowLatency``): ``dispatch_a``
  casts ids to int64 and dispatches with ``async_finish=not return_recv_hook``,
  ``return_recv_hook``; ``dispatch_b`` runs the hook or waits on the event; ``combine_a``
  combines with the same flags, ``combine_b`` runs the hook or waits.

The experts of the replays: local expert e maps a row to ``row * (e + 1) / 4`` (bf16), so each
token's output is ``sum_k w_k x (e_k + 1) / 4``, checked against NumPy in float64, and the bf16
micro-batches bit for bit against ``reference_batched.combine_batched_home`` (the weights applied
at home, in slot order).
"""

from __future__ import annotations

import datetime
import os
import pickle

import numpy as np
import pytest

torch = pytest.importorskip("torch")

#: Per group size: tokens per rank (and, at 4, two logical nodes of 2: DeepEP's low-latency mode
#: across nodes, where the runtimes' plan puts to every peer), and the sizes every rank passes.
SETUPS = {2: dict(tokens=(6, 4)), 3: dict(tokens=(5, 0, 6)), 4: dict(tokens=(3, 5, 0, 4), nodes=2)}
NUM_MAX, HIDDEN, TOP_K = 6, 512, 3
RANK_OFFSET = 128
JOB_TIMEOUT_S = 900
#: (use_fp8, round_scale, use_ue8m0) of DeepEP's test's dispatch formats.
FORMATS = ((False, False, False), (True, False, False), (True, True, False), (True, True, True))


def n_experts(n: int) -> int:
    return 4 * n


def calc_diff(x, y) -> float:
    """DeepEP's similarity measure: 1 - 2 <x+1, y+1> / (|x+1|^2 + |y+1|^2), in float64."""
    x, y = x.double() + 1, y.double() + 1
    return float(1 - 2 * (x * y).sum() / (x * x + y * y).sum())


def cast_back(codes, scales):
    """FP8 rows ``[N, H]`` times their per-128 scales ``[N, H / 128]`` float32 (or ``[N, H / 512]``
    int32 of four UE8M0 codes), as bf16."""
    if scales.dtype == torch.int32:  # code b of a row in byte b % 4 of int32 b / 4, lowest first
        ue8m0 = torch.stack([(scales >> (8 * i)) & 0xFF for i in range(4)], dim=-1).reshape(scales.shape[0], -1)
        scales = (ue8m0.to(torch.int32) << 23).view(torch.float32)
    x = codes.to(torch.float32).view(codes.shape[0], -1, 128) * scales.reshape(codes.shape[0], -1, 1)
    return x.view(codes.shape).to(torch.bfloat16)


def rank_routing(rank: int, n: int, T: int, seed: int):
    """``(topk_idx [T, K] int64, topk_weights [T, K] float32)``: distinct experts per token, some
    slots masked (-1), from a seed every rank shares."""
    g = torch.Generator().manual_seed(seed * 100 + rank)
    scores = torch.rand(T, n_experts(n), generator=g) + 1
    idx = torch.topk(scores, TOP_K, dim=-1).indices
    for _ in range(2):
        if T:
            idx[int(torch.randint(T, (1,), generator=g)), int(torch.randint(TOP_K, (1,), generator=g))] = -1
    return idx, torch.rand(T, TOP_K, generator=g) + 0.1


def deepep_checks(buffer, rank: int, n: int, T: int) -> list:
    """DeepEP's test_main checks, every format, hooks and async_finish, each asserted here; the
    record of what each round saw. Every rank's routing is made here from the shared seeds (the
    test gathers it)."""
    E, L = n_experts(n), n_experts(n) // n
    x = torch.ones(T, HIDDEN, dtype=torch.bfloat16) * (rank - RANK_OFFSET)
    x[:, -128:] = torch.arange(T, dtype=torch.float32).to(torch.bfloat16).view(-1, 1)
    topk_idx, topk_weights = rank_routing(rank, n, T, 1)
    all_idx = [rank_routing(r, n, SETUPS[n]["tokens"][r], 1)[0] for r in range(n)]
    record, rounds = [], 0
    for hook_mode in (False, True):
        for use_fp8, round_scale, use_ue8m0 in FORMATS:
            rounds += 1
            for _ in range(rounds % 2 + 1):
                stats = torch.zeros(L, dtype=torch.int32)
                recv, count, handle, event, hook = buffer.low_latency_dispatch(
                    x, topk_idx, NUM_MAX, E, use_fp8=use_fp8, round_scale=round_scale, use_ue8m0=use_ue8m0,
                    cumulative_local_expert_recv_stats=stats, async_finish=not hook_mode,
                    return_recv_hook=hook_mode)
                hook() if hook_mode else event.current_stream_wait()
            what = f"rank {rank}: fp8={use_fp8} round={round_scale} ue8m0={use_ue8m0} hook={hook_mode}"
            rows = cast_back(recv[0].view(-1, HIDDEN), recv[1].reshape(-1, recv[1].shape[-1])).view(recv[0].shape) \
                if use_fp8 else recv.clone()
            if use_fp8:
                s = recv[1]
                assert s.stride(1) == 1 and s.stride(2) == s.shape[1], f"{what}: scales not column-major"
            src_info, layout_range = handle[0], handle[1]
            for i in range(L):
                expert = rank * L + i
                got = int(count[i])
                assert int(stats[i]) == got, f"{what}: stats {int(stats[i])} != {got}"
                assert got == int((layout_range[i] & 0xFFFFFFFF).sum()), f"{what}: layout_range counts"
                assert got == sum(int((a == expert).sum()) for a in all_idx), f"{what}: expert {i} count {got}"
                r = rows[i, :got]
                body_min, body_max = r[:, :-128].amin(-1), r[:, :-128].amax(-1)
                assert torch.equal(body_min, body_max), f"{what}: expert {i}: rows not constant"
                if round_scale:
                    assert got == 0 or calc_diff(r[:, -1], src_info[i, :got]) < 0.007, f"{what}: src_info"
                else:
                    assert (r[:, -128:].float() - src_info[i, :got].view(-1, 1)).abs().sum() == 0, \
                        f"{what}: expert {i}: token columns differ from recv_src_info"
                for j in range(n):
                    begin, c = int(layout_range[i, j]) >> 32, int(layout_range[i, j]) & 0xFFFFFFFF
                    assert c == int((all_idx[j] == expert).sum()), f"{what}: expert {i} source {j} count"
                    if not round_scale:
                        assert (r[begin:begin + c, :-128].float() - (j - RANK_OFFSET)).abs().sum() == 0, \
                            f"{what}: expert {i}: rows of source {j} not at [{begin}, {begin + c})"
            diffs = []
            for zero_copy in (False, True):
                if zero_copy:
                    buffer.get_next_low_latency_combine_buffer(handle)[:, :, :] = rows
                out = torch.empty(T, HIDDEN, dtype=torch.bfloat16)
                combined, event, hook = buffer.low_latency_combine(rows, topk_idx, topk_weights, handle,
                                                                   async_finish=not hook_mode, zero_copy=zero_copy,
                                                                   return_recv_hook=hook_mode, out=out)
                hook() if hook_mode else event.current_stream_wait()
                assert combined is out, f"{what}: out= not returned"
                want = x.float() * topk_weights.masked_fill(topk_idx == -1, 0).sum(1, keepdim=True)
                diff = calc_diff(want, combined) if T else 0.0
                assert not torch.isnan(combined.float()).any(), f"{what}: NaN"
                assert diff < (9e-4 if use_fp8 else 1e-5), f"{what}: zero_copy={zero_copy}: calc_diff {diff}"
                diffs.append(diff)
            record.append((use_fp8, round_scale, use_ue8m0, hook_mode, [int(c) for c in count], diffs))
    return record


def experts_out(rows: torch.Tensor) -> torch.Tensor:
    """The replays' experts: local expert e maps a row to ``row * (e + 1) / 4`` (bf16, exact)."""
    scale = (torch.arange(rows.shape[0], dtype=torch.float32) + 1).view(-1, 1, 1) / 4
    return (rows.float() * scale).to(torch.bfloat16)


def want_replay(x: torch.Tensor, topk_idx, topk_weights, rank: int, n: int) -> np.ndarray:
    """Each token's ``sum_k w_k x (e_k % L + 1) / 4`` in float64 (the replays' experts)."""
    L = n_experts(n) // n
    f = np.where(topk_idx.numpy() >= 0, (topk_idx.numpy() % L + 1) / 4, 0.0)
    return x.double().numpy() * (topk_weights.double().numpy() * f).sum(1, keepdims=True)


def vllm_dbo(buffer, rank: int, n: int, T: int, ue8m0: bool = False) -> list:
    """vLLM's deepep_ll prepare/finalize under dual-batch overlap: two micro-batches dispatch
    (hooks), receive, combine (hooks into ``out``), receive; each output against NumPy. ``ue8m0``:
    FP8 with packed UE8M0 scales (vLLM's ``use_ue8m0_dispatch``: ``round_scale`` and
    ``use_ue8m0``), the experts reading the rows cast back."""
    E = n_experts(n)
    ubatches = []
    for ub in range(2):
        g = torch.Generator().manual_seed(50 + ub * 10 + rank)
        x = (torch.randn(T, HIDDEN, generator=g) * 0.5).to(torch.bfloat16)
        idx, w = rank_routing(rank, n, T, 7 + ub)
        ubatches.append((x, idx, w))
    handles, hooks, recvs = [None, None], [], []
    for ub, (x, idx, w) in enumerate(ubatches):  # prepare_async of each micro-batch
        recv, count, handles[ub], _, hook = buffer.low_latency_dispatch(x, idx.to(torch.int64), NUM_MAX, E,
                                                                        use_fp8=ue8m0, round_scale=ue8m0,
                                                                        use_ue8m0=ue8m0, async_finish=False,
                                                                        return_recv_hook=True)
        hooks.append(hook)
        recvs.append(recv)
    for hook in hooks:
        hook()
    if ue8m0:  # (the experts' input: the rows cast back from their codes and scales)
        recvs = [cast_back(c.view(-1, HIDDEN), s.reshape(-1, s.shape[-1])).view(c.shape) for c, s in recvs]
    outs, combine_hooks = [], []
    for ub, (x, idx, w) in enumerate(ubatches):  # finalize_async of each micro-batch
        out = torch.empty(T, HIDDEN, dtype=torch.bfloat16)
        _, _, hook = buffer.low_latency_combine(experts_out(recvs[ub]), idx.to(torch.int64), w, handles[ub],
                                                async_finish=False, zero_copy=False, return_recv_hook=True, out=out)
        outs.append(out)
        combine_hooks.append(hook)
    for hook in combine_hooks:
        hook()
    return [(out.float().numpy(), want_replay(x, idx, w, rank, n)) for out, (x, idx, w) in zip(outs, ubatches)]


def runtime_calls(buffer) -> dict:
    """``{runtime key: (its combine_weights, dispatches so far)}`` of the buffer's low-latency runtimes."""
    return {key: (entry.runtime.cfg.combine_weights, entry.runtime.calls)
            for key, entry in buffer._low_latency.entries.items()}


def three_in_flight(buffer, rank: int, n: int, T: int) -> list:
    """Three dispatches before any combine (the third takes the first's buffer back), then the
    three combines in order, each output against NumPy."""
    E, calls = n_experts(n), []
    for c in range(3):
        g = torch.Generator().manual_seed(70 + c * 10 + rank)
        x = (torch.randn(T, HIDDEN, generator=g) * 0.5).to(torch.bfloat16)
        idx, w = rank_routing(rank, n, T, 20 + c)
        recv, _, handle, _, _ = buffer.low_latency_dispatch(x, idx, NUM_MAX, E, use_fp8=False)
        calls.append((x, idx, w, experts_out(recv), handle))  # the outputs taken before the buffer is reused
    return [(buffer.low_latency_combine(y, idx, w, handle)[0].float().numpy(), want_replay(x, idx, w, rank, n))
            for x, idx, w, y, handle in calls]


def sglang_low_latency(buffer, rank: int, n: int, T: int, return_recv_hook: bool) -> tuple:
    """SGLang's low-latency dispatcher: dispatch_a / dispatch_b, combine_a / combine_b (FP8)."""
    E = n_experts(n)
    g = torch.Generator().manual_seed(90 + rank)
    x = (torch.randn(T, HIDDEN, generator=g) * 0.5).to(torch.bfloat16)
    idx, w = rank_routing(rank, n, T, 11)
    recv, masked_m, handle, event, hook = buffer.low_latency_dispatch(
        x, idx.to(torch.int64), NUM_MAX, E, use_fp8=True, async_finish=not return_recv_hook,
        return_recv_hook=return_recv_hook)
    hook() if return_recv_hook else event.current_stream_wait()
    codes, scales = recv
    rows = cast_back(codes.view(-1, HIDDEN), scales.reshape(-1, scales.shape[-1])).view(codes.shape)
    out, event, hook = buffer.low_latency_combine(x=experts_out(rows), topk_idx=idx.to(torch.int64), topk_weights=w,
                                                  handle=handle, async_finish=not return_recv_hook,
                                                  return_recv_hook=return_recv_hook)
    hook() if return_recv_hook else event.current_stream_wait()
    return out.float().numpy(), want_replay(x, idx, w, rank, n), masked_m.tolist()


def host_reads(buffer, rank: int, n: int, T: int) -> dict:
    """Reads of a tensor from the host (``item``, ``tolist``, ``bool``, ``int``, ``float``) inside
    each low-latency call and hook, once the runtimes are built: what a CUDA graph cannot hold."""
    E = n_experts(n)
    x = torch.zeros(T, HIDDEN, dtype=torch.bfloat16)
    idx, w = rank_routing(rank, n, T, 5)
    count = {"reads": 0}

    def counting(name):
        method = getattr(torch.Tensor, name)

        def wrapper(self, *a, **kw):
            count["reads"] += 1
            return method(self, *a, **kw)

        return method, wrapper

    patched = {name: counting(name) for name in ("item", "tolist", "__bool__", "__int__", "__float__")}
    reads = {}

    def measured(name, call):
        count["reads"] = 0
        for attr, (_, wrapper) in patched.items():
            setattr(torch.Tensor, attr, wrapper)
        try:
            result = call()
        finally:
            for attr, (method, _) in patched.items():
                setattr(torch.Tensor, attr, method)
        reads[name] = count["reads"]
        return result

    for fp8 in (False, True):
        recv, _, handle, _, hook = measured(f"dispatch fp8={fp8}", lambda: buffer.low_latency_dispatch(
            x, idx, NUM_MAX, E, use_fp8=fp8, return_recv_hook=True))
        measured(f"dispatch hook fp8={fp8}", hook)
        y = torch.zeros(recv[0].shape if fp8 else recv.shape, dtype=torch.bfloat16)
        _, _, hook = measured(f"combine fp8={fp8}", lambda: buffer.low_latency_combine(y, idx, w, handle,
                                                                                    return_recv_hook=True))
        measured(f"combine hook fp8={fp8}", hook)
    return reads


def refusals(buffer, normal, rank: int, n: int, T: int) -> dict:
    """The messages of the calls the layer refuses (each before anything is sent)."""
    E = n_experts(n)
    x = torch.zeros(T, HIDDEN, dtype=torch.bfloat16)
    idx, w = rank_routing(rank, n, T, 3)
    cases = {
        "not_low_latency_mode": lambda: normal.low_latency_dispatch(x, idx, NUM_MAX, E),
        "too_many_tokens": lambda: buffer.low_latency_dispatch(torch.zeros(NUM_MAX + 1, HIDDEN).bfloat16(),
                                                               torch.zeros(NUM_MAX + 1, TOP_K, dtype=torch.int64),
                                                               NUM_MAX, E),
        "ue8m0_without_round_scale": lambda: buffer.low_latency_dispatch(x, idx, NUM_MAX, E, use_ue8m0=True),
        "hook_and_async": lambda: buffer.low_latency_dispatch(x, idx, NUM_MAX, E, async_finish=True,
                                                              return_recv_hook=True),
        "recv_cost_stats": lambda: buffer.low_latency_dispatch(x, idx, NUM_MAX, E,
                                                               dispatch_wait_recv_cost_stats=torch.zeros(n, n)),
        "logfmt": lambda: buffer.low_latency_combine(x, idx, w, None, use_logfmt=True),
        "foreign_handle": lambda: buffer.low_latency_combine(x, idx, w, ("a", "tuple")),
        "mask_buffer": lambda: buffer.low_latency_update_mask_buffer(0, True),
    }
    messages = {}
    for name, call in cases.items():
        try:
            call()
            messages[name] = None
        except Exception as e:  # noqa: BLE001 - the test checks the class and message
            messages[name] = (type(e).__name__, isinstance(e, NotImplementedError), str(e))
    return messages


def torch_rank_main(rank: int, n: int, store: str, out_dir: str) -> None:
    """One rank of the gloo job (:func:`test_sessions_sim.torch_job_main`)."""
    import torch.distributed as dist

    import ep_runtime.deep_ep as deep_ep

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=n,
                            timeout=datetime.timedelta(seconds=JOB_TIMEOUT_S))
    try:
        T = SETUPS[n]["tokens"][rank]
        group = dist.new_group(list(range(n)))
        if SETUPS[n].get("nodes", 1) > 1:
            from ep_runtime.shmem import session_for

            session_for(group).use_logical_nodes(SETUPS[n]["nodes"])
        hint = deep_ep.Buffer.get_low_latency_rdma_size_hint(NUM_MAX, HIDDEN, n, n_experts(n))
        buffer = deep_ep.Buffer(group, num_rdma_bytes=hint, low_latency_mode=True, num_qps_per_rank=n_experts(n) // n,
                                allow_nvlink_for_low_latency_mode=True, explicitly_destroy=True, allow_mnnvl=False)
        got = {"hint": hint, "deepep": deepep_checks(buffer, rank, n, T)}
        before = runtime_calls(buffer)
        got["vllm_dbo"] = vllm_dbo(buffer, rank, n, T)
        got["runtime_calls"] = (before, runtime_calls(buffer))
        got["three_in_flight"] = three_in_flight(buffer, rank, n, T)
        got["sglang"] = [sglang_low_latency(buffer, rank, n, T, hook) for hook in (True, False)]
        buffer.clean_low_latency_buffer(NUM_MAX, HIDDEN, n_experts(n))
        got["after_clean"] = vllm_dbo(buffer, rank, n, T, ue8m0=True)
        got["host_reads"] = host_reads(buffer, rank, n, T)
        got["refused"] = refusals(buffer, deep_ep.Buffer(group, 0), rank, n, T)
        got["transports"] = sorted({entry.runtime.plan.transport.value
                                    for entry in buffer._low_latency.entries.values()})
        buffer.destroy()
    finally:
        dist.destroy_process_group()
    with open(os.path.join(out_dir, f"{rank}.pkl"), "wb") as f:
        pickle.dump(got, f)


@pytest.fixture(scope="module", params=[2, 3, pytest.param(4, marks=pytest.mark.wide)],
                ids=lambda n: f"{n}_ranks" if n in (2, 3) else f"{n}_ranks_2_nodes")
def job(request, tmp_path_factory):
    from test_sessions_sim import run_torch_job

    n = request.param
    return n, run_torch_job("test_deep_ep_low_latency_sim", n, tmp_path_factory.mktemp(f"ll_{n}"), JOB_TIMEOUT_S)


def test_low_latency_runtimes_put_across_nodes_and_store_within_one(job):
    """One node: every peer mapped, stores; two logical nodes: the plan puts to every peer (the
    weights at home go straight home, which the hierarchical transport's proxies do not carry)."""
    n, got = job
    want = ["puts"] if SETUPS[n].get("nodes", 1) > 1 else ["stores"]
    for rank, g in enumerate(got):
        assert g["transports"] == want, f"rank {rank}: {g['transports']}"


def test_deepep_low_latency_checks_pass_on_every_rank(job):
    """The checks ran in the ranks (a failed one fails the job); each format and mode was seen."""
    n, results = job
    for r, res in enumerate(results):
        seen = {(fp8, rs, ue, hook) for fp8, rs, ue, hook, _, _ in res["deepep"]}
        assert seen == {(*f, h) for f in FORMATS for h in (False, True)}, f"rank {r}: {seen}"
        assert res["hint"] > 0
    # every routed slot arrived somewhere: the counts over the ranks sum to the unmasked slots
    for k in range(len(results[0]["deepep"])):
        total = sum(sum(res["deepep"][k][4]) for res in results)
        want = 0
        for r in range(n):
            idx, _ = rank_routing(r, n, SETUPS[n]["tokens"][r], 1)
            want += int((idx >= 0).sum())
        assert total == want, f"round {k}: {total} rows received, {want} slots routed"


def _check_replay(got: np.ndarray, want: np.ndarray, what: str, fp8: bool = False) -> None:
    """bf16 output within a bf16 rounding of each partial and of the sum (2 ** -7 relative to the
    sum of magnitudes, as reference.combine_tolerance); FP8 rows: within an E4M3 step (2 ** -3)."""
    assert got.shape == want.shape, what
    bound = (2.0 ** -3 if fp8 else 2 * 2.0 ** -7) * np.abs(want).max(initial=0) + 1e-6
    err = np.abs(got - want).max(initial=0)
    assert err <= bound, f"{what}: max error {err} over {bound}"


def test_vllm_dual_batch_overlap_replay(job):
    """Two micro-batches in flight (bf16, and after clean_low_latency_buffer FP8 with packed UE8M0
    scales), and three dispatches before any combine (the third takes the first buffer back)."""
    n, results = job
    for r, res in enumerate(results):
        for what in ("vllm_dbo", "after_clean", "three_in_flight"):
            for ub, (got, want) in enumerate(res[what]):
                _check_replay(got, want, f"rank {r}: {what} micro-batch {ub}", fp8=what == "after_clean")


def exact_dbo_outputs(n: int, ub: int) -> list:
    """Every rank's output of micro-batch ``ub`` of :func:`vllm_dbo` (bf16), from NumPy: the batched
    reference of the inputs (``reference_batched.batched``), the replays' experts on its rows, and
    ``combine_batched_home`` with the combine's weights, the order of the runtime's sums (each
    token's routed slots ascending, float32 from 0, at home)."""
    from ep_runtime.core.config import EPConfig
    from ep_runtime.core.reference_batched import batched, combine_batched_home

    cfg = EPConfig(n_ranks=n, n_experts=n_experts(n), top_k=TOP_K, hidden=HIDDEN, max_tokens_per_rank=NUM_MAX)
    xs, ids, ws = [], [], []
    for r in range(n):
        g = torch.Generator().manual_seed(50 + ub * 10 + r)
        x = (torch.randn(SETUPS[n]["tokens"][r], HIDDEN, generator=g) * 0.5).to(torch.bfloat16)
        idx, w = rank_routing(r, n, SETUPS[n]["tokens"][r], 7 + ub)
        xs.append(x.view(torch.int16).numpy().view(np.uint16))
        ids.append(idx.numpy().astype(np.int32))
        ws.append(w.numpy())
    refs = batched(xs, ids, ws, cfg)
    rows = [torch.from_numpy(ref.x.view(np.int16)).view(torch.bfloat16) for ref in refs]
    ys = [experts_out(y).view(torch.int16).numpy().view(np.uint16) for y in rows]
    return [o.astype(np.float32) for o in combine_batched_home(ys, refs, ids, ws, cfg)]


def test_vllm_dual_batch_overlap_outputs_are_exact(job):
    """The bf16 micro-batches bit for bit (the simulator does not contract multiply-adds): the
    combine's weights multiply the right slot's row once, at home, in the reference's order."""
    n, results = job
    for ub in range(2):
        want = exact_dbo_outputs(n, ub)
        for r, res in enumerate(results):
            np.testing.assert_array_equal(res["vllm_dbo"][ub][0], want[r], err_msg=f"rank {r}: micro-batch {ub}")


def test_a_combine_adds_no_exchange(job):
    """Each micro-batch of the dual-batch overlap costs its buffer's runtime one dispatch and
    nothing else: the combine's weights go to no runtime of their own (every low-latency runtime
    is one of a format's two buffers, built to apply the weights at home)."""
    _, results = job
    for r, res in enumerate(results):
        before, after = res["runtime_calls"]
        assert set(after) == set(before), f"rank {r}: runtimes built by the combines: {set(after) - set(before)}"
        assert {key[-1] for key in after} <= {0, 1}, f"rank {r}: {sorted(after)}"
        assert all(weights == "home" for weights, _ in after.values()), f"rank {r}: {after}"
        grown = sorted(after[key][1] - before[key][1] for key in after)
        assert grown.count(1) == 2 and set(grown) <= {0, 1}, f"rank {r}: dispatches per runtime {grown}"


def test_sglang_low_latency_replay(job):
    n, results = job
    for r, res in enumerate(results):
        for k, (got, want, masked_m) in enumerate(res["sglang"]):
            # FP8 rows: each value within its block's E4M3 step (2 ** -3 relative) of the bf16 input
            bound = 2.0 ** -3 * np.abs(want).max(initial=0) + 1e-6
            assert np.abs(got - want).max(initial=0) <= bound, f"rank {r}: sglang call {k}"
            assert len(masked_m) == n_experts(n) // n


def test_low_latency_calls_read_nothing_from_the_device(job):
    """No call or hook reads a tensor on the host (no synchronization: one CUDA graph serves every
    step); each call was measured."""
    _, results = job
    for r, res in enumerate(results):
        assert len(res["host_reads"]) == 8, res["host_reads"]
        assert not any(res["host_reads"].values()), f"rank {r}: {res['host_reads']}"


#: The refused calls: (error class, a NotImplementedError?, words the message must hold).
REFUSED = {
    "not_low_latency_mode": ("EPStateError", False, ("low_latency_mode=True",)),
    "too_many_tokens": ("EPInputError", False, ("num_max_dispatch_tokens_per_rank",)),
    "ue8m0_without_round_scale": ("EPInputError", False, ("round_scale=True",)),
    "hook_and_async": ("EPInputError", False, ("return_recv_hook",)),
    "recv_cost_stats": ("DeepEPUnsupportedError", True, ("dispatch_wait_recv_cost_stats", "pass None")),
    "logfmt": ("DeepEPUnsupportedError", True, ("use_logfmt", "use_logfmt=False")),
    "foreign_handle": ("EPInputError", False, ("handle",)),
    "mask_buffer": ("DeepEPUnsupportedError", True, ("mask",)),
}


def test_refused_low_latency_calls_name_the_argument(job):
    _, results = job
    for r, res in enumerate(results):
        for name, (cls, not_implemented, words) in REFUSED.items():
            got = res["refused"][name]
            assert got is not None, f"rank {r}: {name} was not refused"
            assert got[0] == cls and got[1] == not_implemented, f"rank {r}: {name}: {got}"
            assert all(w in got[2] for w in words), f"rank {r}: {name}: {got[2]}"
