"""ep_runtime.torch_async on GPUs (one rank per GPU): exactness, and a shared expert overlapped with
the dispatch in flight:

    mpirun -np 2 -x PYTHONPATH python3 tests/gpu/overlap_check.py [--tokens 4096] [--ffn 2048]

One runtime (bf16, the expanded layout). Exactness: a dispatch through ``dispatch_async`` /
``dispatch_wait`` on torch tensors equals the NumPy reference (rows, offsets, counts, sources,
weights bit for bit), ``combine_async`` / ``combine_wait`` of the reference's expert outputs is
within ``reference.combine_tolerance`` of the reference's combine (a GPU contracts multiply-adds),
and ``expert_counts`` is a CUDA tensor. Overlap: a shared
expert ``relu(x W1) W2`` (``[T, H] x [H, F]``, ``[T, F] x [F, H]``, bf16 cuBLAS on the torch
stream) timed with CUDA events on the torch stream, median of ``--samples`` (barrier before
each): the dispatch alone, the shared expert alone, both in sequence (``dispatch_wait`` before
the shared expert) and overlapped (the shared expert enqueued between ``dispatch_async`` and
``dispatch_wait``). Prints a row per rank, then PASS (exact, and overlapped faster than in
sequence) or FAIL.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import harness
import numpy as np


def main() -> int:
    ap = argparse.ArgumentParser()
    harness.add_layer_options(ap, tokens=4096, seed=3)
    ap.add_argument("--ffn", type=int, default=2048)
    ap.add_argument("--samples", type=int, default=30)
    args = ap.parse_args()
    import torch

    from ep_runtime import EPRuntime, reference
    from ep_runtime.testing import expert_outputs
    from ep_runtime.torch_async import combine_async, combine_wait, dispatch_async, dispatch_wait

    cfg = harness.layer_config(args, harness.job_comm().Get_size(), args.tokens, layouts=("expanded",))
    session = harness.open_job_session(cfg)
    me = session.rank
    dev = torch.device("cuda", session.device_index)
    torch.cuda.set_device(dev)
    xs, ids, ws = harness.job_inputs(cfg, args.seed)
    bf16 = lambda a: torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16).to(dev)  # noqa: E731
    x, i, w = bf16(xs[me]), torch.from_numpy(ids[me]).to(dev), torch.from_numpy(ws[me]).to(dev)
    g = torch.Generator(device=dev).manual_seed(args.seed)
    w1 = (torch.randn(args.hidden, args.ffn, device=dev, generator=g) / args.hidden ** 0.5).to(torch.bfloat16)
    w2 = (torch.randn(args.ffn, args.hidden, device=dev, generator=g) / args.ffn ** 0.5).to(torch.bfloat16)
    check = harness.Checks(f"rank {me}: ")
    with EPRuntime(cfg, session) as rt:
        # exactness
        refs = reference.dispatch(xs, ids, ws, cfg)
        batch = dispatch_wait(dispatch_async(x, i, w, rt))
        host = {k: getattr(batch, k).cpu() for k in ("x", "row_offsets", "expert_counts", "src_rank", "src_token",
                                                     "src_k", "weight")}
        got = {k: (v.view(torch.int16).numpy().view(np.uint16) if v.dtype == torch.bfloat16 else v.numpy())
               for k, v in host.items()}
        check.no_failure(harness.batch_failure(got, refs[me], "expanded", xs, cfg, "batch"))
        check(batch.expert_counts.device.type == "cuda", f"expert_counts on {batch.expert_counts.device}")
        y = bf16(expert_outputs(cfg, refs[me], me))
        out = combine_wait(combine_async(y, batch)).cpu().view(torch.int16).numpy().view(np.uint16)
        # FMA contraction: within the tolerance, not bit for bit
        check.no_failure(harness.reference_combine_failure(cfg, refs, ids, ws, me, out, "combine"))

        def shared():
            return torch.relu(x @ w1) @ w2

        def dispatch_then_shared():
            b = dispatch_wait(dispatch_async(x, i, w, rt))
            return b, shared()

        def shared_inside_dispatch():
            p = dispatch_async(x, i, w, rt)
            s = shared()
            return dispatch_wait(p), s

        def dispatch_only():
            return dispatch_wait(dispatch_async(x, i, w, rt))

        times = {}
        for name, fn in (("dispatch", dispatch_only), ("shared", shared), ("in sequence", dispatch_then_shared),
                         ("overlapped", shared_inside_dispatch)):
            samples = []
            for s in range(args.samples + 3):
                torch.cuda.synchronize()
                session.barrier()
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                fn()
                e1.record()
                e1.synchronize()
                if s >= 3:
                    samples.append(e0.elapsed_time(e1) * 1e3)
            times[name] = statistics.median(samples)
    check(times["in sequence"] - times["overlapped"] > 0,
          f"overlapped {times['overlapped']:.1f} us, not faster than in sequence {times['in sequence']:.1f} us")
    del x, i, w, w1, w2, y, batch  # torch's memory freed while the context lives (close() ends it)
    torch.cuda.synchronize()
    session.close()

    def table(every) -> list[str]:
        lines = [f"T={args.tokens} H={args.hidden} K={args.top_k} E={args.experts}, shared expert F={args.ffn}; "
                 f"us, median of {args.samples}, CUDA events on the torch stream",
                 f"{'rank':>4} {'dispatch':>9} {'shared':>9} {'in sequence':>12} {'overlapped':>11} {'saved':>8}"]
        for r, t in enumerate(every):
            lines.append(f"{r:>4} {t['dispatch']:>9.1f} {t['shared']:>9.1f} {t['in sequence']:>12.1f} "
                         f"{t['overlapped']:>11.1f} {t['in sequence'] - t['overlapped']:>8.1f}")
        return lines

    return harness.finish(check.failures, times, table)


if __name__ == "__main__":
    sys.exit(main())
