"""The combine kernels of a plan: ``combine_async`` / ``combine_async_rows`` (send,
ep_runtime/kernels/combine_send.py) and ``combine_wait`` (wait, sum in rank order, epilogue, store,
ep_runtime/kernels/combine_wait.py); with the router weights applied at home, the batched layout's
own pair (ep_runtime/kernels/combine_home.py).

Symbols as in :mod:`ep_runtime.core.layout`; rows move as ``W = H / pack`` words of ``pack`` bf16
values (:func:`ep_runtime.core.layout.token_word`); partials as in :mod:`ep_runtime.kernels.partials`.
docs/protocol.md has the timeline and the summation order. The kernels give a warp to each part
of a token row; each lane handles whole words.
"""

from ep_runtime.kernels.combine_home import make_combine_home_kernels
from ep_runtime.kernels.combine_send import make_combine_send
from ep_runtime.kernels.combine_wait import (MODE_PARTIALS, MODE_REDUCE, identity_epilogue,
                                             make_combine_wait)  # noqa: F401
from ep_runtime.kernels.relay import make_combine_relay
from ep_runtime.kernels.variant import CombineVariant


def make_combine_kernels(v: CombineVariant, epilogue=identity_epilogue) -> dict:
    """``{name: kernel}``: ``combine_async``, ``combine_async_rows`` and ``combine_wait`` for
    ``v`` (combine_wait with ``epilogue``; of the transport it sees only the hierarchical one's
    node size, so the other plans that differ only there share it), and with the hierarchical
    transport ``combine_relay`` (ep_runtime/kernels/relay.py). Each is marked for PDL when ``v.pdl``.
    ``v.home_weights``: the batched layout's ``combine_async`` and ``combine_wait`` with the
    weights applied at home instead (ep_runtime/kernels/combine_home.py), and nothing else."""
    if v.home_weights:
        return dict(make_combine_home_kernels(v, epilogue))
    kernels = dict(make_combine_send(v))
    kernels["combine_wait"] = make_combine_wait(v.threads, v.word, v.f32_partials, v.pdl, epilogue, v.node_size,
                                                v.dest_slots, v.partial_slots)
    if v.node_size:
        kernels["combine_relay"] = make_combine_relay(v)
    return kernels
