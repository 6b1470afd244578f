"""Receiver layouts: how the received rows become the batch the experts read, one module each.

A layout is a placement (which batch row each received (token, local expert) pair is, and the
descriptions of the rows: ``row_offsets``, ``expert_counts``, ``row_src_*``, ``row_weight``,
``row_gather``, ``token_rows``) and a delivery (how the rows' words get there). The receive
kernels (dispatch_wait, dispatch_land, the route-first placing blocks) are built with the
plan's delivering layout (:func:`make_layout`) and call its names; none branches on the layout.

``expanded`` (:mod:`.expanded`)
    Expert-major rows (:mod:`.expert_major`: expert, then source rank, then token; each
    expert's rows padded to ``pad_multiple``), copied from the receive buffer into
    ``expert_x``: by ``dispatch_copy`` after the placement, by a route-first dispatch_wait in
    its own launch (``gather_rows``) or by dispatch_land as each part lands (``copy_to_rows``).
``compact`` (:mod:`.compact`)
    The same placement; nothing is copied into an expert batch: the batch reads the rows where
    they landed, one per (token, source rank), through ``row_gather``.
``dense`` (:mod:`.dense`)
    The same placement (the receive kernels are built as for the compact layout), and DeepEP's
    dense rows: ``dispatch_dense``, after the receive kernel, lays every received (token, source
    rank) out source-major, then in the source's token order (``prefix(s)`` + the token's rank
    among s's tokens with an expert here), with its slots' local expert ids and weights and the
    maps between dense rows and receive-buffer slots (the combine reads its input through them).
``batched`` (:mod:`.batched`)
    The same placement with a fixed stride per expert (DeepEP's low-latency layout):
    ``dispatch_batched``, after the receive kernel, copies the row of local expert e at slot pos
    (its rank among e's rows) to ``e * M + pos`` (M = R Tmax), with its scales column-major per
    expert, and writes the per-expert counts, source tokens and per-source slot ranges.

The namespace :func:`make_layout` returns: the placement's functions (:mod:`.expert_major`:
``scan_placement``, ``first_rows``, ``write_segments``, ``zero_padding_rows``,
``expert_warps``, ``describe_row``, ``row_of``, ``token_of``, ``padded``) and the delivery's:
``COPIES`` (the layout copies rows into an expert batch: receivers built without it hold no such
copy), ``copy_in_pairs``, ``copy_to_rows`` (every lane of a warp: a part of a row into rows
given by index) and ``gather_rows`` (every thread of the copying blocks: every placed row from
its slot; nothing in the compact and dense layouts). A runtime serving several layouts is built
with the first it serves of :data:`LAYOUTS` (``Plan.receiver_layout``) and skips its copies on
another layout's call (``copy_rows`` 0); the dense and batched rows are written by their own
kernels after any receiver.

A new layout is a module with the same names, its placement and its delivery, and a name in
:data:`LAYOUTS`.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

#: The layouts by name: their module.
LAYOUTS = {"expanded": "ep_runtime.kernels.layouts.expanded", "compact": "ep_runtime.kernels.layouts.compact",
           "dense": "ep_runtime.kernels.layouts.dense", "batched": "ep_runtime.kernels.layouts.batched"}


@functools.lru_cache(maxsize=None)
def make_layout(name: str, threads: int) -> SimpleNamespace:
    """The device interface of layout ``name`` for blocks of ``threads`` threads."""
    import importlib

    return importlib.import_module(LAYOUTS[name]).make_layout(threads)


__all__ = ["LAYOUTS", "make_layout"]
