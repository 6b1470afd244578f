"""The fixed cost of a CUDA graph of do-nothing kernels shaped like the EP kernels (GPU machine):

    mpirun -np 1 -x PYTHONPATH python3 tests/gpu/launch_floor.py

What no kernel body can go below: one or two kernels of the EP grid (one block of 512 threads per
SM) that only trigger and wait for their dependents (``ep_runtime/kernels/pdl.py``), launched through the
session's fast launcher (PDL where marked), captured in one CUDA graph and timed as the bench
times a graph (a spin kernel first, then CUDA events around the launch; median of 50). Variants:
one array argument; the same without PDL; 24 array arguments read by every block and 32 KB of
static shared memory (dispatch_async has 26 arguments and 33.8 KB). Run without
``EP_RUNTIME_KERNEL_CACHE`` (these kernels link no NVSHMEM). Prints a table last (us).
"""

from __future__ import annotations

import harness
import numpy as np

N_ARGS = 24
SAMPLES = 50
WARMUP = 10


def _kernels(cuda, int32, pdl):
    """(small, big): kernel factories (a fresh dispatcher each call)."""

    def small():
        @cuda.jit
        def k(a):
            pdl.trigger_dependents()
            pdl.dependency_wait()
            if cuda.threadIdx.x == 0 and a[0] == 12345:
                a[1] = 1

        return k

    params = ", ".join(f"a{i}" for i in range(N_ARGS))
    total = " + ".join(f"a{i}[0]" for i in range(N_ARGS))
    src = (f"def k({params}):\n"
           "    s = cuda.shared.array(8192, int32)\n"
           "    pdl.trigger_dependents()\n"
           "    pdl.dependency_wait()\n"
           "    s[cuda.threadIdx.x] = a0[0]\n"
           "    cuda.syncthreads()\n"
           f"    v = {total}\n"
           "    if cuda.threadIdx.x == 0 and v == 12345 + s[3]:\n"
           "        a0[1] = 1\n")

    def big():
        ns = {"cuda": cuda, "int32": int32, "pdl": pdl}
        exec(src, ns)  # noqa: S102 - N_ARGS parameters, generated
        return cuda.jit(ns["k"])

    return small, big


def main() -> int:
    import cupy
    import numba
    from numba import cuda, int32

    from ep_runtime.tools.bench.measure import DeviceSpin, EventClock, _capture
    from ep_runtime.kernels import pdl

    session = harness.open_job_session(extra_bytes=64 << 20)
    stream = session.stream
    grid, block = session.sm_count(), 512
    small, big = _kernels(cuda, int32, pdl)
    a = cupy.zeros(16, cupy.int32)
    sig = (numba.typeof(cuda.as_cuda_array(a)),)
    variants = {}
    for name, make, n_args, programmatic in (("1 argument", small, 1, True), ("1 argument, no PDL", small, 1, False),
                                             (f"{N_ARGS} arguments + 32 KB shared", big, N_ARGS, True)):
        kernels = []
        for _ in range(2):
            k = make()
            if programmatic:
                pdl.programmatic(k)
            session.precompile(k, sig * n_args)
            kernels.append(k)
        variants[name] = (kernels, (a,) * n_args)
    spin, clock = DeviceSpin(stream, 200.0), EventClock(session)
    rows = []
    for name, (kernels, args) in variants.items():
        for n_kernels in (1, 2):
            graph = _capture(stream, [lambda k=k: session.launch(k, grid, block, args) for k in kernels[:n_kernels]])
            xs = []
            for i in range(WARMUP + SAMPLES):
                spin()
                e0 = clock.mark()
                graph.launch(stream)
                e1 = clock.mark()
                if i >= WARMUP:
                    xs.append(clock.elapsed_us(e0, e1))
            rows.append((name, n_kernels, *np.percentile(xs, [50, 10, 90])))
    session.close()
    print(f"launch floor: CUDA graphs of empty kernels, grid {grid} x {block}; launches {dict(session.launch_counts)}")
    print(f"{'kernels':34} {'n':>2} {'median us':>10} {'p10':>7} {'p90':>7}")
    for name, n_kernels, med, p10, p90 in rows:
        print(f"{name:34} {n_kernels:2d} {med:10.2f} {p10:7.2f} {p90:7.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
