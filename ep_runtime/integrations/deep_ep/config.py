"""DeepEP's :class:`Config` (its performance-tuning record) and the layer's answers to DeepEP's
configuration calls (``Buffer.get_dispatch_config`` / ``get_combine_config``, the buffer size
hints).

The layer takes a ``Config`` wherever DeepEP does and checks it as DeepEP does, but its grids
come from the runtime's execution plan (:mod:`ep_runtime.core.plan`), not from the config's SM
and chunk counts. The size hints keep their role (a byte count to pass to ``Buffer``): the
layer opens its symmetric heap at least that large (docs/deep_ep.md, "Memory").
"""

from __future__ import annotations

from dataclasses import dataclass

from ep_runtime.core.errors import EPInputError

#: GPUs that share one NVLink domain in DeepEP's intranode mode; a group of more ranks is
#: internode (RDMA between nodes), which the layer does not do.
NVL_PEERS = 8
#: Bytes a DeepEP chunk slot holds besides the token row: top-k ids and weights of up to 128
#: slots (8 + 4 bytes each) and up to 128 float32 scales, as its hints assume.
SLOT_EXTRA_BYTES = 128 * 8 + 128 * 4 + 128 * 4
#: Bytes the hints round up to.
HINT_ALIGN = 128
#: The field defaults of DeepEP's ``Config`` (its Python binding's keyword defaults).
DEFAULT_NVL_SEND, DEFAULT_NVL_RECV, DEFAULT_RDMA_SEND, DEFAULT_RDMA_RECV = 6, 256, 6, 256


@dataclass(init=False)
class Config:
    """DeepEP's tuning record: ``Config(num_sms=20, num_max_nvl_chunked_send_tokens=6,
    num_max_nvl_chunked_recv_tokens=256, num_max_rdma_chunked_send_tokens=6,
    num_max_rdma_chunked_recv_tokens=256)``, positional or by keyword.

    Checked as DeepEP checks it (``num_sms >= 0``; each send chunk positive and smaller than its
    receive ring; the RDMA receive ring rounded up to a multiple of its send chunk and at least
    twice it), raising :class:`~ep_runtime.core.errors.EPInputError` naming the field. The layer
    uses none of the counts to run (its execution plan sizes the grids); ``num_sms // 2`` gives
    the width of the handle's channel matrices.
    """

    num_sms: int
    num_max_nvl_chunked_send_tokens: int
    num_max_nvl_chunked_recv_tokens: int
    num_max_rdma_chunked_send_tokens: int
    num_max_rdma_chunked_recv_tokens: int

    def __init__(self, num_sms: int = 20, num_max_nvl_chunked_send_tokens: int = DEFAULT_NVL_SEND,
                 num_max_nvl_chunked_recv_tokens: int = DEFAULT_NVL_RECV,
                 num_max_rdma_chunked_send_tokens: int = DEFAULT_RDMA_SEND,
                 num_max_rdma_chunked_recv_tokens: int = DEFAULT_RDMA_RECV):
        values = dict(num_sms=num_sms, num_max_nvl_chunked_send_tokens=num_max_nvl_chunked_send_tokens,
                      num_max_nvl_chunked_recv_tokens=num_max_nvl_chunked_recv_tokens,
                      num_max_rdma_chunked_send_tokens=num_max_rdma_chunked_send_tokens,
                      num_max_rdma_chunked_recv_tokens=num_max_rdma_chunked_recv_tokens)
        for name, v in values.items():
            if isinstance(v, bool) or not isinstance(v, int):
                raise EPInputError(f"Config: {name}={v!r} must be an int.")
        if num_sms < 0:
            raise EPInputError(f"Config: num_sms={num_sms} must be >= 0.")
        for kind in ("nvl", "rdma"):
            send, recv = values[f"num_max_{kind}_chunked_send_tokens"], values[f"num_max_{kind}_chunked_recv_tokens"]
            if send <= 0 or recv <= 0:
                raise EPInputError(f"Config: num_max_{kind}_chunked_send_tokens={send} and "
                                   f"num_max_{kind}_chunked_recv_tokens={recv} must both be > 0.")
        rdma_send = num_max_rdma_chunked_send_tokens
        values["num_max_rdma_chunked_recv_tokens"] = -(-num_max_rdma_chunked_recv_tokens // rdma_send) * rdma_send
        if num_max_nvl_chunked_send_tokens >= num_max_nvl_chunked_recv_tokens:
            raise EPInputError(f"Config: num_max_nvl_chunked_send_tokens={num_max_nvl_chunked_send_tokens} must be "
                               f"smaller than num_max_nvl_chunked_recv_tokens={num_max_nvl_chunked_recv_tokens} (a "
                               f"chunk must fit its receive ring).")
        if rdma_send > values["num_max_rdma_chunked_recv_tokens"] // 2:
            raise EPInputError(f"Config: num_max_rdma_chunked_send_tokens={rdma_send} must be at most half of "
                               f"num_max_rdma_chunked_recv_tokens={values['num_max_rdma_chunked_recv_tokens']} (after "
                               f"rounding it up to a multiple of the send chunk).")
        self.__dict__.update(values)

    @property
    def num_channels(self) -> int:
        """DeepEP's channels: two SMs each (the width of the handle's channel matrices)."""
        return self.num_sms // 2

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Bytes for DeepEP's NVLink buffer of this config: a ring of
        ``num_max_nvl_chunked_recv_tokens`` slots per channel and NVLink peer, each slot a token
        row of ``hidden_bytes`` and its routing and scales (:data:`SLOT_EXTRA_BYTES`), plus four
        counters a channel and peer; rounded up to 128 bytes. ``Buffer(num_nvl_bytes=...)``
        opens the layer's heap at least that large."""
        _check_hint_args("get_nvl_buffer_size_hint", hidden_bytes, num_ranks)
        peers = min(num_ranks, NVL_PEERS)
        slots = self.num_channels * peers * self.num_max_nvl_chunked_recv_tokens
        counters = self.num_channels * peers * 4 * 4
        return _round_up(counters + slots * (int(hidden_bytes) + SLOT_EXTRA_BYTES), HINT_ALIGN)

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Bytes for DeepEP's RDMA buffer: 0 for a group within one NVLink domain (at most 8
        ranks, DeepEP's intranode mode, which needs none); for a larger group the bytes of
        double-buffered rings per channel and node (what DeepEP's internode mode would take),
        which ``Buffer`` refuses: the layer runs within one node."""
        _check_hint_args("get_rdma_buffer_size_hint", hidden_bytes, num_ranks)
        if num_ranks <= NVL_PEERS:
            return 0
        nodes = -(-num_ranks // NVL_PEERS)
        slots = self.num_channels * nodes * self.num_max_rdma_chunked_recv_tokens
        return _round_up(2 * slots * (int(hidden_bytes) + SLOT_EXTRA_BYTES), HINT_ALIGN)


def default_config(num_sms: int, num_ranks: int, call: str) -> Config:
    """The config ``Buffer.get_dispatch_config`` / ``get_combine_config`` return: ``num_sms`` and
    DeepEP's field defaults, for any group of 1 to 64 ranks (the runtime's limit; the layer has
    no per-size tuning table, its execution plan chooses per call)."""
    if isinstance(num_ranks, bool) or not isinstance(num_ranks, int) or not 1 <= num_ranks <= 64:
        raise EPInputError(f"{call}: num_ranks={num_ranks!r} must be an int in [1, 64] (the group's size).")
    return Config(num_sms)


def _check_hint_args(call: str, hidden_bytes, num_ranks) -> None:
    if isinstance(hidden_bytes, bool) or not isinstance(hidden_bytes, int) or hidden_bytes <= 0:
        raise EPInputError(f"Config.{call}: hidden_bytes={hidden_bytes!r} must be a positive int (a token row's "
                           f"bytes, e.g. hidden * 2 for bf16).")
    if isinstance(num_ranks, bool) or not isinstance(num_ranks, int) or num_ranks < 1:
        raise EPInputError(f"Config.{call}: num_ranks={num_ranks!r} must be a positive int (the group's size).")


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m
