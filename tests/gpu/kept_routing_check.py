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
the reference summed in its order. Prints a line per run (rank 0), then PASS or FAIL.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))  # tests/: the simulator test's helpers


def check(session, cfg, plan: dict, device_count: bool, node_size: int = 0) -> list[str]:
    """The simulator test's run on this rank: its failures."""
    from test_kept_routing_sim import REUSES, SEED, kept_inputs, kept_pe, reused_tokens

    from ep_runtime.core import reference
    from ep_runtime.testing import assert_batch_is_the_reference, call_inputs, combine_over_tolerance

    me, fails = session.rank, []
    got = kept_pe(session, plan, cfg, device_count)
    xs, ids, ws = kept_inputs(cfg)
    for call, layout in ((0, "expanded"),) + REUSES:
        toks = xs if call == 0 else reused_tokens(cfg, call, xs)
        refs = reference.dispatch(toks, ids, ws, cfg)
        try:
            assert_batch_is_the_reference(got[call], refs[me], layout, toks, cfg, f"call {call}")
        except AssertionError as e:
            fails.append(f"call {call} ({layout}) batch: {str(e)[:200]}")
        err = combine_over_tolerance(cfg, refs, ids, ws, me, got[call]["out"][:len(toks[me])], node_size)
        if err is not None:
            fails.append(f"call {call} ({layout}): the combine is off by {err}, over its tolerance")
    routed = reference.routed_ids(ids[me], cfg.n_experts)
    t = np.arange(len(xs[me]), dtype=np.float32)[:, None]
    k = np.arange(cfg.top_k, dtype=np.float32)[None, :]
    want = np.where(routed >= 0, me * 1e4 + t * 1e2 + k, 0.0).astype(np.float32)
    if not np.array_equal(got[3]["slots"][:len(xs[me])], want):
        fails.append("call 3: the slot values differ")
    xs4, ids4, ws4 = call_inputs(cfg, 2, SEED + 4)
    try:
        assert_batch_is_the_reference(got[4], reference.dispatch(xs4, ids4, ws4, cfg)[me], "expanded", xs4, cfg,
                                      "call 4")
    except AssertionError as e:
        fails.append(f"call 4 batch: {str(e)[:200]}")
    return fails


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[128, 4096])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--plans", nargs="+", default=["default", "all"])
    ap.add_argument("--nodes", type=int, default=1, help="logical nodes (2: the hierarchical transport)")
    args = ap.parse_args()
    from mpi4py import MPI
    from test_kept_routing_sim import NODES, VARIANTS, cfg_of

    from ep_runtime.core.layout import BufferLayout
    from ep_runtime.shmem import open_session
    from ep_runtime.testing import gpu_check_report, rank_rows

    comm = MPI.COMM_WORLD
    R = comm.Get_size()
    plans = {"default": None}
    if "all" in args.plans and args.nodes > 1:
        plans["puts within nodes"] = {"node_stores": False}
    elif "all" in args.plans:
        plans.update({k: {"receiver": v["receiver"], **({"transport": "puts"} if "puts" in k else {})}
                      for k, v in VARIANTS.items() if k not in NODES})
    configs = [cfg_of(R, n_experts=args.experts, top_k=args.top_k, hidden=args.hidden, max_tokens_per_rank=T)
               for T in args.tokens]
    session = open_session("nvshmem", heap_bytes=max(BufferLayout(c).symmetric_bytes for c in configs),
                           **({"logical_nodes": args.nodes} if args.nodes > 1 else {}))
    node_size = R // args.nodes if args.nodes > 1 else 0
    me, rows, failures = session.rank, [], []
    for cfg in configs:
        for name, plan in plans.items():
            for device_count in (False, True):
                what = f"T={cfg.max_tokens_per_rank} {name}" + (" device count" if device_count else "")
                fails = check(session, cfg, plan, device_count, node_size)
                rows.append((what, "exact" if not fails else "FAIL"))
                failures += [f"{what}: {f}" for f in fails]
    all_rows, all_failures = comm.gather(rows, root=0), comm.gather(failures, root=0)
    session.close()
    return gpu_check_report(all_failures, rank_rows(all_rows)) if me == 0 else 0


if __name__ == "__main__":
    sys.exit(main())
