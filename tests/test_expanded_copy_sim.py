"""The expanded dispatch's two ways of copying rows, on the simulator (the real kernels, one
process per rank): inside dispatch_wait (``EP_RUNTIME_FUSED_COPY=1``, the default for bf16 at
decode sizes) and in a following dispatch_copy (``0``).

Each runtime dispatches twice with different routing and padded expert segments
(``pad_multiple=4``), so rows the second call leaves as padding held data rows of the first: the
second batch must equal the reference exactly, padding rows zero, whichever way it was copied.
"""

from __future__ import annotations

import numpy as np
import pytest

from ep_runtime import reference
from ep_runtime.config import EPConfig
from ep_runtime.shmem.launch import run_pes
from ep_runtime.testing import make_inputs

CFG = dict(n_ranks=2, n_experts=8, top_k=3, hidden=40, max_tokens_per_rank=10, pad_multiple=4)
SEEDS = (21, 22)  # the first call's routing, the second's


def two_calls_pe(session) -> dict:
    from ep_runtime.runtime import EPRuntime

    cfg = EPConfig(**CFG)
    r = session.rank
    out = {}
    with EPRuntime(cfg, session) as rt:
        out["fused_copy"] = rt.fused_copy
        for seed in SEEDS:
            xs, ids, ws = make_inputs(cfg, "random", seed)
            batch = rt.dispatch(xs[r].view(np.uint16), ids[r], ws[r])
            out[seed] = {"x": session.to_host(batch.x).copy(),
                         "row_offsets": session.to_host(batch.row_offsets).copy()}
    return out


@pytest.fixture(scope="module", params=["1", "0"])
def two_calls(request):
    with pytest.MonkeyPatch.context() as mp:  # the PEs are spawned with this environment
        mp.setenv("EP_RUNTIME_FUSED_COPY", request.param)
        return request.param, run_pes(two_calls_pe, CFG["n_ranks"], timeout_s=240)


def test_the_copy_path_is_the_one_asked_for(two_calls):
    fused, per_rank = two_calls
    assert all(res["fused_copy"] == (fused == "1") for res in per_rank)


def test_the_padding_moved_between_the_calls():
    """Guard the test itself: some row of the second batch is padding that held data before."""
    cfg = EPConfig(**CFG)
    first, second = (reference.dispatch(*make_inputs(cfg, "random", s), cfg) for s in SEEDS)
    moved = []
    for r in range(cfg.n_ranks):
        n = min(first[r].n_rows, second[r].n_rows)
        moved.append(np.any((second[r].src_rank[:n] < 0) & (first[r].src_rank[:n] >= 0)))
    assert any(moved)


def test_both_calls_equal_the_reference_padding_zero(two_calls):
    fused, per_rank = two_calls
    cfg = EPConfig(**CFG)
    for seed in SEEDS:
        refs = reference.dispatch(*make_inputs(cfg, "random", seed), cfg)
        for r, res in enumerate(per_rank):
            got, ref = res[seed], refs[r]
            n = ref.n_rows
            np.testing.assert_array_equal(got["row_offsets"], ref.row_offsets, err_msg=f"fused={fused} seed {seed}")
            np.testing.assert_array_equal(got["x"][:n], ref.x.view(np.uint16),
                                          err_msg=f"fused={fused} seed {seed} rank {r}")
            pad = ref.src_rank[:n] < 0
            assert pad.any(), "the case needs padding rows"
            assert not got["x"][:n][pad].any(), f"fused={fused} seed {seed} rank {r}: padding rows not zero"
