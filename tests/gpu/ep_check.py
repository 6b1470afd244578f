"""GPU acceptance of the four EP kernels (run on the GPU machine, one rank per GPU):

    mpirun -np 2 -x PYTHONPATH python3 tests/gpu/ep_check.py [--tokens 4096 128] [--calls 100]
        [--plans default | variants | receiver=land,transport=puts ...]
        [--compiler numba-cuda | numba-cuda-mlir]

For each execution plan of ``--plans`` (a runtime each, built one after another on one NVSHMEM
session: ``default`` is the rules' plan with EP_RUNTIME_PLAN's overrides, an item such as
``receiver=land,transport=puts`` overrides plan fields, and ``variants`` stands for ``default``
then every receiver on every transport it can run on, ep_runtime.tools.gate_entries.PLAN_VARIANTS)
and each token count T: dispatch exact against the NumPy reference, combine within the
stated tolerance, ``--calls`` back-to-back round trips bit-identical to the first, a CUDA
graph of the four calls replayed ``--replays`` times with correct results, and per-call
times (CUDA events, median of ``--samples`` after warm-up, barrier before each sample).
The reference data of each T is computed once, for every plan. A plan that cannot run here
(EPConfigError when its runtime is built) is a failure; the other plans still run.
Prints a table last (a row per rank, plan and T); exits non-zero on any failure.
"""

from __future__ import annotations

import argparse
import sys
import time
from types import SimpleNamespace

import harness
import numpy as np


def replay_graph(rt, session, stream, tok, tid, tw, y, out, batch, n, first_x, first_out, replays, check, T):
    """Capture dispatch_async -> dispatch_wait -> combine_async -> combine_wait in a CUDA graph,
    replay it ``replays`` times; returns how many replays reproduced the first results."""
    import cupy

    session.barrier()
    stream.begin_capture()
    b = rt.dispatch_wait(rt.dispatch_async(tok, tid, tw))
    rt.combine_wait(rt.combine_async(y, b.handle), out=out)
    graph = stream.end_capture()
    calls_before = rt.device_calls()
    good = 0
    for _ in range(replays):
        out.fill(0)
        graph.launch(stream)
        stream.synchronize()
        good += int(bool(cupy.array_equal(batch.x[:n], first_x)) and bool(cupy.array_equal(out, first_out)))
    rt.synchronize()
    check(rt.device_calls() == calls_before + replays, f"T={T} device call counter after replays")
    return good


def compact_rows(recv_r, r: int, f32: bool) -> np.ndarray:
    """Rank r's compact combine input: its received rows (``receive_rows(...)[r]``) times r + 2,
    rounded to bf16 (float32 with float32 partials), NaN on the rows combine must not read."""
    from ep_runtime.core import reference

    x_r, def_r = recv_r
    rows_r = (x_r.astype(np.float32) * np.float32(r + 2)).astype(reference.BF16).view(np.uint16)
    rows_r[~def_r] = 0x7FC0  # NaN on rows combine must not read
    return rows_r.view(reference.BF16).astype(np.float32) if f32 else rows_r


def reference_data(cfg, T: int, seed: int, me: int, combine_dtype: str, scenario: str = "random") -> SimpleNamespace:
    """What the checks at T compare with on rank ``me``, computed once for every plan. Only this
    rank's parts are kept (8 processes at EP8, T=4096, hidden 7168 outgrew a 128 GB host with
    every rank's kept)."""
    from ep_runtime.core import reference
    from ep_runtime.testing import linear_experts

    R, f32 = cfg.n_ranks, combine_dtype == "float32"
    xs, ids, ws = harness.job_inputs(cfg, seed + T, T, scenario)
    ref_b = reference.dispatch(xs, ids, ws, cfg)
    ys = [linear_experts(b.x, b.row_offsets, cfg.n_local_experts, r) for r, b in enumerate(ref_b)]
    want = reference.combine(ys, ref_b, ids, cfg, home_ranks=[me])[me].astype(np.float32)  # this rank's only
    batch, y = ref_b[me], ys[me]
    del ref_b, ys
    y_max = float(np.abs(y.astype(np.float32)).max()) if y.size else 0.0  # a rank may receive no row
    tol = reference.combine_tolerance(ws[me], y_max, combine_dtype)
    # the compact layout: every rank's received rows and compact combine input, for this rank's
    # expected combine output (and, for the message on a mismatch, the first 4 columns of every
    # rank's partial of each of this rank's tokens)
    recv = reference.receive_rows(xs, ids, cfg)
    rows = [compact_rows(recv[r], r, f32) for r in range(R)]
    want_c = reference.combine_rows(rows, ids, cfg)[me].view(np.uint16)
    counts = [len(x) for x in xs]  # each rank's tokens (a scenario may give a rank none)
    lo = me * cfg.max_tokens_per_rank
    partials = [p[lo:lo + counts[me], :4].copy() for p in rows]
    partials = [p if f32 else p.view(reference.BF16) for p in partials]
    x_recv, defined = recv[me]
    return SimpleNamespace(T=T, counts=counts, n=batch.n_rows, batch=batch, tokens=xs[me].view(np.uint16),
                           ids=ids[me], ws=ws[me], y=y.view(np.uint16), want=want, tol=tol,
                           x_recv=x_recv.view(np.uint16), defined=defined,
                           gather=reference.gather_index(batch, cfg), rows=rows[me], want_c=want_c, partials=partials)


def check_tokens(rt, session, ref: SimpleNamespace, args, check, label: str) -> tuple:
    """Every check at one T (``ref``: its reference_data) on the runtime ``rt``; the table row."""
    import cupy

    from ep_runtime.core import reference

    cfg, stream, me = rt.cfg, session.stream, session.rank
    T, n = ref.T, ref.n
    tok = cupy.asarray(ref.tokens)
    tid = cupy.asarray(ref.ids)
    tw = cupy.asarray(ref.ws)
    y = cupy.zeros((cfg.recv_rows_capacity, cfg.hidden), cupy.uint16)
    y[:n] = cupy.asarray(ref.y)
    out = cupy.empty((ref.counts[me], cfg.hidden), cupy.uint16)

    # 1. correctness against the reference
    batch = rt.dispatch(tok, tid, tw)
    on_host = harness.batch_to_host(session, batch, rows=n)
    check.no_failure(harness.batch_failure(on_host, ref.batch, "expanded", None, cfg, f"T={T} dispatch"))
    rt.combine(y, batch.handle, out=out)
    got = cupy.asnumpy(out)
    err = np.abs(got.view(reference.BF16).astype(np.float32) - ref.want)
    err_max = float(err.max()) if err.size else 0.0  # a rank may have no tokens
    check.no_failure(harness.combine_failure(got, ref.want, ref.tol, f"T={T}"))
    exact_frac = float((err == 0).mean()) if err.size else 1.0
    first_x, first_out = batch.x[:n].copy(), out.copy()

    # 1b. the compact layout: received rows in place + gather indices; combine from one row per
    # received token (exact: a float32 sum of bf16 rows in rank order has no FMA to contract)
    cb = rt.dispatch(tok, tid, tw, layout="compact")
    defined = ref.defined
    check(np.array_equal(cupy.asnumpy(cb.x)[defined], ref.x_recv[defined]), f"T={T} compact x")
    check(np.array_equal(cupy.asnumpy(cb.gather[:n]), ref.gather), f"T={T} gather")
    check(np.array_equal(cupy.asnumpy(cb.recv_tokens), ref.counts), f"T={T} recv_tokens")
    rows_me = session.to_device(ref.rows)  # ordered on the session stream
    out_c = cupy.asnumpy(rt.combine(rows_me, cb.handle, layout="compact"))
    want_c = ref.want_c
    bad = np.flatnonzero((out_c != want_c).any(axis=1))
    if len(bad):
        t = int(bad[0])
        went = sorted({int(e) // cfg.n_local_experts for e in ref.ids[t]})
        parts = {r: ref.partials[r][t] for r in went}
        print(f"{label}: rank {me} T={T}: {len(bad)} of {T} compact tokens differ; token {t} went to {went}; "
              f"got {out_c[t, :4].view(reference.BF16)} want {want_c[t, :4].view(reference.BF16)}; "
              f"partials {parts}; wrong columns {np.flatnonzero(out_c[t] != want_c[t])[:8]}", flush=True)
    check(not len(bad), f"T={T} compact combine not exact ({len(bad)} tokens)")
    # again, the same call: a race would not repeat identically
    cb = rt.dispatch(tok, tid, tw, layout="compact")
    again = cupy.asnumpy(rt.combine(rows_me, cb.handle, layout="compact"))
    check(np.array_equal(again, out_c), f"T={T} compact combine differs run to run")
    # and with the rows made by a plain cupy.asarray on CuPy's current stream, whichever it is:
    # the session's, or the legacy default stream, with which the (blocking) session stream orders
    # (informational: measured not to hold on every rank; the session stream is blocking, so
    # work on the legacy default stream is ordered with the kernels either way)
    current = cupy.cuda.get_current_stream().ptr == session.stream.ptr
    for k in range(3):
        cb = rt.dispatch(tok, tid, tw, layout="compact")
        plain = cupy.asnumpy(rt.combine(cupy.asarray(ref.rows), cb.handle, layout="compact"))
        check(np.array_equal(plain, want_c), f"T={T} compact combine {k} from cupy.asarray not exact "
              f"({int((plain != want_c).any(axis=1).sum())} tokens; current stream is session's: {current})")
    del rows_me

    # 2. back-to-back calls, bit-identical to the first
    same = 0
    for _ in range(args.calls):
        b = rt.dispatch_wait(rt.dispatch_async(tok, tid, tw))
        rt.combine_wait(rt.combine_async(y, b.handle), out=out)
        same += int(bool(cupy.array_equal(b.x[:n], first_x)) and bool(cupy.array_equal(out, first_out)))
    rt.synchronize()
    check(same == args.calls, f"T={T} {args.calls - same} of {args.calls} back-to-back calls differ")

    # 3. CUDA graph of the four calls, replayed
    if args.replays == 0:
        good = 0
    else:
        good = replay_graph(rt, session, stream, tok, tid, tw, y, out, batch, n, first_x, first_out,
                            args.replays, check, T)
    check(good == args.replays, f"T={T} {args.replays - good} of {args.replays} graph replays wrong")

    # 4. per-call times (CUDA events, median; barrier before each sample)
    state = {}

    def run_dispatch():
        state["b"] = rt.dispatch_wait(rt.dispatch_async(tok, tid, tw))

    def run_combine():
        rt.combine_wait(rt.combine_async(y, state["b"].handle), out=out)

    disp = []
    comb = []
    for i in range(args.samples + 5):
        e = [cupy.cuda.Event() for _ in range(4)]
        session.barrier()
        e[0].record(stream)
        run_dispatch()
        e[1].record(stream)
        session.barrier()
        e[2].record(stream)
        run_combine()
        e[3].record(stream)
        e[3].synchronize()
        if i >= 5:
            disp.append(cupy.cuda.get_elapsed_time(e[0], e[1]) * 1e3)
            comb.append(cupy.cuda.get_elapsed_time(e[2], e[3]) * 1e3)
    rt.synchronize()
    return T, n, exact_frac, err_max, same, good, float(np.median(disp)), float(np.median(comb))


def main() -> int:
    ap = argparse.ArgumentParser()
    harness.add_layer_options(ap, tokens=(4096, 128), seed=1)
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--samples", type=int, default=50)
    harness.add_scenario_option(ap)
    ap.add_argument("--combine-dtype", default="bfloat16", choices=["bfloat16", "float32"],
                    help="EPConfig.combine_dtype: float32 partials (compact rows are then float32 too)")
    ap.add_argument("--plans", nargs="+", default=["default"], metavar="PLAN", help=harness.PLANS_HELP)
    harness.add_compiler_option(ap)
    args = harness.parse_args(ap)
    plans = harness.plan_list(args.plans)

    cfg = harness.layer_config(args, harness.job_comm().Get_size(), max(args.tokens),
                               combine_dtype=args.combine_dtype)
    t0 = time.perf_counter()
    session = harness.open_job_session(cfg)  # every plan's regions
    t_init = time.perf_counter() - t0
    refs = [reference_data(cfg, T, args.seed, session.rank, args.combine_dtype, args.scenario) for T in args.tokens]
    lines, rows, failures = harness.run_plans(
        session, plans, {"": cfg}, lambda rt, label, check: [check_tokens(rt, session, ref, args, check, label)
                                                           for ref in refs], build_time=True)
    session.close()

    def table(all_rows) -> list[str]:
        def cells(row) -> str:
            T, n, ex, err, same, good, d, c = row
            return f"{T:>5} {n:>6} {ex:>13.4f} {err:>8.3g} {same:>8} {good:>8} {d:>11.1f} {c:>10.1f}"

        columns = (f"{'T':>5} {'rows':>6} {'combine exact':>13} {'max err':>8} {'b2b same':>8} {'graph ok':>8} "
                   f"{'dispatch us':>11} {'combine us':>10}")
        return [f"session init {t_init:.2f} s", *lines, *harness.plan_table(all_rows, len(plans), columns, cells)]

    return harness.finish(failures, rows, table)


if __name__ == "__main__":
    sys.exit(main())
