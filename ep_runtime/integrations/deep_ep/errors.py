"""The error of :mod:`ep_runtime.integrations.deep_ep` for what DeepEP's API offers and the layer
does not do: internode (RDMA) normal mode, LogFMT, raw buffer access, FP8 formats other than
E4M3 with one scale per 128 elements. Never a silent fallback: each message names the
call, what was asked, and what to do instead."""

from __future__ import annotations

from ep_runtime.core.errors import EPError


class DeepEPUnsupportedError(EPError, NotImplementedError):
    """An argument or call of DeepEP's API asks for what ep_runtime's layer does not do (yet).

    A :class:`NotImplementedError`, so code that probes for a DeepEP feature with
    ``except NotImplementedError`` sees it as absent; the message says what to do instead."""


def unsupported(call: str, what: str, instead: str) -> DeepEPUnsupportedError:
    """The error for ``call`` asking for ``what``, with the way out ``instead``."""
    return DeepEPUnsupportedError(f"{call}: {what}. {instead}")
