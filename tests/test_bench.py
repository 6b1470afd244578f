"""The benchmark tool on the CPU: its byte accounting, the baseline's permutation, and a smoke
run on the simulator (the GPU numbers come from mpirun on the GPU machine)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from ep_runtime import EPConfig, reference
from ep_runtime.bench.stats import gbps, summarize
from ep_runtime.bench.traffic import nccl_permutation, rank_traffic
from ep_runtime.testing import make_inputs


def test_traffic_of_a_hand_worked_example():
    # 2 ranks, 4 experts (rank 0: 0-1, rank 1: 2-3), top-2, hidden 8 (16-byte rows)
    ids0 = np.array([[0, 1], [0, 2], [2, 3]])  # token 0 -> rank 0; token 1 -> both; token 2 -> rank 1
    ids1 = np.array([[3, 1]])                  # token 0 -> both
    t = rank_traffic([ids0, ids1], 0, n_local_experts=2, hidden=8)
    assert t.sent == (2, 2) and t.recv == (2, 1)
    assert t.rows == 4                          # (0,0,e0) (0,0,e1) (0,1,e0) (1,0,e1)
    assert t.logical_bytes == 3 * 16
    # out: 2 rows to rank 1 + routing of 3 tokens x 2 x 8 B; in: 1 row + routing of 1 token
    assert t.dispatch_nvlink_bytes == max(2 * 16 + 3 * 16, 1 * 16 + 1 * 16)
    assert t.combine_nvlink_bytes == 2 * 16
    assert t.dispatch_hbm_bytes == (4 + 3 + 2 * 4) * 16
    assert t.combine_hbm_bytes == (4 + 2 * 3 + 2 * 4 + 3) * 16


@pytest.mark.parametrize("scenario", ["random", "zero_rank", "one_expert"])
def test_nccl_permutation_builds_the_reference_batch(scenario):
    cfg = EPConfig(n_ranks=3, n_experts=6, top_k=2, hidden=4, max_tokens_per_rank=7)
    xs, ids, ws = make_inputs(cfg, scenario, 4)
    batches = reference.dispatch(xs, ids, ws, cfg)
    for r in range(cfg.n_ranks):
        # what all_to_all_single delivers to rank r: each source's tokens that hit r, in order
        buf = np.concatenate([xs[s][(ids[s] // cfg.n_local_experts == r).any(axis=1)] for s in range(cfg.n_ranks)])
        perm = nccl_permutation(ids, r, cfg.n_local_experts)
        assert len(perm) == batches[r].n_rows
        np.testing.assert_array_equal(buf[perm].view(np.uint16), batches[r].x.view(np.uint16))


def test_stats():
    s = summarize([3.0, 1.0, 2.0, 10.0])
    assert s["median"] == 2.5 and s["n"] == 4 and s["p10"] < s["median"] < s["p90"]
    assert gbps(2_000_000, 1000.0) == 2.0


def test_help_documents_the_tool():
    out = subprocess.run([sys.executable, "-m", "ep_runtime.bench", "--help"], capture_output=True, text=True,
                         check=True).stdout
    for word in ("--tokens", "--samples", "--json", "--plot", "floor", "NCCL", "logical GB/s"):
        assert word in out


def test_smoke_run_on_the_simulator(tmp_path):
    path = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "ep_runtime.bench", "--backend", "sim", "--ranks", "2", "--tokens", "3", "6",
         "--hidden", "16", "--experts", "4", "--top-k", "2", "--samples", "3", "--warmup", "1",
         "--json", str(path)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "dispatch us" in proc.stdout and "ceilings measured in this run" in proc.stdout
    data = json.loads(path.read_text())
    assert data["meta"]["backend"] == "sim" and data["meta"]["ranks"] == 2 and data["meta"]["git_sha"]
    assert [len(rank) for rank in data["results"]] == [2, 2]
    for rank in data["results"]:
        for res in rank:
            for span in ("dispatch", "dispatch_async", "dispatch_wait", "combine", "combine_async", "combine_wait"):
                assert res["times_us"][span]["n"] == 3 and res["times_us"][span]["median"] > 0
            assert res["traffic"]["tokens"] == res["config"]["max_tokens_per_rank"]
