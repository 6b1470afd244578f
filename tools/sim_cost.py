"""Measure the simulator's costs behind ``ep_runtime.tools.sim_cost`` (the estimate that lets the demo
and the bench refuse sizes the simulator cannot finish).

    python tools/sim_cost.py            # about 3 minutes on 2 cores
    python tools/sim_cost.py --large    # adds a 64-rank demo (about 6 more minutes on 2 cores)

Runs a set of simulated jobs (demo round trips at 1 to 16 ranks, hidden 8 to 7168; bench sweeps
of 1 and 20 round trips), one at a time, and prints per job its CPU time (every rank process's,
from getrusage) and wall time next to the model's, then the model's CPU constants refitted by
least squares on these jobs. Run it on an otherwise idle machine: the wall times (and so
PARALLEL_EFFICIENCY and POLL_CORE_FRACTION) depend on what else runs.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ep_runtime import EPConfig  # noqa: E402
from ep_runtime.tools import sim_cost  # noqa: E402
from ep_runtime.core.layout import BufferLayout, token_word  # noqa: E402
from ep_runtime.testing import make_inputs  # noqa: E402

#: Demo jobs: (ranks, experts, top-k, hidden, max tokens per rank).
DEMO_JOBS = [(1, 2, 1, 8, 2), (2, 2, 1, 8, 2), (8, 8, 1, 8, 2), (2, 8, 2, 64, 64), (2, 8, 2, 63, 64),
             (2, 8, 2, 1024, 64), (2, 8, 2, 7168, 8), (2, 8, 8, 64, 64), (2, 8, 2, 64, 256), (16, 16, 4, 64, 24)]
LARGE_DEMO_JOBS = [(64, 64, 4, 64, 24)]
#: Bench jobs: (ranks, experts, top-k, hidden, tokens per rank, samples); no warm-up.
BENCH_JOBS = [(2, 2, 1, 8, 2, 1), (2, 2, 1, 8, 2, 20), (4, 4, 1, 8, 2, 20), (2, 8, 2, 64, 64, 5)]


def children_cpu_s() -> float:
    u = resource.getrusage(resource.RUSAGE_CHILDREN)
    return u.ru_utime + u.ru_stime


def messages(cfg: EPConfig, n_tokens=None) -> int:
    """(token, destination rank) pairs of one round trip of the job's actual routing."""
    _, ids, _ = make_inputs(cfg, "random", 0, n_tokens=n_tokens)
    L = cfg.n_local_experts
    return sum(len(np.unique(row // L)) for rank_ids in ids for row in rank_ids)


def run_demo(job) -> tuple:
    from ep_runtime.tools.demo import demo_rank
    from ep_runtime.shmem.launch import run_pes

    R, E, K, H, T = job
    cfg = EPConfig(n_ranks=R, n_experts=E, top_k=K, hidden=H, max_tokens_per_rank=T, wait_timeout_s=0)
    c0, t0 = children_cpu_s(), time.perf_counter()
    run_pes(demo_rank, R, args=(cfg.as_dict(), "random", 0), timeout_s=3600,
            heap_bytes=BufferLayout(cfg).symmetric_bytes)
    return R, 1, messages(cfg), H, children_cpu_s() - c0, time.perf_counter() - t0


def run_bench(job) -> tuple:
    from ep_runtime.tools.bench.__main__ import _parser
    from ep_runtime.tools.bench.run import bench_rank
    from ep_runtime.shmem.launch import run_pes

    R, E, K, H, T, samples = job
    args = _parser().parse_args(["--backend", "sim", "--ranks", str(R), "--experts", str(E), "--top-k", str(K),
                                 "--hidden", str(H), "--tokens", str(T), "--samples", str(samples), "--warmup", "0"])
    cfg = EPConfig(n_ranks=R, n_experts=E, top_k=K, hidden=H, max_tokens_per_rank=T)
    c0, t0 = children_cpu_s(), time.perf_counter()
    run_pes(bench_rank, R, args=(vars(args),), timeout_s=3600, heap_bytes=BufferLayout(cfg).symmetric_bytes)
    return R, samples, messages(cfg, [T] * R), H, children_cpu_s() - c0, time.perf_counter() - t0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--large", action="store_true", help="add a 64-rank demo job")
    args = p.parse_args(argv)
    rows = []
    print(f"{'job':>34} | {'CPU s':>7} {'model':>7} | {'wall s':>7} {'model':>7}", flush=True)
    jobs = ([("demo", j) for j in DEMO_JOBS + (LARGE_DEMO_JOBS if args.large else [])]
            + [("bench", j) for j in BENCH_JOBS])
    for kind, job in jobs:
        R, n_rt, msgs, H, cpu, wall = run_demo(job) if kind == "demo" else run_bench(job)
        est = sim_cost.estimate(R, [(n_rt, msgs, H)])
        rows.append((R, n_rt, msgs, H, cpu))
        print(f"{kind + ' ' + ','.join(map(str, job)):>34} | {cpu:>7.1f} {est.cpu_s:>7.1f} | {wall:>7.1f} "
              f"{est.seconds:>7.1f}", flush=True)
    # cpu = R START + n (R CALL + msgs (MESSAGE + W WORD)), W: words per row
    X = np.array([[R, n * R, n * m, n * m * (H * 2 // token_word(H).itemsize)] for R, n, m, H, _ in rows], float)
    fit, *_ = np.linalg.lstsq(X, np.array([r[-1] for r in rows]), rcond=None)
    for name, value, now in zip(("RANK_START_CPU_S", "CALL_CPU_S", "MESSAGE_CPU_S", "WORD_CPU_S"), fit,
                                (sim_cost.RANK_START_CPU_S, sim_cost.CALL_CPU_S, sim_cost.MESSAGE_CPU_S,
                                 sim_cost.WORD_CPU_S)):
        print(f"{name} = {value:.3g}  (now {now:.3g})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
