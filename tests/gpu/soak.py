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

import harness
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

    from ep_runtime import EPConfig, EPRuntime, reference
    from ep_runtime.testing import linear_experts, make_inputs

    R = harness.job_comm().Get_size()
    cfg = EPConfig(n_ranks=R, n_experts=256, top_k=8, hidden=7168, max_tokens_per_rank=args.max_tokens)
    session = harness.open_job_session(cfg)
    me = session.rank
    rt = EPRuntime(cfg, session)
    current_is_session = cupy.cuda.get_current_stream().ptr == session.stream.ptr
    rng = np.random.default_rng(args.seed)
    sets, check = [], harness.Checks(f"rank {me}: ")
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
        got = harness.batch_to_host(session, batch, rows=n)
        check.no_failure(harness.batch_failure(got, ref[me], "expanded", xs, cfg, f"set {i}: dispatch"))
        tol = reference.combine_tolerance(ws[me], float(np.abs(ys[me].astype(np.float32)).max(initial=1.0)))
        check.no_failure(harness.combine_failure(cupy.asnumpy(s["out"]), want.astype(np.float32), tol, f"set {i}"))
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
    check(current_is_session, "CuPy's current stream is not the session stream after building the runtime")
    check(not n_differ, f"{n_differ} of {args.calls} soak calls differ from their first run")
    check(free_after >= free_before and used_after <= used_before,
          f"device memory grew: free {free_before} -> {free_after}, pool {used_before} -> {used_after}")

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
    row = (args.calls, n_differ, soak_s, free_before - free_after, used_after - used_before, s["ids"].shape[0],
           check_us)

    def table(every) -> list[str]:
        return [f"{'rank':>4} {'calls':>6} {'differ':>6} {'soak s':>7} {'free drop B':>11} {'pool growth B':>13} "
                f"{'check T':>7} {'check us':>8}"] + [
            f"{r:>4} {c[0]:>6} {c[1]:>6} {c[2]:>7.1f} {c[3]:>11} {c[4]:>13} {c[5]:>7} {c[6]:>8.1f}"
            for r, c in enumerate(every)]

    return harness.finish(check.failures, row, table)


if __name__ == "__main__":
    sys.exit(main())
