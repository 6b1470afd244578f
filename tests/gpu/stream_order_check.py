"""CuPy work enqueued right after a runtime call, with no host synchronization, must run after
it (run on the GPU machine: ``mpirun -np 2 -x PYTHONPATH python3 tests/gpu/stream_order_check.py``).

Regression check for the WAR in ``NvshmemSession._on_stream``: with CuPy's own ``with stream:``
blocks inside the session, the null stream was left current, and a CuPy fill enqueued right
after ``dispatch_wait`` ran concurrently with it (some fills overwritten). Prints
PASS when no fill is overwritten and CuPy's current stream is the session's.
"""
import sys

import numpy as np

CALLS = 40


def main():
    import cupy

    from ep_runtime import EPConfig, EPRuntime
    from ep_runtime.core.layout import BufferLayout
    from ep_runtime.shmem import open_session
    from ep_runtime.testing import make_inputs

    cfg = EPConfig(n_ranks=2, n_experts=256, top_k=8, hidden=7168, max_tokens_per_rank=256)
    s = open_session("nvshmem", heap_bytes=BufferLayout(cfg).symmetric_bytes)
    rt = EPRuntime(cfg, s)
    xs, ids, ws = make_inputs(cfg, "random", 3, n_tokens=[256] * cfg.n_ranks)
    tok, ti, tw = (cupy.asarray(a) for a in (xs[s.rank].view(np.uint16), ids[s.rank], ws[s.rank]))
    overwritten = 0
    current_ok = cupy.cuda.get_current_stream().ptr == s.stream.ptr
    for _ in range(CALLS):
        b = rt.dispatch_wait(rt.dispatch_async(tok, ti, tw))
        b.x[0, :].fill(7)  # CuPy's current stream: must run after dispatch_wait
        rt.synchronize()
        overwritten += int(not bool((b.x[0, :] == 7).all()))
        rt.combine_wait(rt.combine_async(b.x, b.handle))
    rt.synchronize()
    rt.close()
    s.close()
    ok = overwritten == 0 and current_ok
    print(f"rank {s.rank}: {overwritten} of {CALLS} fills overwritten; CuPy current stream is the session's: "
          f"{current_ok}; {'PASS' if ok else 'FAIL'}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
