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

from ep_runtime.core.errors import EPConfigError
from ep_runtime.kernels.protocol import relay_chunk_tokens


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


@dataclass(frozen=True)
class NodeTraffic:
    """What one rank moves in one call (a dispatch and its combine) under the hierarchical
    transport (ep_runtime/kernels/relay.py), by direction: ``across_out`` / ``across_in`` bytes to and from
    PEs of other nodes (only this rank's proxies there: what its NIC carries), ``within_out`` /
    ``within_in`` to and from the other PEs of its node (NVLink), ``ops_across``: the NVSHMEM
    operations it issues across nodes (each serviced by a CPU proxy there), ``rows_across``: its
    token rows sent across. :func:`pair_bytes` says what goes from one PE to another."""

    across_out: int
    across_in: int
    within_out: int
    within_in: int
    ops_across: int
    rows_across: int


def _tokens_on(ids, s: int, pes, n_local_experts: int) -> int:
    """Tokens of rank ``s`` (``ids[s]``, [T_s, K]; -1 masks a slot) with an expert on one of the PEs ``pes``."""
    x = np.asarray(ids[s])
    return int(np.isin(np.where(x >= 0, x // n_local_experts, -1), list(pes)).any(axis=1).sum()) if x.size else 0


def pair_bytes(ids, src: int, dst: int, n_local_experts: int, node_size: int, token_bytes: int,
               partial_bytes: int, slot_bytes: int | None = None) -> int:
    """Bytes PE ``src`` puts and signals to PE ``dst`` (not itself) in one call under the
    hierarchical transport, ``ids`` every rank's ``[T_s, K]`` ids (-1: a masked slot); ``N`` =
    ``node_size`` PEs a node, ``L`` experts a PE; a row src sends from its tokens is
    ``token_bytes``, a row packed in a chunk or forwarded by a proxy a whole slot
    (``slot_bytes``, ``EPConfig.slot_bytes``: FP8 messages with their padding; default
    ``token_bytes``):

    - same node: src's routing rows (ids, weights, ranks: ``12 T K``), its rows with an expert
      on dst, dst's counts row with the signal (``4 (L + 1)``) and two 8-byte credit grants; as
      the proxy of each source s on another node (its local index), s's routing rows, s's rows
      with an expert on dst and dst's counts row; src's partials of dst's tokens, and of the
      other nodes' tokens whose proxy here is dst;
    - dst on another node with src's local index (each is the other's proxy): src's routing rows,
      its rows with an expert on dst's node, that node's counts rows with the signal (``4 N (L +
      1)``) and two grants; and, as dst's proxy, one partial per token of dst with an expert on
      src's node (the node's sum);
    - any other PE: nothing.
    """
    N, L = node_size, n_local_experts
    K = max(np.asarray(i).shape[1] for i in ids)
    counts_row = 4 * (L + 1)
    slot = token_bytes if slot_bytes is None else slot_bytes

    def hits(s, pes):
        return _tokens_on(ids, s, pes, L)

    def routing(s):
        return 12 * np.asarray(ids[s]).shape[0] * K

    if src == dst:
        return 0
    node_of = lambda p: p // N  # noqa: E731
    nodes = range(len(ids) // N)
    if node_of(src) == node_of(dst):
        out = routing(src) + hits(src, [dst]) * token_bytes + counts_row + 16 + hits(dst, [src]) * partial_bytes
        for node in nodes:
            if node != node_of(src):
                s = node * N + src % N  # a source src is the proxy of
                out += routing(s) + hits(s, [dst]) * slot + counts_row
                home = node * N + dst % N  # a home whose proxy here is dst
                out += hits(home, [src]) * partial_bytes
        return out
    if src % N != dst % N:
        return 0
    here = range(node_of(src) * N, node_of(src) * N + N)
    there = range(node_of(dst) * N, node_of(dst) * N + N)
    return (routing(src) + hits(src, there) * slot + N * counts_row + 16
            + hits(dst, here) * partial_bytes)


def _chunks_on(ids, s: int, pes, n_local_experts: int) -> int:
    """Chunks of rank ``s``'s batch (``relay_chunk_tokens(T_s)`` consecutive tokens each) with a
    token on one of the PEs ``pes``: the puts that carry its rows to those PEs' node (or their
    sums home)."""
    x = np.asarray(ids[s])
    if not x.size:
        return 0
    hit = np.isin(np.where(x >= 0, x // n_local_experts, -1), list(pes)).any(axis=1)
    return int(np.add.reduceat(hit, np.arange(0, len(hit), relay_chunk_tokens(len(hit)))).astype(bool).sum())


def pair_ops(ids, src: int, dst: int, n_local_experts: int, node_size: int) -> int:
    """NVSHMEM operations PE ``src`` issues to PE ``dst`` of another node in one call under the
    hierarchical transport (0 unless each is the other's proxy): src's routing rows, weights
    and ranks in a put each (when src has tokens), the counts rows with the relay signal, two
    credit grants, one put per chunk of src's tokens bound for dst's node (packed;
    ``relay_chunk_tokens`` tokens a chunk), and, as dst's proxy, one per chunk of dst's tokens with an expert
    on src's node (their sums). Whatever the grid: the same count on the simulator and a GPU."""
    N, L = node_size, n_local_experts
    if src // N == dst // N or src % N != dst % N:
        return 0
    here = range((src // N) * N, (src // N) * N + N)
    there = range((dst // N) * N, (dst // N) * N + N)
    routing = 3 if np.asarray(ids[src]).shape[0] else 0
    return routing + 1 + 2 + _chunks_on(ids, src, there, L) + _chunks_on(ids, dst, here, L)


def node_traffic(ids_per_rank, rank: int, n_local_experts: int, node_size: int, token_bytes: int,
                 partial_bytes: int, slot_bytes: int | None = None) -> NodeTraffic:
    """:class:`NodeTraffic` of ``rank`` for one call (:func:`pair_bytes` and :func:`pair_ops`
    over its peers)."""
    R, N, L = len(ids_per_rank), node_size, n_local_experts

    def pb(a, b):
        return pair_bytes(ids_per_rank, a, b, L, N, token_bytes, partial_bytes, slot_bytes)

    mine = [p for p in range(R) if p // N == rank // N and p != rank]
    proxies = [p for p in range(R) if p // N != rank // N and p % N == rank % N]
    rows = sum(_tokens_on(ids_per_rank, rank, range((p // N) * N, (p // N) * N + N), L) for p in proxies)
    return NodeTraffic(across_out=sum(pb(rank, p) for p in proxies), across_in=sum(pb(p, rank) for p in proxies),
                       within_out=sum(pb(rank, q) for q in mine), within_in=sum(pb(q, rank) for q in mine),
                       ops_across=sum(pair_ops(ids_per_rank, rank, p, L, N) for p in proxies),
                       rows_across=rows)


def random_top_k(rng, tokens: int, n_experts: int, top_k: int) -> np.ndarray:
    """One rank's uniform random routing: each token's ``top_k`` distinct experts of
    ``n_experts``, the experts of its ``top_k`` smallest of ``n_experts`` uniform draws in
    ascending order of their draws. [tokens, top_k] int64. A partial selection, not a sort of every
    row, so a projection of a thousand ranks with an expert each takes seconds."""
    draws = rng.random((tokens, n_experts))
    chosen = np.argpartition(draws, top_k - 1, axis=1)[:, :top_k]
    order = np.argsort(np.take_along_axis(draws, chosen, axis=1), axis=1)
    return np.take_along_axis(chosen, order, axis=1).astype(np.int64)


def project_nodes(nodes: int, gpus: int, tokens: int, hidden: int = 7168, n_experts: int = 256, top_k: int = 8,
                  nic_gbps: float = 400.0, nvlink_gbs: float = 380.0, proxy_op_us: float = 1.0,
                  seed: int = 0) -> dict:
    """The traffic model's projection for one rank of ``nodes`` x ``gpus`` GPUs, bf16 tokens and
    partials, ``tokens`` per GPU routed uniformly at random to ``top_k`` of ``n_experts`` (one
    draw of ``seed``, :func:`random_top_k`; ``n_experts`` a multiple of the ranks, else
    EPConfigError): :func:`node_traffic`'s bytes and operations, and the times they bound
    (us) for a NIC of ``nic_gbps`` Gb/s per GPU, NVLink at ``nvlink_gbs`` GB/s per direction and
    a CPU proxy that services one operation in ``proxy_op_us``; the call (a dispatch and its
    combine) takes at least the largest."""
    R = nodes * gpus
    if n_experts < R or n_experts % R:
        raise EPConfigError(f"project_nodes: n_experts={n_experts} for {nodes} x {gpus} = {R} ranks: expected a "
                         f"multiple of {R} (every rank holds the same number of experts); pass n_experts={R} "
                         f"(one expert a rank) or another multiple of {R}")
    rng, L = np.random.default_rng(seed), n_experts // R
    ids = [random_top_k(rng, tokens, n_experts, top_k) for _ in range(R)]
    t = node_traffic(ids, 0, L, gpus, 2 * hidden, 2 * hidden)
    nic_us = max(t.across_out, t.across_in) / (nic_gbps / 8 * 1e3)  # bytes / (GB/s) = ns; / 1e3 = us
    return {"ranks": R, "across_out": t.across_out, "across_in": t.across_in, "within_out": t.within_out,
            "within_in": t.within_in, "ops_across": t.ops_across, "rows_across": t.rows_across, "nic_us": nic_us,
            "proxy_us": t.ops_across * proxy_op_us,
            "nvlink_us": max(t.within_out, t.within_in) / (nvlink_gbs * 1e3)}


def main(argv=None) -> None:
    """``python -m ep_runtime.tools.bench.traffic``: the projection table of docs/cluster.md."""
    import argparse

    ap = argparse.ArgumentParser(description="The hierarchical transport's traffic model (docs/cluster.md)")
    ap.add_argument("--shapes", nargs="+", default=["2x8", "4x8"], help="NODESxGPUS")
    ap.add_argument("--tokens", type=int, nargs="+", default=[128, 4096])
    ap.add_argument("--proxy-op-us", type=float, default=1.0)
    ap.add_argument("--nic-gbps", type=float, default=400.0)
    ap.add_argument("--experts", type=int, default=256, help="experts of the layer, a multiple of every shape's ranks")
    args = ap.parse_args(argv)
    print(f"| nodes x GPUs | tokens/GPU | MB across out / in (NIC) | MB within out / in (NVLink) | ops across "
          f"| NIC us | proxy us at {args.proxy_op_us:g} us/op | NVLink us |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for shape in args.shapes:
        nodes, gpus = (int(x) for x in shape.split("x"))
        for T in args.tokens:
            p = project_nodes(nodes, gpus, T, n_experts=args.experts, nic_gbps=args.nic_gbps,
                              proxy_op_us=args.proxy_op_us)
            print(f"| {shape} | {T} | {p['across_out'] / 1e6:.2f} / {p['across_in'] / 1e6:.2f} | "
                  f"{p['within_out'] / 1e6:.2f} / {p['within_in'] / 1e6:.2f} | {p['ops_across']} | "
                  f"{p['nic_us']:.0f} | {p['proxy_us']:.0f} | {p['nvlink_us']:.0f} |")


if __name__ == "__main__":
    main()
