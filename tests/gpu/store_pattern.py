"""How fast dispatch_async's store pattern alone moves bytes to a peer (2 ranks, one per GPU):

    mpirun -np 2 -x PYTHONPATH python3 tests/gpu/store_pattern.py [--tokens 4096] [--hidden 7168]

Why: dispatch_async moved bytes to its peer at the same rate with NVSHMEM puts as with peer
stores, slower than a copy-engine copy into the peer's array (docs/plans.md). This script
times the pattern without the rest of the kernel: each warp takes token rows (grid-strided),
each lane loads ``UP`` word pairs (16 bytes each) before it stores any, and stores them to
every destination of the row through the NVLink mapping (``ep_runtime/kernels/vec.py``: ``load_pairs``,
``store_pairs_at``), row ``me * T + t`` of a symmetric [R * T, W] array on each destination;
both ranks at once, a system fence at the end of each warp's rows. Destinations per row:

- ``peer``: the other rank only (the ceiling case: one 16-byte NVLink store per load);
- ``peer+self``: both ranks (a remote and a local store per load);
- ``routing``: the ranks of the row's top-k experts (``--top-k`` of ``--experts``, random:
  what dispatch_async does; with 8 of 256 on 2 ranks nearly every row goes to both).

Swept: pairs in flight per lane (``--unroll``), threads per block (``--threads``) and blocks
(``--blocks``; 0 = one per SM). Each configuration: CUDA events around the kernel, a barrier
before each sample, median of ``--samples``; GB/s counts the bytes stored into the peer's
memory per direction. The copy engine's ``cupy`` copy into the peer's array is timed in the same
run as the ceiling. Prints a table last (rank 0). Measures only.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import harness
import numpy as np


def make_rows_to_destinations(up: int, warp: int = 32):
    """A kernel ``(src [T, W] uint64, bases [R] uint64, masks [T] uint64, row0, row_bytes)``:
    row t of ``src`` stored at ``bases[d] + (row0 + t) * row_bytes`` for every bit d of
    ``masks[t]``, ``up`` word pairs per lane in flight."""
    from numba import cuda, uint64

    from ep_runtime.kernels.vec import make_pair_loops

    load_pairs, _, store_pairs_at = make_pair_loops(up, warp)

    @cuda.jit
    def rows_to_destinations(src, bases, masks, row0, row_bytes):
        lo = cuda.local.array(up, uint64)
        hi = cuda.local.array(up, uint64)
        warps = cuda.blockDim.x // warp
        lane = cuda.threadIdx.x % warp
        T, W = src.shape
        t = cuda.blockIdx.x * warps + cuda.threadIdx.x // warp
        while t < T:
            m = masks[t]
            at = uint64(row0 + t) * uint64(row_bytes)
            w = 2 * lane
            while w < W:
                load_pairs(src[t], w, W, lo, hi)
                for d in range(bases.shape[0]):
                    if (m >> uint64(d)) & uint64(1):
                        store_pairs_at(bases[d] + at, w, W, lo, hi)
                w += 2 * up * warp
            t += cuda.gridDim.x * warps
        cuda.threadfence_system()

    return rows_to_destinations


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    harness.add_layer_options(ap, tokens=4096)
    ap.add_argument("--unroll", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--threads", type=int, nargs="+", default=[256, 512, 1024])
    ap.add_argument("--blocks", type=int, nargs="+", default=[16, 32, 64, 0, 264],
                    help="blocks per launch (0: one per SM); how few SMs reach the link's rate matters to overlap")
    ap.add_argument("--patterns", nargs="+", default=["peer", "peer+self", "routing"])
    ap.add_argument("--samples", type=int, default=20)
    args = ap.parse_args()

    import cupy

    from ep_runtime.tools.bench.measure import DeviceSpin, EventClock

    comm = harness.job_comm()
    R, me = comm.Get_size(), comm.Get_rank()
    T, W = args.tokens, args.hidden // 4  # bf16 rows as uint64 words
    row_bytes = W * 8
    session = harness.open_job_session(extra_bytes=R * T * row_bytes + (64 << 20))
    dst = session.alloc_symmetric("store_pattern.dst", (R * T * row_bytes,), np.uint8)
    bases_host = session.peer_addresses(dst)
    if bases_host is None or R < 2:
        print("store_pattern: needs 2+ ranks whose heaps are mapped (NVLink peers)")
        return 2
    bases = cupy.asarray(np.array(bases_host, np.uint64))
    rng = np.random.default_rng(1 + me)
    src = cupy.asarray(rng.integers(0, 1 << 62, size=(T, W), dtype=np.uint64))
    L = args.experts // R
    routing = np.zeros(T, np.uint64)
    for t in range(T):
        for e in rng.choice(args.experts, size=args.top_k, replace=False):
            routing[t] |= np.uint64(1) << np.uint64(e // L)
    peer = (me + 1) % R
    masks = {"peer": np.full(T, 1 << peer, np.uint64),
             "peer+self": np.full(T, (1 << peer) | (1 << me), np.uint64),
             "routing": routing}
    clock = EventClock(session)
    sms = session.sm_count()
    rows = []

    src_peer = session.peer_view(dst, peer)  # the copy engine's ceiling, same bytes as the "peer" pattern
    chunk = src_peer[me * T * row_bytes:(me + 1) * T * row_bytes]
    flat = src.view(np.uint8).reshape(-1)
    ce = []
    for _ in range(args.samples + 2):
        session.barrier()
        a = clock.mark()
        chunk.data.copy_from_device_async(flat.data, flat.nbytes, stream=session.stream)
        ce.append(clock.elapsed_us(a, clock.mark()))
    ce_us = statistics.median(ce[2:])
    rows.append(("copy engine (cupy)", "-", "-", "-", ce_us, T * row_bytes / (ce_us * 1e3)))

    from numba import cuda as numba_cuda

    kernels = {up: make_rows_to_destinations(up) for up in args.unroll}
    nb_stream = numba_cuda.external_stream(int(session.core_stream.handle))
    spin = DeviceSpin(session.stream, 300.0)  # longer than the host's Numba launch, which stays outside the events
    for pattern in args.patterns:
        m = cupy.asarray(masks[pattern])
        to_peer = int(((masks[pattern] >> np.uint64(peer)) & np.uint64(1)).sum()) * row_bytes
        for up, kernel in kernels.items():
            for threads in args.threads:
                for blocks in args.blocks:
                    grid = blocks or sms
                    launch = kernel[grid, threads, nb_stream]
                    times = []
                    for _ in range(args.samples + 2):
                        session.barrier()
                        spin()
                        a = clock.mark()
                        launch(src, bases, m, me * T, row_bytes)
                        times.append(clock.elapsed_us(a, clock.mark()))
                    us = statistics.median(times[2:])
                    rows.append((pattern, up, threads, grid, us, to_peer / (us * 1e3)))
    session.barrier()
    session.free_symmetric(dst)
    session.close()
    all_rows = harness.gather(rows)
    if me == 0:
        print(f"store_pattern ranks={R} T={T} hidden={args.hidden} row_bytes={row_bytes} samples={args.samples}")
        print(f"{'pattern':<20} {'pairs':>5} {'threads':>7} {'blocks':>6} "
              + " ".join(f"{'r' + str(r) + ' us':>9} {'GB/s':>6}" for r in range(R)))
        for i, row in enumerate(all_rows[0]):
            cells = " ".join(f"{rr[i][4]:>9.1f} {rr[i][5]:>6.1f}" for rr in all_rows)
            print(f"{row[0]:<20} {row[1]!s:>5} {row[2]!s:>7} {row[3]!s:>6} {cells}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
