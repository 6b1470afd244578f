"""The error of :mod:`ep_runtime.integrations.deep_ep` for what DeepEP's API offers and the layer
does not do: low-latency mode, internode (RDMA) buffers, raw buffer access, FP8 formats other
than E4M3 with one scale per 128 elements. Never a silent fallback: each message names the
call, what was asked, and what to do instead."""

from __future__ import annotations

from ep_runtime.core.errors import EPError


class DeepEPUnsupportedError(EPError, NotImplementedError):
    """An argument or call of DeepEP's API asks for what ep_runtime's layer does not do (yet).

    A :class:`NotImplementedError`, so code that probes for a DeepEP feature with
    ``except NotImplementedError`` sees it as absent; the message says which issue brings it
    where one does (low-latency mode: the issue after #63)."""


#: What the message of a low-latency call or argument names.
LOW_LATENCY = ("DeepEP's low-latency mode (low_latency_mode=True, low_latency_dispatch / low_latency_combine, "
               "their buffer hints and cleaning) is not in ep_runtime's layer yet: it is the next issue after #63 "
               "(\"Speak DeepEP (2)\"). Use the normal mode (dispatch / combine) meanwhile")


def unsupported(call: str, what: str, instead: str) -> DeepEPUnsupportedError:
    """The error for ``call`` asking for ``what``, with the way out ``instead``."""
    return DeepEPUnsupportedError(f"{call}: {what}. {instead}")
