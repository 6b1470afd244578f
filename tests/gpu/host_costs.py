"""Where the host time of one runtime call goes (GPU machine; one rank is enough):

    mpirun -np 1 -x PYTHONPATH python3 tests/gpu/host_costs.py [--tokens 128] [--profile 200]

Times, median of ``--repeat`` iterations each (``time.perf_counter_ns``; the stream is drained
outside the timed regions): the four calls; the pieces of a call (argument conversion, checks,
word views, argument assembly, ``session.launch``, the fast launcher's packing, the bare driver
launch); then, with ``--profile N``, cProfile over N rounds (top functions by own time).
Prints a table last. Measures only: no targets (startup_check.py holds those).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time

import harness
import numpy as np


def _median_ns(fn, repeat: int, drain=None, every: int = 50) -> float:
    """Median host time of ``fn()`` in us; ``drain()`` (untimed) every ``every`` calls."""
    pc = time.perf_counter_ns
    out = []
    for i in range(repeat):
        t = pc()
        fn()
        out.append(pc() - t)
        if drain is not None and i % every == every - 1:
            drain()
    return statistics.median(out) / 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    harness.add_layer_options(ap, tokens=128)
    ap.add_argument("--repeat", type=int, default=2000)
    ap.add_argument("--profile", type=int, default=0, help="cProfile this many rounds (0: no profile)")
    args = ap.parse_args()

    import cupy

    from ep_runtime import EPRuntime
    from ep_runtime.core import arrays
    from ep_runtime.core.kernel_args import build_args

    comm = harness.job_comm()
    me, R = comm.Get_rank(), comm.Get_size()
    cfg = harness.layer_config(args, R, args.tokens)
    session = harness.open_job_session(cfg)
    rt = EPRuntime(cfg, session)
    T = args.tokens
    tok, tid, tw = harness.device_inputs(session, *harness.job_inputs(cfg, 7))
    y = cupy.zeros((cfg.recv_rows_capacity, cfg.hidden), cupy.uint16)
    out = cupy.empty((T, cfg.hidden), cupy.uint16)

    def one_round(times=None):
        harness.round_trip(rt, tok, tid, tw, y, out, times)  # host seconds per call into times

    for _ in range(20):
        one_round()
    rt.synchronize()
    rows = []
    times = {k: [] for k in harness.CALLS}
    for i in range(args.repeat // 4):
        one_round(times)
        if i % 10 == 9:
            rt.synchronize()
    rt.synchronize()
    for k, v in times.items():
        rows.append((f"call {k}", statistics.median(v) * 1e6))
    for layout in ("compact",):
        t = []
        for i in range(args.repeat // 4):
            t0 = time.perf_counter_ns()
            h = rt.dispatch_async(tok, tid, tw)
            t1 = time.perf_counter_ns()
            b = rt.dispatch_wait(h, layout=layout)
            t.append((time.perf_counter_ns() - t1) / 1e3)
            rt.combine_wait(rt.combine_async(y, b.handle), out=out)
            if i % 10 == 9:
                rt.synchronize()
        rows.append((f"call dispatch_wait({layout})", statistics.median(t)))
    t = []
    for i in range(args.repeat // 4):
        h = rt.dispatch_async(tok, tid, tw)
        c = rt.combine_async(y, rt.dispatch_wait(h).handle)
        t0 = time.perf_counter_ns()
        rt.combine_wait(c)
        t.append((time.perf_counter_ns() - t0) / 1e3)
        if i % 10 == 9:
            rt.synchronize()
    rows.append(("call combine_wait(out=None)", statistics.median(t)))
    rt.synchronize()

    drain = rt.synchronize
    c = "dispatch_async"
    rows.append(("to_backend(tokens)", _median_ns(lambda: arrays.to_backend(tok, "nvshmem", c, "tokens"), args.repeat)))
    rows.append(("check_array(tokens)", _median_ns(
        lambda: arrays.check_array(tok, c, "tokens", np.uint16, (None, cfg.hidden), ""), args.repeat)))
    word = rt._word
    rows.append(("word_view(tokens)", _median_ns(lambda: arrays.word_view(tok, word, c, "tokens"), args.repeat)))
    rows.append(("cupy.cuda.Device().id", _median_ns(lambda: cupy.cuda.Device().id, args.repeat)))
    rows.append(("tokens.flags.c_contiguous", _median_ns(lambda: tok.flags.c_contiguous, args.repeat)))
    tv = arrays.word_view(tok, word, c, "tokens")
    values = dict(tokens=tv, topk_ids=tid, topk_weights=tw, valid_tokens=rt._no_valid, use_valid=np.int64(0),
                  token_scales=rt._no_scales, prequantized=np.int64(0), timeout_ns=rt._timeout_ns,
                  pad_multiple=rt._pad_multiple)
    rows.append(("build_args(dispatch_async)",
                 _median_ns(lambda: build_args(rt._kernels[c], rt._arg, values), args.repeat)))

    # The fast launcher of the debug-mode routing check (not collective: safe to launch alone).
    kernel = rt._kernels["validate_routing"]
    launcher = session._fast[id(kernel)][0][1]
    vargs = build_args(kernel, rt._arg, dict(topk_ids=tid, topk_weights=tw, valid_tokens=rt._no_valid,
                                                         use_valid=np.int64(0), n_experts=np.int64(cfg.n_experts),
                                                         allow_negative=np.int64(0)))
    grid, block = rt._grid, rt._threads
    rows.append(("session.launch(validate, same args)", _median_ns(
        lambda: session.launch(kernel, grid, block, vargs), args.repeat, drain)))
    rows.append(("launcher.params.pack (same args)", _median_ns(lambda: launcher.params.pack(vargs), args.repeat)))
    fresh = list(vargs)

    def pack_fresh():
        fresh[0] = tid.view()  # a new object each time: the array writer runs
        launcher.params.pack(fresh)

    rows.append(("pack, one new array arg", _median_ns(pack_fresh, args.repeat)))
    launcher.params.pack(vargs)
    f, s, p, dims = launcher._func, launcher._stream, launcher.params.address, (grid, 1, 1, block, 1, 1)
    launch = launcher._launch
    rows.append((f"bare driver launch ({launch.__name__})", _median_ns(
        lambda: launch(f, *dims, 0, s, p, 0), args.repeat, drain)))
    # The same launch through ctypes, for comparison only (how much of it is the binding's).
    import ctypes

    try:
        raw = ctypes.CDLL("libcuda.so.1").cuLaunchKernel
        raw.restype = ctypes.c_int
        raw.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
        fi, si = int(f), int(s)
        rows.append(("same launch through ctypes",
                     _median_ns(lambda: raw(fi, *dims, 0, si, p, None), args.repeat, drain)))
    except (OSError, AttributeError, TypeError) as exc:  # informational only
        rows.append((f"ctypes launch not timed ({type(exc).__name__})", float("nan")))
    rt.synchronize()

    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        for i in range(args.profile):
            one_round()
            if i % 10 == 9:
                rt.synchronize()
        prof.disable()
        rt.synchronize()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(30)
        if me == 0:
            print(buf.getvalue())

    rt.close()
    session.close()
    if me == 0:
        print(f"host_costs ranks={R} T={T} hidden={cfg.hidden} repeat={args.repeat} "
              f"python={sys.version.split()[0]}")
        print(f"{'what':<44} {'host us (median)':>16}")
        for name, us in rows:
            print(f"{name:<44} {us:>16.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
