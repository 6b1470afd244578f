"""Eight ranks on the simulator (the EP8 shape, while 8-GPU machines are not lent): the demo's
round trip, exact against the reference, on random routing and the awkward cases."""

import pytest

from ep_runtime import EPConfig
from ep_runtime.tools.demo import demo_rank
from ep_runtime.core.layout import BufferLayout
from ep_runtime.shmem.launch import run_pes


@pytest.mark.parametrize("scenario", ["random", "zero_rank", "one_expert"])
def test_eight_ranks_round_trip_is_exact(scenario):
    cfg = EPConfig(n_ranks=8, n_experts=16, top_k=4, hidden=24, max_tokens_per_rank=10)
    rows = run_pes(demo_rank, 8, args=(cfg.as_dict(), scenario, 11), timeout_s=300,
                   heap_bytes=BufferLayout(cfg).symmetric_bytes)
    for r in rows:
        assert r["dispatch_exact"], f"rank {r['rank']}: expert batch differs from the reference"
        assert r["combine_ok"] and r["combine_max_err"] == 0.0, f"rank {r['rank']}: combine error {r}"
    assert sum(r["tokens"] for r in rows) > 0


def test_eight_ranks_landing_round_trip_is_exact():
    """The same round trip with dispatch rows as they land (the ``land`` receiver, chosen by the
    one environment variable that overrides a plan): eight route signals per receiver, rows from
    eight sources claimed token-major."""
    cfg = EPConfig(n_ranks=8, n_experts=16, top_k=4, hidden=24, max_tokens_per_rank=10)
    with pytest.MonkeyPatch.context() as mp:  # the PEs are spawned with this environment
        mp.setenv("EP_RUNTIME_PLAN", "receiver=land")
        rows = run_pes(demo_rank, 8, args=(cfg.as_dict(), "random", 12), timeout_s=300,
                       heap_bytes=BufferLayout(cfg).symmetric_bytes)
    for r in rows:
        assert r["plan"].startswith("land receiver"), f"rank {r['rank']}: the runtime did not land: {r['plan']}"
        assert r["dispatch_exact"], f"rank {r['rank']}: expert batch differs from the reference"
        assert r["combine_ok"] and r["combine_max_err"] == 0.0, f"rank {r['rank']}: combine error {r}"
    assert sum(r["tokens"] for r in rows) > 0
