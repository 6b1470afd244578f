"""Fill the kernel cache ahead of time, one process per kernel:

    python -m ep_runtime.tools.prebuild [--jobs N] [--hidden H] [--token-dtype D ...]
                                  [--combine-dtype D ...] [--tokens T ...] [--layouts L ...]
                                  [--cc 9.0a] [--only NAME ...]

A runtime compiles the kernels of its execution plan when it is built (``EPRuntime.__init__``),
one after another, in every rank. This tool compiles the kernels of the plans such jobs get
(:func:`ep_runtime.core.plan.choose_plan` on GPUs of one NVLink domain, for each format, tokens per
rank and layouts served, with ``EP_RUNTIME_PLAN``'s overrides if set), with the signatures the
runtime launches (:func:`ep_runtime.core.builds.kernel_builds`), in ``--jobs`` processes at once,
and stores them in the kernel cache (``$EP_RUNTIME_KERNEL_CACHE``,
:mod:`ep_runtime.shmem.kernel_cache`), so the next start of every configuration it covers loads
them. Kernels already cached are reported as hits and not compiled again.

By default it builds for the GPU of this machine (device 0; the cache keys carry its compute
capability). ``--cc 9.0a`` builds for an sm_90a device without asking a driver (the compile
gate's way, :mod:`ep_runtime.tools.compile_gate`): a CPU-only machine, e.g. a container image's build
step, then prepares the cache for H100/H200 hosts that have the same software (the keys also
carry the versions of numba-cuda, NVSHMEM, NVRTC, nvJitLink and NVVM, and the kernel source).

``EP_RUNTIME_TRACE=1`` in the environment builds the traced kernels (``ep_runtime/kernels/trace.py``), which
the cache keys apart. Prints one line per kernel (with the plans that use it) and a summary
last; exit status 0 when every kernel is cached, 1 when one failed to build, 2 when the tool
cannot run here (the simulator, the cache off, or kernels that build with numba-cuda-mlir, whose
builds the cache does not hold).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

from ep_runtime.core.config import COMBINE_DTYPES, TOKEN_DTYPES

#: Sizes of the configurations built (the kernels do not depend on them, only on the plan, which
#: the tokens per rank and the layouts served choose).
_CONFIG_SIZES = dict(n_ranks=2, n_experts=8, top_k=2)
#: Tokens per rank of the configurations built: one on each side of every threshold the plan's
#: rules have (ep_runtime.core.plan), so every plan a job chooses is built.
CAPACITIES = (16, 256, 512, 1024)
#: Layouts served by the configurations built.
LAYOUT_SETS = ("expanded", "compact", "both")


def _config(hidden: int, token_dtype: str, combine_dtype: str, tokens: int, layouts: str):
    """A configuration whose plan and kernels are those of every job with these formats, this
    hidden size's token word, ``tokens`` per rank and these layouts."""
    from ep_runtime.core.config import EPConfig

    return EPConfig(hidden=hidden, token_dtype=token_dtype, combine_dtype=combine_dtype,
                    max_tokens_per_rank=tokens, layouts=layouts, **_CONFIG_SIZES)


def _plan_of(cfg, overrides=()):
    from ep_runtime.core.plan import Topology, choose_plan, merged_overrides

    return choose_plan(cfg, Topology.nvlink_gpus(cfg.n_ranks), merged_overrides(dict(overrides)))


def _specs(hidden, token_dtypes, combine_dtypes, capacities, layout_sets, all_variants: bool) -> list:
    """``[(hidden, token_dtype, combine_dtype, tokens, layouts, overrides)]``: the jobs' default
    plans at each capacity and set of layouts, or (``all_variants``) a plan of every receiver on
    every transport it can run on (:data:`ep_runtime.core.builds.PLAN_VARIANTS`)."""
    from ep_runtime.core.builds import PLAN_VARIANTS

    out = []
    for td in token_dtypes:
        for cd in combine_dtypes:
            if all_variants:
                out += [(hidden, td, cd, capacities[-1], "both", (("receiver", r), ("transport", t)))
                        for r, t in PLAN_VARIANTS]
            else:
                out += [(hidden, td, cd, tokens, layouts, ()) for tokens in capacities for layouts in layout_sets]
    return out


def _parse_cc(text: str | None):
    """``"9.0a"`` -> ``(9, 0, "a")``; None -> None (ask the driver)."""
    if text is None:
        return None
    t = text.strip().lower().removeprefix("sm_")
    suffix = "a" if t.endswith("a") else ""
    t = t.rstrip("a")
    major, _, minor = t.partition(".") if "." in t else (t[:-1], "", t[-1:])
    try:
        return (int(major), int(minor), suffix)
    except ValueError:
        raise SystemExit(f"prebuild: --cc {text!r}: expected a compute capability such as 9.0a or 90a") from None


#: The kernels built with the plan's receiver layout (``DispatchVariant.layout``: their labels
#: name it, since plans of one receiver and transport may differ in it).
LAYOUT_KERNELS = ("dispatch_wait", "dispatch_land")


def plan(hidden: int, token_dtypes, combine_dtypes, capacities=CAPACITIES, layout_sets=LAYOUT_SETS,
         only=None, all_variants: bool = False) -> list[tuple]:
    """``[(label, spec, name)]``: one per distinct (kernel, signature) of the plans of the
    configurations (:func:`_specs`), in build order, labelled with the kernel, its format and
    the plans that launch it (receiver/transport); plans that differ in what a kernel does not
    read share its build."""
    from ep_runtime.core.builds import kernel_builds
    from ep_runtime.shmem.cache_key import kernel_key

    seen, out = {}, []
    for spec in _specs(hidden, token_dtypes, combine_dtypes, capacities, layout_sets, all_variants):
        cfg = _config(*spec[:5])
        p = _plan_of(cfg, spec[5])
        for name, kernel, types in kernel_builds(cfg, p, only or None):
            ident = kernel_key(kernel, types, (9, 0, "a"))  # a build's identity (any one target)
            tag = f"{p.receiver.value}/{p.transport.value}"
            if name in LAYOUT_KERNELS:  # built with the plan's receiver layout
                tag += f" {p.dispatch_variant(cfg).layout}"
            if ident in seen:
                seen[ident][3].add(tag)
                continue
            seen[ident] = entry = [name, spec[1], spec[2], {tag}, spec]
            out.append(entry)
    return [(f"{name} ({td}" + ("" if cd == "bfloat16" else f", {cd} partials") + f"; {' '.join(sorted(tags))})",
             spec, name) for name, td, cd, tags, spec in out]


def build_one(spec: tuple, name: str, cc=None) -> tuple:
    """Compile and store (or find in the cache) one kernel of :func:`plan` (``spec``: the
    configuration's (hidden, token_dtype, combine_dtype, tokens, layouts, overrides)), without loading it
    (``KernelCache.prepare``); ``(outcome, seconds)``, outcome ``"hit"`` or ``"compiled"``.
    Runs in a worker process."""
    from ep_runtime.core.builds import kernel_builds
    from ep_runtime.shmem.cache_key import target_cc
    from ep_runtime.shmem.kernel_cache import KernelCache

    cache = KernelCache.from_env()
    cfg = _config(*spec[:5])
    (_, kernel, types), = kernel_builds(cfg, _plan_of(cfg, spec[5]), (name,))
    start = time.perf_counter()
    with contextlib.redirect_stdout(sys.stderr):  # compiler chatter stays off the report
        if cc is None:
            outcome = cache.prepare(kernel, types, target_cc())
        else:
            from ep_runtime.tools.compile_gate import _fixed_compute_capability

            with _fixed_compute_capability(cc):
                outcome = cache.prepare(kernel, types, cc)
    return outcome, time.perf_counter() - start


def _build_guarded(job, cc):
    label, spec, name = job
    try:
        return label, *build_one(spec, name, cc=cc), None
    except Exception as exc:  # noqa: BLE001 - reported per kernel, the others go on
        return label, "FAILED", 0.0, f"{type(exc).__name__}: {exc}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ep_runtime.tools.prebuild", description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", "-j", type=int, default=min(16, os.cpu_count() or 1),
                    help="processes compiling at once (default: min(16, CPUs))")
    ap.add_argument("--hidden", type=int, default=7168, help="hidden size (picks the token word; default 7168)")
    ap.add_argument("--token-dtype", nargs="+", default=list(TOKEN_DTYPES), choices=TOKEN_DTYPES,
                    help="token formats to build (default: all)")
    ap.add_argument("--combine-dtype", nargs="+", default=list(COMBINE_DTYPES), choices=COMBINE_DTYPES,
                    help="combine partial formats to build (default: all)")
    ap.add_argument("--tokens", nargs="+", type=int, default=list(CAPACITIES),
                    help=f"tokens per rank of the jobs (default: {' '.join(map(str, CAPACITIES))}, one on each side "
                         f"of every plan rule's threshold)")
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUT_SETS), choices=LAYOUT_SETS,
                    help="layouts the jobs serve (default: each)")
    ap.add_argument("--all-variants", action="store_true",
                    help="build a plan of every receiver on every transport (what the GPU checks of every plan "
                         "variant run) instead of the jobs' default plans")
    ap.add_argument("--cc", help="build for this compute capability without a GPU (e.g. 9.0a)")
    ap.add_argument("--only", nargs="+", metavar="NAME", help="only these kernels (e.g. dispatch_wait)")
    args = ap.parse_args(argv)
    cc = _parse_cc(args.cc)
    from ep_runtime.tools.compile_gate import _simulator_requested

    if _simulator_requested():
        print("prebuild: NUMBA_ENABLE_CUDASIM is set: the simulator compiles nothing, so there is nothing to "
              "cache. Unset it (and run on a GPU, or pass --cc).", file=sys.stderr)
        return 2
    from ep_runtime.kernels import compiler

    if compiler.chosen() == compiler.NUMBA_CUDA_MLIR:
        print("prebuild: the kernels build with numba-cuda-mlir here, whose builds the kernel cache does not hold "
              "(a process compiles them: docs/compilers.md): nothing to prebuild. The cache is numba-cuda's: "
              f"{compiler.COMPILERS[compiler.NUMBA_CUDA][1]}", file=sys.stderr)
        return 2
    from ep_runtime.shmem.kernel_cache import KernelCache

    cache = KernelCache.from_env()
    if cache is None:
        print("prebuild: the kernel cache is off (EP_RUNTIME_KERNEL_CACHE); set it to a directory.", file=sys.stderr)
        return 2
    jobs = plan(args.hidden, args.token_dtype, args.combine_dtype, args.tokens, args.layouts, args.only,
                args.all_variants)
    if not jobs:
        print(f"prebuild: no kernel matches --only {args.only}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    if args.jobs > 1 and len(jobs) > 1:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        ctx = multiprocessing.get_context("spawn")  # fresh interpreters: no forked CUDA or compiler state
        with ProcessPoolExecutor(max_workers=min(args.jobs, len(jobs)), mp_context=ctx) as pool:
            results = list(pool.map(_build_guarded, jobs, [cc] * len(jobs)))
    else:
        results = [_build_guarded(job, cc) for job in jobs]
    wall = time.perf_counter() - start
    for label, outcome, seconds, error in results:
        print(f"{label:<72} {outcome:<9} {seconds:6.1f} s" + (f"  {error}" if error else ""))
    counts = {o: sum(r[1] == o for r in results) for o in ("hit", "compiled", "FAILED")}
    print(f"prebuild: {len(results)} kernels in {wall:.1f} s with {min(args.jobs, len(jobs))} processes: "
          + ", ".join(f"{n} {o}" for o, n in counts.items()) + f"; cache {cache.directory}")
    return 1 if counts["FAILED"] else 0


if __name__ == "__main__":
    sys.exit(main())
