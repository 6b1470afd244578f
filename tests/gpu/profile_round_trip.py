"""One round trip per (token count, layout) with each kernel isolated, for Nsight Compute.

    mpirun -np 2 -x PYTHONPATH bash -c 'if [ "$OMPI_COMM_WORLD_RANK" = 0 ]; then
        ncu --clock-control none --profile-from-start off --set full -o $OUT/prof python3 tests/gpu/profile_round_trip.py;
        else python3 tests/gpu/profile_round_trip.py; fi'

Warm-up calls (compilation, module load) run outside the profiled range; the profiled round
trip synchronizes the stream and barriers every rank after each kernel, so a wait kernel finds
its peers' signals already set when it starts. Nsight Compute's kernel replay restores device
memory between passes, and the memory it restores then already holds the peer's data: every
pass of a wait kernel sees the same state, and the durations are each kernel's body alone (no
waiting for a peer, no launch gaps). Prints the batch sizes; Nsight Compute prints the rest.
"""

from __future__ import annotations

import argparse
import sys

import harness


def main() -> int:
    ap = argparse.ArgumentParser()
    harness.add_layer_options(ap, tokens=(128,), token_dtype=True)
    ap.add_argument("--layout", nargs="+", default=["expanded", "compact"])
    args = ap.parse_args()
    import cupy

    from ep_runtime import EPRuntime

    cfg = harness.layer_config(args, harness.job_comm().Get_size(), max(args.tokens), token_dtype=args.token_dtype)
    session = harness.open_job_session(cfg)
    rt = EPRuntime(cfg, session)
    plain_launch = session.launch

    def isolated_launch(kernel, grid, block, launch_args):
        plain_launch(kernel, grid, block, launch_args)
        session.stream.synchronize()
        session.barrier()

    for T, layout, (tok, tid, tw), y, out in harness.round_trip_cases(session, cfg, args.tokens, args.layout, fill=1):
        for profiled in (False, False, True):
            session.launch = isolated_launch if profiled else plain_launch
            session.barrier()
            if profiled:
                cupy.cuda.profiler.start()
            b = rt.dispatch_wait(rt.dispatch_async(tok, tid, tw), layout=layout)
            rt.combine_wait(rt.combine_async(y, b.handle, layout=layout), out=out)
            rt.synchronize()
            if profiled:
                cupy.cuda.profiler.stop()
        session.launch = plain_launch
        if session.rank == 0:
            print(f"profiled T={T} layout={layout} rows={int(b.row_offsets[-1])}", flush=True)
    rt.close()
    session.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
