"""DeepEP's Python API on ep_runtime. ``ep_runtime.deep_ep`` is this package.

Public names, as DeepEP v1.2.1's package has them: :class:`Buffer` (normal mode, within one
node), :class:`Config`, :class:`EventOverlap` (and ``deep_ep.utils.EventHandle``), plus the
layer's :class:`DeepEPUnsupportedError` for what DeepEP offers and the layer does not do.
"""

from ep_runtime.integrations.deep_ep.buffer import Buffer
from ep_runtime.integrations.deep_ep.config import Config
from ep_runtime.integrations.deep_ep.errors import DeepEPUnsupportedError
from ep_runtime.integrations.deep_ep.utils import EventHandle, EventOverlap

#: Marks this package as ep_runtime's layer (the real DeepEP has no such attribute).
EP_RUNTIME_LAYER = True

__all__ = ["Buffer", "Config", "DeepEPUnsupportedError", "EventHandle", "EventOverlap"]
