"""The NumPy oracle (`ep_runtime.core.reference`) against invariants checked independently of it.

Dispatch is checked as a set and an order: every (source rank, token, k) appears exactly once,
on the rank holding its expert, in its expert's segment, with its exact weight and row bits,
ordered by source rank then token; segments start at multiples of ``pad_multiple`` and padding
is zero with -1 sources. Combine is checked by a round trip through identity experts (within
bf16 rounding, tolerance derived below), by its unreduced partials (zero where a token did
not go; their rank-order float32 sum rounds to the reduced output exactly), by recomputing
the documented summation order token by token (bit-exact), by determinism, and by a tiny
example worked out by hand.

Rows made by :func:`ep_runtime.testing.make_tokens` encode (rank, token) in their first
columns, so a misplaced row is reported with the place it came from.
"""

import numpy as np
import pytest

from ep_runtime.core import reference as ref
from ep_runtime.core.config import EPConfig
from ep_runtime.core.reference import BF16
from ep_runtime.testing import SCENARIOS, applicable_scenarios, describe_row, linear_experts, make_inputs

CONFIGS = {
    "R1_E4_K2": EPConfig(n_ranks=1, n_experts=4, top_k=2, hidden=16, max_tokens_per_rank=8),
    "R2_E8_K2": EPConfig(n_ranks=2, n_experts=8, top_k=2, hidden=32, max_tokens_per_rank=12),
    "R2_E8_K2_pad4": EPConfig(n_ranks=2, n_experts=8, top_k=2, hidden=32, max_tokens_per_rank=12,
                              pad_multiple=4),
    "R2_E4_K1_pad4": EPConfig(n_ranks=2, n_experts=4, top_k=1, hidden=16, max_tokens_per_rank=10,
                              pad_multiple=4),
    "R2_E4_K4": EPConfig(n_ranks=2, n_experts=4, top_k=4, hidden=16, max_tokens_per_rank=10),
    "R4_E8_K3_pad4": EPConfig(n_ranks=4, n_experts=8, top_k=3, hidden=16, max_tokens_per_rank=10,
                              pad_multiple=4),
    "R4_E8_K8_pad4": EPConfig(n_ranks=4, n_experts=8, top_k=8, hidden=8, max_tokens_per_rank=6,
                              pad_multiple=4),
    "R4_E16_K1": EPConfig(n_ranks=4, n_experts=16, top_k=1, hidden=8, max_tokens_per_rank=9),
    "R1_E8_K8": EPConfig(n_ranks=1, n_experts=8, top_k=8, hidden=8, max_tokens_per_rank=6),
    "R2_E8_K4_pad4": EPConfig(n_ranks=2, n_experts=8, top_k=4, hidden=16, max_tokens_per_rank=8,
                              pad_multiple=4),
}
SCENARIO_NAMES = sorted(SCENARIOS)
#: every (config, scenario) pair the config can express
CASES = [(c, s) for c, cfg in CONFIGS.items() for s in applicable_scenarios(cfg)]
#: (seed, n_tokens): random per-rank counts in [1, T], or every rank full.
DRAWS = {"seed0_random_T": (0, None), "seed1_full_T": (1, "full")}


def inputs(cfg, scenario, draw):
    seed, n_tokens = DRAWS[draw]
    return make_inputs(cfg, scenario, seed, [cfg.max_tokens_per_rank] * cfg.n_ranks if n_tokens else None)


def bits16(a) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint16)


def bits32(a) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(a, np.float32)).view(np.uint32)


def expected_hits(cfg, ids, rank):
    """{local expert: [(src rank, token, k), ...] ordered by (src rank, token)}, by plain loops
    (a masked slot, -1, is on no rank)."""
    L = cfg.n_local_experts
    hits = {e: [] for e in range(L)}
    for s, ids_s in enumerate(ids):
        for t in range(ids_s.shape[0]):
            for k in range(cfg.top_k):
                e = int(ids_s[t, k])
                if e // L == rank:
                    hits[e % L].append((s, t, k))
    return hits


def where_from(batch, row) -> str:
    s, t, k = int(batch.src_rank[row]), int(batch.src_token[row]), int(batch.src_k[row])
    enc = describe_row(batch.x[row]) if batch.x.shape[1] >= 3 else "row"
    return f"row {row} (labelled src rank {s}, token {t}, k {k}; {enc})"


def check_dispatch(cfg, xs, ids, ws, batches):
    """Dispatch invariants, computed without the reference's own algorithm."""
    R, L, H, pad = cfg.n_ranks, cfg.n_local_experts, cfg.hidden, cfg.pad_multiple
    assert len(batches) == R
    seen = []
    for r, b in enumerate(batches):
        n = b.n_rows
        assert b.x.dtype == BF16 and b.x.shape == (n, H)
        for name in ("src_rank", "src_token", "src_k"):
            arr = getattr(b, name)
            assert arr.dtype == np.int32 and arr.shape == (n,), f"rank {r} {name}: {arr.dtype} {arr.shape}"
        assert b.weight.dtype == np.float32 and b.weight.shape == (n,)
        assert b.row_offsets.dtype == np.int32 and b.row_offsets.shape == (L + 1,)
        assert b.expert_counts.dtype == np.int32 and b.expert_counts.shape == (L,)
        assert b.row_offsets[0] == 0
        assert n <= cfg.worst_case_recv_rows

        hits = expected_hits(cfg, ids, r)
        for e in range(L):
            lo, hi = int(b.row_offsets[e]), int(b.row_offsets[e + 1])
            exp = hits[e]
            where = f"rank {r} local expert {e} (global {r * L + e}), rows [{lo}, {hi})"
            assert lo % pad == 0, f"{where}: offset not a multiple of {pad}"
            assert b.expert_counts[e] == len(exp), f"{where}: count {b.expert_counts[e]} != {len(exp)}"
            # Smallest multiple of pad holding the real rows (0 rows -> empty segment).
            assert hi - lo == -(-len(exp) // pad) * pad, f"{where}: length {hi - lo} for {len(exp)} rows"
            real = np.arange(lo, lo + len(exp))
            got = list(zip(b.src_rank[real].tolist(), b.src_token[real].tolist(), b.src_k[real].tolist()))
            assert got == exp, f"{where}: (src rank, token, k) {got} != expected {exp}"
            for row, (s, t, k) in zip(real, exp):
                assert bits16(b.x[row]).tolist() == bits16(xs[s][t]).tolist(), \
                    f"{where}: {where_from(b, row)} does not hold the bits of token {t} of rank {s}"
                assert bits32(b.weight[row]) == bits32(ws[s][t, k]), f"{where}: {where_from(b, row)} weight"
            padding = np.arange(lo + len(exp), hi)
            assert (b.src_rank[padding] == -1).all() and (b.src_token[padding] == -1).all() \
                and (b.src_k[padding] == -1).all(), f"{where}: padding rows without -1 sources"
            assert (bits32(b.weight[padding]) == 0).all(), f"{where}: padding weight not +0"
            assert (bits16(b.x[padding]) == 0).all(), f"{where}: padding rows not zero"
            seen += [(s, t, k, r) for s, t, k in got]
        assert b.row_offsets[L] == n
    # Globally: every (s, t, k) exactly once, on the rank that holds its expert; no masked slot (-1).
    want = sorted((s, t, k, int(ids[s][t, k]) // L) for s in range(R) for t in range(ids[s].shape[0])
                  for k in range(cfg.top_k) if ids[s][t, k] >= 0)
    assert sorted(seen) == want


# -- (i) dispatch invariants -----------------------------------------------------------------
@pytest.mark.parametrize("draw", DRAWS)
@pytest.mark.parametrize("cfg_name,scenario", CASES)
def test_dispatch_invariants(cfg_name, scenario, draw):
    cfg = CONFIGS[cfg_name]
    xs, ids, ws = inputs(cfg, scenario, draw)
    check_dispatch(cfg, xs, ids, ws, ref.dispatch(xs, ids, ws, cfg))


@pytest.mark.parametrize("cfg_name", CONFIGS)
def test_dispatch_accepts_uint16_bits(cfg_name):
    """bf16 rows passed as their uint16 bit pattern dispatch to the same bits."""
    cfg = CONFIGS[cfg_name]
    xs, ids, ws = make_inputs(cfg, "random", 3)
    a = ref.dispatch(xs, ids, ws, cfg)
    b = ref.dispatch([bits16(x) for x in xs], ids, ws, cfg)
    for ba, bb in zip(a, b):
        assert bits16(ba.x).tolist() == bits16(bb.x).tolist()


@pytest.mark.parametrize("cfg_name", ["R2_E8_K2", "R2_E8_K2_pad4", "R4_E8_K3_pad4", "R4_E16_K1"])
def test_empty_expert_has_empty_segment(cfg_name):
    cfg = CONFIGS[cfg_name]
    assert cfg.n_experts - 2 >= cfg.top_k     # the scenario can avoid experts 0 and E - 1
    xs, ids, ws = make_inputs(cfg, "empty_expert", 0)
    assert not any(((i == 0) | (i == cfg.n_experts - 1)).any() for i in ids)
    batches = ref.dispatch(xs, ids, ws, cfg)
    L = cfg.n_local_experts
    first, last = batches[0], batches[-1]
    assert first.row_offsets[0] == first.row_offsets[1] == 0 and first.expert_counts[0] == 0
    assert last.row_offsets[L - 1] == last.row_offsets[L] and last.expert_counts[L - 1] == 0


@pytest.mark.parametrize("cfg_name", CONFIGS)
def test_zero_rank_contributes_nothing(cfg_name):
    cfg = CONFIGS[cfg_name]
    xs, ids, ws = make_inputs(cfg, "zero_rank", 0)
    assert xs[0].shape == (0, cfg.hidden) and ids[0].shape == (0, cfg.top_k)
    batches = ref.dispatch(xs, ids, ws, cfg)
    for r, b in enumerate(batches):
        assert not (b.src_rank == 0).any(), f"rank {r} holds a row from rank 0, which sent no tokens"
    out = ref.combine([b.x for b in batches], batches, ids, cfg)
    assert out[0].shape == (0, cfg.hidden) and out[0].dtype == BF16


@pytest.mark.parametrize("cfg_name", ["R2_E8_K2_pad4", "R4_E8_K3_pad4"])
def test_one_expert_segment_holds_every_token(cfg_name):
    cfg = CONFIGS[cfg_name]
    xs, ids, ws = make_inputs(cfg, "one_expert", 0)
    b0 = ref.dispatch(xs, ids, ws, cfg)[0]
    total = sum(x.shape[0] for x in xs)
    assert b0.expert_counts[0] == total
    assert b0.row_offsets[1] == -(-total // cfg.pad_multiple) * cfg.pad_multiple


# -- (ii) round trip through identity experts --------------------------------------------------
#: Identity experts give combine = x * sum_k w_k. The oracle rounds twice to bf16 (each rank's
#: partial on the wire, then the output); bf16 has 8 significant bits, so each rounding moves a
#: value by at most 2**-8 of its magnitude, and both magnitudes are at most |x| * sum_k |w_k|.
#: The float32 products and sums add about (K + R) * 2**-24 relative, far below the 1% slack.
#: Tolerance per element: 2 * 2**-8 * |x| * sum_k |w_k| * 1.01 (one bf16 ulp of the magnitude).
ROUND_TRIP_ULPS = 2 * 2.0**-8 * 1.01


@pytest.mark.parametrize("draw", DRAWS)
@pytest.mark.parametrize("cfg_name,scenario", CASES)
def test_round_trip_identity_experts(cfg_name, scenario, draw):
    cfg = CONFIGS[cfg_name]
    xs, ids, ws = inputs(cfg, scenario, draw)
    batches = ref.dispatch(xs, ids, ws, cfg)
    out = ref.combine([b.x for b in batches], batches, ids, cfg)
    assert len(out) == cfg.n_ranks
    for s in range(cfg.n_ranks):
        assert out[s].dtype == BF16 and out[s].shape == xs[s].shape
        x = xs[s].astype(np.float64)
        w = np.where(ids[s] >= 0, ws[s], 0).astype(np.float64)  # a masked slot's weight is ignored
        want = x * w.sum(axis=1, keepdims=True)
        tol = ROUND_TRIP_ULPS * np.abs(x) * np.abs(w).sum(axis=1, keepdims=True)
        got = out[s].astype(np.float64)
        assert not np.isnan(got).any()
        err = np.abs(got - want)
        bad = np.argwhere(err > tol)
        assert bad.size == 0, (f"home rank {s}: token {bad[0][0]} column {bad[0][1]}: got "
                               f"{got[tuple(bad[0])]}, want {want[tuple(bad[0])]} +- {tol[tuple(bad[0])]}")


# -- (iii) unreduced partials ------------------------------------------------------------------
def expert_outputs(cfg, batches, kind):
    if kind == "identity":
        return [b.x for b in batches]
    return [linear_experts(b.x, b.row_offsets, cfg.n_local_experts, r) for r, b in enumerate(batches)]


@pytest.mark.parametrize("experts", ["identity", "linear"])
@pytest.mark.parametrize("cfg_name,scenario", CASES)
def test_partials_zero_where_not_sent_and_sum_to_reduced(cfg_name, scenario, experts):
    cfg = CONFIGS[cfg_name]
    R, L = cfg.n_ranks, cfg.n_local_experts
    xs, ids, ws = make_inputs(cfg, scenario, 5)
    batches = ref.dispatch(xs, ids, ws, cfg)
    ys = expert_outputs(cfg, batches, experts)
    reduced = ref.combine(ys, batches, ids, cfg)
    partials = ref.combine(ys, batches, ids, cfg, reduce=False)
    for s in range(R):
        p = partials[s]
        assert p.dtype == BF16 and p.shape == (R, xs[s].shape[0], cfg.hidden)
        for t in range(xs[s].shape[0]):
            for r in range(R):
                went = any(int(e) // L == r for e in ids[s][t])
                if not went:
                    assert (bits16(p[r, t]) == 0).all(), \
                        f"home rank {s} token {t}: partial of rank {r} is not +0 though the token did not go there"
        acc = np.zeros((xs[s].shape[0], cfg.hidden), np.float32)
        for r in range(R):                                    # rank order, float32, from 0
            acc = acc + p[r].astype(np.float32)
        assert bits16(acc.astype(BF16)).tolist() == bits16(reduced[s]).tolist(), f"home rank {s}"


@pytest.mark.parametrize("cfg_name,scenario", CASES)
def test_partials_follow_documented_summation_order(cfg_name, scenario):
    """Recompute each partial token by token as docs/protocol.md states it: over the token's
    experts on rank r in ascending expert order, p = f32(p + f32(w * f32(y))) from +0, then
    bf16; compare bits."""
    cfg = CONFIGS[cfg_name]
    R, L = cfg.n_ranks, cfg.n_local_experts
    xs, ids, ws = make_inputs(cfg, scenario, 7)
    batches = ref.dispatch(xs, ids, ws, cfg)
    ys = expert_outputs(cfg, batches, "linear")
    partials = ref.combine(ys, batches, ids, cfg, reduce=False)
    for r, b in enumerate(batches):
        row_of = {(int(s), int(t), int(k)): i for i, (s, t, k) in enumerate(zip(b.src_rank, b.src_token, b.src_k))
                  if s >= 0}
        y = ys[r].astype(np.float32)
        for s in range(R):
            for t in range(xs[s].shape[0]):
                mine = sorted((int(e), k) for k, e in enumerate(ids[s][t]) if int(e) // L == r)
                if not mine:
                    continue
                acc = np.zeros(cfg.hidden, np.float32)
                for _, k in mine:
                    acc = acc + np.float32(ws[s][t, k]) * y[row_of[(s, t, k)]]
                assert bits16(acc.astype(BF16)).tolist() == bits16(partials[s][r, t]).tolist(), \
                    f"partial of rank {r} for token {t} of rank {s} (experts {[e for e, _ in mine]})"


def _order_probe(n_ranks, n_experts):
    """One token of rank 0 routed to experts 0, 1, 2 with weight 1, whose expert outputs are the
    constants 2**24, 1, -2**24 (exact in bf16). Float32 addition of these is order-sensitive:
    (2**24 + 1) - 2**24 = 0 (2**24 + 1 rounds to even), (-2**24 + 1) + 2**24 = 1."""
    cfg = EPConfig(n_ranks=n_ranks, n_experts=n_experts, top_k=3, hidden=1, max_tokens_per_rank=1)
    L = cfg.n_local_experts
    xs = [np.ones((1, 1), BF16)] + [np.zeros((0, 1), BF16)] * (n_ranks - 1)
    ids = [np.array([[2, 0, 1]], np.int32)] + [np.zeros((0, 3), np.int32)] * (n_ranks - 1)
    ws = [np.ones((1, 3), np.float32)] + [np.zeros((0, 3), np.float32)] * (n_ranks - 1)
    batches = ref.dispatch(xs, ids, ws, cfg)
    value = {0: 2.0**24, 1: 1.0, 2: -(2.0**24)}
    ys = []
    for r, b in enumerate(batches):
        y = np.zeros((b.n_rows, 1), np.float32)
        for e in range(L):
            y[b.row_offsets[e]:b.row_offsets[e + 1]] = value.get(r * L + e, 0.0)
        ys.append(y.astype(BF16))
    return cfg, batches, ys, ids


def test_partial_sums_experts_in_ascending_order():
    # One rank holding experts 0..3: p = ((0 + 2**24) + 1) + -2**24 = 0 in ascending expert order
    # (descending would give 1), whatever the order of the ids within the token.
    cfg, batches, ys, ids = _order_probe(n_ranks=1, n_experts=4)
    assert ref.combine(ys, batches, ids, cfg)[0].astype(np.float32).tolist() == [[0.0]]


def test_reduce_sums_ranks_in_ascending_order():
    # Experts 0, 1, 2 on ranks 0, 1, 2: partials 2**24, 1, -2**24; ascending rank order gives 0
    # (descending would give 1).
    cfg, batches, ys, ids = _order_probe(n_ranks=4, n_experts=4)
    partials = ref.combine(ys, batches, ids, cfg, reduce=False)[0]
    assert partials.astype(np.float32)[:, 0, 0].tolist() == [2.0**24, 1.0, -(2.0**24), 0.0]
    assert ref.combine(ys, batches, ids, cfg)[0].astype(np.float32).tolist() == [[0.0]]


# -- (iv) determinism --------------------------------------------------------------------------
@pytest.mark.parametrize("cfg_name", CONFIGS)
def test_dispatch_and_combine_are_deterministic(cfg_name):
    cfg = CONFIGS[cfg_name]
    xs, ids, ws = make_inputs(cfg, "random", 11)
    b1, b2 = ref.dispatch(xs, ids, ws, cfg), ref.dispatch(xs, ids, ws, cfg)
    for a, b in zip(b1, b2):
        assert bits16(a.x).tolist() == bits16(b.x).tolist()
        assert bits32(a.weight).tolist() == bits32(b.weight).tolist()
        for name in ("row_offsets", "expert_counts", "src_rank", "src_token", "src_k"):
            assert np.array_equal(getattr(a, name), getattr(b, name))
    ys = expert_outputs(cfg, b1, "linear")
    for reduce in (True, False):
        o1 = ref.combine(ys, b1, ids, cfg, reduce=reduce)
        o2 = ref.combine(ys, b1, ids, cfg, reduce=reduce)
        for s in range(cfg.n_ranks):
            assert bits16(o1[s]).tolist() == bits16(o2[s]).tolist(), f"home rank {s}, reduce={reduce}"
            assert not np.isnan(o1[s].astype(np.float32)).any()


def test_make_inputs_is_reproducible_and_encodes_origin():
    cfg = CONFIGS["R4_E8_K3_pad4"]
    a, b = make_inputs(cfg, "random", 2), make_inputs(cfg, "random", 2)
    for xa, xb in zip(a[0], b[0]):
        assert bits16(xa).tolist() == bits16(xb).tolist()
    for r, x in enumerate(a[0]):
        for t in range(x.shape[0]):
            assert describe_row(x[t]) == f"row encoding rank {r}, token {t}"
        assert (a[2][r] > 0).all() and np.allclose(a[2][r].sum(axis=1), 1, atol=1e-6)
        assert all(len(set(row.tolist())) == cfg.top_k for row in a[1][r])   # unique ids per token


def test_make_inputs_rejects_unknown_scenario():
    with pytest.raises(ValueError, match="unknown scenario 'hot_expert'"):
        make_inputs(CONFIGS["R2_E8_K2"], "hot_expert", 0)


# -- (v) a tiny example worked by hand -----------------------------------------------------------
# 2 ranks, 4 experts (rank 0: experts 0, 1; rank 1: experts 2, 3), top-2, hidden 4, pad 2.
HAND = EPConfig(n_ranks=2, n_experts=4, top_k=2, hidden=4, max_tokens_per_rank=2, pad_multiple=2)
HAND_X = [np.array([[1, 2, 3, 4], [-1, 0.5, 0, 8]], np.float32).astype(BF16),
          np.array([[10, 20, 30, 40], [0.25, -2, 4, 1]], np.float32).astype(BF16)]
HAND_IDS = [np.array([[1, 2], [3, 0]], np.int32), np.array([[0, 3], [2, 3]], np.int32)]
HAND_W = [np.array([[0.5, 0.25], [0.75, 0.25]], np.float32), np.array([[0.5, 0.5], [0.125, 0.875]], np.float32)]


def hand_experts(batches):
    """Expert e maps a row x to (e + 1) * x (exact for these values); padding stays 0."""
    out = []
    for r, b in enumerate(batches):
        y = b.x.astype(np.float32)
        for e in range(HAND.n_local_experts):
            lo, hi = b.row_offsets[e], b.row_offsets[e + 1]
            y[lo:hi] *= r * HAND.n_local_experts + e + 1
        out.append(y.astype(BF16))
    return out


def test_hand_worked_dispatch():
    b0, b1 = ref.dispatch(HAND_X, HAND_IDS, HAND_W, HAND)
    # Rank 0. Expert 0: (rank 0, token 1, k 1, w .25), (rank 1, token 0, k 0, w .5).
    #         Expert 1: (rank 0, token 0, k 0, w .5), then one padding row (pad 2).
    assert b0.row_offsets.tolist() == [0, 2, 4]
    assert b0.expert_counts.tolist() == [2, 1]
    assert b0.src_rank.tolist() == [0, 1, 0, -1]
    assert b0.src_token.tolist() == [1, 0, 0, -1]
    assert b0.src_k.tolist() == [1, 0, 0, -1]
    assert b0.weight.tolist() == [0.25, 0.5, 0.5, 0.0]
    assert b0.x.astype(np.float32).tolist() == [[-1, 0.5, 0, 8], [10, 20, 30, 40], [1, 2, 3, 4], [0, 0, 0, 0]]
    # Rank 1. Expert 2: (0, 0, k 1, .25), (1, 1, k 0, .125).
    #         Expert 3: (0, 1, k 0, .75), (1, 0, k 1, .5), (1, 1, k 1, .875), one padding row.
    assert b1.row_offsets.tolist() == [0, 2, 6]
    assert b1.expert_counts.tolist() == [2, 3]
    assert b1.src_rank.tolist() == [0, 1, 0, 1, 1, -1]
    assert b1.src_token.tolist() == [0, 1, 1, 0, 1, -1]
    assert b1.src_k.tolist() == [1, 0, 0, 1, 1, -1]
    assert b1.weight.tolist() == [0.25, 0.125, 0.75, 0.5, 0.875, 0.0]
    assert b1.x.astype(np.float32).tolist() == [[1, 2, 3, 4], [0.25, -2, 4, 1], [-1, 0.5, 0, 8],
                                                [10, 20, 30, 40], [0.25, -2, 4, 1], [0, 0, 0, 0]]


def test_hand_worked_combine():
    batches = ref.dispatch(HAND_X, HAND_IDS, HAND_W, HAND)
    ys = hand_experts(batches)
    # Home rank 0, token 0, x = [1, 2, 3, 4]: rank 0 expert 1: .5 * 2x = x; rank 1 expert 2:
    #   .25 * 3x = .75x; sum 1.75x.
    # Home rank 0, token 1, x = [-1, .5, 0, 8]: rank 0 expert 0: .25 * 1x; rank 1 expert 3:
    #   .75 * 4x = 3x; sum 3.25x.
    # Home rank 1, token 0, x = [10, 20, 30, 40]: rank 0 expert 0: .5 * 1x; rank 1 expert 3:
    #   .5 * 4x = 2x; sum 2.5x.
    # Home rank 1, token 1, x = [.25, -2, 4, 1]: only rank 1: .125 * 3x + .875 * 4x = 3.875x.
    partials = ref.combine(ys, batches, HAND_IDS, HAND, reduce=False)
    assert partials[0].astype(np.float32).tolist() == [
        [[1, 2, 3, 4], [-0.25, 0.125, 0, 2]],               # from rank 0
        [[0.75, 1.5, 2.25, 3], [-3, 1.5, 0, 24]],           # from rank 1
    ]
    assert partials[1].astype(np.float32).tolist() == [
        [[5, 10, 15, 20], [0, 0, 0, 0]],                    # from rank 0 (token 1 did not go there)
        [[20, 40, 60, 80], [0.96875, -7.75, 15.5, 3.875]],  # from rank 1
    ]
    out = ref.combine(ys, batches, HAND_IDS, HAND)
    assert out[0].astype(np.float32).tolist() == [[1.75, 3.5, 5.25, 7], [-3.25, 1.625, 0, 26]]
    assert out[1].astype(np.float32).tolist() == [[25, 50, 75, 100], [0.96875, -7.75, 15.5, 3.875]]


@pytest.mark.parametrize("reduce", [True, False])
def test_combine_for_some_home_ranks_equals_those_of_the_whole_combine(reduce):
    """``home_ranks``: a rank checking its own output computes only it (the GPU checks at EP8),
    bit for bit what the combine of every rank gives it; the others are None."""
    cfg = CONFIGS["R4_E8_K3_pad4"]
    xs, ids, ws = make_inputs(cfg, "random", 9)
    batches = ref.dispatch(xs, ids, ws, cfg)
    ys = expert_outputs(cfg, batches, "linear")
    whole = ref.combine(ys, batches, ids, cfg, reduce=reduce)
    for me in range(cfg.n_ranks):
        mine = ref.combine(ys, batches, ids, cfg, reduce=reduce, home_ranks=[me])
        assert [s for s, out in enumerate(mine) if out is not None] == [me]
        assert bits16(mine[me]).tolist() == bits16(whole[me]).tolist()
    with pytest.raises(ValueError, match="home_ranks"):
        ref.combine(ys, batches, ids, cfg, home_ranks=[cfg.n_ranks])


def test_routed_ids_masks_what_no_expert_takes():
    """-1, ids outside [0, n_experts) and repeats of an earlier slot's id route nowhere; the
    first slot of a repeated id keeps it."""
    ids = np.array([[3, 3, -1, 7], [0, 1, 8, -7], [5, -1, 5, 2], [-1, -1, -1, -1]], np.int32)
    assert ref.routed_ids(ids, 8).tolist() == [[3, -1, -1, 7], [0, 1, -1, -1], [5, -1, -1, 2], [-1, -1, -1, -1]]
    assert ids[0, 1] == 3, "the caller's ids are not modified"
    assert ref.routed_ids(np.zeros((0, 4), np.int32), 8).shape == (0, 4)
