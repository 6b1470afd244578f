"""A token's destination ranks as an ascending list: the variant of the device interface past 64
ranks.

The kernels keep the ranks a token goes to (dispatch: the ranks holding one of its experts;
combine: the ranks whose partials it sums) in one of two forms, chosen at build time by
``dest_slots`` (:class:`~ep_runtime.kernels.variant.DispatchVariant`, ``CombineVariant``):

- ``dest_slots`` 0, a **mask**: a uint64, bit d for rank d (64 ranks at most). Every runtime
  of 64 ranks or fewer keeps it, so its builds are the code they were
  (``dispatch_send.token_holders`` and the loops over its bits in the transports and combine).
- ``dest_slots`` S > 0, a **list**: a local int32 array of ``S + 1`` words (:func:`list_words`),
  word 0 the count and words ``1 .. count`` the ranks in ascending order (a token never has more
  destinations than ``min(top_k, n_ranks)`` = S). Loops over it take ``O(K)`` steps, not one a
  rank, and visit the ranks in the mask's order, so sums stay bit for bit the same.

The consumers of each form are the transports' ``send_part`` / ``send_part_flagged`` /
``finish_part`` and ``no_dests`` (:mod:`ep_runtime.kernels.transport`), ``block.flag_listed`` /
``flag_one`` and combine_wait's reductions (:mod:`ep_runtime.kernels.combine_reduce`).

A list build on the stores and puts transports also keeps a token's partials on its home by
destination slot (``CombineVariant.partial_slots``): rank d's partial in slot
:func:`rank_position`, the index of d in the list, so combine_wait reads its list's slots in order.
"""

from ep_runtime.kernels.block import udiv32
from ep_runtime.kernels.cuda_api import cuda, int32, uint32
from ep_runtime.kernels.ranking import ID_BATCH
from ep_runtime.kernels.vec import load_u32_at


def list_words(dest_slots: int) -> int:
    """The int32 words of a destination list of ``dest_slots`` ranks (its count first): the
    local array a kernel of a list build allocates; 0 for a mask build (no list)."""
    return dest_slots + 1 if dest_slots else 0


@cuda.jit(device=True)
def clear_list(dl):
    """``dl``: the empty list."""
    dl[0] = 0


@cuda.jit(device=True)
def insert_rank(dl, d):
    """Rank ``d`` into the ascending list ``dl`` (count in ``dl[0]``) unless it is there: the
    ranks above it move up one word."""
    n = dl[0]
    j = n  # the last word holding a rank <= d (0: none)
    while j > 0 and dl[j] > d:
        j -= 1
    if j > 0 and dl[j] == d:
        return
    i = n
    while i > j:
        dl[i + 1] = dl[i]
        i -= 1
    dl[j + 1] = d
    dl[0] = n + 1


@cuda.jit(device=True)
def holders_at(ids_at, K, L, R, skip, node_size, me, ids_l, dl):
    """``dl`` set to the ranks holding one of a token's ``K`` experts, ascending, but not rank
    ``skip`` (-1: none) and, with ``node_size`` > 0, only those on ``me``'s node (a hierarchical
    transport's row crosses to the others in its chunk), and returned: the token's ids are the int32
    at address ``ids_at`` (its row of ``topk_ids``), rank d holds experts ``[d L, (d + 1) L)``, an
    id outside ``[0, R L)``
    adds none. The ids are loaded ``ID_BATCH`` at a time into ``ids_l`` (local int32
    [ID_BATCH]) before any is used, as ``dispatch_send.token_holders`` loads them."""
    E = R * L
    dl[0] = 0
    for k0 in range(0, K, ID_BATCH):
        for u in range(ID_BATCH):
            if k0 + u < K:
                ids_l[u] = int32(load_u32_at(ids_at, k0 + u))
        for u in range(ID_BATCH):
            if k0 + u < K and uint32(ids_l[u]) < uint32(E):  # (a negative id is a large uint32)
                d = int32(udiv32(ids_l[u], L))
                if d != skip and (node_size == 0 or d // node_size == me // node_size):
                    insert_rank(dl, d)
    return dl


@cuda.jit(device=True)
def holders_of(ids, L, R, dl):
    """``dl`` set to the ranks holding one of the experts ``ids`` ([K] int32; an id outside
    ``[0, R L)`` adds none), ascending, and returned."""
    dl[0] = 0
    for k in range(ids.shape[0]):
        x = ids[k]
        if uint32(x) < uint32(R * L):
            insert_rank(dl, int32(x // L))
    return dl


@cuda.jit(device=True)
def rank_position(ids, L, d):
    """The position of rank ``d`` in the ascending list :func:`holders_of` makes of ``ids``
    ([K] int32; rank r holds experts ``[r L, (r + 1) L)``): the distinct ranks below ``d`` holding
    one of the experts (a negative id holds none). A sender finds its destination slot on a token's home this way, from the
    routing row it received, without a list of its own (``CombineVariant.partial_slots``). One
    32-bit division an id below ``d L``; a rank counts at its first id (range tests, no division)."""
    K = ids.shape[0]
    j = 0
    for k in range(K):
        x = ids[k]
        if x >= 0 and x < d * L:  # an expert of a rank below d
            lo = int32(udiv32(x, L)) * L  # its rank's first expert
            first = True
            for k2 in range(k):
                if ids[k2] >= lo and ids[k2] < lo + L:
                    first = False
            if first:
                j += 1
    return j


@cuda.jit(device=True)
def no_listed(dl):
    """Whether the list ``dl`` is empty."""
    return dl[0] == 0


__all__ = ["list_words", "clear_list", "insert_rank", "holders_at", "holders_of", "rank_position", "no_listed"]
