"""Pure arithmetic of the kernels' block helpers (``kernels/block.py``), their Python source
called on the host (``py_func``): ``interleaved_item``, which deals the combine kernels' rows of every
source to the warps, must be a bijection for every grid and rank count (a row dealt twice is
sent twice, a row never dealt is never sent) and must alternate a warp's sources."""

import pytest

from ep_runtime.kernels import block

#: the device function's own Python source (a @cuda.jit device function is not callable here)
interleaved_item = getattr(block.interleaved_item, "py_func", block.interleaved_item)


@pytest.mark.parametrize("R", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("all_warps", [1, 2, 3, 7, 16, 2112])
def test_interleaved_item_deals_every_source_item_once(R, all_warps):
    n = 41  # items per source (token row parts)
    dealt = [interleaved_item(q, all_warps, R) for q in range(R * n)]
    assert sorted(dealt) == sorted((s, i) for s in range(R) for i in range(n))


def test_a_warp_alternates_its_sources():
    """132 blocks x 16 warps, 2 ranks: warp w's items q = w, w + 2112, ... change source every
    pass (rows for this rank and for the peer overlap in time)."""
    A = 2112
    for w in (0, 1, 777, 2111):
        sources = [interleaved_item(w + p * A, A, 2)[0] for p in range(6)]
        assert all(a != b for a, b in zip(sources, sources[1:])), (w, sources)
