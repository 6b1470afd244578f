"""GPU soak (run on the GPU machine, one rank per GPU):

    mpirun -np 2 -x PYTHONPATH python3 tests/gpu/soak.py [--calls 10000] [--sets 16]

Decode-sized layer (hidden 7168, top-8 of 256 experts, up to 256 tokens per rank). ``--sets``
input sets with random token counts per rank (0 included) are checked once against the NumPy
reference (dispatch exact, combine within the stated tolerance); then ``--calls`` dispatch +
combine round trips pick a set at random each call (the same on every rank) and must be
bit-identical to that set's checked first run. Device memory (free bytes and CuPy's pool) is
read before and after. Also times the debug-mode routing check. Prints a table last.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=10000)
    ap.add_argument("--sets", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--seed", type=int, default=5)
    args = ap.parse_args()

    import cupy
    from mpi4py import MPI

    from ep_runtime import EPConfig, EPRuntime, reference
    from ep_runtime.layout import BufferLayout
    from ep_runtime.shmem import open_session
    from ep_runtime.testing import linear_experts, make_inputs

    comm = MPI.COMM_WORLD
    R = comm.Get_size()
    cfg = EPConfig(n_ranks=R, n_experts=256, top_k=8, hidden=7168, max_tokens_per_rank=args.max_tokens)
    session = open_session("nvshmem", heap_bytes=BufferLayout(cfg).symmetric_bytes)
    me = session.rank
    rt = EPRuntime(cfg, session)
    rng = np.random.default_rng(args.seed)
    sets, failures = [], []
    for i in range(args.sets):
        counts = [int(c) for c in rng.integers(0, cfg.max_tokens_per_rank + 1, R)]
        xs, ids, ws = make_inputs(cfg, "random", args.seed * 1000 + i, n_tokens=counts)
        ref = reference.dispatch(xs, ids, ws, cfg)
        ys = [linear_experts(b.x, b.row_offsets, cfg.n_local_experts, r) for r, b in enumerate(ref)]
        want = reference.combine(ys, ref, ids, cfg)[me]
        n = ref[me].n_rows
        s = {"tok": cupy.asarray(xs[me].view(np.uint16)), "ids": cupy.asarray(ids[me]), "w": cupy.asarray(ws[me]),
             "y": cupy.zeros((max(n, 1), cfg.hidden), cupy.uint16), "n": n,
             "out": cupy.empty((counts[me], cfg.hidden), cupy.uint16)}
        s["y"][:n] = cupy.asarray(ys[me].view(np.uint16))
        batch = rt.dispatch(s["tok"], s["ids"], s["w"])
        rt.combine(s["y"], batch.handle, out=s["out"])
        if not (np.array_equal(cupy.asnumpy(batch.x[:n]), ref[me].x.view(np.uint16))
                and np.array_equal(cupy.asnumpy(batch.row_offsets), ref[me].row_offsets)):
            failures.append(f"set {i}: dispatch differs from the reference")
        got = cupy.asnumpy(s["out"]).view(reference.BF16).astype(np.float32)
        tol = reference.combine_tolerance(ws[me], float(np.abs(ys[me].astype(np.float32)).max(initial=1.0)))
        if not (np.abs(got - want.astype(np.float32)) <= tol).all():
            failures.append(f"set {i}: combine outside tolerance")
        s["x_first"], s["out_first"] = batch.x[:n].copy(), s["out"].copy()
        sets.append(s)

    pool = cupy.get_default_memory_pool()
    session.synchronize()
    free_before, used_before = cupy.cuda.runtime.memGetInfo()[0], pool.used_bytes()
    differ = cupy.zeros((), cupy.int64)
    picks = rng.integers(0, args.sets, args.calls)
    t0 = time.perf_counter()
    for call, i in enumerate(picks):
        s = sets[int(i)]
        b = rt.dispatch_wait(rt.dispatch_async(s["tok"], s["ids"], s["w"]))
        rt.combine_wait(rt.combine_async(s["y"], b.handle), out=s["out"])
        differ += (~cupy.array_equal(b.x[:s["n"]], s["x_first"])) | (~cupy.array_equal(s["out"], s["out_first"]))
        if call % 1000 == 999:
            rt.synchronize()  # raises any device error
    rt.synchronize()
    soak_s = time.perf_counter() - t0
    free_after, used_after = cupy.cuda.runtime.memGetInfo()[0], pool.used_bytes()
    n_differ = int(differ)
    if n_differ:
        failures.append(f"{n_differ} of {args.calls} soak calls differ from their first run")
    if free_after < free_before or used_after > used_before:
        failures.append(f"device memory grew: free {free_before} -> {free_after}, pool {used_before} -> {used_after}")

    # cost of the debug-mode routing check at the largest batch of this layer
    s = max(sets, key=lambda s: s["ids"].shape[0])
    stream = session.stream
    times = []
    for k in range(60):
        e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
        e0.record(stream)
        rt.check_routing(s["ids"], s["w"])
        e1.record(stream)
        e1.synchronize()
        if k >= 10:
            times.append(cupy.cuda.get_elapsed_time(e0, e1) * 1e3)
    rt.synchronize()
    check_us = float(np.median(times))
    rt.close()
    session.close()
    rows = comm.gather((me, args.calls, n_differ, soak_s, free_before - free_after, used_after - used_before,
                        s["ids"].shape[0], check_us), root=0)
    all_fail = comm.gather(failures, root=0)
    if me == 0:
        for f in sum(all_fail, []):
            print("FAIL:", f)
        print(f"{'rank':>4} {'calls':>6} {'differ':>6} {'soak s':>7} {'free drop B':>11} {'pool growth B':>13} "
              f"{'check T':>7} {'check us':>8}")
        for r in rows:
            print(f"{r[0]:>4} {r[1]:>6} {r[2]:>6} {r[3]:>7.1f} {r[4]:>11} {r[5]:>13} {r[6]:>7} {r[7]:>8.1f}")
        print("PASS" if not sum(all_fail, []) else "FAIL")
    return 1 if comm.allreduce(len(failures)) else 0


if __name__ == "__main__":
    sys.exit(main())
