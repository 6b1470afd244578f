"""Command line: ``python -m ep_runtime demo [options]``.

On a CPU the demo runs the real kernels on the built-in simulator, one process per rank.
Under ``mpirun`` on GPUs, ``--backend nvshmem`` runs them on NVSHMEM, one rank per GPU.
"""

from __future__ import annotations

import argparse
import sys

from .config import EPConfig
from .testing import SCENARIOS


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ep_runtime", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="route, dispatch, apply small experts, combine, check against the reference",
                       description="An end-to-end MoE round trip checked against the NumPy reference; prints "
                                   "a per-rank summary and PASS/FAIL (exit status 0/1).")
    d.add_argument("--backend", choices=("auto", "sim", "nvshmem", "reference"), default="auto",
                   help="auto: nvshmem under mpirun with GPUs, else the simulator (default)")
    d.add_argument("--ranks", type=int, default=4, help="ranks for the simulator outside mpirun (default 4)")
    d.add_argument("--experts", type=int, default=16)
    d.add_argument("--top-k", type=int, default=4)
    d.add_argument("--hidden", type=int, default=64)
    d.add_argument("--tokens", type=int, default=24, help="max tokens per rank (each rank sends 1..max)")
    d.add_argument("--n-sms", type=int, default=None, help="blocks per kernel (default: runtime's choice)")
    d.add_argument("--scenario", choices=sorted(SCENARIOS), default="random")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--timeout", type=float, default=300.0, help="seconds before a stuck simulator run fails")
    return p


def demo(args) -> int:
    from .demo import demo_rank, print_summary, reference_summary
    from .shmem.launch import job_backend, job_ranks, run_job

    backend = args.backend if args.backend == "reference" else job_backend(args.backend)
    n_ranks = args.ranks if backend == "reference" else job_ranks(args.ranks)
    cfg = EPConfig(n_ranks=n_ranks, n_experts=args.experts, top_k=args.top_k, hidden=args.hidden,
                   max_tokens_per_rank=args.tokens, n_sms=args.n_sms)
    if backend == "reference":
        ok = print_summary(cfg, "reference (NumPy oracle, no kernels)", args.scenario,
                           reference_summary(cfg, args.scenario, args.seed))
        return 0 if ok else 1
    from .layout import BufferLayout

    rows = run_job(demo_rank, n_ranks, args=(cfg.as_dict(), args.scenario, args.seed), backend=backend,
                   heap_bytes=BufferLayout(cfg).symmetric_bytes, timeout_s=args.timeout)
    if rows is None:  # a rank other than 0 under mpirun: rank 0 reports
        return 0
    name = "sim (Numba CUDA simulator, one process per rank)" if backend == "sim" else backend
    return 0 if print_summary(cfg, name, args.scenario, rows) else 1


def main(argv=None) -> int:
    from .errors import EPError

    args = _parser().parse_args(argv)
    try:
        return demo(args)
    except EPError as e:  # a clear message, not a traceback, for setup problems
        print(f"ep_runtime demo: {type(e).__name__}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
