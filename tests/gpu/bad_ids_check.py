"""Planted out-of-range and repeated expert ids with the routing check off, on GPUs (one rank per
GPU), as tests/test_masked_ids_sim.py checks them on the simulator:

    mpirun -np 2 -x PYTHONPATH python3 tests/gpu/bad_ids_check.py [--tokens 128] [--plans default] [--layouts expanded]
    NVSHMEM_DISABLE_CUDA_VMM=1 mpirun -np 2 -x PYTHONPATH -x NVSHMEM_DISABLE_CUDA_VMM compute-sanitizer \
        --tool memcheck --leak-check no --report-api-errors no --check-device-heap no \
        python3 tests/gpu/bad_ids_check.py --tokens 32 --hidden 1024 --experts 16 --top-k 4

(under memcheck NVSHMEM's bring-up alone takes about 300 s; fill the kernel cache first)

Per plan and layout, on a runtime built with ``debug=False``: a call whose routing is the
``masked`` scenario with ``n_experts + 3`` planted on rank 0 (token 1, slot 0) and ``-7`` on the
last rank (token 2, slot 1) must complete on every rank exactly as the reference with those slots
masked (batch bit for bit, combine within tolerance), and the next ``synchronize()`` of those two
ranks (only) must raise ``EPInputError`` naming the token, the slot and the id; then ``reset()``
on every rank, a clean call exact; then a call with repeated ids (counted once, first slot's
weight) exact with no error. ``--backend sim`` runs the same on the simulator
(``NUMBA_ENABLE_CUDASIM=1 mpiexec -n 2 python3 tests/gpu/bad_ids_check.py --backend sim --tokens 8 --hidden 16
--experts 8 --top-k 2``). Prints a table (rank 0), then PASS or FAIL.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import harness
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))  # tests/: the simulator test's inputs


def check(cfg, me, got, inputs, layout, what) -> list[str]:
    """This rank's batch and output against the reference of ``inputs``: failures."""
    from ep_runtime.core import reference

    xs, ids, ws = inputs
    refs = reference.dispatch(xs, ids, ws, cfg)
    what = f"rank {me}: {what}"
    if cfg.token_format.quantized:  # the rows' places (fp8_check checks the codes and scales bit for bit)
        ref = refs[me]
        try:
            np.testing.assert_array_equal(got["row_offsets"], ref.row_offsets, err_msg=what)
            for k in ("src_rank", "src_token", "src_k"):
                np.testing.assert_array_equal(got[k][:ref.n_rows], getattr(ref, k), err_msg=f"{what}: {k}")
        except AssertionError as e:
            return [f"{what}: batch: {' '.join(str(e).split())[:300]}"]
    else:
        batch = harness.batch_failure(got, refs[me], layout, xs, cfg, f"{what}: batch")
        if batch is not None:
            return [batch]
    combine = harness.reference_combine_failure(cfg, refs, ids, ws, me, got["out"], what)
    return [] if combine is None else [combine]


def main() -> int:
    ap = argparse.ArgumentParser()
    harness.add_layer_options(ap, tokens=128, seed=5, token_dtype=True)
    ap.add_argument("--plans", nargs="+", default=["default"], metavar="PLAN", help=harness.PLANS_HELP)
    ap.add_argument("--layouts", nargs="+", default=["expanded", "compact"], choices=["expanded", "compact"])
    harness.add_backend_option(ap)
    args = ap.parse_args()
    plans = harness.plan_list(args.plans)
    from test_masked_ids_sim import PLANTED, REPEATS, planted_inputs

    from ep_runtime import EPRuntime
    from ep_runtime.testing import make_inputs, round_trip_with_error

    R = harness.job_comm().Get_size()
    cfg = harness.layer_config(args, R, args.tokens, token_dtype=args.token_dtype)
    session = harness.open_job_session(cfg, backend=args.backend)
    me, E = session.rank, cfg.n_experts
    named = {rank % R: (t, k, eval(v.format(E=E))) for rank, t, k, v in PLANTED}  # noqa: S307 - the table's own
    rows, failures = [], []
    for plan in plans:
        with EPRuntime(cfg, session, debug=False, plan=None if plan == "default" else plan) as rt:
            label = harness.plan_label(rt.plan, plan, len(plans))
            for layout in args.layouts:
                planted = planted_inputs(cfg, args.seed)
                got = round_trip_with_error(session, rt, cfg, *planted, layout)
                fails = check(cfg, me, got, planted, layout, f"{label} {layout} planted")
                err = got["error"]
                if me in named:
                    t, k, x = named[me]
                    frag = f"rank {me}: topk_ids[{t}, {k}] = {x} in call "
                    if err is None or frag not in err or "dispatch_async dropped that slot" not in err:
                        fails.append(f"{label} {layout}: expected an error naming {frag!r}, got {err!r}")
                elif err is not None:
                    fails.append(f"{label} {layout}: rank {me} raised for another rank's ids: {err}")
                rt.reset()
                clean = make_inputs(cfg, "random", args.seed + 1, n_tokens=[args.tokens] * R)
                after = round_trip_with_error(session, rt, cfg, *clean, layout)
                fails += check(cfg, me, after, clean, layout, f"{label} {layout} after reset")
                fails += [f"{label} {layout} after reset: {after['error']}"] if after["error"] else []
                repeats = planted_inputs(cfg, args.seed + 2, (), REPEATS)
                rep = round_trip_with_error(session, rt, cfg, *repeats, layout)
                fails += check(cfg, me, rep, repeats, layout, f"{label} {layout} repeated ids")
                fails += [f"{label} {layout} repeated ids: {rep['error']}"] if rep["error"] else []
                rows.append((me, label, layout, (err or "none")[:60], "exact" if not fails else "FAIL"))
                failures += fails
    session.close()

    def table(all_rows) -> list[str]:
        return [f"{'rank':>4} {'plan':<24} {'layout':<9} {'planted ids: the error raised':<62} checks"] + [
            f"{r:>4} {label:<24} {layout:<9} {err:<62} {ok}"
            for r_rows in all_rows for r, label, layout, err, ok in r_rows]

    return harness.finish(failures, rows, table)


if __name__ == "__main__":
    sys.exit(main())
