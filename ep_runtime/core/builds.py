"""The kernels a plan runs, with the signatures it launches them with: one list for the runtime,
prebuild (the kernel cache ahead of time) and the compile-and-link gate.

A runtime of an :class:`~ep_runtime.core.config.EPConfig` under a :class:`~ep_runtime.core.plan.Plan`
compiles exactly :func:`kernel_builds` ``(cfg, plan)``: the dispatch kernels of the plan's
receiver (:func:`ep_runtime.kernels.dispatch.make_dispatch_kernels`), the combine kernels, and
the debug-mode routing check. The kernels depend on the plan's compile-time variants and on the
formats, not on the sizes; the factories cache one build per variant, so two runtimes with the
same variants share their kernels.
"""

from __future__ import annotations

import dataclasses

from ep_runtime.core.config import EPConfig
from ep_runtime.core.kernel_args import argtypes
from ep_runtime.core.layout import BufferLayout
from ep_runtime.core.plan import ExpandedCopy, Plan


#: The plan variants the gate builds: every receiver on every transport it can run on one node.
PLAN_VARIANTS = (("wait", "stores"), ("land", "stores"), ("route_first", "stores"), ("route_first_chunked", "stores"),
                 ("wait", "puts"), ("land", "puts"))
#: ... and across nodes (built for 4 PEs as 2 nodes of 2).
NODE_VARIANTS = (("wait", "hierarchical"),)
#: The kernels of each family, as :func:`plan_kernels` builds them (a family's module is imported
#: only when one of its kernels is asked for: the dispatch and combine kernels import NVSHMEM).
DISPATCH_KERNELS = ("dispatch_async", "dispatch_wait", "dispatch_land", "dispatch_copy", "dispatch_relay",
                    "dispatch_dense", "dispatch_batched")
COMBINE_KERNELS = ("combine_async", "combine_async_rows", "combine_wait", "combine_relay", "combine_async_dense")
#: A format with a global scale (NVFP4): the kernels that compute it on the stream before
#: dispatch_async when the caller passes none (its codec's ``make_global_scale``), in order.
GLOBAL_SCALE_KERNELS = ("tensor_amax", "global_scale_of_amax")


def plan_kernels(cfg: EPConfig, plan: Plan, only=None) -> dict:
    """``{name: kernel}``: every kernel a runtime of ``cfg`` under ``plan`` launches (or those of them named in
    ``only``, building nothing else). ``combine_async_rows`` (and ``combine_async_dense``) copies partial words
    unchanged, so the bf16-partials build serves float32 partials too. ``dispatch_copy`` only where the expanded
    layout is served and copied after the placement; ``dispatch_dense`` and ``combine_async_dense`` where the
    dense layout is served, ``dispatch_batched`` where the batched one is; ``dispatch_relay`` and
    ``combine_relay`` with the hierarchical transport; with ``combine_weights="home"`` the batched
    layout's combine pair of ep_runtime/kernels/combine_home.py and no ``combine_async_rows``. The slot-value kernels depend on the block size,
    transport and PDL only, ``routing_copy`` (a kept routing aside and back) on the block size and PDL;
    :data:`GLOBAL_SCALE_KERNELS` in a format with a global scale."""
    def wanted(*names) -> bool:
        return only is None or any(n in only for n in names)

    kernels, relay, combine = {}, None, {}
    if wanted(*DISPATCH_KERNELS):
        from ep_runtime.kernels.dispatch import make_dispatch_kernels

        kernels.update(make_dispatch_kernels(plan.dispatch_variant(cfg)))
        if plan.expanded_copy is not ExpandedCopy.DISPATCH_COPY:
            del kernels["dispatch_copy"]
        relay = kernels.pop("dispatch_relay", None)
        if plan.serves("dense"):
            from ep_runtime.kernels.layouts.dense import make_dispatch_dense

            kernels["dispatch_dense"] = make_dispatch_dense(plan.threads, cfg.token_format.codec, plan.pdl,
                                                           plan.dispatch_variant(cfg).rank_slots)
        if plan.serves("batched"):
            from ep_runtime.kernels.layouts.batched import make_dispatch_batched

            kernels["dispatch_batched"] = make_dispatch_batched(plan.threads, cfg.token_format.codec, plan.pdl)
    if wanted(*COMBINE_KERNELS):
        from ep_runtime.kernels.combine import make_combine_kernels

        cv = plan.combine_variant(cfg)
        combine = make_combine_kernels(cv)
        rows = {}  # (weights at home: a runtime of the batched layout only, which has no compact combine)
        if not cv.home_weights:
            bf16_rows = dataclasses.replace(cv, f32_partials=False)
            rows["combine_async_rows"] = make_combine_kernels(bf16_rows)["combine_async_rows"]
        kernels.update(combine_async=combine["combine_async"], **rows, combine_wait=combine["combine_wait"])
        if plan.serves("dense"):
            from ep_runtime.kernels.combine_dense import make_combine_async_dense

            kernels["combine_async_dense"] = make_combine_async_dense(dataclasses.replace(cv, f32_partials=False))
    if wanted("validate_routing"):
        from ep_runtime.kernels.validate import validate_routing

        kernels["validate_routing"] = validate_routing
    if relay is not None:  # the hierarchical transport's proxies
        kernels["dispatch_relay"] = relay
    if "combine_relay" in combine:  # (in the runtime's partial format)
        kernels["combine_relay"] = combine["combine_relay"]
    if wanted("slot_values_async", "slot_values_wait"):
        from ep_runtime.kernels.slot_values import make_slot_values_kernels

        v = plan.dispatch_variant(cfg)
        kernels.update(make_slot_values_kernels(v.threads, v.transport, v.pdl, v.node_size, v.node_stores))
    if cfg.token_format.has_global_scale and wanted(*GLOBAL_SCALE_KERNELS):
        from ep_runtime.kernels.codecs import traits

        scale = traits(cfg.token_format.codec).make_global_scale(plan.threads)
        kernels.update({name: getattr(scale, name) for name in GLOBAL_SCALE_KERNELS})
    if wanted("routing_copy"):
        from ep_runtime.kernels.routing_keep import make_routing_copy

        kernels["routing_copy"] = make_routing_copy(plan.threads, plan.pdl)
    return {name: k for name, k in kernels.items() if only is None or name in only}


def kernel_builds(cfg: EPConfig, plan: Plan, only=None) -> list:
    """``[(name, kernel, argtypes)]``: every kernel a runtime of ``cfg`` under ``plan`` compiles
    when it is built (or those named in ``only``), with the Numba signature it launches (from
    the kernels' parameter names, :mod:`ep_runtime.core.kernel_args`; the regions the plan leaves
    out as empty stand-ins)."""
    layout = BufferLayout(cfg, plan)
    return [(name, kernel, argtypes(kernel, layout, name)) for name, kernel in plan_kernels(cfg, plan, only).items()]


def combine_wait_with(cfg: EPConfig, plan: Plan, epilogue):
    """combine_wait with a caller's ``epilogue`` (a Numba device function), for the runtime's
    partial format (built once per epilogue)."""
    from ep_runtime.kernels.combine import make_combine_kernels

    return make_combine_kernels(plan.combine_variant(cfg), epilogue)["combine_wait"]
