"""The runtime calls behind ``Buffer.dispatch`` and ``Buffer.combine`` (arguments checked by
:mod:`~ep_runtime.integrations.deep_ep.buffer`); :func:`run_dispatch` and :func:`open_dispatch`
serve ``HybridEPBuffer`` too.

A dispatch runs the runtime's dense dispatch with the caller's routing (padded with masked
slots to the runtime's ``top_k``): the kernels write DeepEP's dense rows, and the layer copies
them out (:mod:`~ep_runtime.integrations.deep_ep.dense`). A cached dispatch runs the handle's
routing again (the same routing gives the same dense rows). A combine runs the runtime's dense
combine on the caller's rows as they are (unweighted, as DeepEP's: the rows are the caller's
sums; the kernel reads each token's row through the dispatch's map), on the dispatch it belongs
to when that is still the runtime's current call, else after dispatching zeros with the
handle's routing (the same rows land in the same places).

``topk_weights`` of a combine go home on a second, float32 runtime of ``T x top_k`` floats a
rank: a dispatch of empty rows with the routing and a combine that returns each rank's float32
partials (``combine_wait(reduce=False)``), summed here in rank order, so each slot's value is
DeepEP's float32 sum over the ranks the token went to. ``bias`` is added to the combine's float32
sum before its one rounding to bf16 (a ``combine_wait`` epilogue), as DeepEP adds it.
"""

from __future__ import annotations

import torch

from ep_runtime.integrations.deep_ep.dense import DenseRows, DenseViews, dense_rows, dense_x
from ep_runtime.integrations.deep_ep.handle import HandleState, Routing
from ep_runtime.integrations.deep_ep.runtimes import RuntimeCache, RuntimeEntry, RuntimeKey

_BF16 = torch.bfloat16


def dispatch(cache: RuntimeCache, key: RuntimeKey, tokens, scales, routing: Routing, top_k: int | None,
             rows: int | None, alignment: int) -> tuple[DenseRows, RuntimeEntry]:
    """One non-cached dispatch of ``tokens`` (``[T, hidden]`` bf16, or uint8 E4M3 codes with
    ``scales``) with ``routing`` on the runtime of ``key``. Collective. ``top_k``: the caller's
    slots (None: no top-k outputs); ``rows``: ``num_worst_tokens`` (None: read on the host)."""
    entry = cache.entry(key, routing.ids.shape[1], tokens.shape[0])
    batch = run_dispatch(entry, tokens, scales, routing)
    return dense_rows(batch, top_k, rows, alignment, cache.host_values), entry


def cached_dispatch(cache: RuntimeCache, key: RuntimeKey, tokens, scales, state: HandleState):
    """A cached dispatch: ``tokens`` with the routing of ``state``'s dispatch, its dense rows
    ``(x, scales)`` ``[N, ...]`` (zero past the rows received). Collective; no host read."""
    entry = cache.entry(key, state.routing.ids.shape[1], tokens.shape[0])
    batch = run_dispatch(entry, tokens, scales, state.routing)
    return dense_x(batch, state.source)


def combine(cache: RuntimeCache, state: HandleState, x: torch.Tensor,
            bias: torch.Tensor | None) -> tuple[torch.Tensor, RuntimeEntry]:
    """``out`` ``[T, hidden]`` bf16: each token's sum of the rows ``x`` ``[N, hidden]`` bf16 of the
    ranks it went to (+ ``bias``, ``[T, hidden]`` float32), and the runtime entry that combined.
    Collective; no host read."""
    entry, rt_handle = open_dispatch(cache, state.routing, RuntimeKey(x.shape[1], state.routing.n_experts),
                                     state.n_tokens)
    cfg = entry.cfg
    out = torch.empty(state.n_tokens, cfg.hidden, dtype=_BF16, device=entry.bridge.device)
    rt, to_rt = entry.runtime, entry.bridge.to_rt
    entry.open = None
    pending = rt.combine_async(to_rt(_dense_input(x, cfg)), rt_handle, layout="dense")
    if bias is None:
        rt.combine_wait(pending, out=to_rt(out))
    else:
        rt.combine_wait(pending, out=to_rt(out), epilogue=bias_epilogue(), aux=to_rt(bias))
    return out, entry


def combine_weights(cache: RuntimeCache, main: RuntimeEntry, state: HandleState, weights: torch.Tensor) -> torch.Tensor:
    """``[T, K]`` float32: for each token and slot, the sum over the ranks the token went to of
    their ``weights`` ``[N, K]`` rows (DeepEP's combined ``topk_weights``), after the combine on
    ``main``. Collective: a dispatch and a combine on the float32 weights runtime (see the module
    docstring)."""
    entry = cache.weights_entry(main)
    cfg, device = entry.cfg, entry.bridge.device
    empty = torch.zeros(state.n_tokens, cfg.hidden, dtype=_BF16, device=device)
    batch = run_dispatch(entry, empty, None, state.routing)
    n, k = weights.shape
    padded = torch.zeros(n, cfg.hidden, dtype=torch.float32, device=device)
    padded[:, :k] = weights
    partials = torch.empty(cfg.n_ranks, state.n_tokens, cfg.hidden, dtype=torch.float32, device=device)
    rt, to_rt = entry.runtime, entry.bridge.to_rt
    entry.open = None
    rt.combine_wait(rt.combine_async(to_rt(_dense_input(padded, cfg)), batch.rt_handle, layout="dense"),
                    out=to_rt(partials), reduce=False)
    return partials.sum(0)[:, :k].contiguous()


def open_dispatch(cache: RuntimeCache, routing: Routing, key: RuntimeKey, n_tokens: int) -> tuple[RuntimeEntry, object]:
    """The runtime entry whose current dispatch is ``routing``'s, among those of ``key``'s rows
    (its hidden, layout, padding and partials; any token format), and that dispatch's runtime
    handle; when none is (another call came in between, or the combine's rows are wider or
    narrower than the dispatch's), a dispatch of zero rows with ``routing`` on the runtime of
    ``key``, which opens one. Collective."""
    for k, entry in cache.entries.items():
        if (entry.open is not None and entry.open[0] is routing and k.hidden == key.hidden
                and (k.layout, k.pad_multiple, k.combine_dtype) == (key.layout, key.pad_multiple, key.combine_dtype)):
            return entry, entry.open[1]
    entry = cache.entry(key, routing.ids.shape[1], n_tokens)
    zeros = torch.zeros(n_tokens, key.hidden, dtype=_BF16, device=entry.bridge.device)
    return entry, run_dispatch(entry, zeros, None, routing).rt_handle


def _dense_input(rows: torch.Tensor, cfg) -> torch.Tensor:
    """A combine's dense rows ``[N, W]`` as the runtime's dense combine takes them: at most its
    ``R C`` dense rows (rows past those, of a ``num_worst_tokens`` past the capacity, are past
    every row received: never read)."""
    return rows[:cfg.n_ranks * cfg.max_tokens_per_rank]


def run_dispatch(entry: RuntimeEntry, tokens, scales, routing: Routing):
    """The runtime's dispatch of ``tokens`` (and FP8 ``scales``) with ``routing``, padded to its
    ``top_k``, in the entry's layout; the batch as torch views (dense:
    :class:`~ep_runtime.integrations.deep_ep.dense.DenseViews`; else
    :class:`ep_runtime.integrations.torch_async.Batch`), and the entry's open dispatch set to it."""
    from ep_runtime.integrations.torch_async import Batch

    rt, bridge = entry.runtime, entry.bridge
    layout = rt.cfg.layouts[0]
    ids, weights = pad_routing(routing, rt.cfg.top_k)
    to_rt = bridge.to_rt
    handle = rt.dispatch_async(to_rt(tokens), to_rt(ids), to_rt(weights),
                               token_scales=None if scales is None else to_rt(scales))
    b = rt.dispatch_wait(handle, layout=layout)
    entry.open = (routing, b.handle)
    t = bridge.from_rt
    if layout == "dense":
        return DenseViews(b.handle, t(b.x), None if b.scales is None else t(b.scales), t(b.topk_idx),
                          t(b.topk_weights), t(b.slot), t(b.source_rows), t(b.expert_counts))
    compact = layout == "compact"
    return Batch(rt, b.handle, handle.n_tokens, layout, t(b.x), None if b.scales is None else t(b.scales),
                 t(b.row_offsets), t(b.expert_counts), t(b.src_rank), t(b.src_token), t(b.src_k), t(b.weight),
                 t(b.gather) if compact else None, t(b.recv_tokens) if compact else None)


def pad_routing(routing: Routing, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``routing``'s ids and weights ``[T, width]`` (masked slots appended; contiguous)."""
    ids, weights = routing.ids, routing.weights
    extra = width - ids.shape[1]
    if extra:
        ids = torch.nn.functional.pad(ids, (0, extra), value=-1)
        weights = torch.nn.functional.pad(weights, (0, extra), value=0.0)
    return ids.contiguous(), weights.contiguous()


_EPILOGUE = []


def bias_epilogue():
    """The ``combine_wait`` epilogue adding ``aux[token, col]`` (the bias, float32) to a token's
    float32 sum before its rounding (a Numba device function, made once: one build per runtime)."""
    if not _EPILOGUE:
        from ep_runtime.kernels.cuda_api import cuda

        def add_bias(value, token, col, aux):
            return value + aux[token, col]

        _EPILOGUE.append(cuda.jit(device=True)(add_bias))
    return _EPILOGUE[0]
