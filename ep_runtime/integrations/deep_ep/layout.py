"""Routing arithmetic on the device, without host reads: DeepEP's dispatch layout and the
routings the runtime is given.

- :func:`dispatch_layout`: ``Buffer.get_dispatch_layout``'s counts and ``is_token_in_rank``
  from ``topk_idx``, as DeepEP's layout kernel counts them (a slot whose id is outside
  ``[0, num_experts)``, -1 included, counts nowhere).
- :func:`routing_from_topk`, :func:`routing_from_ranks`, :func:`routing_from_map`: the
  :class:`~ep_runtime.integrations.deep_ep.handle.Routing` of a dispatch with top-k, of one
  with ``is_token_in_rank`` only (one slot per destination rank), and of HybridEP's dense
  routing map (a token's experts in increasing order, ``width`` slots).
"""

from __future__ import annotations

import torch

from ep_runtime.integrations.deep_ep.handle import Routing


def dispatch_layout(topk_idx: torch.Tensor, num_experts: int, num_ranks: int):
    """``(num_tokens_per_rank [R] int32, num_tokens_per_expert [E] int32, is_token_in_rank [T, R]
    bool)`` of ``topk_idx`` ``[T, K]`` int64 (experts ``[r * E / R, (r + 1) * E / R)`` on rank
    ``r``): tokens sent to each rank (once per token), slots routed to each expert, and whether
    each token goes to each rank."""
    T, dev = topk_idx.shape[0], topk_idx.device
    valid = (topk_idx >= 0) & (topk_idx < num_experts)
    experts = torch.where(valid, topk_idx, num_experts)
    per_expert = torch.zeros(num_experts + 1, dtype=torch.int32, device=dev)
    per_expert.scatter_add_(0, experts.reshape(-1), torch.ones(experts.numel(), dtype=torch.int32, device=dev))
    ranks = torch.where(valid, topk_idx // (num_experts // num_ranks), num_ranks)
    in_rank = torch.zeros(T, num_ranks + 1, dtype=torch.bool, device=dev).scatter_(1, ranks, True)[:, :num_ranks]
    in_rank = in_rank.contiguous()
    return in_rank.sum(0, dtype=torch.int32), per_expert[:num_experts], in_rank


def routing_from_topk(topk_idx: torch.Tensor, topk_weights: torch.Tensor, num_experts: int) -> Routing:
    """The routing of a dispatch with top-k: ``topk_idx`` ``[T, K]`` (int64; -1 masks a slot) as
    int32 ids, ``topk_weights`` ``[T, K]`` float32 with them."""
    return Routing(topk_idx.to(torch.int32).contiguous(), topk_weights.contiguous(), num_experts)


def routing_from_ranks(is_token_in_rank: torch.Tensor, num_experts: int) -> Routing:
    """The routing of a dispatch without top-k: one slot per rank, rank ``r``'s first expert
    (``r * E / R``) where ``is_token_in_rank[t, r]``, else masked; weights 0. The runtime sends
    token ``t`` once to each such rank, as DeepEP does."""
    T, R = is_token_in_rank.shape
    first = torch.arange(R, dtype=torch.int32, device=is_token_in_rank.device) * (num_experts // R)
    ids = torch.where(is_token_in_rank, first, torch.full((), -1, dtype=torch.int32, device=first.device))
    return Routing(ids.contiguous(), torch.zeros(T, R, dtype=torch.float32, device=first.device), num_experts)


def routing_from_map(routing_map: torch.Tensor, probs: torch.Tensor | None, width: int) -> Routing:
    """The routing of HybridEP's ``routing_map`` ``[T, E]`` bool: each token's experts in
    increasing order in ``width`` slots (-1 after the last; the caller makes ``width`` at least
    the most experts of a token, or reports the cut), ``probs`` ``[T, E]`` float32 at those
    experts (0 without probs)."""
    T, E = routing_map.shape
    order = torch.sort(routing_map.to(torch.int8), dim=1, descending=True, stable=True)
    ids = order.indices[:, :width].to(torch.int32)
    ids = torch.where(order.values[:, :width] > 0, ids, torch.full((), -1, dtype=torch.int32, device=ids.device))
    if width > E:
        ids = torch.nn.functional.pad(ids, (0, width - E), value=-1)
    if probs is None:
        weights = torch.zeros(T, width, dtype=torch.float32, device=ids.device)
    else:
        weights = torch.where(ids >= 0, probs.gather(1, ids.clamp(min=0).long()), 0.0)
    return Routing(ids.contiguous(), weights.contiguous(), E)
