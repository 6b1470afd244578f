"""Timing of the four calls (eager and CUDA-graph replay), the link and memory ceilings, and
the baselines.

Every sample starts with a barrier of all ranks. On GPUs times come from CUDA events on the
session stream (so they include any host launch gap inside the measured span, as a caller
would see it); on the simulator from the host clock (kernels run synchronously there).

Graph mode (:func:`time_graph_round_trips`, GPUs only) captures CUDA graphs of the calls on the
session stream, the way ``tests/gpu/ep_check.py`` (``replay_graph``) does, and times each replay
with events recorded *outside* the graphs (events recorded during a capture become graph nodes,
not timings). Its samples start on the device: after the host barrier, a short spin kernel
(:class:`DeviceSpin`) holds the stream while the host enqueues an on-stream barrier, the start
event and the graph, so every rank's graph starts as its GPU leaves the barrier. (Started by the
host, a rank whose host launched late made its peer's wait kernel wait: wide full-round p90s
with tight medians: docs/plans.md.)
"""

from __future__ import annotations

import inspect
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


class DeviceSpin:
    """A one-thread kernel that spins for about ``us`` microseconds on ``stream`` (CuPy), so the
    host can enqueue what follows before the GPU reaches it (GPUs only)."""

    def __init__(self, stream, us: float):
        import cupy

        self.stream = stream
        self._kernel = cupy.RawKernel(r"""
        extern "C" __global__ void spin(long long cycles) {
            long long t0 = clock64();
            while (clock64() - t0 < cycles) { }
        }""", "spin")
        rate_khz = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.runtime.getDevice())["clockRate"]
        self.cycles = np.int64(us * rate_khz / 1e3)

    def __call__(self):
        if self.cycles > 0:
            self._kernel((1,), (1,), (self.cycles,), stream=self.stream)


def time_round_trips(rt, session, inputs, expert_out, out, samples: int, warmup: int,
                     layout: str = "expanded") -> dict:
    """Samples (us) of each span of :data:`SPANS` over ``warmup + samples`` round trips, with
    dispatch_wait and combine_async in ``layout`` (``expert_out`` shaped for it). ``inputs``:
    dispatch_async's (tokens, topk_ids, topk_weights), or with a fourth item, a dict of its
    keywords (pre-quantized codes as the tokens: ``token_scales``, NVFP4's
    ``token_global_scale``)."""
    clock = clock_for(session)
    tokens, ids, weights, kw = _dispatch_inputs(inputs)
    spans = {name: [] for name in SPANS}
    for i in range(warmup + samples):
        session.barrier()
        m = [clock.mark()]
        h = rt.dispatch_async(tokens, ids, weights, **kw)
        m.append(clock.mark())
        batch = rt.dispatch_wait(h, **_layout(layout))
        m.append(clock.mark())
        session.barrier()
        m.append(clock.mark())
        ch = rt.combine_async(expert_out, batch.handle, **_layout(layout))
        m.append(clock.mark())
        rt.combine_wait(ch, out=out)
        m.append(clock.mark())
        if i >= warmup:
            for name, (a, b) in SPANS.items():
                spans[name].append(clock.elapsed_us(m[a], m[b]))
    rt.synchronize()
    return spans


#: Graph mode's CUDA graphs, in capture order: per round trip, its phases (a barrier before
#: each), each phase a list of (span name, calls captured in that graph). The first round trip
#: has one graph per phase (the ``dispatch`` and ``combine`` spans); the second one graph per
#: call (the four halves). Each round trip walks the runtime's host state machine once, in the
#: legal order (idle -> dispatch sent -> dispatched -> combine sent -> idle), so capturing
#: them back to back is legal; a capture advances only the host state (nothing runs), and a
#: replay advances only the device state (call numbers and signals live in device memory), so
#: replaying a round trip's graphs in order is a complete call on the device.
GRAPH_ROUND_TRIPS = (
    ((("dispatch", ("dispatch_async", "dispatch_wait")),), (("combine", ("combine_async", "combine_wait")),)),
    ((("dispatch_async", ("dispatch_async",)), ("dispatch_wait", ("dispatch_wait",))),
     (("combine_async", ("combine_async",)), ("combine_wait", ("combine_wait",)))),
)


def takes_device_token_count(rt) -> bool:
    """Whether ``rt.dispatch_async`` takes ``n_tokens=`` (a [1] int32 device array holding the
    number of valid rows, read on the device: one graph captured at capacity serves any T)."""
    return "n_tokens" in inspect.signature(rt.dispatch_async).parameters


def _dispatch_inputs(inputs) -> tuple:
    """(tokens, topk_ids, topk_weights, keywords) of dispatch_async from the bench's ``inputs``:
    three arrays, or four with dispatch_async's keywords last (pre-quantized input:
    ``token_scales`` and, NVFP4, ``token_global_scale``)."""
    tokens, ids, weights, *rest = inputs
    return tokens, ids, weights, dict(rest[0]) if rest else {}


def _layout(layout: str) -> dict:
    """The ``layout=`` keyword for the runtime's calls (none for the default, so a runtime
    without layouts is still timed)."""
    return {} if layout == "expanded" else {"layout": layout}


def _round_trip_calls(rt, inputs, expert_out, out, n_tokens, layout: str = "expanded") -> dict:
    """The four calls of one round trip as argument-less functions, threading the handles
    (``inputs`` as in :func:`time_round_trips`)."""
    tokens, ids, weights, kw = _dispatch_inputs(inputs)
    if n_tokens is not None:
        kw = {**kw, "n_tokens": n_tokens}
    st = {}

    def dispatch_async():
        st["h"] = rt.dispatch_async(tokens, ids, weights, **kw)

    def dispatch_wait():
        st["b"] = rt.dispatch_wait(st["h"], **_layout(layout))

    def combine_async():
        st["c"] = rt.combine_async(expert_out, st["b"].handle, **_layout(layout))

    def combine_wait():
        rt.combine_wait(st["c"], out=out)

    return {"dispatch_async": dispatch_async, "dispatch_wait": dispatch_wait,
            "combine_async": combine_async, "combine_wait": combine_wait}


def _capture(stream, fns):
    """One CUDA graph of ``fns`` on ``stream`` (CuPy ``begin_capture`` / ``end_capture``, as in
    ep_check.py). The capture is ended even when a call raises, so the stream stays usable."""
    stream.begin_capture()
    try:
        for fn in fns:
            fn()
    except BaseException:
        try:
            stream.end_capture()
        except Exception:  # noqa: BLE001 - the call's error is the one to report
            pass
        raise
    return stream.end_capture()


#: Device spin before each graph-mode phase (us): longer than the host takes to enqueue an
#: on-stream barrier, two events and a graph launch.
START_SPIN_US = 200.0


def time_graph_round_trips(rt, session, inputs, expert_out, out, samples: int, warmup: int,
                           n_tokens=None, stream=None, layout: str = "expanded") -> dict:
    """Samples (us) of each span of :data:`SPANS`, from CUDA graph replays (GPUs only).

    Captures the graphs of :data:`GRAPH_ROUND_TRIPS` on ``stream`` (default the session
    stream; the on-stream barrier is always on the session stream, so on a GPU pass no other),
    passing ``n_tokens`` (a [1] int32 device array, see :func:`takes_device_token_count`)
    to ``dispatch_async`` when given. Then, per round trip of graphs, ``warmup + samples`` times:
    for each phase a host barrier, a device spin (:data:`START_SPIN_US`) and an on-stream barrier
    (``session.stream_barrier``: the ranks' graphs start together on the device), then per graph
    an event, the graph's launch, an event. The ``dispatch`` and ``combine`` spans time one graph
    each; the halves one graph per call.
    """
    stream = session.stream if stream is None else stream
    clock = clock_for(session)
    spin = (lambda: None) if session.backend == "sim" else DeviceSpin(stream, START_SPIN_US)  # sim: synchronous
    rt.synchronize()  # eager work done, errors raised before capturing
    session.barrier()
    round_trips = []
    for phases in GRAPH_ROUND_TRIPS:
        calls = _round_trip_calls(rt, inputs, expert_out, out, n_tokens, layout)
        round_trips.append([[(name, _capture(stream, [calls[c] for c in captured])) for name, captured in phase]
                            for phase in phases])
    spans = {name: [] for name in SPANS}
    for phases in round_trips:
        for i in range(warmup + samples):
            marks = []
            for phase in phases:
                session.barrier()
                spin()
                session.stream_barrier()
                for name, graph in phase:
                    a = clock.mark()
                    graph.launch(stream)
                    marks.append((name, a, clock.mark()))
            if i >= warmup:
                for name, a, b in marks:
                    spans[name].append(clock.elapsed_us(a, b))
    rt.synchronize()  # raise any error a replay recorded on the device
    return spans


#: The backward of one MoE layer as runtime calls, per sequence its calls in order: the torch
#: wrappers' (``FusedCombine.backward``'s dispatch of dL/dout with the forward's kept routing,
#: the router weights' gradient home as slot values, ``FusedDispatch.backward``'s unweighted
#: combine on that dispatch), the same with the routing sent again, and 2 + 2 (the weights'
#: gradient in a combine of its own, then a dispatch to combine on).
BACKWARD_SEQUENCES = {"backward": ("dispatch_kept", "slot_values", "combine"),
                      "backward_routing": ("dispatch", "slot_values", "combine"),
                      "backward_2d2c": ("dispatch", "combine", "dispatch", "combine")}


def _backward_calls(rt, inputs, expert_out, out, values, slot_out, n_tokens, layout: str) -> dict:
    """The calls of :data:`BACKWARD_SEQUENCES` as argument-less functions (``inputs`` as in
    :func:`time_round_trips`; each dispatch sends them, as a backward sends dL/dout; the kept
    routing is theirs, kept here from one round trip, collectively). The expanded layout's
    combines are unweighted, as a backward's are."""
    tokens, ids, weights, kw = _dispatch_inputs(inputs)
    if n_tokens is not None:
        kw = {**kw, "n_tokens": n_tokens}
    combine_kw = {**_layout(layout), **({"weights": None} if layout == "expanded" else {})}
    st = {}
    batch = rt.dispatch_wait(rt.dispatch_async(tokens, ids, weights, **kw), **_layout(layout))
    kept = rt.keep_routing(batch.handle)
    rt.combine_wait(rt.combine_async(expert_out, batch.handle, **combine_kw), out=out)
    token_kw = {k: kw[k] for k in ("token_scales", "token_global_scale") if k in kw}

    def dispatch():
        st["b"] = rt.dispatch_wait(rt.dispatch_async(tokens, ids, weights, **kw), **_layout(layout))

    def dispatch_kept():
        st["b"] = rt.dispatch_wait(rt.dispatch_async(tokens, routing=kept, **token_kw), **_layout(layout))

    def slot_values():
        rt.slot_values_wait(rt.slot_values_async(values, st["b"].handle), out=slot_out)

    def combine():
        rt.combine_wait(rt.combine_async(expert_out, st["b"].handle, **combine_kw), out=out)

    return {"dispatch": dispatch, "dispatch_kept": dispatch_kept, "slot_values": slot_values, "combine": combine}


def time_backward(rt, session, inputs, expert_out, out, samples: int, warmup: int, graph: bool,
                  n_tokens=None, layout: str = "expanded") -> dict:
    """Samples (us) of each sequence of :data:`BACKWARD_SEQUENCES` (one MoE layer's backward),
    ``warmup + samples`` times each in turn. Eager: events around the sequence's calls after a
    host barrier. ``graph`` (GPUs): one CUDA graph per sequence, replayed as
    :func:`time_graph_round_trips` replays (host barrier, device spin, on-stream barrier, then
    events around the replay). ``expert_out`` is shaped for ``layout``; the slot values are one
    float32 a batch row."""
    cfg = rt.cfg
    values = session.alloc_local("bench.row_values", (cfg.recv_rows_capacity,), np.float32, fill=1.0)
    slot_out = session.alloc_local("bench.slot_out", (cfg.max_tokens_per_rank, cfg.top_k), np.float32)
    calls = _backward_calls(rt, inputs, expert_out, out, values, slot_out, n_tokens, layout)
    clock = clock_for(session)
    spans = {name: [] for name in BACKWARD_SEQUENCES}
    rt.synchronize()
    session.barrier()
    if graph:
        stream = session.stream
        spin = (lambda: None) if session.backend == "sim" else DeviceSpin(stream, START_SPIN_US)
        graphs = {name: _capture(stream, [calls[c] for c in seq]) for name, seq in BACKWARD_SEQUENCES.items()}
    for i in range(warmup + samples):
        for name, seq in BACKWARD_SEQUENCES.items():
            session.barrier()
            if graph:
                spin()
                session.stream_barrier()
                a = clock.mark()
                graphs[name].launch(stream)
            else:
                a = clock.mark()
                for c in seq:
                    calls[c]()
            b = clock.mark()
            if i >= warmup:
                spans[name].append(clock.elapsed_us(a, b))
    rt.synchronize()  # raise any error a call recorded on the device
    return spans


def ceilings(session, nbytes: int, reps: int) -> dict:
    """Measured in this run (GPUs only): ``nvlink_gbps``, one direction, every rank copying
    ``nbytes`` into the next rank of its node's symmetric array at once (copy engine, through a
    peer view); ``hbm_gbps``, a local device-to-device copy counted as bytes read plus written."""
    import cupy

    R, node = session.n_ranks, session.node_of()
    mates = [(session.rank + i) % R for i in range(1, R) if node[(session.rank + i) % R] == node[session.rank]]
    if not mates:
        nvlink = float("nan")
    else:
        sym = session.alloc_symmetric("bench.nvlink_ceiling", (nbytes,), np.uint8)
        src = session.alloc_local("bench.nvlink_src", (nbytes,), np.uint8, fill=1)
        peer = session.peer_view(sym, mates[0])
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

    _join_nccl(session, "NCCL")
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


def _join_nccl(session, who: str) -> None:
    """Join torch.distributed over NCCL, the session's ranks in its rank order, unless this process
    already has: the torch baselines' group (``close_baselines`` leaves it)."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return
    shared = ranks_sharing_a_gpu(session.allgather_object(_device_uuid()))
    if shared:  # every rank sees the same list, so all skip alike (no rank left in a collective)
        raise RuntimeError(f"ranks {shared} share one GPU (e.g. CUDA MPS); {who} needs a GPU of its own per "
                           f"rank, so this baseline is not run")
    port = session.allgather_object(_free_port() if session.rank == 0 else None)[0]
    torch.cuda.set_device(torch.device("cuda", _device_index()))
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=session.rank,
                            world_size=session.n_ranks)


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


def ranks_sharing_a_gpu(uuids: list) -> list[list[int]]:
    """Groups of ranks (each group in rank order, two or more) whose GPU identifiers in ``uuids``
    (one per rank, by rank) are equal; empty when every rank has a GPU of its own."""
    by_gpu: dict = {}
    for rank, uuid in enumerate(uuids):
        by_gpu.setdefault(uuid, []).append(rank)
    return [ranks for ranks in by_gpu.values() if len(ranks) > 1]


def _device_uuid() -> str:
    """This process's current GPU as a string that is the same in every process using it (its
    PCI bus id; device ordinals differ between processes with different visible devices)."""
    import cupy

    return cupy.cuda.Device().pci_bus_id


def _device_index() -> int:
    import cupy

    return cupy.cuda.Device().id
