"""One CUDA graph, captured once at capacity, serving every batch size (run on the GPU machine):

    mpirun -np 2 -x PYTHONPATH python3 tests/gpu/graph_check.py [--capacity 256] [--replays 100]
        [--layout expanded|compact] [--plans default | variants | receiver=land,transport=puts ...]

Captures dispatch_async(n_tokens=<device scalar>) -> dispatch_wait -> (expert compute: the
identity expert, a CuPy copy of the expanded batch, or with ``--layout compact`` a CuPy gather
of the compact batch's rows by its ``gather`` index, as a gathering GEMM reads them) ->
combine_async -> combine_wait once, with capacity-sized input buffers. The compact batch's
``x`` is the receive buffer itself: every replay must gather that replay's rows from the memory
the capture saw (one buffer for every call, guarded by credits: docs/protocol.md). Each replay writes new tokens, routing and weights into those buffers and a new token
count into the device scalar (counts vary by rank and replay: 0, 1, capacity and random ones),
replays the graph, and checks the expert batch exactly and the combine output within
``reference.combine_tolerance`` against the NumPy reference of that step. Rows past the count
hold the previous step's data (decoys: sending one would add rows). All of this runs for each
execution plan of ``--plans`` (as in ep_check.py: ``default``, plan overrides, or ``variants``),
a runtime and a graph each, built one after another on one NVSHMEM session; every plan replays
the same steps, whose references are computed once when several plans run. A plan that cannot
run here (EPConfigError when its runtime is built) is a failure; the other plans still run.
Prints a table, then PASS or FAIL.
"""

from __future__ import annotations

import argparse
import sys
import time
from types import SimpleNamespace

import numpy as np


def step_counts(R: int, cap: int, i: int, rng) -> list[int]:
    """Tokens per rank at replay ``i``: 0, 1 and ``cap`` appear early, then random counts."""
    fixed = {0: [0] + [cap] * (R - 1), 1: [1] * R, 2: [cap] * R, 3: [cap] + [0] * (R - 1)}
    return fixed.get(i, [int(c) for c in rng.integers(0, cap + 1, R)])


def step_reference(cfg, seed: int, i: int, counts: list[int], me: int, compact: bool,
                   scenario: str = "random") -> SimpleNamespace:
    """Replay ``i``'s inputs on rank ``me`` and what it must give there (only this rank's parts
    kept)."""
    from ep_runtime.core import reference
    from ep_runtime.testing import make_inputs

    xs, ids, ws = make_inputs(cfg, scenario, seed * 1000 + i, n_tokens=counts)
    ref_b = reference.dispatch(xs, ids, ws, cfg)
    b = ref_b[me]
    want = reference.combine([rb.x for rb in ref_b], ref_b, ids, cfg, home_ranks=[me])[me]  # bf16
    scale = float(np.abs(b.x.astype(np.float32)).max()) if b.n_rows else 0.0
    return SimpleNamespace(tokens=xs[me].view(np.uint16), ids=ids[me], ws=ws[me], batch=b, want=want,
                           tol=reference.combine_tolerance(ws[me], scale),
                           gather=reference.gather_index(b, cfg) if compact else None)


def run_plan(cfg, session, text: str, counts_per_step, steps, args, n_plans: int):
    """Build plan ``text``'s runtime, capture the graph, replay it once per step (``steps[i]``:
    replay i's step_reference, computed here where None and kept there when several plans run),
    close it. Returns ``(line, rows, failures)``: the plan's line for the report, ``[(label,
    (replays ok, median replay host us) or None)]`` (None: the runtime could not be built; that
    row on rank 0 only) and this rank's failures, each prefixed with the plan."""
    import cupy
    from ep_check import plan_label, runtime_for  # this script's folder is on sys.path

    from ep_runtime.core import reference

    me, stream, cap = session.rank, session.stream, cfg.max_tokens_per_rank
    rt, built = runtime_for(cfg, session, text)
    if rt is None:  # every rank: the plan cannot run here; rank 0 reports it
        return f"plan {text}: not built", ([(text, None)] if me == 0 else []), ([f"{text}: {built}"] if me == 0 else [])
    label = plan_label(rt.plan, text, n_plans)
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

    good, times = 0, []
    for i, counts in enumerate(counts_per_step):
        step = steps[i] or step_reference(cfg, args.seed, i, counts, me, args.layout == "compact", args.scenario)
        if n_plans > 1:
            steps[i] = step
        n = counts[me]
        tok[:n] = cupy.asarray(step.tokens)
        tid[:n] = cupy.asarray(step.ids)
        tw[:n] = cupy.asarray(step.ws)
        count[0] = n
        stream.synchronize()
        session.barrier()
        t0 = time.perf_counter()
        graph.launch(stream)
        stream.synchronize()
        times.append((time.perf_counter() - t0) * 1e6)

        ref = step.batch
        rows = ref.n_rows
        ok = bool(np.array_equal(cupy.asnumpy(batch.row_offsets), ref.row_offsets))
        ok &= bool(np.array_equal(cupy.asnumpy(y[:rows]), ref.x.view(np.uint16)))
        if args.layout == "compact":
            ok &= bool(np.array_equal(cupy.asnumpy(batch.gather[:rows]), step.gather))
            ok &= bool(np.array_equal(cupy.asnumpy(batch.recv_tokens), np.array(counts, np.int32)))
        for k in ("src_rank", "src_token", "src_k", "weight"):
            ok &= bool(np.array_equal(cupy.asnumpy(getattr(batch, k)[:rows]), getattr(ref, k)))
        got = cupy.asnumpy(out[:n]).view(reference.BF16).astype(np.float32)
        ok &= bool((np.abs(got - step.want.astype(np.float32)) <= step.tol).all())
        if not ok:
            failures.append(f"{label}: rank {me}: replay {i} (counts {counts}) differs from the reference")
        good += int(ok)
    rt.synchronize()
    calls = rt.device_calls()
    if calls != args.replays:
        failures.append(f"{label}: rank {me}: device call counter {calls}, expected {args.replays} (one per replay)")
    line = f"plan {label} = {text}: {rt.plan.summary()}"
    rt.close()
    return line, [(label, (good, float(np.median(times))))], failures


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--capacity", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--replays", type=int, default=100)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--scenario", default="random", help="routing (ep_runtime.testing.SCENARIOS; masked: -1 slots)")
    ap.add_argument("--layout", choices=("expanded", "compact"), default="expanded")
    ap.add_argument("--plans", nargs="+", default=["default"], metavar="PLAN",
                    help="execution plans to check, one runtime each on one session: 'default' (the rules' plan "
                         "with EP_RUNTIME_PLAN's overrides), plan overrides such as receiver=land,transport=puts, "
                         "or 'variants' (default, then every receiver on every transport it can run on)")
    args = ap.parse_args()
    from ep_check import plan_list  # this script's folder is on sys.path

    plans = plan_list(args.plans)

    from mpi4py import MPI

    from ep_runtime import EPConfig
    from ep_runtime.core.layout import BufferLayout
    from ep_runtime.shmem import open_session

    comm = MPI.COMM_WORLD
    R, cap = comm.Get_size(), args.capacity
    cfg = EPConfig(n_ranks=R, n_experts=args.experts, top_k=args.top_k, hidden=args.hidden,
                   max_tokens_per_rank=cap)
    session = open_session("nvshmem", heap_bytes=BufferLayout(cfg).symmetric_bytes)  # every plan's regions
    me = session.rank

    rng = np.random.default_rng(args.seed)
    counts_per_step = [step_counts(R, cap, i, rng) for i in range(args.replays)]
    counts_seen = sorted({c for counts in counts_per_step for c in counts})
    steps = [None] * args.replays  # each replay's reference, kept for the next plans when several run
    lines, rows, failures = [], [], []
    for i, text in enumerate(plans):
        try:
            line, plan_rows, plan_failures = run_plan(cfg, session, text, counts_per_step, steps, args, len(plans))
        except Exception:  # not a plan that cannot run: the job stops, as without --plans
            print(f"rank {me}: plan {text!r} raised; the plans after it did not run", file=sys.stderr, flush=True)
            raise
        lines.append(line)
        rows += [(i, label, row) for label, row in plan_rows]
        failures += plan_failures
    session.close()

    all_rows = comm.gather(rows, root=0)
    fails = comm.gather(failures, root=0)
    if me == 0:
        fails = [f for rank_fails in fails for f in rank_fails]
        for f in fails[:10]:
            print("FAIL:", f)
        print(f"layout {args.layout}")
        for line in lines:
            print(line)
        w = max([4] + [len(label) for rr in all_rows for _, label, _ in rr])
        print(f"{'rank':>4} {'plan':<{w}} {'replays ok':>10} {'of':>4} {'smallest counts':>16} "
              f"{'replay host us (median)':>24}")
        for i in range(len(plans)):
            for r, rr in enumerate(all_rows):
                for _, label, row in (x for x in rr if x[0] == i):
                    if row is None:
                        print(f"{r:>4} {label:<{w}} runtime not built (FAIL above)")
                        continue
                    g, t = row
                    print(f"{r:>4} {label:<{w}} {g:>10} {args.replays:>4} {counts_seen[:3]!s:>16} {t:>24.1f}")
        print("PASS" if not fails else "FAIL")
    return 1 if comm.allreduce(len(failures)) else 0


if __name__ == "__main__":
    sys.exit(main())
