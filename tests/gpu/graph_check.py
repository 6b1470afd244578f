"""One CUDA graph, captured once at capacity, serving every batch size (run on the GPU machine):

    mpirun -np 2 -x PYTHONPATH python3 tests/gpu/graph_check.py [--capacity 256] [--replays 100]
        [--layout expanded|compact] [--plans default | variants | receiver=land,transport=puts ...]
        [--compiler numba-cuda | numba-cuda-mlir]

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

import harness
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


def replay_steps(rt, session, check, counts_per_step, steps, keep: bool, args) -> list:
    """Capture the graph on the runtime ``rt``, replay it once per step (``steps[i]``: replay i's
    step_reference, computed here where None and kept there with ``keep``, when several plans
    run), each replay checked against its reference; the table row ``[(replays ok, median replay
    host us)]``."""
    import cupy

    cfg, me, stream, cap = rt.cfg, session.rank, session.stream, rt.cfg.max_tokens_per_rank
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
        if keep:
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

        # the expert's input rows (the batch's, or those the compact batch's gather index picks) in
        # place of the batch's own: checked as an expanded batch
        ref, what = step.batch, f"replay {i} (counts {counts})"
        got = harness.batch_to_host(session, batch, rows=ref.n_rows)
        got["x"] = cupy.asnumpy(y[:ref.n_rows])
        ok = check.no_failure(harness.batch_failure(got, ref, "expanded", None, cfg, what))
        if args.layout == "compact":
            ok &= check(np.array_equal(cupy.asnumpy(batch.gather[:ref.n_rows]), step.gather), f"{what}: gather")
            ok &= check(np.array_equal(cupy.asnumpy(batch.recv_tokens), np.array(counts, np.int32)),
                        f"{what}: recv_tokens")
        ok &= check.no_failure(harness.combine_failure(cupy.asnumpy(out[:n]), step.want.astype(np.float32), step.tol,
                                                       what))
        good += int(ok)
    rt.synchronize()
    calls = rt.device_calls()
    check(calls == args.replays, f"device call counter {calls}, expected {args.replays} (one per replay)")
    return [(good, float(np.median(times)))]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--capacity", type=int, default=256)
    harness.add_layer_options(ap, tokens=None, seed=7)
    ap.add_argument("--replays", type=int, default=100)
    harness.add_scenario_option(ap)
    ap.add_argument("--layout", choices=("expanded", "compact"), default="expanded")
    ap.add_argument("--plans", nargs="+", default=["default"], metavar="PLAN", help=harness.PLANS_HELP)
    harness.add_compiler_option(ap)
    args = harness.parse_args(ap)
    plans = harness.plan_list(args.plans)

    R, cap = harness.job_comm().Get_size(), args.capacity
    cfg = harness.layer_config(args, R, cap)
    session = harness.open_job_session(cfg)  # every plan's regions

    rng = np.random.default_rng(args.seed)
    counts_per_step = [step_counts(R, cap, i, rng) for i in range(args.replays)]
    counts_seen = sorted({c for counts in counts_per_step for c in counts})
    steps = [None] * args.replays  # each replay's reference, kept for the next plans when several run
    lines, rows, failures = harness.run_plans(
        session, plans, {"": cfg},
        lambda rt, label, check: replay_steps(rt, session, check, counts_per_step, steps, len(plans) > 1, args))
    session.close()

    def table(all_rows) -> list[str]:
        def cells(row) -> str:
            good, t = row
            return f"{good:>10} {args.replays:>4} {counts_seen[:3]!s:>16} {t:>24.1f}"

        columns = f"{'replays ok':>10} {'of':>4} {'smallest counts':>16} {'replay host us (median)':>24}"
        return [f"layout {args.layout}", *lines, *harness.plan_table(all_rows, len(plans), columns, cells)]

    return harness.finish(failures, rows, table, most=10)


if __name__ == "__main__":
    sys.exit(main())
