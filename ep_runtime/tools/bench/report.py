"""The README's bench table and plot, rendered from a ``python -m ep_runtime.tools.bench --json`` file.

``python -m ep_runtime.tools.bench.report RUN.json [--plot RUN.png]`` prints one Markdown table of rank
0's results: a row per (tokens per rank, token format), ep_runtime's compact and expanded medians
beside the floors, the baselines (NCCL, DeepEP V1) and ep_runtime's DeepEP layer
(:mod:`ep_runtime.deep_ep`, DeepEP's API on the compact layout) measured in the same run. The plot
is the bench's own (:func:`ep_runtime.tools.bench.run.plot`) with the baselines drawn beside ours.
"""

from __future__ import annotations

import argparse
import json
import math

#: Baselines the table and the plot carry: (key in ``baselines_us``, column or legend label).
DISPATCH_BASELINES = (
    ("all_to_all", "NCCL all_to_all"),
    ("all_to_all+permute", "NCCL all_to_all + permute"),
    ("deepep_32sms_dispatch", "DeepEP V1 32 SMs, layout + dispatch"),
    ("deepep_32sms_dispatch_cached", "DeepEP V1 32 SMs, cached dispatch"),
)
COMBINE_BASELINES = (("deepep_32sms_combine", "DeepEP V1 32 SMs, combine"),)
#: The layer's figures the table carries (:mod:`ep_runtime.tools.bench.deep_ep_api`): DeepEP's calls
#: on ep_runtime, to read beside the compact layout's (the layer's cost) and DeepEP V1's.
LAYER_COLUMNS = ("layer_dispatch", "layer_dispatch_cached", "layer_combine_unweighted", "layer_combine")

FORMAT_NAMES = {"bfloat16": "bf16", "fp8_e4m3": "e4m3", "fp8_e4m3_ue8m0": "e4m3 ue8m0", "nvfp4": "nvfp4"}


def _median(value):
    """A baseline's median us: the bench stores ``{"median", "p10", "p90", "n"}`` per baseline."""
    return value.get("median") if isinstance(value, dict) else value


def _us(value) -> str:
    value = _median(value)
    if not isinstance(value, (int, float)) or not math.isfinite(value):
        return "-"
    return f"{value:.1f}" if value < 1000 else f"{value:.0f}"


def _by_setting(results: list[dict]) -> dict:
    """``{(T, token_dtype): {layout: result}}`` of one rank's results (graph mode first: where a
    run timed several modes, the table shows graph replay)."""
    rows: dict = {}
    for r in sorted(results, key=lambda r: r.get("mode") != "graph"):
        key = (r["config"]["max_tokens_per_rank"], r["config"]["token_dtype"])
        rows.setdefault(key, {}).setdefault(r.get("layout", "expanded"), r)
    return dict(sorted(rows.items(), key=lambda kv: (kv[0][0], kv[0][1] != "bfloat16", kv[0][1])))


def _baselines(by_layout: dict) -> dict:
    """The baselines of one (T, token format) setting: measured once, shared by its layouts."""
    return next(iter(by_layout.values())).get("baselines_us", {})


def markdown_table(results: list[dict]) -> str:
    """The README table of one rank's ``results`` (the bench JSON's ``results[rank]``): per row,
    median us of dispatch / combine in each layout, their floors, and the baselines of the same
    run, and the layer's ("-" where the run has none: DeepEP is measured for bf16 and E4M3 tokens
    only)."""
    head = ("| T | tokens | compact dispatch / combine | floor | expanded dispatch / combine | floor | "
            "NCCL all_to_all / + permute | DeepEP V1 32 SMs: layout + dispatch / cached dispatch / combine | "
            "ep_runtime.deep_ep: layout + dispatch / cached dispatch / combine / with topk_weights |")
    lines = [head, "|" + " --- |" * (head.count("|") - 1)]
    for (T, fmt), by_layout in _by_setting(results).items():
        cells = [str(T), FORMAT_NAMES.get(fmt, fmt)]
        for layout in ("compact", "expanded"):
            r = by_layout.get(layout)
            if r is None:
                cells += ["-", "-"]
                continue
            t = r["times_us"]
            cells.append(f"{_us(t['dispatch']['median'])} / {_us(t['combine']['median'])}")
            cells.append(f"{_us(r['dispatch']['floor_us'])} / {_us(r['combine']['floor_us'])}")
        base = _baselines(by_layout)
        nccl, deepep = DISPATCH_BASELINES[:2], DISPATCH_BASELINES[2:] + COMBINE_BASELINES
        for group in (nccl, deepep):
            cells.append(" / ".join(_us(base.get(key)) for key, _ in group))
        cells.append(" / ".join(_us(base.get(key)) for key in LAYER_COLUMNS))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def baseline_series(results: list[dict]) -> list[dict]:
    """The plot's baseline lines of one rank's results: per phase and baseline of
    :data:`DISPATCH_BASELINES` / :data:`COMBINE_BASELINES` and token format, ``{"phase", "label",
    "T", "us"}`` with the points in increasing T (only baselines the run measured)."""
    lines = []
    settings = _by_setting(results)
    formats = sorted({fmt for _, fmt in settings}, key=lambda f: f != "bfloat16")
    for phase, names in (("dispatch", DISPATCH_BASELINES), ("combine", COMBINE_BASELINES)):
        for key, label in names:
            for fmt in formats:
                points = [(T, _median(_baselines(by).get(key))) for (T, f), by in settings.items() if f == fmt]
                points = [(T, v) for T, v in points if isinstance(v, (int, float))]
                if points:
                    lines.append({"phase": phase, "label": f"{label} ({FORMAT_NAMES.get(fmt, fmt)})",
                                  "T": [T for T, _ in points], "us": [v for _, v in points]})
    return lines


def plot_with_baselines(per_rank: list[list[dict]], path: str):
    """:func:`ep_runtime.tools.bench.run.plot` of rank 0's results with the baselines of
    :func:`baseline_series` added as dotted lines; saved as ``path``; returns the figure."""
    from ep_runtime.tools.bench.run import plot

    fig = plot(per_rank, path)
    axes = fig.get_axes()
    for i, line in enumerate(baseline_series(per_rank[0])):
        ax = axes[0 if line["phase"] == "dispatch" else 1]
        ax.plot(line["T"], line["us"], linestyle=":", marker="x", color=f"C{(i + 5) % 10}", label=line["label"])
    fig.set_size_inches(12, 7.5)
    for ax in axes:  # below the axes: with the baselines there are too many lines for a legend inside
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)
    fig.tight_layout()
    fig.savefig(path)
    return fig


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m ep_runtime.tools.bench.report", description=__doc__.split("\n\n")[0])
    p.add_argument("json", help="a file written by python -m ep_runtime.tools.bench --json")
    p.add_argument("--rank", type=int, default=0, help="whose results (default 0)")
    p.add_argument("--plot", metavar="FILE", help="also draw the plot (PNG; needs matplotlib)")
    args = p.parse_args(argv)
    with open(args.json) as f:
        run = json.load(f)
    per_rank = run["results"]
    if not 0 <= args.rank < len(per_rank):
        p.error(f"--rank {args.rank}: the file has results of ranks 0..{len(per_rank) - 1}")
    meta = run.get("meta", {})
    print(f"{meta.get('ranks', len(per_rank))} x {meta.get('device', '?')}, rank {args.rank}, median us "
          f"(git {str(meta.get('git_sha', '?'))[:7]}):\n")
    print(markdown_table(per_rank[args.rank]))
    if args.plot:
        plot_with_baselines(per_rank[args.rank:] + per_rank[:args.rank], args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
