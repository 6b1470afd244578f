"""Logical nodes on GPUs: one host's GPUs split into nodes that reach each other by NVSHMEM puts
only (``open_session(logical_nodes=n)``), the hierarchical transport's testing topology, as
tests/test_hierarchical_sim.py checks it on the simulator:

    mpirun -np 4 -x PYTHONPATH python3 tests/gpu/logical_nodes_check.py [--nodes 2] [--tokens 128 4096]

On a session of ``--nodes`` logical nodes: the node map, no mapping of a peer on another node
(``peer_addresses`` None, ``peer_view`` refused), the plan on the hierarchical transport; per
token count, the round trips of the simulator test's calls (expanded and compact, ranks with no
tokens, masked slots, every token to one expert) with every batch the reference's bit for bit and
every combine within the reference's tolerance of the reference summed in the hierarchical order;
``--soak`` more round trips of call 0's inputs, each bit-identical to the first, and the median
eager round trip; ``--fp8`` FP8 (e4m3) round trips too, codes and scales bit for bit;
``--fault``: the last logical node withholds one call, and every rank of the others must raise
the timeout its proxy's ``dispatch_relay`` recorded, naming the source that withheld it.
``--nodes 1`` runs the soak and the timing on a session of one node (stores), for the comparison
(NVSHMEM is initialized once a process: one session a run). ``--backend sim`` runs the same
under mpiexec on the simulator. Prints a table last (rank 0), then PASS or FAIL.
"""

from __future__ import annotations

import argparse
import sys
import time

import harness
import numpy as np


def own_failures(session, cfg, run: dict, calls: int, seed: int, node_size: int) -> tuple[list[str], int]:
    """This rank's calls of ``run`` (``testing.plan_pe``) against the reference, batches bit for
    bit, combine within the reference's tolerance: the failures and how many calls passed."""
    from ep_runtime.core import reference
    from ep_runtime.testing import call_inputs, call_layout

    me, check, exact = session.rank, harness.Checks(), 0
    for call in range(calls):
        xs, ids, ws = call_inputs(cfg, call, seed)
        refs = reference.dispatch(xs, ids, ws, cfg)
        layout = call_layout(cfg, call)
        got, what = run["calls"][call], f"call {call} ({layout})"
        batch = check.no_failure(harness.batch_failure(got, refs[me], layout, xs, cfg, what))
        out = got["out"][:len(xs[me])]
        combine = check.no_failure(harness.reference_combine_failure(cfg, refs, ids, ws, me, out, what, node_size))
        exact += batch and combine
    return check.failures, exact


def soak_and_time(session, cfg, n: int, seed: int, plan: str = "") -> tuple[int, float, float]:
    """``n`` round trips (expanded) of call 0's inputs on a fresh runtime: how many differ from
    the first (dispatch rows and combine output, by hash), and the median dispatch and combine
    us (host clock around each synchronized half: an eager call as a caller sees it)."""
    from ep_runtime.core import reference
    from ep_runtime.core.runtime import EPRuntime
    from ep_runtime.testing import call_inputs, expert_outputs

    me = session.rank
    xs, ids, ws = call_inputs(cfg, 0, seed)
    y = session.to_device(expert_outputs(cfg, reference.dispatch(xs, ids, ws, cfg)[me], me))
    x, i, w = harness.device_inputs(session, xs, ids, ws)
    first, differ, td, tc = None, 0, [], []
    rt = EPRuntime(cfg, session, plan=plan or None)
    for k in range(n):
        session.barrier()
        t0 = time.perf_counter()
        try:
            batch = rt.dispatch(x, i, w)
            session.synchronize()
            t1 = time.perf_counter()
            out = rt.combine(y, batch.handle)
            session.synchronize()
        except Exception as e:  # print it now: the runtime's collective close would wait for the peers
            from mpi4py import MPI

            print(f"rank {me}: soak call {k}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            MPI.COMM_WORLD.Abort(1)
        t2 = time.perf_counter()
        td.append(t1 - t0)
        tc.append(t2 - t1)
        # compared where they are: a host copy of a large batch would cost more than the call
        now = (batch.x[:batch_rows(session, batch)], out)
        xp = __import__("cupy") if "cupy" in type(out).__module__ else np
        if first is None:
            first = tuple(a.copy() for a in now)
        else:
            differ += not all(bool(xp.array_equal(a, b)) for a, b in zip(now, first))
    rt.close()
    return differ, 1e6 * float(np.median(td)), 1e6 * float(np.median(tc))


def fp8_failures(session, cfg, seed: int, comm) -> list[str]:
    """FP8 (e4m3) round trips of the simulator test's calls (``testing.fp8_plan_pe``) on every
    rank, checked on rank 0 against the reference (``assert_fp8_calls_are_the_reference``: codes
    and scales bit for bit, the combine within tolerance, in the hierarchical order)."""
    import dataclasses

    from ep_runtime.testing import assert_fp8_calls_are_the_reference, fp8_plan_pe

    cfg8 = dataclasses.replace(cfg, token_dtype="fp8_e4m3")
    run = fp8_plan_pe(session, {}, cfg8, seed)
    runs = comm.gather(run, root=0)
    if comm.Get_rank() != 0:
        return []
    try:
        assert_fp8_calls_are_the_reference(cfg8, runs, seed, False, f"FP8 T={cfg.max_tokens_per_rank}",
                                           node_size=run["plan"]["node_size"], exact_combine=False)
    except AssertionError as e:
        return [f"FP8 T={cfg.max_tokens_per_rank}: {str(e)[:300]}"]
    return []


def batch_rows(session, batch) -> int:
    return int(session.to_host(batch.row_offsets)[-1])


def withheld_call(session, cfg, seed: int, nodes: int) -> str | None:
    """A runtime of ``cfg`` with a short wait timeout: one round trip on every rank, then the
    last node's ranks withhold their next dispatch. On the other ranks: the failure, or None
    when their dispatch raised the timeout of ``dispatch_relay`` naming their source there."""
    import dataclasses

    from ep_runtime.core import reference
    from ep_runtime.core.errors import EPTimeoutError
    from ep_runtime.core.runtime import EPRuntime
    from ep_runtime.testing import call_inputs, expert_outputs

    me, R = session.rank, session.n_ranks
    size = R // nodes
    xs, ids, ws = call_inputs(cfg, 0, seed)
    y = session.to_device(expert_outputs(cfg, reference.dispatch(xs, ids, ws, cfg)[me], me))
    x, i, w = harness.device_inputs(session, xs, ids, ws)
    verdict = None
    with EPRuntime(dataclasses.replace(cfg, wait_timeout_s=2.0), session) as rt:
        rt.combine(y, rt.dispatch(x, i, w).handle)
        if me // size != nodes - 1:
            source = (nodes - 1) * size + me % size
            try:
                rt.dispatch(x, i, w)
                verdict = "the dispatch raised nothing"
            except EPTimeoutError as e:
                want = (f"rank {me}: dispatch_relay of call 1 timed out", f"waiting for rank {source}: relay_signal")
                verdict = None if all(w in str(e) for w in want) else f"another timeout: {str(e)[:200]}"
        session.barrier()
    return verdict


def main() -> int:
    from mpi4py import MPI

    try:
        return checked_main()
    except BaseException:  # a rank that fails mid-call must not leave its peers in a collective: abort the job
        import traceback

        print(f"rank {MPI.COMM_WORLD.Get_rank()}: " + traceback.format_exc(), file=sys.stderr, flush=True)
        MPI.COMM_WORLD.Abort(1)
        return 1


def checked_main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=2)
    harness.add_layer_options(ap, tokens=(128, 4096), hidden=2048, experts=64, seed=11)
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--soak", type=int, default=100)
    harness.add_backend_option(ap)
    ap.add_argument("--fp8", action="store_true", help="also FP8 (e4m3) round trips: codes and scales exact")
    ap.add_argument("--fault", action="store_true", help="last: the last node withholds a call (named timeouts)")
    ap.add_argument("--watchdog", type=float, default=0, help="print every thread's stack every S seconds (hangs)")
    ap.add_argument("--plan", default="", help="plan overrides (transport=puts, ...): the transport is not checked")
    args = ap.parse_args()
    if args.watchdog:
        import faulthandler

        faulthandler.dump_traceback_later(args.watchdog, repeat=True)
    from ep_runtime.core.errors import EPInputError
    from ep_runtime.core.plan import Topology, choose_plan
    from ep_runtime.testing import plan_pe

    comm = harness.job_comm()
    R, nodes = comm.Get_size(), args.nodes
    cfgs = {T: harness.layer_config(args, R, T) for T in args.tokens}
    rows, fails = [], []
    session = harness.open_job_session(*cfgs.values(), backend=args.backend, extra_bytes=64 << 20,
                                       logical_nodes=nodes)
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
    def progress(what: str) -> None:  # where a run that hangs got to (stderr, every rank)
        print(f"rank {me}: {what} ({time.monotonic() - t0:.0f} s)", file=sys.stderr, flush=True)

    t0 = time.monotonic()
    for T, cfg in cfgs.items():
        plan = choose_plan(cfg, Topology.of(session))
        progress(f"T={T}: {plan.summary()}")
        want = "hierarchical" if nodes > 1 else "stores"
        if not args.plan and plan.transport.value != want:
            fails.append(f"rank {me}: {nodes} node(s), T={T}: transport {plan.transport.value}, want {want}")
        exact = None
        if nodes > 1:
            run = plan_pe(session, args.plan or {}, cfg, args.calls, args.seed)
            own, exact = own_failures(session, cfg, run, args.calls, args.seed, run["plan"]["node_size"])
            for f in own:
                progress(f"T={T}: {f}")
            fails += [f"rank {me}, T={T}: {f}" for f in own]
        progress(f"T={T}: round trips checked, soak")
        differ, d_us, c_us = soak_and_time(session, cfg, args.soak, args.seed, args.plan)
        if differ:
            fails.append(f"rank {me}, T={T}: {differ} of {args.soak} round trips differ from the first")
        rows.append((me, T, plan.summary(), exact, differ, d_us, c_us))
        if args.fp8 and nodes > 1:
            progress(f"T={T}: FP8 round trips")
            fails += fp8_failures(session, cfg, args.seed, comm)
    fault = None
    if args.fault and nodes > 1:
        progress("a withheld call")
        fault = withheld_call(session, cfgs[min(cfgs)], args.seed, nodes)
        if fault is not None:
            fails.append(f"rank {me}: a withheld call: {fault}")
    session.close()

    def table(every) -> list[str]:
        lines = [f"{R} ranks as {nodes} node(s) {node_of}, hidden {args.hidden}, top-{args.top_k} of {args.experts}, "
                 f"backend {args.backend}; {args.soak} soak round trips (eager, host clock, median us)",
                 "rank     T  exact calls  soak differ  dispatch us  combine us  plan"]
        for rank_rows, _ in every:
            for r, T, summary, exact, differ, d_us, c_us in rank_rows:
                ex = "-" if exact is None else f"{exact}/{args.calls}"
                lines.append(f"{r:>4} {T:>5} {ex:>11} {differ:>11} {d_us:>12.1f} {c_us:>11.1f}  {summary}")
        if args.fault and nodes > 1:
            named = all(rank_fault is None for _, rank_fault in every)
            lines.append(f"fault: node {nodes - 1} withheld call 1; the other nodes' ranks raised dispatch_relay's "
                         f"timeout naming their source: {'yes' if named else 'NO'}")
        return lines

    return harness.finish(fails, (rows, fault), table, most=20)


if __name__ == "__main__":
    sys.exit(main())
