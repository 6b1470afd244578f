"""How fast the expanded layout's copy runs, in three loop shapes (one GPU, no NVSHMEM):

    python3 tests/gpu/copy_probe.py [--tokens 128 4096] [--ranks 2] [--hidden 7168]

Why: at decode sizes the expanded dispatch's copy ran far slower than a device copy of the same
bytes (docs/plans.md, "The expanded copy at decode sizes"). The copy reads each received
row once and stores it to the token's local expert rows. This script times the copy alone,
on received rows laid out as the runtime lays them (``R`` sources of ``T`` tokens, top-k of
``E`` experts, rank 0's ``E / R`` local experts, rows expert-major in (source, token) order),
in three loop shapes over warp items (a part of a row, ``ep_runtime/kernels/block.py``'s ``row_parts``):

- ``per_source``: the shape of ``expand_rows`` before this probe: a pass per source, each
  item reading the token's ids, then counting its local experts, then reading its rows' indices
  and the row (four dependent loads a pass);
- ``flat``: one pass over every source's items; each item issues the row's first loads, its
  ids and its first rows' indices together, then stores;
- ``by_row``: a warp per part of an expert row: the row's source slot (``row_gather``), then
  the row (each received row read once per local expert; the repeats hit L2).

Each shape with ``--pairs`` word pairs per lane in flight; a grid of one 512-thread block per
SM. CUDA events around each launch, queued behind a device spin so that the host's launch stays
outside them; median of ``--samples``. A device-to-device copy of the expanded rows' bytes is
the ceiling of the same run. Every shape's output is checked against NumPy's gather first.
Prints a table last. Measures only.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import harness
import numpy as np

THREADS = 512
#: Registers a thread may use so that a 512-thread block launches (64 K registers an SM).
MAX_REGISTERS = 128
#: Rows preloaded per item by the ``flat`` shape (a token's local experts beyond it are read
#: in the store loop).
ROWS_AHEAD = 8


def make_kernels(pairs: int, warp: int = 32):
    """The three shapes' kernels with ``pairs`` word pairs per lane in flight."""
    from numba import int32, uint64

    from ep_runtime.kernels.cuda_api import cuda

    from ep_runtime.kernels.block import local_expert_count, part_bounds, part_words, row_parts
    from ep_runtime.kernels.vec import make_pair_loops

    load_p, store_p, _ = make_pair_loops(pairs, warp)
    warps = THREADS // warp

    @cuda.jit(max_registers=MAX_REGISTERS)
    def per_source(d_tokens, d_ids, counts, token_rows, expert_x, me, L):
        lo = cuda.local.array(pairs, uint64)
        hi = cuda.local.array(pairs, uint64)
        lane = cuda.threadIdx.x % warp
        first_warp = cuda.blockIdx.x * warps + cuda.threadIdx.x // warp
        all_warps = cuda.gridDim.x * warps
        W = expert_x.shape[1]
        for s in range(d_tokens.shape[0]):
            T_s = counts[s]
            parts = row_parts(T_s, W, all_warps, warp)
            span = part_words(W, parts, warp)
            i = first_warp
            while i < T_s * parts:
                t, w0, w1 = part_bounds(i, parts, span, W)
                n_local = local_expert_count(d_ids[s, t], L, me)
                rows = token_rows[s, t]
                w = w0 + 2 * lane
                while w < w1:
                    load_p(d_tokens[s, t], w, w1, lo, hi)
                    for j in range(n_local):
                        store_p(expert_x[rows[j]], w, w1, lo, hi)
                    w += 2 * pairs * warp
                i += all_warps

    @cuda.jit(max_registers=MAX_REGISTERS)
    def flat(d_tokens, d_ids, counts, token_rows, expert_x, me, L):
        lo = cuda.local.array(pairs, uint64)
        hi = cuda.local.array(pairs, uint64)
        ahead = cuda.local.array(ROWS_AHEAD, int32)
        lane = cuda.threadIdx.x % warp
        first_warp = cuda.blockIdx.x * warps + cuda.threadIdx.x // warp
        all_warps = cuda.gridDim.x * warps
        W = expert_x.shape[1]
        R = d_tokens.shape[0]
        K = d_ids.shape[2]
        Q = 0
        for s in range(R):
            Q += counts[s]
        parts = row_parts(Q, W, all_warps, warp)
        span = part_words(W, parts, warp)
        i = first_warp
        while i < Q * parts:
            q, w0, w1 = part_bounds(i, parts, span, W)
            s = 0
            t = q
            while t >= counts[s]:
                t -= counts[s]
                s += 1
            src = d_tokens[s, t]
            rows = token_rows[s, t]
            w = w0 + 2 * lane
            load_p(src, w, w1, lo, hi)  # issued before the ids and rows: one latency for all
            for j in range(ROWS_AHEAD):
                if j < K:
                    ahead[j] = rows[j]
            n_local = local_expert_count(d_ids[s, t], L, me)
            while w < w1:
                for j in range(ROWS_AHEAD):
                    if j < n_local:
                        store_p(expert_x[ahead[j]], w, w1, lo, hi)
                for j in range(ROWS_AHEAD, n_local):
                    store_p(expert_x[rows[j]], w, w1, lo, hi)
                w += 2 * pairs * warp
                if w < w1:
                    load_p(src, w, w1, lo, hi)
            i += all_warps

    @cuda.jit(max_registers=MAX_REGISTERS)
    def by_row(d_tokens, row_gather, n_rows, expert_x):
        lo = cuda.local.array(pairs, uint64)
        hi = cuda.local.array(pairs, uint64)
        lane = cuda.threadIdx.x % warp
        first_warp = cuda.blockIdx.x * warps + cuda.threadIdx.x // warp
        all_warps = cuda.gridDim.x * warps
        W = expert_x.shape[1]
        Tmax = d_tokens.shape[1]
        parts = row_parts(n_rows, W, all_warps, warp)
        span = part_words(W, parts, warp)
        i = first_warp
        while i < n_rows * parts:
            r, w0, w1 = part_bounds(i, parts, span, W)
            gsrc = row_gather[r]
            s = gsrc // Tmax
            src = d_tokens[s, gsrc - s * Tmax]
            w = w0 + 2 * lane
            while w < w1:
                load_p(src, w, w1, lo, hi)
                store_p(expert_x[r], w, w1, lo, hi)
                w += 2 * pairs * warp
            i += all_warps

    return per_source, flat, by_row


def layout(R, T, E, K, seed=1):
    """Rank 0's received routing and placement: ids [R, T, K] int32, token_rows [R, T, K]
    int32 (row of the j-th local expert of token (s, t)), row_gather [C] int32 (s * T + t),
    C rows (expert-major, (source, token) order within an expert)."""
    rng = np.random.default_rng(seed)
    L = E // R
    ids = np.stack([[rng.choice(E, size=K, replace=False) for _ in range(T)] for _ in range(R)]).astype(np.int32)
    local = [(s, t, k, int(ids[s, t, k])) for s in range(R) for t in range(T) for k in range(K) if ids[s, t, k] < L]
    local.sort(key=lambda x: (x[3], x[0], x[1]))
    token_rows = np.full((R, T, K), -1, np.int32)
    fill = np.zeros((R, T), np.int32)
    row_gather = np.empty(len(local), np.int32)
    order = sorted(range(len(local)), key=lambda r: (local[r][0], local[r][1], local[r][2]))
    for r, (s, t, _, _) in enumerate(local):
        row_gather[r] = s * T + t
    for r in order:  # a token's rows in k order, as the placement lists them
        s, t = local[r][0], local[r][1]
        token_rows[s, t, fill[s, t]] = r
        fill[s, t] += 1
    return ids, token_rows, row_gather, L


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    harness.add_layer_options(ap, tokens=(128, 4096))
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--pairs", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--samples", type=int, default=50)
    args = ap.parse_args()

    import cupy
    from numba import cuda as numba_cuda

    from ep_runtime.tools.bench.measure import DeviceSpin

    stream = cupy.cuda.Stream(non_blocking=True)
    nb_stream = numba_cuda.external_stream(int(stream.ptr))
    sms = cupy.cuda.runtime.getDeviceProperties(0)["multiProcessorCount"]
    spin = DeviceSpin(stream, 300.0)
    kernels = {p: make_kernels(p) for p in args.pairs}
    W = args.hidden // 4  # bf16 rows as uint64 words
    table = []

    def timed(launch):
        out = []
        for _ in range(args.samples + 3):
            spin()
            a, b = cupy.cuda.Event(), cupy.cuda.Event()
            a.record(stream)
            launch()
            b.record(stream)
            b.synchronize()
            out.append(cupy.cuda.get_elapsed_time(a, b) * 1e3)
        return statistics.median(out[3:])

    for T in args.tokens:
        R = args.ranks
        ids, token_rows, row_gather, L = layout(R, T, args.experts, args.top_k)
        C = row_gather.size
        rng = np.random.default_rng(7)
        tokens_h = rng.integers(0, 1 << 62, size=(R, T, W), dtype=np.uint64)
        want = tokens_h.reshape(R * T, W)[row_gather]
        d_tokens, d_ids = cupy.asarray(tokens_h), cupy.asarray(ids)
        d_rows, d_gather = cupy.asarray(token_rows), cupy.asarray(row_gather)
        counts = cupy.asarray(np.full(R, T, np.int32))
        expert_x = cupy.zeros((C, W), np.uint64)
        moved = C * W * 8 + R * T * W * 8  # written + read once
        with stream:
            scratch = cupy.empty_like(expert_x)
            src_flat = cupy.ones((C, W), np.uint64)
        ceiling = timed(lambda: scratch.data.copy_from_device_async(src_flat.data, src_flat.nbytes, stream=stream))
        table.append((T, C, "device copy (ceiling)", "-", ceiling, 2 * C * W * 8 / ceiling / 1e3))
        for p, (per_source, flat, by_row) in kernels.items():
            shapes = {
                "per_source": lambda: per_source[sms, THREADS, nb_stream](d_tokens, d_ids, counts, d_rows, expert_x,
                                                                          0, L),
                "flat": lambda: flat[sms, THREADS, nb_stream](d_tokens, d_ids, counts, d_rows, expert_x, 0, L),
                "by_row": lambda: by_row[sms, THREADS, nb_stream](d_tokens, d_gather, C, expert_x),
            }
            for name, launch in shapes.items():
                expert_x.fill(0)
                launch()
                stream.synchronize()
                if not np.array_equal(cupy.asnumpy(expert_x), want):
                    print(f"copy_probe: {name} (pairs {p}) at T={T} copied wrong rows")
                    return 1
                us = timed(launch)
                table.append((T, C, name, p, us, moved / us / 1e3))
    print(f"one GPU, {sms} SMs, {THREADS}-thread blocks; {args.ranks} sources, top-{args.top_k} of "
          f"{args.experts}, hidden {args.hidden} bf16; median of {args.samples} (us)")
    print(f"{'T':>5} {'rows':>6} {'shape':<22} {'pairs':>5} {'us':>8} {'GB/s':>7}")
    for T, C, name, p, us, gbs in table:
        print(f"{T:>5} {C:>6} {name:<22} {p!s:>5} {us:>8.2f} {gbs:>7.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
