"""The runtimes behind one ``Buffer`` or ``HybridEPBuffer``: one :class:`~ep_runtime.core.runtime.EPRuntime`
per row shape and format, built on first use, and the layer's only device-to-host read.

DeepEP sizes a buffer in bytes and takes any token count, hidden size, expert count and top-k
per call; a runtime fixes them in its :class:`~ep_runtime.core.config.EPConfig`. A
:class:`RuntimeCache` keeps one runtime per :class:`RuntimeKey` (hidden, experts, token format,
layout, padding), its ``top_k`` the widest routing seen (narrower routings are padded with
masked slots) and its ``max_tokens_per_rank`` (``C``) the largest batch any rank passed to the
call that built it (one host gather, at that collective build), or more when asked.

Every decision that builds or rebuilds a runtime is taken from values equal on every rank
(the key, a routing's width, an agreed token count), so the ranks build together: building is
collective. A rank's batch larger than ``C`` cannot be agreed on without a collective, so it
raises before anything is sent (docs/deep_ep.md, "Memory").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ep_runtime.core.config import EPConfig
from ep_runtime.core.errors import EPError, EPInputError
from ep_runtime.core.layout import BufferLayout
from ep_runtime.integrations.torch import _Bridge

#: The layer opens its process's session with a symmetric heap of at least this many times the
#: first runtime's symmetric bytes (room for a second token format and the combine's weights).
HEAP_HEADROOM = 2


@dataclass(frozen=True)
class RuntimeKey:
    """What fixes a runtime besides its ``top_k`` and token capacity."""

    hidden: int
    n_experts: int
    token_dtype: str = "bfloat16"
    layout: str = "dense"
    pad_multiple: int = 1
    combine_dtype: str = "bfloat16"


@dataclass(eq=False)
class RuntimeEntry:
    """One runtime of a cache and what the layer keeps with it.

    Attributes
    ----------
    runtime, bridge : the runtime and its torch bridge.
    open : the routing whose dispatch is the runtime's current call, with its runtime handle
        (``(routing, rt_handle)``), until a combine or another dispatch; None when idle.
    """

    runtime: object
    bridge: _Bridge
    open: tuple | None = None

    @property
    def cfg(self) -> EPConfig:
        return self.runtime.cfg


class RuntimeCache:
    """The runtimes of one layer object over ``group`` (a torch ProcessGroup or an mpi4py
    communicator), in this process's session, opened at the first build.

    Parameters
    ----------
    group : the job's group the session is opened over (:func:`ep_runtime.shmem.session_for`).
    heap_floor : the fewest symmetric heap bytes to open the session with (``num_nvl_bytes``).
    min_tokens : the fewest tokens per rank a runtime holds (``C`` is at least this).
    owner : the caller's name, for messages (``"Buffer"``, ``"HybridEPBuffer"``).
    capacity_arg : the caller's argument that sets ``min_tokens``, for messages.
    session : an ep_runtime session already open in this process (e.g. a benchmark's), used
        instead of opening one; ``group`` may then be None (the session's ranks are the group).
    """

    def __init__(self, group, heap_floor: int, min_tokens: int, owner: str, capacity_arg: str, session=None):
        from ep_runtime.shmem.bootstrap import bootstrap_group

        self.group, self.session = group, session
        self.boot = bootstrap_group(group) if group is not None or session is None else session.bootstrap
        self.heap_floor, self.min_tokens, self.owner, self.capacity_arg = heap_floor, min_tokens, owner, capacity_arg
        if session is not None:
            self.rank, self.n_ranks = session.rank, session.n_ranks
            if self.boot is not None and (self.boot.rank, self.boot.size) != (self.rank, self.n_ranks):
                raise EPInputError(f"{owner}: session= is rank {self.rank} of {self.n_ranks}, but the group gives "
                                   f"rank {self.boot.rank} of {self.boot.size}; pass a session over the group's ranks.")
        else:
            self.rank, self.n_ranks = self.boot.rank, self.boot.size
        self.entries: dict[RuntimeKey, RuntimeEntry] = {}

    def _allgather(self, obj) -> list:
        """Every rank's ``obj`` (host): over the session once there is one, else the group."""
        return self.session.allgather_object(obj) if self.session is not None else self.boot.allgather_object(obj)

    def entry(self, key: RuntimeKey, top_k: int, tokens: int, tokens_agreed: bool = False) -> RuntimeEntry:
        """The runtime of ``key`` holding ``top_k`` slots and this rank's ``tokens``, built or
        rebuilt when it does not (collective then: ``key`` and ``top_k`` must be equal on every
        rank, and ``tokens`` too when ``tokens_agreed``). A rank whose ``tokens`` exceed the
        runtime's capacity, without agreement, raises :class:`EPInputError` before any call."""
        entry = self.entries.get(key)
        if entry is not None:
            cfg = entry.cfg
            if top_k <= cfg.top_k and tokens <= cfg.max_tokens_per_rank:
                return entry
            if top_k <= cfg.top_k and not tokens_agreed:
                raise EPInputError(
                    f"{self.owner}: this rank dispatches {tokens} tokens, but the buffer holds "
                    f"{cfg.max_tokens_per_rank} per rank, the largest batch of any rank at its first dispatch of "
                    f"hidden {key.hidden} and {key.n_experts} experts ({key.token_dtype}). Make the first dispatch "
                    f"the largest (e.g. a warm-up at the maximum batch), or pass {self.capacity_arg}="
                    f"{tokens} (or more) when building the {self.owner} on every rank. The other ranks' waits for "
                    f"this one will time out.")
            top_k, tokens = max(top_k, cfg.top_k), max(tokens, cfg.max_tokens_per_rank)
            self.close_entry(key)
        return self._build(key, top_k, tokens)

    def _build(self, key: RuntimeKey, top_k: int, tokens: int) -> RuntimeEntry:
        """Collective: every rank's ``tokens`` gathered, the largest (at least ``min_tokens``) the capacity."""
        from ep_runtime.core.runtime import EPRuntime

        tokens = max([self.min_tokens, 1] + list(self._allgather(int(tokens))))
        if top_k > key.n_experts:
            raise EPInputError(f"{self.owner}: a routing of {top_k} slots per token for {key.n_experts} experts; "
                               f"pass at most num_experts slots (ids distinct per token, -1 for a masked slot).")
        cfg = EPConfig(n_ranks=self.n_ranks, n_experts=key.n_experts, top_k=top_k, hidden=key.hidden,
                       max_tokens_per_rank=tokens, token_dtype=key.token_dtype, combine_dtype=key.combine_dtype,
                       pad_multiple=key.pad_multiple, layouts=(key.layout,))
        session = self.open_session(cfg)
        plan = None
        if key == weights_key(key.hidden, key.n_experts) and session.spans_nodes():
            plan = {"transport": "puts"}  # its combine returns each rank's partials (the hierarchical transport sums)
        try:
            runtime = EPRuntime(cfg, session, plan=plan)
        except EPError as exc:
            raise type(exc)(f"{self.owner}: building the runtime for {tokens} tokens per rank of hidden {key.hidden} "
                            f"failed in this process's session (symmetric heap {session.heap_bytes} bytes, opened by "
                            f"the first buffer of the process): {exc}. Give the first buffer more num_nvl_bytes, or "
                            f"make its first dispatch the largest.") from exc
        entry = self.entries[key] = RuntimeEntry(runtime, _Bridge(runtime))
        return entry

    def open_session(self, cfg: EPConfig):
        """This process's session over the group, opened (collective) at the first build with a
        heap of at least ``heap_floor`` and :data:`HEAP_HEADROOM` times ``cfg``'s symmetric bytes
        (under the plan of GPUs of one NVLink domain: the session, which gives the topology, is
        not open yet)."""
        if self.session is None:
            from ep_runtime.core.plan import Topology, choose_plan
            from ep_runtime.shmem import DEFAULT_SESSION_HEAP_BYTES, session_for

            layout = BufferLayout(cfg, choose_plan(cfg, Topology.nvlink_gpus(cfg.n_ranks), {}))
            heap = max(self.heap_floor, DEFAULT_SESSION_HEAP_BYTES, HEAP_HEADROOM * layout.symmetric_bytes)
            try:
                self.session = session_for(self.group, heap)
            except EPInputError as exc:
                if "exceeds" not in str(exc):
                    raise
                self.session = session_for(self.group, 0)  # opened earlier, smaller: the runtime may still fit
        return self.session

    def weights_entry(self, entry: RuntimeEntry) -> RuntimeEntry:
        """The float32 runtime that takes a combine's ``topk_weights`` home for ``entry``'s routings
        (:mod:`~ep_runtime.integrations.deep_ep.exchange`): ``entry``'s top-k and capacity, built at
        the first weighted combine (collective; the values are equal on every rank) with
        :func:`weights_key`."""
        cfg = entry.cfg
        key = weights_key(weights_width(cfg.top_k), cfg.n_experts)
        return self.entry(key, cfg.top_k, cfg.max_tokens_per_rank, tokens_agreed=True)

    def close_entry(self, key: RuntimeKey) -> None:
        """Close the runtime of ``key`` if there is one (collective)."""
        entry = self.entries.pop(key, None)
        if entry is not None:
            entry.runtime.close()

    def close(self) -> None:
        """Close every runtime (collective); the session stays open (one per process)."""
        for key in list(self.entries):
            self.close_entry(key)

    # -- the host ------------------------------------------------------------------------------
    @staticmethod
    def host_values(t: torch.Tensor) -> list:
        """``t`` (a 1-D integer tensor) as a host list: the layer's only read of the device from
        the host (on a GPU, a synchronization of the current stream). A dispatch that returns
        counts calls it once; one with ``num_worst_tokens``, a cached one, and a combine never."""
        return t.tolist()

    def gather_values(self, values: torch.Tensor) -> torch.Tensor:
        """Every rank's ``values`` (a 1-D int64 tensor of the same length everywhere), as a
        ``[R, n]`` host tensor in rank order. Collective; one :meth:`host_values` read: on an
        NCCL group the gather runs on the device first, on any other group (gloo, MPI) on the
        host after the read."""
        dist = torch.distributed
        boot_group = getattr(self.boot, "group", None)
        if (values.is_cuda and dist.is_available() and isinstance(boot_group, dist.ProcessGroup)
                and "nccl" in str(dist.get_backend(boot_group))):
            out = torch.empty(self.n_ranks * values.numel(), dtype=values.dtype, device=values.device)
            dist.all_gather_into_tensor(out, values.contiguous(), group=boot_group)
            return torch.tensor(self.host_values(out), dtype=torch.int64, device="cpu").view(self.n_ranks, -1)
        return torch.tensor(self._allgather(self.host_values(values)), dtype=torch.int64,
                            device="cpu").view(self.n_ranks, -1)


def weights_key(width: int, n_experts: int) -> RuntimeKey:
    """The key of a weights runtime: rows of ``width`` float32 values, partials in float32 (on
    PEs of several nodes its plan puts, so its combine can return each rank's partials)."""
    return RuntimeKey(width, n_experts, combine_dtype="float32")


def weights_width(top_k: int) -> int:
    """Columns of the weights runtime's rows: ``top_k`` float32 values padded to a multiple of 4
    (float32 partials move as pairs of floats, token rows as words of 4 bf16)."""
    return -(-top_k // 4) * 4
