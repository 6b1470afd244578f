"""Test data for every rank, generated identically on every rank from a seed.

Token rows encode their origin: column 0 holds the source rank, column 1 ``t // 128`` and
column 2 ``t % 128`` (small integers, exact in bfloat16), the rest random bf16 values; so a
misplaced row says where it came from. Routing scenarios cover the awkward cases.
"""

from __future__ import annotations

import numpy as np

from .config import EPConfig
from .reference import BF16

#: Routing scenarios: name -> what it exercises.
SCENARIOS = {
    "random": "distinct random experts per token, random positive weights",
    "zero_rank": "rank 0 sends no tokens (T=0) while the others send",
    "empty_expert": "random routing that avoids expert 0 and the last expert entirely",
    "one_expert": "every token picks the same top-k experts (expert 0 gets every token)",
}


def applicable_scenarios(cfg: EPConfig) -> list[str]:
    """The scenarios a config can express ('empty_expert' needs n_experts - 2 >= top_k)."""
    return [s for s in SCENARIOS if s != "empty_expert" or cfg.n_experts - 2 >= cfg.top_k]


def make_tokens(rank: int, n_tokens: int, hidden: int, rng: np.random.Generator) -> np.ndarray:
    """[n_tokens, hidden] bfloat16 rows that encode (rank, token) in their first columns."""
    x = rng.standard_normal((n_tokens, hidden)).astype(np.float32)
    t = np.arange(n_tokens)
    for col, val in enumerate((np.full(n_tokens, rank), t // 128, t % 128)):
        if col < hidden:
            x[:, col] = val
    return x.astype(BF16)


def make_routing(cfg: EPConfig, n_tokens: int, scenario: str, rng: np.random.Generator):
    """``(topk_ids [T, K] int32, topk_weights [T, K] float32)`` for one rank."""
    E, K = cfg.n_experts, cfg.top_k
    if scenario == "one_expert":
        ids = np.tile(np.arange(K, dtype=np.int32), (n_tokens, 1))
    else:
        pool = np.arange(E)
        if scenario == "empty_expert":
            if E - 2 < K:
                raise ValueError(f"scenario 'empty_expert' needs n_experts - 2 >= top_k; got {E} and {K}")
            pool = pool[1:-1]
        ids = np.stack([rng.choice(pool, size=K, replace=False) for _ in range(n_tokens)]).astype(np.int32) \
            if n_tokens else np.zeros((0, K), np.int32)
    w = rng.random((n_tokens, K)).astype(np.float32) + np.float32(0.05)
    w /= w.sum(axis=1, keepdims=True)
    return ids.reshape(n_tokens, K), w.astype(np.float32)


def make_inputs(cfg: EPConfig, scenario: str, seed: int, n_tokens=None):
    """Inputs of every rank: lists of tokens [T_r, H] bf16, ids [T_r, K] int32, weights
    [T_r, K] float32. ``n_tokens``: per-rank token counts (default: random in [1, max])."""
    if scenario not in SCENARIOS:
        raise ValueError(f"unknown scenario {scenario!r}; choose from {sorted(SCENARIOS)}")
    rng = np.random.default_rng(seed)
    R, T = cfg.n_ranks, cfg.max_tokens_per_rank
    counts = list(n_tokens) if n_tokens is not None else [int(rng.integers(1, T + 1)) for _ in range(R)]
    if scenario == "zero_rank":
        counts[0] = 0
    xs, ids, ws = [], [], []
    for r in range(R):
        xs.append(make_tokens(r, counts[r], cfg.hidden, rng))
        i, w = make_routing(cfg, counts[r], scenario, rng)
        ids.append(i)
        ws.append(w)
    return xs, ids, ws


def linear_experts(batch_x: np.ndarray, row_offsets: np.ndarray, n_local: int, rank: int) -> np.ndarray:
    """A small per-expert map on the host: row of global expert e -> x * (1 + e / 64) - e / 8,
    in float32, rounded to bf16. ``batch_x`` [rows, H] bf16; returns the same shape."""
    y = batch_x.astype(np.float32).copy()
    for e_local in range(n_local):
        lo, hi = int(row_offsets[e_local]), int(row_offsets[e_local + 1])
        e = rank * n_local + e_local
        y[lo:hi] = y[lo:hi] * np.float32(1 + e / 64) - np.float32(e / 8)
    return y.astype(BF16)


#: bf16 quiet NaN: :func:`expert_outputs` writes it on every row combine must never read, so a
#: read of one poisons the output.
POISON_BF16 = 0x7FC0


def expert_outputs(cfg: EPConfig, batch, rank: int) -> np.ndarray:
    """The expert outputs a test passes to combine: [capacity, H] bf16 bits, ``linear_experts``
    of the rows of ``batch`` (a :class:`~ep_runtime.reference.ExpertBatchRef` of ``rank``: their
    bf16 values, or the E4M3 codes as numbers in an FP8 format), :data:`POISON_BF16` on padding
    rows and on every row past the batch."""
    y = np.full((cfg.recv_rows_capacity, cfg.hidden), POISON_BF16, np.uint16)
    n = batch.n_rows
    y[:n] = linear_experts(batch.x, batch.row_offsets, cfg.n_local_experts, rank).view(np.uint16)
    y[:n][batch.src_rank < 0] = POISON_BF16
    return y


def describe_row(x_row: np.ndarray) -> str:
    """Where a token row came from, read from its encoded columns."""
    v = x_row[:3].astype(np.float32)
    return f"row encoding rank {int(v[0])}, token {int(v[1]) * 128 + int(v[2])}" if len(v) >= 3 else "row"


def input_error_of(call) -> str | None:
    """The message of the :class:`~ep_runtime.errors.EPInputError` that ``call()`` raises, or
    None when it returns (any other exception propagates)."""
    from .errors import EPInputError

    try:
        call()
    except EPInputError as err:
        return str(err)
    return None


def off_by_8(a: np.ndarray) -> np.ndarray:
    """A C-contiguous copy of ``a`` whose data starts 8 bytes past a 16-byte boundary (caller
    arrays the kernels' 16-byte word-pair paths must not take)."""
    flat = np.empty(a.nbytes + 32, np.uint8)
    skip = (8 - flat.ctypes.data) % 16
    out = flat[skip:skip + a.nbytes].view(a.dtype).reshape(a.shape)
    out[...] = a
    assert out.ctypes.data % 16 == 8 and out.flags.c_contiguous
    return out


# -- per-rank bodies shared by the simulator tests of the runtime's build knobs (run_pes targets) --
def knob_disagreement_pe(session, env: str, values: tuple, cfg: EPConfig) -> dict:
    """Build a runtime of ``cfg`` with environment variable ``env`` set to ``values[rank]``:
    ``{"error": message}`` of the EPConfigError the runtime raises when the ranks disagree, or
    ``{"error": None}``."""
    import os

    from .errors import EPConfigError
    from .runtime import EPRuntime

    os.environ[env] = values[session.rank]
    try:
        EPRuntime(cfg, session).close()
    except EPConfigError as exc:
        return {"error": str(exc)}
    return {"error": None}


def capacity_pe(session, env: str, value: str, cfg: EPConfig, seed: int) -> dict:
    """With ``env`` = ``value``, dispatch "one_expert" inputs of ``seed`` (6 tokens a rank) in a
    runtime of ``cfg`` (a batch capacity below what arrives): ``{"error": message}`` of the
    EPCapacityError, or ``{"error": None}`` on a rank that raised none."""
    import os

    from .errors import EPCapacityError
    from .runtime import EPRuntime

    os.environ[env] = value
    r = session.rank
    xs, ids, ws = make_inputs(cfg, "one_expert", seed, n_tokens=[6] * cfg.n_ranks)
    res = {"error": None}
    with EPRuntime(cfg, session) as rt:
        try:
            rt.dispatch(xs[r].view(np.uint16), ids[r], ws[r])
        except EPCapacityError as exc:
            res["error"] = str(exc)
        session.barrier()
    return res
