"""`EPConfig`: the frozen, validated description of one expert-parallel layer.

Every rank must build the same config (the runtime checks it at construction). Invalid
values raise :class:`~ep_runtime.core.errors.EPConfigError` naming the field, the value, the rule
and a fix.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, fields

from ep_runtime.core.errors import EPConfigError

#: Token formats dispatch moves (:mod:`ep_runtime.core.formats`): bf16 travels as its 16-bit pattern;
#: the FP8 formats as E4M3 codes with a float32 ("fp8_e4m3") or power-of-two ("fp8_e4m3_ue8m0")
#: scale per 128 elements, NVFP4 ("nvfp4") as E2M1 codes with an E4M3 scale per 16 elements and
#: the tensor's float32 global scale; quantized inside dispatch_async or given pre-quantized.
TOKEN_DTYPES = ("bfloat16", "fp8_e4m3", "fp8_e4m3_ue8m0", "nvfp4")
#: Formats of combine partials (each rank's weighted sum for a token, on the wire and summed at
#: home): "bfloat16" rounds each partial to bf16; "float32" keeps the float32 sum (twice the
#: bytes), so only the output is rounded (docs/formats.md, "Combine precision").
COMBINE_DTYPES = ("bfloat16", "float32")
#: float32 partials move as 8-byte words of 2 floats, with token rows as 8-byte words of 4 bf16.
F32_PARTIALS_HIDDEN_MULTIPLE = 4
#: Where a combine applies the router weights (``EPConfig.combine_weights``): "expert", each
#: expert rank weights and sums its rows of a token and sends one partial home; "home" (the
#: batched layout only), each expert rank sends every (token, slot) row unweighted and the home
#: rank sums ``w[t, k] * row[t, k]`` with the weights given at the combine (DeepEP's
#: low-latency combine, which takes the weights there and nowhere else).
COMBINE_WEIGHTS = ("expert", "home")
from ep_runtime.kernels.protocol import MAX_RANKS, PLACEMENT_WORDS  # noqa: F401 (limits the kernels set)

#: Row indices of the expert batch are int32.
MAX_ROWS = 2**31 - 1
#: The layouts dispatch_wait can return (``EPConfig.layouts``): one row per (token, local
#: expert), the received rows as they landed with per-expert gather indices, the received
#: rows laid out densely in DeepEP's order (one per received (token, source rank)), or DeepEP's
#: low-latency batch (``[local experts, n_ranks * max_tokens_per_rank, hidden]``).
LAYOUTS = ("expanded", "compact", "dense", "batched")
#: The layouts a runtime serves by default, also spelled ``"both"``.
DEFAULT_LAYOUTS = ("expanded", "compact")
#: Default bound on a device-side wait: long enough for a slow peer's first-call compile to be
#: excluded (the runtime compiles before the first call), short enough to surface a hang.
DEFAULT_WAIT_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class EPConfig:
    """One expert-parallel layer: sizes, formats and limits.

    Parameters
    ----------
    n_ranks : int
        Ranks (PEs) in the expert-parallel group; 1 <= n_ranks <= 1024 (past 64, destination
        lists in every token format: ``plan.check_plan``).
    n_experts : int
        Global experts, a multiple of ``n_ranks``; rank r holds experts
        ``[r * n_local_experts, (r + 1) * n_local_experts)``. At most
        ``PLACEMENT_WORDS / (n_ranks + 1)`` local experts (2,048 experts on one rank, 2,730 on
        two, 4,032 on 64).
    top_k : int
        Experts per token, 1 <= top_k <= n_experts (ids unique within a token).
    hidden : int
        Elements per token row.
    max_tokens_per_rank : int
        Upper bound on the tokens any rank passes to one dispatch; sizes every buffer.
    token_dtype : str
        Format of token rows on the wire and in the expert batch: ``"bfloat16"`` (the bf16 bit
        patterns), ``"fp8_e4m3"`` (E4M3 codes with a float32 scale per 128 elements) or
        ``"fp8_e4m3_ue8m0"`` (E4M3 codes with a power-of-two scale byte per 128 elements) or
        ``"nvfp4"`` (E2M1 codes, an E4M3 scale per 16 elements and the tensor's float32 global
        scale; ``hidden`` a multiple of 64), quantized inside dispatch_async or given
        pre-quantized (:mod:`ep_runtime.core.formats`).
    combine_dtype : str
        Format of the per-rank partial sums sent back by combine: ``"bfloat16"`` (each partial
        rounded to bf16) or ``"float32"`` (unrounded, twice the bytes; ``hidden`` a multiple
        of 4). The combine output is bf16 either way.
    n_sms : int or None
        Thread blocks per kernel (persistent grid); ``None`` lets the runtime choose.
    wait_timeout_s : float
        Bound on every device-side wait, in seconds; ``0`` waits forever.
    pad_multiple : int
        Each expert's segment of the expert batch starts at a multiple of this (grouped
        GEMM tiles); padding rows are zero with source rank -1.
    max_recv_rows : int or None
        Capacity of the expert batch in rows; ``None`` = the worst case
        (:attr:`worst_case_recv_rows`). A smaller capacity saves memory; a call that needs more
        raises :class:`~ep_runtime.core.errors.EPCapacityError` with the count it needed.
    allow_negative_weights : bool
        Whether the debug-mode routing check accepts negative router weights (NaN and
        infinities are always rejected).
    layouts : str or tuple of str
        The layouts dispatch_wait serves: ``"expanded"``, ``"compact"``, ``"dense"``,
        ``"batched"``, or any tuple of them; the default is expanded and compact, also spelled
        ``"both"``. The execution plan gives the expanded and compact layouts their fastest
        measured paths (:mod:`ep_runtime.core.plan`); ``"dense"`` (DeepEP's received rows,
        written by ``dispatch_dense`` after any receiver) and ``"batched"`` (DeepEP's
        low-latency rows, ``dispatch_batched``'s; not NVFP4) add to whichever the plan picks for
        the others, and a runtime that serves only them is planned as a compact one. A runtime
        allocates the expert batch only when it serves the expanded layout, and the dense and
        batched rows only when it serves those. Stored as a tuple in ``LAYOUTS`` order.
    """

    n_ranks: int
    n_experts: int
    top_k: int
    hidden: int
    max_tokens_per_rank: int
    token_dtype: str = "bfloat16"
    combine_dtype: str = "bfloat16"
    n_sms: int | None = None
    wait_timeout_s: float = DEFAULT_WAIT_TIMEOUT_S
    pad_multiple: int = 1
    max_recv_rows: int | None = None
    allow_negative_weights: bool = True
    layouts: tuple = DEFAULT_LAYOUTS
    combine_weights: str = "expert"

    def __post_init__(self):
        object.__setattr__(self, "layouts", _layouts(self.layouts))
        for f in ("n_ranks", "n_experts", "top_k", "hidden", "max_tokens_per_rank", "pad_multiple"):
            _require_int(f, getattr(self, f))
        for f in ("n_sms", "max_recv_rows"):
            if getattr(self, f) is not None:
                _require_int(f, getattr(self, f))
        _check(self.n_ranks >= 1, "n_ranks", self.n_ranks, "must be >= 1", "use the size of the expert-parallel group")
        _check(self.n_ranks <= MAX_RANKS, "n_ranks", self.n_ranks,
               f"must be <= {MAX_RANKS} (the receive kernels keep a word per source rank in shared memory, "
               f"and every region is sized for every rank's tokens: docs/wide_ep.md)",
               f"split the group into expert-parallel groups of at most {MAX_RANKS} ranks")
        _check(self.n_experts >= 1, "n_experts", self.n_experts, "must be >= 1", "use the model's expert count")
        if self.n_experts % self.n_ranks:
            lo = self.n_experts // self.n_ranks * self.n_ranks
            hi = lo + self.n_ranks
            fix = f"use {lo} or {hi}" if lo > 0 else f"use {hi}"
            raise EPConfigError(
                f"EPConfig.n_experts={self.n_experts}: n_experts must be a multiple of n_ranks "
                f"({self.n_ranks}) so every rank holds the same number of experts; {fix}")
        L = self.n_local_experts
        if (self.n_ranks + 1) * L > PLACEMENT_WORDS:
            most = PLACEMENT_WORDS // (self.n_ranks + 1) * self.n_ranks
            raise EPConfigError(
                f"EPConfig.n_experts={self.n_experts}: with n_ranks={self.n_ranks}, (n_ranks + 1) * n_experts / "
                f"n_ranks = {(self.n_ranks + 1) * L} exceeds {PLACEMENT_WORDS} (dispatch_wait places rows from a "
                f"table of each source's first row per local expert in shared memory); use at most {most} experts "
                f"on {self.n_ranks} ranks, or more ranks")
        _check(1 <= self.top_k <= self.n_experts, "top_k", self.top_k,
               f"must be in [1, n_experts={self.n_experts}]", "use the router's k")
        _check(self.hidden >= 1, "hidden", self.hidden, "must be >= 1", "use the model's hidden size")
        _check(self.max_tokens_per_rank >= 1, "max_tokens_per_rank", self.max_tokens_per_rank,
               "must be >= 1", "use the largest batch one rank passes to dispatch")
        from ep_runtime.core.formats import token_dtype_names

        names = token_dtype_names()
        _check(isinstance(self.token_dtype, str) and self.token_dtype in names, "token_dtype", self.token_dtype,
               f"must be one of the strings {names} (formats.register_format adds one)", "use 'bfloat16'")
        try:
            self.token_format.validate_hidden(self.hidden)
        except EPConfigError as e:
            raise EPConfigError(f"EPConfig.hidden={self.hidden} with token_dtype={self.token_dtype!r}: {e} "
                                f"(token_dtype='bfloat16' takes any hidden)") from None
        _check(isinstance(self.combine_dtype, str) and self.combine_dtype in COMBINE_DTYPES, "combine_dtype",
               self.combine_dtype, f"must be one of the strings {COMBINE_DTYPES}",
               "use 'bfloat16' (or 'float32' for unrounded partials)")
        if self.combine_dtype == "float32" and self.hidden % F32_PARTIALS_HIDDEN_MULTIPLE:
            m = F32_PARTIALS_HIDDEN_MULTIPLE
            up = -(-self.hidden // m) * m
            raise EPConfigError(
                f"EPConfig.hidden={self.hidden} with combine_dtype='float32': hidden must be a multiple of {m} "
                f"(float32 partials move as 8-byte words of 2 floats, and token rows as 8-byte words of 4 bf16); "
                f"pad hidden to {up}, or use combine_dtype='bfloat16' (any hidden)")
        if "batched" in self.layouts and self.token_format.has_global_scale:
            raise EPConfigError(f"EPConfig.layouts={self.layouts!r} with token_dtype={self.token_dtype!r}: the batched "
                                f"layout (DeepEP's low-latency rows) carries bf16 or FP8 rows; use token_dtype "
                                f"'bfloat16', 'fp8_e4m3' or 'fp8_e4m3_ue8m0', or drop 'batched' from layouts.")
        _check_combine_weights(self)
        if self.n_sms is not None:
            _check(self.n_sms >= 1, "n_sms", self.n_sms, "must be >= 1 or None", "use None to let the runtime choose")
        _check(isinstance(self.wait_timeout_s, numbers.Real) and not isinstance(self.wait_timeout_s, bool)
               and math.isfinite(self.wait_timeout_s) and self.wait_timeout_s >= 0,
               "wait_timeout_s", self.wait_timeout_s, "must be a finite number of seconds >= 0",
               f"use {DEFAULT_WAIT_TIMEOUT_S} (or 0 to wait forever)")
        _check(self.pad_multiple >= 1, "pad_multiple", self.pad_multiple, "must be >= 1",
               "use 1 for no padding, or the grouped GEMM's row tile (e.g. 64 or 128)")
        _check(isinstance(self.allow_negative_weights, bool), "allow_negative_weights", self.allow_negative_weights,
               "must be a bool", "pass True or False")
        if self.max_recv_rows is not None:
            _check(self.max_recv_rows >= 1, "max_recv_rows", self.max_recv_rows, "must be >= 1 or None",
                   "use None for the worst case")
        _check(self.recv_rows_capacity <= MAX_ROWS, "max_recv_rows" if self.max_recv_rows else "max_tokens_per_rank",
               self.max_recv_rows or self.max_tokens_per_rank,
               f"gives {self.recv_rows_capacity} expert-batch rows, more than int32 row indices allow",
               "set max_recv_rows to a smaller capacity")

    # -- derived sizes -----------------------------------------------------------------------
    @property
    def n_local_experts(self) -> int:
        """Experts per rank (``L``)."""
        return self.n_experts // self.n_ranks

    @property
    def token_format(self):
        """The :class:`~ep_runtime.core.formats.TokenFormat` of ``token_dtype``."""
        from ep_runtime.core.formats import get_format

        return get_format("bf16" if self.token_dtype == "bfloat16" else self.token_dtype)

    @property
    def token_bytes(self) -> int:
        """Bytes of one token on the wire: ``hidden`` bf16 values, or a quantized message's codes
        and scales (NVFP4: and its global scale; its padding to whole words,
        :meth:`~ep_runtime.core.formats.TokenFormat.message_bytes`, is never written or sent)."""
        fmt = self.token_format
        return fmt.payload_bytes(self.hidden) + fmt.extras_bytes(self.hidden)

    @property
    def slot_bytes(self) -> int:
        """Bytes of one token's slot in the receive buffer, what a copy of a whole slot moves (the
        hierarchical transport's packed chunks and its proxies' forwards): ``token_bytes`` in
        bf16, an FP8 message with its padding."""
        fmt = self.token_format
        return fmt.message_bytes(self.hidden) if fmt.quantized else self.token_bytes

    @property
    def partial_bytes(self) -> int:
        """Bytes of one combine partial (one token's row from one rank): ``2 * hidden`` with
        bf16 partials, ``4 * hidden`` with float32 partials."""
        return self.hidden * (4 if self.combine_dtype == "float32" else 2)

    @property
    def routing_bytes(self) -> int:
        """Bytes of one token's routing entry (``top_k`` int32 ids + ``top_k`` float32 weights)."""
        return self.top_k * 8

    @property
    def bytes_per_message(self) -> int:
        """Bytes dispatch moves per (token, destination rank): the row plus its routing entry."""
        return self.token_bytes + self.routing_bytes

    @property
    def worst_case_recv_tokens(self) -> int:
        """Most tokens one rank can receive in one dispatch (every token of every rank)."""
        return self.n_ranks * self.max_tokens_per_rank

    @property
    def worst_case_recv_rows(self) -> int:
        """Most expert-batch rows one rank can need: every received token hits
        ``min(top_k, L)`` local experts, plus the padding of every segment."""
        return (self.worst_case_recv_tokens * min(self.top_k, self.n_local_experts)
                + self.n_local_experts * (self.pad_multiple - 1))

    @property
    def recv_rows_capacity(self) -> int:
        """Rows of the expert batch (``max_recv_rows`` or the worst case)."""
        return self.max_recv_rows if self.max_recv_rows is not None else self.worst_case_recv_rows

    def rank_of_expert(self, expert: int) -> int:
        """The rank holding global expert ``expert``."""
        return expert // self.n_local_experts

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _layouts(value) -> tuple:
    """``value`` (a layout name, ``"both"`` or an iterable of names) as a tuple in LAYOUTS order."""
    names = DEFAULT_LAYOUTS if value == "both" else (value,) if isinstance(value, str) else tuple(value)
    if not names or any(n not in LAYOUTS for n in names):
        raise EPConfigError(f"EPConfig.layouts={value!r}: expected 'expanded', 'compact', 'dense', 'batched', 'both' "
                            f"(expanded and compact) or a tuple of {LAYOUTS}; use 'compact' for a runtime that serves "
                            f"only the compact layout, 'dense' for DeepEP's received rows, 'batched' for its "
                            f"low-latency rows.")
    return tuple(n for n in LAYOUTS if n in names)


def _check_combine_weights(cfg: EPConfig) -> None:
    """``combine_weights``: one of :data:`COMBINE_WEIGHTS`; ``"home"`` only on a runtime serving
    just the batched layout (its slots are the rows sent home) with bf16 partials (the rows go
    home as the experts wrote them)."""
    _check(isinstance(cfg.combine_weights, str) and cfg.combine_weights in COMBINE_WEIGHTS, "combine_weights",
           cfg.combine_weights, f"must be one of the strings {COMBINE_WEIGHTS}", "use 'expert' (the default)")
    if cfg.combine_weights != "home":
        return
    if cfg.layouts != ("batched",):
        raise EPConfigError(f"EPConfig.combine_weights='home' with layouts={cfg.layouts!r}: weights applied at home "
                            f"need one row home per (token, slot), which only the batched layout's combine sends; "
                            f"use layouts=('batched',), or combine_weights='expert' for the other layouts.")
    if cfg.combine_dtype != "bfloat16":
        raise EPConfigError(f"EPConfig.combine_weights='home' with combine_dtype={cfg.combine_dtype!r}: the rows go "
                            f"home unweighted as the experts wrote them (bf16) and are summed in float32 there; use "
                            f"combine_dtype='bfloat16'.")


def _require_int(field: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise EPConfigError(
            f"EPConfig.{field}={value!r}: must be an int, got {type(value).__name__}; pass int({field})")


def _check(ok: bool, field: str, value, rule: str, fix: str) -> None:
    if not ok:
        raise EPConfigError(f"EPConfig.{field}={value!r}: {field} {rule}; {fix}")
