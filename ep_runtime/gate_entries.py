"""Kernel signatures checked by the compile-and-link gate (``python -m ep_runtime.compile_gate``).

One entry per (kernel, argument types) that host code launches: ``(name, kernel, argtypes)``,
where ``kernel`` is the ``@cuda.jit`` function and ``argtypes`` a tuple of Numba types. Arrays
are C-contiguous (``"C"``), as NVSHMEM needs. The gate links each entry to an sm_90a cubin on a
CPU-only machine.
"""

from numba import types

from .kernels import gate_probe, selftest


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
    # the SHMEM layer's exchange kernels (kernels/selftest.py), as the tests launch them
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


def ep_kernel_entries():
    """The EP kernels, at the GPU block size, with the exact signatures the runtime launches
    (from ``ep_runtime.kernel_args``, the lists the runtime builds its arguments from), and the
    variants of the FP8 token formats, of float32 combine partials and of the send paths."""
    from ep_runtime.config import EPConfig
    from ep_runtime.kernel_args import argtypes
    from ep_runtime.layout import BufferLayout, token_word
    from ep_runtime.runtime import GPU_THREADS, _kernels_for
    from ep_runtime.transfer import SendPaths

    layout = BufferLayout(EPConfig(n_ranks=2, n_experts=8, top_k=2, hidden=64, max_tokens_per_rank=16))
    kernels = _kernels_for(GPU_THREADS, token_word(layout.cfg.hidden))
    entries = [(name, kernel, argtypes(name, layout)) for name, kernel in kernels.items()]
    # the FP8 token formats' dispatch kernels (the other kernels do not depend on the format)
    for token_dtype, ue8m0 in (("fp8_e4m3", False), ("fp8_e4m3_ue8m0", True)):
        fp8 = BufferLayout(EPConfig(n_ranks=2, n_experts=8, top_k=2, hidden=256, max_tokens_per_rank=16,
                                    token_dtype=token_dtype))
        fk = _kernels_for(GPU_THREADS, token_word(fp8.cfg.hidden), True, ue8m0)
        entries += [(f"{name} ({token_dtype})", fk[name], argtypes(name, fp8))
                    for name in ("dispatch_async", "dispatch_copy")]
    # float32 combine partials (EPConfig.combine_dtype="float32"): combine_async and combine_wait
    # built with f32_partials (the dispatch kernels do not depend on the partial format, and
    # combine_async_rows, which copies partial words unchanged, is the bf16 build: the same entry)
    f32 = BufferLayout(EPConfig(n_ranks=2, n_experts=8, top_k=2, hidden=64, max_tokens_per_rank=16,
                                combine_dtype="float32"))
    ck = _kernels_for(GPU_THREADS, token_word(f32.cfg.hidden), f32_partials=True)
    assert ck["combine_async_rows"] is kernels["combine_async_rows"]
    entries += [(f"{name} (float32 partials)", ck[name], argtypes(name, f32))
                for name in ("combine_async", "combine_wait")]
    # the other send paths (compile time: ep_runtime.transfer.SendPaths), for the kernels that depend on them
    for label, paths, names in (("puts", SendPaths(stores=False), ("dispatch_async", "combine_async",
                                                                     "combine_async_rows")),
                                ("copy engine", SendPaths(copy_engine=True), ("dispatch_async",)),
                                ("land", SendPaths(land=True), ("dispatch_async",)),
                                ("place", SendPaths(place=True), ("dispatch_async", "dispatch_wait")),
                                ("route first", SendPaths(route_first=True), ("dispatch_async", "dispatch_wait")),
                                ("route first, chunks", SendPaths(route_first=True, route_chunks=True),
                                 ("dispatch_async", "dispatch_wait"))):
        pk = _kernels_for(GPU_THREADS, token_word(layout.cfg.hidden), paths=paths)
        entries += [(f"{name} ({label})", pk[name], argtypes(name, layout)) for name in names]
    fp8_puts = _kernels_for(GPU_THREADS, token_word(fp8.cfg.hidden), True, True, paths=SendPaths(stores=False))
    entries.append(("dispatch_async (fp8_e4m3_ue8m0, puts)", fp8_puts["dispatch_async"],
                    argtypes("dispatch_async", fp8)))
    return entries


def gate_entries():
    return list(GATE_ENTRIES) + ep_kernel_entries()
