"""The pure-NumPy oracle: dispatch and combine for all ranks, in one process.

These functions define what the kernels must produce (docs/protocol.md states the same):

Routing
    ``topk_ids[t, k] == -1`` masks a slot: it names no expert. An id outside ``[-1,
    n_experts)`` is dropped the same way (the runtime raises it after the call), and an id an
    earlier slot of the token already names counts once, with the first slot's weight
    (:func:`routed_ids`). A token whose slots are all masked combines to a zero row.

Dispatch (exact)
    Rank ``r``'s expert batch holds one row per (source token, local expert of ``r`` in its
    routed ids), grouped by local expert ``e`` (ascending), then source rank ``s`` (ascending),
    then source token ``t`` (ascending). Segment ``e`` starts at ``row_offsets[e]``, a multiple
    of ``pad_multiple``; padding rows are zero with source rank/token/k ``-1`` and weight 0.

Combine (fixed order, float32)
    Rank ``r`` computes, for each token ``(s, t)`` it received, the partial
    ``p_r = sum over its local experts e of t in ascending e: w(t, e) * f32(y_e(t))``
    accumulated sequentially in float32 from 0, and rounds it to ``combine_dtype`` (the wire:
    bfloat16, or float32, i.e. not rounded). The home rank ``s`` sums the partials of the ranks
    token ``t`` went to, in rank order, in float32 from 0, and rounds to bfloat16. Kernels may
    differ from this only by fused multiply-add contraction; :func:`combine_tolerance` bounds
    that. :func:`combine_exact` is the float64 combine and :func:`combine_error_bound` bounds
    each mode's distance from it (docs/formats.md, "Combine precision").
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

from ep_runtime.core.config import EPConfig

BF16 = np.dtype(ml_dtypes.bfloat16)


@dataclass
class ExpertBatchRef:
    """One rank's expert-major batch.

    Attributes
    ----------
    x : [rows, hidden] bfloat16
    row_offsets : [L + 1] int32
    expert_counts : [L] int32 (unpadded)
    src_rank, src_token, src_k : [rows] int32 (-1 on padding rows)
    weight : [rows] float32 (0 on padding rows)
    scales : FP8 token formats only: [rows, hidden / 128] float32 or uint8 UE8M0 codes (0 on
        padding rows); ``x`` is then [rows, hidden] uint8 E4M3 codes. NVFP4: [rows, hidden / 16]
        uint8 E4M3 codes, ``x`` [rows, hidden / 2] uint8 packed E2M1 codes
    global_scales : NVFP4 only: [rows] float32, each row's source rank's global scale (0 on
        padding rows)
    """

    x: np.ndarray
    row_offsets: np.ndarray
    expert_counts: np.ndarray
    src_rank: np.ndarray
    src_token: np.ndarray
    src_k: np.ndarray
    weight: np.ndarray
    scales: np.ndarray | None = None
    global_scales: np.ndarray | None = None

    @property
    def n_rows(self) -> int:
        return int(self.row_offsets[-1])


def routed_ids(topk_ids, n_experts: int) -> np.ndarray:
    """``[T, K]`` int32: the experts the slots of ``topk_ids`` ([T, K] int) route to, -1 (masked)
    for a slot that is -1, outside ``[0, n_experts)``, or a repeat of an earlier slot's id in
    its token's row."""
    ids = np.array(topk_ids, dtype=np.int64)  # a copy
    ids[(ids < 0) | (ids >= n_experts)] = -1
    for k in range(1, ids.shape[1]):
        repeat = np.any(ids[:, :k] == ids[:, k:k + 1], axis=1) & (ids[:, k] >= 0)
        ids[repeat, k] = -1
    return ids.astype(np.int32)


def as_bf16(x: np.ndarray) -> np.ndarray:
    """View a uint16 array of bf16 bits as bfloat16 (or round a float array to bfloat16)."""
    x = np.asarray(x)
    if x.dtype == np.uint16:
        return x.view(BF16)
    return x.astype(BF16)


def global_scales(inputs_per_rank, cfg: EPConfig, global_scales_per_rank=None) -> list | None:
    """Each rank's global scale (float32) in a format with one (NVFP4; else None): the given
    ``global_scales_per_rank`` (a float32 or a [1] array per rank), or the rule's of each rank's
    bf16 tokens, as the runtime computes it when the caller passes none."""
    fmt = cfg.token_format
    if not fmt.has_global_scale:
        return None
    if global_scales_per_rank is not None:
        return [np.float32(np.asarray(g, np.float32).reshape(-1)[0]) for g in global_scales_per_rank]
    return [fmt.global_scale(as_bf16(x).view(np.uint16)) for x in inputs_per_rank]


def encoded_tokens(inputs_per_rank, cfg: EPConfig, token_scales_per_rank=None, global_scales_per_rank=None):
    """What each rank sends, per its token format: ``(rows, scales)`` per rank, bf16 rows and
    None, or in an FP8 format the E4M3 codes ``[T_r, hidden]`` uint8 and block scales
    ``[T_r, hidden / 128]`` (:meth:`ep_runtime.core.formats.TokenFormat.quantize` of bf16 inputs, or
    the given codes and ``token_scales_per_rank`` when pre-quantized). NVFP4: the packed codes
    ``[T_r, hidden / 2]`` and scales ``[T_r, hidden / 16]``, quantized under each rank's
    :func:`global_scales`."""
    fmt = cfg.token_format
    if not fmt.quantized:
        return [(as_bf16(x), None) for x in inputs_per_rank]
    if token_scales_per_rank is not None:
        return [(np.asarray(x).view(np.uint8), np.asarray(sc, fmt.scale_dtype))
                for x, sc in zip(inputs_per_rank, token_scales_per_rank)]
    if fmt.has_global_scale:
        gs = global_scales(inputs_per_rank, cfg, global_scales_per_rank)
        return [fmt.quantize(as_bf16(x).view(np.uint16), g) for x, g in zip(inputs_per_rank, gs)]
    return [fmt.quantize(as_bf16(x).view(np.uint16)) for x in inputs_per_rank]


def dispatch(inputs_per_rank, topk_ids_per_rank, topk_weights_per_rank, cfg: EPConfig,
             token_scales_per_rank=None, global_scales_per_rank=None) -> list[ExpertBatchRef]:
    """Expert batches of every rank.

    Parameters
    ----------
    inputs_per_rank : list of [T_r, hidden] bfloat16 (or uint16 bf16 bits); in an FP8 token
        format quantized as the kernels do (:func:`encoded_tokens`), or uint8 E4M3 codes with
        ``token_scales_per_rank`` (pre-quantized input)
    topk_ids_per_rank : list of [T_r, top_k] int
    topk_weights_per_rank : list of [T_r, top_k] float32
    global_scales_per_rank : NVFP4: each rank's global scale (:func:`global_scales`; required
        with pre-quantized input)
    """
    R, L, H, pad = cfg.n_ranks, cfg.n_local_experts, cfg.hidden, cfg.pad_multiple
    W = cfg.token_format.payload_width(H)
    encoded = encoded_tokens(inputs_per_rank, cfg, token_scales_per_rank, global_scales_per_rank)
    gs = global_scales(inputs_per_rank, cfg, global_scales_per_rank)
    xs = [x for x, _ in encoded]
    routed = [routed_ids(ids, cfg.n_experts) for ids in topk_ids_per_rank]
    quantized = cfg.token_format.quantized
    row_dtype = xs[0].dtype if xs else BF16
    batches = []
    for r in range(R):
        rows_x, ranks, tokens, ks, ws, rows_s, rows_g = [], [], [], [], [], [], []
        offsets = np.zeros(L + 1, np.int32)
        counts = np.zeros(L, np.int32)
        n = 0
        for e_local in range(L):
            e = r * L + e_local
            offsets[e_local] = n
            for s in range(R):
                ids = routed[s]
                t_hit, k_hit = np.nonzero(ids == e)
                order = np.argsort(t_hit, kind="stable")
                t_hit, k_hit = t_hit[order], k_hit[order]
                rows_x.append(xs[s][t_hit])
                if quantized:
                    rows_s.append(encoded[s][1][t_hit])
                if gs is not None:
                    rows_g.append(np.full(len(t_hit), gs[s], np.float32))
                ranks.append(np.full(len(t_hit), s, np.int32))
                tokens.append(t_hit.astype(np.int32))
                ks.append(k_hit.astype(np.int32))
                ws.append(np.asarray(topk_weights_per_rank[s], np.float32)[t_hit, k_hit])
                counts[e_local] += len(t_hit)
                n += len(t_hit)
            n_pad = -n % pad
            rows_x.append(np.zeros((n_pad, W), row_dtype))
            if quantized:
                rows_s.append(np.zeros((n_pad, cfg.token_format.scale_count(H)), cfg.token_format.scale_dtype))
            rows_g.append(np.zeros(n_pad, np.float32))
            ranks.append(np.full(n_pad, -1, np.int32))
            tokens.append(np.full(n_pad, -1, np.int32))
            ks.append(np.full(n_pad, -1, np.int32))
            ws.append(np.zeros(n_pad, np.float32))
            n += n_pad
        offsets[L] = n
        batches.append(ExpertBatchRef(
            x=np.concatenate(rows_x) if rows_x else np.zeros((0, W), row_dtype), row_offsets=offsets,
            expert_counts=counts, src_rank=np.concatenate(ranks), src_token=np.concatenate(tokens),
            src_k=np.concatenate(ks), weight=np.concatenate(ws),
            scales=np.concatenate(rows_s) if quantized and rows_s else None,
            global_scales=np.concatenate(rows_g) if gs is not None and rows_g else None))
    return batches


def partial_wire_dtype(cfg: EPConfig) -> np.dtype:
    """The dtype a partial travels in: bfloat16, or float32 with ``combine_dtype="float32"``."""
    return np.dtype(np.float32) if cfg.combine_dtype == "float32" else BF16


def _home_ranks(home_ranks, R: int) -> list[int]:
    """The home ranks asked for (all when None), checked, in ascending order."""
    if home_ranks is None:
        return list(range(R))
    wanted = sorted({int(s) for s in home_ranks})
    if any(s < 0 or s >= R for s in wanted):
        raise ValueError(f"home_ranks={list(home_ranks)}: every rank must be in [0, n_ranks = {R})")
    return wanted


def partial_sums(expert_out_per_rank, batches: list[ExpertBatchRef], topk_ids_per_rank, cfg: EPConfig,
                 dtype=np.float32, home_ranks=None, weights="dispatch"):
    """``partials[r][s]`` [T_s, hidden]: rank r's weighted sums over its local experts, in
    ascending expert order from 0, for the tokens of home rank s (zero where a token did not go
    to r), in ``dtype`` (float32 as the kernels; float64 for :func:`combine_exact`).
    ``expert_out_per_rank`` as in :func:`combine`. ``home_ranks``: only these s (the others are
    None), so a rank checking its own output holds ``R`` arrays, not ``R * R``. ``weights`` as
    :func:`combine` takes it."""
    R, L, H = cfg.n_ranks, cfg.n_local_experts, cfg.hidden
    wanted = _home_ranks(home_ranks, R)
    n_tokens = [np.asarray(ids).shape[0] for ids in topk_ids_per_rank]
    partials = [[np.zeros((n_tokens[s], H), dtype) if s in wanted else None for s in range(R)] for _ in range(R)]
    for r, b in enumerate(batches):
        y = as_bf16(expert_out_per_rank[r]).astype(dtype)
        w = b.weight.astype(dtype) if isinstance(weights, str) and weights == "dispatch" else \
            np.ones(b.n_rows, dtype) if weights is None else np.asarray(weights[r], np.float32)[:b.n_rows].astype(dtype)
        for e_local in range(L):
            lo, hi = int(b.row_offsets[e_local]), int(b.row_offsets[e_local + 1])
            rows = np.arange(lo, hi)[b.src_rank[lo:hi] >= 0]
            for s in wanted:
                mine = rows[b.src_rank[rows] == s]
                t = b.src_token[mine]
                partials[r][s][t] = partials[r][s][t] + w[mine][:, None] * y[mine]
    return partials


def combine(expert_out_per_rank, batches: list[ExpertBatchRef], topk_ids_per_rank, cfg: EPConfig,
            reduce: bool = True, home_ranks=None, weights="dispatch", node_size: int = 0):
    """Each token's router-weighted sum of its experts' outputs, back on its home rank.

    Parameters
    ----------
    expert_out_per_rank : list of [>= rows_r, hidden] bfloat16 (or uint16 bits), row-aligned
        with ``batches[r]``.
    batches : the output of :func:`dispatch`.
    topk_ids_per_rank : list of [T_s, top_k] int (the routing passed to dispatch).
    reduce : if False, return per home rank the unreduced partials ``[R, T_s, hidden]``
        (zero where the token did not go to that rank) in the wire dtype: bfloat16, or float32
        (unrounded) with ``cfg.combine_dtype == "float32"``.
    home_ranks : optional iterable of ranks: only their outputs are computed (the others are
        None), in ``R`` times less memory than all of them (a GPU check at EP8, T=4096, hidden
        7168 holds 0.9 GB of float32 partials per process instead of 7.5 GB).
    weights : what each row is multiplied by: ``"dispatch"`` (its router weight, the batch's
        ``weight``), None (1: the plain sum of a token's rows) or per rank a float32 array
        row-aligned with ``batches[r]`` (``EPRuntime.combine_async``'s ``weights``).
    node_size : the hierarchical transport's PEs per node (0: one transport for every peer).
        Then each other node's partials of a token are first summed on that node (float32 from
        0, ascending rank, rounded to the partial dtype), and the home rank sums its own node's
        partials and one per other node, in ascending rank (:func:`sum_home`).

    Returns
    -------
    list of [T_s, hidden] bfloat16, one per home rank ``s`` (or the partials, see ``reduce``).
    With ``combine_dtype="bfloat16"`` each partial is rounded to bf16 before the home rank sums
    them; with ``"float32"`` it is not, and only the output is rounded.
    """
    R, L = cfg.n_ranks, cfg.n_local_experts
    wire = partial_wire_dtype(cfg)
    wanted = _home_ranks(home_ranks, R)
    partials = partial_sums(expert_out_per_rank, batches, topk_ids_per_rank, cfg, home_ranks=wanted, weights=weights)
    outs = []
    for s in range(R):
        if s not in wanted:
            outs.append(None)
            continue
        ids = routed_ids(topk_ids_per_rank[s], cfg.n_experts)
        went = [np.any(ids // L == r, axis=1) for r in range(R)]
        if not reduce:
            outs.append(np.stack([np.where(went[r][:, None], partials[r][s], 0).astype(wire)
                                  for r in range(R)]) if R else None)
            continue
        outs.append(sum_home([partials[r][s].astype(wire) for r in range(R)], went, s, wire, node_size))
    return outs


def sum_home(terms, went, home: int, wire, node_size: int = 0) -> np.ndarray:
    """A home rank's combine output, bf16 [T, hidden]: ``terms[r]`` [T, hidden] (rank r's partials
    of its tokens, in the ``wire`` dtype) summed in float32 from 0 in ascending rank, each token
    over the ranks with ``went[r]`` [T] set. With ``node_size`` (the hierarchical transport),
    the ranks of another node count as one term, at their node's place: the float32 sum from 0,
    in ascending rank, of that node's terms, rounded to ``wire`` (its proxy's sum)."""
    R = len(terms)
    acc = np.zeros(terms[0].shape if R else (0, 0), np.float32)
    r = 0
    while r < R:
        if node_size and r // node_size != home // node_size:  # another node: its proxy's sum
            node = range(r, r + node_size)
            part = np.zeros_like(acc)
            for q in node:
                part = np.where(went[q][:, None], part + terms[q].astype(np.float32), part)
            hit = np.any([went[q] for q in node], axis=0)
            acc = np.where(hit[:, None], acc + part.astype(wire).astype(np.float32), acc)
            r += node_size
            continue
        acc = np.where(went[r][:, None], acc + terms[r].astype(np.float32), acc)
        r += 1
    return acc.astype(BF16)


def receive_rows(inputs_per_rank, topk_ids_per_rank, cfg: EPConfig, token_scales_per_rank=None,
                 with_scales: bool = False, global_scales_per_rank=None):
    """The compact layout: what each rank's receive buffer holds after dispatch.

    Returns per rank ``r`` a pair ``(x, defined)``: ``x`` [R * T, hidden] bfloat16 (T =
    ``max_tokens_per_rank``; uint8 E4M3 codes in an FP8 token format), row ``s * T + t`` =
    token t of rank s when that token has an expert on ``r`` (``defined`` [R * T] bool marks
    those rows; the others are zero here and unspecified on a device). With ``with_scales``,
    a triple ``(x, defined, scales)``: the rows' block scales ``[R * T, hidden / 128]`` (FP8).
    NVFP4: ``x`` [R * T, hidden / 2] packed codes and scales [R * T, hidden / 16], quantized
    under ``global_scales_per_rank`` (:func:`global_scales`; :func:`receive_global_scales`).
    """
    R, L, T, H = cfg.n_ranks, cfg.n_local_experts, cfg.max_tokens_per_rank, cfg.hidden
    encoded = encoded_tokens(inputs_per_rank, cfg, token_scales_per_rank, global_scales_per_rank)
    fmt = cfg.token_format
    out = []
    for r in range(R):
        x = np.zeros((R * T, fmt.payload_width(H)), encoded[0][0].dtype if encoded else BF16)
        scales = np.zeros((R * T, fmt.scale_count(H)), fmt.scale_dtype) if fmt.quantized else None
        defined = np.zeros(R * T, bool)
        for s in range(R):
            hit = np.flatnonzero(np.any(routed_ids(topk_ids_per_rank[s], cfg.n_experts) // L == r, axis=1))
            x[s * T + hit] = encoded[s][0][hit]
            if scales is not None:
                scales[s * T + hit] = encoded[s][1][hit]
            defined[s * T + hit] = True
        out.append((x, defined, scales) if with_scales else (x, defined))
    return out


def receive_global_scales(inputs_per_rank, topk_ids_per_rank, cfg: EPConfig, global_scales_per_rank=None):
    """NVFP4's compact layout: per rank ``r`` ``(global_scales, defined)``, ``[R * T]`` float32 (row
    ``s * T + t``: rank s's global scale where its token t has an expert on ``r``, else 0) and
    :func:`receive_rows`' ``defined``."""
    R, L, T = cfg.n_ranks, cfg.n_local_experts, cfg.max_tokens_per_rank
    gs = global_scales(inputs_per_rank, cfg, global_scales_per_rank)
    out = []
    for r in range(R):
        g, defined = np.zeros(R * T, np.float32), np.zeros(R * T, bool)
        for s in range(R):
            hit = np.flatnonzero(np.any(routed_ids(topk_ids_per_rank[s], cfg.n_experts) // L == r, axis=1))
            g[s * T + hit], defined[s * T + hit] = gs[s], True
        out.append((g, defined))
    return out


def gather_index(batch: ExpertBatchRef, cfg: EPConfig) -> np.ndarray:
    """The compact batch's ``gather`` [rows] int32: the receive-buffer row of each expert-batch
    row, ``src_rank * T + src_token`` (-1 on padding rows), so that
    ``receive_rows(...)[r][0][gather] == batch.x`` on every real row."""
    T = cfg.max_tokens_per_rank
    return np.where(batch.src_rank >= 0, batch.src_rank * T + batch.src_token, -1).astype(np.int32)


def partial_rows_f32(rows: np.ndarray, cfg: EPConfig) -> np.ndarray:
    """A rank's compact combine input as float32: bf16 rows (or uint16 bits) widened, or, with
    ``combine_dtype="float32"``, float32 rows as they are (anything else is refused, as the
    runtime refuses it)."""
    rows = np.asarray(rows)
    if cfg.combine_dtype == "float32":
        if rows.dtype != np.float32:
            raise ValueError(f"combine_dtype='float32': compact rows must be float32, got {rows.dtype}")
        return rows
    return as_bf16(rows).astype(np.float32)


def combine_rows(rows_per_rank, topk_ids_per_rank, cfg: EPConfig, node_size: int = 0):
    """Combine in the compact layout: rank ``r`` returns, for each token it received, one row
    (its own partial, already weighted and reduced over its experts: bf16, or float32 with
    ``cfg.combine_dtype == "float32"``).

    Parameters
    ----------
    rows_per_rank : list of [R * T, hidden] bfloat16 (or uint16 bits), or float32 with
        ``combine_dtype="float32"``; row ``s * T + t`` of rank ``r`` is its partial for token t
        of rank s (read only where that token went to r).
    topk_ids_per_rank : list of [T_s, top_k] int (the routing passed to dispatch).

    Returns
    -------
    list of [T_s, hidden] bfloat16: per home rank, the float32 sum from 0, in rank order, of the
    partials of the ranks each token went to, rounded to bfloat16 (with ``node_size``, in the
    hierarchical order of :func:`combine`).
    """
    R, L, T = cfg.n_ranks, cfg.n_local_experts, cfg.max_tokens_per_rank
    wire = partial_wire_dtype(cfg)
    outs = []
    for s in range(R):
        ids = routed_ids(topk_ids_per_rank[s], cfg.n_experts)
        n = ids.shape[0]
        went = [np.any(ids // L == r, axis=1) for r in range(R)]
        terms = [partial_rows_f32(rows_per_rank[r], cfg)[s * T:s * T + n].astype(wire) for r in range(R)]
        outs.append(sum_home(terms, went, s, wire, node_size))
    return outs


@dataclass
class DenseRowsRef:
    """One rank's dense rows (the dense layout: DeepEP's normal-mode received rows).

    Attributes
    ----------
    x : [rows, hidden] bfloat16 (a quantized format's codes, as :func:`receive_rows`): one row per
        received (token, source rank), source rank ascending, then the source's token order
    topk_idx : [rows, top_k] int32, the local expert of each slot (its routed id - r L), or -1
        where the routed id is masked or on another rank
    topk_weights : [rows, top_k] float32, the slot's weight, 0 where ``topk_idx`` is -1
    slot : [rows] int32, ``s * T + t`` of each row (T = ``max_tokens_per_rank``)
    slot_row : [R, T] int32, the row of token t of rank s, -1 where it did not come
    source_rows : [R] int32, the rows from each source rank
    scales, global_scales : a quantized format's rows' scales ``[rows, S]`` and NVFP4's global
        scales ``[rows]`` (else None)
    """

    x: np.ndarray
    topk_idx: np.ndarray
    topk_weights: np.ndarray
    slot: np.ndarray
    slot_row: np.ndarray
    source_rows: np.ndarray
    scales: np.ndarray | None = None
    global_scales: np.ndarray | None = None


def dense(inputs_per_rank, topk_ids_per_rank, topk_weights_per_rank, cfg: EPConfig, token_scales_per_rank=None,
          global_scales_per_rank=None) -> list[DenseRowsRef]:
    """The dense rows of every rank (arguments as :func:`dispatch`): rank ``r`` receives token
    ``t`` of rank ``s`` when a routed id of it is one of ``r``'s experts, as row
    ``prefix(s) + (the rank of t among s's such tokens)``."""
    R, L, T = cfg.n_ranks, cfg.n_local_experts, cfg.max_tokens_per_rank
    fmt = cfg.token_format
    recv = receive_rows(inputs_per_rank, topk_ids_per_rank, cfg, token_scales_per_rank, True,
                        global_scales_per_rank)
    gs = receive_global_scales(inputs_per_rank, topk_ids_per_rank, cfg, global_scales_per_rank) \
        if fmt.has_global_scale else None
    out = []
    for r in range(R):
        x, defined, scales = recv[r]
        idx, wts, slots, per_source = [], [], [], []
        for s in range(R):
            ids = routed_ids(topk_ids_per_rank[s], cfg.n_experts)
            local = (ids >= r * L) & (ids < (r + 1) * L)
            hit = np.flatnonzero(local.any(axis=1))
            idx.append(np.where(local[hit], ids[hit] - r * L, -1).astype(np.int32))
            wts.append(np.where(local[hit], np.asarray(topk_weights_per_rank[s], np.float32)[hit], 0).astype(
                np.float32))
            slots.append((s * T + hit).astype(np.int32))
            per_source.append(len(hit))
        slot = np.concatenate(slots)
        slot_row = np.full(R * T, -1, np.int32)
        slot_row[slot] = np.arange(len(slot), dtype=np.int32)
        K = cfg.top_k
        out.append(DenseRowsRef(x[slot], np.concatenate(idx).reshape(-1, K), np.concatenate(wts).reshape(-1, K), slot,
                                slot_row.reshape(R, T), np.array(per_source, np.int32),
                                scales[slot] if scales is not None else None,
                                gs[r][0][slot] if gs is not None else None))
    return out


def combine_dense(rows_per_rank, dense_per_rank: list[DenseRowsRef], topk_ids_per_rank, cfg: EPConfig,
                  node_size: int = 0):
    """Combine in the dense layout: rank ``r``'s ``rows_per_rank[r]`` ``[>= rows, hidden]`` holds
    its partial for each of its dense rows (already combined over its experts; bf16 or float32
    as :func:`combine_rows`); each token sums them home as :func:`combine_rows` does."""
    R, T = cfg.n_ranks, cfg.max_tokens_per_rank
    compact = []
    for r in range(R):
        rows, slot = np.asarray(rows_per_rank[r]), dense_per_rank[r].slot
        c = np.zeros((R * T,) + rows.shape[1:], rows.dtype)
        c[slot] = rows[:len(slot)]
        compact.append(c)
    return combine_rows(compact, topk_ids_per_rank, cfg, node_size)


def combine_tolerance(topk_weights: np.ndarray, expert_out_abs_max: float,
                      combine_dtype: str = "bfloat16") -> np.ndarray:
    """Per-token absolute tolerance of a kernel's combine against :func:`combine`.

    The kernel and the reference add the same terms in the same order; they may differ by
    fused multiply-add contraction (one float32 rounding per term). With S = ``sum_k |w_k| *
    max|y|``:

    - ``"bfloat16"``: the difference can flip a bf16 rounding of the partial and of the
      output: at most 2 bf16 ulps of the largest magnitude, ``2 * 2**-7 * S``;
    - ``"float32"``: the partials are not rounded, so the float32 sums differ by at most
      ``2 * (2K + 1)`` float32 roundings of at most ``2**-24 * S`` each (the 2K + 1 products
      and sums a term passes through, K = top_k, counted for both sides), bounded by
      ``K * 2**-21 * S``, and the output's bf16 rounding can flip once, 1 bf16 ulp,
      ``2**-7 * S``: ``(2**-7 + K * 2**-21) * S``.

    Shape ``[T, 1]``, float32. On the simulator (no FMA) the kernels match exactly in both modes.
    """
    w = np.abs(np.asarray(topk_weights, np.float32))
    S = w.sum(axis=1, keepdims=True) * np.float32(expert_out_abs_max)
    if combine_dtype == "float32":
        return ((2.0**-7 + w.shape[1] * 2.0**-21) * S).astype(np.float32)
    return (2.0 * 2.0**-7 * S).astype(np.float32)


def combine_exact(expert_out_per_rank, batches: list[ExpertBatchRef], topk_ids_per_rank, cfg: EPConfig,
                  absolute: bool = False):
    """The exact combine in float64, per home rank ``[T_s, hidden]``: ``sum_k w_k * y_k`` over
    each token's experts (float32 weights times bf16 outputs are exact in float64; the sum of K
    such terms is within 2**-52 relative). ``absolute``: ``sum_k |w_k * y_k|`` instead, the
    scale :func:`combine_error_bound` uses. Arguments as in :func:`combine`."""
    parts = partial_sums([np.abs(as_bf16(y).astype(np.float64)) if absolute else y for y in expert_out_per_rank],
                         [_abs_weights(b) for b in batches] if absolute else batches, topk_ids_per_rank, cfg,
                         np.float64)
    return [sum(parts[r][s] for r in range(cfg.n_ranks)) for s in range(cfg.n_ranks)]


def _abs_weights(b: ExpertBatchRef) -> ExpertBatchRef:
    return ExpertBatchRef(**{**b.__dict__, "weight": np.abs(b.weight)})


#: bf16 and float32 unit roundoffs (half an ulp at 1: 8 and 24 significant bits).
U_BF16, U_F32 = 2.0**-8, 2.0**-24


def combine_error_bound(exact: np.ndarray, abs_terms: np.ndarray, top_k: int, combine_dtype: str) -> np.ndarray:
    """Elementwise bound on ``|combine output - exact|`` (float64; ``exact`` and ``abs_terms``
    from :func:`combine_exact`, S = ``abs_terms`` = ``sum_k |w_k y_k|``), for the kernels (FMA
    contraction or not) and the reference:

    - every term passes through at most 2K + 1 float32 roundings (its product, the sums of its
      rank's partial, the sums at home), so the float32 value v before the output's rounding
      is within ``(2K + 1) * U_F32 * S`` (times 1 + O(K U_F32)) of the sum of what was rounded;
      ``K * 2**-22 * S = 4 K U_F32 S`` covers it with room for those factors;
    - ``"bfloat16"`` partials: each partial p_r is rounded, ``|bf16(p_r) - p_r| <= U_BF16 *
      |p_r|``, and ``sum_r |p_r| <= S (1 + ...)``: ``U_BF16 * (1 + 2**-6) * S`` (the
      ``2**-6`` covers the output rounding of these errors, U_BF16 * U_BF16 * S, and the float32
      factors);
    - the output's bf16 rounding: ``U_BF16 * |v| <= U_BF16 * |exact|`` plus ``U_BF16`` times the
      errors above (inside their margins).

    So ``"float32"``: ``U_BF16 |exact| + K 2**-22 S`` (only the output rounding is relative to the
    result; cancellation between ranks costs nothing), and ``"bfloat16"``: that plus
    ``U_BF16 (1 + 2**-6) S`` (each partial's rounding is relative to the partial, which can be
    far larger than the result). Subnormal results are not covered (not reached by the tests).
    """
    bound = U_BF16 * np.abs(exact) + top_k * 2.0**-22 * abs_terms
    if combine_dtype == "bfloat16":
        bound = bound + U_BF16 * (1 + 2.0**-6) * abs_terms
    return bound
