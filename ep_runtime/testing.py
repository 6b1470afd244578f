"""Test data for every rank, generated identically on every rank from a seed.

Token rows encode their origin: column 0 holds the source rank, column 1 ``t // 128`` and
column 2 ``t % 128`` (small integers, exact in bfloat16), the rest random bf16 values; so a
misplaced row says where it came from. Routing scenarios cover the awkward cases.
"""

from __future__ import annotations

import numpy as np

from ep_runtime.core.config import EPConfig
from ep_runtime.core.reference import BF16

#: Routing scenarios: name -> what it exercises.
SCENARIOS = {
    "random": "distinct random experts per token, random positive weights",
    "zero_rank": "rank 0 sends no tokens (T=0) while the others send",
    "empty_expert": "random routing that avoids expert 0 and the last expert entirely",
    "one_expert": "every token picks the same top-k experts (expert 0 gets every token)",
    "masked": "random routing with masked slots (-1): a quarter of the slots, every seventh token "
              "entirely, and every token of the last rank (of two or more); experts 0 and the last "
              "get none where top_k <= n_experts - 2",
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
        if scenario == "empty_expert" and E - 2 < K:
            raise ValueError(f"scenario 'empty_expert' needs n_experts - 2 >= top_k; got {E} and {K}")
        if scenario == "empty_expert" or (scenario == "masked" and E - 2 >= K):
            pool = pool[1:-1]
        ids = np.stack([rng.choice(pool, size=K, replace=False) for _ in range(n_tokens)]).astype(np.int32) \
            if n_tokens else np.zeros((0, K), np.int32)
    ids = ids.reshape(n_tokens, K)
    if scenario == "masked":
        ids[rng.random((n_tokens, K)) < 0.25] = -1
        ids[::7] = -1
    w = rng.random((n_tokens, K)).astype(np.float32) + np.float32(0.05)
    w /= w.sum(axis=1, keepdims=True)
    return ids, w.astype(np.float32)


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
        if scenario == "masked" and r == R - 1 and R > 1:
            i[:] = -1  # a rank with every token masked
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
    of the rows of ``batch`` (a :class:`~ep_runtime.core.reference.ExpertBatchRef` of ``rank``: their
    bf16 values, or the codes as numbers in a quantized format, one per element:
    ``TokenFormat.codes``), :data:`POISON_BF16` on padding rows and on every row past the batch."""
    y = np.full((cfg.recv_rows_capacity, cfg.hidden), POISON_BF16, np.uint16)
    n = batch.n_rows
    x = cfg.token_format.codes(batch.x)
    y[:n] = linear_experts(x, batch.row_offsets, cfg.n_local_experts, rank).view(np.uint16)
    y[:n][batch.src_rank < 0] = POISON_BF16
    return y


def describe_row(x_row: np.ndarray) -> str:
    """Where a token row came from, read from its encoded columns."""
    v = x_row[:3].astype(np.float32)
    return f"row encoding rank {int(v[0])}, token {int(v[1]) * 128 + int(v[2])}" if len(v) >= 3 else "row"


def input_error_of(call) -> str | None:
    """The message of the :class:`~ep_runtime.core.errors.EPInputError` that ``call()`` raises, or
    None when it returns (any other exception propagates)."""
    from ep_runtime.core.errors import EPInputError

    try:
        call()
    except EPInputError as err:
        return str(err)
    return None


def off_boundary(a: np.ndarray, boundary: int, offset: int) -> np.ndarray:
    """A C-contiguous copy of ``a`` whose data starts ``offset`` bytes past a ``boundary``-byte
    boundary (caller arrays that the kernels' aligned paths must not take)."""
    flat = np.empty(a.nbytes + 2 * boundary, np.uint8)
    skip = (offset - flat.ctypes.data) % boundary
    out = flat[skip:skip + a.nbytes].view(a.dtype).reshape(a.shape)
    out[...] = a
    assert out.ctypes.data % boundary == offset and out.flags.c_contiguous
    return out


def off_by_8(a: np.ndarray) -> np.ndarray:
    """A copy of ``a`` 8 bytes past a 16-byte boundary (not for the 16-byte word-pair paths)."""
    return off_boundary(a, 16, 8)


# -- per-rank bodies of the plan tests (run_pes targets): a runtime of a plan override each ----------
def plan_disagreement_pe(session, plans: tuple, cfg: EPConfig) -> dict:
    """Build a runtime of ``cfg`` with plan overrides ``plans[rank]``: ``{"error": message}`` of
    the EPConfigError the ranks' disagreement raises, or ``{"error": None}``."""
    from ep_runtime.core.errors import EPConfigError
    from ep_runtime.core.runtime import EPRuntime

    try:
        EPRuntime(cfg, session, plan=plans[session.rank]).close()
    except EPConfigError as exc:
        return {"error": str(exc)}
    return {"error": None}


def capacity_pe(session, plan: dict, cfg: EPConfig, seed: int) -> dict:
    """Under plan overrides ``plan``, dispatch "one_expert" inputs of ``seed`` (6 tokens a rank)
    in a runtime of ``cfg`` (a batch capacity below what arrives): ``{"error": message}`` of the
    EPCapacityError, or ``{"error": None}`` on a rank that raised none."""
    from ep_runtime.core.errors import EPCapacityError
    from ep_runtime.core.runtime import EPRuntime

    r = session.rank
    xs, ids, ws = make_inputs(cfg, "one_expert", seed, n_tokens=[6] * cfg.n_ranks)
    res = {"error": None}
    with EPRuntime(cfg, session, plan=plan) as rt:
        try:
            rt.dispatch(xs[r].view(np.uint16), ids[r], ws[r], layout=cfg.layouts[0])
        except EPCapacityError as exc:
            res["error"] = str(exc)
        session.barrier()
    return res


def silent_peer_pe(session, plan: dict, cfg: EPConfig, seed: int, callers=(0,)) -> dict:
    """Under plan overrides ``plan``: one round trip of "random" inputs of ``seed`` on every rank
    (each combine grants call 1 its token credits), then only the ranks in ``callers`` make a
    second dispatch, which waits for the others until ``cfg.wait_timeout_s``: ``{"error":
    message}`` of a caller's EPTimeoutError (None on the others, or where none was raised)."""
    from ep_runtime.core import reference
    from ep_runtime.core.errors import EPTimeoutError
    from ep_runtime.core.runtime import EPRuntime

    r = session.rank
    xs, ids, ws = make_inputs(cfg, "random", seed)
    res = {"error": None}
    with EPRuntime(cfg, session, plan=plan) as rt:
        batch = rt.dispatch(xs[r].view(np.uint16), ids[r], ws[r])
        rt.combine(expert_outputs(cfg, reference.dispatch(xs, ids, ws, cfg)[r], r), batch.handle)
        if r in callers:
            try:
                rt.dispatch(xs[r].view(np.uint16), ids[r], ws[r])
            except EPTimeoutError as exc:
                res["error"] = str(exc)
        session.barrier()
    return res


# -- round trips over the awkward routings, one runtime per plan ---------------------------------------
#: The routings the plan tests cycle through, one a call in turn (the awkward ones included).
CALL_SCENARIOS = ("random", "zero_rank", "masked", "one_expert")


def call_layout(cfg: EPConfig, call: int) -> str:
    """The layout of call ``call`` of a runtime serving ``cfg.layouts``: the one it serves, or
    expanded, compact, expanded, expanded, compact, ... for both."""
    if len(cfg.layouts) == 1:
        return cfg.layouts[0]
    return "expanded" if call % 3 != 1 else "compact"


def call_inputs(cfg: EPConfig, call: int, seed: int):
    """The inputs of call ``call`` (``seed + call``, the routing of :data:`CALL_SCENARIOS` in
    turn): random token counts at call 0, none anywhere at call 3, varying ones (some rank with
    none) at the others."""
    counts = None if call == 0 else [0] * cfg.n_ranks if call == 3 else \
        [(call + 2 * r) % (cfg.max_tokens_per_rank + 1) for r in range(cfg.n_ranks)]
    return make_inputs(cfg, CALL_SCENARIOS[call % len(CALL_SCENARIOS)], seed + call, counts)


#: The batch fields those tests compare (``ExpertBatch`` and ``CompactBatch`` attributes).
BATCH_FIELDS = ("x", "row_offsets", "expert_counts", "src_rank", "src_token", "src_k", "weight")
#: The FP8 calls of those tests: (layout, scale layout).
FP8_CALLS = (("expanded", "row"), ("compact", "row"), ("expanded", "column"))


def combine_over_tolerance(cfg: EPConfig, refs: list, ids: list, ws: list, rank: int, out: np.ndarray,
                           node_size: int = 0):
    """A GPU check's combine on ``rank`` of every rank's :func:`expert_outputs` of the reference
    batches ``refs``: ``out`` [T, H] bf16 bits against ``reference.combine`` (in the hierarchical
    transport's order for ``node_size``). None when every token is within
    ``reference.combine_tolerance`` (of the weights of its routed slots: a GPU's fused
    multiply-adds round differently from the reference), else the largest error."""
    from ep_runtime.core import reference

    ys = [expert_outputs(cfg, refs[s], s) for s in range(cfg.n_ranks)]
    want = reference.combine(ys, refs, ids, cfg, home_ranks=[rank], node_size=node_size)[rank].astype(np.float32)
    # the largest output of a real row (padding rows hold NaN: a NaN bound would pass anything)
    y_max = max(float(np.abs(y.view(reference.BF16)[:b.n_rows][b.src_rank >= 0].astype(np.float32)).max(initial=0))
                for y, b in zip(ys, refs))
    tol = reference.combine_tolerance(np.where(reference.routed_ids(ids[rank], cfg.n_experts) >= 0, ws[rank], 0),
                                      y_max)  # [T, 1]: each token's own bound
    err = np.abs(out.view(reference.BF16).astype(np.float32) - want)
    return float(err.max()) if not (err <= tol).all() else None


def rank_rows(all_rows: list) -> list[str]:
    """A GPU check's (tests/gpu/) per-rank ``(what, result)`` rows, gathered on rank 0, as lines
    ``rank r  what  result``."""
    return [f"rank {r}  {what:<40} {result}" for r, rows in enumerate(all_rows) for what, result in rows]


def gpu_check_report(all_failures: list, lines: list) -> int:
    """Rank 0 of a GPU check: every rank's failures (``all_failures``, a list per rank) as
    ``FAIL: ...``, then ``lines`` (its table), then PASS or FAIL. Returns the exit code (0: PASS)."""
    failures = sum(all_failures, [])
    for f in failures:
        print("FAIL:", f)
    for line in lines:
        print(line)
    print("FAIL" if failures else "PASS")
    return 1 if failures else 0


def padded_to_capacity(session, cfg: EPConfig, x, i, w):
    """``(x, i, w, n_tokens)``: this rank's inputs (host arrays: bf16 bits, ids, weights) padded
    to the runtime's capacity (NaN token rows, distinct ids, weights 1) and their token count as
    a [1] int32 device scalar, as a captured CUDA graph passes them to ``dispatch_async``."""
    T, n = cfg.max_tokens_per_rank, len(x)
    x = np.vstack([x, np.full((T - n, cfg.hidden), POISON_BF16, np.uint16)])
    i = np.vstack([i, np.zeros((T - n, cfg.top_k), np.int32) + np.arange(cfg.top_k, dtype=np.int32)])
    w = np.vstack([w, np.ones((T - n, cfg.top_k), np.float32)])
    return x, i, w, session.to_device(np.array([n], np.int32))


def dispatch_to_host(session, rt, cfg: EPConfig, x, i, w, layout: str, device_count: bool = False):
    """One dispatch of this rank's ``x`` (bf16 bits), ``i`` (ids), ``w`` (weights), host arrays, in ``layout``:
    ``(got, batch)``, ``got`` the batch's :data:`BATCH_FIELDS` as host copies (the compact
    layout's ``gather`` and ``recv_tokens`` too). ``device_count``: the inputs padded to the
    runtime's capacity (NaN token rows, distinct ids, weights 1) and the token count passed as a
    device scalar (``n_tokens``), as a captured CUDA graph passes it (:func:`padded_to_capacity`)."""
    n_tokens = None
    if device_count:
        x, i, w, n_tokens = padded_to_capacity(session, cfg, x, i, w)
    x, i, w = (session.to_device(a) for a in (x, i, w))  # host arrays in: the same on every backend
    batch = rt.dispatch_wait(rt.dispatch_async(x, i, w, n_tokens=n_tokens), layout=layout)
    got = {k: session.to_host(getattr(batch, k)).copy() for k in BATCH_FIELDS}
    if layout == "compact":
        got["gather"] = session.to_host(batch.gather).copy()
        got["recv_tokens"] = session.to_host(batch.recv_tokens).copy()
    return got, batch


def round_trip_with_error(session, rt, cfg: EPConfig, xs, ids, ws, layout: str) -> dict:
    """One dispatch of this rank's inputs in ``layout`` (as the session's arrays) and the combine
    of the reference's expert outputs: the batch's :data:`BATCH_FIELDS` (and the compact
    layout's ``gather`` and ``recv_tokens``) and the combine output (``"out"``) as host copies,
    and the ``EPInputError`` message the next synchronize raised (``"error"``, or None): what a
    call with bad expert ids leaves behind."""
    from ep_runtime.core import reference
    from ep_runtime.core.errors import EPInputError

    r, dev = session.rank, session.to_device
    batch = rt.dispatch_wait(rt.dispatch_async(dev(np.ascontiguousarray(xs[r].view(np.uint16))), dev(ids[r]),
                                               dev(ws[r])), layout=layout)
    got = {k: session.to_host(getattr(batch, k)).copy() for k in BATCH_FIELDS}
    if layout == "compact":
        got["gather"] = session.to_host(batch.gather).copy()
        got["recv_tokens"] = session.to_host(batch.recv_tokens).copy()
    out = rt.combine_wait(rt.combine_async(dev(expert_outputs(cfg, reference.dispatch(xs, ids, ws, cfg)[r], r)),
                                           batch.handle))
    try:
        rt.synchronize()
        got["error"] = None
    except EPInputError as e:
        got["error"] = str(e)
    got["out"] = session.to_host(out).copy()[:len(xs[r])]
    return got


def plan_round_trips(session, rt, cfg: EPConfig, calls: int, seed: int, device_count: bool,
                     buffers: tuple = ()) -> list:
    """``calls`` round trips on ``rt`` (call c: :func:`call_inputs` in :func:`call_layout`), each
    with the combine of the reference's expert outputs: per call, :func:`dispatch_to_host`'s
    fields, the combine output (``"out"``, this rank's tokens) and a host copy of each runtime
    region named in ``buffers``, taken once every rank has finished the call (no peer's next
    call writes there yet)."""
    from ep_runtime.core import reference

    r, out = session.rank, []
    for call in range(calls):
        xs, ids, ws = call_inputs(cfg, call, seed)
        got, batch = dispatch_to_host(session, rt, cfg, xs[r].view(np.uint16), ids[r], ws[r],
                                      call_layout(cfg, call), device_count)
        refs = reference.dispatch(xs, ids, ws, cfg)
        y = session.to_device(expert_outputs(cfg, refs[r], r))  # a gathering GEMM writes expanded-order outputs
        got["out"] = session.to_host(rt.combine(y, batch.handle)).copy()[:len(xs[r])]
        session.barrier()
        for name in buffers:
            got[name] = session.to_host(rt.buffers[name]).copy()
        session.barrier()
        out.append(got)
    return out


def plan_pe(session, plan: dict, cfg: EPConfig, calls: int, seed: int, device_count: bool = False,
            buffers: tuple = ()) -> dict:
    """:func:`plan_round_trips` on a runtime of ``cfg`` under plan overrides ``plan``, with the
    plan it took (``as_dict``) and the regions it allocated."""
    from ep_runtime.core.runtime import EPRuntime

    with EPRuntime(cfg, session, plan=plan) as rt:
        got = plan_round_trips(session, rt, cfg, calls, seed, device_count,
                               tuple(b for b in buffers if rt.layout.has(b)))
        return {"calls": got, "plan": rt.plan.as_dict(), "regions": [r.name for r in rt.layout.regions]}


def received_batch(got: dict):
    """The expanded batch a rank received (:func:`dispatch_to_host`'s host copies) as a
    :class:`~ep_runtime.core.reference.ExpertBatchRef`, for :func:`expert_outputs`."""
    from ep_runtime.core import reference

    n = int(got["row_offsets"][-1])
    return reference.ExpertBatchRef(x=got["x"][:n].view(BF16), row_offsets=got["row_offsets"],
                                    expert_counts=got["expert_counts"],
                                    **{k: got[k][:n] for k in ("src_rank", "src_token", "src_k", "weight")})


def wide_round_trip_pe(session, n_nodes: int, cfg: EPConfig, plan: dict, seed: int) -> dict:
    """As ``n_nodes`` logical nodes (1: one node), one round trip of call 0's inputs
    (:func:`call_inputs`) in the expanded layout under plan overrides ``plan``, combining the
    :func:`expert_outputs` of the batch this rank received: ``{"calls": [fields and "out"],
    "plan": ..., "traffic": ...}``, what :func:`assert_calls_are_the_reference` and
    :func:`assert_traffic_is_the_model` take (``traffic``: what the round trip's kernels put and
    signalled, ``session.traffic()``).

    Unlike :func:`plan_pe` no rank computes the reference's batches (of every rank: work that
    grows with the ranks squared in every rank); :func:`assert_calls_are_the_reference` checks
    every batch once, so a wrong batch fails there and a combine of it cannot pass.
    """
    from ep_runtime.core.runtime import EPRuntime

    r = session.rank
    if n_nodes > 1:
        session.use_logical_nodes(n_nodes)
    xs, ids, ws = call_inputs(cfg, 0, seed)
    session.traffic(reset=True)
    with EPRuntime(cfg, session, plan=plan) as rt:
        got, batch = dispatch_to_host(session, rt, cfg, xs[r].view(np.uint16), ids[r], ws[r], "expanded")
        y = session.to_device(expert_outputs(cfg, received_batch(got), r))
        got["out"] = session.to_host(rt.combine(y, batch.handle)).copy()[:len(xs[r])]
        return {"calls": [got], "plan": rt.plan.as_dict(), "traffic": session.traffic(reset=True)}


def assert_batch_is_the_reference(got: dict, ref, layout: str, xs, cfg: EPConfig, what: str) -> None:
    """One rank's batch (``got``, from :func:`dispatch_to_host`) against the reference's ``ref``:
    offsets, counts, row descriptions and weights bit for bit; the expanded rows, or the compact
    rows each gather index picks, and each source's token count."""
    from ep_runtime.core import reference

    n = ref.n_rows
    np.testing.assert_array_equal(got["row_offsets"], ref.row_offsets, err_msg=what)
    np.testing.assert_array_equal(got["expert_counts"], ref.expert_counts, err_msg=what)
    for k in ("src_rank", "src_token", "src_k"):
        np.testing.assert_array_equal(got[k][:n], getattr(ref, k), err_msg=f"{what}: {k}")
    np.testing.assert_array_equal(got["weight"][:n].view(np.uint32), ref.weight.view(np.uint32), what)
    if layout == "expanded":
        np.testing.assert_array_equal(got["x"][:n], ref.x.view(np.uint16), err_msg=f"{what}: x")
    else:
        assert got["recv_tokens"].tolist() == [len(x) for x in xs], what
        np.testing.assert_array_equal(got["gather"][:n], reference.gather_index(ref, cfg), what)
        real = got["gather"][:n] >= 0
        np.testing.assert_array_equal(got["x"][got["gather"][:n][real]], ref.x.view(np.uint16)[real],
                                      err_msg=f"{what}: x[gather]")


def assert_calls_are_the_reference(cfg: EPConfig, runs: list, calls: int, seed: int, what: str,
                                   node_size: int = 0) -> None:
    """:func:`plan_pe`'s runs against the reference: every call's batch on every rank
    (:func:`assert_batch_is_the_reference`) and its combine output, bit for bit (summed in the
    hierarchical transport's order for ``node_size`` PEs a node: ``reference.combine``)."""
    from ep_runtime.core import reference

    for call in range(calls):
        xs, ids, ws = call_inputs(cfg, call, seed)
        refs = reference.dispatch(xs, ids, ws, cfg)
        outs = reference.combine([expert_outputs(cfg, refs[s], s) for s in range(cfg.n_ranks)], refs, ids, cfg,
                                 node_size=node_size)
        layout = call_layout(cfg, call)
        for r in range(cfg.n_ranks):
            got, at = runs[r]["calls"][call], f"{what}: rank {r} call {call} ({layout})"
            assert_batch_is_the_reference(got, refs[r], layout, xs, cfg, at)
            np.testing.assert_array_equal(got["out"], outs[r].view(np.uint16), err_msg=f"{at}: combine")


def assert_traffic_is_the_model(cfg: EPConfig, runs: list, routings: list, size: int, node_stores: bool) -> None:
    """What each PE's kernels put and signalled to each other PE (``session.traffic``) against
    the traffic model (bench.traffic, docs/cluster.md), PE to PE: across nodes the bytes
    (``pair_bytes``) and the operations (``pair_ops``: a put per chunk, not per row); within a
    node the model's bytes when the plan puts there, and when it stores there only 8-byte
    signals (credits, flags, dispatch signals) and the counts rows a proxy forwards with the
    signal of each source of another node (no row, partial or routing row goes as a put)."""
    from ep_runtime.tools.bench.traffic import pair_bytes, pair_ops

    R, L = cfg.n_ranks, cfg.n_local_experts
    for r, got in enumerate(runs):
        for d in range(R):
            if d == r:
                continue
            ops, sent = int(got["traffic"][d, 0]), int(got["traffic"][d, 1])
            if d // size == r // size and node_stores:
                rows = len(routings) * (R // size - 1)  # a counts row a call per source r is the proxy of
                assert sent == 8 * (ops - rows) + rows * 4 * (L + 1), \
                    f"rank {r} to {d} (its node, stores): {ops} operations of {sent} bytes are not {rows} counts " \
                    f"rows and 8-byte signals: something else went as a put"
                continue
            model = sum(pair_bytes(ids, r, d, L, size, cfg.token_bytes, cfg.partial_bytes, cfg.slot_bytes)
                        for ids in routings)
            assert model == sent, f"rank {r} to {d}: model {model}, sent {got['traffic'][d]}"
            if d // size != r // size:  # and the operations across: a put per chunk, not per row
                model_ops = sum(pair_ops(ids, r, d, L, size) for ids in routings)
                assert model_ops == ops, f"rank {r} to {d}: model {model_ops} operations, sent {got['traffic'][d]}"


def fp8_plan_pe(session, plan: dict, cfg: EPConfig, seed: int, prequantized: bool = False) -> dict:
    """Under plan overrides ``plan``, quantized tokens quantized in dispatch_async (``prequantized``:
    quantized by the format's NumPy encoder and passed with their scales, and in NVFP4 their
    global scale, the rule's), the calls of :data:`FP8_CALLS` (the layouts ``cfg`` serves; inputs
    of :func:`call_inputs`), each batch's :data:`BATCH_FIELDS`, scales (NVFP4: global scales) and
    compact gather as host copies, and the combine output."""
    from ep_runtime.core import reference
    from ep_runtime.core.runtime import EPRuntime

    r, out, fmt = session.rank, [], cfg.token_format
    fields = BATCH_FIELDS + ("scales",) + (("global_scales",) if fmt.has_global_scale else ())
    with EPRuntime(cfg, session, plan=plan) as rt:
        for call, (layout, scales) in enumerate(c for c in FP8_CALLS if c[0] in cfg.layouts):
            xs, ids, ws = call_inputs(cfg, call, seed)
            tokens, kw = xs[r].view(np.uint16), {}
            if prequantized:
                g = reference.global_scales(xs, cfg)
                tokens, token_scales = fmt.quantize(tokens, g[r]) if g else fmt.quantize(tokens)
                kw = {"token_scales": session.to_device(token_scales)}
                if g:
                    kw["token_global_scale"] = session.to_device(np.array([g[r]], np.float32))
            dev = [session.to_device(np.ascontiguousarray(a)) for a in (tokens, ids[r], ws[r])]
            batch = rt.dispatch_wait(rt.dispatch_async(*dev, **kw), layout=layout, scales=scales)
            got = {k: session.to_host(getattr(batch, k)).copy() for k in fields}
            if layout == "compact":
                got["gather"] = session.to_host(batch.gather).copy()
            refs = reference.dispatch(xs, ids, ws, cfg)
            y = session.to_device(expert_outputs(cfg, refs[r], r))
            got["out"] = session.to_host(rt.combine(y, batch.handle)).copy()
            got["layout"], got["scale_layout"] = layout, scales
            out.append(got)
    return {"calls": out, "plan": rt.plan.as_dict()}


def assert_fp8_calls_are_the_reference(cfg: EPConfig, runs: list, seed: int, prequantized: bool, what: str,
                                       node_size: int = 0, exact_combine: bool = True) -> None:
    """:func:`fp8_plan_pe`'s runs against the reference: offsets, descriptions, the codes (the
    expanded rows, or the compact rows each gather index picks) and their scales (in the scale
    layout asked for; NVFP4: and global scales) bit for bit; the combine output too (in the
    hierarchical order for ``node_size``, as :func:`assert_calls_are_the_reference`), or with
    ``exact_combine`` False within the reference's tolerance (:func:`combine_over_tolerance`: a
    GPU's FMA contraction)."""
    from ep_runtime.core import reference

    for call in range(len(runs[0]["calls"])):
        xs, ids, ws = call_inputs(cfg, call, seed)
        codes_in, scales_in = xs, None
        if prequantized:
            enc = reference.encoded_tokens(xs, cfg)
            codes_in, scales_in = [c for c, _ in enc], [sc for _, sc in enc]
        refs = reference.dispatch(codes_in, ids, ws, cfg, scales_in, reference.global_scales(xs, cfg))
        outs = reference.combine([expert_outputs(cfg, reference.dispatch(xs, ids, ws, cfg)[s], s)
                                  for s in range(cfg.n_ranks)], reference.dispatch(xs, ids, ws, cfg), ids, cfg,
                                 node_size=node_size)
        for r in range(cfg.n_ranks):
            got, ref = runs[r]["calls"][call], refs[r]
            layout, n = got["layout"], ref.n_rows
            at = f"{what}: rank {r} call {call} ({layout}, {got['scale_layout']} scales)"
            np.testing.assert_array_equal(got["row_offsets"], ref.row_offsets, err_msg=at)
            for k in ("src_rank", "src_token", "src_k"):
                np.testing.assert_array_equal(got[k][:n], getattr(ref, k), err_msg=f"{at}: {k}")
            if layout == "expanded":
                np.testing.assert_array_equal(got["x"][:n], ref.x.view(np.uint8), err_msg=f"{at}: codes")
                sc = got["scales"].T if got["scale_layout"] == "column" else got["scales"]
                np.testing.assert_array_equal(np.ascontiguousarray(sc[:n]).view(np.uint8), ref.scales.view(np.uint8),
                                              err_msg=f"{at}: scales")
                if ref.global_scales is not None:
                    np.testing.assert_array_equal(got["global_scales"][:n], ref.global_scales,
                                                  err_msg=f"{at}: global scales")
            else:
                rows = got["gather"][:n]
                real = rows >= 0
                np.testing.assert_array_equal(got["x"][rows[real]], ref.x.view(np.uint8)[real], err_msg=f"{at}: codes")
                np.testing.assert_array_equal(got["scales"][rows[real]].view(np.uint8),
                                              ref.scales[real].view(np.uint8), err_msg=f"{at}: scales")
                if ref.global_scales is not None:
                    np.testing.assert_array_equal(got["global_scales"][rows[real]], ref.global_scales[real],
                                                  err_msg=f"{at}: global scales")
            if exact_combine:
                np.testing.assert_array_equal(got["out"][:len(xs[r])], outs[r].view(np.uint16),
                                              err_msg=f"{at}: combine")
            else:
                err = combine_over_tolerance(cfg, reference.dispatch(xs, ids, ws, cfg), ids, ws, r,
                                             got["out"][:len(xs[r])], node_size)
                assert err is None, f"{at}: the combine is off by {err}, over its tolerance"
