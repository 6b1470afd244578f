"""One argument list per kernel: its own signature (``ep_runtime/core/kernel_args.py``).

Every kernel parameter is named after the array or scalar it receives, and the launch list is
built from those names, so two arrays of one type cannot be passed in each other's place; a
parameter that names nothing the runtime has is refused before any launch, naming the kernel
and the parameter. Runs on the simulator's kernel objects (the same Python source the GPU
compiles)."""

import numpy as np
import pytest

from ep_runtime.core.builds import kernel_builds
from ep_runtime.core.kernel_args import (CALLER_ARRAYS, RUNTIME_ARRAYS, SCALARS, arg_names, argtypes, build_args,
                                         region_views, view_base)
from ep_runtime.core.layout import BufferLayout
from ep_runtime.tools.gate_entries import home_weight_entries, plan_entries


@pytest.fixture(scope="module")
def builds():
    """``[(label, layout, name, kernel)]``: every kernel of every plan variant and format the
    compile gate builds."""
    out = []
    for label, cfg, plan in plan_entries() + home_weight_entries():
        layout = BufferLayout(cfg, plan)
        out += [(label, layout, name, kernel) for name, kernel, _ in kernel_builds(cfg, plan)]
    return out


def test_every_parameter_names_what_it_receives(builds):
    every_region = {r.name for _, layout, _, _ in builds for r in layout.regions} | set(
        next(iter(builds))[1].absent())
    for label, layout, name, kernel in builds:
        for p in arg_names(kernel):
            view = view_base(p)
            base = view[0] if view else p
            assert (p in SCALARS or base in CALLER_ARRAYS or base in RUNTIME_ARRAYS or base in every_region), \
                f"{name} [{label}]: parameter {p!r}"
        assert len(argtypes(kernel, layout, name)) == len(arg_names(kernel))


def test_the_launch_list_is_the_signature_so_a_swapped_pair_gets_its_own_arrays(builds):
    """dispatch_async takes dispatch_signal and dispatch_route_signal, two [G, R] uint64 regions:
    a kernel whose signature lists them the other way round still receives each by its name."""
    _, layout, _, kernel = next(b for b in builds if b[2] == "dispatch_async")
    names = list(arg_names(kernel))
    i, j = names.index("dispatch_signal"), names.index("dispatch_route_signal")
    names[i], names[j] = names[j], names[i]
    namespace = {}
    exec(f"def swapped({', '.join(names)}):\n    pass\n", namespace)
    regions = {n: object() for n in names}
    args = build_args(namespace["swapped"], regions, {})
    assert args[i] is regions["dispatch_route_signal"] and args[j] is regions["dispatch_signal"]
    assert [a for a in args] == [regions[n] for n in names]


def test_values_override_regions_by_name(builds):
    _, _, _, kernel = next(b for b in builds if b[2] == "validate_routing")
    regions = {n: ("region", n) for n in arg_names(kernel)}
    args = build_args(kernel, regions, {"topk_ids": "mine"})
    assert args[arg_names(kernel).index("topk_ids")] == "mine"
    assert args[arg_names(kernel).index("status")] == ("region", "status")


def test_a_parameter_named_after_nothing_is_refused_naming_the_kernel_and_the_parameter(builds):
    _, layout, _, _ = builds[0]

    def my_kernel(dispatch_tokens, dispatch_sigal):
        pass

    with pytest.raises(TypeError, match=r"kernel my_kernel: parameter 'dispatch_sigal' names no region"):
        argtypes(my_kernel, layout)


def test_views_are_the_regions_bytes(builds):
    _, layout, _, kernel = next(b for b in builds if b[2] == "dispatch_copy")
    assert "dispatch_tokens_u8" in arg_names(kernel) and "expert_scales_u8" in arg_names(kernel)
    regions = {"dispatch_tokens": np.arange(12, dtype=np.uint64).reshape(2, 6), "expert_scales": np.ones(4, np.float32)}
    views = region_views(regions, [kernel])
    assert views["dispatch_tokens_u8"].shape == (2, 48) and views["dispatch_tokens_u8"].dtype == np.uint8
    assert np.shares_memory(views["dispatch_tokens_u8"], regions["dispatch_tokens"])
    assert views["expert_scales_u8"].dtype == np.uint8 and views["expert_scales_u8"].size == 16
    types = dict(zip(arg_names(kernel), argtypes(kernel, layout)))
    assert str(types["dispatch_tokens_u8"].dtype) == "uint8" and types["dispatch_tokens_u8"].ndim == 3
