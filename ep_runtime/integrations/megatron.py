"""Megatron-core's own ``fused_a2a`` on ep_runtime, unmodified.

Megatron-core's flex token dispatcher (``moe_token_dispatcher_type="flex"``,
``moe_flex_dispatcher_backend`` ``"deepep"`` or ``"hybridep"``) reaches expert-parallel
communication through ``megatron.core.transformer.moe.fused_a2a``, which imports
``deep_ep.Buffer``, ``deep_ep.utils.EventOverlap`` / ``EventHandle`` and
``deep_ep.HybridEPBuffer`` when the module is first imported. With ``import deep_ep`` resolving
to :mod:`ep_runtime.deep_ep` (the install step, ``python -m ep_runtime deep-ep install``, for every
process; or :func:`fused_a2a` in one), Megatron-core's module runs on ep_runtime as it is: no
Megatron module is patched. Megatron-core 0.16.1 and ``core_v0.19.0`` call the layer with their
own arguments (docs/deep_ep.md, "Megatron-core").

The one pitfall is order: ``fused_a2a`` reads ``deep_ep`` once, at its import, and sets
``HAVE_DEEP_EP`` / ``HAVE_HYBRIDEP`` from it. :func:`fused_a2a` makes the alias active and says
so when Megatron-core imported that module before the alias could take effect.
"""

from __future__ import annotations

import importlib
import sys

from ep_runtime.core.errors import EPStateError
from ep_runtime.integrations.deep_ep import Buffer, HybridEPBuffer, alias

#: Megatron-core's module that reads DeepEP.
FUSED_A2A = "megatron.core.transformer.moe.fused_a2a"


def fused_a2a():
    """Megatron-core's ``fused_a2a`` module, running on ep_runtime's DeepEP layer: activates the
    ``deep_ep`` alias in this process (nothing more when the install step did) and imports the
    module. Raises :class:`~ep_runtime.core.errors.EPStateError` when the module found no DeepEP
    or another one (it was imported before the alias: activate it first, or use the install
    step), and :class:`ImportError` when Megatron-core is not installed
    (``pip install -e ".[megatron]"``)."""
    alias.activate()
    module = sys.modules.get(FUSED_A2A) or importlib.import_module(FUSED_A2A)
    found = {"Buffer": getattr(module, "Buffer", None) is Buffer,
             "HybridEPBuffer": getattr(module, "HybridEPBuffer", None) is HybridEPBuffer}
    if not (module.HAVE_DEEP_EP and module.HAVE_HYBRIDEP and all(found.values())):
        raise EPStateError(f"{FUSED_A2A} was imported before `import deep_ep` gave ep_runtime's layer "
                           f"(HAVE_DEEP_EP={module.HAVE_DEEP_EP}, HAVE_HYBRIDEP={module.HAVE_HYBRIDEP}, ep_runtime's "
                           f"classes: {found}): call ep_runtime.megatron.fused_a2a() before importing Megatron-core's "
                           f"MoE modules, or install the alias for every process: python -m ep_runtime deep-ep install")
    return module


__all__ = ["FUSED_A2A", "fused_a2a"]
