"""What a kernel build is compiled for: the compile-time part of an execution plan.

:mod:`ep_runtime.core.plan` chooses a :class:`~ep_runtime.core.plan.Plan` per runtime; the kernels see
only the fields below (:class:`DispatchVariant`, :class:`CombineVariant`), each a closure
constant of the factory that builds them, so a build holds only the code its plan runs and the
kernel cache keys builds apart by these values. The enums are the plan's: exclusive choices, so
an impossible combination cannot be written down.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from ep_runtime.kernels.codecs import CodecSpec


class Transport(str, Enum):
    """How rows, routing and partials reach the peers."""

    #: stores from the SMs into the peers' heaps through their NVLink mappings
    STORES = "stores"
    #: NVSHMEM puts (any peer NVSHMEM reaches; completion by quiet and put_signal)
    PUTS = "puts"
    #: several nodes: within this PE's node stores through the mappings (``node_stores``) or
    #: puts, and across nodes a put per chunk of tokens and node to the node's proxy, the PE
    #: with this PE's local index there, which forwards the rows to its node's peers
    #: (``ep_runtime/kernels/relay.py``; nodes of ``node_size`` consecutive PEs)
    HIERARCHICAL = "hierarchical"


class Receiver(str, Enum):
    """Where and when the received rows are placed (their expert-batch rows described)."""

    #: dispatch_wait places every row after every source's signal
    WAIT = "wait"
    #: dispatch_land, started early, places rows while they fly and copies each part as it lands
    LAND = "land"
    #: the routing rows go first; dispatch_wait's few early blocks place from them while the
    #: token rows fly, every block ranking every received token
    ROUTE_FIRST = "route_first"
    #: route first for large batches: the token blocks send the routing rows, and the placing
    #: blocks each rank a chunk of the received tokens
    ROUTE_FIRST_CHUNKED = "route_first_chunked"

    @property
    def routes_first(self) -> bool:
        return self in (Receiver.ROUTE_FIRST, Receiver.ROUTE_FIRST_CHUNKED)


@dataclass(frozen=True)
class DispatchVariant:
    """The compile-time constants of the dispatch kernels.

    ``threads``: threads per block (a power of 2; a warp's width on the simulator at most).
    ``codec``: the token format's :class:`~ep_runtime.kernels.codecs.CodecSpec`. ``transport``,
    ``receiver``, ``pdl``: the plan's. ``share_from_tokens``: received tokens from which a
    route-first dispatch_wait's placing blocks share the rows' descriptions;
    ``chunk_from_tokens``: ... from which a chunked build's blocks each rank a chunk;
    ``split_from_tokens``: tokens of a call from which a chunked build's token blocks send the
    routing rows (no routing block). ``node_size``: PEs per node of the hierarchical transport
    (0 otherwise); ``node_stores``: its writes within a node are stores (else puts).
    ``layout``: the receive kernels' layout (:mod:`ep_runtime.kernels.layouts`): ``"expanded"``
    when the plan serves it (its copies skipped on a compact call), else ``"compact"``.
    ``dest_slots``: how a token's destination ranks are kept (:mod:`ep_runtime.kernels.destinations`):
    0, a 64-bit mask (64 ranks at most); else an ascending list of at most this many ranks.
    ``rank_slots``: the per-source words the receive kernels keep in shared memory (at least the
    rank count; 64 for every runtime of 64 ranks or fewer).
    """

    threads: int
    codec: CodecSpec
    transport: Transport
    receiver: Receiver
    pdl: bool
    share_from_tokens: int
    chunk_from_tokens: int
    split_from_tokens: int
    node_size: int = 0
    node_stores: bool = False
    layout: str = "expanded"
    dest_slots: int = 0
    rank_slots: int = 64


@dataclass(frozen=True)
class CombineVariant:
    """The compile-time constants of the combine kernels: ``threads`` per block, the token word
    (``word``: NumPy dtype name, ``"uint64"`` / ``"uint32"`` / ``"uint16"``), float32 partials
    (``f32_partials``), the ``transport``, ``pdl`` and the hierarchical transport's
    ``node_size`` (PEs per node; 0 otherwise) and ``node_stores`` (its writes within a node
    are stores) and ``dest_slots`` (a token's destination ranks: 0, a 64-bit mask; else an
    ascending list of at most this many, as :class:`DispatchVariant`'s). ``partial_slots``: how
    the home's ``combine_partials`` / ``combine_row_flag`` are indexed: 0, by source rank
    (``[G, R, T, H]``, ``[R, T, parts]``); else by destination slot, ``[G, S, T, H]`` and ``[S,
    T, parts]`` with ``S = partial_slots``: rank d's partial of token t in slot j, the position
    of d among t's ascending destination ranks (ep_runtime/kernels/destinations.py,
    ``rank_position``; destination lists on the stores and puts transports), or with destination
    lists on the hierarchical transport by sender, ``S = N + X``: the PE of the home's node with
    local index i in row i, the proxy of the x-th other node in row ``N + x``
    (``nodes.sender_index``)."""

    threads: int
    word: str
    f32_partials: bool
    transport: Transport
    pdl: bool
    node_size: int = 0
    node_stores: bool = False
    home_weights: bool = False
    dest_slots: int = 0
    partial_slots: int = 0
