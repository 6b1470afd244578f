"""One training step of a MoE layer through ep_runtime's autograd functions, forward and backward
across ranks, checked against the same layer computed densely in one process with PyTorch.

    python examples/train_step.py --backend sim --ranks 2     # CPU: the simulator
    mpirun -np 2 python examples/train_step.py --hidden 1024 --ffn 512 --experts 16 --top-k 4 --tokens 256

Every rank builds the same float32 weights from a seed (a router ``[H, E]``; per expert SwiGLU
``W1, W3 [H, F]``, ``W2 [F, H]``; each rank keeps its local experts) and its own bf16 tokens. The
layer: router softmax, top-k renormalized (``topk_weights`` requires grad), ``FusedDispatch``,
each local expert's SwiGLU on its segment of the expert-major batch (float32 math on bf16 rows),
``FusedCombine``; the loss is ``sum(out * c)`` with a fixed bf16 cotangent ``c`` per rank. Rank 0
(or the launcher) gathers outputs and gradients and repeats the step densely in float32 on the
CPU with the routing the ranks chose (after checking it is the top-k of the reference's own
probabilities, up to ties within ``TIE_TOLERANCE``).

Tolerances (float32 reference vs bf16 transport): each checked tensor G against its reference R
must satisfy ``max|G - R| <= TOLERANCE * max|R|``. bf16 keeps 8 significant bits (relative
rounding <= 2**-9); a value of this step passes through at most six bf16 roundings in sequence
(the expert outputs, the forward combine's partial and result; the rows ``w * dL/dout``, the
expert-input gradient rows, the backward combine's partial and result; the token gradient adds
its router path), each relative to the magnitudes it sums: 6 * 2**-9 ~ 1.2% of the largest
magnitude, so ``TOLERANCE = 2**-5`` (3.1%) leaves a margin while a wrong weight, a missing term or
a misrouted row gives errors of the order of the values themselves. Prints one line per rank
with the time of each phase, then PASS or FAIL.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from ep_runtime import BufferLayout, EPConfig

#: Allowed max|G - R| as a fraction of max|R| (see the module docstring).
TOLERANCE = 2.0**-5
#: Reference probabilities this close count as a tie (the ranks may pick either expert).
TIE_TOLERANCE = 1e-5
PHASES = ("route", "dispatch", "experts", "combine", "backward")


def layer_weights(cfg: EPConfig, ffn: int, seed: int) -> dict:
    """Router and expert weights, float32 NumPy, identical on every rank."""
    rng = np.random.default_rng(seed)
    H, E = cfg.hidden, cfg.n_experts
    s = 1 / np.sqrt(H)
    return {"router": (rng.standard_normal((H, E)) * s).astype(np.float32),
            "w1": (rng.standard_normal((E, H, ffn)) * s).astype(np.float32),
            "w3": (rng.standard_normal((E, H, ffn)) * s).astype(np.float32),
            "w2": (rng.standard_normal((E, ffn, H)) / np.sqrt(ffn)).astype(np.float32)}


def rank_data(rank: int, cfg: EPConfig, seed: int):
    """This rank's tokens and loss cotangent, float32 values exact in bf16, ``[T, H]`` each (T
    varies by rank; rank 1 has none, so a rank without tokens takes part in every collective)."""
    import torch

    rng = np.random.default_rng(seed + 1 + rank)
    T = 0 if rank == 1 else int(rng.integers(1, cfg.max_tokens_per_rank + 1))
    x = torch.from_numpy(rng.standard_normal((T, cfg.hidden)).astype(np.float32)).bfloat16().float()
    c = torch.from_numpy(rng.standard_normal((T, cfg.hidden)).astype(np.float32)).bfloat16().float()
    return x, c


def swiglu(x, w1, w3, w2):
    """(silu(x W1) * (x W3)) W2 in float32."""
    import torch

    return (torch.nn.functional.silu(x @ w1) * (x @ w3)) @ w2


def route(x, router, top_k: int):
    """Top-k of the router's softmax, renormalized: ids [T, K] int64, weights [T, K] float32."""
    import torch

    p = torch.softmax(x.float() @ router, dim=1)
    top, ids = torch.topk(p, top_k, dim=1)
    return ids, top / top.sum(dim=1, keepdim=True)


def train_rank(session, fields: dict, ffn: int, seed: int, permuted_rows: int | None) -> dict:
    """One rank's training step; its outputs, gradients (host copies) and phase times."""
    import torch

    from ep_runtime.torch import close_buffers, fused_combine, fused_dispatch, get_buffer

    if session.backend == "sim":
        torch.set_num_threads(1)  # one process per rank already
        device = torch.device("cpu")
    else:
        device = torch.device("cuda", session.local_rank)
        torch.cuda.set_device(device)
    cfg = EPConfig(**fields)
    r, L = session.rank, cfg.n_local_experts
    W = {k: torch.from_numpy(v).to(device) for k, v in layer_weights(cfg, ffn, seed).items()}
    router = W["router"].requires_grad_()
    experts = [W[m][r * L:(r + 1) * L].clone().requires_grad_() for m in ("w1", "w3", "w2")]
    x32, c = (t.to(device) for t in rank_data(r, cfg, seed))
    x = x32.bfloat16().requires_grad_()
    rt = get_buffer(session, cfg.hidden * 2, cfg.n_experts, cfg.top_k, cfg.max_tokens_per_rank,
                    pad_multiple=cfg.pad_multiple)

    times, t0 = {}, time.perf_counter()

    def lap(phase):
        nonlocal t0
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        now = time.perf_counter()
        times[phase], t0 = now - t0, now

    ids, weights = route(x, router, cfg.top_k)
    lap("route")
    expert_x, _, _, handle = fused_dispatch(x, ids.to(torch.int32), weights, rt, permuted_rows)
    lap("dispatch")
    offsets = handle.row_offsets.tolist()
    rows = [swiglu(expert_x[offsets[e]:offsets[e + 1]].float(), *(w[e] for w in experts)) for e in range(L)]
    rows.append(torch.zeros(handle.n_rows - offsets[L], cfg.hidden, device=device))  # past the batch's end
    y = torch.cat(rows).bfloat16()
    lap("experts")
    out = fused_combine(y, weights, handle)
    lap("combine")
    (out.float() * c).sum().backward()
    rt.synchronize()
    lap("backward")
    close_buffers(session)
    host = lambda t: t.detach().float().cpu().numpy()  # noqa: E731
    return {"rank": r, "tokens": len(x), "ids": ids.cpu().numpy(), "out": host(out), "x_grad": host(x.grad),
            "router_grad": host(router.grad), "expert_grads": [host(w.grad) for w in experts], "times": times}


def dense_reference(cfg: EPConfig, ffn: int, seed: int, rows: list) -> dict:
    """The step in one process, float32 on the CPU, with the ranks' routing: out, dL/dx (all
    tokens, rank order), dL/drouter, dL/dW1, W3, W2; and whether the routing is the reference's
    top-k up to ties."""
    import torch

    W = {k: torch.from_numpy(v).requires_grad_() for k, v in layer_weights(cfg, ffn, seed).items()}
    xs, cs = zip(*(rank_data(row["rank"], cfg, seed) for row in rows))
    x = torch.cat(xs).requires_grad_()
    ids = torch.from_numpy(np.concatenate([row["ids"] for row in rows]))
    p = torch.softmax(x @ W["router"], dim=1)
    chosen = p.gather(1, ids)
    others = p.scatter(1, ids, -1.0)
    routing_ok = bool((chosen.min(dim=1).values >= others.max(dim=1).values - TIE_TOLERANCE).all()) if len(x) else True
    w = chosen / chosen.sum(dim=1, keepdim=True)
    out = torch.zeros_like(x)
    for e in range(cfg.n_experts):
        t, k = torch.nonzero(ids == e, as_tuple=True)
        y = swiglu(x[t], W["w1"][e], W["w3"][e], W["w2"][e])
        out = out.index_add(0, t, w[t, k][:, None] * y)
    (out * torch.cat(cs)).sum().backward()
    return {"out": out.detach().numpy(), "x_grad": x.grad.numpy(), "router_grad": W["router"].grad.numpy(),
            "expert_grads": [W[m].grad.numpy() for m in ("w1", "w3", "w2")], "routing_ok": routing_ok}


def compare(rows: list, ref: dict) -> dict:
    """max|G - R| / max|R| of each checked tensor."""
    def rel(got, want):
        return float(np.abs(got - want).max(initial=0.0) / max(np.abs(want).max(initial=0.0), 1e-30))

    return {"out": rel(np.concatenate([row["out"] for row in rows]), ref["out"]),
            "dL/dx": rel(np.concatenate([row["x_grad"] for row in rows]), ref["x_grad"]),
            "dL/drouter": rel(sum(row["router_grad"] for row in rows), ref["router_grad"]),
            **{f"dL/d{m}": rel(np.concatenate([row["expert_grads"][i] for row in rows]), ref["expert_grads"][i])
               for i, m in enumerate(("W1", "W3", "W2"))}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="auto", choices=("auto", "sim", "nvshmem"),
                    help="auto: nvshmem under mpirun with GPUs, else the simulator")
    ap.add_argument("--ranks", type=int, default=2, help="simulated ranks outside mpirun")
    ap.add_argument("--experts", type=int, default=4)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=16)
    ap.add_argument("--ffn", type=int, default=24)
    ap.add_argument("--tokens", type=int, default=6, help="max tokens per rank")
    ap.add_argument("--pad-multiple", type=int, default=1)
    ap.add_argument("--permuted-rows", type=int, default=None,
                    help="rows of the expert batch (HybridEP's num_permuted_tokens: no host read of the count)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    from ep_runtime.shmem.launch import job_ranks, run_job

    n_ranks = job_ranks(args.ranks)
    cfg = EPConfig(n_ranks=n_ranks, n_experts=args.experts, top_k=args.top_k, hidden=args.hidden,
                   max_tokens_per_rank=args.tokens, pad_multiple=args.pad_multiple)
    rows = run_job(train_rank, n_ranks, args=(cfg.as_dict(), args.ffn, args.seed, args.permuted_rows),
                   backend=args.backend, heap_bytes=BufferLayout(cfg).symmetric_bytes)
    if rows is None:  # a rank other than 0 under mpirun: rank 0 reports
        return 0
    ref = dense_reference(cfg, args.ffn, args.seed, rows)
    errors = compare(rows, ref)
    print(f"MoE train step: {n_ranks} ranks, {cfg.n_experts} experts, top-{cfg.top_k}, hidden {cfg.hidden}, "
          f"ffn {args.ffn}, pad {cfg.pad_multiple}")
    for row in rows:
        print(f"rank {row['rank']}: {row['tokens']:>5} tokens  "
              + "  ".join(f"{p} {row['times'][p] * 1e3:.2f} ms" for p in PHASES))
    print("max|G - R| / max|R|: " + "  ".join(f"{k} {v:.2e}" for k, v in errors.items())
          + f"  (tolerance {TOLERANCE:.2e})")
    ok = ref["routing_ok"] and all(v <= TOLERANCE for v in errors.values())
    if not ref["routing_ok"]:
        print("routing: the ranks' top-k is not the reference's")
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
