"""How fast can one GPU read and reduce the expanded combine's expert rows? (GPU, no MPI):

    python3 tests/gpu/combine_read_probe.py [--tokens 4096] [--hidden 7168]

The expanded combine's sender (combine_async) reads each token's ~4 expert rows (0.47 GB at
T=4096, hidden 7168, top-8 of 256, 2 ranks), weights them and sums them in float32, one warp per
(token, source). Nsight Compute (docs/plans.md) found it far below device-memory
bandwidth, its warps waiting on their row loads: 16 warps per SM (the 128-register cap at 512
threads), each with 2 KB in flight (one row's 4 16-byte words per lane, rows one after another).
This probe times that read-and-reduce pattern alone, without NVLink, on random rows of a
buffer as large as the expanded batch, in three forms:

- ``reg``: the kernel's pattern (rows one after another, ``UP`` 16-byte words per lane in
  registers), one block of 512 threads per SM (``x1``), or as many blocks as fit (``xN``);
- ``stage``: each step's words of *every* row of the token copied into shared memory with
  ``cp.async`` (no register holds them in flight), then reduced from there; ``UP`` words per
  lane and row, single or double buffered (the next step's copies issued before this step is
  reduced), in dynamic shared memory.

Every form sums the rows in the same order (row j ascending, float32 from 0, rounded to bf16
once), so their outputs must be equal; one is checked against NumPy. Compiled with NVRTC
through CuPy. Prints a table last: us per pass, GB/s read, and the factor over ``reg x1``.
"""

from __future__ import annotations

import argparse

import harness
import numpy as np

SOURCE = r"""
__device__ __forceinline__ unsigned int bf16_bits(float f) {  // round to nearest even (no NaN here)
  unsigned int u = __float_as_uint(f);
  return (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
}
__device__ __forceinline__ void acc8(float* a, uint4 v, float w) {
  unsigned int p[4] = {v.x, v.y, v.z, v.w};
  #pragma unroll
  for (int i = 0; i < 4; ++i) {
    a[2 * i] += w * __uint_as_float(p[i] << 16);
    a[2 * i + 1] += w * __uint_as_float(p[i] & 0xFFFF0000u);
  }
}
__device__ __forceinline__ uint4 pack8(const float* a) {
  unsigned int p[4];
  #pragma unroll
  for (int i = 0; i < 4; ++i) p[i] = bf16_bits(a[2 * i]) | (bf16_bits(a[2 * i + 1]) << 16);
  return make_uint4(p[0], p[1], p[2], p[3]);
}

// rows one after another, UP words per lane in registers (combine_async's pair loop)
extern "C" __global__ void reduce_reg(const uint4* __restrict__ x, const int* __restrict__ trows,
                                      const int* __restrict__ nloc, const float* __restrict__ w,
                                      uint4* __restrict__ out, int items, int W16, int K) {
  int lane = threadIdx.x & 31;
  int q = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  int nw = (gridDim.x * blockDim.x) >> 5;
  for (; q < items; q += nw) {
    int n = nloc[q];
    for (int base = 0; base < W16; base += 32 * UP) {
      float a[UP * 8];
      #pragma unroll
      for (int i = 0; i < UP * 8; ++i) a[i] = 0.f;
      for (int j = 0; j < n; ++j) {
        int r = trows[q * K + j];
        float wt = w[r];
        uint4 v[UP];
        #pragma unroll
        for (int u = 0; u < UP; ++u) {
          int c = base + u * 32 + lane;
          v[u] = c < W16 ? x[(size_t)r * W16 + c] : make_uint4(0, 0, 0, 0);
        }
        #pragma unroll
        for (int u = 0; u < UP; ++u) acc8(a + 8 * u, v[u], wt);
      }
      #pragma unroll
      for (int u = 0; u < UP; ++u) {
        int c = base + u * 32 + lane;
        if (c < W16) out[(size_t)q * W16 + c] = pack8(a + 8 * u);
      }
    }
  }
}

__device__ __forceinline__ void cp16(void* smem, const void* gmem) {
  unsigned int s = (unsigned int)__cvta_generic_to_shared(smem);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(s), "l"(gmem) : "memory");
}

// each step's words of every row into shared memory (cp.async), then reduced from there;
// BUF buffers (2: the next step's copies are in flight while this one is reduced)
extern "C" __global__ void reduce_stage(const uint4* __restrict__ x, const int* __restrict__ trows,
                                        const int* __restrict__ nloc, const float* __restrict__ w,
                                        uint4* __restrict__ out, int items, int W16, int K) {
  extern __shared__ uint4 stage[];  // [warps][BUF][KS][UP][32]
  int lane = threadIdx.x & 31;
  int wib = threadIdx.x >> 5;
  uint4* mine = stage + (size_t)wib * BUF * KS * UP * 32;
  int q = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  int nw = (gridDim.x * blockDim.x) >> 5;
  for (; q < items; q += nw) {
    int n = min(nloc[q], KS);
    int my_r = lane < n ? trows[q * K + lane] : 0;
    float my_w = lane < n ? w[my_r] : 0.f;
    int steps = (W16 + 32 * UP - 1) / (32 * UP);
    // issue step s into buffer s % BUF
    auto issue = [&](int s) {
      uint4* buf = mine + (size_t)(s % BUF) * KS * UP * 32;
      for (int j = 0; j < n; ++j) {
        int r = __shfl_sync(0xffffffffu, my_r, j);
        #pragma unroll
        for (int u = 0; u < UP; ++u) {
          int c = s * 32 * UP + u * 32 + lane;
          if (c < W16) cp16(buf + (j * UP + u) * 32 + lane, x + (size_t)r * W16 + c);
        }
      }
      asm volatile("cp.async.commit_group;" ::: "memory");
    };
    #pragma unroll
    for (int s = 0; s < BUF - 1; ++s) if (s < steps) issue(s);
    for (int s = 0; s < steps; ++s) {
      if (s + BUF - 1 < steps) issue(s + BUF - 1);
      else asm volatile("cp.async.commit_group;" ::: "memory");  // keep the group count
      asm volatile("cp.async.wait_group %0;" :: "n"(BUF - 1) : "memory");
      uint4* buf = mine + (size_t)(s % BUF) * KS * UP * 32;
      float a[UP * 8];
      #pragma unroll
      for (int i = 0; i < UP * 8; ++i) a[i] = 0.f;
      for (int j = 0; j < n; ++j) {
        float wt = __shfl_sync(0xffffffffu, my_w, j);
        #pragma unroll
        for (int u = 0; u < UP; ++u) {
          int c = s * 32 * UP + u * 32 + lane;
          if (c < W16) acc8(a + 8 * u, buf[(j * UP + u) * 32 + lane], wt);
        }
      }
      #pragma unroll
      for (int u = 0; u < UP; ++u) {
        int c = s * 32 * UP + u * 32 + lane;
        if (c < W16) out[(size_t)q * W16 + c] = pack8(a + 8 * u);
      }
      __syncwarp();  // every lane has read this buffer before it is filled again
    }
    asm volatile("cp.async.wait_all;" ::: "memory");
  }
}
"""


def routing(tokens: int, ranks: int, experts: int, top_k: int, seed: int):
    """Rank 0's items (token, source) with local experts, their rows in an expert-major batch,
    and the batch's row count: what combine_async reads on rank 0."""
    rng = np.random.default_rng(seed)
    L = experts // ranks
    ids = np.stack([rng.permutation(experts)[:top_k] for _ in range(tokens * ranks)]).astype(np.int64)
    local = ids < L  # rank 0 holds experts [0, L)
    # expert-major rows: rows of expert e in item order
    order = [[] for _ in range(L)]
    for q in range(len(ids)):
        for e in sorted(ids[q][local[q]]):
            order[e].append(q)
    first = np.cumsum([0] + [len(o) for o in order])
    rows_of = [[] for _ in range(len(ids))]
    for e in range(L):
        for i, q in enumerate(order[e]):
            rows_of[q].append(first[e] + i)
    items = [q for q in range(len(ids)) if rows_of[q]]
    K = top_k
    trows = np.zeros((len(items), K), np.int32)
    nloc = np.zeros(len(items), np.int32)
    for i, q in enumerate(items):
        nloc[i] = len(rows_of[q])
        trows[i, :nloc[i]] = rows_of[q]
    return trows, nloc, int(first[-1])


def blocks_per_sm(regs: int, threads: int, shared: int) -> int:
    """Resident blocks per SM on sm_90 from the kernel's registers and shared bytes (CuPy's
    RawKernel exposes no occupancy call): 64 K registers (256 per warp granule), 2,048 threads,
    228 KB shared (1 KB reserved per block), at most 32 blocks."""
    warps = threads // 32
    by_regs = 65536 // (-(-regs * 32 // 256) * 256 * warps)
    by_threads = 2048 // threads
    by_shared = 228 * 1024 // (shared + 1024)
    return max(1, min(by_regs, by_threads, by_shared, 32))


def main() -> int:
    ap = argparse.ArgumentParser()
    harness.add_layer_options(ap, tokens=4096)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args()
    import cupy

    dev = cupy.cuda.Device()
    sms = dev.attributes["MultiProcessorCount"]
    trows, nloc, C = routing(args.tokens, args.ranks, args.experts, args.top_k, 5)
    W16 = args.hidden * 2 // 16
    rng = np.random.default_rng(6)
    x = cupy.asarray(rng.integers(0x3C00, 0x4000, (C, W16 * 8), dtype=np.uint16))  # bf16 in [1, 2)
    w = cupy.asarray(rng.random(C, dtype=np.float32))
    d_trows, d_nloc = cupy.asarray(trows), cupy.asarray(nloc)
    items = len(nloc)
    read_bytes = int(nloc.sum()) * W16 * 16
    K = args.top_k

    forms = [("reg", dict(UP=4), 512, 1), ("reg", dict(UP=4), 512, 0), ("reg", dict(UP=4), 256, 0),
             ("stage", dict(UP=2, KS=8, BUF=1), 512, 0), ("stage", dict(UP=2, KS=8, BUF=2), 256, 0),
             ("stage", dict(UP=4, KS=8, BUF=1), 256, 0), ("stage", dict(UP=1, KS=8, BUF=2), 512, 0),
             ("stage", dict(UP=2, KS=8, BUF=2), 512, 0)]
    results, outs = [], {}
    for name, defs, threads, one_per_sm in forms:
        opts = tuple(f"-D{k}={v}" for k, v in defs.items()) + ("-std=c++17",)
        if name == "reg":
            opts += ("-DKS=1", "-DBUF=1")
        mod = cupy.RawModule(code=SOURCE, options=opts)
        k = mod.get_function(f"reduce_{name}")
        shared = 0
        if name == "stage":
            shared = threads // 32 * defs["BUF"] * defs["KS"] * defs["UP"] * 32 * 16
            if shared > 227 * 1024:
                continue
            k.max_dynamic_shared_size_bytes = shared
        per_sm = 1 if one_per_sm else blocks_per_sm(k.num_regs, threads, shared)
        grid = sms * per_sm
        out = cupy.zeros((items, W16 * 8), cupy.uint16)
        launch = lambda: k((grid,), (threads,), (x, d_trows, d_nloc, w, out, np.int32(items), np.int32(W16),  # noqa: E731
                                                   np.int32(K)), shared_mem=shared)
        launch()
        dev.synchronize()
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        times = []
        for _ in range(args.repeat):
            start.record()
            launch()
            stop.record()
            stop.synchronize()
            times.append(cupy.cuda.get_elapsed_time(start, stop) * 1e3)
        us = float(np.median(times))
        label = f"{name} {' '.join(f'{a}={b}' for a, b in defs.items())} t={threads} x{per_sm} regs={k.num_regs}"
        outs[label] = cupy.asnumpy(out)
        results.append((label, us, read_bytes / us / 1e3, shared))
    # every form's sums equal; one item against NumPy
    ref_label = results[0][0]
    for label, *_ in results:
        assert np.array_equal(outs[label], outs[ref_label]), f"{label} differs from {ref_label}"
    q = int(np.argmax(nloc))
    xs = cupy.asnumpy(x[trows[q, :nloc[q]]]).astype(np.uint32) << 16
    ws = cupy.asnumpy(w)[trows[q, :nloc[q]]]
    acc = np.zeros(W16 * 8, np.float32)
    for j in range(nloc[q]):
        acc += ws[j] * xs[j].view(np.float32)
    got = (outs[ref_label][q].astype(np.uint32) << 16).view(np.float32)
    assert np.allclose(got, acc, rtol=2 ** -7), "the sums disagree with NumPy"
    base = results[0][1]
    print(f"items {items} rows {int(nloc.sum())} buffer {C * W16 * 16 / 2**20:.0f} MiB read {read_bytes / 2**20:.0f} MiB")
    print(f"{'form':58s} {'us':>8s} {'GB/s':>7s} {'shared KB':>9s} {'x reg x1':>8s}")
    for label, us, gbs, shared in results:
        print(f"{label:58s} {us:8.1f} {gbs:7.0f} {shared // 1024:9d} {base / us:8.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
