"""Where the time goes, kernel by kernel (run on the GPU machine, one rank per GPU):

    mpirun -np 2 -x PYTHONPATH python3 tests/gpu/kernel_times.py [--tokens 128 4096] [--layout expanded compact]

Every kernel launch of a round trip is bracketed by CUDA events on the session stream (the
session's ``launch`` is wrapped), a barrier before each half. Each half is queued behind a
short spin kernel (``--spin-us``), so the host enqueues all its launches before the GPU reaches
them: the events then time the kernels, not the host's launch gaps (without it, at small T an
event pair spans mostly host time). The table gives each
kernel's median device time (us) per token count and layout, and each kernel's registers per
thread and local (spill) memory per thread, so a kernel that spills or waits long shows. A
wait kernel's time includes waiting for its peers' signals. Prints a table last (rank 0).
"""

from __future__ import annotations

import argparse
import sys

import harness
import numpy as np


def kernel_resources(kernel) -> str:
    """``regs/thread, local bytes/thread`` of a compiled Numba kernel (first overload)."""
    try:
        k = next(iter(kernel.overloads.values()))
        return f"{k.regs_per_thread} regs, {k.local_mem_per_thread} B local"
    except Exception as e:  # noqa: BLE001 - informational only
        return f"? ({type(e).__name__})"


def main() -> int:
    ap = argparse.ArgumentParser()
    harness.add_layer_options(ap, tokens=(128, 4096), token_dtype=True)
    ap.add_argument("--layout", nargs="+", default=["expanded", "compact"])
    ap.add_argument("--samples", type=int, default=50)
    ap.add_argument("--repeat", type=int, default=0,
                    help="also time each kernel (dispatch_async excepted) launched N times back to back in a "
                         "CUDA graph, with the last round trip's arguments, next to empty kernels of the same grid: "
                         "separates a kernel's fixed cost from its work")
    ap.add_argument("--spin-us", type=float, default=300.0,
                    help="device spin queued before each half (0: time eager launches as they come)")
    args = ap.parse_args()
    import cupy

    from ep_runtime import EPRuntime
    from ep_runtime.tools.bench.measure import DeviceSpin

    cfg = harness.layer_config(args, harness.job_comm().Get_size(), max(args.tokens), token_dtype=args.token_dtype)
    session = harness.open_job_session(cfg)
    rt = EPRuntime(cfg, session)
    names = {id(k): n for n, k in rt._kernels.items()}
    stream = session.stream
    launches = []
    plain_launch = session.launch

    def timed_launch(kernel, grid, block, launch_args):
        a = cupy.cuda.Event()
        a.record(stream)
        plain_launch(kernel, grid, block, launch_args)
        b = cupy.cuda.Event()
        b.record(stream)
        launches.append((names.get(id(kernel), "?"), a, b, (kernel, grid, block, launch_args)))

    session.launch = timed_launch
    spin = DeviceSpin(stream, args.spin_us)

    def graph_time(launch_once):
        """us per launch: ``args.repeat`` launches captured in one graph, median of 5 replays."""
        launch_once()  # outside the capture: a first launch loads the module (NVSHMEM's init copies on the legacy stream)
        stream.synchronize()
        session.barrier()
        stream.begin_capture()
        for _ in range(args.repeat):
            launch_once()
        graph = stream.end_capture()
        graph.launch(stream)
        per = []
        for _ in range(5):
            a, b = cupy.cuda.Event(), cupy.cuda.Event()
            a.record(stream)
            graph.launch(stream)
            b.record(stream)
            b.synchronize()
            per.append(cupy.cuda.get_elapsed_time(a, b) * 1e3 / args.repeat)
        session.barrier()
        return float(np.median(per))

    repeated, empty = {}, {}
    if args.repeat:
        from numba import cuda as ncuda

        from ep_runtime.kernels import shmem as kshmem

        @ncuda.jit
        def empty_numba(x):
            if x[0] == 12345:
                x[1] = 0

        @ncuda.jit
        def my_pe_numba(x):
            if x[0] == 12345:
                x[1] = kshmem.my_pe()

        probe = cupy.zeros(2, cupy.int64)
        raw = cupy.RawKernel(r"""extern "C" __global__ void empty_raw(long long* x) { if (x[0] == 12345) x[1] = 0; }""",
                             "empty_raw")
        grid, block = rt._grid, rt._threads
        nstream = ncuda.external_stream(stream.ptr)
        empty["cupy empty"] = graph_time(lambda: raw((grid,), (block,), (probe,), stream=stream))
        empty["numba empty"] = graph_time(lambda: empty_numba[grid, block, nstream](probe))
        empty["numba + nvshmem my_pe"] = graph_time(lambda: my_pe_numba[grid, block, nstream](probe))

    table = {}
    for T, layout, (tok, tid, tw), y, out in harness.round_trip_cases(session, cfg, args.tokens, args.layout):
        times = {}
        for i in range(args.samples + 5):
            launches.clear()
            session.barrier()
            spin()
            b = rt.dispatch_wait(rt.dispatch_async(tok, tid, tw), layout=layout)
            session.barrier()
            spin()
            rt.combine_wait(rt.combine_async(y, b.handle, layout=layout), out=out)
            stream.synchronize()
            if i >= 5:
                for name, a, e, _ in launches:
                    times.setdefault(name, []).append(cupy.cuda.get_elapsed_time(a, e) * 1e3)
        table[T, layout] = {name: float(np.median(v)) for name, v in times.items()}
        if args.repeat:
            session.launch = plain_launch
            for name, _, _, call in launches:
                if name != "dispatch_async":
                    repeated.setdefault((T, layout), {})[name] = graph_time(lambda: plain_launch(*call))
            session.launch = timed_launch
    rt.synchronize()
    resources = {n: kernel_resources(k) for n, k in rt._kernels.items() if n != "validate_routing"}
    session.launch = plain_launch
    rt.close()
    session.close()
    if session.rank == 0:
        print(f"token dtype {args.token_dtype}; spin {args.spin_us} us before each half")
        print(f"kernel resources (block {rt._threads} threads, grid {rt._grid}):")
        for n, res in resources.items():
            print(f"  {n:20} {res}")
        order = ["dispatch_async", "dispatch_wait", "dispatch_copy", "combine_async", "combine_async_rows",
                 "combine_wait"]
        print(f"{'T':>5} {'layout':>8} | " + " ".join(f"{n:>18}" for n in order) + " | sum us (rank 0, median)")
        for (T, layout), per in table.items():
            print(f"{T:>5} {layout:>8} | " + " ".join(f"{per[n]:>18.1f}" if n in per else f"{'-':>18}" for n in order)
                  + f" | {sum(per.values()):.1f}")
        if args.repeat:
            print(f"graph of {args.repeat} back-to-back launches, us per launch (grid {rt._grid} x {rt._threads}):")
            for n, v in empty.items():
                print(f"  {n:24} {v:8.1f}")
            for (T, layout), per in repeated.items():
                print(f"{T:>5} {layout:>8} | " + " ".join(f"{per[n]:>18.1f}" if n in per else f"{'-':>18}"
                                                          for n in order))
    return 0


if __name__ == "__main__":
    sys.exit(main())
