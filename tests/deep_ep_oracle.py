"""Inputs and NumPy oracle of the simulator tests of ``ep_runtime.deep_ep`` (tests/test_deep_ep_sim.py,
tests/test_deep_ep_engines_sim.py): every rank's tokens, top-k routing and weights from seeds (so
each rank and the test process make the same ones), and what DeepEP's normal mode returns for
them, written from DeepEP v1.2.1's documented semantics (``deep_ep/buffer.py``) and the checks of
its ``tests/test_intranode.py``:

- ``recv_x``: one row per received (token, source), source rank then token order, the source's
  row bit for bit;
- ``recv_topk_idx`` ``[N, K]``: the slot's local expert, or -1 (masked, elsewhere);
  ``recv_topk_weights``: its weight, or 0 where -1;
- the per-expert counts (slots routed to each local expert, rounded up to the alignment);
- ``rank_prefix_matrix[:, rank]``: rows received from sources ``0..s``;
- combine: each token's rows summed over the ranks it went to, in rank order, in float32, plus
  the bias, rounded once to bf16; combined weights summed likewise in float32.

Token rows encode their origin (column 0 the source rank, column 1 the token index, exact in
bf16), so a misplaced row names where it came from.
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)
#: E4M3 bytes that are NaN (0x7F and 0xFF), kept out of random codes.
FP8_NAN = (0x7F, 0xFF)


@dataclass(frozen=True)
class Setup:
    """One job's sizes: ``R`` ranks with ``tokens[r]`` tokens each, hidden ``H`` (a multiple of
    512: FP8 with packed UE8M0 scales), ``E`` experts, ``K`` slots a token."""

    R: int
    tokens: tuple
    H: int = 512
    E: int = 8
    K: int = 3
    seed: int = 7

    @property
    def L(self) -> int:
        return self.E // self.R


@dataclass(frozen=True)
class RankInputs:
    """One rank's inputs (NumPy): ``x`` [T, H] bf16 bits (origin-encoded), ``x2`` another such
    batch (random rows), ``codes`` [T, H] uint8 E4M3, ``scales`` [T, H/128] float32, ``packed``
    [T, H/512] int32 (UE8M0 exponents), ``topk`` [T, K] int64 (-1 masks; token 1 masks every
    slot), ``weights`` [T, K] float32, ``bias`` [2, T, H] bf16 bits."""

    x: np.ndarray
    x2: np.ndarray
    codes: np.ndarray
    scales: np.ndarray
    packed: np.ndarray
    topk: np.ndarray
    weights: np.ndarray
    bias: np.ndarray


def rank_inputs(setup: Setup, rank: int) -> RankInputs:
    """``rank``'s inputs, from ``(setup.seed, rank)``."""
    rng = np.random.default_rng([setup.seed, rank])
    T, H, E, K = setup.tokens[rank], setup.H, setup.E, setup.K
    x = rng.standard_normal((T, H)).astype(BF16)
    x[:, 0], x[:, 1] = rank, np.arange(T)
    x2 = rng.standard_normal((T, H)).astype(BF16)
    codes = rng.integers(0, 256, (T, H), dtype=np.uint8)
    codes[np.isin(codes, FP8_NAN)] = 0x38  # 1.0
    scales = rng.uniform(0.5, 2.0, (T, H // 128)).astype(np.float32)
    packed = rng.integers(110, 140, (T, H // 128), dtype=np.uint8).view(np.int32).reshape(T, H // 512)
    topk = np.stack([rng.permutation(E)[:K] for _ in range(T)]).astype(np.int64) if T else np.zeros((0, K), np.int64)
    if T > 2:
        topk[0, 1] = -1
        topk[1, :] = -1
    weights = rng.uniform(0.1, 1.0, (T, K)).astype(np.float32)
    bias = rng.standard_normal((2, T, H)).astype(BF16)
    return RankInputs(x.view(np.uint16), x2.view(np.uint16), codes, scales, packed, topk, weights,
                      bias.view(np.uint16))


def destinations(setup: Setup, topk_row: np.ndarray) -> list[int]:
    """The ranks a token with this top-k row goes to, ascending."""
    return sorted({int(e) // setup.L for e in topk_row if 0 <= e < setup.E})


def received(setup: Setup, ins: list[RankInputs], rank: int) -> list[tuple[int, int]]:
    """``(source, token)`` of each row ``rank`` receives, in DeepEP's order."""
    return [(s, t) for s in range(setup.R) for t in range(len(ins[s].topk))
            if rank in destinations(setup, ins[s].topk[t])]


def expected_dispatch(setup: Setup, ins: list[RankInputs], rank: int, alignment: int = 1) -> dict:
    """What DeepEP's dispatch returns on ``rank`` (host arrays): ``rows`` (the (source, token)
    list), ``x`` / ``x2`` / ``codes`` / ``scales`` / ``packed`` of those rows, ``topk_idx``,
    ``topk_weights``, ``counts`` (aligned), ``prefix`` (column ``rank`` of rank_prefix_matrix),
    ``src_idx``."""
    rows = received(setup, ins, rank)
    K, L = setup.K, setup.L
    idx = np.full((len(rows), K), -1, np.int64)
    w = np.zeros((len(rows), K), np.float32)
    counts = np.zeros(L, np.int64)
    for i, (s, t) in enumerate(rows):
        for k, e in enumerate(ins[s].topk[t]):
            if rank * L <= e < (rank + 1) * L:
                idx[i, k], w[i, k] = e - rank * L, ins[s].weights[t, k]
                counts[e - rank * L] += 1
    per_source = [sum(1 for s, _ in rows if s == src) for src in range(setup.R)]
    pick = {name: np.stack([getattr(ins[s], name)[t] for s, t in rows]) if rows else
            np.zeros((0,) + getattr(ins[0], name).shape[1:], getattr(ins[0], name).dtype)
            for name in ("x", "x2", "codes", "scales", "packed")}
    return dict(rows=rows, topk_idx=idx, topk_weights=w, counts=((counts + alignment - 1) // alignment * alignment),
                prefix=np.cumsum(per_source), src_idx=np.array([t for _, t in rows], np.int64), **pick)


def expected_combine(setup: Setup, ins: list[RankInputs], rows_per_rank: list, bias: np.ndarray | None = None):
    """Each rank's combine output ``[T, H]`` (bf16 bits) when rank ``r`` passes
    ``rows_per_rank[r]`` ``[N_r, H]`` (bf16 bits, DeepEP's row order): per token the float32 sum
    over the ranks it went to (ascending), plus ``bias[s]`` (``[T, H]`` float32) when given,
    rounded once."""
    out = []
    index = [{row: i for i, row in enumerate(received(setup, ins, r))} for r in range(setup.R)]
    for s in range(setup.R):
        T = len(ins[s].topk)
        acc = np.zeros((T, setup.H), np.float32)
        for t in range(T):
            for r in destinations(setup, ins[s].topk[t]):
                acc[t] += rows_per_rank[r][index[r][s, t]].view(BF16).astype(np.float32)
        if bias is not None:
            acc = acc + bias[s]
        out.append(acc.astype(BF16).view(np.uint16))
    return out


def expected_weights(setup: Setup, ins: list[RankInputs], weights_per_rank: list) -> list:
    """Each rank's combined ``topk_weights`` ``[T, K']``: per token and slot the float32 sum over
    the ranks it went to (ascending) of ``weights_per_rank[r]`` ``[N_r, K']``."""
    out = []
    index = [{row: i for i, row in enumerate(received(setup, ins, r))} for r in range(setup.R)]
    width = weights_per_rank[0].shape[1]
    for s in range(setup.R):
        T = len(ins[s].topk)
        acc = np.zeros((T, width), np.float32)
        for t in range(T):
            for r in destinations(setup, ins[s].topk[t]):
                acc[t] += weights_per_rank[r][index[r][s, t]]
        out.append(acc)
    return out
