"""Kept routing on GPUs (one rank per GPU), as tests/test_kept_routing_sim.py checks it on the
simulator:

    mpirun -np 2 -x PYTHONPATH python3 tests/gpu/kept_routing_check.py [--tokens 128 4096] [--plans default all]
    mpirun -np 4 -x PYTHONPATH python3 tests/gpu/kept_routing_check.py --nodes 2

Per token count and plan (``default``: the plan the runtime picks; ``all`` adds every receiver
on every transport), on a runtime with ``debug=False``, the simulator test's calls
(``kept_pe``): call 0 dispatched and its routing kept (masked slots, a repeated id, a rank with
no tokens), another routing at call 1, new tokens with the kept routing at calls 2 (compact) and
3 (expanded, with its slot values home), a fresh routing at call 4, with the token count on the
host and on the device. Every batch must be the reference's bit for bit, every combine within
the reference's tolerance (a GPU's fused multiply-adds round differently), the slot values
exact. ``--nodes N``: a session of N logical nodes, so the default plan is the hierarchical
transport (stores within a node; ``all`` adds puts within a node), the combine checked against
the reference summed in its order. ``--backend sim`` runs the same on the simulator
(``NUMBA_ENABLE_CUDASIM=1 mpiexec -n 2 python3 tests/gpu/kept_routing_check.py --backend sim --tokens 8
--hidden 16 --experts 8 --top-k 2``). Prints a line per run (rank 0), then PASS or FAIL.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import harness
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))  # tests/: the simulator test's helpers


def check(session, cfg, plan: dict, device_count: bool, node_size: int = 0) -> list[str]:
    """The simulator test's run on this rank: its failures."""
    from test_kept_routing_sim import REUSES, SEED, kept_inputs, kept_pe, reused_tokens

    from ep_runtime.core import reference
    from ep_runtime.testing import call_inputs

    me, check = session.rank, harness.Checks()
    got = kept_pe(session, plan, cfg, device_count)
    xs, ids, ws = kept_inputs(cfg)
    for call, layout in ((0, "expanded"),) + REUSES:
        toks = xs if call == 0 else reused_tokens(cfg, call, xs)
        refs = reference.dispatch(toks, ids, ws, cfg)
        what = f"call {call} ({layout})"
        check.no_failure(harness.batch_failure(got[call], refs[me], layout, toks, cfg, what))
        out = got[call]["out"][:len(toks[me])]
        check.no_failure(harness.reference_combine_failure(cfg, refs, ids, ws, me, out, what, node_size))
    routed = reference.routed_ids(ids[me], cfg.n_experts)
    t = np.arange(len(xs[me]), dtype=np.float32)[:, None]
    k = np.arange(cfg.top_k, dtype=np.float32)[None, :]
    want = np.where(routed >= 0, me * 1e4 + t * 1e2 + k, 0.0).astype(np.float32)
    check(np.array_equal(got[3]["slots"][:len(xs[me])], want), "call 3: the slot values differ")
    xs4, ids4, ws4 = call_inputs(cfg, 2, SEED + 4)
    check.no_failure(harness.batch_failure(got[4], reference.dispatch(xs4, ids4, ws4, cfg)[me], "expanded", xs4,
                                           cfg, "call 4"))
    return check.failures


def main() -> int:
    ap = argparse.ArgumentParser()
    harness.add_layer_options(ap, tokens=(128, 4096), hidden=512, experts=64)
    ap.add_argument("--plans", nargs="+", default=["default", "all"])
    ap.add_argument("--nodes", type=int, default=1, help="logical nodes (2: the hierarchical transport)")
    harness.add_backend_option(ap)
    args = ap.parse_args()
    from test_kept_routing_sim import NODES, VARIANTS, cfg_of

    from ep_runtime.testing import rank_rows

    R = harness.job_comm().Get_size()
    plans = {"default": None}
    if "all" in args.plans and args.nodes > 1:
        plans["puts within nodes"] = {"node_stores": False}
    elif "all" in args.plans:
        plans.update({k: {"receiver": v["receiver"], **({"transport": "puts"} if "puts" in k else {})}
                      for k, v in VARIANTS.items() if k not in NODES})
    configs = [cfg_of(R, n_experts=args.experts, top_k=args.top_k, hidden=args.hidden, max_tokens_per_rank=T)
               for T in args.tokens]
    session = harness.open_job_session(*configs, backend=args.backend, logical_nodes=args.nodes)
    node_size = R // args.nodes if args.nodes > 1 else 0
    rows, failures = [], []
    for cfg in configs:
        for name, plan in plans.items():
            for device_count in (False, True):
                what = f"T={cfg.max_tokens_per_rank} {name}" + (" device count" if device_count else "")
                fails = check(session, cfg, plan, device_count, node_size)
                rows.append((what, "exact" if not fails else "FAIL"))
                failures += [f"rank {session.rank}: {what}: {f}" for f in fails]
    session.close()
    return harness.finish(failures, rows, rank_rows)


if __name__ == "__main__":
    sys.exit(main())
