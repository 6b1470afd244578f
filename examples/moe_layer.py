"""A real MoE layer on ep_runtime: router, dispatch, SwiGLU experts, combine, checked against a
dense single-process reference of the same layer and weights.

    python examples/moe_layer.py                      # CPU: the simulator, 4 ranks
    mpirun -np 2 python examples/moe_layer.py --hidden 1024 --ffn 512 --experts 16 --top-k 4 --tokens 256

Every rank builds the same weights from a seed: a router ``[H, E]`` and, per expert, SwiGLU
matrices ``W1, W3 [H, F]`` and ``W2 [F, H]``. Each rank routes its own tokens (top-k of the
softmax, renormalized), dispatches them, runs each local expert's FFN over its contiguous
segment of the expert-major batch (NumPy on the simulator, CuPy/cuBLAS on GPUs), and combines.
Prints the error against the dense reference, the time per phase, and PASS.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from ep_runtime import EPConfig
from ep_runtime.core.layout import BufferLayout


def layer_weights(cfg: EPConfig, ffn: int, seed: int) -> dict:
    """Router and expert weights, float32, identical on every rank."""
    rng = np.random.default_rng(seed)
    H, E = cfg.hidden, cfg.n_experts
    s = 1 / np.sqrt(H)
    return {"router": rng.standard_normal((H, E)).astype(np.float32) * s,
            "w1": rng.standard_normal((E, H, ffn)).astype(np.float32) * s,
            "w3": rng.standard_normal((E, H, ffn)).astype(np.float32) * s,
            "w2": rng.standard_normal((E, ffn, H)).astype(np.float32) / np.sqrt(ffn)}


def bf16_to_f32(bits, xp):
    """float32 values of bf16 bit patterns (uint16), in NumPy or CuPy."""
    return (bits.astype(xp.uint32) << 16).view(xp.float32)


def f32_to_bf16(x, xp):
    """bf16 bit patterns (uint16) of float32 values, rounded to nearest even."""
    u = xp.ascontiguousarray(x, dtype=xp.float32).view(xp.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(xp.uint16)


def route(x, router, top_k: int):
    """Top-k of the router's softmax, renormalized: ids [T, K] int32, weights [T, K] float32."""
    logits = x @ router
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    ids = np.argsort(-p, axis=1, kind="stable")[:, :top_k].astype(np.int32)
    w = np.take_along_axis(p, ids, axis=1)
    return ids, (w / w.sum(axis=1, keepdims=True)).astype(np.float32)


def swiglu(x, w1, w3, w2, xp):
    """SwiGLU FFN: (silu(x W1) * (x W3)) W2, float32."""
    a = x @ w1
    return ((a / (1 + xp.exp(-a))) * (x @ w3)) @ w2


def tokens_of(rank: int, cfg: EPConfig, seed: int):
    """This rank's input tokens, bf16 bit patterns [T, H] (T varies by rank, one rank may have 0)."""
    rng = np.random.default_rng(seed + 1 + rank)
    T = int(rng.integers(0, cfg.max_tokens_per_rank + 1)) if rank else cfg.max_tokens_per_rank
    return f32_to_bf16(rng.standard_normal((T, cfg.hidden)).astype(np.float32), np)


def dense_reference(x_bits, W, top_k: int):
    """The layer in one process: out [T, H] float32 and the per-element tolerance [T, H]
    (2**-6 of sum_k w_k |y_k|: bf16 rounding of the expert outputs, the per-rank partials and
    the output, each at most 2**-9 relative)."""
    x = bf16_to_f32(x_bits, np)
    ids, w = route(x, W["router"], top_k)
    out = np.zeros_like(x)
    scale = np.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(top_k):
            e = ids[t, k]
            y = swiglu(x[t:t + 1], W["w1"][e], W["w3"][e], W["w2"][e], np)[0]
            out[t] += w[t, k] * y
            scale[t] += w[t, k] * np.abs(y)
    return out, 2.0**-6 * scale + 1e-6


def moe_rank(session, fields: dict, ffn: int, seed: int) -> dict:
    """One rank of the layer: route, dispatch, experts, combine; its check and phase times."""
    from ep_runtime import EPRuntime

    if session.backend == "sim":
        xp = np
    else:
        import cupy as xp
    cfg = EPConfig(**fields)
    W = layer_weights(cfg, ffn, seed)
    r, L = session.rank, cfg.n_local_experts
    x_bits = tokens_of(r, cfg, seed)
    times = {}
    with EPRuntime(cfg, session) as rt:
        experts = [tuple(xp.asarray(W[m][r * L + e]) for m in ("w1", "w3", "w2")) for e in range(L)]
        t0 = time.perf_counter()
        ids, w = route(bf16_to_f32(x_bits, np), W["router"], cfg.top_k)
        times["route"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        batch = rt.dispatch(session.to_device(x_bits), session.to_device(ids), session.to_device(w))
        times["dispatch"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        offsets = session.to_host(batch.row_offsets)
        y = xp.zeros((max(int(offsets[-1]), 1), cfg.hidden), xp.uint16)
        for e in range(L):
            lo, hi = int(offsets[e]), int(offsets[e + 1])
            if hi > lo:
                y[lo:hi] = f32_to_bf16(swiglu(bf16_to_f32(batch.x[lo:hi], xp), *experts[e], xp), xp)
        session.synchronize()
        times["experts"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = rt.combine(y, batch.handle)
        times["combine"] = time.perf_counter() - t0
        got = bf16_to_f32(session.to_host(out), np)
    want, tol = dense_reference(x_bits, W, cfg.top_k)
    err = np.abs(got - want)
    return {"rank": r, "tokens": len(x_bits), "max_err": float(err.max(initial=0.0)),
            "ok": bool((err <= tol).all()), "times": times}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=4, help="simulated ranks outside mpirun")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=32)
    ap.add_argument("--ffn", type=int, default=48)
    ap.add_argument("--tokens", type=int, default=12, help="max tokens per rank")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    from ep_runtime.shmem.launch import job_ranks, run_job

    n_ranks = job_ranks(args.ranks)
    cfg = EPConfig(n_ranks=n_ranks, n_experts=args.experts, top_k=args.top_k, hidden=args.hidden,
                   max_tokens_per_rank=args.tokens)
    rows = run_job(moe_rank, n_ranks, args=(cfg.as_dict(), args.ffn, args.seed),
                   heap_bytes=BufferLayout(cfg).symmetric_bytes)
    if rows is None:  # a rank other than 0 under mpirun: rank 0 reports
        return 0
    print(f"MoE layer: {n_ranks} ranks, {cfg.n_experts} experts, top-{cfg.top_k}, hidden {cfg.hidden}, ffn {args.ffn}")
    print(f"{'rank':>4} {'tokens':>6} {'max err':>9} {'check':>5}  " + " ".join(f"{p + ' ms':>12}" for p in rows[0]["times"]))
    for row in rows:
        print(f"{row['rank']:>4} {row['tokens']:>6} {row['max_err']:>9.2e} {'ok' if row['ok'] else 'WRONG':>5}  "
              + " ".join(f"{v * 1e3:>12.2f}" for v in row["times"].values()))
    ok = all(row["ok"] for row in rows)
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
