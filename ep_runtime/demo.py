"""The main job: an end-to-end MoE round trip checked against the NumPy reference.

Every rank builds the same inputs from a seed (rows that encode their origin), routes them,
dispatches with the real kernels, applies small per-expert linear maps on the host, combines,
and checks its expert batch (exactly) and its combined output (within the stated tolerance)
against :mod:`ep_runtime.reference`. Runs on the simulator (one process per rank, on a CPU)
or on NVSHMEM under mpirun; ``--backend reference`` runs the reference alone.
"""

from __future__ import annotations

import time

import numpy as np

from . import reference
from .config import EPConfig
from .testing import linear_experts, make_inputs


def reference_round_trip(cfg: EPConfig, scenario: str, seed: int):
    """Reference batches and outputs of every rank for the demo's inputs."""
    xs, ids, ws = make_inputs(cfg, scenario, seed)
    batches = reference.dispatch(xs, ids, ws, cfg)
    ys = [linear_experts(b.x, b.row_offsets, cfg.n_local_experts, r) for r, b in enumerate(batches)]
    outs = reference.combine(ys, batches, ids, cfg)
    return xs, ids, ws, batches, outs


def demo_rank(session, cfg_fields: dict, scenario: str, seed: int) -> dict:
    """One rank of the demo: real kernels on ``session``; returns this rank's check summary."""
    from .runtime import EPRuntime

    cfg = EPConfig(**cfg_fields)
    xs, ids, ws, ref_batches, ref_outs = reference_round_trip(cfg, scenario, seed)
    r = session.rank
    with EPRuntime(cfg, session) as rt:
        plan = rt.plan.summary()
        t0 = time.perf_counter()
        batch = rt.dispatch(session.to_device(xs[r].view(np.uint16)), session.to_device(ids[r]),
                            session.to_device(ws[r]))
        t_dispatch = time.perf_counter() - t0
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
        out = session.to_host(out).view(reference.BF16).astype(np.float32)
    want = ref_outs[r].astype(np.float32)
    err = np.abs(out - want)
    tol = reference.combine_tolerance(ws[r], max(1.0, float(np.abs(ref.x.astype(np.float32)).max(initial=0)) * 5))
    return {"rank": r, "tokens": len(xs[r]), "rows": n, "expert_counts": got["expert_counts"].tolist(),
            "dispatch_exact": bool(dispatch_ok),
            "combine_max_err": float(err.max(initial=0.0)), "combine_ok": bool((err <= tol).all()),
            "dispatch_s": t_dispatch, "combine_s": t_combine, "plan": plan}


def print_summary(cfg: EPConfig, backend: str, scenario: str, rows: list[dict]) -> bool:
    print(f"ep_runtime demo: backend={backend} ranks={cfg.n_ranks} experts={cfg.n_experts} top_k={cfg.top_k} "
          f"hidden={cfg.hidden} max_tokens_per_rank={cfg.max_tokens_per_rank} scenario={scenario}")
    if rows and rows[0].get("plan"):
        print(f"plan: {rows[0]['plan']}")
    print(f"{'rank':>4} {'tokens':>6} {'rows':>6} {'dispatch':>9} {'combine max err':>16} {'combine':>8} "
          f"{'dispatch ms':>11} {'combine ms':>10}")
    for s in rows:
        print(f"{s['rank']:>4} {s['tokens']:>6} {s['rows']:>6} {'exact' if s['dispatch_exact'] else 'WRONG':>9} "
              f"{s['combine_max_err']:>16.3g} {'ok' if s['combine_ok'] else 'WRONG':>8} "
              f"{s['dispatch_s'] * 1e3:>11.1f} {s['combine_s'] * 1e3:>10.1f}")
    ok = all(s["dispatch_exact"] and s["combine_ok"] for s in rows)
    print("PASS" if ok else "FAIL")
    return ok


def reference_summary(cfg: EPConfig, scenario: str, seed: int) -> list[dict]:
    """The demo with the reference standing in for the kernels (checks combine∘dispatch)."""
    xs, ids, ws, batches, outs = reference_round_trip(cfg, scenario, seed)
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
                     "dispatch_s": 0.0, "combine_s": 0.0})
    return rows
