"""Where a kernel's fixed cost goes: phase time stamps from inside the kernels (GPU machine):

    mpirun -np 1 -x PYTHONPATH python3 tests/gpu/trace_phases.py [--tokens 1 128] [--layout compact expanded]

Sets ``EP_RUNTIME_TRACE=1`` before the kernels are built (``ep_runtime/kernels/trace.py``: the kernels then
write ``%globaltimer`` stamps into the trace words of the ``status`` region; the build differs
from the plain one, and the kernel cache keys it apart). Each half of a round trip is queued
behind a device spin (``--spin-us``), so the kernels run back to back as a graph would run them;
the trace words are cleared before each half and read after it. The table gives, per token
count and layout, each traced point's median time in microseconds from its kernel's start
(block 0's first instruction), and the gap from the previous kernel's last stamp to each
kernel's start. ``%globaltimer`` ticks in coarse steps on some GPUs: read the table to the
microsecond, no finer. Prints a table last (rank 0).
"""

from __future__ import annotations

import argparse
import os
import sys

import harness
import numpy as np


def main() -> int:
    ap = argparse.ArgumentParser()
    harness.add_layer_options(ap, tokens=(1, 128), token_dtype=True)
    ap.add_argument("--layout", nargs="+", default=["compact", "expanded"])
    ap.add_argument("--samples", type=int, default=30)
    ap.add_argument("--spin-us", type=float, default=200.0)
    args = ap.parse_args()
    os.environ["EP_RUNTIME_TRACE"] = "1"  # before any kernel module is imported
    import cupy

    from ep_runtime import EPRuntime
    from ep_runtime.tools.bench.measure import DeviceSpin
    from ep_runtime.kernels.trace import SLOTS, TRACE
    from ep_runtime.core.layout import TRACE_BASE

    assert TRACE, "EP_RUNTIME_TRACE was not seen by ep_runtime.kernels.trace"
    R = harness.job_comm().Get_size()
    cfg = harness.layer_config(args, R, max(args.tokens), token_dtype=args.token_dtype)
    session = harness.open_job_session(cfg)
    rt = EPRuntime(cfg, session)
    stream = session.stream
    spin = DeviceSpin(stream, args.spin_us)
    trace = rt.buffers["status"][TRACE_BASE:]

    def half(run):
        trace.fill(0)
        session.barrier()
        spin()
        result = run()
        stream.synchronize()
        return result, cupy.asnumpy(trace).astype(np.int64)

    table = {}
    for T, layout, (tok, tid, tw), y, out in harness.round_trip_cases(session, cfg, args.tokens, args.layout):
        stamps = []
        for i in range(args.samples + 3):
            b, s1 = half(lambda: rt.dispatch_wait(rt.dispatch_async(tok, tid, tw), layout=layout))
            _, s2 = half(lambda: rt.combine_wait(rt.combine_async(y, b.handle, layout=layout), out=out))
            if i >= 3:
                stamps.append(np.where(s1 != 0, s1, s2))  # dispatch slots from the first half
        table[T, layout] = np.stack(stamps)
    rt.close()
    session.close()
    if session.rank != 0:
        return 0
    kernels = ["dispatch_async", "dispatch_wait", "dispatch_land", "dispatch_copy", "combine_async", "combine_wait"]
    start = {k: next(s for s, (kk, p) in SLOTS.items() if kk == k and p == "start") for k in kernels}
    print(f"{R} rank(s), hidden {args.hidden}, top-{args.top_k} of {args.experts}, {args.token_dtype}; "
          f"us from each kernel's start, median of {args.samples}")
    for (T, layout), st in table.items():
        print(f"T={T} {layout}")
        prev_end = None
        for k in kernels:
            s0 = start[k]
            if not (st[:, s0] > 0).all():
                continue
            if prev_end is not None:
                gap = np.median((st[:, s0] - prev_end) / 1e3)
                print(f"  {'':16} (gap from the previous kernel's last stamp: {gap:6.1f})")
            last = st[:, s0]
            for slot, (kk, point) in SLOTS.items():
                if kk != k or slot == s0 or not (st[:, slot] > 0).all():
                    continue
                print(f"  {k:16} {point:28} {np.median((st[:, slot] - st[:, s0]) / 1e3):6.1f}")
                last = np.maximum(last, st[:, slot])
            prev_end = last
        if (st[:, start["dispatch_land"]] > 0).all():  # it overlaps dispatch_async: its points on that clock too
            for slot, (kk, point) in SLOTS.items():
                if kk == "dispatch_land" and (st[:, slot] > 0).all():
                    t = np.median((st[:, slot] - st[:, start["dispatch_async"]]) / 1e3)
                    print(f"  {kk:16} {point:28} {t:6.1f} from dispatch_async's start")
    return 0


if __name__ == "__main__":
    sys.exit(main())
