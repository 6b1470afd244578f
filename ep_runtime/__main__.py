"""Command line: ``python -m ep_runtime demo [options]`` and ``python -m ep_runtime deep-ep
{install,uninstall,status}``.

On a CPU the demo runs the real kernels on the built-in simulator, one process per rank.
Under ``mpirun`` on GPUs, ``--backend nvshmem`` runs them on NVSHMEM, one rank per GPU.
``deep-ep install`` makes ``import deep_ep`` give ep_runtime's DeepEP layer in every process of
this Python (:mod:`ep_runtime.integrations.deep_ep.alias`).
"""

from __future__ import annotations

import argparse
import sys
import time

from ep_runtime.tools.cli import HelpFormatter, Heartbeat
from ep_runtime.core.config import EPConfig
from ep_runtime.testing import SCENARIOS

#: Seconds between "still running" lines while the simulated ranks run.
PROGRESS_EVERY_S = 15.0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ep_runtime", description=__doc__, formatter_class=HelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="route, dispatch, apply small experts, combine, check against the reference",
                       formatter_class=HelpFormatter,
                       description="An end-to-end MoE round trip checked against the NumPy reference. Prints\n"
                                   "what each column means, a line per rank and PASS or FAIL (exit status 0 or\n"
                                   "1; 2: refused, or failed to run). On the simulator, a size it cannot finish\n"
                                   "within --timeout is refused before anything starts, with its estimate.")
    d.add_argument("--backend", choices=("auto", "sim", "nvshmem", "reference"), default="auto",
                   help="auto: nvshmem under mpirun with GPUs, else the simulator (sim); reference: the NumPy "
                        "oracle alone, no kernels")
    d.add_argument("--ranks", type=int, default=4, help="ranks for the simulator outside mpirun")
    d.add_argument("--experts", type=int, default=16, help="experts in all (a multiple of the ranks)")
    d.add_argument("--top-k", type=int, default=4, help="experts per token")
    d.add_argument("--hidden", type=int, default=64, help="values per token row (bf16)")
    d.add_argument("--tokens", type=int, default=24, help="max tokens per rank (each rank sends 1..max)")
    d.add_argument("--n-sms", type=int, default=None, help="blocks per kernel (without it: the runtime's choice)")
    d.add_argument("--scenario", choices=sorted(SCENARIOS), default="random", help="routing")
    d.add_argument("--seed", type=int, default=0, help="seed of the tokens and the routing")
    d.add_argument("--timeout", type=float, default=300.0,
                   help="simulator: seconds before the run fails; sizes estimated to take longer are refused")
    a = sub.add_parser("deep-ep", help="make `import deep_ep` give ep_runtime's DeepEP layer (or undo it, or report)",
                       formatter_class=HelpFormatter,
                       description="install: write ep_runtime_deep_ep.pth and the module it loads into a site\n"
                                   "directory, so that every process of this Python (torchrun, mpirun and\n"
                                   "multiprocessing workers included) gets ep_runtime.deep_ep for `import deep_ep`.\n"
                                   "Refused while a real DeepEP is installed, unless --shadow. uninstall: remove\n"
                                   "them. status: what is installed where. Exit status 0, or 2 when refused.")
    a.add_argument("action", choices=("install", "uninstall", "status"))
    a.add_argument("--site", default=None, help="the site directory (default: this Python's site-packages)")
    a.add_argument("--shadow", action="store_true", help="install even though a real DeepEP is installed (it is "
                                                         "hidden; every import warns)")
    return p


def deep_ep_command(args) -> int:
    """``python -m ep_runtime deep-ep ACTION``: the install step (:mod:`ep_runtime.integrations.deep_ep.alias`)."""
    from ep_runtime.integrations.deep_ep import alias

    if args.action == "install":
        for path in alias.install(args.site, shadow=args.shadow):
            print(f"wrote {path}")
        print("`import deep_ep` now gives ep_runtime.deep_ep in new processes of this Python "
              "(`python -m ep_runtime deep-ep uninstall` undoes it)")
    elif args.action == "uninstall":
        removed = alias.uninstall(args.site)
        print("\n".join(f"removed {p}" for p in removed) if removed else "nothing to remove")
    else:
        for key, value in alias.status(args.site).items():
            print(f"{key}: {value}")
    return 0


def simulator_estimate(cfg: EPConfig, scenario: str):
    """The demo's cost on the simulator (:mod:`ep_runtime.tools.sim_cost`): one round trip, each rank
    sending (1 + max tokens) / 2 tokens on average."""
    from ep_runtime.tools.sim_cost import estimate, ranks_per_token

    senders = cfg.n_ranks - (1 if scenario == "zero_rank" else 0)
    messages = senders * (cfg.max_tokens_per_rank + 1) / 2 * ranks_per_token(cfg.n_ranks, cfg.n_experts,
                                                                                cfg.top_k, scenario)
    return estimate(cfg.n_ranks, [(1, messages, cfg.hidden)])


def _too_slow(cfg: EPConfig, args, est) -> str:
    """Why a size is refused on the simulator, and what to do instead."""
    from ep_runtime.tools.sim_cost import format_duration, timeout_hint

    default = simulator_estimate(EPConfig(n_ranks=4, n_experts=16, top_k=4, hidden=64, max_tokens_per_rank=24),
                                 "random")
    return (f"the simulator cannot finish this size within --timeout {args.timeout:g} s; estimate: "
            f"{est.describe()}. The simulator runs every GPU thread as a Python thread: keep it small (the defaults, 4 ranks, "
            f"24 tokens, hidden 64, take about {format_duration(default.seconds)}): lower --ranks, --tokens or "
            f"--hidden{timeout_hint(est.seconds)}; for sizes like these use GPUs: "
            f"mpirun -np {cfg.n_ranks} python -m ep_runtime demo --backend nvshmem ...")


def demo(args) -> int:
    from ep_runtime.tools.demo import demo_rank, print_summary, reference_summary
    from ep_runtime.core.errors import EPInputError, PEFailure
    from ep_runtime.shmem.launch import job_backend, job_ranks, run_job

    backend = args.backend if args.backend == "reference" else job_backend(args.backend)
    n_ranks = args.ranks if backend == "reference" else job_ranks(args.ranks)
    fields = dict(n_ranks=n_ranks, n_experts=args.experts, top_k=args.top_k, hidden=args.hidden,
                  max_tokens_per_rank=args.tokens, n_sms=args.n_sms)
    if backend == "sim":  # device-side waits bounded by the job's limit, not a GPU's (slow peers are normal here)
        fields["wait_timeout_s"] = args.timeout
    cfg = EPConfig(**fields)
    if backend == "reference":
        ok = print_summary(cfg, "reference (NumPy oracle, no kernels)", args.scenario,
                           reference_summary(cfg, args.scenario, args.seed), kind="reference")
        return 0 if ok else 1
    from ep_runtime.core.layout import BufferLayout

    run = dict(args=(cfg.as_dict(), args.scenario, args.seed), backend=backend,
               heap_bytes=BufferLayout(cfg).symmetric_bytes, timeout_s=args.timeout)
    if backend != "sim":
        rows = run_job(demo_rank, n_ranks, **run)
    else:
        est = simulator_estimate(cfg, args.scenario)
        if est.seconds > args.timeout:
            raise EPInputError(_too_slow(cfg, args, est))
        print(f"ep_runtime demo: running {n_ranks} simulated ranks (one process each), {est.describe()}",
              file=sys.stderr, flush=True)
        run["args"] += (time.time(),)  # rank 0 prints each phase's end
        start = time.monotonic()
        try:
            with Heartbeat("ep_runtime demo", PROGRESS_EVERY_S, est.seconds):
                rows = run_job(demo_rank, n_ranks, **run)
        except PEFailure as e:
            if time.monotonic() - start < args.timeout:
                raise
            raise PEFailure(f"{e}\nThe simulated ranks ran past --timeout {args.timeout:g} s (estimate: "
                            f"{est.describe()}); other processes may be using the cores: raise --timeout, or "
                            f"lower the size.") from None
    if rows is None:  # a rank other than 0 under mpirun: rank 0 reports
        return 0
    name = "sim (Numba CUDA simulator, one process per rank)" if backend == "sim" else backend
    return 0 if print_summary(cfg, name, args.scenario, rows, simulated=backend == "sim") else 1


def main(argv=None) -> int:
    from ep_runtime.core.errors import EPError

    args = _parser().parse_args(argv)
    try:
        return deep_ep_command(args) if args.command == "deep-ep" else demo(args)
    except EPError as e:  # a clear message, not a traceback, for setup problems
        print(f"ep_runtime {args.command}: {type(e).__name__}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
