"""DeepEP's Python API on ep_runtime: what ``import deep_ep`` gives after the install step.

``ep_runtime.deep_ep`` is this package. ``python -m ep_runtime deep-ep install`` makes ``import
deep_ep`` resolve to it in every process of the Python that runs it (an import alias read at
start-up: torchrun and mpirun workers included), without editing an engine's code;
:func:`~ep_runtime.integrations.deep_ep.alias.activate` does so in the calling process only.
README "DeepEP's API" and docs/deep_ep.md.

Public names, as DeepEP v1.2.1's package has them: :class:`Buffer` (normal mode, within one
node), :class:`Config`, :class:`EventOverlap` (and ``deep_ep.utils.EventHandle``); as its
``hybrid-ep`` branch adds: :class:`HybridEPBuffer`; and the layer's
:class:`DeepEPUnsupportedError` for what DeepEP offers and the layer does not do.
"""

from ep_runtime.integrations.deep_ep.buffer import Buffer
from ep_runtime.integrations.deep_ep.config import Config
from ep_runtime.integrations.deep_ep.errors import DeepEPUnsupportedError
from ep_runtime.integrations.deep_ep.hybrid_ep import HybridEPBuffer
from ep_runtime.integrations.deep_ep.utils import EventHandle, EventOverlap

#: Marks this package as ep_runtime's layer (the real DeepEP has no such attribute).
ep_runtime_layer = True

__all__ = ["Buffer", "Config", "DeepEPUnsupportedError", "EventHandle", "EventOverlap", "HybridEPBuffer"]
