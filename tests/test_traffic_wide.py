"""The traffic model (ep_runtime/tools/bench/traffic.py) past 64 ranks, pure NumPy: a hand-worked
72-rank (9 x 8) routing, the projection's random routing and its refusal of an expert count the
ranks do not divide, and docs/wide_ep.md's figures against the model and the layout code."""

from __future__ import annotations

import numpy as np
import pytest

from ep_runtime.core.errors import EPConfigError
from ep_runtime.tools.bench.traffic import node_traffic, pair_bytes, project_nodes, random_top_k

#: 9 nodes of 8 PEs, an expert a PE, top-1, 16 tokens a PE (2 chunks of 8), every token of PE r to
#: expert (r + 8) mod 72: the PE of the next node with r's local index, r's proxy there.
NODES, N, T = 9, 8, 16
R = NODES * N
TOKEN, PARTIAL = 100, 10


def next_node_routing():
    return [np.full((T, 1), (r + N) % R, np.int64) for r in range(R)]


def test_a_72_rank_call_moves_the_hand_worked_bytes_and_operations():
    """PE 0 (node 0). Across, to each of its 8 proxies (PE 8 k): its routing rows (12 T K = 192),
    node k's 8 counts rows with the signal (8 x 4 (L + 1) = 64) and two grants (16): 272 each; its
    16 rows go to PE 8 only (1600) and PE 64's 16 tokens come to node 0, so PE 0 sums them home to
    PE 64 (16 partials, 160): 8 x 272 + 1600 + 160 = 3936 out, the same in (the routing is a
    rotation). Within, to each of its 7 node peers: its routing, a counts row and two grants
    (192 + 8 + 16), and as the proxy of the source with its local index on each of the 8 other
    nodes, that source's routing and a counts row (8 x 200); no row of node 0's PEs stays on
    node 0: 7 x 1816 = 12712 each way. Operations, to each proxy: 3 routing puts, the counts with
    the signal, 2 grants, and a put per chunk: PE 0's 2 chunks to PE 8, and PE 64's 2 chunks
    summed home from PE 0: 8 x 6 + 2 + 2 = 52."""
    t = node_traffic(next_node_routing(), 0, 1, N, TOKEN, PARTIAL)
    assert (t.across_out, t.across_in) == (3936, 3936)
    assert (t.within_out, t.within_in) == (12712, 12712)
    assert t.ops_across == 52 and t.rows_across == 16
    # nothing goes to a PE of another node that is not a proxy, nor to itself
    ids = next_node_routing()
    assert pair_bytes(ids, 0, 9, 1, N, TOKEN, PARTIAL) == 0 and pair_bytes(ids, 0, 0, 1, N, TOKEN, PARTIAL) == 0


def test_the_projection_draws_each_token_s_experts_as_a_full_sort_of_its_draws_would():
    K, E = 8, 320
    ids = random_top_k(np.random.default_rng(3), 64, E, K)
    sorted_draw = np.argsort(np.random.default_rng(3).random((64, E)), axis=1)[:, :K]
    assert ids.dtype == np.int64 and ids.shape == (64, K)
    assert np.array_equal(ids, sorted_draw)
    assert all(len(set(row)) == K for row in ids.tolist())


def test_a_wide_projection_runs_and_an_expert_count_the_ranks_do_not_divide_is_refused():
    p = project_nodes(9, 8, 16, n_experts=72)
    assert p["ranks"] == 72 and p["across_out"] > 0 and p["ops_across"] >= 8 * 6
    with pytest.raises(EPConfigError, match=r"n_experts=256 for 40 x 8 = 320 ranks.*n_experts=320"):
        project_nodes(40, 8, 16, n_experts=256)


def test_docs_wide_ep_shows_the_model_s_16x8_row_and_the_layout_s_totals(capsys, monkeypatch):
    """docs/wide_ep.md's traffic row at 16 x 8, T = 128 is the tool's, and its region totals at 2 x 8
    and 16 x 8 are BufferLayout's (MAX_RANKS lifted for the sizes only, as the doc's recipe does)."""
    from pathlib import Path

    import ep_runtime.core.config as config
    from ep_runtime.core.config import EPConfig
    from ep_runtime.core.layout import BufferLayout
    from ep_runtime.core.plan import Topology, choose_plan
    from ep_runtime.tools.bench.traffic import main

    doc = (Path(__file__).resolve().parents[1] / "docs" / "wide_ep.md").read_text()
    main(["--shapes", "16x8", "--experts", "256", "--tokens", "128"])
    row = capsys.readouterr().out.splitlines()[2]
    assert row.replace("| 16x8 | 128 |", "| 16x8 | 256 | 128 |") in doc.splitlines()
    totals = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[4:7]] for line in doc.splitlines()
              if line.startswith(("| **symmetric**", "| **local**"))}
    monkeypatch.setattr(config, "MAX_RANKS", 1024)
    for column, nodes in enumerate((2, 16)):
        R = nodes * 8
        cfg = EPConfig(n_ranks=R, n_experts=256, top_k=8, hidden=7168, max_tokens_per_rank=4096,
                       layouts=("expanded", "compact", "dense", "batched"))
        plan = choose_plan(cfg, Topology(R, False, 132, True, False, tuple(p // 8 for p in range(R)), True))
        layout = BufferLayout(cfg, plan)
        for name, size in (("**symmetric**", layout.symmetric_bytes), ("**local**", layout.local_bytes)):
            assert totals[name][column] == f"**{round(size / (1 << 20)):,}**", (nodes, name, totals[name])
