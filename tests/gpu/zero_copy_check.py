"""PyTorch tensors in and out of EPRuntime with no copies, and stream order with torch.

GPU machine (after ``source .devcarry/setup.sh``; one rank per GPU, ``nvshmem`` backend)::

    mpirun -np 2 -x PYTHONPATH python3 tests/gpu/zero_copy_check.py

CPU (the simulator, ranks as processes; tests/test_zero_copy_sim.py runs this)::

    python tests/gpu/zero_copy_check.py --backend sim

On GPUs the runtime is given the CUDA torch tensors themselves (it imports them through DLPack);
on ``sim`` it takes NumPy arrays, so the check hands it NumPy views of CPU tensors (no copy
either). Each rank checks:

- in: for each tensor handed in (tokens, topk_ids, topk_weights to ``dispatch_async``,
  expert_out to ``combine_async``, out to ``combine_wait``), the array ``arrays.to_backend``
  makes of it, and one array argument of the kernels that call launches, have the tensor's
  data pointer (a copy anywhere on the way shows as a FAIL naming both pointers);
- batch out: ``batch.x`` seen from torch through DLPack has the runtime buffer's data pointer,
  and its rows equal :func:`ep_runtime.core.reference.dispatch` exactly;
- out: ``combine_wait(out=tensor)`` returns an array on the tensor's memory, and the tensor holds
  :func:`ep_runtime.core.reference.combine` within :func:`ep_runtime.core.reference.combine_tolerance`;
- streams: a round trip whose torch work (a slow producer of the tokens, the experts reading the
  batch and slowly writing their outputs, a reader of the output) runs
  (a) on the runtime's stream (``session.stream`` as a torch stream), with no synchronization;
  (b) on a torch stream of the caller, with the waits the runtime's stream contract asks for
      (README: every call enqueues on ``session.stream`` and work on another stream must wait
      for it): the runtime's stream waits for the caller's before the runtime's calls, the
      caller's waits for the runtime's after them (what ``ep_runtime.torch`` does).
  Both must read exactly the reference batch and a combine within tolerance. On ``sim`` kernels
  run synchronously and there are no streams: (a) and (b) check the data flow only. On GPUs two
  more round trips inform without deciding PASS: a control, (b) without the waits, says whether
  the delays make a missing wait visible (stale rows); and (c) torch work on torch's current
  stream with only the wait after the calls says whether the runtime's DLPack import of its
  inputs orders its stream after torch's current stream by itself (CuPy's ``from_dlpack`` hands
  the producer CuPy's current stream, the session's, and torch's ``__dlpack__`` makes that stream
  wait for torch's current one; not a documented promise of the runtime).

Prints one line per check and rank (rank 0 prints them all, after a ``FAIL:`` line for each that
failed), then PASS or FAIL.
"""

from __future__ import annotations

import argparse
import contextlib
import sys

import harness
import numpy as np

#: Spin cycles of ``torch.cuda._sleep`` that make the caller's producers slow (about 25 ms at
#: 2 GHz): long enough for a missing stream wait to show as stale data, far below
#: ``EPConfig.wait_timeout_s`` (a rank's waits also wait for its peer's slow producer).
DELAY_CYCLES = 50_000_000
#: What every buffer a stream round trip writes holds before it (exact in bf16; the test data,
#: small integers and standard normals, never take this value).
SENTINEL = -1024.0
#: Sizes per backend: the GPU run is small enough for any machine; the simulator runs each
#: simulated thread as a Python thread, so it gets a tiny layer.
SIZES = {"gpu": dict(hidden=1024, experts=16, top_k=4, tokens=256),
         "sim": dict(hidden=16, experts=4, top_k=2, tokens=6)}


def address(a) -> int:
    """The data pointer of a torch tensor, a CuPy or Numba device array, a NumPy array, or the
    simulator's FakeCUDAArray (which forwards ``__array_interface__`` to its NumPy array)."""
    if hasattr(a, "data_ptr"):
        return a.data_ptr()
    cai = getattr(a, "__cuda_array_interface__", None)
    return cai["data"][0] if cai is not None else a.__array_interface__["data"][0]


class LaunchLog:
    """Wraps ``session.launch`` to record the data pointers of every launch's array arguments."""

    def __init__(self, session):
        self.launches: list[set[int]] = []
        launch = session.launch

        def logged(kernel, grid, block, args):
            self.launches.append({address(a) for a in args if getattr(a, "ndim", 0)})
            return launch(kernel, grid, block, args)

        session.launch = logged

    def pointers_during(self, call):
        """``call()``'s result and the data pointers of the arrays of every kernel it launched."""
        start = len(self.launches)
        result = call()
        return result, set().union(*self.launches[start:])


class RankData:
    """This rank's tensors, their reference results, and what the runtime is handed for them."""

    def __init__(self, cfg, rank: int, seed: int, device, gpu: bool):
        import torch

        from ep_runtime.core import reference
        from ep_runtime.testing import linear_experts

        self.gpu = gpu
        T = cfg.max_tokens_per_rank
        xs, ids, ws = harness.job_inputs(cfg, seed)
        ref = reference.dispatch(xs, ids, ws, cfg)
        ys = [linear_experts(b.x, b.row_offsets, cfg.n_local_experts, r) for r, b in enumerate(ref)]
        self.n = ref[rank].n_rows
        self.ref_x_bits = ref[rank].x.view(np.int16)
        self.ref_out = reference.combine(ys, ref, ids, cfg)[rank].astype(np.float32)
        self.tol = reference.combine_tolerance(ws[rank], float(np.abs(ys[rank].astype(np.float32)).max(initial=0)))

        def tensor(a):  # a copy on the device: the tensors below own their memory
            a = np.ascontiguousarray(a)
            if a.dtype == reference.BF16:
                return torch.from_numpy(a.view(np.int16)).to(device, copy=True).view(torch.bfloat16)
            return torch.from_numpy(a).to(device, copy=True)

        self.tok_src, self.y_src = tensor(xs[rank]), tensor(ys[rank])
        self.tok, self.tid, self.tw = tensor(xs[rank]), tensor(ids[rank]), tensor(ws[rank])
        self.y = torch.zeros((cfg.recv_rows_capacity, cfg.hidden), dtype=torch.bfloat16, device=device)
        self.y[:self.n] = self.y_src
        self.out = torch.empty((T, cfg.hidden), dtype=torch.bfloat16, device=device)
        self.batch_x = None  # the runtime's expert_x through DLPack, once there is a runtime

    def arg(self, t):
        """What the caller hands the runtime for tensor ``t``: the tensor itself on GPUs; on
        ``sim`` (NumPy only) a NumPy view of its memory, bf16 as its uint16 bits."""
        import torch

        if self.gpu:
            return t
        return t.view(torch.int16).numpy().view(np.uint16) if t.dtype == torch.bfloat16 else t.numpy()

    def bad_rows(self, x) -> int:
        """Rows of ``x`` (the batch's first n rows, bf16) that differ from the reference's bits."""
        import torch

        return int(np.any(x.view(torch.int16).cpu().numpy() != self.ref_x_bits, axis=1).sum())

    def bad_out(self, out) -> tuple[int, float]:
        """Rows of ``out`` ([T, hidden] bf16) outside the tolerance, and the largest error."""
        err = np.abs(out.float().cpu().numpy() - self.ref_out)
        return int(np.any(~(err <= self.tol), axis=1).sum()), float(err.max(initial=0))


def from_runtime(arr):
    """A runtime array of bf16 bits (CuPy or NumPy) as a bf16 torch tensor, through DLPack."""
    import torch

    return torch.from_dlpack(arr.view(np.int16)).view(torch.bfloat16)


class Streams:
    """The runtime's stream (``session.stream`` as a torch stream), a torch stream of the caller's
    own and torch's current stream. On ``sim`` there are no streams: every method does nothing and
    work runs in call order."""

    def __init__(self, session, device, gpu: bool):
        import torch

        self.gpu = gpu
        self.runtime = torch.cuda.ExternalStream(session.stream.ptr, device=device) if gpu else None
        self.caller = torch.cuda.Stream(device) if gpu else None
        self.current = torch.cuda.current_stream(device) if gpu else None

    def on(self, stream):
        """Torch work in the block runs on ``stream``."""
        import torch

        return torch.cuda.stream(stream) if self.gpu else contextlib.nullcontext()

    def wait(self, waiter, producer) -> None:
        """Work enqueued on ``waiter`` from now on runs after the work enqueued on ``producer`` so far."""
        if self.gpu:
            waiter.wait_stream(producer)

    def slow(self) -> None:
        """Delay the current torch stream (a slow producer)."""
        import torch

        if self.gpu:
            torch.cuda._sleep(DELAY_CYCLES)

    def synchronize(self, rt) -> None:
        """The host waits for every stream; raises any error a kernel recorded."""
        import torch

        if self.gpu:
            torch.cuda.synchronize()
        rt.synchronize()


#: Round trips: where the caller's torch work runs ("runtime": the runtime's stream; "torch": a
#: torch stream of the caller's own; "current": torch's current stream), and whether the runtime's
#: stream waits for the caller's before the runtime's calls and the caller's for the runtime's after.
ORDERS = {"runtime": ("runtime", False, False), "caller": ("torch", True, True),
          "control": ("torch", False, False), "dlpack": ("current", False, True)}


def round_trip(rt, st: Streams, d: RankData, order: str) -> tuple[int, int]:
    """One dispatch and combine with the caller's torch work as :data:`ORDERS` ``[order]`` says.
    Returns the batch rows and the output rows the caller read wrong (stale or not yet written)."""
    where, before, after = ORDERS[order]
    caller = {"runtime": st.runtime, "torch": st.caller, "current": st.current}[where]
    for t in (d.tok, d.y, d.out, d.batch_x):  # everything the round trip writes starts stale
        t.fill_(SENTINEL)
    st.synchronize(rt)
    with st.on(caller):
        st.slow()
        d.tok.copy_(d.tok_src)  # the tokens, produced late
    if before:
        st.wait(st.runtime, caller)
    batch = rt.dispatch_wait(rt.dispatch_async(d.arg(d.tok), d.arg(d.tid), d.arg(d.tw)))
    if after:
        st.wait(caller, st.runtime)
    with st.on(caller):
        x_seen = d.batch_x[:d.n].clone()  # the experts read their rows ...
        st.slow()
        d.y[:d.n].copy_(d.y_src)  # ... and write their outputs, late
    if before:
        st.wait(st.runtime, caller)
    rt.combine_wait(rt.combine_async(d.arg(d.y), batch.handle), out=d.arg(d.out))
    if after:
        st.wait(caller, st.runtime)
    with st.on(caller):
        out_seen = d.out.clone()  # the caller reads the output
    st.synchronize(rt)
    return d.bad_rows(x_seen), d.bad_out(out_seen)[0]


def check_rank(session, opts: dict) -> list[tuple[str, bool | None, str]]:
    """This rank's checks: ``(what, ok, detail)`` each; ``ok`` is None for information only."""
    import torch

    from ep_runtime import EPConfig, EPRuntime
    from ep_runtime.core import arrays

    gpu = session.backend != "sim"
    if gpu:
        device = torch.device("cuda", session.device_index)
        torch.cuda.set_device(device)  # torch's current device must be the tensors' for DLPack export
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)
    cfg = EPConfig(n_ranks=session.n_ranks, n_experts=opts["experts"], top_k=opts["top_k"], hidden=opts["hidden"],
                   max_tokens_per_rank=opts["tokens"])
    d = RankData(cfg, session.rank, opts["seed"], device, gpu)
    results = []

    def check(what, ok, detail=""):
        results.append((what, None if ok is None else bool(ok), detail))

    def same(t, ptr):
        return f"{ptr:#x} == tensor {t.data_ptr():#x}" if ptr == t.data_ptr() else \
            f"COPIED: {ptr:#x} != tensor {t.data_ptr():#x}"

    with EPRuntime(cfg, session) as rt:
        log = LaunchLog(session)
        if gpu:
            torch.cuda.synchronize()  # the inputs made above are complete before the first call
        tensors = {"tokens": d.tok, "topk_ids": d.tid, "topk_weights": d.tw, "expert_out": d.y, "out": d.out}
        for name, t in tensors.items():
            ptr = address(arrays.to_backend(d.arg(t), session.backend, "zero_copy_check", name))
            check(f"in: arrays.to_backend({name}) is the tensor's memory", ptr == t.data_ptr(), same(t, ptr))

        handle, launched = log.pointers_during(lambda: rt.dispatch_async(d.arg(d.tok), d.arg(d.tid), d.arg(d.tw)))
        for name in ("tokens", "topk_ids", "topk_weights"):
            t = tensors[name]
            check(f"in: dispatch_async launches its kernels on {name}'s memory", t.data_ptr() in launched,
                  f"tensor {t.data_ptr():#x} {'among' if t.data_ptr() in launched else 'NOT among'} "
                  f"{len(launched)} launched arrays")
        batch = rt.dispatch_wait(handle)
        rt.synchronize()
        d.batch_x = from_runtime(batch.x)
        buf = address(rt.buffers["expert_x"])
        check("batch out: batch.x through DLPack is the runtime's expert_x buffer",
              d.batch_x.data_ptr() == buf == address(batch.x),
              f"torch {d.batch_x.data_ptr():#x}, buffer {buf:#x}, batch.x {address(batch.x):#x}")
        bad = d.bad_rows(d.batch_x[:d.n])
        check("batch out: its rows equal the reference exactly", bad == 0, f"{bad} of {d.n} rows differ")

        ch, launched = log.pointers_during(lambda: rt.combine_async(d.arg(d.y), batch.handle))
        check("in: combine_async launches its kernel on expert_out's memory", d.y.data_ptr() in launched,
              f"tensor {d.y.data_ptr():#x} {'among' if d.y.data_ptr() in launched else 'NOT among'} "
              f"{len(launched)} launched arrays")
        ret, launched = log.pointers_during(lambda: rt.combine_wait(ch, out=d.arg(d.out)))
        check("out: combine_wait launches its kernel on out's memory", d.out.data_ptr() in launched,
              f"tensor {d.out.data_ptr():#x} {'among' if d.out.data_ptr() in launched else 'NOT among'} "
              f"{len(launched)} launched arrays")
        check("out: combine_wait returns the out tensor's memory", address(ret) == d.out.data_ptr(),
              same(d.out, address(ret)))
        rt.synchronize()
        bad, max_err = d.bad_out(d.out)
        check("out: the out tensor holds the reference combine within tolerance", bad == 0,
              f"{bad} of {len(d.out)} rows outside, max error {max_err:.3g}")

        st = Streams(session, device, gpu)
        where = "" if gpu else " (sim: synchronous, data flow only)"
        for order, what in (("runtime", "torch work on the runtime's stream, no waits"),
                            ("caller", "torch work on a torch stream, runtime waits for it before the calls, "
                                       "it waits for the runtime after them")):
            bad_x, bad_o = round_trip(rt, st, d, order)
            check(f"streams: {what}{where}", bad_x == 0 and bad_o == 0,
                  f"{bad_x} of {d.n} batch rows and {bad_o} of {len(d.out)} output rows read wrong")
        if gpu:  # information only: (order, what, reading when some rows were wrong, when none were)
            for order, what, if_wrong, if_right in (
                    ("control", "control: torch work on a torch stream, no waits",
                     "the delays make a missing wait visible", "WARNING: no race seen: the checks above prove little"),
                    ("dlpack", "torch work on torch's current stream, the caller waits after the calls, the "
                               "runtime never waits before them",
                     "the runtime's DLPack imports of the inputs did not order it after torch's current stream",
                     "the runtime's DLPack imports of the inputs ordered it after torch's current stream")):
                bad_x, bad_o = round_trip(rt, st, d, order)
                check(f"streams (information): {what}", None,
                      f"{bad_x} of {d.n} batch rows and {bad_o} of {len(d.out)} output rows read wrong: "
                      f"{if_wrong if bad_x or bad_o else if_right}")
    return results


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=("auto", "nvshmem", "sim"), default="auto",
                   help="auto: nvshmem under mpirun with GPUs, else the simulator")
    p.add_argument("--ranks", type=int, default=2, help="simulated ranks outside mpirun (default 2)")
    p.add_argument("--hidden", type=int, help=f"default {SIZES['gpu']['hidden']} (sim {SIZES['sim']['hidden']})")
    p.add_argument("--experts", type=int, help=f"default {SIZES['gpu']['experts']} (sim {SIZES['sim']['experts']})")
    p.add_argument("--top-k", type=int, help=f"default {SIZES['gpu']['top_k']} (sim {SIZES['sim']['top_k']})")
    p.add_argument("--tokens", type=int, help=f"tokens per rank; default {SIZES['gpu']['tokens']} "
                                              f"(sim {SIZES['sim']['tokens']})")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=300.0, help="simulator: seconds before a stuck run fails")
    args = p.parse_args(argv)

    from ep_runtime import BufferLayout, EPConfig
    from ep_runtime.shmem.launch import job_backend, job_ranks, run_job
    from ep_runtime.testing import gpu_check_report

    backend, n_ranks = job_backend(args.backend), job_ranks(args.ranks)
    sizes = SIZES["sim" if backend == "sim" else "gpu"]
    opts = {k: sizes[k] if getattr(args, k) is None else getattr(args, k) for k in sizes}
    opts["seed"] = args.seed
    cfg = EPConfig(n_ranks=n_ranks, n_experts=opts["experts"], top_k=opts["top_k"], hidden=opts["hidden"],
                   max_tokens_per_rank=opts["tokens"])
    per_rank = run_job(check_rank, n_ranks, args=(opts,), backend=backend,
                       heap_bytes=BufferLayout(cfg).symmetric_bytes, timeout_s=args.timeout)
    if per_rank is None:  # a rank other than 0 under mpirun: rank 0 reports
        return 0
    failures = [[f"rank {rank}: {what}: {detail}" for what, ok, detail in results if ok is False]
                for rank, results in enumerate(per_rank)]
    lines = [f"backend {backend}, {n_ranks} ranks, hidden {opts['hidden']}, {opts['experts']} experts, "
             f"top-{opts['top_k']}, {opts['tokens']} tokens per rank"]
    lines += [f"rank {rank} {'info' if ok is None else 'ok  ' if ok else 'FAIL'} {what}: {detail}"
              for rank, results in enumerate(per_rank) for what, ok, detail in results]
    return gpu_check_report(failures, lines)


if __name__ == "__main__":
    sys.exit(main())
