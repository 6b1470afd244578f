"""Logical nodes on GPUs: one host's GPUs split into nodes that reach each other by NVSHMEM puts
only (``open_session(logical_nodes=n)``), as tests/test_logical_nodes_sim.py checks them on the
simulator:

    mpirun -np 4 -x PYTHONPATH python3 tests/gpu/logical_nodes_check.py [--nodes 2] [--tokens 128 4096]

On a session of ``--nodes`` logical nodes: the node map, no mapping of a peer on another node
(``peer_addresses`` None, ``peer_view`` refused), the plan on puts; per token
count, the round trips of the simulator test's calls (expanded and compact, ranks with no
tokens, masked slots) with every batch the reference's bit for bit and every combine within the
reference's tolerance; ``--soak`` more round trips of call 0's inputs, each bit-identical to the
first, and the median eager round trip. ``--nodes 1`` runs the soak and the timing on a session of
one node (stores), for the comparison (NVSHMEM is initialized once a process: one session a run).
``--backend sim`` runs the same under mpiexec on the simulator. Prints a table last (rank 0),
then PASS or FAIL.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time

import numpy as np


def own_failures(session, cfg, run: dict, calls: int, seed: int) -> list[str]:
    """This rank's calls of ``run`` (``testing.plan_pe``) against the reference: batches bit for
    bit, combine within the reference's tolerance."""
    from ep_runtime import reference
    from ep_runtime.testing import (
        assert_batch_is_the_reference,
        call_inputs,
        call_layout,
        combine_over_tolerance,
    )

    me, fails = session.rank, []
    for call in range(calls):
        xs, ids, ws = call_inputs(cfg, call, seed)
        refs = reference.dispatch(xs, ids, ws, cfg)
        layout = call_layout(cfg, call)
        got = run["calls"][call]
        try:
            assert_batch_is_the_reference(got, refs[me], layout, xs, cfg, f"call {call} ({layout})")
        except AssertionError as e:
            fails.append(f"call {call} ({layout}) batch: {str(e)[:300]}")
        err = combine_over_tolerance(cfg, refs, ids, ws, me, got["out"][:len(xs[me])])
        if err is not None:
            fails.append(f"call {call} ({layout}): the combine is off by {err}, over its tolerance")
    return fails


def soak_and_time(session, cfg, n: int, seed: int) -> tuple[int, float, float]:
    """``n`` round trips (expanded) of call 0's inputs on a fresh runtime: how many differ from
    the first (dispatch rows and combine output, by hash), and the median dispatch and combine
    us (host clock around each synchronized half: an eager call as a caller sees it)."""
    from ep_runtime import reference
    from ep_runtime.runtime import EPRuntime
    from ep_runtime.testing import call_inputs, expert_outputs

    me = session.rank
    xs, ids, ws = call_inputs(cfg, 0, seed)
    y = session.to_device(expert_outputs(cfg, reference.dispatch(xs, ids, ws, cfg)[me], me))
    x, i, w = (session.to_device(a) for a in (xs[me].view(np.uint16), ids[me], ws[me]))
    first, differ, td, tc = None, 0, [], []
    with EPRuntime(cfg, session) as rt:
        for _ in range(n):
            session.barrier()
            t0 = time.perf_counter()
            batch = rt.dispatch(x, i, w)
            session.synchronize()
            t1 = time.perf_counter()
            out = rt.combine(y, batch.handle)
            session.synchronize()
            t2 = time.perf_counter()
            td.append(t1 - t0)
            tc.append(t2 - t1)
            h = hashlib.sha1(session.to_host(batch.x)[:batch_rows(session, batch)].tobytes())
            h.update(session.to_host(out).tobytes())
            first = first or h.hexdigest()
            differ += h.hexdigest() != first
    return differ, 1e6 * float(np.median(td)), 1e6 * float(np.median(tc))


def batch_rows(session, batch) -> int:
    return int(session.to_host(batch.row_offsets)[-1])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--tokens", type=int, nargs="+", default=[128, 4096])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--soak", type=int, default=100)
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--backend", default="nvshmem", choices=("nvshmem", "sim"))
    args = ap.parse_args()
    from mpi4py import MPI

    from ep_runtime import EPConfig
    from ep_runtime.errors import EPInputError
    from ep_runtime.layout import BufferLayout
    from ep_runtime.plan import Topology, choose_plan
    from ep_runtime.shmem import open_session
    from ep_runtime.testing import plan_pe

    comm = MPI.COMM_WORLD
    R = comm.Get_size()
    cfgs = {T: EPConfig(n_ranks=R, n_experts=args.experts, top_k=args.top_k, hidden=args.hidden,
                        max_tokens_per_rank=T) for T in args.tokens}
    heap = max(BufferLayout(c).symmetric_bytes for c in cfgs.values()) + (64 << 20)
    rows, fails, nodes = [], [], args.nodes
    session = open_session(args.backend, heap, comm=comm, logical_nodes=nodes if nodes > 1 else None)
    me = session.rank
    node_of = session.node_of()
    if nodes > 1:
        probe = session.alloc_symmetric("check.probe", (8,), "int32")
        other = next(p for p in range(R) if node_of[p] != node_of[me])
        if session.peer_addresses(probe) is not None:
            fails.append(f"rank {me}: peer_addresses of a session of {nodes} nodes is not None")
        try:
            session.peer_view(probe, other)
            fails.append(f"rank {me}: peer_view of PE {other} (node {node_of[other]}) was not refused")
        except EPInputError as e:
            if "reach it with NVSHMEM puts" not in str(e):
                fails.append(f"rank {me}: peer_view refused with another message: {e}")
        session.free_symmetric(probe)
    for T, cfg in cfgs.items():
        plan = choose_plan(cfg, Topology.of(session))
        want = "puts" if nodes > 1 else "stores"
        if plan.transport.value != want:
            fails.append(f"rank {me}: {nodes} node(s), T={T}: transport {plan.transport.value}, want {want}")
        exact = None
        if nodes > 1:
            run = plan_pe(session, {}, cfg, args.calls, args.seed)
            own = own_failures(session, cfg, run, args.calls, args.seed)
            fails += [f"rank {me}, T={T}: {f}" for f in own]
            exact = args.calls - len({f.split(" ")[1] for f in own})
        differ, d_us, c_us = soak_and_time(session, cfg, args.soak, args.seed)
        if differ:
            fails.append(f"rank {me}, T={T}: {differ} of {args.soak} round trips differ from the first")
        rows.append((me, T, plan.summary(), exact, differ, d_us, c_us))
    session.close()
    every = comm.gather((rows, fails), root=0)
    if comm.Get_rank() != 0:
        return 0
    print(f"{R} ranks as {nodes} node(s) {node_of}, hidden {args.hidden}, top-{args.top_k} of {args.experts}, "
          f"backend {args.backend}; {args.soak} soak round trips (eager, host clock, median us)")
    print("rank     T  exact calls  soak differ  dispatch us  combine us  plan")
    for rs, _ in every:
        for me, T, summary, exact, differ, d_us, c_us in rs:
            ex = "-" if exact is None else f"{exact}/{args.calls}"
            print(f"{me:>4} {T:>5} {ex:>11} {differ:>11} {d_us:>12.1f} {c_us:>11.1f}  {summary}")
    all_fails = [f for _, fs in every for f in fs]
    for f in all_fails[:20]:
        print("FAIL:", f)
    print("FAIL" if all_fails else "PASS")
    return 1 if all_fails else 0


if __name__ == "__main__":
    sys.exit(main())
