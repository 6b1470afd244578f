"""Acceptance tests of `EPRuntime` on the CPU simulator: the real kernels, one process per rank.

Every case is checked against the NumPy oracle (:mod:`ep_runtime.core.reference`): dispatch exactly
(row bits, offsets, counts, sources, weight bits), combine within
``reference.combine_tolerance`` and, on the simulator (no FMA contraction), bit for bit.
Token rows encode their origin (:func:`ep_runtime.testing.make_tokens`), so a wrong row is
reported with the place it came from (:func:`ep_runtime.testing.describe_row`).

A simulated round trip costs about a second of process start-up plus a fraction of a second
per call, so the cases of a world size run together: one :func:`run_pes` call per (suite,
world size), made lazily and cached for the module. Each case builds its own `EPRuntime`,
closes it, and returns host copies of everything; the many small tests below assert on the
cached results. The per-rank bodies (``*_pe``) live here so that the PE processes import them
by name; they catch the errors a case expects and return ``(type name, message)``.

Suites (``sim(suite, R)``):

- ``correctness``: routing scenarios and awkward shapes (:func:`correctness_cases`), a
  summation-order probe (:func:`probe_routing`: bit equality alone rarely notices another
  summation order, wider precision or an FMA, because bf16 rounding hides them), repeated
  runs, back-to-back calls, skipped combines, unreduced partials, an epilogue;
- ``misuse``: bad arguments (EPInputError before any launch, the runtime stays usable),
  routing faults (EPInputError from the device-side check of debug mode, always on for the
  simulator: the runtime refuses calls until reset()), handle misuse (EPStateError), between
  good calls;
- ``capacity``: one rank overflows ``max_recv_rows``; its peers time out in combine; reset();
- ``skip``: one rank skips a dispatch, then one rank's routing check fails; each time its
  peers time out in dispatch naming it; reset().

The failure suites use ``wait_timeout_s = FAIL_WAIT_TIMEOUT_S`` and end with a good round
trip, checked like the others.
"""

import time
import traceback
from dataclasses import dataclass, replace

import numpy as np
import pytest

from ep_runtime.core import reference
from ep_runtime.core.config import EPConfig
from ep_runtime.core.reference import BF16
from ep_runtime.shmem.launch import run_pes
from ep_runtime.testing import describe_row, linear_experts, make_inputs

WORLD_SIZES = (2, 4)
#: Limit of one run_pes call (a suite takes ~5-20 s on a 2-core CI machine).
RUN_TIMEOUT_S = 240
#: wait_timeout_s of the cases that provoke device-side timeouts: short, so CI stays fast.
FAIL_WAIT_TIMEOUT_S = 1.0
#: bf16 bits written into expert-output rows that combine must never read (padding rows and
#: rows past the batch): a quiet NaN, so reading one poisons the output.
POISON_BF16 = 0x7FC0
#: Rows of a mismatching batch listed in a failure message.
MAX_REPORTED_ROWS = 8
BATCH_FIELDS = ("x", "row_offsets", "expert_counts", "src_rank", "src_token", "src_k", "weight")


# -- cases --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    """One configuration and routing of a world size (picklable: sent to the PEs)."""

    name: str
    cfg: dict
    scenario: str = "random"
    seed: int = 0
    n_tokens: tuple | None = None  # per-rank token counts; None: random in [1, max]
    probe: bool = False  # summation-order probe: probe_routing and PROBE_SCALES experts

    def config(self) -> EPConfig:
        return EPConfig(**self.cfg)

    def inputs(self):
        cfg = self.config()
        xs, ids, ws = make_inputs(cfg, self.scenario, self.seed,
                                  None if self.n_tokens is None else list(self.n_tokens))
        if self.probe:
            ids, ws = map(list, zip(*(probe_routing(cfg, s, len(x)) for s, x in enumerate(xs))))
        return xs, ids, ws


def base_cfg(n_ranks: int, **changes) -> dict:
    """2 local experts per rank, top-2, hidden 16, up to 6 tokens per rank."""
    return {**dict(n_ranks=n_ranks, n_experts=2 * n_ranks, top_k=2, hidden=16, max_tokens_per_rank=6),
            **changes}


#: Summation-order probe: local expert i of every rank multiplies its rows by PROBE_SCALES[i]
#: (powers of two: exact in bf16). With equal weights, a token's terms come in exactly
#: cancelling pairs next to a small term, so float32 sums in another order than the documented
#: one (ascending expert, then ascending rank), in higher precision, or with a fused
#: multiply-add change the bf16 result by far more than an ulp.
PROBE_SCALES = (2.0**25, -(2.0**25), 1.0, -(2.0**25))
PROBE_LOCAL_EXPERTS = len(PROBE_SCALES)
#: A weight whose products with bf16 values are inexact in float32 (an FMA would show).
PROBE_INEXACT_WEIGHT = np.float32(0.1)


def probe_routing(cfg: EPConfig, s: int, n_tokens: int):
    """``(ids [T, 3] int32, weights [T, 3] float32)`` of rank ``s`` for the probe. Token kinds,
    by ``t % 5`` (``t % 3`` below 3 ranks), with target rank ``q = (s + t) % R``, listing each
    token's terms in the documented order (ids are stored in descending order: the order is by
    expert, not by k slot); B is 2**25 x / 4, 1 is x / 4:

    0. experts 0, 1, 2 of q, weights 1/4: (+B, -B, 1) in one partial: wrong order loses the 1;
    1. experts 0, 2, 3 of q, weights 1/4: (+B, 1, -B): float32 loses the 1, wider precision keeps it;
    2. experts 0, 1, 2 of q, weights 0.1: an FMA leaves the rounding error of 0.1 * B x;
    3. (R >= 3) expert 0, 1, 2 of three ranks q0 < q1 < q2: (+B, -B, 1) across ranks;
    4. (R >= 3) expert 0, 2, 3 of ranks q0 < q1 < q2: (+B, 1, -B) across ranks.
    """
    R, L = cfg.n_ranks, cfg.n_local_experts
    assert L == PROBE_LOCAL_EXPERTS and cfg.top_k == 3
    ids = np.zeros((n_tokens, 3), np.int32)
    ws = np.full((n_tokens, 3), 0.25, np.float32)
    for t in range(n_tokens):
        kind = t % 5 if R >= 3 else t % 3
        q = (s + t) % R
        local = (0, 1, 2) if kind in (0, 2, 3) else (0, 2, 3)
        ranks = sorted((q + i) % R for i in range(3)) if kind >= 3 else [q] * 3
        ids[t] = [rank * L + i for rank, i in zip(ranks, local)][::-1]
        if kind == 2:
            ws[t] = PROBE_INEXACT_WEIGHT
    return ids, ws


def correctness_cases(R: int) -> list[Case]:
    """Single round trips; the simulator's block has 8 threads (``runtime.SIM_THREADS``)."""
    return [
        Case("random", base_cfg(R), seed=1),
        Case("random_3_local_experts_top3", base_cfg(R, n_experts=3 * R, top_k=3), seed=2),
        Case("zero_rank", base_cfg(R), "zero_rank", seed=3),
        Case("empty_expert", base_cfg(R), "empty_expert", seed=4),
        Case("one_expert", base_cfg(R), "one_expert", seed=5),
        Case("masked", base_cfg(R), "masked", seed=26),
        Case("masked_top_k_1", base_cfg(R, top_k=1), "masked", seed=27),
        Case("top_k_1", base_cfg(R, top_k=1), seed=6),
        Case("top_k_all_experts", base_cfg(R, top_k=2 * R), seed=7),
        Case("one_local_expert", base_cfg(R, n_experts=R, top_k=min(2, R)), seed=8),
        Case("pad_4", base_cfg(R, pad_multiple=4), seed=9),
        Case("pad_3_empty_expert", base_cfg(R, pad_multiple=3), "empty_expert", seed=10),
        Case("pad_4_zero_rank", base_cfg(R, pad_multiple=4), "zero_rank", seed=11),
        # token words (layout.token_word): 16 -> uint64 (4 bf16), 6 -> uint32 (2), 5 -> uint16 (1)
        Case("hidden_20", base_cfg(R, hidden=20), seed=12),
        Case("hidden_6_uint32_words", base_cfg(R, hidden=6), seed=22),
        Case("hidden_5", base_cfg(R, hidden=5), seed=13),
        Case("n_sms_1", base_cfg(R, n_sms=1), seed=14),
        Case("n_sms_3", base_cfg(R, n_sms=3), seed=15),
        # several ranking rounds per source (19 tokens > the routing block's 8 threads)
        Case("many_tokens_n_sms_3", base_cfg(R, hidden=8, max_tokens_per_rank=19, n_sms=3), seed=16,
             n_tokens=(19,) * R),
        # many ranking rounds per source (70 tokens > 8 rounds of the routing block's 8 threads)
        # and the words-in-flight loops of dispatch_copy and both combine kernels, full passes and
        # tail (hidden 552: 138 uint64 words = 2 passes of 8 lanes x 8 words + 10)
        Case("scan_chunks_unrolled_copy", base_cfg(R, hidden=552, max_tokens_per_rank=70, n_sms=2), seed=23,
             n_tokens=(70,) * R),
        Case("no_tokens_anywhere", base_cfg(R), seed=17, n_tokens=(0,) * R),
        # more local experts than the block's 8 threads: each thread of the placement scan sums a run
        # of 3 experts (ep_runtime/kernels/dispatch.py, scan_placement), padded segments inside a run
        Case("local_experts_beyond_threads_pad_2", base_cfg(R, n_experts=20 * R, top_k=5, pad_multiple=2,
                                                            max_tokens_per_rank=9), seed=25, n_tokens=(9,) * R),
        # few rows, wide rows, many warps: rows cut into parts (ep_runtime/kernels/block.py, row_parts):
        # 3 rows x 4 parts of 16 words on 8 blocks of one 8-lane warp
        Case("row_parts_small_batch_wide_rows", base_cfg(R, hidden=256, max_tokens_per_rank=3, n_sms=8),
             seed=24, n_tokens=(3,) * R),
        # experts 0 and 1 (rank 0) get 3R tokens each, padded to 4: exactly max_recv_rows rows
        Case("one_expert_exactly_at_capacity",
             base_cfg(R, pad_multiple=4, max_recv_rows=2 * (-(-3 * R // 4) * 4)), "one_expert", seed=19,
             n_tokens=(3,) * R),
        Case("summation_order_probe", base_cfg(R, n_experts=PROBE_LOCAL_EXPERTS * R, top_k=3,
                                               max_tokens_per_rank=10), seed=18, n_tokens=(10,) * R,
             probe=True),
    ]


def repeat_case(R: int) -> Case:
    return Case("repeat", base_cfg(R, n_experts=3 * R, top_k=3, hidden=12), seed=21)


#: Back-to-back calls on one runtime.
N_CALLS = 5


def call_token_counts(R: int, T: int) -> list[tuple]:
    """Tokens per rank of each of N_CALLS calls: varying by rank and by call, 0 for some rank
    in some calls (call 2 has rank 0 at 0 for every world size)."""
    return [tuple((3 * c + 2 * r + 1) % (T + 1) for r in range(R)) for c in range(N_CALLS)]


def back_to_back_cases(R: int) -> list[Case]:
    cfg = base_cfg(R)
    return [Case(f"call{c}", cfg, seed=100 + c, n_tokens=counts)
            for c, counts in enumerate(call_token_counts(R, cfg["max_tokens_per_rank"]))]


def device_count_cases(R: int) -> list[Case]:
    """Calls whose token counts come from a device scalar; decoys come from a full-size case
    (seed 300) prepended as the first entry (not itself a call)."""
    cfg = base_cfg(R)
    T = cfg["max_tokens_per_rank"]
    return [Case("decoys", cfg, seed=300, n_tokens=(T,) * R)] + [
        Case(f"call{c}", cfg, seed=310 + c, n_tokens=counts)
        for c, counts in enumerate(call_token_counts(R, T))]


#: Which calls of the skip-combine run also combine (the others dispatch only).
SKIP_COMBINE_PATTERN = (True, False, False, True, False, True)


def skip_combine_cases(R: int) -> list[Case]:
    cfg = base_cfg(R, pad_multiple=2)
    return [Case(f"call{c}", cfg, seed=200 + c) for c in range(len(SKIP_COMBINE_PATTERN))]


def partials_case(R: int) -> Case:
    return Case("partials", base_cfg(R, n_experts=3 * R, top_k=3), seed=31)


#: The epilogue's cases: hidden 20 (5 uint64 words a row: combine_wait's one-word loop) and
#: hidden 24 (6 words: its word-pair loop, ep_runtime/kernels/vec.py).
EPILOGUE_HIDDEN = {"epilogue": 20, "epilogue_word_pairs": 24}


def epilogue_case(R: int, name: str = "epilogue") -> Case:
    return Case(name, base_cfg(R, n_experts=3 * R, top_k=3, hidden=EPILOGUE_HIDDEN[name]), seed=41)


def aux_for(rank: int, n_tokens: int, hidden: int) -> np.ndarray:
    """The epilogue's residual of rank ``rank``: [T, H] float32."""
    return np.random.default_rng(1000 + rank).standard_normal((n_tokens, hidden)).astype(np.float32)


def residual_add(value, token, col, aux):
    """Epilogue body (made a Numba device function in the PEs): value + aux[token, col]."""
    return value + aux[token, col]


def misuse_case(R: int) -> Case:
    return Case("misuse", base_cfg(R), seed=51, n_tokens=(4,) * R)


def capacity_case(R: int) -> Case:
    """Every token goes to experts 0 and 1 (both on rank 0): rank 0 needs 2 * 2R rows, more
    than the capacity 2R; the other ranks receive nothing."""
    return Case("capacity", base_cfg(R, max_recv_rows=2 * R, wait_timeout_s=FAIL_WAIT_TIMEOUT_S),
                "one_expert", seed=61, n_tokens=(2,) * R)


def capacity_recovery_case(R: int) -> Case:
    """Fits in the capacity 2R: each rank receives at most R tokens x 2 local experts."""
    c = capacity_case(R)
    return Case("capacity_recovery", c.cfg, seed=62, n_tokens=(1,) * R)


def skip_case(R: int) -> Case:
    return Case("skip", base_cfg(R, wait_timeout_s=FAIL_WAIT_TIMEOUT_S), seed=71, n_tokens=(4,) * R)


def skip_recovery_case(R: int) -> Case:
    return Case("skip_recovery", skip_case(R).cfg, seed=72)


#: The rank that overflows in capacity_case, and the rank that skips a dispatch or sends bad
#: routing in the ``skip`` suite.
OVERFLOW_RANK = 0
FAULTY_RANK = 1


# -- shared by the PEs and the parent -----------------------------------------------------------
def expert_outputs(case: Case, ref: reference.ExpertBatchRef, rank: int) -> np.ndarray:
    """The expert outputs a rank passes to combine: [capacity, H] uint16, the linear experts of
    ``testing`` (or PROBE_SCALES) on the batch's rows, POISON_BF16 on padding rows and rows
    past the batch."""
    cfg = case.config()
    y = np.full((cfg.recv_rows_capacity, cfg.hidden), POISON_BF16, np.uint16)
    n = ref.n_rows
    if case.probe:
        scale = np.repeat(np.array(PROBE_SCALES, np.float32), np.diff(ref.row_offsets))[:, None]
        y[:n] = (ref.x.astype(np.float32) * scale).astype(BF16).view(np.uint16)
    else:
        y[:n] = linear_experts(ref.x, ref.row_offsets, cfg.n_local_experts, rank).view(np.uint16)
    y[:n][ref.src_rank < 0] = POISON_BF16
    return y


# -- per-rank bodies (run in the PE processes) ------------------------------------------------
def _host_batch(session, batch) -> dict:
    return {k: session.to_host(getattr(batch, k)) for k in BATCH_FIELDS}


def _caught(call) -> tuple | None:
    """Run ``call``; ``(type name, message)`` of what it raised, or None."""
    try:
        call()
    except Exception as err:  # noqa: BLE001 - the type is part of the result
        return type(err).__name__, str(err)
    return None


def _round_trip(session, rt, case: Case, **combine_kwargs) -> dict:
    """One dispatch + combine of ``case`` on ``rt``; host copies of the batch and output."""
    cfg, r = case.config(), session.rank
    xs, ids, ws = case.inputs()
    batch = rt.dispatch(session.to_device(xs[r].view(np.uint16)), session.to_device(ids[r]),
                        session.to_device(ws[r]))
    got = _host_batch(session, batch)
    y = expert_outputs(case, reference.dispatch(xs, ids, ws, cfg)[r], r)
    out = rt.combine(session.to_device(y), batch.handle, **combine_kwargs)
    return {"batch": got, "out": session.to_host(out)}


def _run_cases(cases: dict, run_one) -> dict:
    """``{name: run_one(case) or {"error": traceback}}``: one broken case does not hide the
    results of the others."""
    results = {}
    for name, case in cases.items():
        try:
            results[name] = run_one(case)
        except Exception:  # noqa: BLE001 - reported by the parent, case by case
            results[name] = {"error": traceback.format_exc()}
    return results


def correctness_pe(session, R: int) -> dict:
    """Every correctness case of world size ``R`` on this rank."""
    from numba import cuda

    from ep_runtime.core.runtime import EPRuntime

    def single(case):
        with EPRuntime(case.config(), session) as rt:
            return _round_trip(session, rt, case)

    def repeat(case):
        runs = []
        for _ in range(3):
            with EPRuntime(case.config(), session) as rt:
                runs.append(_round_trip(session, rt, case))
        return {"runs": runs}

    def sequence(cases, combine_pattern):
        calls = []
        with EPRuntime(cases[0].config(), session) as rt:
            for case, combine in zip(cases, combine_pattern):
                if combine:
                    calls.append(_round_trip(session, rt, case))
                else:
                    xs, ids, ws = case.inputs()
                    r = session.rank
                    batch = rt.dispatch(xs[r].view(np.uint16), ids[r], ws[r])
                    calls.append({"batch": _host_batch(session, batch), "out": None})
            return {"calls": calls, "host_calls": rt.calls, "device_calls": rt.device_calls()}

    def device_count(all_cases):
        """Back-to-back calls with capacity-sized inputs whose valid rows are counted by a
        device scalar (dispatch_async(n_tokens=...)): rows past the count are decoys routed to
        real experts, so sending one shows up; combine rows past the count must stay as set."""
        cfg, r = all_cases[0].config(), session.rank
        cap = cfg.max_tokens_per_rank
        decoys = all_cases[0].inputs()  # full-size inputs of another seed: their rows are decoys
        cases = all_cases[1:]
        calls = []
        with EPRuntime(cfg, session) as rt:
            for case in cases:
                xs, ids, ws = case.inputs()
                n = len(xs[r])
                x = session.to_device(np.concatenate([xs[r], decoys[0][r][:cap - n]]).view(np.uint16))
                i = session.to_device(np.concatenate([ids[r], decoys[1][r][:cap - n]]))
                w = session.to_device(np.concatenate([ws[r], decoys[2][r][:cap - n]]))
                count = session.to_device(np.array([n], np.int32))
                handle = rt.dispatch_async(x, i, w, n_tokens=count)
                batch = rt.dispatch_wait(handle)
                got = _host_batch(session, batch)
                y = expert_outputs(case, reference.dispatch(xs, ids, ws, cfg)[r], r)
                out = np.full((len(x), cfg.hidden), 0xBEEF, np.uint16)
                rt.combine_wait(rt.combine_async(y, batch.handle), out=out)
                rt.synchronize()
                calls.append({"batch": got, "out": session.to_host(out)[:n], "tail": session.to_host(out)[n:]})
        return {"calls": calls}

    def partials(case):
        cfg, r = case.config(), session.rank
        xs, ids, ws = case.inputs()
        with EPRuntime(cfg, session) as rt:
            handle = rt.dispatch_async(xs[r], ids[r], ws[r])  # bfloat16 accepted as is
            batch = rt.dispatch_wait(handle)
            got = _host_batch(session, batch)
            y = expert_outputs(case, reference.dispatch(xs, ids, ws, cfg)[r], r)
            chandle = rt.combine_async(y, batch.handle)
            out = np.full((R, len(xs[r]), cfg.hidden), 0xBEEF, np.uint16)  # zeros must be written
            returned = rt.combine_wait(chandle, out=out, reduce=False)
            rt.synchronize()
            return {"batch": got, "out": session.to_host(out), "returned_is_out": returned is out}

    def epilogue(case):
        cfg, r = case.config(), session.rank
        xs = case.inputs()[0]
        aux = aux_for(r, len(xs[r]), cfg.hidden)
        with EPRuntime(cfg, session) as rt:
            return _round_trip(session, rt, case, epilogue=cuda.jit(device=True)(residual_add), aux=aux)

    out = _run_cases({c.name: c for c in correctness_cases(R)}, single)
    out.update(_run_cases({"repeat": repeat_case(R)}, repeat))
    out.update(_run_cases({"back_to_back": back_to_back_cases(R)},
                          lambda cases: sequence(cases, [True] * len(cases))))
    out.update(_run_cases({"skip_combine": skip_combine_cases(R)},
                          lambda cases: sequence(cases, SKIP_COMBINE_PATTERN)))
    out.update(_run_cases({"device_count": device_count_cases(R)}, device_count))
    out.update(_run_cases({"partials": partials_case(R)}, partials))
    out.update(_run_cases({name: epilogue_case(R, name) for name in EPILOGUE_HIDDEN}, epilogue))
    return out


def bad_routing(cfg: EPConfig, ids: np.ndarray, ws: np.ndarray) -> dict:
    """``{name: (ids, weights)}``: one routing fault each (the tokens need T >= 4)."""
    out_of_range, negative, dup, nan_w, inf_w = ids.copy(), ids.copy(), ids.copy(), ws.copy(), ws.copy()
    out_of_range[1, 0] = cfg.n_experts
    negative[3, 1] = -2  # (-1 masks a slot)
    dup[2, 1] = dup[2, 0]
    nan_w[0, 1] = np.nan
    inf_w[1, 0] = -np.inf
    return {"ids_out_of_range": (out_of_range, ws), "ids_negative": (negative, ws), "ids_duplicate": (dup, ws),
            "weights_nan": (ids, nan_w), "weights_inf": (ids, inf_w)}


def misuse_pe(session, case: Case) -> dict:
    """Bad inputs and handle misuse, every rank making the same (mis)calls, between good
    round trips. Returns ``errors`` ``{name: (type name, message) or None}``, what followed
    the routing faults, and the good calls' results."""
    from ep_runtime.core.runtime import EPRuntime

    cfg, r, T, H = case.config(), session.rank, case.n_tokens[session.rank], case.cfg["hidden"]
    xs, ids, ws = case.inputs()
    x, i, w = xs[r].view(np.uint16), ids[r], ws[r]
    y = expert_outputs(case, reference.dispatch(xs, ids, ws, cfg)[r], r)
    errors, res = {}, {"after_routing_fault": {}}
    with EPRuntime(cfg, session) as rt, EPRuntime(cfg, session) as other:
        # -- bad arguments: rejected at the boundary, before any launch --------------------------
        too_many = T + cfg.max_tokens_per_rank  # > max_tokens_per_rank
        wide = np.zeros((T, 2 * H), np.uint16)
        bad_arguments = {
            "tokens_float32": (x.astype(np.float32), i, w),
            "tokens_wrong_hidden": (np.zeros((T, H + 1), np.uint16), i, w),
            "tokens_over_max_tokens": (np.zeros((too_many, H), np.uint16), np.zeros((too_many, 2), np.int32),
                                       np.full((too_many, 2), 0.5, np.float32)),
            "tokens_not_contiguous": (wide[:, :H], i, w),
            "tokens_not_numpy": (x.tolist(), i, w),
            "ids_int64": (x, i.astype(np.int64), w),
            "ids_wrong_rows": (x, i[:-1], w[:-1]),
            "weights_float64": (x, i, w.astype(np.float64)),
        }
        for name, args in bad_arguments.items():
            errors[name] = _caught(lambda: rt.dispatch_async(*args))
        res["device_calls_after_bad_arguments"] = rt.device_calls()
        res["host_calls_after_bad_arguments"] = rt.calls

        # -- routing faults: the device-side check (debug mode, always on the simulator) ---------
        for name, (bad_ids, bad_ws) in bad_routing(cfg, i, w).items():
            errors[name] = _caught(lambda: rt.dispatch_async(x, bad_ids, bad_ws))
            res["after_routing_fault"][name] = {"refused": _caught(lambda: rt.dispatch_async(x, i, w)),
                                                "device_calls": rt.device_calls()}
            rt.reset()

        # -- handle misuse around a good call ---------------------------------------------------
        handle = rt.dispatch_async(x, i, w)
        errors["dispatch_async_twice"] = _caught(lambda: rt.dispatch_async(x, i, w))
        errors["combine_async_before_dispatch_wait"] = _caught(lambda: rt.combine_async(y, handle))
        errors["foreign_handle"] = _caught(lambda: other.dispatch_wait(handle))
        batch = rt.dispatch_wait(handle)
        errors["dispatch_wait_twice"] = _caught(lambda: rt.dispatch_wait(handle))
        wide_out = np.zeros((len(y), H + 1), np.uint16)
        errors["expert_out_wrong_hidden"] = _caught(lambda: rt.combine_async(wide_out, handle))
        n_rows = int(batch.row_offsets[-1])
        errors["expert_out_too_few_rows"] = _caught(lambda: rt.combine_async(y[:n_rows - 1], handle)) \
            if n_rows > 0 else None
        chandle = rt.combine_async(y, handle)
        errors["dispatch_wait_with_combine_handle"] = _caught(lambda: rt.dispatch_wait(chandle))
        errors["combine_wait_with_dispatch_handle"] = _caught(lambda: rt.combine_wait(handle))
        errors["combine_async_twice"] = _caught(lambda: rt.combine_async(y, handle))
        errors["combine_wait_out_wrong_shape"] = _caught(
            lambda: rt.combine_wait(chandle, out=np.zeros((T + 1, H), np.uint16)))
        res["first"] = {"batch": _host_batch(session, batch), "out": session.to_host(rt.combine_wait(chandle))}
        rt.synchronize()
        errors["combine_wait_twice"] = _caught(lambda: rt.combine_wait(chandle))
        errors["dispatch_wait_after_combine"] = _caught(lambda: rt.dispatch_wait(handle))
        # a stale handle: call 0's, while call 1 is in flight
        handle1 = rt.dispatch_async(x, i, w)
        errors["stale_handle"] = _caught(lambda: rt.dispatch_wait(handle))
        batch = rt.dispatch_wait(handle1)
        res["second"] = {"batch": _host_batch(session, batch),
                         "out": session.to_host(rt.combine(y, batch.handle))}
        res["device_calls"] = rt.device_calls()
        other.close()
        errors["closed_runtime"] = _caught(lambda: other.dispatch_async(x, i, w))
    res["errors"] = errors
    return res


def capacity_pe(session, case: Case, recovery: Case, plan: str = "") -> dict:
    """The overflow call (every rank: dispatch, then combine if dispatch returned), a refused
    call, reset(), and a good round trip, on a runtime of ``plan``'s overrides."""
    from ep_runtime.core.runtime import EPRuntime

    cfg, r = case.config(), session.rank
    xs, ids, ws = case.inputs()
    res = {}
    with EPRuntime(cfg, session, plan=plan or None) as rt:
        res["plan"] = rt.plan.as_dict()
        def overflow():
            batch = rt.dispatch(xs[r], ids[r], ws[r])
            res["dispatched"] = True
            rt.combine(np.zeros((cfg.recv_rows_capacity, cfg.hidden), np.uint16), batch.handle)

        res["dispatched"] = False
        start = time.monotonic()
        res["error"] = _caught(overflow)
        res["error_s"] = time.monotonic() - start
        res["refused"] = _caught(lambda: rt.dispatch(xs[r], ids[r], ws[r]))
        rt.reset()
        res["after_reset"] = _round_trip(session, rt, recovery)
        res["device_calls"] = rt.device_calls()
    return res


def skip_pe(session, case: Case, recovery: Case) -> dict:
    """Two faults of one rank (FAULTY_RANK), each followed by a refused call on the others,
    reset() everywhere and a good round trip:

    - ``skip``: it skips a dispatch; the others dispatch (and time out);
    - ``bad_routing``: its routing has an expert id out of range (the device-side check
      raises there, nothing is sent); the others dispatch (and time out).
    """
    from ep_runtime.core.runtime import EPRuntime

    cfg, r = case.config(), session.rank
    xs, ids, ws = case.inputs()
    res = {}
    with EPRuntime(cfg, session) as rt:
        for fault in ("skip", "bad_routing"):
            out = res[fault] = {"error": None, "error_s": None, "refused": None}
            if r == FAULTY_RANK and fault == "bad_routing":
                bad_ids, bad_ws = bad_routing(cfg, ids[r], ws[r])["ids_out_of_range"]
                out["error"] = _caught(lambda: rt.dispatch(xs[r], bad_ids, bad_ws))
            elif r != FAULTY_RANK:
                start = time.monotonic()
                out["error"] = _caught(lambda: rt.dispatch(xs[r], ids[r], ws[r]))
                out["error_s"] = time.monotonic() - start
            out["refused"] = _caught(lambda: rt.dispatch(xs[r], ids[r], ws[r])) if out["error"] else None
            rt.reset()
            out["after_reset"] = _round_trip(session, rt, recovery)
            rt.reset()  # call numbers restart at 0 for the next fault
    return res


# -- parent side: run each suite once per world size ------------------------------------------
@pytest.fixture(scope="module")
def sim():
    """``sim(suite, n_ranks)``: the per-rank results of a suite, run on first use."""
    cache = {}

    def get(suite: str, R: int):
        if (suite, R) not in cache:
            if suite == "correctness":
                cache[suite, R] = run_pes(correctness_pe, R, args=(R,), timeout_s=RUN_TIMEOUT_S)
            elif suite == "misuse":
                cache[suite, R] = run_pes(misuse_pe, R, args=(misuse_case(R),), timeout_s=RUN_TIMEOUT_S)
            elif suite == "capacity":
                cache[suite, R] = run_pes(capacity_pe, R, args=(capacity_case(R), capacity_recovery_case(R)),
                                          timeout_s=RUN_TIMEOUT_S)
            elif suite == "capacity_two_placers":  # the copying dispatch_wait places in two blocks of four
                grid4 = {**capacity_case(R).cfg, "n_sms": 4}
                cases = (replace(capacity_case(R), cfg=grid4), replace(capacity_recovery_case(R), cfg=grid4))
                plan = "receiver=route_first,expanded_copy=in_wait,share_from_tokens=1,placing_blocks=2"
                cache[suite, R] = run_pes(capacity_pe, R, args=(*cases, plan), timeout_s=RUN_TIMEOUT_S)
            elif suite == "skip":
                cache[suite, R] = run_pes(skip_pe, R, args=(skip_case(R), skip_recovery_case(R)),
                                          timeout_s=RUN_TIMEOUT_S)
            else:
                raise KeyError(suite)
        return cache[suite, R]

    return get


def case_results(sim, R: int, name: str) -> list:
    """The per-rank results of correctness case ``name``; fails with a PE's traceback."""
    per_rank = [res[name] for res in sim("correctness", R)]
    for r, res in enumerate(per_rank):
        if "error" in res:
            pytest.fail(f"{name}, {R} ranks: rank {r} raised:\n{res['error']}")
    return per_rank


# -- checks -----------------------------------------------------------------------------------
def bits32(a) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(a, np.float32)).view(np.uint32)


ROW_FIELDS = ("src_rank", "src_token", "src_k", "weight")


def _row_story(x_bits, src_rank, src_token, src_k, weight) -> str:
    where = "padding" if src_rank < 0 else describe_row(x_bits.view(BF16))
    return f"{where} (src_rank {src_rank}, src_token {src_token}, k {src_k}, weight {float(weight):.9g})"


def dispatch_mismatches(got: dict, ref: reference.ExpertBatchRef, cfg: EPConfig, rank: int) -> list[str]:
    """Human-readable differences between a kernel batch and the reference batch: per wrong
    row, its expert segment, the fields that differ, and where the row got and the row wanted
    came from."""
    L, n = cfg.n_local_experts, ref.n_rows
    msgs = []
    if not np.array_equal(got["row_offsets"], ref.row_offsets):
        msgs.append(f"rank {rank}: row_offsets {got['row_offsets'].tolist()}, want {ref.row_offsets.tolist()}")
    if not np.array_equal(got["expert_counts"], ref.expert_counts):
        msgs.append(f"rank {rank}: expert_counts {got['expert_counts'].tolist()}, "
                    f"want {ref.expert_counts.tolist()}")
    if n > len(got["x"]):
        return msgs + [f"rank {rank}: the reference needs {n} rows, the batch holds {len(got['x'])}"]
    want = {"x": ref.x.view(np.uint16), "src_rank": ref.src_rank, "src_token": ref.src_token,
            "src_k": ref.src_k, "weight": ref.weight}
    differs = {"x": (got["x"][:n] != want["x"]).any(axis=1),
               "weight": bits32(got["weight"][:n]) != bits32(ref.weight)}
    differs.update({k: got[k][:n] != want[k] for k in ("src_rank", "src_token", "src_k")})
    rows = np.flatnonzero(np.any(list(differs.values()), axis=0)) if n else []
    for row in rows[:MAX_REPORTED_ROWS]:
        e = rank * L + int(np.searchsorted(ref.row_offsets, row, side="right")) - 1
        fields = ", ".join(k for k, d in differs.items() if d[row])
        cols = np.flatnonzero(got["x"][row] != want["x"][row])
        where = (f"; x columns {cols[:8].tolist()} got {got['x'][row][cols[:8]].tolist()} want "
                 f"{want['x'][row][cols[:8]].tolist()} (bf16 bits)" if len(cols) else "")
        msgs.append(f"rank {rank}, row {row} (segment of expert {e}; {fields} differ): got "
                    f"{_row_story(got['x'][row], *(got[k][row] for k in ROW_FIELDS))}, want "
                    f"{_row_story(want['x'][row], *(want[k][row] for k in ROW_FIELDS))}{where}")
    if len(rows) > MAX_REPORTED_ROWS:
        msgs.append(f"rank {rank}: {len(rows) - MAX_REPORTED_ROWS} more wrong rows of {n}")
    return msgs


def assert_dispatch_exact(per_rank_batches: list, case: Case, what: str = "") -> None:
    cfg = case.config()
    refs = reference.dispatch(*case.inputs(), cfg)
    msgs = [m for r, got in enumerate(per_rank_batches) for m in dispatch_mismatches(got, refs[r], cfg, r)]
    assert not msgs, f"{case.name}{what}: dispatch differs from reference.dispatch:\n" + "\n".join(msgs)


def reference_outputs(case: Case, reduce: bool = True) -> list:
    cfg = case.config()
    xs, ids, ws = case.inputs()
    refs = reference.dispatch(xs, ids, ws, cfg)
    ys = [expert_outputs(case, b, r) for r, b in enumerate(refs)]
    return reference.combine(ys, refs, ids, cfg, reduce=reduce)


def expert_out_abs_max(case: Case) -> float:
    """Largest |expert output| of any real row of any rank (the scale of combine_tolerance)."""
    cfg = case.config()
    refs = reference.dispatch(*case.inputs(), cfg)
    return max([float(np.abs(expert_outputs(case, b, r)[:b.n_rows][b.src_rank >= 0].view(BF16)
                             .astype(np.float32)).max(initial=0)) for r, b in enumerate(refs)])


def combine_mismatches(got_bits: np.ndarray, want: np.ndarray, rank: int) -> str:
    """Where a combine output differs bitwise: count, first positions and values."""
    want_bits = want.view(np.uint16)
    diff = np.argwhere(got_bits != want_bits)
    first = "; ".join(f"{tuple(map(int, p))}: got {got_bits[tuple(p)].view(BF16)!r} want {want[tuple(p)]!r}"
                      for p in diff[:MAX_REPORTED_ROWS])
    return f"rank {rank}: {len(diff)} of {want.size} values differ ({first})"


def assert_combine_exact(per_rank_outs: list, case: Case, what: str = "") -> None:
    want = reference_outputs(case)
    msgs = []
    for r, got in enumerate(per_rank_outs):
        assert got.shape == want[r].shape, f"{case.name}{what}: rank {r}: out {got.shape}, want {want[r].shape}"
        if not np.array_equal(got, want[r].view(np.uint16)):
            msgs.append(combine_mismatches(got, want[r], r))
    assert not msgs, (f"{case.name}{what}: combine is not bit-identical to reference.combine on the "
                      f"simulator (no FMA there):\n" + "\n".join(msgs))


# -- correctness: one round trip per case -----------------------------------------------------
CASE_NAMES = [c.name for c in correctness_cases(2)]


@pytest.mark.parametrize("name", CASE_NAMES)
@pytest.mark.parametrize("R", WORLD_SIZES)
def test_dispatch_equals_reference_exactly(sim, R, name):
    case = next(c for c in correctness_cases(R) if c.name == name)
    if case.cfg.get("max_recv_rows"):
        assert reference.dispatch(*case.inputs(), case.config())[0].n_rows == case.cfg["max_recv_rows"]
    assert_dispatch_exact([res["batch"] for res in case_results(sim, R, name)], case)


@pytest.mark.parametrize("name", CASE_NAMES)
@pytest.mark.parametrize("R", WORLD_SIZES)
def test_dispatch_leaves_rows_past_the_batch_at_their_initial_values(sim, R, name):
    for r, res in enumerate(case_results(sim, R, name)):
        b, n = res["batch"], int(res["batch"]["row_offsets"][-1])
        assert not b["x"][n:].any(), f"rank {r}: expert_x written past row {n}"
        for k in ("src_rank", "src_token", "src_k"):
            assert (b[k][n:] == -1).all(), f"rank {r}: {k} written past row {n}"
        assert (bits32(b["weight"][n:]) == 0).all(), f"rank {r}: weight written past row {n}"


@pytest.mark.parametrize("name", CASE_NAMES)
@pytest.mark.parametrize("R", WORLD_SIZES)
def test_combine_within_reference_tolerance(sim, R, name):
    case = next(c for c in correctness_cases(R) if c.name == name)
    want = reference_outputs(case)
    _, _, ws = case.inputs()
    for r, res in enumerate(case_results(sim, R, name)):
        got = res["out"].view(BF16).astype(np.float32)
        assert got.shape == want[r].shape
        assert not np.isnan(got).any(), f"rank {r}: NaN in the output (a poisoned row was read)"
        tol = reference.combine_tolerance(ws[r], expert_out_abs_max(case))
        err = np.abs(got - want[r].astype(np.float32))
        assert (err <= tol).all(), f"rank {r}: max error {err.max()} beyond tolerance"


@pytest.mark.parametrize("name", CASE_NAMES)
@pytest.mark.parametrize("R", WORLD_SIZES)
def test_combine_bit_identical_to_reference_on_simulator(sim, R, name):
    case = next(c for c in correctness_cases(R) if c.name == name)
    assert_combine_exact([res["out"] for res in case_results(sim, R, name)], case)


# -- correctness: repeated runs, call sequences, partials, epilogue ---------------------------------
@pytest.mark.parametrize("R", WORLD_SIZES)
def test_combine_bit_identical_across_three_runtimes(sim, R):
    runs = [res["runs"] for res in case_results(sim, R, "repeat")]
    for r, rank_runs in enumerate(runs):
        for i, run in enumerate(rank_runs[1:], start=1):
            assert np.array_equal(run["out"], rank_runs[0]["out"]), f"rank {r}: run {i} differs from run 0"
            for k in BATCH_FIELDS:
                assert np.array_equal(run["batch"][k], rank_runs[0]["batch"][k]), f"rank {r}: run {i} {k}"
    assert_combine_exact([rank_runs[0]["out"] for rank_runs in runs], repeat_case(R))


@pytest.mark.parametrize("R", WORLD_SIZES)
def test_back_to_back_calls_on_one_runtime(sim, R):
    per_rank = case_results(sim, R, "back_to_back")
    cases = back_to_back_cases(R)
    assert any(0 in c.n_tokens for c in cases) and len({c.n_tokens for c in cases}) == N_CALLS
    for c, case in enumerate(cases):
        calls = [res["calls"][c] for res in per_rank]
        assert_dispatch_exact([call["batch"] for call in calls], case, f" (call {c} of {N_CALLS})")
        assert_combine_exact([call["out"] for call in calls], case, f" (call {c} of {N_CALLS})")
    for r, res in enumerate(per_rank):
        assert (res["host_calls"], res["device_calls"]) == (N_CALLS, N_CALLS), f"rank {r}"


@pytest.mark.parametrize("R", WORLD_SIZES)
def test_token_count_from_a_device_scalar(sim, R):
    """dispatch_async(n_tokens=device scalar) with capacity-sized inputs: exactly the first
    n rows of each rank travel (decoy rows past n would add rows), combine writes exactly the
    first n output rows (the rest keep their 0xBEEF), for counts that vary by rank and call,
    0 included."""
    per_rank = case_results(sim, R, "device_count")
    cases = device_count_cases(R)
    calls_cases = cases[1:]
    assert any(0 in c.n_tokens for c in calls_cases)
    for c, case in enumerate(calls_cases):
        calls = [res["calls"][c] for res in per_rank]
        assert_dispatch_exact([call["batch"] for call in calls], case, f" (call {c}, device count)")
        assert_combine_exact([call["out"] for call in calls], case, f" (call {c}, device count)")
        for r, call in enumerate(calls):
            assert (call["tail"] == 0xBEEF).all(), f"call {c} rank {r}: combine wrote rows past n_tokens"


@pytest.mark.parametrize("R", WORLD_SIZES)
def test_dispatch_without_combine_then_round_trips(sim, R):
    per_rank = case_results(sim, R, "skip_combine")
    for c, (case, combined) in enumerate(zip(skip_combine_cases(R), SKIP_COMBINE_PATTERN)):
        calls = [res["calls"][c] for res in per_rank]
        assert_dispatch_exact([call["batch"] for call in calls], case, f" (call {c})")
        if combined:
            assert_combine_exact([call["out"] for call in calls], case, f" (call {c})")
    n = len(SKIP_COMBINE_PATTERN)
    assert [(res["host_calls"], res["device_calls"]) for res in per_rank] == [(n, n)] * R


@pytest.mark.parametrize("R", WORLD_SIZES)
def test_combine_wait_reduce_false_returns_the_reference_partials(sim, R):
    case = partials_case(R)
    per_rank = case_results(sim, R, "partials")
    assert_dispatch_exact([res["batch"] for res in per_rank], case)
    want = reference_outputs(case, reduce=False)
    for r, res in enumerate(per_rank):
        assert res["returned_is_out"], f"rank {r}: combine_wait(out=...) must return out"
        assert res["out"].shape == want[r].shape
        assert np.array_equal(res["out"], want[r].view(np.uint16)), combine_mismatches(res["out"], want[r], r)


@pytest.mark.parametrize("name", sorted(EPILOGUE_HIDDEN))
@pytest.mark.parametrize("R", WORLD_SIZES)
def test_epilogue_residual_add(sim, R, name):
    case = epilogue_case(R, name)
    cfg = case.config()
    xs, ids, _ = case.inputs()
    partials = reference_outputs(case, reduce=False)
    L = cfg.n_local_experts
    for r, res in enumerate(case_results(sim, R, name)):
        # as the kernel: float32 sum from 0 over the ranks the token went to, ascending, + aux, bf16
        acc = np.zeros((len(xs[r]), cfg.hidden), np.float32)
        for q in range(R):
            went = np.any(ids[r] // L == q, axis=1)[:, None]
            acc = np.where(went, acc + partials[r][q].astype(np.float32), acc)
        want = (acc + aux_for(r, len(xs[r]), cfg.hidden)).astype(BF16)
        assert np.array_equal(res["out"], want.view(np.uint16)), combine_mismatches(res["out"], want, r)


# -- failures: handle misuse and bad inputs ---------------------------------------------------
STATE = "EPStateError"
#: misuse name -> (error type, fragments its message must contain)
MISUSE = {
    "dispatch_async_twice": (STATE, ["dispatch_async called out of order", "state 'dispatch sent'",
                                     "expects dispatch_wait next"]),
    "combine_async_before_dispatch_wait": (STATE, ["combine_async called out of order",
                                                   "state 'dispatch sent'", "expects dispatch_wait next"]),
    "foreign_handle": (STATE, ["dispatch_wait got a handle from another EPRuntime"]),
    "dispatch_wait_twice": (STATE, ["dispatch_wait got the handle of call 0", "each handle is used once"]),
    "dispatch_wait_with_combine_handle": (STATE, ["dispatch_wait needs a DispatchHandle; got CombineHandle"]),
    "combine_wait_with_dispatch_handle": (STATE, ["combine_wait needs a CombineHandle; got DispatchHandle"]),
    "combine_async_twice": (STATE, ["combine_async got the handle of call 0", "each handle is used once"]),
    "combine_wait_twice": (STATE, ["combine_wait got the handle of call 0", "each handle is used once"]),
    "dispatch_wait_after_combine": (STATE, ["dispatch_wait got the handle of call 0"]),
    "stale_handle": (STATE, ["dispatch_wait got the handle of call 0", "current call 1"]),
    "closed_runtime": (STATE, ["dispatch_async on a closed runtime"]),
}
#: bad argument -> fragments of the EPInputError raised before any launch
BAD_ARGUMENTS = {
    "tokens_float32": ["dispatch_async: tokens must have dtype bfloat16", "got float32"],
    "tokens_wrong_hidden": ["dispatch_async: tokens must have shape [*, 16]; got [4, 17]", "got [4, 17]"],
    "tokens_over_max_tokens": ["dispatch_async: tokens has 10 rows", "max_tokens_per_rank is 6"],
    "tokens_not_contiguous": ["dispatch_async: tokens must be C-contiguous"],
    "tokens_not_numpy": ["dispatch_async: tokens must be a NumPy array", "got list"],
    "ids_int64": ["dispatch_async: topk_ids must have dtype int32", "got int64"],
    "ids_wrong_rows": ["dispatch_async: topk_ids must have shape [4, 2]", "got [3, 2]"],
    "weights_float64": ["dispatch_async: topk_weights must have dtype float32", "got float64"],
    "expert_out_wrong_hidden": ["combine_async: expert_out must have shape [*, 16]", "got ["],
    "expert_out_too_few_rows": ["combine_async: expert_out has", "rows but the expert batch has"],
    "combine_wait_out_wrong_shape": ["combine_wait: out must have shape [4, 16]", "got [5, 16]"],
}
#: routing fault (bad_routing) -> fragments of the EPInputError of the device-side check
#: ({r}: the rank, {E}: n_experts, {e}: the duplicated expert)
ROUTING_FAULTS = {
    "ids_out_of_range": ["rank {r}: topk_ids[1, 0] = {E} is outside [-1, n_experts={E})"],
    "ids_negative": ["rank {r}: topk_ids[3, 1] = -2 is outside [-1, n_experts={E})"],
    "ids_duplicate": ["rank {r}: token 2 lists expert {e} twice in topk_ids (slots 0 and 1)"],
    "weights_nan": ["rank {r}: topk_weights[0, 1] = nan must be finite"],
    "weights_inf": ["rank {r}: topk_weights[1, 0] = -inf must be finite"],
}
ROUTING_FAULT_TAIL = ["nothing was sent", "reset() on every rank"]


@pytest.mark.parametrize("misuse", sorted(MISUSE))
@pytest.mark.parametrize("R", WORLD_SIZES)
def test_handle_misuse_raises_state_error(sim, R, misuse):
    kind, fragments = MISUSE[misuse]
    for r, res in enumerate(sim("misuse", R)):
        caught = res["errors"][misuse]
        assert caught is not None, f"rank {r}: {misuse} raised nothing"
        assert caught[0] == kind, f"rank {r}: {misuse} raised {caught}"
        for frag in [f"rank {r}: "] + fragments:
            assert frag in caught[1], f"rank {r}: {misuse}: {frag!r} not in {caught[1]!r}"


@pytest.mark.parametrize("bad", sorted(BAD_ARGUMENTS))
@pytest.mark.parametrize("R", WORLD_SIZES)
def test_bad_argument_raises_input_error_before_launch(sim, R, bad):
    for r, res in enumerate(sim("misuse", R)):
        caught = res["errors"][bad]
        if bad == "expert_out_too_few_rows" and caught is None and not res["first"]["batch"]["row_offsets"][-1]:
            continue  # this rank received no rows: nothing is too few
        assert caught is not None and caught[0] == "EPInputError", f"rank {r}: {bad} raised {caught}"
        for frag in BAD_ARGUMENTS[bad]:
            assert frag in caught[1], f"rank {r}: {bad}: {frag!r} not in {caught[1]!r}"


@pytest.mark.parametrize("fault", sorted(ROUTING_FAULTS))
@pytest.mark.parametrize("R", WORLD_SIZES)
def test_routing_fault_raises_input_error_and_refuses_calls_until_reset(sim, R, fault):
    case = misuse_case(R)
    cfg = case.config()
    _, ids, ws = case.inputs()
    for r, res in enumerate(sim("misuse", R)):
        caught = res["errors"][fault]
        assert caught is not None and caught[0] == "EPInputError", f"rank {r}: {fault} raised {caught}"
        e = int(ids[r][2, 0])
        for frag in [f.format(r=r, E=cfg.n_experts, e=e) for f in ROUTING_FAULTS[fault]] + ROUTING_FAULT_TAIL:
            assert frag in caught[1], f"rank {r}: {fault}: {frag!r} not in {caught[1]!r}"
        after = res["after_routing_fault"][fault]
        assert after["device_calls"] == 0, f"rank {r}: dispatch_async ran after the routing check failed"
        kind, message = after["refused"]
        assert kind == "EPStateError" and "refused: the runtime failed earlier (EPInputError" in message, \
            after["refused"]


@pytest.mark.parametrize("R", WORLD_SIZES)
def test_bad_inputs_launch_nothing_and_the_runtime_still_works(sim, R):
    case = misuse_case(R)
    per_rank = sim("misuse", R)
    assert [(res["device_calls_after_bad_arguments"], res["host_calls_after_bad_arguments"])
            for res in per_rank] == [(0, 0)] * R
    for which in ("first", "second"):
        assert_dispatch_exact([res[which]["batch"] for res in per_rank], case, f" ({which} good call)")
        assert_combine_exact([res[which]["out"] for res in per_rank], case, f" ({which} good call)")
    assert [res["device_calls"] for res in per_rank] == [2] * R


# -- failures: capacity overflow, a rank that skips a dispatch ---------------------------------------
@pytest.mark.parametrize("R", WORLD_SIZES)
def test_capacity_overflow_raises_on_the_overflowing_rank(sim, R):
    case = capacity_case(R)
    needed = reference.dispatch(*case.inputs(), case.config())[OVERFLOW_RANK].n_rows
    capacity = case.cfg["max_recv_rows"]
    assert needed > capacity
    res = sim("capacity", R)[OVERFLOW_RANK]
    assert not res["dispatched"], "dispatch() returned on the overflowing rank"
    kind, message = res["error"]
    assert kind == "EPCapacityError", res["error"]
    for frag in (f"rank {OVERFLOW_RANK}: dispatch_wait of call 0 needed {needed} expert-batch rows",
                 f"capacity is {capacity} (EPConfig.max_recv_rows)", f"at least {needed}"):
        assert frag in message, f"{frag!r} not in {message!r}"


def test_capacity_overflow_with_two_placing_blocks_raises_copies_nothing_and_recovers(sim):
    """Both placing blocks of the copying launch find the overflow and publish it failed: the
    copying blocks copy nothing (no out-of-bounds row), the rank raises the capacity error, and
    after reset() the round trip is exact."""
    R = 2
    case, recovery = capacity_case(R), capacity_recovery_case(R)
    per_rank = sim("capacity_two_placers", R)
    res = per_rank[OVERFLOW_RANK]
    assert (res["plan"]["receiver"], res["plan"]["expanded_copy"], res["plan"]["grid"]) == ("route_first", "in_wait", 4)
    assert not res["dispatched"], "dispatch() returned on the overflowing rank"
    assert res["error"][0] == "EPCapacityError", res["error"]
    assert f"capacity is {case.cfg['max_recv_rows']}" in res["error"][1], res["error"]
    assert_dispatch_exact([r["after_reset"]["batch"] for r in per_rank], recovery, " (after reset)")
    assert_combine_exact([r["after_reset"]["out"] for r in per_rank], recovery, " (after reset)")


@pytest.mark.parametrize("R", WORLD_SIZES)
def test_capacity_overflow_times_out_the_peers_combine_naming_the_rank(sim, R):
    for r, res in enumerate(sim("capacity", R)):
        if r == OVERFLOW_RANK:
            continue
        assert res["dispatched"], f"rank {r}: dispatch failed: {res['error']}"
        kind, message = res["error"]
        assert kind == "EPTimeoutError", f"rank {r}: {res['error']}"
        frag = (f"rank {r}: combine_wait of call 0 timed out after {FAIL_WAIT_TIMEOUT_S:g} s waiting for rank "
                f"{OVERFLOW_RANK}: combine_row_flag[{OVERFLOW_RANK}, token ")  # the first part it waited for
        assert frag in message and "] expected >= 1, observed 0" in message, f"{frag!r} not in {message!r}"


@pytest.mark.parametrize("R", WORLD_SIZES)
def test_capacity_failure_refuses_calls_until_reset(sim, R):
    recovery = capacity_recovery_case(R)
    per_rank = sim("capacity", R)
    for r, res in enumerate(per_rank):
        kind, message = res["refused"]
        assert kind == "EPStateError", f"rank {r}: {res['refused']}"
        first = "EPCapacityError" if r == OVERFLOW_RANK else "EPTimeoutError"
        for frag in (f"rank {r}: dispatch_async refused: the runtime failed earlier ({first}", "reset()"):
            assert frag in message, f"rank {r}: {frag!r} not in {message!r}"
        assert res["device_calls"] == 1, f"rank {r}: call numbers restart at 0 after reset()"
    assert_dispatch_exact([res["after_reset"]["batch"] for res in per_rank], recovery, " (after reset)")
    assert_combine_exact([res["after_reset"]["out"] for res in per_rank], recovery, " (after reset)")


@pytest.mark.parametrize("fault", ["skip", "bad_routing"])
@pytest.mark.parametrize("R", WORLD_SIZES)
def test_faulty_rank_times_out_the_peers_dispatch_naming_it(sim, R, fault):
    """A rank that skips a dispatch, or whose routing check fails (it sends nothing): each peer's
    dispatch raises EPTimeoutError after wait_timeout_s naming the rank, the kernel and the
    counter; further calls are refused until reset()."""
    per_rank = [res[fault] for res in sim("skip", R)]
    for r, res in enumerate(per_rank):
        if r == FAULTY_RANK:
            if fault == "bad_routing":
                assert res["error"][0] == "EPInputError", res["error"]
            continue
        kind, message = res["error"]
        assert kind == "EPTimeoutError", f"rank {r}: {res['error']}"
        # the first wait that cannot end: the faulty rank never granted call 0's token rows
        frag = (f"rank {r}: dispatch_async of call 0 timed out after {FAIL_WAIT_TIMEOUT_S:g} s waiting for rank "
                f"{FAULTY_RANK}: dispatch_token_credit[{FAULTY_RANK}] expected >= 1, observed 0")
        assert frag in message, f"{frag!r} not in {message!r}"
        assert f"rank {FAULTY_RANK} did not make this call" in message
        # the first block to time out records the error, later blocks see it and return at once:
        # raised after the timeout, not long after it (10 s of slack for a loaded CI machine)
        elapsed = res["error_s"]
        assert FAIL_WAIT_TIMEOUT_S <= elapsed < FAIL_WAIT_TIMEOUT_S + 10, f"rank {r}: {elapsed:.1f} s"
    for r, res in enumerate(per_rank):
        if res["error"] is not None:
            kind, message = res["refused"]
            assert kind == "EPStateError" and "refused: the runtime failed earlier" in message, f"rank {r}"


@pytest.mark.parametrize("fault", ["skip", "bad_routing"])
@pytest.mark.parametrize("R", WORLD_SIZES)
def test_faulty_rank_then_reset_then_good_round_trip(sim, R, fault):
    recovery = skip_recovery_case(R)
    per_rank = [res[fault] for res in sim("skip", R)]
    assert_dispatch_exact([res["after_reset"]["batch"] for res in per_rank], recovery, " (after reset)")
    assert_combine_exact([res["after_reset"]["out"] for res in per_rank], recovery, " (after reset)")
