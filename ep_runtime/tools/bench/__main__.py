"""``mpirun -np N python -m ep_runtime.tools.bench [options]``: time dispatch and combine.

Per configuration: dispatch (async + wait), combine (async + wait) and each half alone, with a
barrier before every sample, CUDA events, warm-up, median and p10/p90; logical GB/s (every
received token row, the rank's own included: DeepEP's definition); NVLink GB/s (bytes that
crossed NVLink in the busier direction); the floor, the larger of NVLink bytes / NVLink ceiling
and device-memory bytes / HBM ceiling, with both ceilings measured in this run, and the measured
time as a fraction of it; baselines moving the same rows in the same run (NCCL
``all_to_all_single`` when torch is importable, alone and with the permutation its users need
to reach our layout, recorded as not run where ranks share a GPU, as under CUDA MPS: NCCL needs
a GPU per rank; nvshmem4py's host ``alltoall``; DeepEP V1's intranode normal kernels on the
same tokens and routing when ``deep_ep`` is importable, bf16 only, at 32 and 20 SMs:
``get_dispatch_layout`` + ``dispatch``, and ``combine``). A baseline that fails is recorded with its
error and never stops the benchmark. Lists of values sweep their cartesian
product. Outside mpirun (or with ``--backend sim``) it runs on the simulator, as a smoke test:
no ceilings or baselines, host-clock times.

Modes (``--mode``, one or both; default eager): **eager** times the four calls as a caller
makes them. **graph** (GPUs only) captures CUDA graphs on the session stream, one per phase
(dispatch = dispatch_async + dispatch_wait; combine = combine_async + combine_wait, captured
right after, the runtime's legal call order), and times each replay with CUDA events recorded
outside the graphs; each phase starts on the device (a host barrier, a short spin kernel, then
an on-stream barrier of all ranks, so host launch skew between ranks is not timed); the async
and wait columns come from graphs of one call each, captured and replayed the same way. Graphs are captured with all T rows; when
the runtime's dispatch_async takes ``n_tokens=`` (a device scalar), T is passed that way, as a
decode step serving a varying batch from one graph would. The simulator has no CUDA graphs:
``--mode graph`` there is refused before anything runs.

Layouts (``--layout``, one or both; default expanded): **expanded** times dispatch_wait's
expert-major batch (one row per (token, local expert): the expansion copy included) and
combine from expert-major outputs; **compact** times dispatch_wait without the expansion copy
(rows stay one per (token, source rank), with gather indices per expert) and combine from one
row per received token, the layout DeepEP and NCCL deliver. The floor's device-memory bytes
follow the layout (``ep_runtime.tools.bench.traffic``).

Quantized input (``--fp8-input``, sweepable; default bf16): in an FP8 or NVFP4 token format,
**bf16** passes bf16 tokens that dispatch_async quantizes; **prequantized** passes the same tokens'
codes and scales, quantized beforehand by the format's NumPy rule (``dispatch_async(codes, ...,
token_scales=)``, the input of DeepEP's normal kernels and MAX's input scales; NVFP4 also passes
the rule's global scale, ``token_global_scale=``): no encoding in the kernel and fewer sender reads
(the floor's device-memory bytes follow). The table marks it ``+pq``.

Combine partials (``--combine-dtype``, sweepable; default bfloat16): **float32** sends each rank's
partial unrounded (``EPConfig.combine_dtype="float32"``, hidden a multiple of 4): combine's NVLink
bytes and the partials' device-memory bytes double (``ep_runtime.tools.bench.traffic``); the compact
layout's combine input is then float32. The table marks it ``/f32`` after the token format.

Each layout is timed on a runtime that serves only it (``--serve each``, the default: its own
execution plan), or every layout on one runtime serving both (``--serve both``); ``--plan`` passes
plan overrides (``receiver=land,pdl=0``: ep_runtime.core.plan).

Sizes (``--tokens``, ``--hidden``, ``--top-k``, ``--experts``, ``--samples``, ``--warmup``) default to a
GPU layer on GPUs and to a tiny layer on the simulator (``SIZE_DEFAULTS``); on the simulator a sweep
estimated to take longer than ``--timeout`` (``ep_runtime.tools.sim_cost``) is refused before anything runs.
Progress goes to stderr, a line per configuration (rank 0), and on the simulator a line every 15 s.

Results print as a table (rank 0; ``mode``, ``layout`` and ``receiver`` columns; ``n/a`` where a
figure has no meaning in the run: GB/s, floors and baselines on the simulator, floors without
ceilings) and, with ``--json FILE``, as JSON with the configuration, mode, the runtime's plan
(``plan``: its fields and summary), git sha, devices and versions; ``--plot FILE.png`` draws time
against tokens (matplotlib): one line per layout and mode (and per any other setting the sweep
varies), each with its floor dashed where the run measured one.
"""

from __future__ import annotations

import argparse
import json
import sys

from ep_runtime.tools.cli import HelpFormatter, Heartbeat
from ep_runtime.core.config import EPConfig
from ep_runtime.core.formats import token_dtype_names
from ep_runtime.core.layout import BufferLayout
from ep_runtime.tools.bench.run import TOKEN_INPUTS, bench_rank, configs, layouts, metadata, plot, table, token_inputs

#: The sizes the options default to, per backend: a GPU layer (DeepSeek-V3's MoE shape) on GPUs;
#: on the simulator, where every simulated GPU thread is a Python thread, a layer it times in
#: seconds. ``experts`` on the simulator: per rank (the total must be a multiple of the ranks).
SIZE_DEFAULTS = {
    "gpu": {"tokens": [4096], "hidden": [7168], "top_k": [8], "experts": [256], "samples": 50, "warmup": 5},
    "sim": {"tokens": [8], "hidden": [64], "top_k": [2], "experts_per_rank": 4, "samples": 5, "warmup": 1},
}
#: Seconds between "still running" lines on the simulator.
PROGRESS_EVERY_S = 15.0


def _size_help(what: str, gpu, sim) -> str:
    return f"{what} (default: {gpu} on GPUs, {sim} on the simulator)"


def _parser() -> argparse.ArgumentParser:
    g, m = SIZE_DEFAULTS["gpu"], SIZE_DEFAULTS["sim"]
    p = argparse.ArgumentParser(prog="python -m ep_runtime.tools.bench", description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--backend", choices=("auto", "nvshmem", "sim"), default="auto",
                   help="auto: nvshmem under mpirun with GPUs, else the simulator (sim)")
    p.add_argument("--ranks", type=int, default=2, help="simulated ranks outside mpirun")
    p.add_argument("--tokens", type=int, nargs="+", help=_size_help("tokens per rank (sweepable)", *g["tokens"],
                                                                      *m["tokens"]))
    p.add_argument("--hidden", type=int, nargs="+", help=_size_help("values per token row (sweepable)",
                                                                      *g["hidden"], *m["hidden"]))
    p.add_argument("--top-k", type=int, nargs="+", help=_size_help("experts per token (sweepable)", *g["top_k"],
                                                                     *m["top_k"]))
    p.add_argument("--experts", type=int, nargs="+",
                   help=_size_help("experts in all (sweepable; a multiple of the ranks)", *g["experts"],
                                   f"{m['experts_per_rank']} per rank"))
    p.add_argument("--n-sms", type=int, nargs="+", default=[0], help="blocks per kernel; 0 = all SMs")
    p.add_argument("--mode", nargs="+", choices=("eager", "graph"), default=["eager"],
                   help="eager: the calls as made by a caller; graph: CUDA graph replay, one graph per phase "
                        "(GPUs only); both: --mode eager graph")
    p.add_argument("--token-dtype", nargs="+", choices=token_dtype_names(),
                   default=["bfloat16"], help="token format of dispatch (sweepable): bf16, FP8 E4M3 with float32 "
                                              "/ power-of-two scales per 128 elements, or NVFP4 (E2M1, an E4M3 "
                                              "scale per 16 elements, a float32 global scale), quantized inside "
                                              "dispatch; the bytes in GB/s and the floor are the format's message "
                                              "bytes")
    p.add_argument("--fp8-input", nargs="+", choices=TOKEN_INPUTS, default=["bf16"],
                   help="dispatch_async's input in quantized token formats (sweepable): bf16 tokens quantized "
                        "inside dispatch_async, or prequantized: codes and scales quantized beforehand by the caller "
                        "(token_scales=; NVFP4 also token_global_scale=); the sender's device-memory reads in the "
                        "floor follow the input; the table marks pre-quantized rows with +pq (bf16 formats take bf16 "
                        "tokens only)")
    p.add_argument("--combine-dtype", nargs="+", choices=("bfloat16", "float32"), default=["bfloat16"],
                   help="format of combine partials (sweepable): bf16, or float32 (unrounded, twice the partial "
                        "bytes; hidden a multiple of 4); the table marks float32 partials with /f32")
    p.add_argument("--layout", nargs="+", choices=("expanded", "compact"), default=["expanded"],
                   help="expanded: dispatch_wait lays rows out per (token, local expert) and combine takes "
                        "expert-major outputs; compact: no expansion copy, one row per (token, source rank) "
                        "both ways (DeepEP's and NCCL's layout); both: --layout expanded compact")
    p.add_argument("--serve", choices=("each", "both"), default="each",
                   help="each: a runtime per layout, serving only it (its own plan); both: one runtime serving "
                        "both layouts (default: each)")
    p.add_argument("--plan", default="", help="plan overrides for every runtime, e.g. 'receiver=land,pdl=0' "
                                              "(ep_runtime.core.plan; default: none)")
    p.add_argument("--samples", type=int,
                   help=_size_help("timed samples per configuration and mode (>= 50 on GPUs)", g["samples"],
                                   m["samples"]))
    p.add_argument("--warmup", type=int, help=_size_help("untimed round trips first", g["warmup"], m["warmup"]))
    p.add_argument("--seed", type=int, default=0, help="seed of the tokens and the routing")
    p.add_argument("--ceiling-mib", type=int, default=256, help="MiB copied to measure each ceiling (GPUs)")
    p.add_argument("--no-baselines", action="store_true", help="skip NCCL, nvshmem alltoall and DeepEP")
    p.add_argument("--logical-nodes", type=int, default=1,
                   help="split the ranks into this many nodes of consecutive ranks that reach each other by "
                        "NVSHMEM puts only (the hierarchical transport's testing topology; no baselines); the "
                        "table adds each rank's bytes between and within nodes")
    p.add_argument("--backward", action="store_true",
                   help="also time one MoE layer's backward (bf16 tokens): a dispatch, the router weights' "
                        "gradient home as slot values and a combine, against the 2 dispatches + 2 combines "
                        "of the backward before slot values")
    p.add_argument("--json", metavar="FILE", help="write results as JSON")
    p.add_argument("--plot", metavar="FILE", help="plot time against tokens (PNG; needs matplotlib)")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="simulator: seconds before the run fails; sweeps estimated to take longer are refused")
    return p


def apply_size_defaults(args, backend: str, n_ranks: int) -> None:
    """Fill the size options left unset with :data:`SIZE_DEFAULTS` of ``backend`` (``"sim"`` or
    a GPU backend), in place, so the results record the sizes that ran."""
    sizes = SIZE_DEFAULTS["sim" if backend == "sim" else "gpu"]
    for name in ("tokens", "hidden", "top_k", "samples", "warmup"):
        if getattr(args, name) is None:
            setattr(args, name, sizes[name])
    if args.experts is None:
        args.experts = sizes["experts"] if "experts" in sizes else [sizes["experts_per_rank"] * n_ranks]


def simulator_estimate(args, n_ranks: int):
    """The sweep's cost on the simulator (:mod:`ep_runtime.tools.sim_cost`): per configuration,
    ``warmup + samples`` round trips per layout and dispatch input, every rank sending T tokens."""
    from ep_runtime.tools.sim_cost import estimate, ranks_per_token

    jobs = []
    for f in configs(args):
        round_trips = (args.warmup + args.samples) * len(layouts(args)) * len(token_inputs(args, f["token_dtype"]))
        messages = n_ranks * f["max_tokens_per_rank"] * ranks_per_token(n_ranks, f["n_experts"], f["top_k"])
        jobs.append((round_trips, messages, f["hidden"]))
    return estimate(n_ranks, jobs)


def _too_slow(args, n_ranks: int, est) -> str:
    """Why a sweep is refused on the simulator, and what to do instead."""
    from ep_runtime.tools.sim_cost import timeout_hint

    sim = SIZE_DEFAULTS["sim"]
    return (f"the simulator cannot finish this sweep within --timeout {args.timeout:g} s; estimate: "
            f"{est.describe()}. The simulator runs every GPU thread as a Python thread: time tiny layers there (its defaults: "
            f"--tokens {sim['tokens'][0]} --hidden {sim['hidden'][0]} --top-k {sim['top_k'][0]} --experts "
            f"{sim['experts_per_rank'] * n_ranks} --samples {sim['samples']} --warmup {sim['warmup']})"
            f"{timeout_hint(est.seconds)}; GPU sizes need GPUs: mpirun -np 2 python -m ep_runtime.tools.bench ...")


def main(argv=None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    from ep_runtime.core.errors import EPError
    from ep_runtime.shmem.launch import job_backend, job_ranks, run_job

    if args.plot:  # before anything runs: a missing matplotlib would end the run after the timing
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            parser.error("--plot needs matplotlib: pip install -e \".[plot]\" (or drop --plot)")
    backend, n_ranks = job_backend(args.backend), job_ranks(args.ranks)
    apply_size_defaults(args, backend, n_ranks)
    if "graph" in args.mode and backend == "sim":
        why = "" if args.backend == "sim" else " (--backend auto chose it: not under mpirun, or no GPU visible)"
        parser.error(f"--mode graph needs CUDA graphs, and the simulator backend{why} has none (it runs each "
                     f"kernel on the host as it is called). Run graph mode on GPUs under mpirun, e.g. "
                     f"'mpirun -np 2 python -m ep_runtime.tools.bench --mode eager graph ...', or use --mode eager "
                     f"on the simulator.")
    try:  # every configuration is checked first (an EPConfigError names the field and the fix)
        heap = max(BufferLayout(EPConfig(n_ranks=n_ranks, **f)).symmetric_bytes for f in configs(args))
    except EPError as e:
        print(f"ep_runtime.tools.bench: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    est = simulator_estimate(args, n_ranks) if backend == "sim" else None
    if est is not None and est.seconds > args.timeout:
        parser.error(_too_slow(args, n_ranks, est))
    if backend != "sim":  # the NVLink ceiling's copy target, and nvshmem alltoall's two buffers
        heap += (args.ceiling_mib << 20) + 2 * n_ranks * max(args.tokens) * max(args.hidden) * 2
    run = dict(args=(vars(args),), backend=backend, heap_bytes=heap, timeout_s=args.timeout)
    try:
        if est is None:
            per_rank = run_job(bench_rank, n_ranks, **run)
        else:
            print(f"ep_runtime.tools.bench: simulator, {est.describe()}", file=sys.stderr, flush=True)
            with Heartbeat("ep_runtime.tools.bench", PROGRESS_EVERY_S, est.seconds):
                per_rank = run_job(bench_rank, n_ranks, **run)
    except EPError as e:
        print(f"ep_runtime.tools.bench: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    if per_rank is None:  # a rank other than 0 under mpirun: rank 0 reports
        return 0
    print(table(per_rank, simulated=backend == "sim"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": metadata(backend, n_ranks), "args": vars(args), "results": per_rank}, f, indent=1)
    if args.plot:
        plot(per_rank, args.plot, simulated=backend == "sim")
        print(f"plot: {args.plot}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
