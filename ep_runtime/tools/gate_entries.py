"""Kernel signatures checked by the compile-and-link gate (``python -m ep_runtime.tools.compile_gate``).

One entry per (kernel, argument types) that host code launches: ``(name, kernel, argtypes)``,
where ``kernel`` is the ``@cuda.jit`` function and ``argtypes`` a tuple of Numba types. Arrays
are C-contiguous (``"C"``), as NVSHMEM needs. The gate links each entry to an sm_90a cubin on a
CPU-only machine.
"""

from ep_runtime.core.builds import GLOBAL_SCALE_KERNELS, NODE_VARIANTS, PLAN_VARIANTS  # noqa: F401 (the tools' lists)
from ep_runtime.kernels import gate_probe, selftest
from ep_runtime.kernels.cuda_api import types


def _c(dtype, ndim=1):
    """A C-contiguous device array type."""
    return types.Array(dtype, ndim, "C")


u16, u64, i32, i64, f32 = types.uint16, types.uint64, types.int32, types.int64, types.float32

GATE_ENTRIES = [
    # (dst_tokens, src_tokens, dst_meta, src_meta, sig, pe)
    ("probe_put_fence_signal", gate_probe.probe_put_fence_signal,
     (_c(u16, 2), _c(u16, 2), _c(u64), _c(u64), _c(u64), i32)),
    # (dst, src, sig, counter, out, want, timeout_ns)
    ("probe_signal_wait_atomics", gate_probe.probe_signal_wait_atomics,
     (_c(i64), _c(i64), _c(u64), _c(i64), _c(i64), u64, u64)),
    # the SHMEM layer's exchange kernels (ep_runtime/kernels/selftest.py), as the tests launch them
    ("ring_put_signal", selftest.ring_put_signal, (_c(i32, 2), _c(i32), _c(u64), i64, _c(i32, 2))),
    ("ring_put_quiet_signal", selftest.ring_put_quiet_signal, (_c(i32, 2), _c(i32), _c(u64), i64, _c(i32, 2))),
    ("alltoall_put_nbi_fence", selftest.alltoall_put_nbi_fence, (_c(u16, 2), _c(u16, 2), _c(u64), i64)),
    ("alltoall_put_nbi_no_fence", selftest.alltoall_put_nbi_no_fence, (_c(f32, 2), _c(f32, 2), _c(u64), i64)),
    ("wait_all_copy_out", selftest.wait_all_copy_out, (_c(i32, 2), _c(u64), i64, _c(i32, 2))),
    ("count_on_pe0", selftest.count_on_pe0, (_c(u64), _c(u64))),
    ("put_pattern", selftest.put_pattern, (_c(u16), _c(u16), i32)),
    ("alltoall_put_signal_warp", selftest.alltoall_put_signal_warp, (_c(f32, 2), _c(f32, 2), _c(u64))),
    ("wait_ge_copy_out", selftest.wait_ge_copy_out, (_c(f32, 2), _c(u64), i64, i64, _c(f32, 2), _c(u64))),
    ("atomic_mix", selftest.atomic_mix, (_c(u64), _c(u64))),
    ("ring_peer_store_signal", selftest.ring_peer_store_signal,
     (_c(i32), _c(i32, 2), _c(i32), _c(u64), i64, _c(i32, 2))),
]


#: The kernels of the hierarchical transport in the default gate (bfloat16 tokens and partials):
#: its new kernels. every_build has the rest: its senders and combine_wait, whose node code
#: (``nodes.reaches``, ``via_proxies``, the proxies' signal) every build types and lowers with
#: a node size of 0, and the FP8 and float32-partial builds.
HIERARCHICAL_CROSS_SECTION = ("dispatch_relay", "combine_relay")
#: The formats it builds them in: (token_dtype, combine_dtype).
FORMATS = (("bfloat16", "bfloat16"), ("bfloat16", "float32"), ("fp8_e4m3", "bfloat16"),
           ("fp8_e4m3_ue8m0", "bfloat16"), ("nvfp4", "bfloat16"))


def plan_entries(formats=FORMATS, variants=PLAN_VARIANTS + NODE_VARIANTS, pdl: bool = True) -> list:
    """``[(label, cfg, plan)]``: a plan of every receiver on every transport, in each format, on
    GPUs of one NVLink domain (``Topology.nvlink_gpus``; the hierarchical transport on 4 GPUs as
    2 nodes of 2, storing and putting within a node), every layout the format has served (so
    every kernel a plan can launch is built: the expanded layout's receivers, dispatch_dense,
    combine_async_dense and, but in NVFP4, dispatch_batched)."""
    from ep_runtime.core.config import EPConfig
    from ep_runtime.core.plan import Topology, choose_plan

    out = []
    for token_dtype, combine_dtype in formats:
        layouts = ("expanded", "compact", "dense") + (() if token_dtype == "nvfp4" else ("batched",))
        for receiver, transport in variants:
            nodes = transport == "hierarchical"  # 4 PEs as 2 nodes of 2 (their heaps not mapped across)
            cfg = EPConfig(n_ranks=4 if nodes else 2, n_experts=8, top_k=2, hidden=256, max_tokens_per_rank=16,
                           token_dtype=token_dtype, combine_dtype=combine_dtype,
                           layouts=layouts)
            topology = Topology(4, False, 132, True, False, (0, 0, 1, 1), True) if nodes else Topology.nvlink_gpus(2)
            within = ((True, ""), (False, " puts within")) if nodes else ((False, ""),)
            for node_stores, note in within:  # the hierarchical transport stores, or puts, within a node
                plan = choose_plan(cfg, topology, {"receiver": receiver, "transport": transport, "pdl": pdl,
                                                   **({"node_stores": node_stores} if nodes else {})})
                out.append((f"{receiver}/{transport}{note}, {token_dtype}" +
                            (", f32 partials" if combine_dtype == "float32" else ""), cfg, plan))
    return out


#: The transports the batched combine with the weights at home runs on (the hierarchical one
#: refuses it).
HOME_WEIGHT_TRANSPORTS = ("stores", "puts")


def home_weight_entries(pdl: bool = True) -> list:
    """``[(label, cfg, plan)]``: a runtime of the batched layout only with
    ``combine_weights="home"`` on each of :data:`HOME_WEIGHT_TRANSPORTS` (the wait receiver, bf16
    rows: its combine pair, ep_runtime/kernels/combine_home.py, depends on neither the receiver
    nor the token format; its dispatch kernels are the other plans' builds)."""
    from ep_runtime.core.config import EPConfig
    from ep_runtime.core.plan import Topology, choose_plan

    cfg = EPConfig(n_ranks=2, n_experts=8, top_k=2, hidden=256, max_tokens_per_rank=16, layouts=("batched",),
                   combine_weights="home")
    return [(f"wait/{transport}, bfloat16, weights at home", cfg,
             choose_plan(cfg, Topology.nvlink_gpus(2), {"receiver": "wait", "transport": transport, "pdl": pdl}))
            for transport in HOME_WEIGHT_TRANSPORTS]


def _in_cross_section(name: str, token_dtype: str, receiver: str, transport: str = "stores",
                      combine_dtype: str = "bfloat16") -> bool:
    """Whether the default gate builds kernel ``name`` of a plan with ``receiver`` and ``transport`` in
    ``token_dtype``. Every bfloat16 build is in it (each receiver, transport and partial
    format). In an FP8 format the receivers' own kernels and ``dispatch_copy`` are built once
    each, and ``dispatch_async`` only for the ``wait`` receiver (FP8_E4M3 on both transports,
    UE8M0 on stores): the FP8 quantizing code is one device function every sender calls, and
    what a sender of another receiver adds (routes, parts) is the bfloat16 build's, which the
    gate builds; UE8M0's puts sender is FP8_E4M3's with UE8M0's scale code, built in its stores
    sender. The receive kernels of UE8M0 equal FP8_E4M3's except for the scale words they copy,
    so they are built in FP8_E4M3 only, and of the route-first receivers only the chunked one
    (the plain one's code is its bfloat16 build's less the copy, and the chunked FP8 build's
    less the chunks); ``dispatch_copy`` and ``dispatch_batched`` (which write the scales' layout)
    in both. NVFP4's codec
    is its own: its ``dispatch_async`` on both transports (peer stores, or a stage and puts),
    its ``dispatch_copy`` (its receiver) and the kernels of its global scale
    (:data:`GLOBAL_SCALE_KERNELS`); its receive kernels read of the codec only its ``RAW``
    trait, as FP8_E4M3's do. FP8's ``dispatch_land`` is left out too (no default plan lands FP8
    rows: only an override does, and its landing code is the bfloat16 build's). ``routing_copy``
    calls no NVSHMEM function (nothing to link) and tests/test_prebuild.py builds it for sm_90a.
    Of the hierarchical transport's builds, :data:`HIERARCHICAL_CROSS_SECTION` in bfloat16. Only
    ``every_build`` has the others."""
    if transport == "hierarchical":
        return name in HIERARCHICAL_CROSS_SECTION and token_dtype == combine_dtype == "bfloat16"
    if name == "routing_copy" or (name == "dispatch_land" and token_dtype != "bfloat16"):
        return False
    if name in GLOBAL_SCALE_KERNELS:  # one build a format (their key has neither receiver nor transport)
        return True
    if token_dtype == "bfloat16":
        return True
    if name == "dispatch_async":
        return receiver == "wait" and (token_dtype in ("fp8_e4m3", "nvfp4") or transport == "stores")
    if name in ("dispatch_copy", "dispatch_batched"):
        return True
    if name == "dispatch_wait" and receiver == "route_first":  # its FP8 code is route_first_chunked's build's
        return False
    return token_dtype == "fp8_e4m3"


def ep_kernel_entries(every_build: bool = False):
    """The EP kernels with the exact signatures the runtime launches (:func:`ep_runtime.core.builds
    .kernel_builds`) for the plan variants and formats of :func:`plan_entries`: each distinct
    build once (by its kernel-cache key: plans that differ in what a kernel does not read, such
    as a receive kernel's transport, share it), named by the first plan that launches it.
    By default the cross-section :func:`_in_cross_section` describes; ``every_build`` adds the
    rest (every FP8 sender of every receiver, the UE8M0 receive kernels, the batched combine with
    the weights at home of :func:`home_weight_entries`): what
    ``python -m ep_runtime.tools.compile_gate --entries ep_runtime.tools.gate_entries:every_build`` checks,
    and what a GPU machine compiles when tests/gpu/plan_checks.sh runs every variant."""
    from ep_runtime.core.builds import kernel_builds
    from ep_runtime.tools.compile_gate import TARGET_CC
    from ep_runtime.shmem.cache_key import kernel_key

    seen, entries = set(), []
    for label, cfg, plan in plan_entries() + (home_weight_entries() if every_build else []):
        for name, kernel, argtypes in kernel_builds(cfg, plan):
            if not (every_build or _in_cross_section(name, cfg.token_dtype, plan.receiver.value,
                                                     plan.transport.value, cfg.combine_dtype)):
                continue
            key = kernel_key(kernel, argtypes, TARGET_CC)
            if key not in seen:
                seen.add(key)
                entries.append((f"{name} [{label}]", kernel, argtypes))
    return entries


#: The probes of nvshmem4py's device calls the EP kernels make (the rest of GATE_ENTRIES are the
#: SHMEM layer's self-test kernels, which every_build checks and tests/gpu/shmem_check.py runs).
PROBE_ENTRIES = GATE_ENTRIES[:2]


def gate_entries():
    """The default gate (CI): the probes and the EP builds' cross-section."""
    return list(PROBE_ENTRIES) + ep_kernel_entries()


def every_build():
    """The probes, the SHMEM layer's self-test kernels and every EP build of every plan variant and format."""
    return list(GATE_ENTRIES) + ep_kernel_entries(every_build=True)
