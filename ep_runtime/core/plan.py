"""The execution plan: how one runtime moves rows, chosen once, typed, and read by everything.

A :class:`Plan` is frozen and made of enums and numbers, so an impossible combination cannot be
written down and every choice has one place: the kernels are built from it (their compile-time
:class:`~ep_runtime.kernels.variant.DispatchVariant` / ``CombineVariant``), the buffer layout
allocates only the regions it uses, the runtime launches what it says, and the bench, prebuild,
the compile gate, the demo and the error messages print it.

:func:`choose_plan` picks it from the :class:`~ep_runtime.core.config.EPConfig` (its sizes, formats
and the layouts it serves), the session's :class:`Topology` and explicit overrides, recording a
one-line reason for each rule that fired. The thresholds below are the rules' numbers; the
measurements behind them are in docs/plans.md, each with the command that re-measures it.

Overrides are plan fields passed when the runtime is built (``EPRuntime(..., plan={...})``) or,
for experiments, the string in ``EP_RUNTIME_PLAN`` (``"receiver=land,receiver_sms=64"``); an
unknown key, a bad value or an impossible combination raises :class:`EPConfigError` naming the
rule. Every rank must agree on the plan (:func:`agree`).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from enum import Enum

from ep_runtime.core.config import EPConfig
from ep_runtime.core.errors import EPConfigError
from ep_runtime.kernels.protocol import MASK_RANKS, MAX_COPY_PLACERS
from ep_runtime.kernels.variant import CombineVariant, DispatchVariant, Receiver, Transport

__all__ = ["Plan", "Topology", "Transport", "Receiver", "ExpandedCopy", "choose_plan", "parse_overrides", "agree",
           "PLAN_ENV", "OVERRIDABLE"]

#: The one environment variable that changes a plan: overrides for experiments, ``key=value``
#: pairs separated by commas (the same keys as ``EPRuntime(..., plan={...})``).
PLAN_ENV = "EP_RUNTIME_PLAN"


class ExpandedCopy(str, Enum):
    """How the expanded layout's rows (one per (token, local expert)) are written."""

    #: ``dispatch_copy`` after the receive kernel: token-major, each received row read once
    DISPATCH_COPY = "dispatch_copy"
    #: a route-first dispatch_wait on the whole grid: its first block places, every block copies
    IN_WAIT = "in_wait"
    #: dispatch_land copies each part of each row as it lands
    IN_LAND = "in_land"
    #: the runtime does not serve the expanded layout
    NONE = "none"


# -- rules' thresholds (docs/plans.md has the measurements) --------------------------------------

#: Threads per block on a GPU: 16 warps, each copying or reducing its own row part.
GPU_THREADS = 512
#: Threads per block on the simulator (each a Python thread; a simulated block is one warp).
SIM_THREADS = 8
#: Blocks per kernel on the simulator when EPConfig.n_sms is None (several, so the block
#: scheduling and the last-block tickets are exercised).
SIM_BLOCKS = 2
#: Batches up to this many tokens per rank route first (every token format).
ROUTE_FIRST_MAX_TOKENS = 128
#: FP8 runtimes serving the expanded layout route first only while ranks x tokens per rank (the
#: most tokens a rank receives) is at most this: past it the placing blocks delay dispatch_copy.
ROUTE_FIRST_FP8_EXPANDED_MAX_RECEIVED = 256
#: FP8 batches from this many tokens per rank route first, chunked.
ROUTE_FIRST_FP8_MIN_TOKENS = 512
#: bf16 batches from this many tokens per rank land (expanded layout served) or route first,
#: chunked (compact layout only).
LARGE_BATCH_TOKENS = 1024
#: SMs dispatch_async leaves to dispatch_land's early blocks.
LAND_SMS = 48
#: Placing blocks of a route-first dispatch_wait (unchunked / chunked), each on an SM
#: dispatch_async leaves; a copying launch (``expanded_copy=in_wait``) places in as many.
ROUTE_FIRST_BLOCKS = 2
ROUTE_FIRST_CHUNK_BLOCKS = 4
#: SMs combine_async leaves to combine_wait's early blocks (compact / expanded combine input).
COMBINE_WAIT_SMS = 24
COMBINE_WAIT_SMS_EXPANDED = 8
#: The SMs of the GPUs the early receivers' SM figures above were measured on (H100, H200): on
#: a grid of another size (MPS shares, MIG slices) they take the same share of it
#: (:func:`fitted_sms`).
TUNED_SMS = 132
#: Received tokens from which a route-first dispatch_wait's placing blocks share the rows'
#: descriptions (below, the first block describes them all).
SHARE_FROM_TOKENS = 128
#: Received tokens from which a chunked build's placing blocks each rank a chunk.
CHUNK_FROM_TOKENS = 1024
#: Tokens of a call from which a chunked build's token blocks send the routing rows (no routing
#: block, so the routing is not left to one block's share of the busy links).
SPLIT_FROM_TOKENS = 512

LAYOUTS = ("expanded", "compact", "dense", "batched")


@dataclass(frozen=True)
class Topology:
    """What the plan needs to know of the machine, the same on every rank.

    ``n_ranks``; ``peers_mapped``: every PE's symmetric heap is mapped into this process (NVLink
    peers: the kernels can store into them); ``sm_count``: the GPU's SMs (the whole grid);
    ``pdl``: programmatic dependent launch is available (compute capability 9.0 or later and the
    session's fast launcher, which sets its launch attribute); ``simulated``: Numba's CUDA
    simulator runs the kernels; ``node_of``: every PE's node (``Session.node_of``; empty: one
    node), logical nodes of a testing topology included; ``node_peers_mapped``: every PE maps
    the heaps of its own node's PEs (``Session.node_peers_mapped``: stores within a node).
    """

    n_ranks: int
    peers_mapped: bool
    sm_count: int
    pdl: bool
    simulated: bool = False
    node_of: tuple = ()
    node_peers_mapped: bool = False

    @property
    def n_nodes(self) -> int:
        """Nodes the PEs are on (1 when ``node_of`` is empty)."""
        return len(set(self.node_of)) or 1

    @property
    def node_size(self) -> int:
        """PEs per node when the nodes are blocks of equal size of consecutive PEs, numbered in
        order (what the hierarchical transport needs), else 0."""
        R, n = self.n_ranks, self.n_nodes
        if not self.node_of or R % n:
            return 0
        size = R // n
        return size if tuple(self.node_of) == tuple(p // size for p in range(R)) else 0

    @classmethod
    def of(cls, session) -> "Topology":
        """The topology of an open session (collective: it probes the peer mappings and gathers
        the PEs' nodes)."""
        return cls(session.n_ranks, session.peers_mapped(), session.sm_count(), session.pdl_capable(),
                   session.backend == "sim", session.node_of(), session.node_peers_mapped())

    @classmethod
    def nvlink_gpus(cls, n_ranks: int, sm_count: int = 132) -> "Topology":
        """GPUs of one NVLink domain with PDL (an H100 or H200 host): for printing the plans a
        job there gets, without the GPUs."""
        return cls(n_ranks, True, sm_count, True, False)


@dataclass(frozen=True)
class Plan:
    """How a runtime moves rows. Every field is a choice of :func:`choose_plan` (or an override).

    ``layouts``: the dispatch layouts served (EPConfig.layouts). ``transport``: how rows,
    routing and partials reach peers. ``receiver``: where and when received rows are placed.
    ``expanded_copy``: how the expanded layout's rows are written. ``pdl``: kernels built and
    launched with programmatic dependent launch. ``threads``: per block. ``grid``: blocks of a
    whole-grid launch. ``receiver_sms``: SMs dispatch_async leaves to the receive kernel's early
    blocks (0: none). ``placing_blocks``: a route-first dispatch_wait's blocks in the compact
    layout, and the blocks of its copying launch that place (0 for the other receivers).
    ``combine_wait_sms`` / ``combine_wait_sms_expanded``: SMs combine_async leaves to
    combine_wait (compact / expanded combine input).
    ``share_from_tokens``, ``chunk_from_tokens``, ``split_from_tokens``: the route-first
    kernels' thresholds (:class:`~ep_runtime.kernels.variant.DispatchVariant`). ``node_size``:
    PEs per node of the hierarchical transport (0 with the others; from the topology, not an
    override). ``node_stores``: the hierarchical transport stores into the peers of a node
    through their mappings (else puts within a node too; False with the other transports).
    ``dest_list``: the kernels keep a token's destination ranks as an ascending list, not a
    64-bit mask (needed past 64 ranks; ep_runtime/kernels/destinations.py).
    ``reasons``: one line per rule, not part of the plan's identity.
    """

    layouts: tuple
    transport: Transport
    receiver: Receiver
    expanded_copy: ExpandedCopy
    pdl: bool
    threads: int
    grid: int
    receiver_sms: int
    placing_blocks: int
    combine_wait_sms: int
    combine_wait_sms_expanded: int
    share_from_tokens: int = SHARE_FROM_TOKENS
    chunk_from_tokens: int = CHUNK_FROM_TOKENS
    split_from_tokens: int = SPLIT_FROM_TOKENS
    node_size: int = 0
    node_stores: bool = False
    dest_list: bool = False
    reasons: tuple = field(default=(), compare=False)

    # -- grids ----------------------------------------------------------------------------------
    @property
    def dispatch_async_grid(self) -> int:
        """dispatch_async's blocks: the grid less the SMs left to the receiver's early blocks (at
        least half the grid for landing, whose blocks also copy)."""
        if not self.receiver_sms:
            return self.grid
        if self.receiver is Receiver.LAND:
            return max(self.grid - self.receiver_sms, (self.grid + 1) // 2)
        return max(self.grid - self.receiver_sms, 1)

    @property
    def dispatch_wait_grid(self) -> int:
        """dispatch_wait's blocks in a launch that only places (the compact layout, or before
        dispatch_copy): the placing blocks of a route-first receiver, else the grid."""
        return self.placing_blocks if self.receiver.routes_first else self.grid

    def combine_async_grid(self, layout: str) -> int:
        """The sending combine kernel's blocks for ``layout``'s input: the grid less the SMs left
        to combine_wait's early blocks (at least half the grid)."""
        sms = self.combine_wait_sms_expanded if layout == "expanded" else self.combine_wait_sms
        return max(self.grid - sms, (self.grid + 1) // 2) if sms else self.grid

    def serves(self, layout: str) -> bool:
        return layout in self.layouts

    @property
    def receiver_layout(self) -> str:
        """The layout the receive kernels are built with: ``"expanded"`` when served (its copies
        skipped on another layout's call), else ``"compact"`` when served, else ``"dense"`` or
        ``"batched"`` (the compact layout's placement and copies: their rows are
        ``dispatch_dense``'s and ``dispatch_batched``'s)."""
        return next(name for name in LAYOUTS if self.serves(name))

    # -- what the kernels are built for -----------------------------------------------------------
    def dispatch_variant(self, cfg: EPConfig) -> DispatchVariant:
        """The dispatch kernels' compile-time constants for a runtime of ``cfg``."""
        return DispatchVariant(self.threads, cfg.token_format.codec, self.transport, self.receiver, self.pdl,
                               self.share_from_tokens, self.chunk_from_tokens, self.split_from_tokens, self.node_size,
                               self.node_stores, self.receiver_layout, self.dest_slots(cfg),
                               max(cfg.n_ranks, MASK_RANKS))

    def combine_variant(self, cfg: EPConfig) -> CombineVariant:
        """The combine kernels' compile-time constants for a runtime of ``cfg``."""
        from ep_runtime.core.layout import token_word

        return CombineVariant(self.threads, token_word(cfg.hidden).name, cfg.combine_dtype == "float32",
                              self.transport, self.pdl, self.node_size, self.node_stores,
                              home_weights=cfg.combine_weights == "home", dest_slots=self.dest_slots(cfg),
                              partial_slots=self.partial_slots(cfg))

    def dest_slots(self, cfg: EPConfig) -> int:
        """The kernels' destination list length (``DispatchVariant.dest_slots``): 0 for the mask,
        else ``min(top_k, n_ranks)``, the most ranks a token goes to."""
        return min(cfg.top_k, cfg.n_ranks) if self.dest_list else 0

    def partial_slots(self, cfg: EPConfig) -> int:
        """The rows of a home's partials other than a row a rank (``CombineVariant.partial_slots``):
        with destination lists on the stores and puts transports, ``dest_slots`` (``combine_partials
        [G, min(K, R), T, H]``, a slot a destination rank); with destination lists on the
        hierarchical transport, its senders, ``N + X`` (a PE of the home's node by its local index
        in ``combine_partials [G, N, T, H]``, the proxy of the x-th other node by ``N + x`` in
        ``combine_chunk_flag``, its chunk of sums one run of rows of ``combine_sums``); else 0, a
        row a source rank (the mask builds; the weights at home, already by top-k slot)."""
        if not self.dest_slots(cfg) or cfg.combine_weights == "home":
            return 0
        if self.transport is Transport.HIERARCHICAL:
            return self.node_size + cfg.n_ranks // self.node_size - 1
        return self.dest_slots(cfg)

    # -- records --------------------------------------------------------------------------------
    def as_dict(self) -> dict:
        """The plan's fields as plain values (enums by value), without the reasons."""
        out = {}
        for f in dataclasses.fields(self):
            if f.name == "reasons":
                continue
            v = getattr(self, f.name)
            out[f.name] = v.value if isinstance(v, Enum) else list(v) if isinstance(v, tuple) else v
        return out

    def summary(self) -> str:
        """One line: ``receiver/transport, copy, grids``."""
        copy = "" if self.expanded_copy is ExpandedCopy.NONE else f", expanded copy {self.expanded_copy.value}"
        return (f"{self.receiver.value} receiver, {self.transport.value}{copy}, pdl {'on' if self.pdl else 'off'}, "
                f"dispatch_async {self.dispatch_async_grid}/{self.grid} blocks")

    def describe(self) -> str:
        """The plan as a table (under 100 columns): each field, its value and why."""
        why = dict(_split_reason(r) for r in self.reasons)
        transport = self.transport.value + (f" ({self.node_size} PEs a node, "
                                            f"{'stores' if self.node_stores else 'puts'} within)"
                                            if self.node_size else "")
        rows = [("layouts", "+".join(self.layouts)), ("transport", transport),
                ("receiver", self.receiver.value), ("expanded_copy", self.expanded_copy.value),
                ("pdl", "on" if self.pdl else "off"), ("threads", self.threads), ("grid", self.grid),
                ("receiver_sms", self.receiver_sms), ("placing_blocks", self.placing_blocks),
                ("combine_wait_sms", self.combine_wait_sms),
                ("combine_wait_sms_expanded", self.combine_wait_sms_expanded),
                ("share_from_tokens", self.share_from_tokens), ("chunk_from_tokens", self.chunk_from_tokens),
                ("split_from_tokens", self.split_from_tokens)]
        if self.node_size:
            rows.insert(2, ("node_stores", "on" if self.node_stores else "off"))
        if self.dest_list:
            rows.append(("dest_list", "on"))
        lines = [f"{name:<26} {str(value):<20} {why.get(name, '')}".rstrip() for name, value in rows]
        grids = (f"grids: dispatch_async {self.dispatch_async_grid}, dispatch_wait {self.dispatch_wait_grid}, "
                 f"combine_async {self.combine_async_grid('compact')} (compact) / "
                 f"{self.combine_async_grid('expanded')} (expanded)")
        trade = [f"trade: {why['trade']}"] if "trade" in why else []
        return "\n".join(lines + [grids] + trade)


def _split_reason(reason: str) -> tuple[str, str]:
    name, _, text = reason.partition(": ")
    return name.partition("=")[0], text


# -- overrides --------------------------------------------------------------------------------------

#: Plan fields an override may set, and how a string value is read.
OVERRIDABLE = {
    "transport": Transport, "receiver": Receiver, "expanded_copy": ExpandedCopy, "pdl": bool,
    "receiver_sms": int, "placing_blocks": int, "combine_wait_sms": int, "combine_wait_sms_expanded": int,
    "share_from_tokens": int, "chunk_from_tokens": int, "split_from_tokens": int, "node_stores": bool,
    "dest_list": bool,
}


def parse_overrides(text: str, where: str = PLAN_ENV) -> dict:
    """``"key=value,key=value"`` -> ``{key: value}`` with typed values. Raises EPConfigError
    naming ``where`` for an unknown key or a bad value."""
    out = {}
    for item in filter(None, (p.strip() for p in (text or "").split(","))):
        key, eq, value = (s.strip() for s in item.partition("="))
        if not eq:
            raise EPConfigError(f"{where}: {item!r} is not key=value; e.g. {PLAN_ENV}='receiver=wait,pdl=0'.")
        out[key] = value
    return normalize_overrides(out, where)


def normalize_overrides(overrides: dict, where: str = "plan") -> dict:
    """``overrides`` with every key checked against :data:`OVERRIDABLE` and every value
    converted to its field's type (enum members, bools, ints). Raises EPConfigError naming
    ``where``, the key, the value and what is accepted."""
    out = {}
    for key, value in (overrides or {}).items():
        kind = OVERRIDABLE.get(key)
        if kind is None:
            raise EPConfigError(f"{where}: unknown plan field {key!r}; overridable fields: "
                                f"{', '.join(OVERRIDABLE)}.")
        out[key] = _convert(kind, key, value, where)
    return out


def _convert(kind, key, value, where):
    if isinstance(kind, type) and issubclass(kind, Enum):
        try:
            return kind(value.value if isinstance(value, Enum) else str(value).strip().lower())
        except ValueError:
            raise EPConfigError(f"{where}: {key}={value!r}; expected one of "
                                f"{', '.join(m.value for m in kind)}.") from None
    if kind is bool:
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in ("1", "true", "on", "yes"):
            return True
        if text in ("0", "false", "off", "no"):
            return False
        raise EPConfigError(f"{where}: {key}={value!r}; expected 1 or 0 (on or off).")
    try:
        number = int(value)
        if isinstance(value, bool) or number < 0 or str(number) != str(value).strip():
            raise ValueError
    except ValueError:
        raise EPConfigError(f"{where}: {key}={value!r}; expected an integer >= 0.") from None
    return number


def overrides_from_env() -> dict:
    """The overrides in ``EP_RUNTIME_PLAN`` (empty when unset)."""
    return parse_overrides(os.environ.get(PLAN_ENV, ""), PLAN_ENV)


def merged_overrides(explicit: dict | None) -> dict:
    """The caller's overrides with ``EP_RUNTIME_PLAN``'s: a field both set to different values
    raises EPConfigError (an experiment should not be silently ignored, nor win silently)."""
    explicit = normalize_overrides(explicit or {}, "EPRuntime(plan=...)")
    env = overrides_from_env()
    clash = {k: (explicit[k], env[k]) for k in explicit.keys() & env.keys() if explicit[k] != env[k]}
    if clash:
        raise EPConfigError(f"{PLAN_ENV} and EPRuntime(plan=...) set the same plan fields to different values "
                            f"(field: (argument, environment)): {clash}; drop one of the two.")
    return {**env, **explicit}


# -- the rules --------------------------------------------------------------------------------------


def choose_plan(cfg: EPConfig, topology: Topology, overrides: dict | None = None) -> Plan:
    """The plan for a runtime of ``cfg`` on ``topology``: each field by its rule (below) unless
    ``overrides`` sets it (validated: unknown fields, bad values and impossible combinations
    raise EPConfigError naming the rule). Pure: no environment is read here (see
    :func:`merged_overrides`)."""
    o = normalize_overrides(overrides or {})
    reasons = []

    def pick(name, value, reason):
        if name in o:
            reasons.append(f"{name}: set by override")
            return o[name]
        reasons.append(f"{name}: {reason}")
        return value

    layouts = tuple(cfg.layouts)
    fp8 = cfg.token_format.quantized
    transport = pick("transport", *((Transport.STORES, "every PE's heap is mapped here (NVLink): stores from the SMs")
                                    if topology.peers_mapped else
                                    (Transport.PUTS, "the weights at home (EPConfig.combine_weights='home', DeepEP's "
                                                     "low-latency mode) send each (token, slot) row straight home, "
                                                     "which the hierarchical transport's proxies do not carry: "
                                                     "NVSHMEM puts to every peer")
                                    if cfg.combine_weights == "home" else
                                    (Transport.HIERARCHICAL, f"the PEs are on {topology.n_nodes} nodes of "
                                                             f"{topology.node_size}: within a node see node_stores; "
                                                             f"across, a put per chunk of tokens and node, through "
                                                             f"the node's proxy")
                                    if topology.n_nodes > 1 and topology.node_size else
                                    (Transport.PUTS, f"the PEs are on {topology.n_nodes} nodes, not blocks of "
                                                     f"consecutive PEs of one size: NVSHMEM puts to every peer")
                                    if topology.n_nodes > 1 else
                                    (Transport.PUTS, "some PE's heap is not mapped here: NVSHMEM puts")))
    hierarchical = transport is Transport.HIERARCHICAL
    node_size = topology.node_size if hierarchical else 0
    node_stores = pick("node_stores", hierarchical and topology.node_peers_mapped,
                       "every PE of a node maps its node's heaps (NVLink): stores within a node"
                       if hierarchical and topology.node_peers_mapped else
                       "some PE of a node does not map its node's heaps: puts within a node" if hierarchical
                       else "not the hierarchical transport")
    pdl = pick("pdl", topology.pdl, "compute capability 9.0+ and the fast launcher" if topology.pdl else
               "the simulator" if topology.simulated else "no PDL here (compute capability < 9.0 or no fast launcher)")
    threads = SIM_THREADS if topology.simulated else GPU_THREADS
    grid = cfg.n_sms or (SIM_BLOCKS if topology.simulated else topology.sm_count)
    whole = cfg.n_sms is None and not topology.simulated
    reasons.append(f"grid: {'EPConfig.n_sms' if cfg.n_sms else 'the simulator' if topology.simulated else 'every SM'}")

    receiver = pick("receiver", *_receiver_rule(cfg, layouts, transport, pdl, whole))
    expanded_copy = pick("expanded_copy", *_copy_rule(layouts, receiver, fp8))
    early = pdl and whole and grid >= 2  # a receiver started early needs SMs left free and PDL
    placing = {Receiver.ROUTE_FIRST: ROUTE_FIRST_BLOCKS, Receiver.ROUTE_FIRST_CHUNKED: ROUTE_FIRST_CHUNK_BLOCKS}
    placing_blocks = pick("placing_blocks", placing.get(receiver, 0),
                          "route first: each placing block on an SM dispatch_async leaves" if receiver.routes_first
                          else "not route first")
    receiver_sms = pick("receiver_sms", (fitted_sms(LAND_SMS, grid) if receiver is Receiver.LAND
                                         else min(placing_blocks, grid // 2)) if early else 0,
                        "dispatch_land's early blocks" if early and receiver is Receiver.LAND else
                        "the placing blocks" if early and receiver.routes_first else
                        "no early receiver" if early else "no SMs left free (EPConfig.n_sms, the simulator or no PDL)")
    combine_sms = pick("combine_wait_sms", fitted_sms(COMBINE_WAIT_SMS, grid) if early else 0,
                       "combine_wait's early blocks" if early else "no SMs left free")
    combine_sms_x = pick("combine_wait_sms_expanded", fitted_sms(COMBINE_WAIT_SMS_EXPANDED, grid) if early else 0,
                         "combine_wait's early blocks (the sender reads every expert row)" if early
                         else "no SMs left free")
    dest_list = pick("dest_list", cfg.n_ranks > MASK_RANKS,
                     f"{cfg.n_ranks} > {MASK_RANKS} ranks: destination lists" if cfg.n_ranks > MASK_RANKS else
                     f"{cfg.n_ranks} <= {MASK_RANKS} ranks: a 64-bit destination mask")
    thresholds = {k: o[k] for k in ("share_from_tokens", "chunk_from_tokens", "split_from_tokens") if k in o}
    reasons += [f"{k}: set by override" for k in thresholds]
    if receiver is Receiver.LAND and "compact" in layouts and "expanded" in layouts and "receiver" not in o:
        reasons.append("trade: serving both layouts, the compact one lands too; a runtime serving only the "
                       "compact layout routes first, chunked (docs/plans.md)")
    plan = Plan(layouts, transport, receiver, expanded_copy, pdl, threads, grid, receiver_sms, placing_blocks,
                combine_sms, combine_sms_x, node_size=node_size, node_stores=node_stores, dest_list=dest_list,
                reasons=tuple(reasons),
                **thresholds)
    check_plan(plan, cfg, topology)
    return plan


def fitted_sms(sms: int, grid: int) -> int:
    """``sms``, a figure measured on ``TUNED_SMS`` SMs, as the same share of a grid of ``grid``
    blocks (``grid`` >= 2): at least 1, at most half the grid (the sending kernel keeps the
    rest), and ``sms`` itself on a grid of ``TUNED_SMS``."""
    return max(1, min(sms, round(sms * grid / TUNED_SMS), grid // 2))


def _receiver_rule(cfg, layouts, transport, pdl, whole):
    T, fp8 = cfg.max_tokens_per_rank, cfg.token_format.quantized
    if cfg.n_ranks < 2:
        return Receiver.WAIT, "one rank: no row in flight to overlap"
    if not whole:
        return Receiver.WAIT, "EPConfig.n_sms or the simulator: no SMs left for an early receiver"
    if not pdl:
        return Receiver.WAIT, "no PDL: no receiver can start beside dispatch_async"
    if transport is Transport.HIERARCHICAL:
        return Receiver.WAIT, "hierarchical: the proxies forward whole calls, then signal on the sources' behalf"
    stores = transport is Transport.STORES
    received = cfg.n_ranks * T
    fp8_copied = fp8 and "expanded" in layouts and received > ROUTE_FIRST_FP8_EXPANDED_MAX_RECEIVED
    if T <= ROUTE_FIRST_MAX_TOKENS and stores and not fp8_copied:
        return Receiver.ROUTE_FIRST, f"{'FP8' if fp8 else 'bf16'}, {T} <= {ROUTE_FIRST_MAX_TOKENS} tokens per rank"
    if T <= ROUTE_FIRST_MAX_TOKENS and stores:
        return Receiver.WAIT, (f"FP8, the expanded layout served, {cfg.n_ranks} x {T} = {received} > "
                               f"{ROUTE_FIRST_FP8_EXPANDED_MAX_RECEIVED} tokens received: placing first delays "
                               f"dispatch_copy")
    if fp8:
        if T >= ROUTE_FIRST_FP8_MIN_TOKENS and stores:
            return Receiver.ROUTE_FIRST_CHUNKED, f"FP8, {T} >= {ROUTE_FIRST_FP8_MIN_TOKENS} tokens per rank"
        return Receiver.WAIT, (f"FP8, {ROUTE_FIRST_MAX_TOKENS} < {T} < {ROUTE_FIRST_FP8_MIN_TOKENS} tokens per rank"
                               if stores else "FP8 over puts")
    if T >= LARGE_BATCH_TOKENS:
        if "expanded" in layouts or not stores:
            return Receiver.LAND, f"bf16, {T} >= {LARGE_BATCH_TOKENS} tokens per rank, " + (
                "the expanded layout served: rows copied as they land" if stores else "over puts")
        return Receiver.ROUTE_FIRST_CHUNKED, f"bf16, {T} >= {LARGE_BATCH_TOKENS} tokens per rank, compact layout only"
    return Receiver.WAIT, (f"bf16, {ROUTE_FIRST_MAX_TOKENS} < {T} < {LARGE_BATCH_TOKENS} tokens per rank" if stores
                           else "bf16 over puts")


def _copy_rule(layouts, receiver, fp8):
    if "expanded" not in layouts:
        return ExpandedCopy.NONE, "the expanded layout is not served"
    if receiver is Receiver.LAND and not fp8:
        return ExpandedCopy.IN_LAND, "landing copies bf16 rows as they land"
    if receiver is Receiver.ROUTE_FIRST and not fp8:
        return ExpandedCopy.IN_WAIT, "route first, bf16: one launch places and copies"
    return ExpandedCopy.DISPATCH_COPY, ("FP8: dispatch_copy lays the scales out" if fp8 else
                                        "a copy after the placement reads each row once")


def check_plan(plan: Plan, cfg: EPConfig, topology: Topology) -> None:
    """Raise EPConfigError, naming the rule, unless ``plan`` can run a runtime of ``cfg`` on
    ``topology``. The one place the combinations are checked."""
    fp8 = cfg.token_format.quantized
    rules = [
        (plan.layouts == tuple(cfg.layouts), "layouts",
         f"the plan serves {plan.layouts} but EPConfig.layouts is {tuple(cfg.layouts)}",
         "build the plan from the config"),
        (plan.transport is not Transport.STORES or topology.peers_mapped, "transport",
         "transport=stores needs every PE's heap mapped here (NVLink peers)", "use transport=puts"),
        (plan.transport is not Transport.HIERARCHICAL or (topology.n_nodes > 1 and topology.node_size and
                                                          plan.node_size == topology.node_size), "transport",
         f"transport=hierarchical needs PEs on 2 or more nodes of equal size, each a block of consecutive PEs; "
         f"these PEs are on nodes {list(topology.node_of) or [0] * topology.n_ranks}", "use transport=puts"),
        (cfg.combine_weights != "home" or plan.transport is not Transport.HIERARCHICAL, "transport",
         "EPConfig.combine_weights='home' sends each (token, slot) row straight to its home, which the hierarchical "
         "transport's proxies do not carry (they sum a node's partials of a token)",
         "use transport=puts (it reaches every PE), or combine_weights='expert'"),
        (not plan.node_stores or (plan.transport is Transport.HIERARCHICAL and topology.node_peers_mapped),
         "node_stores", f"node_stores=1 needs the hierarchical transport (this plan's: {plan.transport.value}) and "
         f"every PE mapping its node's heaps (NVLink within a node): "
         f"{'yes' if topology.node_peers_mapped else 'no'}", "use node_stores=0"),
        (plan.transport is not Transport.HIERARCHICAL or plan.receiver is Receiver.WAIT, "receiver",
         f"receiver={plan.receiver.value} with transport=hierarchical: the proxies forward whole calls, which only "
         f"the wait receiver takes", "use receiver=wait"),
        (not plan.receiver.routes_first or plan.transport is Transport.STORES, "receiver",
         f"receiver={plan.receiver.value} stores the routing through the peers' mappings: it needs transport=stores",
         "use receiver=wait or receiver=land"),
        (not plan.pdl or topology.pdl, "pdl",
         "pdl=1 needs compute capability 9.0+ and the session's fast launcher", "use pdl=0"),
        ((plan.expanded_copy is ExpandedCopy.NONE) == ("expanded" not in plan.layouts), "expanded_copy",
         f"expanded_copy={plan.expanded_copy.value} with layouts {'+'.join(plan.layouts)}: it is 'none' exactly "
         "when the expanded layout is not served", "leave expanded_copy to the rule"),
        (plan.expanded_copy is not ExpandedCopy.IN_LAND or (plan.receiver is Receiver.LAND and not fp8),
         "expanded_copy", "expanded_copy=in_land needs receiver=land and bf16 tokens",
         "use expanded_copy=dispatch_copy"),
        (plan.expanded_copy is not ExpandedCopy.IN_WAIT or (plan.receiver.routes_first and not fp8),
         "expanded_copy", "expanded_copy=in_wait needs a route-first receiver and bf16 tokens "
         "(FP8 scales are laid out by dispatch_copy)", "use expanded_copy=dispatch_copy"),
        (not plan.receiver.routes_first or plan.placing_blocks >= 1, "placing_blocks",
         f"placing_blocks={plan.placing_blocks}: a route-first receiver places in at least one block",
         f"use {ROUTE_FIRST_BLOCKS}"),
        (plan.expanded_copy is not ExpandedCopy.IN_WAIT or plan.placing_blocks <= MAX_COPY_PLACERS,
         "placing_blocks", f"placing_blocks={plan.placing_blocks} with expanded_copy=in_wait: a copying "
         f"dispatch_wait places in at most {MAX_COPY_PLACERS} blocks", f"use {MAX_COPY_PLACERS} or fewer"),
        (plan.receiver.routes_first or plan.placing_blocks == 0, "placing_blocks",
         f"placing_blocks={plan.placing_blocks} with receiver={plan.receiver.value}: only route first places in "
         "a few blocks", "leave it 0"),
        (plan.receiver_sms < plan.grid, "receiver_sms", f"receiver_sms={plan.receiver_sms} leaves dispatch_async "
         f"no block of grid={plan.grid}", "use fewer"),
        (max(plan.combine_wait_sms, plan.combine_wait_sms_expanded) < plan.grid, "combine_wait_sms",
         f"combine_wait_sms={plan.combine_wait_sms} / _expanded={plan.combine_wait_sms_expanded} leave "
         f"combine_async no block of grid={plan.grid}", "use fewer"),
        (plan.dest_list or cfg.n_ranks <= MASK_RANKS, "dest_list",
         f"dest_list=0 with {cfg.n_ranks} ranks: a 64-bit destination mask holds {MASK_RANKS} ranks at most",
         "leave dest_list to the rule"),
        (min(plan.share_from_tokens, plan.chunk_from_tokens, plan.split_from_tokens) >= 1, "thresholds",
         "share_from_tokens, chunk_from_tokens and split_from_tokens must be >= 1", "use the defaults"),
    ]
    for ok, rule, what, fix in rules:
        if not ok:
            raise EPConfigError(f"plan rule '{rule}': {what}; {fix}.")


def agree(plan: Plan, session) -> None:
    """Collective: raise EPConfigError on every rank unless every rank chose the same plan; the
    error shows this rank's plan and the first that differs."""
    mine = plan.as_dict()
    everyone = session.allgather_object((mine, plan.describe()))
    for rank, (theirs, text) in enumerate(everyone):
        if theirs != mine:
            raise EPConfigError(
                f"rank {session.rank}: the execution plan differs from rank {rank}'s (the same config, topology and "
                f"overrides give the same plan: check {PLAN_ENV} and EPRuntime(plan=...) on every rank).\n"
                f"rank {session.rank}:\n{plan.describe()}\nrank {rank}:\n{text}")
