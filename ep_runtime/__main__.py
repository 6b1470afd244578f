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


def _under_mpirun() -> bool:
    from .shmem.launch import mpi_rank_size

    return mpi_rank_size() is not None


def demo(args) -> int:
    from .demo import demo_rank, print_summary, reference_summary

    backend = args.backend
    if backend == "auto":
        from .shmem import gpu_visible

        backend = "nvshmem" if _under_mpirun() and gpu_visible() else "sim"
    n_ranks = args.ranks
    if backend in ("nvshmem", "sim") and _under_mpirun():
        n_ranks = _mpi_size()
    cfg = EPConfig(n_ranks=n_ranks, n_experts=args.experts, top_k=args.top_k, hidden=args.hidden,
                   max_tokens_per_rank=args.tokens, n_sms=args.n_sms)
    if backend == "reference":
        ok = print_summary(cfg, "reference (NumPy oracle, no kernels)", args.scenario,
                           reference_summary(cfg, args.scenario, args.seed))
        return 0 if ok else 1
    from .layout import BufferLayout
    from .shmem import open_session
    from .shmem.launch import run_pes

    heap = BufferLayout(cfg).symmetric_bytes
    if _under_mpirun():
        from mpi4py import MPI

        with open_session(backend, heap_bytes=heap) as session:
            row = demo_rank(session, cfg.as_dict(), args.scenario, args.seed)
        rows = MPI.COMM_WORLD.gather(row, root=0)
        ok = print_summary(cfg, backend, args.scenario, rows) if MPI.COMM_WORLD.Get_rank() == 0 else True
        ok = MPI.COMM_WORLD.allreduce(int(ok), op=MPI.MIN)
        return 0 if ok else 1
    if backend == "nvshmem":
        print("--backend nvshmem needs mpirun (one rank per GPU): mpirun -np 2 python -m ep_runtime demo "
              "--backend nvshmem", file=sys.stderr)
        return 2
    rows = run_pes(demo_rank, n_ranks, args=(cfg.as_dict(), args.scenario, args.seed), timeout_s=args.timeout,
                   heap_bytes=heap)
    return 0 if print_summary(cfg, "sim (Numba CUDA simulator, one process per rank)", args.scenario, rows) else 1


def _mpi_size() -> int:
    from .shmem.launch import mpi_rank_size

    return mpi_rank_size()[1]


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
