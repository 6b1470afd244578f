"""Kernel arguments, named once: by the kernel's own parameters.

A kernel's argument list is its signature. Each parameter is named after what it receives, and
the runtime builds the launch arguments, and the compile-and-link gate the Numba signature the
runtime launches, from those names, so a host list cannot drift from the kernel and two arrays
of one type cannot be passed in each other's place. A name is a
:class:`~ep_runtime.core.layout.BufferLayout` region, a region seen in another dtype
(``<region>_u8``: :data:`VIEWS`, the last axis rescaled), a caller's array
(:data:`CALLER_ARRAYS`: dtype and rank), an array the runtime makes outside the layout
(:data:`RUNTIME_ARRAYS`) or an int64 scalar (:data:`SCALARS`). Regions a runtime's plan does
not allocate, and those only an FP8 token format has (``layout.FORMAT_REGIONS``), are passed
as empty stand-ins (:meth:`BufferLayout.absent`). A parameter that names none of these is an
error of the kernel (:func:`argtypes` raises, naming it), found by the gate and by the
runtime's construction before anything is launched.
"""

from __future__ import annotations

import functools
import inspect

import numpy as np

from ep_runtime.core.layout import BufferLayout, token_word

#: Arrays the caller passes (after conversion to the kernels' dtypes), as (dtype, ndim).
CALLER_ARRAYS = {
    "tokens": (np.uint16, 2),
    "topk_ids": (np.int32, 2),
    "topk_weights": (np.float32, 2),
    "valid_tokens": (np.int32, 1),
    "expert_out": (np.uint16, 2),
    "out": (np.uint16, 2),
    "out_partials": (np.uint16, 3),
    "aux": (np.float32, 2),
    "own_rows": (np.uint16, 2),  # combine_wait: the compact expert_out (this rank's own partials), or [0, 0]
    "token_scales": (np.uint8, 2),  # pre-quantized FP8 input: the scales' bytes, [T, S * scale bytes]
    "row_values": (np.float32, 1),  # slot_values_async: one value per expert-batch row
    "slot_out": (np.float32, 2),  # slot_values_wait: [T, K], the values home
    # routing_copy: a kept routing (EPRuntime.keep_routing), [R, Tmax, K] and [R, L + 1]
    "kept_ids": (np.int32, 3),
    "kept_weights": (np.float32, 3),
    "kept_counts": (np.int32, 2),
    "kept_ranks": (np.int32, 3),
}
#: Arrays the runtime makes outside the layout, as (dtype, ndim): ``peer_bases`` [P, R] uint64,
#: the address of each region of ``layout.PEER_REGIONS`` (row ``PEER_TOKENS`` ...) on every PE as
#: mapped on this one (``Session.peer_addresses``), known only once the heap is allocated.
RUNTIME_ARRAYS = {"peer_bases": (np.uint64, 2)}
#: Dtype views of regions a kernel reads or writes byte-wise (FP8 messages and scales), by the
#: suffix of the parameter's name: ``dispatch_tokens_u8`` is ``dispatch_tokens`` as uint8.
VIEWS = {"_u8": np.dtype(np.uint8)}
#: bf16 arrays (caller's and regions) that kernels take as views in the token word
#: (:func:`ep_runtime.core.layout.token_word`): the last axis has ``hidden * 2 / itemsize`` words.
#: The partials (``combine_partials``, ``combine_stage``, the compact ``expert_out``,
#: ``out_partials``) are float32 with ``EPConfig.combine_dtype = "float32"``
#: (:func:`ep_runtime.core.layout.partial_dtype`): then the token word is uint64 (hidden a multiple
#: of 4) and their views hold ``hidden / 2`` words, 2 floats each; the argument types are the same.
WORD_ARRAYS = frozenset({"tokens", "expert_out", "own_rows", "out", "out_partials", "dispatch_tokens",
                         "combine_partials", "combine_stage", "expert_x", "relay_partials", "relay_stage",
                         "relay_rows", "relay_sums", "combine_sums", "dense_x", "batched_x"})
#: int64 scalar arguments.
SCALARS = ("pad_multiple", "timeout_ns", "mode", "n_experts", "allow_negative", "use_valid", "prequantized",
           "scales_col_major", "copy_rows", "reuse_routing", "restore", "scales_form")



@functools.lru_cache(maxsize=None)
def arg_names(kernel) -> tuple[str, ...]:
    """The argument list of ``kernel`` (a ``@cuda.jit`` dispatcher, the simulator's kernel or a
    plain function): its parameter names, in order."""
    return tuple(inspect.signature(getattr(kernel, "py_func", kernel)).parameters)


def view_base(name: str):
    """``(region, dtype)`` when parameter ``name`` is a region seen in another dtype
    (:data:`VIEWS`), else ``None``."""
    for suffix, dtype in VIEWS.items():
        if name.endswith(suffix):
            return name[:-len(suffix)], dtype
    return None


def build_args(kernel, regions: dict, values: dict) -> tuple:
    """Launch arguments of ``kernel`` in its parameters' order: each name from ``values`` if
    given there, else from ``regions`` (the runtime's kernel-ready region arrays and views)."""
    return tuple(values[n] if n in values else regions[n] for n in arg_names(kernel))


def argtypes(kernel, layout: BufferLayout, name: str | None = None) -> tuple:
    """The Numba signature (the kernel compiler's types) the runtime launches ``kernel`` with
    (C-contiguous arrays), from its parameter names. Raises ``TypeError`` naming the kernel (``name``, else its function's)
    and the parameter when a name is none of the kinds above."""
    from ep_runtime.kernels.cuda_api import from_dtype, types

    absent = layout.absent()
    out = []
    for n in arg_names(kernel):
        if n in SCALARS:
            out.append(types.int64)
            continue
        view = view_base(n)
        base = view[0] if view is not None else n
        if base in CALLER_ARRAYS:
            dtype, ndim = CALLER_ARRAYS[base]
        elif base in RUNTIME_ARRAYS:
            dtype, ndim = RUNTIME_ARRAYS[base]
        elif layout.has(base):
            r = layout.region(base)
            dtype, ndim = r.dtype, len(r.shape)
        elif base in absent:
            dtype, ndim = absent[base]
        else:
            who = name or getattr(getattr(kernel, "py_func", kernel), "__name__", repr(kernel))
            raise TypeError(f"kernel {who}: parameter {n!r} names no region, view (<region>_u8), caller array, "
                            f"runtime array or scalar; name it after the array it receives (layout regions: "
                            f"{', '.join(r.name for r in layout.regions)})")
        if view is not None:
            dtype = view[1]
        elif n in WORD_ARRAYS:
            dtype = token_word(layout.cfg.hidden)
        out.append(types.Array(from_dtype(np.dtype(dtype)), ndim, "C"))
    return tuple(out)


def region_views(regions: dict, kernels) -> dict:
    """``{parameter: view}`` of every region view a parameter of ``kernels`` takes (``regions``:
    the region arrays by name, stand-ins included)."""
    out = {}
    for kernel in kernels:
        for n in arg_names(kernel):
            view = view_base(n)
            if view is not None and view[0] in regions:
                out[n] = regions[view[0]].view(view[1])
    return out
