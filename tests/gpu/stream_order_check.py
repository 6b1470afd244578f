"""CuPy work enqueued right after a runtime call, with no host synchronization, must run after
it (run on the GPU machine: ``mpirun -np 2 -x PYTHONPATH python3 tests/gpu/stream_order_check.py``).

Regression check for the WAR in ``NvshmemSession._on_stream``: with CuPy's own ``with stream:``
blocks inside the session, the null stream was left current, and a CuPy fill enqueued right
after ``dispatch_wait`` ran concurrently with it (some fills overwritten). Prints a line per
rank, then PASS when no fill is overwritten and CuPy's current stream is the session's on every
rank.
"""
import sys

import harness

CALLS = 40


def main():
    import cupy

    from ep_runtime import EPConfig, EPRuntime

    cfg = EPConfig(n_ranks=harness.job_comm().Get_size(), n_experts=256, top_k=8, hidden=7168,
                   max_tokens_per_rank=256)
    s = harness.open_job_session(cfg)
    rt = EPRuntime(cfg, s)
    tok, ti, tw = harness.device_inputs(s, *harness.job_inputs(cfg, 3))
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
    check = harness.Checks(f"rank {s.rank}: ")
    check(overwritten == 0, f"{overwritten} of {CALLS} fills overwritten")
    check(current_ok, "CuPy's current stream is not the session's")
    row = f"{overwritten} of {CALLS} fills overwritten; CuPy current stream is the session's: {current_ok}"
    return harness.finish(check.failures, row, lambda every: [f"rank {r}: {line}" for r, line in enumerate(every)])


if __name__ == "__main__":
    sys.exit(main())
