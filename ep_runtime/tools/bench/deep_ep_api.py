"""DeepEP's normal-mode API timed on this rank's inputs: DeepEP V1 itself (the baseline, when its
package is installed) and ep_runtime's layer of that API (:mod:`ep_runtime.deep_ep`), in the same
run as the runtime's own calls, so the layer's cost over the runtime shows beside both.

Each sample starts after a synchronization and a barrier of all ranks; on GPUs it is timed with
CUDA events on the caller's stream (what the caller waits for, host work inside included), on
the simulator with the host clock. Per buffer, with its key prefix:

- ``{prefix}_dispatch``: ``get_dispatch_layout`` then ``dispatch`` with top-k, as Megatron's and
  the engines' DeepEP paths run it (the host reads the received counts: one synchronization);
- ``{prefix}_dispatch_cached``: ``dispatch`` with the previous call's handle (no layout, no host
  read: DeepEP's tuning loop, a backward's dispatch);
- ``{prefix}_combine``: ``combine`` of the received rows (bf16) with the received weights (the
  call Megatron's backward makes); the layer adds ``{prefix}_combine_unweighted`` (the forward's
  combine, without ``topk_weights``: the runtime's compact combine and the layer's gathers) and
  ``{prefix}_dispatch_worst`` (``num_worst_tokens``: no host read, CUDA-graph-compatible).
"""

from __future__ import annotations

import importlib
import time

import numpy as np

#: SM counts the DeepEP baseline runs its normal kernels on: the 32 its intranode tests tune with,
#: and its default (``Buffer.num_sms``).
DEEPEP_SMS = (32, 20)
#: The layer's NVLink bytes argument (what DeepEP's tests pass); the layer sizes its heap by its runtimes.
NVL_BYTES = int(2e9)


def deepep_v1(session, tokens, ids, weights, n_experts: int, samples: int, warmup: int, fp8=None) -> dict:
    """DeepEP V1's intranode normal kernels (``deep_ep.Buffer`` of the real package) on this rank's
    tokens (``[T, H]`` bf16 bits as uint16), routing (``[T, K]`` int32) and weights (``[T, K]``
    float32), or, with ``fp8 = (codes, scales)`` (E4M3 codes ``[T, H]`` uint8, float32 scales
    ``[T, H / 128]``), those FP8 tokens; per SM count of :data:`DEEPEP_SMS`, keys
    ``deepep_{sms}sms_*`` (see the module docstring). Refuses ep_runtime's layer under that name
    (the alias installed: the baseline would time the layer)."""
    import torch.distributed as dist

    from ep_runtime.tools.bench.measure import _join_nccl

    deep_ep = importlib.import_module("deep_ep")
    if getattr(deep_ep, "ep_runtime_layer", False):
        raise RuntimeError("`import deep_ep` gives ep_runtime's layer (python -m ep_runtime deep-ep install): the "
                           "DeepEP V1 baseline needs the real package; uninstall the alias for this run")
    _join_nccl(session, "DeepEP")
    buffer = deep_ep.Buffer(dist.group.WORLD, NVL_BYTES, 0, explicitly_destroy=True)  # its tests' NVLink buffer
    out = {}
    try:
        for sms in DEEPEP_SMS:
            deep_ep.Buffer.set_num_sms(sms)
            out.update(_api_times(buffer, f"deepep_{sms}sms", session, tokens, ids, weights, n_experts, samples,
                                  warmup, fp8, layer=False))
    finally:
        _settle(session)
        buffer.destroy()
    return out


def deep_ep_layer(session, tokens, ids, weights, n_experts: int, samples: int, warmup: int, fp8=None) -> dict:
    """ep_runtime's DeepEP layer (:class:`ep_runtime.deep_ep.Buffer` on this session, sized for
    ``T`` tokens a rank) on the inputs of :func:`deepep_v1`: keys ``layer_*`` (see the module
    docstring). Collective."""
    import ep_runtime.deep_ep as layer

    buffer = layer.Buffer(None, NVL_BYTES, 0, explicitly_destroy=True, session=session,
                          max_tokens_per_rank=len(tokens))
    try:
        return _api_times(buffer, "layer", session, tokens, ids, weights, n_experts, samples, warmup, fp8, layer=True)
    finally:
        _settle(session)
        buffer.destroy()


def _api_times(buffer, prefix: str, session, tokens, ids, weights, n_experts: int, samples: int, warmup: int, fp8,
               layer: bool) -> dict:
    """The samples (us) of each call of the module docstring on ``buffer``."""
    import torch

    gpu = session.backend != "sim"
    dev = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
    if fp8 is None:
        x = torch.from_numpy(np.ascontiguousarray(tokens).view(np.int16)).to(dev).view(torch.bfloat16)
    else:
        codes, scales = fp8
        x = (torch.from_numpy(np.ascontiguousarray(codes)).to(dev).view(torch.float8_e4m3fn),
             torch.from_numpy(np.ascontiguousarray(scales, np.float32)).to(dev))
    idx = torch.from_numpy(np.ascontiguousarray(ids, np.int64)).to(dev)
    w = torch.from_numpy(np.ascontiguousarray(weights, np.float32)).to(dev)
    worst = len(tokens) * session.n_ranks

    def timed(run, *args, **kwargs):
        """``run(*args, **kwargs)`` after a sync and a barrier: its result and its us."""
        _settle(session)
        if not gpu:
            t0 = time.perf_counter()
            result = run(*args, **kwargs)
            return result, (time.perf_counter() - t0) * 1e6
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        result = run(*args, **kwargs)
        b.record()
        b.synchronize()
        return result, a.elapsed_time(b) * 1e3

    def dispatch(**extra):
        per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(idx, n_experts)
        return buffer.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                               num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w, **extra)

    kinds = ("dispatch", "dispatch_cached", "combine") + (("dispatch_worst", "combine_unweighted") if layer else ())
    times = {f"{prefix}_{k}": [] for k in kinds}
    for i in range(warmup + samples):
        got = {}
        (recv_x, _, recv_w, _, handle, _), got["dispatch"] = timed(dispatch)
        _, got["dispatch_cached"] = timed(buffer.dispatch, x, handle=handle)
        rows = recv_x[0].shape[0] if isinstance(recv_x, tuple) else recv_x.shape[0]
        y = recv_x if fp8 is None else torch.ones((rows, tokens.shape[1]), device=dev, dtype=torch.bfloat16)
        _, got["combine"] = timed(buffer.combine, y, handle, topk_weights=recv_w)
        if layer:
            _, got["dispatch_worst"] = timed(dispatch, num_worst_tokens=worst)
            _, got["combine_unweighted"] = timed(buffer.combine, y, handle)
        if i >= warmup:
            for k, t in got.items():
                times[f"{prefix}_{k}"].append(t)
    return times


def _settle(session) -> None:
    """Every rank's device work done and the ranks met (a sample's start, a buffer's end)."""
    if session.backend != "sim":
        import torch

        torch.cuda.synchronize()
    session.barrier()
