"""The kernels a plan runs, with the signatures it launches them with: one list for the runtime,
prebuild (the kernel cache ahead of time) and the compile-and-link gate.

A runtime of an :class:`~ep_runtime.config.EPConfig` under a :class:`~ep_runtime.plan.Plan`
compiles exactly :func:`kernel_builds` ``(cfg, plan)``: the dispatch kernels of the plan's
receiver (:func:`ep_runtime.kernels.dispatch.make_dispatch_kernels`), the combine kernels, and
the debug-mode routing check. The kernels depend on the plan's compile-time variants and on the
formats, not on the sizes; the factories cache one build per variant, so two runtimes with the
same variants share their kernels.
"""

from __future__ import annotations

import dataclasses

from .config import EPConfig
from .kernel_args import argtypes
from .layout import BufferLayout
from .plan import ExpandedCopy, Plan, Transport


def plan_kernels(cfg: EPConfig, plan: Plan) -> dict:
    """``{name: kernel}``: every kernel a runtime of ``cfg`` under ``plan`` launches.
    ``combine_async_rows`` copies partial words unchanged, so the bf16-partials build serves
    float32 partials too. ``dispatch_copy`` only where the expanded layout is served and copied
    after the placement. The slot-value kernels depend on the block size, transport and PDL only,
    ``routing_copy`` (a kept routing aside and back) on the block size and PDL."""
    from .kernels.combine import make_combine_kernels
    from .kernels.dispatch import make_dispatch_kernels
    from .kernels.routing_keep import make_routing_copy
    from .kernels.slot_values import make_slot_values_kernels
    from .kernels.validate import validate_routing

    kernels = make_dispatch_kernels(plan.dispatch_variant(cfg))
    if plan.expanded_copy is not ExpandedCopy.DISPATCH_COPY:
        del kernels["dispatch_copy"]
    cv = plan.combine_variant(cfg)
    combine = make_combine_kernels(cv)
    rows = make_combine_kernels(dataclasses.replace(cv, f32_partials=False))["combine_async_rows"]
    kernels.update(combine_async=combine["combine_async"], combine_async_rows=rows,
                   combine_wait=combine["combine_wait"], validate_routing=validate_routing)
    if "combine_relay" in combine:  # the hierarchical transport's proxy, in the runtime's partial format
        kernels["combine_relay"] = combine["combine_relay"]
    kernels.update(make_slot_values_kernels(plan.threads, plan.transport is Transport.STORES, plan.pdl))
    kernels["routing_copy"] = make_routing_copy(plan.threads, plan.pdl)
    return kernels


def kernel_builds(cfg: EPConfig, plan: Plan) -> list:
    """``[(name, kernel, argtypes)]``: every kernel a runtime of ``cfg`` under ``plan`` compiles
    when it is built, with the Numba signature it launches (the argument lists of
    :mod:`ep_runtime.kernel_args`, the regions the plan leaves out as empty stand-ins)."""
    layout = BufferLayout(cfg, plan)
    return [(name, kernel, argtypes(name, layout)) for name, kernel in plan_kernels(cfg, plan).items()]


def combine_wait_with(cfg: EPConfig, plan: Plan, epilogue):
    """combine_wait with a caller's ``epilogue`` (a Numba device function), for the runtime's
    partial format (built once per epilogue)."""
    from .kernels.combine import make_combine_kernels

    return make_combine_kernels(plan.combine_variant(cfg), epilogue)["combine_wait"]
