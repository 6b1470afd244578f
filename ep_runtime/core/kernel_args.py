"""The argument list of each kernel, named once.

The runtime builds launch arguments from these lists, and the compile-and-link gate builds
the Numba signatures the runtime will launch from the same lists, so the two cannot drift.
A name is either a :class:`~ep_runtime.core.layout.BufferLayout` region, a view of one in another
dtype (``"region:u8"``: :data:`VIEWS`, the last axis rescaled), a caller's
array (:data:`CALLER_ARRAYS`: dtype and rank), or an int64 scalar (:data:`SCALARS`). Regions
a runtime's plan does not allocate, and those only an FP8 token format has
(``layout.FORMAT_REGIONS``), are passed as empty stand-ins (:meth:`BufferLayout.absent`).
"""

from __future__ import annotations

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
#: Dtype views of regions a kernel reads or writes byte-wise (FP8 messages and scales).
VIEWS = {"u8": np.dtype(np.uint8)}
#: bf16 arrays (caller's and regions) that kernels take as views in the token word
#: (:func:`ep_runtime.core.layout.token_word`): the last axis has ``hidden * 2 / itemsize`` words.
#: The partials (``combine_partials``, ``combine_stage``, the compact ``expert_out``,
#: ``out_partials``) are float32 with ``EPConfig.combine_dtype = "float32"``
#: (:func:`ep_runtime.core.layout.partial_dtype`): then the token word is uint64 (hidden a multiple
#: of 4) and their views hold ``hidden / 2`` words, 2 floats each; the argument types are the same.
WORD_ARRAYS = frozenset({"tokens", "expert_out", "own_rows", "out", "out_partials", "dispatch_tokens",
                         "combine_partials", "combine_stage", "expert_x", "relay_partials", "relay_stage",
                         "relay_rows", "relay_sums"})
#: int64 scalar arguments.
SCALARS = ("pad_multiple", "timeout_ns", "mode", "n_experts", "allow_negative", "use_valid", "prequantized",
           "scales_col_major", "copy_rows", "reuse_routing", "restore")

KERNEL_ARGS = {
    "validate_routing": ("topk_ids", "topk_weights", "valid_tokens", "use_valid", "n_experts",
                         "allow_negative", "status"),
    "dispatch_async": (
        "tokens", "topk_ids", "topk_weights", "valid_tokens", "use_valid", "dispatch_tokens", "dispatch_topk_ids",
        "dispatch_topk_weights", "dispatch_counts", "dispatch_ranks", "dispatch_signal", "dispatch_async_sync",
        "dispatch_send_ranks", "dispatch_send_counts", "status", "token_scales", "prequantized",
        "dispatch_send_stage", "dispatch_send_stage:u8", "dispatch_tokens:u8", "peer_bases", "dispatch_token_credit",
        "timeout_ns", "dispatch_route_signal", "dispatch_row_flag", "reuse_routing", "relay_counts", "relay_signal",
        "relay_stage", "relay_rows", "relay_chunk_flag", "relay_slot"),
    "dispatch_relay": (
        "dispatch_tokens", "dispatch_topk_ids", "dispatch_topk_weights", "dispatch_ranks", "dispatch_counts",
        "dispatch_signal", "relay_counts", "relay_signal", "dispatch_token_credit", "dispatch_async_sync",
        "relay_sync", "status", "timeout_ns", "relay_rows", "relay_chunk_flag", "peer_bases", "reuse_routing"),
    "dispatch_wait": (
        "dispatch_topk_ids", "dispatch_topk_weights", "dispatch_counts", "dispatch_ranks", "dispatch_signal",
        "dispatch_async_sync", "row_offsets", "expert_counts", "row_src_rank", "row_src_token",
        "row_src_k", "row_weight", "row_gather", "recv_tokens", "token_rows", "status", "pad_multiple",
        "timeout_ns", "dispatch_tokens", "expert_x", "copy_rows", "combine_wait_claims", "receive_sync",
        "dispatch_route_signal", "dispatch_placed"),
    "dispatch_land": (
        "dispatch_topk_ids", "dispatch_topk_weights", "dispatch_counts", "dispatch_ranks", "dispatch_route_signal",
        "dispatch_signal", "receive_sync", "row_offsets", "expert_counts", "row_src_rank", "row_src_token",
        "row_src_k", "row_weight", "row_gather", "recv_tokens", "token_rows", "status", "pad_multiple",
        "timeout_ns", "dispatch_tokens", "expert_x", "dispatch_row_flag", "copy_rows", "combine_wait_claims",
        "tokens"),
    "dispatch_copy": (
        "dispatch_tokens", "dispatch_topk_ids", "dispatch_counts", "dispatch_async_sync",
        "token_rows", "row_offsets", "expert_counts", "expert_x", "status", "dispatch_tokens:u8",
        "expert_scales:u8", "scales_col_major"),
    "combine_async": (
        "expert_out", "dispatch_topk_ids", "dispatch_counts", "combine_partials", "dispatch_async_sync", "token_rows",
        "row_weight", "combine_stage", "status", "peer_bases", "dispatch_token_credit", "combine_row_flag",
        "relay_partials", "relay_flag"),
    "combine_async_rows": (
        "expert_out", "dispatch_topk_ids", "dispatch_counts", "combine_partials", "dispatch_async_sync", "status",
        "peer_bases", "dispatch_token_credit", "combine_row_flag", "relay_partials", "relay_flag"),
    "combine_relay": ("combine_partials", "relay_partials", "relay_flag", "relay_sums", "combine_chunk_flag",
                      "dispatch_topk_ids", "dispatch_counts", "dispatch_async_sync", "status", "timeout_ns"),
    "combine_wait": (
        "out", "out_partials", "dispatch_topk_ids", "dispatch_counts", "combine_partials", "dispatch_async_sync",
        "status", "mode", "timeout_ns", "aux", "own_rows", "combine_row_flag", "combine_wait_claims", "relay_slot",
        "combine_chunk_flag"),
    "routing_copy": ("dispatch_topk_ids", "dispatch_topk_weights", "dispatch_counts", "dispatch_ranks",
                     "dispatch_route_signal", "dispatch_async_sync", "kept_ids", "kept_weights", "kept_counts",
                     "kept_ranks", "restore"),
    "slot_values_async": ("row_values", "row_offsets", "row_src_rank", "row_src_token", "row_src_k", "slot_values",
                          "slot_signal", "dispatch_async_sync", "status", "peer_bases", "slot_across", "slot_stage",
                          "dispatch_counts"),
    "slot_values_wait": ("slot_out", "slot_values", "slot_signal", "dispatch_topk_ids", "dispatch_counts",
                         "dispatch_async_sync", "status", "timeout_ns", "slot_across"),
}


def build_args(kernel: str, regions: dict, values: dict) -> tuple:
    """Launch arguments of ``kernel``: each name from ``values`` if given there, else from
    ``regions`` (the runtime's kernel-ready region arrays)."""
    return tuple(values[n] if n in values else regions[n] for n in KERNEL_ARGS[kernel])


def argtypes(kernel: str, layout: BufferLayout) -> tuple:
    """The Numba signature the runtime launches ``kernel`` with (C-contiguous arrays)."""
    from numba import from_dtype, types

    absent = layout.absent()
    out = []
    for n in KERNEL_ARGS[kernel]:
        if n in SCALARS:
            out.append(types.int64)
            continue
        base, _, view = n.partition(":")
        if base in CALLER_ARRAYS:
            dtype, ndim = CALLER_ARRAYS[base]
        elif base in RUNTIME_ARRAYS:
            dtype, ndim = RUNTIME_ARRAYS[base]
        elif not layout.has(base):
            dtype, ndim = absent[base]
        else:
            r = layout.region(base)
            dtype, ndim = r.dtype, len(r.shape)
        if view:
            dtype = VIEWS[view]
        elif n in WORD_ARRAYS:
            dtype = token_word(layout.cfg.hidden)
        out.append(types.Array(from_dtype(np.dtype(dtype)), ndim, "C"))
    return tuple(out)


def region_view(array, name: str):
    """``array`` (a region) as kernel argument ``name``: itself, or for ``"region:u8"`` the same
    memory as bytes (last axis rescaled)."""
    _, _, view = name.partition(":")
    return array.view(VIEWS[view]) if view else array
