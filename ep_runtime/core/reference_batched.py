"""The NumPy reference of the batched layout (DeepEP's low-latency rows), every rank at once.

:func:`batched` is what ``dispatch_wait(layout="batched")`` returns on each rank, built from the
expert-major reference batch (:func:`ep_runtime.core.reference.dispatch`): local expert e's
rows, in that order, at slots ``0 .. counts[e] - 1`` of ``M = R T``; :func:`combine_batched` is
each home rank's output of ``combine_async(layout="batched")``: the expanded combine's sums
(:func:`ep_runtime.core.reference.combine`) of the slots' outputs; :func:`combine_batched_home`
the output with ``EPConfig.combine_weights="home"``: each token's slots' rows weighted and
summed at home, in slot order. A separate module from
:mod:`ep_runtime.core.reference` (which it reads) to keep each under the house's file size.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ep_runtime.core.config import EPConfig
from ep_runtime.core.reference import BF16, ExpertBatchRef, as_bf16, combine, dispatch, routed_ids


@dataclass
class BatchedRef:
    """One rank's batched rows.

    Attributes
    ----------
    x : [L, M, W] the rows (bf16, or a quantized format's codes, as :func:`dispatch`); zero past
        each expert's count (unspecified on a device)
    counts : [L] int32
    src_rank, src_token : [L, M] int32, each slot's source rank and token (-1 past the count)
    layout_range : [L, R] int64, per (expert, source rank) ``first slot << 32 | count``
    scales : FP8 formats: [L, M, S] each slot's block scales in the format's scale dtype (float32
        or UE8M0 codes), zero past the count; else None
    """

    x: np.ndarray
    counts: np.ndarray
    src_rank: np.ndarray
    src_token: np.ndarray
    layout_range: np.ndarray
    scales: np.ndarray | None = None


def batched(inputs_per_rank, topk_ids_per_rank, topk_weights_per_rank, cfg: EPConfig,
            token_scales_per_rank=None) -> list[BatchedRef]:
    """The batched rows of every rank (arguments as :func:`ep_runtime.core.reference.dispatch`)."""
    R, L, M = cfg.n_ranks, cfg.n_local_experts, cfg.n_ranks * cfg.max_tokens_per_rank
    out = []
    for b in dispatch(inputs_per_rank, topk_ids_per_rank, topk_weights_per_rank, cfg, token_scales_per_rank):
        x = np.zeros((L, M, b.x.shape[1]), b.x.dtype)
        scales = None if b.scales is None else np.zeros((L, M, b.scales.shape[1]), b.scales.dtype)
        src_rank, src_token = np.full((L, M), -1, np.int32), np.full((L, M), -1, np.int32)
        layout_range = np.zeros((L, R), np.int64)
        for e in range(L):
            o, c = int(b.row_offsets[e]), int(b.expert_counts[e])
            x[e, :c] = b.x[o:o + c]
            if scales is not None:
                scales[e, :c] = b.scales[o:o + c]
            src_rank[e, :c], src_token[e, :c] = b.src_rank[o:o + c], b.src_token[o:o + c]
            per = np.bincount(b.src_rank[o:o + c], minlength=R).astype(np.int64)
            layout_range[e] = (np.cumsum(per) - per) << 32 | per
        out.append(BatchedRef(x, b.expert_counts.astype(np.int32), src_rank, src_token, layout_range, scales))
    return out


def expanded_rows(batched_rows: np.ndarray, batch: ExpertBatchRef) -> np.ndarray:
    """``batched_rows`` ``[L, M, ...]`` (one value or row per batched slot) in the expert-major
    order of ``batch`` (a rank's :func:`ep_runtime.core.reference.dispatch`): slot (e, pos) at
    row ``row_offsets[e] + pos``; padding rows zero."""
    out = np.zeros((batch.n_rows,) + batched_rows.shape[2:], batched_rows.dtype)
    for e, c in enumerate(batch.expert_counts):
        o = int(batch.row_offsets[e])
        out[o:o + int(c)] = batched_rows[e, :int(c)]
    return out


def combine_batched(outputs_per_rank, batches: list[ExpertBatchRef], topk_ids_per_rank, cfg: EPConfig,
                    weights="dispatch") -> list:
    """Combine in the batched layout, per home rank ``[T_s, hidden]`` bfloat16.

    ``outputs_per_rank[r]`` ``[L, M, hidden]`` bfloat16 (or uint16 bits): rank r's output of
    each batched slot; ``batches`` the expert-major reference batches (their rows are the slots,
    in order); ``weights``: ``"dispatch"`` (the router weights), None (1) or per rank float32
    ``[L, M]`` (a weight per slot). The sums are the expanded layout's (each token's partial over
    its local experts ascending, float32 from 0; partials summed home in rank order)."""
    rows = [expanded_rows(np.asarray(y).reshape(cfg.n_local_experts, -1, cfg.hidden), b)
            for y, b in zip(outputs_per_rank, batches)]
    if not (isinstance(weights, str) or weights is None):
        weights = [expanded_rows(np.asarray(w, np.float32).reshape(cfg.n_local_experts, -1), b)
                   for w, b in zip(weights, batches)]
    return combine(rows, batches, topk_ids_per_rank, cfg, weights=weights)


def combine_batched_home(outputs_per_rank, refs: list[BatchedRef], topk_ids_per_rank, topk_weights_per_rank,
                         cfg: EPConfig) -> list:
    """Combine in the batched layout with the weights applied at home
    (``EPConfig.combine_weights="home"``), per home rank ``[T_s, hidden]`` bfloat16.

    ``outputs_per_rank[r]`` ``[L, M, hidden]`` bfloat16 (or uint16 bits): rank r's output of each
    batched slot; ``refs`` the batched rows (:func:`batched`: which slot holds each (token,
    expert)); ``topk_ids_per_rank`` the dispatch's routing, ``topk_weights_per_rank[s]`` ``[T_s,
    K]`` float32 the weights home rank s gives the combine. Token t's output is bf16 of the sum
    over its routed slots k (:func:`~ep_runtime.core.reference.routed_ids`: masked, dropped and
    repeated slots skipped), ascending, of ``float32(w[t, k] * row)``, in float32 from 0: the
    row the slot's expert wrote for the token, unrounded until the output."""
    L, H = cfg.n_local_experts, cfg.hidden
    rows = [as_bf16(np.asarray(y)).reshape(L, -1, H).astype(np.float32) for y in outputs_per_rank]
    outs = []
    for s, (topk_ids, weights) in enumerate(zip(topk_ids_per_rank, topk_weights_per_rank)):
        ids = routed_ids(topk_ids, cfg.n_experts)
        weights = np.asarray(weights, np.float32)
        out = np.zeros((ids.shape[0], H), np.float32)
        for t in range(ids.shape[0]):
            for k in range(ids.shape[1]):
                x = int(ids[t, k])
                if x < 0:
                    continue
                r, e = divmod(x, L)
                pos = np.flatnonzero((refs[r].src_rank[e] == s) & (refs[r].src_token[e] == t))
                assert len(pos) == 1, f"token {t} of rank {s}: expert {x} holds {len(pos)} slots of it"
                out[t] += weights[t, k] * rows[r][e, pos[0]]
        outs.append(out.astype(BF16))
    return outs
