"""Fill the kernel cache ahead of time, one process per kernel:

    python -m ep_runtime.prebuild [--jobs N] [--hidden H] [--token-dtype D ...]
                                  [--combine-dtype D ...] [--cc 9.0a] [--only NAME ...]

A runtime compiles its kernels when it is built (``EPRuntime.__init__``), one after another, in
every rank: about 100 s for the bf16 kernels on the lent H200 machines, more with the FP8
formats. This tool compiles the same kernels, with the same signatures
(:func:`ep_runtime.runtime.kernel_builds`), in ``--jobs`` processes at once and stores them in
the kernel cache (``$EP_RUNTIME_KERNEL_CACHE``, :mod:`ep_runtime.shmem.kernel_cache`), so the
next start of every configuration it covers loads them (a hit: a fraction of a second each).
Kernels already cached are reported as hits and not compiled again.

By default it builds for the GPU of this machine (device 0; the cache keys carry its compute
capability). ``--cc 9.0a`` builds for an sm_90a device without asking a driver (the compile
gate's way, :mod:`ep_runtime.compile_gate`): a CPU-only machine, e.g. a container image's build
step, then prepares the cache for H100/H200 hosts that have the same software (the keys also
carry the versions of numba-cuda, NVSHMEM, NVRTC, nvJitLink and NVVM, and the kernel source).

``EP_RUNTIME_TRACE=1`` in the environment builds the traced kernels (``kernels/trace.py``), which
the cache keys apart. The send path is compiled into the dispatch and combine kernels
(:class:`ep_runtime.transfer.SendPaths`): the tool builds the one ``EP_RUNTIME_PEER_STORES``,
``EP_RUNTIME_TOKEN_TRANSFER``, ``EP_RUNTIME_DISPATCH_LAND`` and ``EP_RUNTIME_DISPATCH_PLACE``
select (:func:`ep_runtime.runtime.expected_send_paths`; under ``auto``, the default, both paths
it takes: see :data:`CAPACITIES`; with ``EP_RUNTIME_DISPATCH_LAND=0`` the large capacity's is the
placing build), so run it with the job's settings. Prints
one line per kernel and a summary last; exit status 0 when every kernel is cached, 1 when one
failed to build, 2 when the tool cannot run here.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

from .config import COMBINE_DTYPES, TOKEN_DTYPES
from .dispatch_overlap import LAND_AUTO_MIN_TOKENS

#: Sizes of the configurations built (any valid ones: the kernels do not depend on them, only on
#: the send path, which ``EP_RUNTIME_DISPATCH_LAND=auto`` chooses by capacity: see
#: :data:`CAPACITIES`).
_CONFIG_SIZES = dict(n_ranks=2, n_experts=8, top_k=2)
#: Tokens per rank of the configurations built: one below and one at
#: :data:`ep_runtime.dispatch_overlap.LAND_AUTO_MIN_TOKENS`, so both send paths ``auto`` takes
#: are built (the same kernel twice is built once).
CAPACITIES = (16, LAND_AUTO_MIN_TOKENS)


def _config(hidden: int, token_dtype: str, combine_dtype: str, tokens: int):
    """A configuration whose kernels are those of every configuration with these formats, this
    hidden size's token word and the send path this environment takes at ``tokens`` per rank
    (the sizes do not enter the kernels' signatures)."""
    from .config import EPConfig

    return EPConfig(hidden=hidden, token_dtype=token_dtype, combine_dtype=combine_dtype,
                    max_tokens_per_rank=tokens, **_CONFIG_SIZES)


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


def _label(name: str, token_dtype: str, combine_dtype: str, path: str = "") -> str:
    """``path``: "landing" or "placing" for the dispatch kernels of those send paths, else ""."""
    return (f"{name} ({token_dtype}" + ("" if combine_dtype == "bfloat16" else f", {combine_dtype} partials")
            + (f", {path}" if path else "") + ")")


def plan(hidden: int, token_dtypes, combine_dtypes, only=None) -> list[tuple]:
    """``[(label, hidden, token_dtype, combine_dtype, tokens, name)]``: one per distinct (kernel,
    signature) of the configurations (each format at each of :data:`CAPACITIES`), in build
    order (a kernel shared by several formats or capacities once)."""
    from .runtime import GPU_THREADS, expected_send_paths, kernel_builds

    seen, out = set(), []
    for td in token_dtypes:
        for cd in combine_dtypes:
            for tokens in CAPACITIES:
                cfg = _config(hidden, td, cd, tokens)
                paths = expected_send_paths(cfg)
                path = ("landing" if paths.land else "placing" if paths.place else "route-first" if paths.route_first
                        else "")
                for name, kernel, types in kernel_builds(cfg, GPU_THREADS):
                    ident = (id(kernel), tuple(repr(t) for t in types))
                    if ident in seen or (only and name not in only):
                        continue
                    seen.add(ident)
                    out.append((_label(name, td, cd, path if name.startswith("dispatch") else ""), hidden, td, cd,
                                tokens, name))
    return out


def build_one(hidden: int, token_dtype: str, combine_dtype: str, tokens: int, name: str, cc=None) -> tuple:
    """Compile and store (or find in the cache) one kernel of :func:`plan`, without loading it
    (``KernelCache.prepare``); ``(outcome, seconds)``, outcome ``"hit"`` or ``"compiled"``.
    Runs in a worker process."""
    from .runtime import GPU_THREADS, kernel_builds
    from .shmem.kernel_cache import KernelCache, target_cc

    cache = KernelCache.from_env()
    (_, kernel, types), = [b for b in kernel_builds(_config(hidden, token_dtype, combine_dtype, tokens), GPU_THREADS)
                           if b[0] == name]
    start = time.perf_counter()
    with contextlib.redirect_stdout(sys.stderr):  # compiler chatter stays off the report
        if cc is None:
            outcome = cache.prepare(kernel, types, target_cc())
        else:
            from .compile_gate import _fixed_compute_capability

            with _fixed_compute_capability(cc):
                outcome = cache.prepare(kernel, types, cc)
    return outcome, time.perf_counter() - start


def _build_guarded(job, cc):
    label, *spec = job
    try:
        return label, *build_one(*spec, cc=cc), None
    except Exception as exc:  # noqa: BLE001 - reported per kernel, the others go on
        return label, "FAILED", 0.0, f"{type(exc).__name__}: {exc}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ep_runtime.prebuild", description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", "-j", type=int, default=min(16, os.cpu_count() or 1),
                    help="processes compiling at once (default: min(16, CPUs))")
    ap.add_argument("--hidden", type=int, default=7168, help="hidden size (picks the token word; default 7168)")
    ap.add_argument("--token-dtype", nargs="+", default=list(TOKEN_DTYPES), choices=TOKEN_DTYPES,
                    help="token formats to build (default: all)")
    ap.add_argument("--combine-dtype", nargs="+", default=list(COMBINE_DTYPES), choices=COMBINE_DTYPES,
                    help="combine partial formats to build (default: all)")
    ap.add_argument("--cc", help="build for this compute capability without a GPU (e.g. 9.0a)")
    ap.add_argument("--only", nargs="+", metavar="NAME", help="only these kernels (e.g. dispatch_wait)")
    args = ap.parse_args(argv)
    cc = _parse_cc(args.cc)
    from .compile_gate import _simulator_requested

    if _simulator_requested():
        print("prebuild: NUMBA_ENABLE_CUDASIM is set: the simulator compiles nothing, so there is nothing to "
              "cache. Unset it (and run on a GPU, or pass --cc).", file=sys.stderr)
        return 2
    if cc is not None and cc >= (9, 0):
        os.environ.setdefault("EP_RUNTIME_PDL", "1")  # what an sm_90 device builds (kernels/pdl.py); workers inherit it
    from .shmem.kernel_cache import KernelCache

    cache = KernelCache.from_env()
    if cache is None:
        print("prebuild: the kernel cache is off (EP_RUNTIME_KERNEL_CACHE); set it to a directory.", file=sys.stderr)
        return 2
    jobs = plan(args.hidden, args.token_dtype, args.combine_dtype, args.only)
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
        print(f"{label:<58} {outcome:<13} {seconds:7.1f} s" + (f"  {error}" if error else ""))
    counts = {o: sum(r[1] == o for r in results) for o in ("hit", "compiled", "FAILED")}
    print(f"prebuild: {len(results)} kernels in {wall:.1f} s with {min(args.jobs, len(jobs))} processes: "
          + ", ".join(f"{n} {o}" for o, n in counts.items()) + f"; cache {cache.directory}")
    return 1 if counts["FAILED"] else 0


if __name__ == "__main__":
    sys.exit(main())
