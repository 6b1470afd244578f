"""GPU acceptance of the dense layout (one rank per GPU; or several ranks on one GPU):

    mpirun -np 2 -x PYTHONPATH python3 tests/gpu/dense_check.py [--tokens 4096 128] [--replays 10]
        [--token-dtype bfloat16 fp8_e4m3] [--plans default | variants | receiver=wait,transport=puts ...]
    bash tests/gpu/mps_run.sh 2 sh -c 'mpirun -np 2 $EP_MPIRUN_ARGS python3 tests/gpu/dense_check.py'
    NUMBA_ENABLE_CUDASIM=1 mpiexec -n 2 python3 tests/gpu/dense_check.py --backend sim --tokens 6 3 \\
        --hidden 256 --experts 8 --top-k 2 --scenario masked

For each token format of ``--token-dtype``, plan of ``--plans`` (one runtime each, serving only the
dense layout) and token count T (T tokens on every rank):

- ``dispatch_wait(layout="dense")``: the dense rows (bf16 words, or FP8 codes and scales), each
  slot's local expert and weight, the maps between dense rows and (source, token) slots and the
  rows per source equal :func:`ep_runtime.core.reference.dense` bit for bit, with the slots, ids
  and weights past the rows received cleared;
- ``combine_async(layout="dense")`` of rows that name their rank and (source, token) equals
  :func:`~ep_runtime.core.reference.combine_dense` bit for bit (unweighted sums of bf16 rows in
  rank order: no multiply for a GPU to contract);
- (GPU only) a CUDA graph of the dense dispatch and combine, replayed ``--replays`` times, each
  replay's dense rows and output equal to the eager call's.

A plan that cannot run here is a failure; the others still run. Prints a table last (rank 0);
exits non-zero on any failure.
"""

from __future__ import annotations

import argparse
import sys
from types import SimpleNamespace

import harness
import numpy as np

#: The dense batch's fields checked against the reference (rows past the received count: cleared).
FIELDS = ("x", "topk_idx", "topk_weights", "slot", "slot_row", "source_rows")


def dense_partials(cfg, ref, rank: int) -> np.ndarray:
    """Rank ``rank``'s combine input: [R T, H] bf16 bits, dense row i = bf16((rank + 1) + slot[i] / 16
    + col / 256) (rows past the received count zero, never read)."""
    from ep_runtime.core.reference import BF16

    R, T = cfg.n_ranks, cfg.max_tokens_per_rank
    out = np.zeros((R * T, cfg.hidden), np.uint16)
    cols = np.arange(cfg.hidden, dtype=np.float32) / 256
    rows = np.float32(rank + 1) + ref.slot.astype(np.float32)[:, None] / 16 + cols[None, :]
    out[:len(ref.slot)] = rows.astype(BF16).view(np.uint16)
    return out


def dense_reference(cfg, T: int, seed: int, me: int, scenario: str) -> SimpleNamespace:
    """What the checks at T compare with on rank ``me``, computed once for every plan."""
    from ep_runtime.core import reference

    xs, ids, ws = harness.job_inputs(cfg, seed + T, T, scenario)
    refs = reference.dense(xs, ids, ws, cfg)
    ys = [dense_partials(cfg, d, r) for r, d in enumerate(refs)]
    want = reference.combine_dense(ys, refs, ids, cfg)[me]
    return SimpleNamespace(T=T, inputs=(xs[me].view(np.uint16), ids[me], ws[me]), ref=refs[me], y=ys[me],
                           want=want.view(np.uint16))


def batch_failures(session, b, ref, what: str) -> list[str]:
    """How the dense batch ``b`` differs from ``ref`` (empty: every field exact)."""
    host = {k: session.to_host(getattr(b, k)) for k in FIELDS}
    n, out = len(ref.slot), []
    want = {"x": ref.x.view(host["x"].dtype), "topk_idx": ref.topk_idx, "topk_weights": ref.topk_weights,
            "slot": ref.slot}
    for k, v in want.items():
        if not np.array_equal(host[k][:n], v):
            bad = np.flatnonzero((host[k][:n] != v).reshape(n, -1).any(axis=1))
            out.append(f"{what}: {k}: {len(bad)} of {n} rows differ, first {bad[:4].tolist()} (slots "
                       f"{ref.slot[bad[:4]].tolist()})")
    if not np.array_equal(host["slot_row"], ref.slot_row):
        out.append(f"{what}: slot_row differs")
    if not np.array_equal(host["source_rows"], ref.source_rows):
        out.append(f"{what}: source_rows {host['source_rows'].tolist()}, want {ref.source_rows.tolist()}")
    if (host["slot"][n:] != -1).any() or (host["topk_idx"][n:] != -1).any() or host["topk_weights"][n:].any():
        out.append(f"{what}: slots, ids or weights past the {n} rows received not cleared")
    if ref.scales is not None and not np.array_equal(session.to_host(b.scales)[:n].view(np.uint8),
                                                     ref.scales.view(np.uint8)):
        out.append(f"{what}: scales differ")
    return out


def check_t(rt, session, d: SimpleNamespace, args, check) -> tuple:
    """Every check at one T on runtime ``rt``: the table row ``(T, rows, graph replays alike, {check: ok})``."""
    dev, host = session.to_device, session.to_host
    tok, tid, tw = (dev(np.ascontiguousarray(a)) for a in d.inputs)
    y = dev(d.y)
    ok = {}
    b = rt.dispatch(tok, tid, tw, layout="dense")
    fails = batch_failures(session, b, d.ref, f"T={d.T} dispatch")
    ok["dispatch"] = check(not fails, "; ".join(fails))
    out = host(rt.combine(y, b.handle, layout="dense"))
    ok["combine"] = check(np.array_equal(out, d.want), f"T={d.T} combine: {int((out != d.want).any(axis=1).sum())} "
                                                       f"of {len(out)} tokens differ")
    same = graph_replays(rt, session, d, args) if args.backend == "nvshmem" else None
    if same is not None:
        ok["graph"] = check(same == args.replays, f"T={d.T}: {args.replays - same} graph replays differ")
    return d.T, len(d.ref.slot), same, ok


def graph_replays(rt, session, d: SimpleNamespace, args) -> int:
    """Replays of a captured dense dispatch and combine whose rows and output equal the eager call's
    (the rows of ``x`` received; those past them are stale, documented as such)."""
    import cupy

    stream, same, n = session.stream, 0, len(d.ref.slot)
    tok, tid, tw = (cupy.asarray(np.ascontiguousarray(a)) for a in d.inputs)
    y = cupy.asarray(d.y)
    eager = rt.dispatch(tok, tid, tw, layout="dense")

    def fields(b):  # the batch's fields the replays must reproduce
        return [getattr(b, k)[:n] if k == "x" else getattr(b, k) for k in FIELDS]

    first = [f.copy() for f in fields(eager)]
    out = cupy.empty((d.T, rt.cfg.hidden), cupy.uint16)
    rt.combine(y, eager.handle, layout="dense", out=out)
    want = out.copy()
    session.barrier()
    stream.begin_capture()
    gb = rt.dispatch_wait(rt.dispatch_async(tok, tid, tw), layout="dense")
    rt.combine_wait(rt.combine_async(y, gb.handle, layout="dense"), out=out)
    graph = stream.end_capture()
    for _ in range(args.replays):
        gb.x[:n].fill(0)
        out.fill(0)
        graph.launch(stream)
        stream.synchronize()
        same += all(bool(cupy.array_equal(g, f)) for g, f in zip(fields(gb), first)) and \
            bool(cupy.array_equal(out, want))
    rt.synchronize()
    return same


def main() -> int:
    ap = argparse.ArgumentParser()
    harness.add_layer_options(ap, tokens=(4096, 128), seed=7)
    ap.add_argument("--token-dtype", nargs="+", default=["bfloat16", "fp8_e4m3"],
                    help="EPConfig.token_dtype of each runtime (FP8: quantized in dispatch_async)")
    ap.add_argument("--replays", type=int, default=10)
    harness.add_scenario_option(ap)
    harness.add_backend_option(ap)
    ap.add_argument("--plans", nargs="+", default=["default"], metavar="PLAN", help=harness.PLANS_HELP)
    args = ap.parse_args()
    plans = harness.plan_list(args.plans)

    R = harness.job_comm().Get_size()
    cfgs = {fmt: harness.layer_config(args, R, max(args.tokens), token_dtype=fmt, layouts="dense")
            for fmt in args.token_dtype}
    session = harness.open_job_session(*cfgs.values(), backend=args.backend)
    me = session.rank
    refs = {fmt: [dense_reference(cfg, T, args.seed, me, args.scenario) for T in args.tokens]
            for fmt, cfg in cfgs.items()}
    lines, rows, failures = harness.run_plans(
        session, plans, cfgs,
        lambda rt, label, check: [check_t(rt, session, d, args, check) for d in refs[rt.cfg.token_dtype]])
    session.close()

    def table(all_rows) -> list[str]:
        def cells(row) -> str:
            T, n, same, ok = row
            graph = "-" if same is None else str(same)
            return f"{T:>5} {n:>6} {graph:>10}  {sum(ok.values())}/{len(ok)} exact"

        columns = f"{'T':>5} {'rows':>6} {'graph same':>10}  checks"
        return [*lines, *harness.plan_table(all_rows, len(plans), columns, cells, key_column=("format", 14))]

    return harness.finish(failures, rows, table)


if __name__ == "__main__":
    sys.exit(main())
