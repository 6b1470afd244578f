"""One CUDA graph, captured once at capacity, serving every batch size (run on the GPU machine):

    mpirun -np 2 -x PYTHONPATH python3 tests/gpu/graph_check.py [--capacity 256] [--replays 100]
        [--layout expanded|compact]

Captures dispatch_async(n_tokens=<device scalar>) -> dispatch_wait -> (expert compute: the
identity expert, a CuPy copy of the expanded batch, or with ``--layout compact`` a CuPy gather
of the compact batch's rows by its ``gather`` index, as a gathering GEMM reads them) ->
combine_async -> combine_wait once, with capacity-sized input buffers. The compact batch's
``x`` is the receive buffer itself: every replay must gather that replay's rows from the memory
the capture saw (one buffer for every call, guarded by credits: docs/protocol.md). Each replay writes new tokens, routing and weights into those buffers and a new token
count into the device scalar (counts vary by rank and replay: 0, 1, capacity and random ones),
replays the graph, and checks the expert batch exactly and the combine output within
``reference.combine_tolerance`` against the NumPy reference of that step. Rows past the count
hold the previous step's data (decoys: sending one would add rows). Prints a table, then PASS
or FAIL.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np


def step_counts(R: int, cap: int, i: int, rng) -> list[int]:
    """Tokens per rank at replay ``i``: 0, 1 and ``cap`` appear early, then random counts."""
    fixed = {0: [0] + [cap] * (R - 1), 1: [1] * R, 2: [cap] * R, 3: [cap] + [0] * (R - 1)}
    return fixed.get(i, [int(c) for c in rng.integers(0, cap + 1, R)])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--capacity", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--replays", type=int, default=100)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--layout", choices=("expanded", "compact"), default="expanded")
    args = ap.parse_args()

    import cupy
    from mpi4py import MPI

    from ep_runtime import EPConfig, EPRuntime, reference
    from ep_runtime.layout import BufferLayout
    from ep_runtime.shmem import open_session
    from ep_runtime.testing import make_inputs

    comm = MPI.COMM_WORLD
    R, cap = comm.Get_size(), args.capacity
    cfg = EPConfig(n_ranks=R, n_experts=args.experts, top_k=args.top_k, hidden=args.hidden,
                   max_tokens_per_rank=cap)
    session = open_session("nvshmem", heap_bytes=BufferLayout(cfg).symmetric_bytes)
    rt = EPRuntime(cfg, session)
    me, stream = session.rank, session.stream
    failures = []

    tok = cupy.zeros((cap, cfg.hidden), cupy.uint16)
    tid = cupy.zeros((cap, cfg.top_k), cupy.int32)
    tw = cupy.zeros((cap, cfg.top_k), cupy.float32)
    tid[:] = cupy.arange(cfg.top_k, dtype=cupy.int32)  # any valid routing for the capture
    count = cupy.zeros((1,), cupy.int32)
    y = cupy.zeros((cfg.recv_rows_capacity, cfg.hidden), cupy.uint16)
    out = cupy.zeros((cap, cfg.hidden), cupy.uint16)

    session.barrier()
    stream.begin_capture()
    batch = rt.dispatch_wait(rt.dispatch_async(tok, tid, tw, n_tokens=count), layout=args.layout)
    if args.layout == "compact":  # gather the batch's rows (padding rows: -1 wraps to a row, unused)
        cupy.take(batch.x, batch.gather, axis=0, out=y)
    else:
        cupy.copyto(y, batch.x)  # the identity expert, inside the graph
    rt.combine_wait(rt.combine_async(y, batch.handle), out=out)
    graph = stream.end_capture()

    rng = np.random.default_rng(args.seed)
    good, times, counts_seen = 0, [], set()
    for i in range(args.replays):
        counts = step_counts(R, cap, i, rng)
        counts_seen.update(counts)
        xs, ids, ws = make_inputs(cfg, "random", args.seed * 1000 + i, n_tokens=counts)
        n = counts[me]
        tok[:n] = cupy.asarray(xs[me].view(np.uint16))
        tid[:n] = cupy.asarray(ids[me])
        tw[:n] = cupy.asarray(ws[me])
        count[0] = n
        stream.synchronize()
        session.barrier()
        t0 = time.perf_counter()
        graph.launch(stream)
        stream.synchronize()
        times.append((time.perf_counter() - t0) * 1e6)

        ref_b = reference.dispatch(xs, ids, ws, cfg)
        ref_out = reference.combine([b.x for b in ref_b], ref_b, ids, cfg)
        rows = ref_b[me].n_rows
        ok = bool(np.array_equal(cupy.asnumpy(batch.row_offsets), ref_b[me].row_offsets))
        ok &= bool(np.array_equal(cupy.asnumpy(y[:rows]), ref_b[me].x.view(np.uint16)))
        if args.layout == "compact":
            ok &= bool(np.array_equal(cupy.asnumpy(batch.gather[:rows]), reference.gather_index(ref_b[me], cfg)))
            ok &= bool(np.array_equal(cupy.asnumpy(batch.recv_tokens), np.array(counts, np.int32)))
        for k in ("src_rank", "src_token", "src_k", "weight"):
            ok &= bool(np.array_equal(cupy.asnumpy(getattr(batch, k)[:rows]), getattr(ref_b[me], k)))
        got = cupy.asnumpy(out[:n]).view(reference.BF16).astype(np.float32)
        want = ref_out[me].astype(np.float32)
        scale = float(np.abs(ref_b[me].x.astype(np.float32)).max()) if rows else 0.0
        tol = reference.combine_tolerance(ws[me], scale)
        ok &= bool((np.abs(got - want) <= tol).all())
        if not ok:
            failures.append(f"rank {me}: replay {i} (counts {counts}) differs from the reference")
        good += int(ok)
    rt.synchronize()
    calls = rt.device_calls()
    if calls != args.replays:
        failures.append(f"rank {me}: device call counter {calls}, expected {args.replays} (one per replay)")
    rt.close()
    session.close()

    rows = comm.gather((me, good, sorted(counts_seen)[:3], float(np.median(times))), root=0)
    fails = comm.gather(failures, root=0)
    if me == 0:
        for f in sum(fails, [])[:10]:
            print("FAIL:", f)
        print(f"layout {args.layout}")
        print(f"{'rank':>4} {'replays ok':>10} {'of':>4} {'smallest counts':>16} {'replay host us (median)':>24}")
        for r, g, c, t in rows:
            print(f"{r:>4} {g:>10} {args.replays:>4} {str(c):>16} {t:>24.1f}")
        print("PASS" if not sum(fails, []) else "FAIL")
    return 1 if comm.allreduce(len(failures)) else 0


if __name__ == "__main__":
    sys.exit(main())
