"""The dispatch kernels of a plan, by role.

=================  ======================================  =============================
role               kernel                                  module
=================  ======================================  =============================
send               ``dispatch_async``                      ep_runtime/kernels/dispatch_send.py (token rows),
                                                           ep_runtime/kernels/dispatch_route.py (routing)
place              ``dispatch_wait`` (receivers ``wait``,  ep_runtime/kernels/dispatch_wait.py,
                   ``route_first``, ``..._chunked``)       ep_runtime/kernels/layouts/, ranking.py,
                                                           route_first.py, route_chunks.py
land               ``dispatch_land`` (receiver ``land``)   ep_runtime/kernels/dispatch_land.py
copy               ``dispatch_copy`` (expanded layout)     ep_runtime/kernels/layouts/expanded.py
relay              ``dispatch_relay`` (hierarchical)       ep_runtime/kernels/relay.py
=================  ======================================  =============================

Symbols as in :mod:`ep_runtime.core.layout`; ``g = n % 2`` is the buffer group of call ``n``
(routing, counts, signals; the token rows have one buffer, guarded by credits), ``me`` this
rank; token rows move as words of ``pack`` bf16 values (``W = H / pack`` words a row,
:func:`ep_runtime.core.layout.token_word`). docs/protocol.md has the timeline of a call.
"""

from ep_runtime.kernels.layouts.expanded import make_dispatch_copy
from ep_runtime.kernels.dispatch_land import make_dispatch_land
from ep_runtime.kernels.dispatch_send import make_dispatch_async
from ep_runtime.kernels.dispatch_wait import make_dispatch_wait
from ep_runtime.kernels.relay import make_dispatch_relay
from ep_runtime.kernels.variant import DispatchVariant, Receiver


def make_dispatch_kernels(v: DispatchVariant) -> dict:
    """``{name: kernel}``: the dispatch kernels a plan of variant ``v`` launches:
    ``dispatch_async``, its receiver's kernel (``dispatch_land`` for ``land``, ``dispatch_wait``
    otherwise), ``dispatch_copy``, and with the hierarchical transport ``dispatch_relay``
    (ep_runtime/kernels/relay.py). Each is marked for PDL when ``v.pdl`` (but the relay)."""
    kernels = {"dispatch_async": make_dispatch_async(v)}
    if v.receiver is Receiver.LAND:
        kernels["dispatch_land"] = make_dispatch_land(v)
    else:
        kernels["dispatch_wait"] = make_dispatch_wait(v)
    kernels["dispatch_copy"] = make_dispatch_copy(v.threads, v.codec, v.pdl)
    if v.node_size:
        kernels["dispatch_relay"] = make_dispatch_relay(v)
    return kernels
