"""Bytes one rank moves in one dispatch and one combine (pure NumPy, CPU-testable).

From the routing of every rank, for rank ``r`` (``H`` hidden, ``K`` top-k; a token on the wire
and in the receive buffer is ``token_bytes``: ``2 H`` in bf16, the codes and scales of a
message in an FP8 format (``EPConfig.token_bytes``: its padding is never sent); expert outputs
and combine results are bf16, ``2 H``; a partial is ``partial_bytes``: ``2 H`` with bf16
partials, ``4 H`` with ``combine_dtype="float32"``):

- ``sent[d]``: tokens of ``r`` with at least one expert on rank ``d`` (one message each,
  deduplicated per rank); ``recv[s]``: tokens of ``s`` with an expert on ``r``;
  ``rows``: expert-batch rows of ``r`` (one per (token, local expert)); ``sent_any``: tokens of
  ``r`` with an expert on any rank.
- **logical bytes** (DeepEP's definition): every received token row, the rank's own included,
  ``sum(recv) * token_bytes``.
- **NVLink bytes** per direction: rows to and from the other ranks, plus the routing tables
  (``8K`` bytes per token to every other rank); the larger direction bounds the time.
- **HBM bytes** (device-memory reads and writes of the expanded path, each byte counted once,
  as the kernels move it): dispatch: the sender reads each of its tokens that goes anywhere
  once (``sent_any`` input rows of ``input_bytes``, one read serving every destination: bf16
  rows, ``2 H``, whatever the format when the bench passes bf16 tokens, quantized in
  dispatch_async for FP8; a pre-quantized FP8 input is its codes and scales, ``token_bytes``),
  the receive buffer is written
  (``sum(recv)`` rows), and the expansion copy reads each received row once and writes one batch
  row per batch row (``sum(recv) + rows``: token-major, dispatch_copy or dispatch_land);
  combine: reads the expert outputs (``rows``, bf16), the partials of this rank's tokens are
  written here (its own by combine_async, the peers' through NVLink: ``sum(sent)``) and read
  by combine_wait, which writes ``T`` bf16 rows. Combine's NVLink bytes are partials. (Reading
  a received row once per batch row, or counting staged partials that the stores path does not
  stage, would overstate the expanded dispatch's bytes and make its %floor read high:
  docs/plans.md.)
- **HBM bytes of the compact layout** (``layout="compact"``: no expansion copy, the caller's
  combine input is one row per received token): dispatch: the sender reads its tokens
  (``sent_any`` input rows) and the receive buffer is written (``sum(recv)`` rows); combine: the
  caller's rows (partials) are read (``sum(recv)``: the peers' by combine_async, this rank's own
  by combine_wait, in place), the peers' partials land (``sum(sent) - sent[r]``), combine_wait
  reads them and writes ``T`` bf16 rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Traffic:
    """Per-rank byte counts of one call (see the module docstring)."""

    tokens: int
    rows: int
    sent: tuple[int, ...]
    recv: tuple[int, ...]
    logical_bytes: int
    dispatch_nvlink_bytes: int
    combine_nvlink_bytes: int
    dispatch_hbm_bytes: int
    combine_hbm_bytes: int
    compact_dispatch_hbm_bytes: int
    compact_combine_hbm_bytes: int
    #: a slot return (``EPRuntime.slot_values``): 4 bytes per row, home from the rows' ranks
    slot_nvlink_bytes: int = 0
    #: a dispatch with a kept routing (``dispatch_async(tokens, routing=kept)``): the token rows
    #: without the routing rows
    kept_dispatch_nvlink_bytes: int = 0

    def hbm_bytes(self, phase: str, layout: str = "expanded") -> int:
        """Device-memory bytes of ``phase`` ("dispatch" or "combine") in ``layout``."""
        return getattr(self, f"{'compact_' if layout == 'compact' else ''}{phase}_hbm_bytes")


def rank_traffic(ids_per_rank, rank: int, n_local_experts: int, hidden: int, token_bytes: int | None = None,
                 partial_bytes: int | None = None, input_bytes: int | None = None) -> Traffic:
    """Byte counts for ``rank`` given every rank's ``[T_s, K]`` expert ids; ``token_bytes``:
    one dispatched token (default ``2 * hidden``, bf16; ``EPConfig.token_bytes`` in general);
    ``partial_bytes``: one combine partial (default ``2 * hidden``, bf16;
    ``EPConfig.partial_bytes`` in general, ``4 * hidden`` with float32 partials);
    ``input_bytes``: one token of dispatch_async's input (default ``2 * hidden``, bf16 tokens;
    ``token_bytes`` for pre-quantized FP8 codes and scales)."""
    R = len(ids_per_rank)
    K = np.asarray(ids_per_rank[0]).shape[1] if R else 0
    row = 2 * hidden  # bf16 rows: expert outputs, results
    tok = row if token_bytes is None else token_bytes
    part = row if partial_bytes is None else partial_bytes
    in_row = row if input_bytes is None else input_bytes

    def hits(ids, d):  # tokens of a rank with an expert on rank d
        ids = np.asarray(ids)
        return int((ids // n_local_experts == d).any(axis=1).sum()) if ids.size else 0

    sent = tuple(hits(ids_per_rank[rank], d) for d in range(R))
    recv = tuple(hits(ids_per_rank[s], rank) for s in range(R))
    rows = sum(int((np.asarray(ids) // n_local_experts == rank).sum()) for ids in ids_per_rank)
    T = np.asarray(ids_per_rank[rank]).shape[0]
    mine = np.asarray(ids_per_rank[rank])
    sent_any = int(((mine >= 0) & (mine < R * n_local_experts)).any(axis=1).sum()) if mine.size else 0
    routing_out = (R - 1) * T * K * 8
    routing_in = sum(np.asarray(ids_per_rank[s]).shape[0] * K * 8 for s in range(R) if s != rank)
    out_rows = sum(sent) - sent[rank]
    in_rows = sum(recv) - recv[rank]
    rows_from_others = sum(int((np.asarray(ids_per_rank[s]) // n_local_experts == rank).sum()) for s in range(R)
                           if s != rank)
    my_slots_elsewhere = int(((mine >= 0) & (mine < R * n_local_experts) & (mine // n_local_experts != rank)).sum()) \
        if mine.size else 0
    return Traffic(
        tokens=T, rows=rows, sent=sent, recv=recv,
        logical_bytes=sum(recv) * tok,
        dispatch_nvlink_bytes=max(out_rows * tok + routing_out, in_rows * tok + routing_in),
        combine_nvlink_bytes=max(in_rows, out_rows) * part,
        dispatch_hbm_bytes=sent_any * in_row + (2 * sum(recv) + rows) * tok,
        combine_hbm_bytes=(rows + T) * row + 2 * sum(sent) * part,
        compact_dispatch_hbm_bytes=sent_any * in_row + sum(recv) * tok,
        compact_combine_hbm_bytes=T * row + (sum(recv) + 2 * out_rows) * part,
        slot_nvlink_bytes=4 * max(rows_from_others, my_slots_elsewhere),
        kept_dispatch_nvlink_bytes=max(out_rows, in_rows) * tok,
    )


def nccl_permutation(ids_per_rank, rank: int, n_local_experts: int) -> np.ndarray:
    """Rows of an all-to-all receive buffer (one row per (token, destination rank): source
    ranks in order, each source's tokens that hit ``rank`` in token order) to gather, in
    order, to build ``rank``'s expert-major batch (local expert, source rank, source token).
    [rows] int64."""
    R, L = len(ids_per_rank), n_local_experts
    base, positions = 0, []
    for s in range(R):
        ids = np.asarray(ids_per_rank[s])
        mine = ids // L == rank                       # [T_s, K]
        hit = mine.any(axis=1) if ids.size else np.zeros(0, bool)
        slot = np.cumsum(hit) - 1 + base              # buffer row of each hitting token
        positions.append((ids, mine, slot))
        base += int(hit.sum())
    perm = []
    for e_local in range(L):
        e = rank * L + e_local
        for ids, _, slot in positions:
            t = np.nonzero((ids == e).any(axis=1))[0] if ids.size else np.zeros(0, np.int64)
            perm.append(slot[t])
    return np.concatenate(perm).astype(np.int64) if perm else np.zeros(0, np.int64)
