"""One benchmark run: per-rank timing of every configuration, and the report (table, JSON,
plot). The command line is :mod:`ep_runtime.bench.__main__`."""

from __future__ import annotations

import argparse
import itertools
import subprocess
import sys

import numpy as np

from ..config import EPConfig
from ..layout import partial_dtype
from ..testing import make_inputs
from .measure import (GRAPH_ROUND_TRIPS, ceilings, nccl_all_to_all, nvshmem_alltoall, takes_device_token_count,
                      time_graph_round_trips, time_round_trips)
from .stats import gbps, summarize
from .traffic import nccl_permutation, rank_traffic


def configs(args):
    """The EPConfig fields (less n_ranks) of every point of the sweep, in argument order."""
    for tokens, hidden, top_k, experts, n_sms, token_dtype, combine_dtype in itertools.product(
            args.tokens, args.hidden, args.top_k, args.experts, args.n_sms, getattr(args, "token_dtype", None) or
            ["bfloat16"], getattr(args, "combine_dtype", None) or ["bfloat16"]):
        yield dict(n_experts=experts, top_k=top_k, hidden=hidden, max_tokens_per_rank=tokens,
                   n_sms=n_sms or None, token_dtype=token_dtype, combine_dtype=combine_dtype)


#: dispatch_async's inputs the bench can time (``--fp8-input``): bf16 tokens (quantized inside
#: dispatch_async in an FP8 format), or FP8 codes and scales quantized beforehand by the caller
#: (``token_scales=``; MAX's input scales, DeepEP's FP8 ``x`` of its normal kernels).
TOKEN_INPUTS = ("bf16", "prequantized")


def token_inputs(args, token_dtype: str) -> list[str]:
    """The inputs timed for ``token_dtype`` (``--fp8-input``, in order, each once): FP8 formats
    take either; bf16 tokens are the only input of the bf16 format."""
    if token_dtype == "bfloat16":
        return ["bf16"]
    return list(dict.fromkeys(getattr(args, "fp8_input", None) or ["bf16"]))


def dispatch_inputs(session, cfg: EPConfig, tokens, ids, weights, token_input: str) -> tuple:
    """dispatch_async's device inputs for one rank, as :func:`~.measure.time_round_trips` takes
    them: (tokens, topk_ids, topk_weights, token_scales): bf16 ``tokens`` ([T, H] bf16 as
    uint16) with no scales, or (``"prequantized"``) their FP8 codes ([T, H] uint8) and scales
    ([T, H / 128]) by the format's NumPy quantizer (:meth:`~ep_runtime.formats.TokenFormat.quantize`,
    the rule dispatch_async applies to bf16 tokens)."""
    bits = np.ascontiguousarray(tokens).view(np.uint16)
    if token_input == "bf16":
        return tuple(session.to_device(a) for a in (bits, ids, weights)) + (None,)
    codes, scales = cfg.token_format.quantize(bits)
    return tuple(session.to_device(a) for a in (codes, ids, weights, scales))


def modes(args) -> list[str]:
    """The timing modes asked for (``--mode``), in order, each once; ``eager`` if none."""
    return list(dict.fromkeys(getattr(args, "mode", None) or ["eager"]))


def layouts(args) -> list[str]:
    """The dispatch/combine layouts asked for (``--layout``), in order, each once."""
    return list(dict.fromkeys(getattr(args, "layout", None) or ["expanded"]))


def served(args) -> list[tuple]:
    """The runtimes a configuration is timed on, as the layouts each serves (``--serve``):
    ``each`` (default), one runtime per layout asked for, serving only it, on its own plan; or
    ``both``, one runtime serving both layouts, every layout asked for timed on it."""
    asked = layouts(args)
    if getattr(args, "serve", "each") == "both":
        return [("expanded", "compact")]
    return [(layout,) for layout in asked]


def close_baselines(session) -> None:
    """Leave torch.distributed if a baseline joined it, so no rank's NCCL heartbeat outlives the
    TCP store of rank 0 (which printed a c10d 'recvValue failed' traceback at exit). Collective:
    the ranks meet on the session's barrier, not NCCL's, which a failed baseline may have left
    unusable (an optional baseline never stops the benchmark, nor its end)."""
    if "torch.distributed" in sys.modules:
        import torch.distributed as dist

        if dist.is_initialized():
            session.barrier()
            try:
                dist.destroy_process_group()
            except Exception as e:  # noqa: BLE001 - the results are complete; say why NCCL did not close
                print(f"ep_runtime.bench: rank {session.rank}: torch.distributed did not close cleanly: "
                      f"{type(e).__name__}: {e}", file=sys.stderr)


def bench_rank(session, args_dict) -> list[dict]:
    """One rank of the benchmark; returns this rank's result per configuration and mode
    (configurations in sweep order, each with its modes in ``--mode`` order)."""

    args = argparse.Namespace(**args_dict)
    gpu = session.backend != "sim"
    results, ceil = [], {"nvlink_gbps": float("nan"), "hbm_gbps": float("nan")}
    if gpu:
        ceil = ceilings(session, args.ceiling_mib << 20, reps=10)
    todo = list(configs(args))
    for i, fields in enumerate(todo):
        cfg = EPConfig(n_ranks=session.n_ranks, **fields)
        if session.rank == 0:
            print(f"\r[{'#' * (i + 1)}{'.' * (len(todo) - i - 1)}] {i + 1}/{len(todo)} {fields}", end="",
                  file=sys.stderr, flush=True)
        T = cfg.max_tokens_per_rank
        xs, ids, ws = make_inputs(cfg, "random", args.seed, n_tokens=[T] * cfg.n_ranks)
        r = session.rank
        given = token_inputs(args, cfg.token_dtype)
        trs = {g: rank_traffic(ids, r, cfg.n_local_experts, cfg.hidden, token_bytes=cfg.token_bytes,
                               partial_bytes=cfg.partial_bytes,
                               input_bytes=cfg.token_bytes if g == "prequantized" else None) for g in given}
        tr = trs[given[0]]  # the baselines' rows (the same for every input)
        runs = []
        # each input on the device once (the captured graphs keep reading it)
        inputs_of = {g: dispatch_inputs(session, cfg, xs[r], ids[r], ws[r], g) for g in given}
        outs = {"expanded": None, "compact": None}
        out = session.alloc_local("bench.out", (T, cfg.hidden), np.uint16)
        for serve in served(args):
            runs += _time_runtime(session, args, EPConfig(**{**cfg.as_dict(), "layouts": serve}), inputs_of, outs,
                                  out, given)
        base = {}
        if gpu and not args.no_baselines:
            base.update(_try(lambda: nccl_all_to_all(session, tr.sent, tr.recv, cfg.hidden,
                                                     nccl_permutation(ids, r, cfg.n_local_experts),
                                                     args.samples, args.warmup), "nccl"))
            base.update(_try(lambda: nvshmem_alltoall(session, tr.sent, cfg.hidden, args.samples, args.warmup),
                             "nvshmem_alltoall"))
        for mode, layout, token_input, spans, graph, plan in runs:
            results.append(_result(cfg, trs[token_input], spans, base, ceil, mode, graph, layout, plan, token_input))
    if session.rank == 0:
        print(file=sys.stderr)
    if gpu:
        close_baselines(session)
    return results


def _time_runtime(session, args, cfg: EPConfig, inputs_of: dict, outs: dict, out, given) -> list:
    """Time every input, layout served and mode on one runtime of ``cfg`` (its layouts those
    asked for that it serves): ``[(mode, layout, token_input, spans, graph, plan)]``, ``plan``
    the runtime's plan as a dict with its summary (the JSON's record of how rows moved)."""
    from ..runtime import EPRuntime

    runs, T = [], cfg.max_tokens_per_rank
    with EPRuntime(cfg, session, plan=getattr(args, "plan", None) or None) as rt:
        plan = {**rt.plan.as_dict(), "summary": rt.plan.summary()}
        if session.rank == 0:
            print(f"\n  {'+'.join(cfg.layouts)}: {rt.plan.summary()}", file=sys.stderr, flush=True)
        for token_input, layout in itertools.product(given, [lay for lay in layouts(args) if lay in cfg.layouts]):
            inputs = inputs_of[token_input]
            if outs[layout] is None:  # expert outputs: one row per batch row, or per (source rank, token slot)
                outs[layout] = (session.alloc_local("bench.expert_out", (cfg.recv_rows_capacity, cfg.hidden),
                                                    np.uint16) if layout == "expanded" else
                                session.alloc_local("bench.expert_rows", (cfg.n_ranks * T, cfg.hidden),
                                                    partial_dtype(cfg)))
            y = outs[layout]
            for mode in modes(args):
                if mode == "eager":
                    spans = time_round_trips(rt, session, inputs, y, out, args.samples, args.warmup, layout=layout)
                    runs.append((mode, layout, token_input, spans, None, plan))
                    continue
                # captured with all T rows; with n_tokens, T is also read on the device at replay
                dev_t = takes_device_token_count(rt)
                graph = {"captured_rows": T, "n_tokens": "device scalar" if dev_t else "none (static shape)"}
                n_tok = session.to_device(np.array([T], np.int32)) if dev_t else None
                before = rt.device_calls()
                spans = time_graph_round_trips(rt, session, inputs, y, out, args.samples, args.warmup,
                                               n_tokens=n_tok, layout=layout)
                # a replay that did not run would time as nothing: count the calls the device made
                graph["replayed_round_trips"] = len(GRAPH_ROUND_TRIPS) * (args.warmup + args.samples)
                graph["device_calls"] = rt.device_calls() - before
                runs.append((mode, layout, token_input, spans, graph, plan))
    return runs


def _try(fn, name) -> dict:
    """A baseline's samples, or its error (an optional baseline never stops the benchmark)."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - reported in the results
        return {name: f"error: {type(e).__name__}: {e}"}


def _result(cfg, tr, spans, base, ceil, mode="eager", graph=None, layout="expanded", plan=None,
            token_input="bf16") -> dict:
    times = {k: summarize(v) for k, v in spans.items()}
    d, c = times["dispatch"]["median"], times["combine"]["median"]
    floor_d = max(tr.dispatch_nvlink_bytes / (ceil["nvlink_gbps"] * 1e3),
                  tr.hbm_bytes("dispatch", layout) / (ceil["hbm_gbps"] * 1e3))
    floor_c = max(tr.combine_nvlink_bytes / (ceil["nvlink_gbps"] * 1e3),
                  tr.hbm_bytes("combine", layout) / (ceil["hbm_gbps"] * 1e3))
    res = {
        "mode": mode, "layout": layout, "token_input": token_input, "config": cfg.as_dict(), "plan": plan or {},
        "traffic": tr.__dict__,
        "ceilings": ceil, "times_us": times,
        "dispatch": {"logical_gbps": gbps(tr.logical_bytes, d), "nvlink_gbps": gbps(tr.dispatch_nvlink_bytes, d),
                     "floor_us": floor_d, "of_floor": floor_d / d if d else float("nan")},
        "combine": {"logical_gbps": gbps(tr.logical_bytes, c), "nvlink_gbps": gbps(tr.combine_nvlink_bytes, c),
                    "floor_us": floor_c, "of_floor": floor_c / c if c else float("nan")},
        "baselines_us": {k: (summarize(v) if isinstance(v, list) else v) for k, v in base.items()},
    }
    if graph is not None:  # how the graphs were captured: rows, and whether T came from a device scalar
        res["graph"] = graph
    return res


def _fmt_name(cfg: dict, token_input: str = "bf16") -> str:
    """Short format name for the table: the token format, bf16, e4m3 (float32 scales) or ue8m0,
    with ``+pq`` appended for pre-quantized FP8 input and ``/f32`` for float32 combine partials."""
    name = {"bfloat16": "bf16", "fp8_e4m3": "e4m3", "fp8_e4m3_ue8m0": "ue8m0"}.get(cfg.get("token_dtype"), "bf16")
    return name + ("+pq" if token_input == "prequantized" else "") + (
        "/f32" if cfg.get("combine_dtype") == "float32" else "")


def _receiver_name(res: dict) -> str:
    """The plan's receiver, short, for the table (``-`` when the record has none)."""
    names = {"wait": "wait", "land": "land", "route_first": "rfirst", "route_first_chunked": "rfirst/c"}
    return names.get(res.get("plan", {}).get("receiver"), "-")


def table(per_rank: list[list[dict]]) -> str:
    """One line per (configuration, mode, rank). In graph mode ``dispatch`` and ``combine`` are
    one graph replay each; ``async`` and ``wait`` are replays of graphs of one call each."""
    head = (f"{'rank':>4} {'T':>5} {'H':>5} {'K':>2} {'E':>4} {'sms':>4} {'tokens':>8} {'mode':>5} {'layout':>8} "
            f"{'receiver':>8} | "
            f"{'dispatch us (p10-p90)':>24} "
            f"{'async':>7} {'wait':>7} {'GB/s log':>8} {'NVL':>6} {'floor':>7} {'%floor':>6} | "
            f"{'combine us':>10} {'GB/s log':>8} {'floor':>7} {'%floor':>6} | baselines (median us)")
    lines = [head]
    for r, results in enumerate(per_rank):
        for res in results:
            cfg, t = res["config"], res["times_us"]
            d, c = res["dispatch"], res["combine"]
            bl = ", ".join(f"{k} {v['median']:.1f}" if isinstance(v, dict) else f"{k} {v}"
                           for k, v in res["baselines_us"].items()) or "-"
            lines.append(
                f"{r:>4} {cfg['max_tokens_per_rank']:>5} {cfg['hidden']:>5} {cfg['top_k']:>2} {cfg['n_experts']:>4} "
                f"{cfg['n_sms'] or 'all':>4} {_fmt_name(cfg, res.get('token_input', 'bf16')):>8} "
                f"{res.get('mode', 'eager'):>5} "
                f"{res.get('layout', 'expanded'):>8} {_receiver_name(res):>8} | "
                f"{t['dispatch']['median']:>9.1f} ({t['dispatch']['p10']:.1f}-"
                f"{t['dispatch']['p90']:.1f}) {t['dispatch_async']['median']:>7.1f} {t['dispatch_wait']['median']:>7.1f} "
                f"{d['logical_gbps']:>8.1f} {d['nvlink_gbps']:>6.1f} {d['floor_us']:>7.1f} {100 * d['of_floor']:>5.1f}% | "
                f"{t['combine']['median']:>10.1f} {c['logical_gbps']:>8.1f} {c['floor_us']:>7.1f} "
                f"{100 * c['of_floor']:>5.1f}% | {bl}")
    if any(res.get("token_input") == "prequantized" for results in per_rank for res in results):
        lines.append("+pq: pre-quantized input (FP8 codes and scales from the caller, token_scales=); FP8 rows "
                     "without it quantize bf16 tokens inside dispatch_async")
    graphs = [(r, res) for r, results in enumerate(per_rank) for res in results if "graph" in res]
    if graphs:
        how = ", ".join(sorted({res["graph"]["n_tokens"] for _, res in graphs}))
        lines.append(f"graph mode: CUDA graphs replayed (dispatch, combine: one graph each; async, wait: one graph "
                     f"per call), captured with T rows; valid-token count: {how}")
    for r, res in graphs:
        g = res["graph"]
        if g.get("device_calls") != g.get("replayed_round_trips"):
            lines.append(f"WARNING rank {r} T={res['config']['max_tokens_per_rank']}: the device counted "
                         f"{g.get('device_calls')} calls for {g.get('replayed_round_trips')} replayed round trips: "
                         f"graph times are not valid")
    ceil = per_rank[0][0]["ceilings"] if per_rank and per_rank[0] else {}
    lines.append(f"ceilings measured in this run: NVLink {ceil.get('nvlink_gbps', float('nan')):.1f} GB/s per "
                 f"direction, HBM {ceil.get('hbm_gbps', float('nan')):.1f} GB/s read+write")
    return "\n".join(lines)


def metadata(backend: str, n_ranks: int) -> dict:
    """Git sha, devices and versions for the JSON results."""
    import platform

    from .. import __version__

    meta = {"ep_runtime": __version__, "backend": backend, "ranks": n_ranks, "python": platform.python_version(),
            "numpy": np.__version__}
    try:
        meta["git_sha"] = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                         check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        meta["git_sha"] = "unknown"
    for mod in ("numba_cuda", "cupy", "nvshmem", "torch"):
        try:
            meta[mod] = getattr(__import__(mod), "__version__", "?")
        except ImportError:
            pass
    if backend != "sim":
        import cupy

        meta["device"] = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    return meta


def plot(per_rank: list[list[dict]], path: str) -> None:
    """Median dispatch/combine time (per mode) and floor against tokens per rank (rank 0)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = sorted(per_rank[0], key=lambda r: r["config"]["max_tokens_per_rank"])
    modes_ = list(dict.fromkeys(r.get("mode", "eager") for r in res))
    fig, ax = plt.subplots(figsize=(7, 4))
    for name in ("dispatch", "combine"):
        for mode in modes_:
            mres = [r for r in res if r.get("mode", "eager") == mode]
            T = [r["config"]["max_tokens_per_rank"] for r in mres]
            label = name if len(modes_) == 1 else f"{name} ({mode})"
            ax.plot(T, [r["times_us"][name]["median"] for r in mres], marker="o", label=label)
        mres = [r for r in res if r.get("mode", "eager") == modes_[0]]
        ax.plot([r["config"]["max_tokens_per_rank"] for r in mres], [r[name]["floor_us"] for r in mres],
                linestyle="--", label=f"{name} floor")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tokens per rank")
    ax.set_ylabel("us (median)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
