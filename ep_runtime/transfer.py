"""How dispatch_async moves token rows to the peers: stores from its warps, or the copy engine.

Two transfers, one protocol (docs/protocol.md, "Copy-engine transfer"):

- ``stores``: dispatch_async's warps store (or put) each row into every rank that holds one of
  its experts. Any token format, any batch size; the row's group is the device's call parity.
- ``copy_engine``: a copy-engine copy of the caller's whole ``tokens`` array into every peer's
  slot (one contiguous copy per peer, on a side stream beside dispatch_async), while the
  kernel's warps store each row to this rank only; then ``dispatch_signal`` signals. Measured
  on 2 x H200: a copy-engine copy into a peer reaches 389 GB/s, stores from SMs 352-360 GB/s
  (docs/throughput.md), and the copy holds no SM. It sends rows a peer does not need (a token
  with no expert there: 0.35 % of them for top-8 of 256 on 2 ranks, 10 % on 4, 34 % on 8,
  ``C(E - L, K) / C(E, K)`` under uniform routing). The row group is then the host's call
  parity (a copy's address is fixed when it is enqueued or captured), and a cumulative credit per peer
  (``dispatch_token_credit``) keeps a copy from writing rows a peer still reads.

``EP_RUNTIME_TOKEN_TRANSFER`` (read when a runtime is built): ``auto`` (default: the stores,
:func:`choose_copy_engine` says why), ``stores`` or ``copy_engine``.
"""

from __future__ import annotations

import os
from typing import NamedTuple

from .config import EPConfig
from .errors import EPConfigError


class SendPaths(NamedTuple):
    """The send path a runtime's kernels are built for (compile-time constants of
    ``make_dispatch_kernels`` and ``make_combine_kernels``, so a build holds only the code its
    runtime runs: docs/throughput.md, "v20").

    ``stores``: routing, token rows and partials stored into the peers' heaps through the
    NVLink mappings (else NVSHMEM puts; ``EP_RUNTIME_PEER_STORES``). ``copy_engine``: the
    token rows by copy-engine copies (:func:`choose_copy_engine`). ``land``: dispatch_async
    serves dispatch_land (``EP_RUNTIME_DISPATCH_LAND``). ``place``: dispatch_async's routing
    blocks place the received rows during the transfer and dispatch_wait only waits for the
    rows (``EP_RUNTIME_DISPATCH_PLACE``; with ``stores`` only, not with ``copy_engine`` or
    ``land``). ``route_first``: dispatch_async sends and signals the routing rows first and ranks
    nothing; dispatch_wait (one block, started early) places the rows from them while the token
    rows fly (``EP_RUNTIME_DISPATCH_ROUTE_FIRST``; with ``stores`` only, not with ``copy_engine``,
    ``land`` or ``place``). ``route_chunks``: a route-first build for large batches (v33;
    :func:`ep_runtime.dispatch_overlap.route_chunks`): from ``FIRST_SPLIT_TOKENS`` tokens the
    token blocks send the routing rows, and from ``CHUNK_FROM_TOKENS`` received tokens
    dispatch_wait's blocks rank a chunk each; a decode-size build leaves that code out (it cost
    0.5-1 us at T <= 128 on 2 x H100)."""

    stores: bool = True
    copy_engine: bool = False
    land: bool = False
    place: bool = False
    route_first: bool = False
    route_chunks: bool = False


#: Environment variable choosing the token transfer: ``auto``, ``stores`` or ``copy_engine``.
TOKEN_TRANSFER_ENV = "EP_RUNTIME_TOKEN_TRANSFER"


def choose_copy_engine(cfg: EPConfig, peer_mapped: bool) -> bool:
    """Whether token rows go to peers by the copy engine, per ``EP_RUNTIME_TOKEN_TRANSFER``.

    ``peer_mapped``: every PE's heap is mapped here (NVLink; the copies target peer views).
    ``copy_engine`` where it cannot work raises :class:`EPConfigError` saying why. ``auto``
    takes the stores: measured on 2 x H200 at T=4096 (docs/throughput.md, "v15"), the copy
    engine's dispatch is slower today (compact 202.8 us against 193.8: the copies land 183.5
    us after dispatch_async starts, for 151 us of transfer at the ceiling), so no shape is
    known where it wins yet."""
    choice = os.environ.get(TOKEN_TRANSFER_ENV, "auto").strip().lower()
    if choice not in ("auto", "stores", "copy_engine"):
        raise EPConfigError(f"{TOKEN_TRANSFER_ENV}={choice!r}; expected auto, stores or copy_engine (unset means "
                            f"auto).")
    if choice != "copy_engine" or cfg.n_ranks < 2:
        return False
    if cfg.token_format.quantized:
        raise EPConfigError(f"{TOKEN_TRANSFER_ENV}=copy_engine, but token_dtype={cfg.token_dtype!r} is encoded "
                            f"inside dispatch_async (the copy engine moves the caller's bf16 rows as they are); unset "
                            f"it or set it to stores.")
    if not peer_mapped:
        raise EPConfigError(f"{TOKEN_TRANSFER_ENV}=copy_engine, but some PE's heap is not mapped here (no NVLink "
                            f"path), or EP_RUNTIME_PEER_STORES=0; unset it or set it to stores.")
    return True


def peer_token_slots(session, sym, layout, rank: int) -> list:
    """``slots[d]``: a uint8 view of rank ``d``'s ``dispatch_tokens[rank]`` (this rank's rows
    on peer d), from the peer view of the symmetric allocation ``sym``; None for ``d == rank``
    (its rows are stored by dispatch_async's warps)."""
    region = layout.region("dispatch_tokens")
    R, T, H = region.shape
    row_bytes = H * region.dtype.itemsize
    start = region.offset + rank * T * row_bytes
    return [None if d == rank else session.peer_view(sym, d)[start:start + T * row_bytes] for d in range(R)]
