"""Reusing a call's validated launch arguments while the caller passes the same arrays.

A runtime call spends most of its host time checking and converting the caller's arrays
(dtype, shape, contiguity, device, alignment, bf16 word views) and assembling the kernel's
argument tuple. Decode loops and CUDA-graph-style callers pass the same array objects every
step, so :class:`CallMemo` keeps, per call site, the last arrays passed and their
:func:`~ep_runtime.core.arrays.fingerprint` (type, address, shape, strides, dtype: everything the
checks depend on), the call's other parameters (``key``: compared with ``==``) and the
:class:`PreparedCall` made from them. A call with the same key and the same array objects
(``is``) with unchanged fingerprints reuses it; any other call prepares (and checks) afresh
and replaces the entry. Per-call checks that read device data (debug mode) are not memoized.

The memo holds one entry per call site, with references to its last arrays (keeping them
alive until the site's next call with other arrays, or :meth:`CallMemo.clear`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ep_runtime.core.arrays import fingerprint


@dataclass(frozen=True)
class PreparedCall:
    """One kernel launch ready to enqueue: ``kernel`` (a Numba dispatcher) with ``args`` (the
    full argument tuple, kernel-ready arrays and int64 scalars), plus what the call reports or
    checks each time: ``n_tokens``, a row count (dispatch_async and combine_wait: the tokens T;
    combine_async: expert_out's rows, for debug mode's check) and ``checked``, converted arrays
    (dispatch_async: the debug-mode routing check's arguments; combine_wait: ``(out,)``, which
    it returns)."""

    kernel: Any
    args: tuple
    n_tokens: int = 0
    checked: tuple = ()
    #: blocks of the launch (0: the plan's whole grid); the senders leave SMs to their receivers
    grid: int = 0
    #: dispatch_async of a landing runtime: the dispatch_land launches dispatch_wait enqueues,
    #: ``(places only, places and copies)`` (copy_rows 0, 1), which read the call's tokens
    #: (this rank's own rows, never sent: docs/protocol.md, "Dispatch rows as they land")
    land: tuple = ()


class CallMemo:
    """The last :class:`PreparedCall` of each call site, keyed by its caller objects."""

    def __init__(self):
        self._sites: dict = {}

    def get(self, site: str, key: tuple, objs: tuple) -> PreparedCall | None:
        """The prepared call of ``site`` if it was made for an equal ``key`` from the objects
        ``objs``, each with an unchanged fingerprint; else None."""
        entry = self._sites.get(site)
        if entry is None:
            return None
        last_key, last, prints, prepared = entry
        if key != last_key or len(objs) != len(last):
            return None
        for a, b in zip(objs, last):
            if a is not b:
                return None
        if tuple(map(fingerprint, objs)) != prints:
            return None
        return prepared

    def get_or_prepare(self, site: str, key: tuple, objs: tuple,
                       prepare: Callable[[], PreparedCall]) -> PreparedCall:
        """:meth:`get`, else ``prepare()`` (which validates and raises on bad input; nothing is
        stored then), remembered as the entry of ``site``. ``key``: hashable parameters of the
        call other than arrays (compared with ``==``); ``objs``: the caller's arrays (or None)."""
        prepared = self.get(site, key, objs)
        if prepared is None:
            prints = tuple(map(fingerprint, objs))  # before prepare: what was checked
            prepared = prepare()
            self._sites[site] = (key, objs, prints, prepared)
        return prepared

    def clear(self) -> None:
        """Forget every call site (drops the references to the caller's arrays)."""
        self._sites.clear()
