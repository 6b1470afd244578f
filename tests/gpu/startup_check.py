"""Start-up time with the kernel cache, and host time per call with the fast launch path
(run on the GPU machine, one rank per GPU, each phase in a NEW job):

    mpirun -np 2 -x PYTHONPATH python3 tests/gpu/startup_check.py --phase cold
    mpirun -np 2 -x PYTHONPATH python3 tests/gpu/startup_check.py --phase warm

``cold`` empties the kernel cache directory first (rank 0 deletes, then a barrier), so building the
runtime compiles and stores every kernel; ``warm`` must find them all there (no compile). Each rank
prints ``STARTUP phase=... rank=... build_s=...`` (``build_s``: ``EPRuntime(cfg, session)``, kernels
ready; ``import_s``: importing the kernel modules and nvshmem4py's device bindings, before it).

Then, on the same runtime, host time of each of the four calls (``time.perf_counter`` around the
Python call only; the stream is synchronized outside the timed region after each round, never
inside) and of each ``session.launch`` alone, median over ``--calls`` rounds, with the fast launch
path and with Numba's dispatcher (``session.fast_launch = False``); the results of both paths must
be bit-identical. Prints a table last, then PASS or FAIL.

Targets (FAIL if missed): warm ``build_s`` <= 3 s on every rank; fast ``session.launch`` <= 10 us
(median); every launch of the fast rounds took the fast path.
"""

from __future__ import annotations

import argparse
import importlib
import os
import shutil
import statistics
import sys
import time

import harness
import numpy as np

BUILD_TARGET_S = 3.0
LAUNCH_TARGET_US = 10.0


def _snapshot(batch, out):
    """Host copies of everything a round produced: the batch's arrays (rows up to the batch's
    row count where an array is row-aligned with ``x``) and the combined output."""
    import cupy

    n = int(cupy.asnumpy(batch.row_offsets)[-1])
    snap = {"out": cupy.asnumpy(out)}
    fields = getattr(batch, "__dataclass_fields__", None) or vars(batch)
    for name in fields:
        v = getattr(batch, name)
        if isinstance(v, cupy.ndarray):
            rows = v[:n] if v.ndim and v.shape[0] == batch.x.shape[0] else v
            snap[name] = cupy.asnumpy(rows)
    return snap


def _measure(rt, session, inputs, calls, fast):
    """Host times per call and per launch for one path, and the results of one checked round."""
    tok, tid, tw, y, out = inputs
    session.fast_launch = fast
    for _ in range(10):  # warm-up (Numba's first dispatch of each kernel types its arguments)
        harness.round_trip(rt, tok, tid, tw, y, out)
    rt.synchronize()
    session.barrier()
    before = dict(session.launch_counts)
    times = {name: [] for name in harness.CALLS}
    for _ in range(calls):
        harness.round_trip(rt, tok, tid, tw, y, out, times)
        rt.synchronize()  # outside the timed calls: keeps the launch queue short
    used = {k: session.launch_counts[k] - before[k] for k in before}

    launch_times = []
    inner = session.launch

    def timed_launch(kernel, grid, block, args):
        t = time.perf_counter()
        inner(kernel, grid, block, args)
        launch_times.append(time.perf_counter() - t)

    session.launch = timed_launch
    try:
        for _ in range(calls):
            harness.round_trip(rt, tok, tid, tw, y, out)
            rt.synchronize()
    finally:
        del session.launch  # back to the class's method

    session.barrier()
    out.fill(0)
    batch = harness.round_trip(rt, tok, tid, tw, y, out)
    rt.synchronize()
    med = {name: statistics.median(v) * 1e6 for name, v in times.items()}
    med["session.launch"] = statistics.median(launch_times) * 1e6
    return med, used, _snapshot(batch, out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--phase", choices=("cold", "warm"), required=True)
    ap.add_argument("--cache-dir", default=os.environ.get("EP_RUNTIME_KERNEL_CACHE")
                    or "/tmp/ep_runtime_startup_check/kernels",
                    help="kernel cache directory (default: $EP_RUNTIME_KERNEL_CACHE or a /tmp folder)")
    harness.add_layer_options(ap, tokens=128, seed=1)
    ap.add_argument("--calls", type=int, default=200)
    args = ap.parse_args()

    comm = harness.job_comm()
    me, R = comm.Get_rank(), comm.Get_size()
    check = harness.Checks()
    check(os.environ.get("EP_RUNTIME_FAST_LAUNCH", "1").strip().lower() not in ("0", "off", "false", "no"),
          "EP_RUNTIME_FAST_LAUNCH disables the fast path: unset it for this check")
    cache_dir = os.path.abspath(os.path.expanduser(args.cache_dir))
    os.environ["EP_RUNTIME_KERNEL_CACHE"] = cache_dir  # read when the session opens
    if args.phase == "cold" and me == 0:
        shutil.rmtree(cache_dir, ignore_errors=True)
    comm.Barrier()
    check(args.phase != "warm" or (os.path.isdir(cache_dir) and os.listdir(cache_dir)),
          f"warm phase but {cache_dir} is empty: run --phase cold first (same machine)")

    import cupy

    from ep_runtime import EPRuntime

    cfg = harness.layer_config(args, R, args.tokens)
    t0 = time.perf_counter()
    session = harness.open_job_session(cfg)
    open_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for module in ("ep_runtime.kernels.shmem", "ep_runtime.kernels.dispatch", "ep_runtime.kernels.combine"):
        importlib.import_module(module)  # the kernel modules and nvshmem4py's device bindings
    import_s = time.perf_counter() - t0
    session.barrier()
    t0 = time.perf_counter()
    rt = EPRuntime(cfg, session)
    build_s = time.perf_counter() - t0
    stats = dict(session.kernel_cache.stats) if session.kernel_cache is not None else {}
    print(f"STARTUP phase={args.phase} rank={me} build_s={build_s:.2f} import_s={import_s:.2f} "
          f"open_s={open_s:.2f} cache_hits={stats.get('hits')} cache_misses={stats.get('misses')} "
          f"cache_stored={stats.get('stored')} cache_rejected={stats.get('rejected')} "
          f"uncacheable={stats.get('uncacheable')}", flush=True)
    if session.kernel_cache is None:
        check(False, "the kernel cache is disabled")
    elif args.phase == "warm":
        check(not (stats["misses"] or stats["rejected"] or stats["uncacheable"] or not stats["hits"]),
              f"rank {me}: warm start compiled kernels ({stats})")
        check(build_s <= BUILD_TARGET_S, f"rank {me}: warm build {build_s:.2f} s > {BUILD_TARGET_S} s")
    else:
        check(stats["stored"], f"rank {me}: cold start stored no kernel ({stats})")

    T = args.tokens
    tok, tid, tw = harness.device_inputs(session, *harness.job_inputs(cfg, args.seed + T, T))
    y = cupy.asarray(np.random.default_rng(args.seed + me).integers(
        0, 1 << 14, size=(cfg.recv_rows_capacity, cfg.hidden), dtype=np.uint16))  # finite bf16 values
    out = cupy.empty((T, cfg.hidden), cupy.uint16)
    inputs = (tok, tid, tw, y, out)

    fast_med, fast_used, fast_res = _measure(rt, session, inputs, args.calls, fast=True)
    numba_med, numba_used, numba_res = _measure(rt, session, inputs, args.calls, fast=False)
    session.fast_launch = True
    check(not fast_used["numba"] and fast_used["fast"],
          f"rank {me}: fast rounds launched {fast_used} (some launches fell back to Numba)")
    check(not numba_used["fast"], f"rank {me}: Numba rounds launched {numba_used}")
    for name in sorted(set(fast_res) | set(numba_res)):
        a, b = fast_res.get(name), numba_res.get(name)
        same = a is not None and b is not None and a.shape == b.shape and np.array_equal(a.view(np.uint8),
                                                                                       b.view(np.uint8))
        check(same, f"rank {me}: {name} differs between the fast and the Numba path")
    check(fast_med["session.launch"] <= LAUNCH_TARGET_US,
          f"rank {me}: fast session.launch {fast_med['session.launch']:.1f} us > {LAUNCH_TARGET_US} us")

    rt.close()
    session.close()

    def table(every) -> list[str]:
        lines = [f"startup_check phase={args.phase} ranks={R} T={T} hidden={cfg.hidden} experts={cfg.n_experts} "
                 f"top_k={cfg.top_k} calls={args.calls} cache={cache_dir}",
                 f"{'rank':>4} {'build s':>8} {'import s':>8} {'what (host us, median)':<24} {'fast':>8} {'numba':>8}"]
        for r, (b, imp, fm, nm) in enumerate(every):
            for i, name in enumerate(harness.CALLS + ("session.launch",)):
                lead = f"{r:>4} {b:>8.2f} {imp:>8.2f}" if i == 0 else " " * 22
                lines.append(f"{lead} {name:<24} {fm[name]:>8.1f} {nm[name]:>8.1f}")
        return lines

    return harness.finish(check.failures, (build_s, import_s, fast_med, numba_med), table)


if __name__ == "__main__":
    sys.exit(main())
