"""Timing of the four calls, the link and memory ceilings, and the baselines.

Every sample starts with a barrier of all ranks. On GPUs times come from CUDA events on the
session stream (so they include any host launch gap inside the measured span, as a caller
would see it); on the simulator from the host clock (kernels run synchronously there).
"""

from __future__ import annotations

import time

import numpy as np

#: Round-trip spans recorded per sample: name -> (first mark, last mark).
SPANS = {"dispatch": (0, 2), "dispatch_async": (0, 1), "dispatch_wait": (1, 2),
         "combine": (3, 5), "combine_async": (3, 4), "combine_wait": (4, 5)}


class EventClock:
    """CUDA events on the session stream."""

    def __init__(self, session):
        self.stream = session.stream

    def mark(self):
        import cupy

        e = cupy.cuda.Event()
        e.record(self.stream)
        return e

    @staticmethod
    def elapsed_us(a, b) -> float:
        import cupy

        b.synchronize()
        return cupy.cuda.get_elapsed_time(a, b) * 1e3


class WallClock:
    """The host clock (the simulator runs kernels synchronously)."""

    @staticmethod
    def mark():
        return time.perf_counter()

    @staticmethod
    def elapsed_us(a, b) -> float:
        return (b - a) * 1e6


def clock_for(session):
    return WallClock() if session.backend == "sim" else EventClock(session)


def time_round_trips(rt, session, inputs, expert_out, out, samples: int, warmup: int) -> dict:
    """Samples (us) of each span of :data:`SPANS` over ``warmup + samples`` round trips."""
    clock = clock_for(session)
    tokens, ids, weights = inputs
    spans = {name: [] for name in SPANS}
    for i in range(warmup + samples):
        session.barrier()
        m = [clock.mark()]
        h = rt.dispatch_async(tokens, ids, weights)
        m.append(clock.mark())
        batch = rt.dispatch_wait(h)
        m.append(clock.mark())
        session.barrier()
        m.append(clock.mark())
        ch = rt.combine_async(expert_out, batch.handle)
        m.append(clock.mark())
        rt.combine_wait(ch, out=out)
        m.append(clock.mark())
        if i >= warmup:
            for name, (a, b) in SPANS.items():
                spans[name].append(clock.elapsed_us(m[a], m[b]))
    rt.synchronize()
    return spans


def ceilings(session, nbytes: int, reps: int) -> dict:
    """Measured in this run (GPUs only): ``nvlink_gbps``, one direction, every rank copying
    ``nbytes`` into the next rank's symmetric array at once (copy engine, through a peer
    view); ``hbm_gbps``, a local device-to-device copy counted as bytes read plus written."""
    import cupy

    if session.n_ranks < 2:
        nvlink = float("nan")
    else:
        sym = session.alloc_symmetric("bench.nvlink_ceiling", (nbytes,), np.uint8)
        src = session.alloc_local("bench.nvlink_src", (nbytes,), np.uint8, fill=1)
        peer = session.peer_view(sym, (session.rank + 1) % session.n_ranks)
        nvlink = nbytes / (_median_copy_us(session, peer, src, reps) * 1e3)
        session.barrier()
        session.free_symmetric(sym)
        del src
    a = session.alloc_local("bench.hbm_src", (nbytes,), np.uint8, fill=1)
    b = session.alloc_local("bench.hbm_dst", (nbytes,), np.uint8)
    hbm = 2 * nbytes / (_median_copy_us(session, b, a, reps) * 1e3)
    del a, b
    cupy.get_default_memory_pool().free_all_blocks()
    return {"nvlink_gbps": nvlink, "hbm_gbps": hbm}


def _median_copy_us(session, dst, src, reps: int) -> float:
    clock = EventClock(session)
    times = []
    for _ in range(reps + 2):
        session.barrier()
        a = clock.mark()
        dst.data.copy_from_device_async(src.data, src.nbytes, stream=session.stream)
        b = clock.mark()
        times.append(clock.elapsed_us(a, b))
    return float(np.median(times[2:]))


def nccl_all_to_all(session, sent, recv, hidden: int, perm, samples: int, warmup: int) -> dict:
    """torch.distributed all_to_all_single (NCCL) moving the same rows as our dispatch (one row
    per (token, destination rank)), alone and followed by the permutation (``index_select``
    with ``perm``, [rows] int64) its users run to reach our expert-major layout."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        port = session.allgather_object(_free_port() if session.rank == 0 else None)[0]
        torch.cuda.set_device(torch.device("cuda", _device_index()))
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=session.rank,
                                world_size=session.n_ranks)
    dev = torch.device("cuda", torch.cuda.current_device())
    send = torch.randn(sum(sent), hidden, device=dev).to(torch.bfloat16)
    recv_buf = torch.empty(sum(recv), hidden, device=dev, dtype=torch.bfloat16)
    index = torch.as_tensor(perm, device=dev, dtype=torch.int64)
    out = {"all_to_all": [], "all_to_all+permute": []}
    for i in range(warmup + samples):
        for name in out:
            torch.cuda.synchronize()
            session.barrier()
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            dist.all_to_all_single(recv_buf, send, list(recv), list(sent))
            if name == "all_to_all+permute":
                recv_buf.index_select(0, index)
            e1.record()
            e1.synchronize()
            if i >= warmup:
                out[name].append(e0.elapsed_time(e1) * 1e3)
    return out


def nvshmem_alltoall(session, sent, hidden: int, samples: int, warmup: int) -> dict:
    """nvshmem4py's host ``alltoall`` (TEAM_WORLD) of equal blocks of ``max(sent)`` bf16 rows per
    destination (its API needs equal blocks), on the session stream. Needs
    ``2 * n_ranks * max(sent) * hidden * 2`` bytes of symmetric heap."""
    import nvshmem.core as nvshmem

    R = session.n_ranks
    block = max(max(sent), 1) * hidden * 2  # bytes: moved as uint8 (alltoallmem), whatever the dtype
    src = session.alloc_symmetric("bench.a2a_src", (R * block,), np.uint8)
    dst = session.alloc_symmetric("bench.a2a_dst", (R * block,), np.uint8)
    clock = EventClock(session)
    times = []
    for i in range(warmup + samples):
        session.barrier()
        a = clock.mark()
        nvshmem.alltoall(nvshmem.Teams.TEAM_WORLD, dst, src, stream=session.core_stream)
        b = clock.mark()
        if i >= warmup:
            times.append(clock.elapsed_us(a, b))
    session.barrier()
    session.free_symmetric(dst)
    session.free_symmetric(src)
    return {"nvshmem_alltoall": times}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _device_index() -> int:
    import cupy

    return cupy.cuda.Device().id
