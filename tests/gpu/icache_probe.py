"""What executing code for the first time costs (GPU machine, no MPI):

    python3 tests/gpu/icache_probe.py

Each kernel runs N float FMAs per thread (8 independent chains), either as N lines of
straight-line code executed once (every instruction fetched cold by each SM) or as a loop body
of 500 lines run N / 500 times (fetched once, then warm), one block per SM, with blocks of 32
or 512 threads; time from ``%globaltimer`` inside the kernel (median over blocks, median of 30
launches). The difference is the instruction fetch a kernel pays for code it runs once, as the
EP kernels do per call (docs/plans.md). Compiled with NVRTC through CuPy
(Numba takes minutes on thousands of straight lines). Prints a table last.
"""

from __future__ import annotations

import numpy as np

CHAINS = 8
SHAPES = ((1000, 1), (4000, 1), (8000, 1), (500, 2), (500, 8), (500, 16))


def source(n_lines: int, reps: int) -> str:
    """CUDA C of a kernel running ``n_lines`` FMAs ``reps`` times (a loop kept rolled)."""
    body = "\n".join(f"    x{i % CHAINS} = fmaf(x{i % CHAINS}, m, c);" for i in range(n_lines))
    inits = "".join(f"  float x{j} = a[{j + 2}];\n" for j in range(CHAINS))
    total = " + ".join(f"x{j}" for j in range(CHAINS))
    return ('extern "C" __global__ void k(const float* a, long long* out) {\n'
            '  unsigned long long t0, t1;\n  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));\n'
            f"  float m = a[0], c = a[1];\n{inits}"
            f"  #pragma unroll 1\n  for (int r = 0; r < {reps}; ++r) {{\n{body}\n  }}\n"
            '  __syncthreads();\n  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t1));\n'
            f"  float s = {total};\n"
            "  if (threadIdx.x == 0) { out[2 * blockIdx.x] = (long long)(t1 - t0); "
            "out[2 * blockIdx.x + 1] = (long long)s; }\n}\n")


def main() -> int:
    import cupy

    a = cupy.full(16, 1.0001, cupy.float32)
    grid = cupy.cuda.Device().attributes["MultiProcessorCount"]
    out = cupy.zeros((grid, 2), cupy.int64)
    kernels, rows = {}, []
    for threads in (32, 512):
        for n_lines, reps in SHAPES:
            if (n_lines, reps) not in kernels:
                kernels[n_lines, reps] = cupy.RawKernel(source(n_lines, reps), "k")
            k = kernels[n_lines, reps]
            k((grid,), (threads,), (a, out))
            cupy.cuda.Device().synchronize()
            times = []
            for _ in range(30):
                k((grid,), (threads,), (a, out))
                times.append(np.median(cupy.asnumpy(out)[:, 0]))
            rows.append((threads, n_lines, reps, np.median(times) / 1e3))
    print(f"{'threads':>7} {'lines':>6} {'runs':>5} {'FMAs':>6} {'us in kernel':>13}")
    for threads, n_lines, reps, us in rows:
        print(f"{threads:7d} {n_lines:6d} {reps:5d} {n_lines * reps:6d} {us:13.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
