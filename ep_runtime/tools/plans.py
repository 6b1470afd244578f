"""``python -m ep_runtime.tools.plans``: the default execution plans of a GPU host, as the plan
rules (:mod:`ep_runtime.core.plan`) choose them; ``--table`` prints docs/plans.md's table."""

from __future__ import annotations

from ep_runtime.core.config import EPConfig
from ep_runtime.core.plan import PLAN_ENV, Topology, choose_plan, parse_overrides


def plans_table(ranks=(2, 4), token_dtypes=("bfloat16", "fp8_e4m3"), tokens=(1, 128, 1024, 4096),
                layout_sets=("expanded", "compact", "both"), sm_count: int = 132) -> str:
    """The default plans of GPUs of one NVLink domain (``sm_count`` SMs each, PDL), one
    markdown row per (ranks, token format, tokens per rank, layouts served), for the
    DeepSeek-V3-sized layer (hidden 7168, top-8 of 256 experts; the plan reads no other size)."""
    lines = ["| ranks | tokens | T | layouts | receiver | transport | expanded copy | dispatch_async blocks "
             "| receiver SMs | placing blocks | combine_async blocks (compact / expanded) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for R in ranks:
        for td in token_dtypes:
            for T in tokens:
                for lay in layout_sets:
                    cfg = EPConfig(n_ranks=R, n_experts=256, top_k=8, hidden=7168, max_tokens_per_rank=T,
                                   token_dtype=td, layouts=lay)
                    p = choose_plan(cfg, Topology.nvlink_gpus(R, sm_count))
                    lines.append(f"| {R} | {cfg.token_format.name} | {T} | {lay} | {p.receiver.value} | "
                                 f"{p.transport.value} | {p.expanded_copy.value} | {p.dispatch_async_grid}/{p.grid} | "
                                 f"{p.receiver_sms} | {p.placing_blocks} | {p.combine_async_grid('compact')} / "
                                 f"{p.combine_async_grid('expanded')} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    """``python -m ep_runtime.tools.plans``: print the default plans of GPUs of one NVLink domain,
    ``describe()`` each (or, with ``--table``, one markdown row each)."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m ep_runtime.tools.plans", description=main.__doc__)
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--token-dtype", nargs="+", default=["bfloat16", "fp8_e4m3"])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 128, 1024, 4096], help="tokens per rank")
    ap.add_argument("--layouts", nargs="+", default=["expanded", "compact", "both"])
    ap.add_argument("--sms", type=int, default=132, help="SMs per GPU (132: H100 and H200)")
    ap.add_argument("--overrides", default="", help=f"plan overrides, as {PLAN_ENV} takes them")
    ap.add_argument("--table", action="store_true", help="one markdown row per plan")
    args = ap.parse_args(argv)
    if args.table:
        print(plans_table(args.ranks, args.token_dtype, args.tokens, args.layouts, args.sms))
        return 0
    overrides = parse_overrides(args.overrides, "--overrides") if args.overrides else {}
    for R in args.ranks:
        for td in args.token_dtype:
            for T in args.tokens:
                for lay in args.layouts:
                    cfg = EPConfig(n_ranks=R, n_experts=256, top_k=8, hidden=7168, max_tokens_per_rank=T,
                                   token_dtype=td, layouts=lay)
                    plan = choose_plan(cfg, Topology.nvlink_gpus(R, args.sms), overrides)
                    print(f"== {R} ranks, {cfg.token_format.name}, T={T}, serving {lay}\n{plan.describe()}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
