"""Engines' DeepEP normal-mode call sequences, replayed on ``ep_runtime.deep_ep`` on the simulator
(a gloo job of 2 ranks), checked for shapes, dtypes and values against tests/deep_ep_oracle.py.

Read (to learn the calls; no code taken):

- vLLM ``vllm/model_executor/layers/fused_moe/prepare_finalize/deepep_ht.py`` at commit
  055e47c28003156421365af985d676fc921cb075 (``DeepEPHTPrepareAndFinalize``) and
  ``vllm/distributed/device_communicators/all2all.py`` (``DeepEPHTAll2AllManager``): the buffer
  of ``group=cpu_group, num_nvl_bytes=1 GiB, num_rdma_bytes=0, low_latency_mode=False,
  num_qps_per_rank=1``; ``get_dispatch_layout(..., async_finish=False)``; ``dispatch`` of bf16, or
  of block-quantized FP8 ``(codes, [T, H/128] float32 scales)``, with ``expert_alignment=1``,
  ``Buffer.get_dispatch_config(world)``, ``async_finish=True``; the receiver waits
  ``if event.event is not None``, remaps ``recv_topk_idx`` to global ids (-1 to an expert of
  another rank) and takes the per-expert list; finalize reduces each row over its slots with the
  weights (``TopKWeightAndReduceContiguous``) and calls ``combine(x, handle, topk_weights=None,
  config=get_combine_config(world), async_finish=True)``, copying the output. With dual-batch
  overlap (DBO) two micro-batches dispatch before either combines (``handles[ubatch]``).
- SGLang ``python/sglang/srt/layers/moe/token_dispatcher/deepep.py`` at commit
  003a81bf2870c07b110de13641ad4f0ba63b1fa1 (``_DeepEPDispatcherImplNormal``, ``DeepEPBuffer``):
  the buffer of ``num_nvl_bytes`` from the configs' NVLink size hints, ``num_qps_per_rank=
  Buffer.num_sms``, ``allow_mnnvl=True``; ``Buffer.capture()`` as the layout's
  ``previous_event`` when ``async_finish``; the layout's event as the dispatch's; ``dispatch``
  with ``expert_alignment=128`` under DeepGEMM, FP8 tokens quantized per 128 with UE8M0 scales
  packed in int32 and column-major (Blackwell DeepGEMM), ``config=Config(**json)``; the experts'
  rows, already weighted and reduced, combined with ``previous_event=Buffer.capture()``.

The experts here: expert ``e`` maps a row ``x`` (FP8: its codes times their block scales) to
``x * (e + 1)`` in float32; a received row's output is the float32 sum over its local slots of
weight times that, rounded to bf16; the combine sums the rows of the ranks a token went to.
"""

from __future__ import annotations


import ml_dtypes
import numpy as np
import pytest

from deep_ep_oracle import BF16, Setup, expected_combine, expected_dispatch, rank_inputs

torch = pytest.importorskip("torch")

SETUP = Setup(R=2, tokens=(12, 9))
JOB_TIMEOUT_S = 600
#: The runs: (engine, token format, async_finish, expert_alignment).
RUNS = (("vllm", "bf16", True, 1), ("vllm", "fp8", True, 1), ("vllm_dbo", "bf16", False, 1),
        ("sglang", "bf16", False, 1), ("sglang", "fp8_ue8m0", True, 128))


def _bf16(bits: np.ndarray):
    return torch.from_numpy(np.ascontiguousarray(bits).view(np.int16)).view(torch.bfloat16)


def _bits(t) -> np.ndarray:
    return t.detach().contiguous().view(torch.int16).numpy().view(np.uint16).copy()


def _experts(rows: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The received rows' outputs ``[N, H]`` bf16: per row, the float32 sum over its local slots
    (in slot order) of weight times ``rows * (e + 1)``."""
    acc = torch.zeros(rows.shape, dtype=torch.float32)
    for k in range(idx.shape[1]):
        local = idx[:, k] >= 0
        acc = acc + torch.where(local[:, None], w[:, k, None] * (rows * (idx[:, k, None] + 1).float()), 0.0)
    return acc.bfloat16()


def _dequantized(codes: torch.Tensor, scales: torch.Tensor, packed: bool) -> torch.Tensor:
    """FP8 rows in float32: codes times their block's scale (UE8M0 exponents: 2 ** (e - 127))."""
    if packed:
        scales = torch.pow(2.0, scales.contiguous().view(torch.uint8).float() - 127)
    per_block = scales.repeat_interleave(128, dim=1)
    return codes.float() * per_block


def _vllm(buffer, ins, setup: Setup, fmt: str, async_finish: bool, micro_batches: int) -> dict:
    """vLLM's DeepEPHTPrepareAndFinalize: prepare (layout, dispatch, receiver), experts, finalize
    (combine), micro-batch by micro-batch as DBO interleaves them."""
    import ep_runtime.deep_ep as deep_ep

    T = len(ins.topk)
    cuts = np.linspace(0, T, micro_batches + 1).astype(int)
    config = deep_ep.Buffer.get_dispatch_config(setup.R) if setup.R in (2, 4, 8) else None
    handles, received, out = [], [], {}
    for u in range(micro_batches):
        lo, hi = cuts[u], cuts[u + 1]
        topk, weights = torch.from_numpy(ins.topk[lo:hi]), torch.from_numpy(ins.weights[lo:hi])
        per_rank, rdma, per_expert, in_rank, event = buffer.get_dispatch_layout(
            topk_idx=topk, num_experts=setup.E, previous_event=None, async_finish=False, allocate_on_comm_stream=False)
        tokens = _bf16(ins.x[lo:hi]) if fmt == "bf16" else (
            torch.from_numpy(ins.codes[lo:hi].copy()).view(torch.float8_e4m3fn), torch.from_numpy(ins.scales[lo:hi]))
        data, idx, w, counts, handle, event = buffer.dispatch(
            x=tokens, handle=None, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=rdma,
            is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=topk, topk_weights=weights,
            expert_alignment=1, config=config, previous_event=None, async_finish=async_finish,
            allocate_on_comm_stream=False)
        handles.append(handle)
        received.append((data, idx, w, counts, event))
    for u, (data, idx, w, counts, event) in enumerate(received):
        if event.event is not None:
            event.current_stream_wait()
        offset = buffer.rank * setup.L
        global_ids = torch.where(idx == -1, setup.E - 1 if offset == 0 else 0, idx + offset)
        rows = data.float() if fmt == "bf16" else _dequantized(*data, packed=False)
        y = _experts(rows, idx, w)
        out[u] = dict(counts=counts, global_ids=global_ids.numpy().copy(), idx=idx.numpy().copy(), y=_bits(y),
                      dtypes=(str(data.dtype) if fmt == "bf16" else (str(data[0].dtype), str(data[1].dtype)),
                              str(idx.dtype), str(w.dtype)))
        out[u]["y_in"] = y
    for u in range(micro_batches):
        combined, none, event = buffer.combine(x=out[u].pop("y_in"), handle=handles[u], topk_weights=None,
                                               config=deep_ep.Buffer.get_combine_config(setup.R), previous_event=None,
                                               async_finish=async_finish, allocate_on_comm_stream=False)
        if event.event is not None:
            event.current_stream_wait()
        output = torch.empty(combined.shape, dtype=torch.bfloat16)
        output.copy_(combined, non_blocking=True)
        out[u].update(out=_bits(output), none=none, cut=(int(cuts[u]), int(cuts[u + 1])))
    return out


def _sglang(buffer, ins, setup: Setup, fmt: str, async_finish: bool, alignment: int) -> dict:
    """SGLang's _DeepEPDispatcherImplNormal: dispatch_a/b, the experts, combine_a/b."""
    import ep_runtime.deep_ep as deep_ep

    topk, weights = torch.from_numpy(ins.topk).to(torch.int64), torch.from_numpy(ins.weights)
    if fmt == "bf16":
        hidden = _bf16(ins.x)
    else:  # per-128 FP8 with UE8M0 exponents packed four to an int32, column-major
        hidden = (torch.from_numpy(ins.codes.copy()).view(torch.float8_e4m3fn),
                  torch.from_numpy(ins.packed.copy()).T.contiguous().T)
    previous_event = deep_ep.Buffer.capture() if async_finish else None
    per_rank, rdma, per_expert, in_rank, previous_event = buffer.get_dispatch_layout(
        topk, setup.E, previous_event=previous_event, async_finish=async_finish,
        allocate_on_comm_stream=previous_event is not None)
    config = deep_ep.Config(**dict(num_sms=24, num_max_nvl_chunked_send_tokens=8, num_max_nvl_chunked_recv_tokens=256,
                                   num_max_rdma_chunked_send_tokens=6, num_max_rdma_chunked_recv_tokens=128))
    recv_x, recv_ids, recv_w, counts, handle, event = buffer.dispatch(
        hidden, topk_idx=topk, topk_weights=weights, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=rdma,
        is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, previous_event=previous_event,
        async_finish=async_finish, allocate_on_comm_stream=(previous_event is not None) and async_finish,
        expert_alignment=alignment, config=config if fmt != "bf16" else None)
    event.current_stream_wait() if async_finish else ()
    if isinstance(recv_x, tuple):
        recv_x, scale = recv_x
        rows = _dequantized(recv_x, scale, packed=True)
        scale_info = (str(scale.dtype), list(scale.shape), scale.numpy().copy())
    else:
        rows, scale_info = recv_x.float(), None
    y = _experts(rows, recv_ids, recv_w)
    previous_event = deep_ep.Buffer.capture() if async_finish else None
    combined, _, event = buffer.combine(y, handle, async_finish=async_finish, previous_event=previous_event,
                                        allocate_on_comm_stream=previous_event is not None, config=None)
    event.current_stream_wait() if async_finish else ()
    return {0: dict(counts=counts, idx=recv_ids.numpy().copy(), y=_bits(y), out=_bits(combined), scale=scale_info,
                    dtypes=(str(recv_x.dtype), str(recv_ids.dtype), str(recv_w.dtype)), cut=(0, len(ins.topk)))}


def torch_rank_main(rank: int, n: int, store: str, out_dir: str) -> None:
    """One rank of the gloo job: every run of :data:`RUNS`, pickled."""
    import datetime
    import os
    import pickle

    import torch.distributed as dist

    import ep_runtime.deep_ep as deep_ep

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=n,
                            timeout=datetime.timedelta(seconds=JOB_TIMEOUT_S))
    try:
        ins = rank_inputs(SETUP, rank)
        cpu_group = dist.new_group(list(range(n)), backend="gloo")
        vllm = deep_ep.Buffer(group=cpu_group, num_nvl_bytes=1024 * 1024 * 1024, num_rdma_bytes=0,
                              low_latency_mode=False, num_qps_per_rank=1)
        deep_ep.Buffer.set_num_sms(20)
        hidden_bytes = SETUP.H * 2
        nvl = max(c.get_nvl_buffer_size_hint(hidden_bytes, n) for c in (deep_ep.Buffer.get_dispatch_config(n),
                                                                          deep_ep.Buffer.get_combine_config(n)))
        rdma = max(c.get_rdma_buffer_size_hint(hidden_bytes, n) for c in (deep_ep.Buffer.get_dispatch_config(n),
                                                                           deep_ep.Buffer.get_combine_config(n)))
        sglang = deep_ep.Buffer(cpu_group, nvl, rdma, low_latency_mode=False, num_qps_per_rank=deep_ep.Buffer.num_sms,
                                allow_mnnvl=True)
        got = {}
        for engine, fmt, async_finish, alignment in RUNS:
            if engine.startswith("vllm"):
                got[engine, fmt] = _vllm(vllm, ins, SETUP, fmt, async_finish, 2 if engine == "vllm_dbo" else 1)
            else:
                got[engine, fmt] = _sglang(sglang, ins, SETUP, fmt, async_finish, alignment)
    finally:
        dist.destroy_process_group()
    with open(os.path.join(out_dir, f"{rank}.pkl"), "wb") as f:
        pickle.dump(got, f)


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    from test_sessions_sim import run_torch_job

    return run_torch_job("test_deep_ep_engines_sim", SETUP.R, tmp_path_factory.mktemp("deep_ep_engines"), JOB_TIMEOUT_S)


def _expected_experts(want: dict, rows: np.ndarray) -> np.ndarray:
    """The oracle of :func:`_experts` for one rank's expected dispatch (NumPy, same float32 order)."""
    acc = np.zeros(rows.shape, np.float32)
    for k in range(want["topk_idx"].shape[1]):
        local = want["topk_idx"][:, k] >= 0
        term = want["topk_weights"][:, k, None] * (rows * (want["topk_idx"][:, k, None] + 1).astype(np.float32))
        acc = acc + np.where(local[:, None], term, np.float32(0))
    return acc.astype(BF16).view(np.uint16)


def _rows_of(want: dict, fmt: str) -> np.ndarray:
    if fmt == "bf16":
        return want["x"].view(BF16).astype(np.float32)
    codes = want["codes"].view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    if fmt == "fp8":
        scales = want["scales"]
    else:
        scales = np.exp2(want["packed"].view(np.uint8).astype(np.float32) - 127)
    return codes * np.repeat(scales, 128, axis=1)


def _micro_setup(ins, cut_of) -> tuple:
    """Inputs restricted to each rank's micro-batch tokens ``cut_of[r]`` (a Setup and RankInputs)."""
    from deep_ep_oracle import RankInputs

    sub = [RankInputs(**{f: getattr(i, f)[lo:hi] if f != "bias" else i.bias[:, lo:hi]
                         for f in RankInputs.__dataclass_fields__}) for i, (lo, hi) in zip(ins, cut_of)]
    return Setup(R=SETUP.R, tokens=tuple(hi - lo for lo, hi in cut_of), H=SETUP.H, E=SETUP.E, K=SETUP.K), sub


@pytest.mark.parametrize("run", RUNS, ids=lambda r: f"{r[0]}-{r[1]}")
def test_engine_call_sequence_gives_deep_ep_s_results(job, run):
    engine, fmt, _, alignment = run
    ins = [rank_inputs(SETUP, r) for r in range(SETUP.R)]
    micro = sorted(job[0][engine, fmt])
    for u in micro:
        setup, sub = _micro_setup(ins, [job[r][engine, fmt][u]["cut"] for r in range(SETUP.R)])
        wants = [expected_dispatch(setup, sub, r, alignment) for r in range(SETUP.R)]
        ys = []
        for r, want in enumerate(wants):
            got, what = job[r][engine, fmt][u], f"{engine} {fmt}, micro-batch {u}, rank {r}"
            assert got["counts"] == want["counts"].tolist(), what
            np.testing.assert_array_equal(got["idx"], want["topk_idx"], err_msg=what)
            np.testing.assert_array_equal(got["y"], _expected_experts(want, _rows_of(want, fmt)), err_msg=what)
            ys.append(got["y"])
            if engine.startswith("vllm"):
                offset = r * setup.L
                remapped = np.where(want["topk_idx"] == -1, setup.E - 1 if offset == 0 else 0,
                                    want["topk_idx"] + offset)
                np.testing.assert_array_equal(got["global_ids"], remapped, err_msg=what)
                assert got["none"] is None
            want_dtypes = ("torch.bfloat16" if fmt == "bf16" else ("torch.float8_e4m3fn", "torch.float32"))
            if engine == "sglang" and fmt != "bf16":
                want_dtypes = "torch.float8_e4m3fn"
                dtype, shape, scale = got["scale"]
                assert dtype == "torch.int32" and shape == [len(want["rows"]), SETUP.H // 512], what
                np.testing.assert_array_equal(scale, want["packed"], err_msg=f"{what}: scales")
            assert got["dtypes"] == (want_dtypes, "torch.int64", "torch.float32"), what
        for r, out in enumerate(expected_combine(setup, sub, ys)):
            np.testing.assert_array_equal(job[r][engine, fmt][u]["out"], out, err_msg=f"{engine} {fmt} {u}: rank {r}")
        if alignment > 1:
            assert all(c % alignment == 0 for r in range(SETUP.R) for c in job[r][engine, fmt][u]["counts"])
