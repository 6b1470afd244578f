"""The main job: an end-to-end MoE round trip checked against the NumPy reference.

Every rank builds the same inputs from a seed (rows that encode their origin), routes them,
dispatches with the real kernels, applies small per-expert linear maps on the host, combines,
and checks its expert batch (exactly) and its combined output (within the stated tolerance)
against :mod:`ep_runtime.core.reference`. Runs on the simulator (one process per rank, on a CPU)
or on NVSHMEM under mpirun; ``--backend reference`` runs the reference alone.
"""

from __future__ import annotations

import sys
import textwrap
import time

import numpy as np

from ep_runtime.core import reference
from ep_runtime.core.config import EPConfig
from ep_runtime.testing import linear_experts, make_inputs


def reference_round_trip(cfg: EPConfig, scenario: str, seed: int):
    """The demo's inputs and the reference's results, every rank's: ``(xs, ids, ws, batches,
    expert outputs, combined outputs)``, lists indexed by rank."""
    xs, ids, ws = make_inputs(cfg, scenario, seed)
    batches = reference.dispatch(xs, ids, ws, cfg)
    ys = [linear_experts(b.x, b.row_offsets, cfg.n_local_experts, r) for r, b in enumerate(batches)]
    outs = reference.combine(ys, batches, ids, cfg)
    return xs, ids, ws, batches, ys, outs


def _progress(since: float | None, rank: int, what: str) -> None:
    """Rank 0's progress line on stderr (``since``: the job's start, ``time.time()``; None: quiet)."""
    if since is not None and rank == 0:
        print(f"ep_runtime demo: rank 0: {what} ({time.time() - since:.0f} s)", file=sys.stderr, flush=True)


def demo_rank(session, cfg_fields: dict, scenario: str, seed: int, progress_since: float | None = None) -> dict:
    """One rank of the demo: real kernels on ``session``; returns this rank's check summary.

    ``progress_since``: the job's start (``time.time()``); rank 0 then prints a line on stderr
    as each phase ends (runtime built, dispatched, combined). Collective: every rank calls.
    """
    from ep_runtime.core.runtime import EPRuntime

    cfg = EPConfig(**cfg_fields)
    xs, ids, ws, ref_batches, ref_ys, ref_outs = reference_round_trip(cfg, scenario, seed)
    r = session.rank
    with EPRuntime(cfg, session) as rt:
        _progress(progress_since, r, f"all {cfg.n_ranks} ranks started, runtime built")
        plan = rt.plan.summary()
        t0 = time.perf_counter()
        batch = rt.dispatch(session.to_device(xs[r].view(np.uint16)), session.to_device(ids[r]),
                            session.to_device(ws[r]))
        t_dispatch = time.perf_counter() - t0
        _progress(progress_since, r, "dispatched")
        ref = ref_batches[r]
        n = ref.n_rows
        got = {k: session.to_host(getattr(batch, k)) for k in
               ("x", "row_offsets", "expert_counts", "src_rank", "src_token", "src_k", "weight")}
        dispatch_ok = (np.array_equal(got["row_offsets"], ref.row_offsets)
                       and np.array_equal(got["expert_counts"], ref.expert_counts)
                       and np.array_equal(got["x"][:n], ref.x.view(np.uint16))
                       and all(np.array_equal(got[k][:n], getattr(ref, k))
                               for k in ("src_rank", "src_token", "src_k", "weight")))
        y = linear_experts(got["x"][:n].view(reference.BF16), got["row_offsets"], cfg.n_local_experts, r)
        t0 = time.perf_counter()
        out = rt.combine(session.to_device(y.view(np.uint16)), batch.handle)
        t_combine = time.perf_counter() - t0
        _progress(progress_since, r, "combined")
        out = session.to_host(out).view(reference.BF16).astype(np.float32)
    want = ref_outs[r].astype(np.float32)
    err = np.abs(out - want)
    # the largest expert output any token of this rank can sum: every rank's, over all ranks
    y_max = max((float(np.abs(v.astype(np.float32)).max(initial=0.0)) for v in ref_ys), default=0.0)
    tol = reference.combine_tolerance(ws[r], y_max, cfg.combine_dtype)  # [T, 1], per token
    return {"rank": r, "tokens": len(xs[r]), "rows": n, "expert_counts": got["expert_counts"].tolist(),
            "dispatch_exact": bool(dispatch_ok),
            "combine_max_err": float(err.max(initial=0.0)), "combine_ok": bool((err <= tol).all()),
            "combine_tol": float(tol.min()) if tol.size else None,
            "dispatch_s": t_dispatch, "combine_s": t_combine, "plan": plan}


#: What each column of the summary means, per backend kind: ``"kernels"`` (the simulator or
#: NVSHMEM) or ``"reference"`` (the NumPy oracle alone); the times' line follows from the backend.
COLUMNS = {
    "kernels": (
        ("tokens", "tokens this rank routed, each to its top-k experts (1 to --tokens per rank)"),
        ("rows", "expert-batch rows it received from dispatch, one per (token, local expert)"),
        ("batch", "its expert batch against the reference's: exact, or WRONG (dispatch copies rows)"),
        ("max err", "largest |kernel combine output - reference combine output| over its tokens' values"),
        ("tol", "the tolerance of max err: 2 bf16 ulps of sum_k |w_k| x max|expert output| per token "
                "(reference.combine_tolerance; the smallest of its tokens shown, each token checked against its "
                "own; the simulator has no fused multiply-add, so its error is 0)"),
        ("check", "PASS if its batch is exact and every output value is within tol, else FAIL"),
    ),
    "reference": (
        ("tokens", "tokens this rank routed, each to its top-k experts (1 to --tokens per rank)"),
        ("rows", "expert-batch rows the reference's dispatch gives it, one per (token, local expert)"),
        ("batch", "no kernels ran: the reference's batch is the one compared (always exact)"),
        ("max err", "largest |reference combine output - sum_k w_k x expert_k(x) in float32| over its tokens' "
                    "values (the oracle checked against the experts' maps applied directly)"),
        ("tol", "the tolerance of max err: 4 bf16 ulps of sum_k |w_k| x (5 |x| + 40) per value (the smallest "
                "shown)"),
        ("check", "PASS if every output value is within tol, else FAIL"),
    ),
}

#: Characters per line of the columns' legend.
LEGEND_WIDTH = 100

#: Printed under the simulator's table.
SIMULATOR_TIMES_NOTE = ("simulator times are not performance: every simulated GPU thread is a Python thread and "
                        "blocks run one at a time; time the kernels on GPUs (mpirun -np 2 python -m ep_runtime.tools.bench)")


def _num(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def print_summary(cfg: EPConfig, backend: str, scenario: str, rows: list[dict], kind: str = "kernels",
                  simulated: bool = False) -> bool:
    """Print the per-rank summary (what each column means, one line per rank, PASS or FAIL);
    whether every rank passed.

    Parameters
    ----------
    backend : str
        The backend's name for the first line.
    rows : list of dict
        :func:`demo_rank`'s (or :func:`reference_summary`'s) summary of each rank.
    kind : str
        ``"kernels"`` or ``"reference"``: which :data:`COLUMNS` legend applies.
    simulated : bool
        The kernels ran on the simulator: its times are labelled as not performance.
    """
    print(f"ep_runtime demo: backend={backend} ranks={cfg.n_ranks} experts={cfg.n_experts} top_k={cfg.top_k} "
          f"hidden={cfg.hidden} max_tokens_per_rank={cfg.max_tokens_per_rank} scenario={scenario}")
    if rows and rows[0].get("plan"):
        print(f"plan: {rows[0]['plan']}")
    if kind != "kernels":
        times = "no kernel calls are timed (-)"
    elif simulated:
        times = "host time of its dispatch and combine calls (on the simulator: not performance, see below)"
    else:
        times = ("host time of its dispatch and combine calls, the runtime's first (for performance: "
                 "python -m ep_runtime.tools.bench)")
    print("columns:")
    for name, meaning in COLUMNS[kind] + (("dispatch ms, combine ms", times),):
        print(textwrap.fill(meaning, LEGEND_WIDTH, initial_indent=f"  {name + ':':<9} ", subsequent_indent=" " * 12))
    print(f"{'rank':>4} {'tokens':>6} {'rows':>6} {'batch':>6} {'max err':>9} {'tol':>9} {'check':>5} "
          f"{'dispatch ms':>11} {'combine ms':>10}")
    failed, timed = [], kind == "kernels"
    for s in rows:
        ok = s["dispatch_exact"] and s["combine_ok"]
        if not ok:
            failed.append(s["rank"])
        print(f"{s['rank']:>4} {s['tokens']:>6} {s['rows']:>6} {'exact' if s['dispatch_exact'] else 'WRONG':>6} "
              f"{s['combine_max_err']:>9.3g} {_num(s.get('combine_tol'), '.3g'):>9} {'PASS' if ok else 'FAIL':>5} "
              f"{_num(s['dispatch_s'] * 1e3 if timed else None, '.1f'):>11} "
              f"{_num(s['combine_s'] * 1e3 if timed else None, '.1f'):>10}")
    if simulated:
        print(SIMULATOR_TIMES_NOTE)
    print("PASS" if not failed else f"FAIL: rank(s) {', '.join(map(str, failed))} (see the check column)")
    return not failed


def reference_summary(cfg: EPConfig, scenario: str, seed: int) -> list[dict]:
    """The demo with the reference standing in for the kernels (checks combine∘dispatch)."""
    xs, ids, ws, batches, _, outs = reference_round_trip(cfg, scenario, seed)
    rows = []
    for r in range(cfg.n_ranks):
        # Oracle self-check: each token's output equals the weighted sum of its experts' maps.
        x = xs[r].astype(np.float32)
        want = np.zeros_like(x)
        for k in range(cfg.top_k):
            e = ids[r][:, k]
            want += ws[r][:, k:k + 1] * (x * (1 + e[:, None] / 64) - e[:, None] / 8)
        err = np.abs(outs[r].astype(np.float32) - want)
        tol = 4 * 2.0**-7 * (np.abs(ws[r]).sum(1, keepdims=True) * (np.abs(x) * 5 + 40))
        rows.append({"rank": r, "tokens": len(xs[r]), "rows": batches[r].n_rows, "dispatch_exact": True,
                     "combine_max_err": float(err.max(initial=0.0)), "combine_ok": bool((err <= tol).all()),
                     "combine_tol": float(tol.min()) if tol.size else None, "dispatch_s": 0.0, "combine_s": 0.0})
    return rows
