"""Token codecs: how a token travels and lands, one device module per token format family.

A :class:`~ep_runtime.core.formats.TokenFormat` names its codec with a :class:`CodecSpec` (the
module and its compile-time parameters); the kernels are built from it and only the codec's own
device code looks at the format. A codec module has two factories:

``make_sender(spec, threads, tp, destinations, lands)`` -> namespace (dispatch_async)
    ``send_rows(tokens, token_scales, token_global_scale_u8, prequantized, ids_base, rows,
    rows_u8, stage, stage_u8, row_flag, peer_bases, T, K, L, R, me, n, token_blocks, mbuf, held,
    ids_l, lo, hi)``: every thread of a token block sends its share of this PE's ``T`` tokens,
    each once to every PE of ``destinations(ids_at, K, L, R, me, skip, ids_l)`` (uint64 bits, or
    where the transport was built with destination lists, ``tp.LISTED``, a list: ``tp.no_dests``
    tells an empty one, ep_runtime/kernels/destinations.py), through the transport ``tp``
    (:mod:`ep_runtime.kernels.transport`), into row ``[me, t]`` of ``rows`` (``dispatch_tokens``,
    its uint8 view ``rows_u8``); ``stage`` / ``stage_u8`` are a
    message stage (``dispatch_send_stage``) where the codec stages and puts; ``token_scales``
    (uint8 [Tc, scale bytes]: pre-quantized input's scales, ``prequantized`` nonzero) and
    ``token_global_scale_u8`` (uint8 [4]: a format with a global scale's float32) are empty
    where the format has none. Returns whether every row went as plain stores (the launch's
    ticket then fences; else it quiets). ``lands``: the receiver lands rows part by part
    (``row_flag[me, t, p]`` set after each part; a codec that cannot flag parts leaves it to the
    receiver's signal). ``pack_row(tokens, token_scales, token_global_scale_u8, prequantized, t,
    row, lane, mbuf, peer_bases, held, lo, hi)``: every lane of a warp writes token ``t`` as it
    travels into the local row ``row`` (the hierarchical transport's chunks).
    Constants: ``MBUF_WORDS`` and ``HELD_WORDS`` (int64 and uint32 shared words a block's encoder
    needs; 1 when none).

``make_receiver(spec, threads)`` -> namespace (the expanded layout's copy)
    ``lay_out(msg_u8, P, XB, expert_scales_u8, r, C, col_major, lane)``: every lane of a warp lays
    the message's ``XB`` bytes of extras (its scales: from byte ``P``, the payload's end) out for
    expert row ``r`` of ``C`` in ``expert_scales_u8``, row- or column-major; ``zero(XB,
    expert_scales_u8, r, C, col_major, lane)``: a padding row's; ``lay_out_batched(msg_u8, P, S,
    batched_scales_u8, e, pos, M, form, lane)``: the message's S block scales for slot ``pos`` of
    local expert ``e`` in the batched layout (column-major per expert; ``form`` a
    ``BATCHED_SCALES_*`` of :mod:`ep_runtime.kernels.protocol`; NVFP4 has none: the batched layout
    refuses it). The payload words themselves
    (the message's first ``expert_x.shape[1]`` words) are copied by the layout, whatever the codec.

Module constants (:func:`traits`): ``RAW`` (a message is the caller's token words: a receiver may
copy it as it lands, and read this PE's own rows from the caller's tokens) and ``ENCODES`` (the
sender computes each message: fewer routing blocks leave the encoder more SMs).

A codec of a format with a global scale (``TokenFormat.has_global_scale``) also has
``make_global_scale(threads)`` -> namespace of the kernels ``tensor_amax`` and
``global_scale_of_amax`` (:data:`ep_runtime.core.builds.GLOBAL_SCALE_KERNELS`), which compute it on
the stream when the caller passes none.

Codecs: :mod:`.words` (bf16 rows as they are), :mod:`.fp8` (E4M3 codes with a float32 or a
UE8M0 scale per 128 elements, encoded in dispatch_async or taken pre-quantized) and :mod:`.nvfp4`
(E2M1 codes, an E4M3 scale per 16 elements and the tensor's float32 global scale).
docs/formats.md, "Adding a format", says what a new one takes.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class CodecSpec:
    """A token format's codec: its device ``module`` (a dotted name with ``make_sender`` and
    ``make_receiver``) and the compile-time ``params`` (a tuple of ``(name, value)`` pairs, e.g.
    ``(("scale_bytes", 1),)``) it is built with. Hashable: kernel builds are cached by it."""

    module: str
    params: tuple = ()

    def param(self, name: str, default=None):
        """The value of parameter ``name`` (``default`` when absent)."""
        return dict(self.params).get(name, default)


#: The codec of rows that travel as the caller's words (bf16 tokens): :mod:`.words`.
WORDS = CodecSpec("ep_runtime.kernels.codecs.words")


def _module(spec: CodecSpec):
    return importlib.import_module(spec.module)


def traits(spec: CodecSpec):
    """``spec``'s codec module, for its constants ``RAW`` and ``ENCODES`` (no kernel built)."""
    return _module(spec)


def make_sender(spec: CodecSpec, threads: int, tp, destinations, lands: bool):
    """The sending side of ``spec``'s codec for blocks of ``threads`` threads over transport
    ``tp`` (see the module docstring)."""
    return _module(spec).make_sender(spec, threads, tp, destinations, lands)


def make_receiver(spec: CodecSpec, threads: int):
    """The receiving side of ``spec``'s codec (the expanded layout's extras)."""
    return _module(spec).make_receiver(spec, threads)


__all__ = ["WORDS", "CodecSpec", "make_receiver", "make_sender", "traits"]
