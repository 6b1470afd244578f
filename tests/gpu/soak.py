"""GPU soak (run on the GPU machine, one rank per GPU):

    mpirun -np 2 -x PYTHONPATH python3 tests/gpu/soak.py [--calls 10000] [--sets 16]

Decode-sized layer (hidden 7168, top-8 of 256 experts, up to 256 tokens per rank). ``--sets``
input sets with random token counts per rank (0 included) are checked once against the NumPy
reference (dispatch exact, combine within the stated tolerance); then ``--calls`` dispatch +
combine round trips pick a set at random each call (the same on every rank) and must be
bit-identical to that set's checked first run. Device memory (free bytes and CuPy's pool) is
read after a warm-up and at the end. Also times the debug-mode routing check. Prints a table last.
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
    ap.add_argument("--mode", choices=("plain", "sync", "barrier", "split"), default="plain",
                    help="between calls: nothing (default), a host synchronize, or a barrier of all ranks; "
                         "split: a barrier between dispatch_async and dispatch_wait")
    ap.add_argument("--diagnose", type=int, default=0, help="print the first N differing calls (syncs each call)")
    args = ap.parse_args()

    import cupy
    from mpi4py import MPI

    from ep_runtime import EPConfig, EPRuntime, reference
    from ep_runtime.core.layout import BufferLayout
    from ep_runtime.shmem import open_session
    from ep_runtime.testing import linear_experts, make_inputs

    comm = MPI.COMM_WORLD
    R = comm.Get_size()
    cfg = EPConfig(n_ranks=R, n_experts=256, top_k=8, hidden=7168, max_tokens_per_rank=args.max_tokens)
    session = open_session("nvshmem", heap_bytes=BufferLayout(cfg).symmetric_bytes)
    me = session.rank
    rt = EPRuntime(cfg, session)
    current_is_session = cupy.cuda.get_current_stream().ptr == session.stream.ptr
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
        if args.diagnose:
            s.update(x_ref=ref[me].x.view(np.uint16), src_rank=ref[me].src_rank, src_token=ref[me].src_token,
                     all_x=[x.view(np.uint16) for x in xs])
        sets.append(s)

    pool = cupy.get_default_memory_pool()
    warmup = min(200, args.calls // 10)  # first calls load the comparison kernels; measure after them
    differ = cupy.zeros((), cupy.int64)
    picks = rng.integers(0, args.sets, args.calls)
    t0 = time.perf_counter()
    shown = 0
    for call, i in enumerate(picks):
        s = sets[int(i)]
        h = rt.dispatch_async(s["tok"], s["ids"], s["w"])
        if args.mode == "split":
            session.barrier()
        b = rt.dispatch_wait(h)
        x_bad = ~cupy.array_equal(b.x[:s["n"]], s["x_first"])
        rt.combine_wait(rt.combine_async(s["y"], b.handle), out=s["out"])
        out_bad = ~cupy.array_equal(s["out"], s["out_first"])
        differ += x_bad | out_bad
        if args.diagnose and shown < args.diagnose and bool(x_bad | out_bad):
            shown += 1
            prev = int(picks[call - 1]) if call else -1
            nd = int((s["out"] != s["out_first"]).any(axis=1).sum())
            got = cupy.asnumpy(b.x[:s["n"]])
            bad_rows = np.nonzero((got != s["x_ref"]).any(axis=1))[0]
            origin = ""
            if len(bad_rows):
                r0 = int(bad_rows[0])
                src = (int(s["src_rank"][r0]), int(s["src_token"][r0]))
                col3 = got[r0, 3]
                owners = [j for j, o in enumerate(sets) if src[1] < o["all_x"][src[0]].shape[0]
                          and o["all_x"][src[0]][src[1], 3] == col3]
                origin = (f"; {len(bad_rows)} rows differ from the reference, first row {r0} from (rank, token) "
                          f"{src}: its data matches that token in sets {owners}; first-run x equals reference "
                          f"{bool(np.array_equal(cupy.asnumpy(s['x_first']), s['x_ref']))}")
            print(f"rank {me} call {call} set {int(i)} (prev set {prev}, group {call % 2}): x differs "
                  f"{bool(x_bad)}, out differs {bool(out_bad)} in {nd} of {s['out'].shape[0]} tokens{origin}",
                  flush=True)
        if args.mode == "sync":
            rt.synchronize()
        elif args.mode == "barrier":
            session.barrier()
        if call % 1000 == 999:
            rt.synchronize()  # raises any device error
        if call == warmup - 1:
            rt.synchronize()
            free_before, used_before = cupy.cuda.runtime.memGetInfo()[0], pool.used_bytes()
    rt.synchronize()
    soak_s = time.perf_counter() - t0
    free_after, used_after = cupy.cuda.runtime.memGetInfo()[0], pool.used_bytes()
    n_differ = int(differ)
    if not current_is_session:
        failures.append("CuPy's current stream is not the session stream after building the runtime")
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
