"""The batched layout (DeepEP's low-latency rows) in one CUDA graph serving every decode step (run on
the GPU machine):

    mpirun -np 2 -x PYTHONPATH python3 tests/gpu/batched_graph_check.py [--capacity 128] [--replays 50]
        [--scenario masked] [--plans default | variants | receiver=land,transport=puts ...]
        [--combine-weights expert home]

Captures dispatch_async(n_tokens=<device scalar>) -> dispatch_wait(layout="batched") -> the expert
stand-in (the identity: a CuPy copy of the batch's ``[L, M, hidden]`` rows) -> combine_async(layout=
"batched", with the router weights: at the expert ranks, the dispatch's; or, ``EPConfig.combine_weights
="home"`` as the deep_ep layer builds its runtimes, the same weights passed to the combine and applied at
home) -> combine_wait once, with capacity-sized inputs, and counts the graph's nodes (the
driver's ``cuGraphGetNodes``; kernel nodes by ``cuGraphNodeGetType``): a capture that completes
holds no host synchronization (one would end it with an error), and a second capture of the same
calls must give the same nodes. Each replay writes new tokens, routing (``--scenario masked``: -1
slots) and weights into the inputs and a new token count into the device scalar (counts vary by
rank and replay: 0, 1, the capacity and random ones), replays the graph, and checks every local
expert's count, slot ranges, source tokens and rows exactly against
:func:`ep_runtime.core.reference_batched.batched` and the combine output within
``reference.combine_tolerance`` of :func:`~ep_runtime.core.reference_batched.combine_batched`
(or ``combine_batched_home``; a GPU may contract the weighted sums' multiply-adds), for each
``--combine-weights`` choice (default both). Prints a table, then PASS or FAIL.
"""

from __future__ import annotations

import argparse
import ctypes
import sys
from types import SimpleNamespace

import harness
import numpy as np
from graph_check import step_counts

#: The driver's graph node type of a kernel launch (CU_GRAPH_NODE_TYPE_KERNEL).
KERNEL_NODE = 0


def graph_nodes(graph) -> tuple[int, int]:
    """``(nodes, kernel nodes)`` of a captured CuPy graph (its ``cudaGraph_t``, the driver's ``CUgraph``)."""
    cuda = ctypes.CDLL("libcuda.so.1")
    n = ctypes.c_size_t(0)
    if cuda.cuGraphGetNodes(ctypes.c_void_p(graph.graph), None, ctypes.byref(n)):
        raise RuntimeError("cuGraphGetNodes failed")
    nodes = (ctypes.c_void_p * n.value)()
    cuda.cuGraphGetNodes(ctypes.c_void_p(graph.graph), nodes, ctypes.byref(n))
    kernels = 0
    for node in nodes:
        kind = ctypes.c_int(-1)
        cuda.cuGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(kind))
        kernels += kind.value == KERNEL_NODE
    return n.value, kernels


def step_reference(cfg, seed: int, i: int, counts: list[int], me: int, scenario: str) -> SimpleNamespace:
    """Replay ``i``'s inputs on rank ``me`` and what it must give there."""
    from ep_runtime.core import reference
    from ep_runtime.core.reference_batched import batched, combine_batched, combine_batched_home
    from ep_runtime.testing import make_inputs

    xs, ids, ws = make_inputs(cfg, scenario, seed * 1000 + i, n_tokens=counts)
    refs = batched(xs, ids, ws, cfg)
    if cfg.combine_weights == "home":  # the combine's weights (the dispatch's here) applied at home
        want = combine_batched_home([r.x for r in refs], refs, ids, ws, cfg)[me]
    else:
        want = combine_batched([r.x for r in refs], reference.dispatch(xs, ids, ws, cfg), ids, cfg)[me]
    b = refs[me]
    scale = float(np.abs(b.x.astype(np.float32)).max()) if b.x.size else 0.0
    return SimpleNamespace(tokens=xs[me].view(np.uint16), ids=ids[me], ws=ws[me], ref=b, want=want,
                           tol=reference.combine_tolerance(ws[me], scale))


def capture(rt, stream, tok, tid, tw, count, y, out):
    """The step's calls captured on ``stream``: the graph and the batch it fills. With
    ``combine_weights="home"`` the combine takes the weights ``tw`` (read at home by combine_wait)."""
    import cupy

    weights = {"weights": tw} if rt.cfg.combine_weights == "home" else {}
    stream.begin_capture()
    batch = rt.dispatch_wait(rt.dispatch_async(tok, tid, tw, n_tokens=count), layout="batched")
    cupy.copyto(y, batch.x)  # the identity expert, inside the graph
    rt.combine_wait(rt.combine_async(y, batch.handle, layout="batched", **weights), out=out)
    return stream.end_capture(), batch


def replay_steps(rt, session, check, counts_per_step, args) -> list:
    """Capture, count the nodes, replay once per step with checks; the table row."""
    import cupy

    cfg, me, stream, cap = rt.cfg, session.rank, session.stream, rt.cfg.max_tokens_per_rank
    L, M = cfg.n_local_experts, cfg.n_ranks * cap
    tok = cupy.zeros((cap, cfg.hidden), cupy.uint16)
    tid = cupy.zeros((cap, cfg.top_k), cupy.int32)
    tw = cupy.zeros((cap, cfg.top_k), cupy.float32)
    tid[:] = cupy.arange(cfg.top_k, dtype=cupy.int32)  # any valid routing for the capture
    count = cupy.zeros((1,), cupy.int32)
    y = cupy.zeros((L, M, cfg.hidden), cupy.uint16)
    out = cupy.zeros((cap, cfg.hidden), cupy.uint16)

    session.barrier()
    graph, batch = capture(rt, stream, tok, tid, tw, count, y, out)
    nodes = graph_nodes(graph)
    again, _ = capture(rt, stream, tok, tid, tw, count, y, out)
    check(graph_nodes(again) == nodes, f"a second capture gave {graph_nodes(again)} nodes, the first {nodes}")
    check(nodes[1] >= 5, f"{nodes[1]} kernel nodes: fewer than the step's five kernels and the copy")

    good = 0
    for i, counts in enumerate(counts_per_step):
        step = step_reference(cfg, args.seed, i, counts, me, args.scenario)
        n = counts[me]
        tok[:n] = cupy.asarray(step.tokens)
        tid[:n] = cupy.asarray(step.ids)
        tw[:n] = cupy.asarray(step.ws)
        count[0] = n
        stream.synchronize()
        session.barrier()
        graph.launch(stream)
        stream.synchronize()
        ref, what = step.ref, f"replay {i} (counts {counts})"
        got = {k: cupy.asnumpy(getattr(batch, k)) for k in ("x", "counts", "src_token", "layout_range")}
        ok = check(np.array_equal(got["counts"], ref.counts), f"{what}: counts {got['counts'].tolist()}")
        ok &= check(np.array_equal(got["layout_range"], ref.layout_range), f"{what}: layout_range")
        for e in range(L):
            c = int(ref.counts[e])
            ok &= check(np.array_equal(got["x"][e, :c], ref.x[e, :c].view(np.uint16)), f"{what}: expert {e} rows")
            ok &= check(np.array_equal(got["src_token"][e, :c], ref.src_token[e, :c]), f"{what}: expert {e} tokens")
        ok &= check.no_failure(harness.combine_failure(cupy.asnumpy(out[:n]), step.want.astype(np.float32), step.tol,
                                                       what))
        good += int(ok)
    rt.synchronize()
    return [(good, nodes)]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--capacity", type=int, default=128)
    harness.add_layer_options(ap, tokens=None, seed=7)
    ap.add_argument("--replays", type=int, default=50)
    harness.add_scenario_option(ap)
    ap.add_argument("--plans", nargs="+", default=["default"], metavar="PLAN", help=harness.PLANS_HELP)
    ap.add_argument("--combine-weights", nargs="+", choices=("expert", "home"), default=["expert", "home"],
                    help="where the combine applies the router weights (EPConfig.combine_weights; the hierarchical "
                         "transport takes 'expert' only)")
    args = ap.parse_args()
    plans = harness.plan_list(args.plans)

    R, cap = harness.job_comm().Get_size(), args.capacity
    cfgs = {w: harness.layer_config(args, R, cap, layouts="batched", combine_weights=w) for w in args.combine_weights}
    session = harness.open_job_session(*cfgs.values())
    rng = np.random.default_rng(args.seed)
    counts_per_step = [step_counts(R, cap, i, rng) for i in range(args.replays)]
    lines, rows, failures = harness.run_plans(
        session, plans, cfgs, lambda rt, label, check: replay_steps(rt, session, check, counts_per_step, args))
    session.close()

    def table(all_rows) -> list[str]:
        def cells(row) -> str:
            good, (nodes, kernels) = row
            return f"{good:>10} {args.replays:>4} {nodes:>6} {kernels:>7}"

        columns = f"{'replays ok':>10} {'of':>4} {'nodes':>6} {'kernels':>7}"
        return ["layout batched", *lines, *harness.plan_table(all_rows, len(plans), columns, cells,
                                                               key_column=("weights", 7))]

    return harness.finish(failures, rows, table, most=10)


if __name__ == "__main__":
    sys.exit(main())
