"""Slot values home on GPUs (one rank per GPU), as tests/test_slot_values_sim.py checks them on the
simulator, then their time next to a combine of the same batch:

    mpirun -np 2 -x PYTHONPATH python3 tests/gpu/slot_values_check.py [--tokens 128 4096] [--hidden 512]

Per token count, on a runtime with ``debug=False``: the simulator test's calls (``slot_pe``: masked
slots, a rank with no tokens, none anywhere, every token to one expert, a planted repeated id, both
layouts), each rank's ``[T, K]`` slot values exactly the expected ones (values that encode the
row's source rank, token and expert) and the same batch's combine within the reference's
tolerance (exact on the simulator; a GPU's fused multiply-adds round differently);
then values shorter than the batch (``short_values_pe``): ``EPInputError`` on that rank and an
``EPTimeoutError`` naming its ``slot_signal`` on the others. Then, at ``--time-tokens`` tokens a
rank and ``--time-hidden`` (random routing), CUDA-event medians of ``slot_values_async +
slot_values_wait`` and of the combine (``combine_async + combine_wait``) of the same batch, with
the bytes each moves. ``--backend sim`` runs the same on the simulator (``NUMBA_ENABLE_CUDASIM=1 mpiexec -n 2
python3 tests/gpu/slot_values_check.py --backend sim --tokens 8 --hidden 16 --experts 8 --top-k 2 --time-tokens``:
no timing). Prints a table (rank 0), then PASS or FAIL.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import harness
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))  # tests/: the simulator test's helpers


def exactness(session, cfg, me: int) -> list[str]:
    """The simulator test's calls on this runtime config: this rank's failures."""
    from test_slot_values_sim import CALLS, expected_home_of_call, planted_inputs, slot_pe

    from ep_runtime.core import reference

    check = harness.Checks(f"T={cfg.max_tokens_per_rank} ")
    got = slot_pe(session, cfg)
    for call in range(CALLS):
        xs, ids, ws = planted_inputs(cfg, call)
        want, home = expected_home_of_call(cfg, me, call), got[call]["home"]
        if home.shape != want.shape or not np.array_equal(home, want):
            bad = (np.argwhere(home != want).tolist() if home.shape == want.shape
                   else [f"shape {home.shape}, want {want.shape}"])
            check(False, f"call {call}: slot values differ at {bad[:4]}")
        refs, what = reference.dispatch(xs, ids, ws, cfg), f"call {call}: after the slot values"
        check.no_failure(harness.reference_combine_failure(cfg, refs, ids, ws, me, got[call]["combined"], what))
    return check.failures


def timings(session, cfg, samples: int) -> dict:
    """Medians (us) of the slot return and of the combine of the same batch, on this rank."""
    from ep_runtime import EPRuntime
    from ep_runtime.tools.bench.measure import clock_for

    clock = clock_for(session)
    x, i, w = harness.device_inputs(session, *harness.job_inputs(cfg, 7))
    values = session.to_device(np.ones(cfg.recv_rows_capacity, np.float32))
    y = session.to_device(np.zeros((cfg.recv_rows_capacity, cfg.hidden), np.uint16))
    out = session.to_device(np.zeros((cfg.max_tokens_per_rank, cfg.top_k), np.float32))
    slot_us, combine_us = [], []
    with EPRuntime(cfg, session, debug=False) as rt:
        for n in range(5 + samples):
            batch = rt.dispatch_wait(rt.dispatch_async(x, i, w))
            session.barrier()
            a = clock.mark()
            rt.slot_values_wait(rt.slot_values_async(values, batch.handle), out=out)
            b = clock.mark()
            session.barrier()
            c = clock.mark()
            rt.combine_wait(rt.combine_async(y, batch.handle))
            d = clock.mark()
            if n >= 5:
                slot_us.append(clock.elapsed_us(a, b))
                combine_us.append(clock.elapsed_us(c, d))
        rt.synchronize()
        rows = int(session.to_host(batch.row_offsets)[-1])
    return {"slot_us": float(np.median(slot_us)), "combine_us": float(np.median(combine_us)),
            "slot_bytes": rows * 4, "combine_bytes": rows * cfg.hidden * 2}


def main() -> int:
    ap = argparse.ArgumentParser()
    harness.add_layer_options(ap, tokens=(128, 4096), hidden=512, experts=64)
    ap.add_argument("--time-tokens", type=int, nargs="*", default=[128, 4096])
    ap.add_argument("--time-hidden", type=int, default=7168)
    ap.add_argument("--time-experts", type=int, default=256)
    ap.add_argument("--samples", type=int, default=50)
    harness.add_backend_option(ap)
    args = ap.parse_args()
    from test_slot_values_sim import cfg_of, short_values_pe

    from ep_runtime.testing import rank_rows

    R = harness.job_comm().Get_size()
    configs = [cfg_of(R, n_experts=args.experts, top_k=args.top_k, hidden=args.hidden, max_tokens_per_rank=T)
               for T in args.tokens]
    timed = [cfg_of(R, n_experts=args.time_experts, top_k=args.top_k, hidden=args.time_hidden, max_tokens_per_rank=T,
                    pad_multiple=1) for T in args.time_tokens]
    session = harness.open_job_session(*configs, *timed, backend=args.backend)
    me, failures, rows = session.rank, [], []
    for cfg in configs:
        fails = exactness(session, cfg, me)
        rows.append((f"exact, T={cfg.max_tokens_per_rank} hidden {cfg.hidden}", "exact" if not fails else "FAIL"))
        failures += [f"rank {me}: {f}" for f in fails]
    short = short_values_pe(session, cfg_of(R, wait_timeout_s=1.0, max_tokens_per_rank=4))
    want = "EPInputError: rank 0: slot_values_async of call 0: values has" if me == 0 else \
        f"EPTimeoutError: rank {me}: slot_values_wait of call 0 timed out"
    ok = short["error"] is not None and short["error"].startswith(want) and \
        (me == 0 or "waiting for rank 0: slot_signal[0][0]" in short["error"])
    rows.append(("short values: the error raised", (short["error"] or "none")[:70]))
    failures += [] if ok else [f"rank {me}: short values: expected {want!r}, got {short['error']!r}"]
    times = [timings(session, cfg, args.samples) for cfg in timed]
    session.close()

    def table(every) -> list[str]:
        lines = [f"{'T':>6} {'hidden':>6} {'rank':>4} {'slot values us':>15} {'bytes':>10} {'combine us':>11} "
                 f"{'bytes':>12}"]
        for j, cfg in enumerate(timed):
            for r, (_, rank_times) in enumerate(every):
                t = rank_times[j]
                lines.append(f"{cfg.max_tokens_per_rank:>6} {cfg.hidden:>6} {r:>4} {t['slot_us']:>15.1f} "
                             f"{t['slot_bytes']:>10} {t['combine_us']:>11.1f} {t['combine_bytes']:>12}")
        return rank_rows([per_rank for per_rank, _ in every]) + lines

    return harness.finish(failures, (rows, times), table)


if __name__ == "__main__":
    sys.exit(main())
