"""One benchmark run: per-rank timing of every configuration, and the report (table, JSON,
plot). The command line is :mod:`ep_runtime.tools.bench.__main__`."""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import math
import subprocess
import sys
import time

import numpy as np

from ep_runtime.core.config import EPConfig
from ep_runtime.core.layout import partial_dtype
from ep_runtime.testing import make_inputs
from ep_runtime.tools.bench.deep_ep_api import deep_ep_layer, deepep_v1
from ep_runtime.tools.bench.measure import (GRAPH_ROUND_TRIPS, ceilings, nccl_all_to_all, nvshmem_alltoall,
                                            takes_device_token_count, time_backward, time_graph_round_trips,
                                            time_round_trips)
from ep_runtime.tools.bench.stats import gbps, summarize
from ep_runtime.tools.bench.traffic import nccl_permutation, node_traffic, rank_traffic


def configs(args):
    """The EPConfig fields (less n_ranks) of every point of the sweep, in argument order."""
    for tokens, hidden, top_k, experts, n_sms, token_dtype, combine_dtype in itertools.product(
            args.tokens, args.hidden, args.top_k, args.experts, args.n_sms, getattr(args, "token_dtype", None) or
            ["bfloat16"], getattr(args, "combine_dtype", None) or ["bfloat16"]):
        yield dict(n_experts=experts, top_k=top_k, hidden=hidden, max_tokens_per_rank=tokens,
                   n_sms=n_sms or None, token_dtype=token_dtype, combine_dtype=combine_dtype)


#: dispatch_async's inputs the bench can time (``--fp8-input``): bf16 tokens (quantized inside
#: dispatch_async in a quantized format), or codes and scales quantized beforehand by the caller
#: (``token_scales=``; MAX's input scales, DeepEP's FP8 ``x`` of its normal kernels).
TOKEN_INPUTS = ("bf16", "prequantized")


def token_inputs(args, token_dtype: str) -> list[str]:
    """The inputs timed for ``token_dtype`` (``--fp8-input``, in order, each once): quantized
    formats take either; bf16 tokens are the only input of the bf16 format."""
    if token_dtype == "bfloat16":
        return ["bf16"]
    return list(dict.fromkeys(getattr(args, "fp8_input", None) or ["bf16"]))


def dispatch_inputs(session, cfg: EPConfig, tokens, ids, weights, token_input: str) -> tuple:
    """dispatch_async's device inputs for one rank, as :func:`~.measure.time_round_trips` takes
    them: ``(tokens, topk_ids, topk_weights, keywords)``: bf16 ``tokens`` ([T, H] bf16 as
    uint16) with no keywords, or (``"prequantized"``) their codes (FP8: [T, H] uint8; NVFP4:
    [T, H / 2] uint8) with ``token_scales`` by the format's NumPy quantizer
    (:meth:`~ep_runtime.core.formats.TokenFormat.quantize`, the rule dispatch_async applies to
    bf16 tokens) and, in a format with a global scale (NVFP4), the rule's ``token_global_scale``
    ([1] float32)."""
    bits = np.ascontiguousarray(tokens).view(np.uint16)
    dev_ids, dev_weights = session.to_device(ids), session.to_device(weights)
    if token_input == "bf16":
        return session.to_device(bits), dev_ids, dev_weights, {}
    fmt = cfg.token_format
    if fmt.has_global_scale:
        g = fmt.global_scale(bits)
        codes, scales = fmt.quantize(bits, g)
        kw = {"token_global_scale": session.to_device(np.array([g], np.float32))}
    else:
        codes, scales = fmt.quantize(bits)
        kw = {}
    return session.to_device(codes), dev_ids, dev_weights, {"token_scales": session.to_device(scales), **kw}


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
                print(f"ep_runtime.tools.bench: rank {session.rank}: torch.distributed did not close cleanly: "
                      f"{type(e).__name__}: {e}", file=sys.stderr)


def describe_fields(fields: dict, inputs=("bf16",)) -> str:
    """A configuration of the sweep in a few words, as the progress lines show it."""
    fmt = ", ".join(_fmt_name(fields, g) for g in inputs)
    return (f"T={fields['max_tokens_per_rank']} H={fields['hidden']} K={fields['top_k']} E={fields['n_experts']} "
            f"sms={fields['n_sms'] or 'all'} {fmt}")


def bench_rank(session, args_dict) -> list[dict]:
    """One rank of the benchmark; returns this rank's result per configuration and mode
    (configurations in sweep order, each with its modes in ``--mode`` order)."""

    args = argparse.Namespace(**args_dict)
    gpu = session.backend != "sim"
    nodes = getattr(args, "logical_nodes", 1) or 1
    if nodes > 1:  # before anything reports the peer mappings
        session.use_logical_nodes(nodes)
    results, ceil = [], {"nvlink_gbps": float("nan"), "hbm_gbps": float("nan")}
    if gpu:
        ceil = ceilings(session, args.ceiling_mib << 20, reps=10)
    todo = list(configs(args))
    start = time.monotonic()
    for i, fields in enumerate(todo):
        if not gpu:  # device-side waits bounded by the job's limit, not a GPU's (slow peers are normal here)
            fields = {**fields, "wait_timeout_s": args.timeout}
        cfg = EPConfig(n_ranks=session.n_ranks, **fields)
        if session.rank == 0:  # a line per configuration, on its own line
            what = describe_fields(fields, token_inputs(args, cfg.token_dtype))
            print(f"ep_runtime.tools.bench: [{i + 1}/{len(todo)}] {what} ({time.monotonic() - start:.0f} s)",
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
        if gpu and not args.no_baselines and nodes == 1:
            base.update(_try(lambda: nccl_all_to_all(session, tr.sent, tr.recv, cfg.hidden,
                                                     nccl_permutation(ids, r, cfg.n_local_experts),
                                                     args.samples, args.warmup), "nccl"))
            base.update(_try(lambda: nvshmem_alltoall(session, tr.sent, cfg.hidden, args.samples, args.warmup),
                             "nvshmem_alltoall"))
            if cfg.token_dtype in ("bfloat16", "fp8_e4m3"):  # DeepEP's API: ep_runtime's layer, and DeepEP V1
                fp8 = cfg.token_format.quantize(xs[r].view(np.uint16)) if cfg.token_format.quantized else None
                base.update(_try(lambda: deep_ep_layer(session, xs[r], ids[r], ws[r], cfg.n_experts, args.samples,
                                                       args.warmup, fp8=fp8), "layer"))
                if importlib.util.find_spec("deep_ep") is not None:
                    base.update(_try(lambda: deepep_v1(session, xs[r], ids[r], ws[r], cfg.n_experts, args.samples,
                                                       args.warmup, fp8=fp8), "deepep"))
        for mode, layout, token_input, spans, graph, plan in runs:
            results.append(_result(cfg, trs[token_input], spans, base, ceil, mode, graph, layout, plan, token_input))
            if plan.get("node_size"):  # the hierarchical transport: this rank's bytes by direction and place
                results[-1]["node_traffic"] = {"node_size": plan["node_size"], **node_traffic(
                    ids, r, cfg.n_local_experts, plan["node_size"], cfg.token_bytes, cfg.partial_bytes,
                    cfg.slot_bytes).__dict__}
    if gpu:
        close_baselines(session)
    return results


def _time_runtime(session, args, cfg: EPConfig, inputs_of: dict, outs: dict, out, given) -> list:
    """Time every input, layout served and mode on one runtime of ``cfg`` (its layouts those
    asked for that it serves): ``[(mode, layout, token_input, spans, graph, plan)]``, ``plan``
    the runtime's plan as a dict with its summary (the JSON's record of how rows moved)."""
    from ep_runtime.core.runtime import EPRuntime

    runs, T = [], cfg.max_tokens_per_rank
    with EPRuntime(cfg, session, plan=getattr(args, "plan", None) or None) as rt:
        plan = {**rt.plan.as_dict(), "summary": rt.plan.summary()}
        if session.rank == 0:
            print(f"ep_runtime.tools.bench:   serving {'+'.join(cfg.layouts)}: {rt.plan.summary()}", file=sys.stderr,
                  flush=True)
        for token_input, layout in itertools.product(given, [lay for lay in layouts(args) if lay in cfg.layouts]):
            inputs = inputs_of[token_input]
            if outs[layout] is None:  # expert outputs: one row per batch row, or per (source rank, token slot)
                outs[layout] = (session.alloc_local("bench.expert_out", (cfg.recv_rows_capacity, cfg.hidden),
                                                    np.uint16) if layout == "expanded" else
                                session.alloc_local("bench.expert_rows", (cfg.n_ranks * T, cfg.hidden),
                                                    partial_dtype(cfg)))
            y = outs[layout]
            backward = getattr(args, "backward", False) and token_input == "bf16" and not cfg.token_format.quantized
            for mode in modes(args):
                if mode == "eager":
                    spans = time_round_trips(rt, session, inputs, y, out, args.samples, args.warmup, layout=layout)
                    if backward:
                        spans.update(time_backward(rt, session, inputs, y, out, args.samples, args.warmup, False,
                                                   layout=layout))
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
                if backward:
                    spans.update(time_backward(rt, session, inputs, y, out, args.samples, args.warmup, True,
                                               n_tokens=n_tok, layout=layout))
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
    if "backward" in times:  # one layer's backward: NVLink bytes of this rank (the larger direction)
        D, C, S = tr.dispatch_nvlink_bytes, tr.combine_nvlink_bytes, tr.slot_nvlink_bytes
        res["backward_nvlink_bytes"] = {"backward": tr.kept_dispatch_nvlink_bytes + S + C,
                                        "backward_routing": D + S + C, "backward_2d2c": 2 * D + 2 * C}
    return res


def _fmt_name(cfg: dict, token_input: str = "bf16") -> str:
    """Short format name for the table: the token format, bf16, e4m3 (float32 scales) or ue8m0,
    with ``+pq`` appended for pre-quantized FP8 input and ``/f32`` for float32 combine partials."""
    name = {"bfloat16": "bf16", "fp8_e4m3": "e4m3", "fp8_e4m3_ue8m0": "ue8m0", "nvfp4": "nvfp4"}.get(
        cfg.get("token_dtype"), "bf16")
    return name + ("+pq" if token_input == "prequantized" else "") + (
        "/f32" if cfg.get("combine_dtype") == "float32" else "")


def _receiver_name(res: dict) -> str:
    """The plan's receiver, short, for the table (``-`` when the record has none)."""
    names = {"wait": "wait", "land": "land", "route_first": "rfirst", "route_first_chunked": "rfirst/c"}
    return names.get(res.get("plan", {}).get("receiver"), "-")


#: Printed for a figure that has no meaning in the run: GB/s, floors and %floor where no ceiling
#: was measured, every GB/s on the simulator (host-clock times of simulated kernels), baselines
#: that did not run there.
NOT_APPLICABLE = "n/a"

#: The table's note on the simulator's figures.
SIMULATOR_NOTE = ("simulator: times are host-clock times of the simulated kernels (every GPU thread a Python "
                  "thread, blocks one at a time): they show the workflow, not performance")


def _fig(value, spec: str, width: int, meaningful: bool = True, suffix: str = "") -> str:
    """``value`` formatted right-aligned in ``width`` (plus the suffix), or n/a where it has no
    meaning in this run (not ``meaningful``, or not a finite number)."""
    if not meaningful or not isinstance(value, (int, float)) or not math.isfinite(value):
        return f"{NOT_APPLICABLE:>{width + len(suffix)}}"
    return f"{format(value, spec) + suffix:>{width + len(suffix)}}"


def table(per_rank: list[list[dict]], simulated: bool = False) -> str:
    """One line per (configuration, mode, rank). In graph mode ``dispatch`` and ``combine`` are
    one graph replay each; ``async`` and ``wait`` are replays of graphs of one call each.
    ``simulated``: the results come from the simulator, where GB/s, floors and baselines are
    n/a (its times are host-clock times of simulated kernels, and it has no NVLink or HBM)."""
    head = (f"{'rank':>4} {'T':>5} {'H':>5} {'K':>2} {'E':>4} {'sms':>4} {'tokens':>8} {'mode':>5} {'layout':>8} "
            f"{'receiver':>8} | "
            f"{'dispatch us (p10-p90)':>24} "
            f"{'async':>7} {'wait':>7} {'GB/s log':>8} {'NVL':>6} {'floor':>7} {'%floor':>6} | "
            f"{'combine us':>10} {'GB/s log':>8} {'floor':>7} {'%floor':>6} | baselines (median us)")
    lines = [head]
    gpu = not simulated
    for r, results in enumerate(per_rank):
        for res in results:
            cfg, t = res["config"], res["times_us"]
            d, c = res["dispatch"], res["combine"]
            bl = ", ".join(f"{k} {v['median']:.1f}" if isinstance(v, dict) else f"{k} {v}"
                           for k, v in res["baselines_us"].items()) or ("-" if gpu else NOT_APPLICABLE)
            lines.append(
                f"{r:>4} {cfg['max_tokens_per_rank']:>5} {cfg['hidden']:>5} {cfg['top_k']:>2} {cfg['n_experts']:>4} "
                f"{cfg['n_sms'] or 'all':>4} {_fmt_name(cfg, res.get('token_input', 'bf16')):>8} "
                f"{res.get('mode', 'eager'):>5} "
                f"{res.get('layout', 'expanded'):>8} {_receiver_name(res):>8} | "
                f"{t['dispatch']['median']:>9.1f} ({t['dispatch']['p10']:.1f}-"
                f"{t['dispatch']['p90']:.1f}) {t['dispatch_async']['median']:>7.1f} {t['dispatch_wait']['median']:>7.1f} "
                f"{_fig(d['logical_gbps'], '.1f', 8, gpu)} {_fig(d['nvlink_gbps'], '.1f', 6, gpu)} "
                f"{_fig(d['floor_us'], '.1f', 7)} {_fig(100 * d['of_floor'], '.1f', 5, suffix='%')} | "
                f"{t['combine']['median']:>10.1f} {_fig(c['logical_gbps'], '.1f', 8, gpu)} "
                f"{_fig(c['floor_us'], '.1f', 7)} {_fig(100 * c['of_floor'], '.1f', 5, suffix='%')} | {bl}")
    backward = [(r, res) for r, results in enumerate(per_rank) for res in results if "backward" in res["times_us"]]
    if backward:
        lines.append("backward of one layer (median us, p10-p90; MB over NVLink, this rank's larger direction): "
                     "dispatch with the kept routing + slot values + combine | the same, the routing sent again "
                     "| 2 dispatches + 2 combines (before slot values)")
    for r, res in backward:
        t, b = res["times_us"], res["backward_nvlink_bytes"]
        cells = " | ".join(f"{t[k]['median']:>8.1f} ({t[k]['p10']:.1f}-{t[k]['p90']:.1f}) {b[k] / 1e6:>8.3f} MB"
                           for k in ("backward", "backward_routing", "backward_2d2c"))
        lines.append(f"{r:>4} {res['config']['max_tokens_per_rank']:>5} {res.get('mode', 'eager'):>5} "
                     f"{res.get('layout', 'expanded'):>8} | {cells}")
    nodes = [(r, res) for r, results in enumerate(per_rank) for res in results if "node_traffic" in res]
    if nodes:
        lines.append("hierarchical transport, one call (dispatch + combine) of each rank, MB by direction: across "
                     "nodes (to and from its proxies) | within its node; NVSHMEM operations it issues across")
    for r, res in nodes:
        n = res["node_traffic"]
        lines.append(f"{r:>4} {res['config']['max_tokens_per_rank']:>5} {res.get('mode', 'eager'):>5} "
                     f"{res.get('layout', 'expanded'):>8} | across {n['across_out'] / 1e6:>8.3f} out "
                     f"{n['across_in'] / 1e6:>8.3f} in | within {n['within_out'] / 1e6:>8.3f} out "
                     f"{n['within_in'] / 1e6:>8.3f} in | {n['ops_across']} ops (a chunk of rows or sums: 1 op)")
    if any(res.get("token_input") == "prequantized" for results in per_rank for res in results):
        lines.append("+pq: pre-quantized input (codes and scales from the caller, token_scales=); FP8 and NVFP4 "
                     "rows without it quantize bf16 tokens inside dispatch_async")
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
    if simulated:
        lines.append(f"ceilings measured in this run: {NOT_APPLICABLE} on the simulator (no NVLink or HBM: GB/s, "
                     f"floor and %floor are GPU figures, and the baselines run on GPUs only)")
        lines.append(SIMULATOR_NOTE)
    else:
        ceil = per_rank[0][0]["ceilings"] if per_rank and per_rank[0] else {}
        lines.append(f"ceilings measured in this run: NVLink {_fig(ceil.get('nvlink_gbps'), '.1f', 0)} GB/s per "
                     f"direction, HBM {_fig(ceil.get('hbm_gbps'), '.1f', 0)} GB/s read+write")
    return "\n".join(lines)


def metadata(backend: str, n_ranks: int) -> dict:
    """Git sha, devices and versions for the JSON results."""
    import platform

    

    from ep_runtime import __version__

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


#: The settings besides T that tell the plot's lines apart: (legend name, its value in a
#: result). Mode and layout always name a line; the others only where the sweep varies them.
_SERIES_SETTINGS = (
    ("mode", lambda r: r.get("mode", "eager")),
    ("layout", lambda r: r.get("layout", "expanded")),
    ("tokens", lambda r: _fmt_name(r["config"], r.get("token_input", "bf16"))),
    ("H", lambda r: r["config"]["hidden"]),
    ("K", lambda r: r["config"]["top_k"]),
    ("E", lambda r: r["config"]["n_experts"]),
    ("sms", lambda r: r["config"]["n_sms"] or "all"),
)


def _setting_label(names_values) -> str:
    return " ".join(str(v) if n in ("mode", "layout", "tokens") else f"{n}={v}" for n, v in names_values)


def plot_series(results: list[dict]) -> list[dict]:
    """The plot's lines for one rank's results, per phase (``"dispatch"``, ``"combine"``): one
    line per combination of the settings besides T (:data:`_SERIES_SETTINGS`), its points in
    increasing T, so no line joins results of different layouts or modes. Each line is
    ``{"phase", "label", "floor_label", "T", "us", "floor_us"}``: ``floor_us`` is the floor of
    each point, or None where a point has no finite floor (no ceilings: the simulator), and
    ``floor_label`` names the line's floor (the same for every mode: the floor does not depend
    on it)."""
    varying = [i for i, (_, get) in enumerate(_SERIES_SETTINGS) if i < 2 or len({get(r) for r in results}) > 1]
    groups: dict[tuple, list[dict]] = {}
    for r in results:
        groups.setdefault(tuple(_SERIES_SETTINGS[i][1](r) for i in varying), []).append(r)
    lines = []
    for phase in ("dispatch", "combine"):
        for key, rs in groups.items():
            rs = sorted(rs, key=lambda r: r["config"]["max_tokens_per_rank"])
            named = [(_SERIES_SETTINGS[i][0], v) for i, v in zip(varying, key)]
            floors = [r[phase]["floor_us"] for r in rs]
            finite = all(isinstance(f, (int, float)) and math.isfinite(f) for f in floors)
            lines.append({"phase": phase, "label": _setting_label(named),
                          "floor_label": "floor " + _setting_label([nv for nv in named if nv[0] != "mode"]),
                          "T": [r["config"]["max_tokens_per_rank"] for r in rs],
                          "us": [r["times_us"][phase]["median"] for r in rs],
                          "floor_us": floors if finite else None})
    return lines


def plot(per_rank: list[list[dict]], path: str, simulated: bool = False):
    """Median dispatch (left) and combine (right) time against tokens per rank, rank 0's
    results: one line per layout, mode and any other setting the sweep varies
    (:func:`plot_series`), each floor dashed in its line's colour where the run measured one
    (GPUs), and the legend names only what is drawn. Saved as ``path`` (matplotlib, no display
    needed); returns the figure."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4))
    axes = fig.subplots(1, 2, sharey=True)
    colours: dict[str, str] = {}
    floors_drawn: set[tuple[str, str]] = set()
    for line in plot_series(per_rank[0]):
        ax = axes[0 if line["phase"] == "dispatch" else 1]
        colour = colours.setdefault(line["label"], f"C{len(colours)}")
        ax.plot(line["T"], line["us"], marker="o", color=colour, label=line["label"])
        if line["floor_us"] is not None and (line["phase"], line["floor_label"]) not in floors_drawn:
            floors_drawn.add((line["phase"], line["floor_label"]))
            ax.plot(line["T"], line["floor_us"], linestyle="--", color=colour, label=line["floor_label"])
    for ax, phase in zip(axes, ("dispatch", "combine")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(phase)
        ax.set_xlabel("tokens per rank")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_ylabel("us (median, rank 0)")
    fig.suptitle("simulator: host-clock times of simulated kernels, not performance; no floors (no NVLink or HBM)"
                 if simulated else "rank 0, median per call; dashed: the floor from the ceilings measured in this run",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    return fig
