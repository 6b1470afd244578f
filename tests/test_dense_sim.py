"""The dense layout on the simulator (real kernels, one process per rank): dispatch_wait(layout=
"dense") returns DeepEP's received rows, one per (token, source rank), source-major then in token
order, with each slot's local expert and weight and the maps between dense rows and receive-buffer
slots, written by dispatch_dense; combine_async(layout="dense") takes one row per dense row and
reads it through slot_dense_row. Dispatch exact against :func:`ep_runtime.core.reference.dense`,
combine exact against :func:`~ep_runtime.core.reference.combine_dense` (the simulator does not
contract multiply-adds) and bit for bit run to run, over the awkward routings, valid tokens below
the capacity, bf16 / FP8 / NVFP4 rows, both transports, every receiver, runtimes serving several
layouts and a sequence of calls on one runtime; bad arguments are refused before any launch.
"""

from __future__ import annotations

import numpy as np
import pytest

from ep_runtime.core import reference
from ep_runtime.core.config import EPConfig
from ep_runtime.core.reference import BF16
from ep_runtime.shmem.launch import run_pes
from ep_runtime.testing import input_error_of, make_inputs

RUN_TIMEOUT_S = 300
DENSE_FIELDS = ("x", "topk_idx", "topk_weights", "slot", "slot_row", "source_rows", "row_offsets",
                "expert_counts")
#: Every receiver a plan can choose, and the puts transport (the simulator's default plan is
#: ``wait`` over stores); the chunked route-first receiver ranks in chunks from one token on.
PLANS = {"wait": None, "puts": "transport=puts", "land": "receiver=land", "route_first": "receiver=route_first",
         "route_first_chunked": "receiver=route_first_chunked,chunk_from_tokens=1"}


def base_cfg(R: int, **changes) -> dict:
    return {**dict(n_ranks=R, n_experts=2 * R, top_k=2, hidden=16, max_tokens_per_rank=6, layouts="dense"),
            **changes}


def cases(R: int) -> list:
    """(name, config dict, scenario, seed, token counts or None, plan overrides, valid tokens or None)."""
    out = [
        ("random", base_cfg(R), "random", 1, None, None, None),
        ("zero_rank", base_cfg(R), "zero_rank", 3, None, None, None),
        ("empty_expert", base_cfg(R), "empty_expert", 4, None, None, None),
        ("one_expert", base_cfg(R), "one_expert", 5, None, None, None),
        ("top_k_1", base_cfg(R, top_k=1), "random", 6, None, None, None),
        ("masked", base_cfg(R, n_experts=4 * R, top_k=3), "masked", 7, None, None, None),
        ("no_tokens_anywhere", base_cfg(R), "random", 8, (0,) * R, None, None),
        # full-capacity inputs, of which the device's n_tokens counts fewer
        ("valid_tokens_below_capacity", base_cfg(R), "random", 9, (6,) * R, None, 4),
        # rows of an odd number of uint16 words, and rows longer than one pass of the copy
        ("hidden_5", base_cfg(R, hidden=5), "random", 10, None, None, None),
        ("hidden_552_n_sms_3", base_cfg(R, hidden=552, n_sms=3), "random", 11, (6,) * R, None, None),
        ("fp8_e4m3", base_cfg(R, hidden=256), "masked", 12, None, None, None),
        ("fp8_e4m3_puts", base_cfg(R, hidden=256), "random", 13, None, "transport=puts", None),
        ("nvfp4", base_cfg(R, hidden=64), "random", 14, None, None, None),
        # the expanded layout served too: its receivers copy; the dense rows come after any of them
        ("with_expanded_land", base_cfg(R, layouts=("expanded", "dense")), "random", 15, None, "receiver=land", None),
        ("with_expanded_route_first", base_cfg(R, layouts=("expanded", "dense")), "random", 16, None,
         "receiver=route_first", None),
    ]
    formats = {"fp8_e4m3": "fp8_e4m3", "fp8_e4m3_puts": "fp8_e4m3", "nvfp4": "nvfp4"}
    out = [(n, {**c, "token_dtype": formats[n]} if n in formats else c, *rest) for n, c, *rest in out]
    out += [(f"plan_{name}", base_cfg(R), "masked", 20 + i, None, plan, None) for i, (name, plan) in
            enumerate(PLANS.items())]
    return out


def inputs(cfg: EPConfig, scenario, seed, counts, valid):
    """Every rank's inputs as passed, and as the reference sees them (the first ``valid`` rows)."""
    xs, ids, ws = make_inputs(cfg, scenario, seed, None if counts is None else list(counts))
    if valid is None:
        return (xs, ids, ws), (xs, ids, ws)
    return (xs, ids, ws), ([x[:valid] for x in xs], [i[:valid] for i in ids], [w[:valid] for w in ws])


def dense_partials(cfg: EPConfig, ref: reference.DenseRowsRef, rank: int) -> np.ndarray:
    """Rank ``rank``'s combine input: [rows, H] bf16, row i = bf16((rank + 1) + slot[i] / 16 + col
    / 256): each value names the rank and the (source, token) it stands for."""
    cols = np.arange(cfg.hidden, dtype=np.float32) / 256
    rows = np.float32(rank + 1) + ref.slot.astype(np.float32)[:, None] / 16 + cols[None, :]
    return rows.astype(BF16)


# -- per-rank body ------------------------------------------------------------------------------
def dense_pe(session, R: int) -> dict:
    from ep_runtime.core.runtime import EPRuntime

    r = session.rank

    def host(batch) -> dict:
        got = {k: session.to_host(getattr(batch, k)).copy() for k in DENSE_FIELDS}
        for k in ("scales", "global_scales"):
            got[k] = None if getattr(batch, k) is None else session.to_host(getattr(batch, k)).copy()
        return got

    def round_trip(rt, cfg, passed, seen, valid):
        xs, ids, ws = passed
        n_tokens = None if valid is None else session.to_device(np.array([valid], np.int32))
        h = rt.dispatch_async(xs[r].view(np.uint16), ids[r], ws[r], n_tokens=n_tokens)
        batch = rt.dispatch_wait(h, layout="dense")
        rt.synchronize()
        got = host(batch)
        got["address"] = batch.x.__array_interface__["data"][0]  # (the simulator's arrays are NumPy's)
        ref = reference.dense(*seen, cfg)[r]
        out = rt.combine(dense_partials(cfg, ref, r).view(np.uint16), batch.handle, layout="dense")
        return {"batch": got, "out": session.to_host(out).copy()}

    results = {}
    for name, cfg_d, scenario, seed, counts, plan, valid in cases(R):
        cfg = EPConfig(**cfg_d)
        passed, seen = inputs(cfg, scenario, seed, counts, valid)
        with EPRuntime(cfg, session, plan=plan) as rt:
            # the same call twice: the second must repeat the first bit for bit
            results[name] = [round_trip(rt, cfg, passed, seen, valid) for _ in range(2)]

    # one runtime serving every layout: dense, compact and expanded calls in a row, the dense
    # batch's views the same memory every call (a captured graph reads every replay's rows)
    cfg = EPConfig(**base_cfg(R, layouts=("expanded", "compact", "dense")))
    seq, addresses = [], set()
    with EPRuntime(cfg, session) as rt:
        for call in range(6):
            counts = tuple((2 * call + r2 + 1) % (cfg.max_tokens_per_rank + 1) for r2 in range(R))
            passed, seen = inputs(cfg, "masked" if call % 3 else "random", 400 + call, counts, None)
            if call % 3 == 1:
                xs, ids, ws = passed
                batch = rt.dispatch(xs[r].view(np.uint16), ids[r], ws[r], layout="compact")
                rt.combine(np.zeros((R * cfg.max_tokens_per_rank, cfg.hidden), np.uint16), batch.handle,
                           layout="compact")
                seq.append(None)
                continue
            res = round_trip(rt, cfg, passed, seen, None)
            seq.append(res)
            addresses.add(res["batch"]["address"])

        errors = {}
        passed, seen = inputs(cfg, "random", 499, None, None)
        xs, ids, ws = passed
        batch = rt.dispatch(xs[r].view(np.uint16), ids[r], ws[r], layout="compact")
        ref = reference.dense(*seen, cfg)[r]
        rows = dense_partials(cfg, ref, r).view(np.uint16)
        errors["combine_without_dense_dispatch"] = input_error_of(
            lambda: rt.combine_async(rows, batch.handle, layout="dense"))
        rt.combine(np.zeros((R * cfg.max_tokens_per_rank, cfg.hidden), np.uint16), batch.handle, layout="compact")
        batch = rt.dispatch(xs[r].view(np.uint16), ids[r], ws[r], layout="dense")
        too_many = np.zeros((R * cfg.max_tokens_per_rank + 1, cfg.hidden), np.uint16)
        for what, call in {
            "combine_dense_rows_too_many": lambda: rt.combine_async(too_many, batch.handle, layout="dense"),
            "combine_dense_wrong_hidden": lambda: rt.combine_async(rows[:, :-1], batch.handle, layout="dense"),
            "combine_dense_float32": lambda: rt.combine_async(rows.astype(np.float32), batch.handle, layout="dense"),
            "combine_dense_weights": lambda: rt.combine_async(rows, batch.handle, layout="dense", weights=None),
        }.items():
            errors[what] = input_error_of(call)
        after = {"out": session.to_host(rt.combine(rows, batch.handle, layout="dense")).copy()}
    with EPRuntime(EPConfig(**base_cfg(R, layouts="compact")), session) as rt:
        h = rt.dispatch_async(xs[r].view(np.uint16), ids[r], ws[r])
        errors["dispatch_wait_not_served"] = input_error_of(lambda: rt.dispatch_wait(h, layout="dense"))
        rt.dispatch_wait(h, layout="compact")
    return {"cases": results, "sequence": seq, "addresses": len(addresses), "errors": errors, "after_errors": after}


@pytest.fixture(scope="module", params=[2, 3, 4])
def sim(request):
    R = request.param
    return R, run_pes(dense_pe, R, args=(R,), timeout_s=RUN_TIMEOUT_S)


# -- checks -----------------------------------------------------------------------------------
def check_dense_batch(got: dict, cfg: EPConfig, seen, r: int, what: str) -> None:
    """Every received row exact (words, scales, ids, weights, maps, counts), and what lies past the
    rows received: slots -1, ids -1, weights 0; slot_row -1 wherever the token did not come."""
    ref = reference.dense(*seen, cfg)[r]
    exp = reference.dispatch(*seen, cfg)[r]
    R, T, K = cfg.n_ranks, cfg.max_tokens_per_rank, cfg.top_k
    n = len(ref.slot)
    assert got["x"].shape[0] == R * T and got["topk_idx"].shape == (R * T, K), what
    bad = np.flatnonzero((got["x"][:n] != ref.x.view(got["x"].dtype)).any(axis=1))
    assert not len(bad), f"{what}: rank {r}: dense rows {bad[:8]} (slots {ref.slot[bad[:8]]}) differ"
    np.testing.assert_array_equal(got["topk_idx"][:n], ref.topk_idx, err_msg=f"{what}: topk_idx")
    np.testing.assert_array_equal(got["topk_weights"][:n].view(np.uint32), ref.topk_weights.view(np.uint32),
                                  err_msg=f"{what}: topk_weights")
    np.testing.assert_array_equal(got["slot"][:n], ref.slot, err_msg=f"{what}: slot")
    np.testing.assert_array_equal(got["slot_row"], ref.slot_row, err_msg=f"{what}: slot_row")
    np.testing.assert_array_equal(got["source_rows"], ref.source_rows, err_msg=f"{what}: source_rows")
    assert (got["slot"][n:] == -1).all() and (got["topk_idx"][n:] == -1).all(), f"{what}: past the rows"
    assert (got["topk_weights"][n:] == 0).all(), f"{what}: weights past the rows"
    np.testing.assert_array_equal(got["expert_counts"], exp.expert_counts, err_msg=f"{what}: expert_counts")
    np.testing.assert_array_equal(got["row_offsets"], exp.row_offsets, err_msg=f"{what}: row_offsets")
    if ref.scales is not None:
        np.testing.assert_array_equal(got["scales"][:n].view(np.uint8), ref.scales.view(np.uint8),
                                      err_msg=f"{what}: scales")
    else:
        assert got["scales"] is None, what
    if ref.global_scales is not None:
        np.testing.assert_array_equal(got["global_scales"][:n], ref.global_scales, err_msg=f"{what}: global")


def want_combine(cfg: EPConfig, seen) -> list:
    refs = reference.dense(*seen, cfg)
    rows = [dense_partials(cfg, d, r) for r, d in enumerate(refs)]
    return reference.combine_dense(rows, refs, seen[1], cfg)


def test_dense_dispatch_equals_the_reference_exactly(sim):
    R, per_rank = sim
    for name, cfg_d, scenario, seed, counts, plan, valid in cases(R):
        cfg = EPConfig(**cfg_d)
        _, seen = inputs(cfg, scenario, seed, counts, valid)
        for r, res in enumerate(per_rank):
            check_dense_batch(res["cases"][name][0]["batch"], cfg, seen, r, name)


def test_dense_combine_equals_the_reference(sim):
    """Exact on the simulator (no FMA; the reference's summation order); on GPUs the same sums
    of unweighted bf16 rows, float32 from 0 in rank order, have no multiply to contract."""
    R, per_rank = sim
    for name, cfg_d, scenario, seed, counts, plan, valid in cases(R):
        cfg = EPConfig(**cfg_d)
        _, seen = inputs(cfg, scenario, seed, counts, valid)
        want = want_combine(cfg, seen)
        for r, res in enumerate(per_rank):
            got = res["cases"][name][0]["out"]
            if valid is not None:  # [T, H] for the T rows passed, of which the first valid are written
                assert got.shape == (len(inputs(cfg, scenario, seed, counts, None)[0][0][r]), cfg.hidden), name
                got = got[:valid]
            assert got.shape == want[r].shape, name
            np.testing.assert_array_equal(got, want[r].view(np.uint16), err_msg=f"{name}: rank {r}")


def test_dense_calls_repeat_bit_for_bit(sim):
    R, per_rank = sim
    for name, *_ in cases(R):
        for r, res in enumerate(per_rank):
            first, second = res["cases"][name]
            for k, v in first["batch"].items():
                if v is not None:  # (the address too: the same memory)
                    np.testing.assert_array_equal(second["batch"][k], v, err_msg=f"{name}: rank {r}: {k}")
            np.testing.assert_array_equal(second["out"], first["out"], err_msg=f"{name}: rank {r}: out")


def test_dense_calls_in_a_row_on_one_runtime_serving_every_layout(sim):
    R, per_rank = sim
    cfg = EPConfig(**base_cfg(R, layouts=("expanded", "compact", "dense")))
    for call in range(6):
        if call % 3 == 1:
            continue
        counts = tuple((2 * call + r2 + 1) % (cfg.max_tokens_per_rank + 1) for r2 in range(R))
        _, seen = inputs(cfg, "masked" if call % 3 else "random", 400 + call, counts, None)
        want = want_combine(cfg, seen)
        for r, res in enumerate(per_rank):
            got = res["sequence"][call]
            check_dense_batch(got["batch"], cfg, seen, r, f"call {call}")
            np.testing.assert_array_equal(got["out"], want[r].view(np.uint16), err_msg=f"call {call}: rank {r}")
    for res in per_rank:
        assert res["addresses"] == 1  # the dense rows are the same memory every call


def test_bad_dense_calls_are_refused_before_launch(sim):
    R, per_rank = sim
    cfg = EPConfig(**base_cfg(R, layouts=("expanded", "compact", "dense")))
    _, seen = inputs(cfg, "random", 499, None, None)
    want = want_combine(cfg, seen)
    for r, res in enumerate(per_rank):
        e = res["errors"]
        assert e["combine_without_dense_dispatch"] and "dispatch_wait(handle, layout='dense')" in \
            e["combine_without_dense_dispatch"], e
        assert e["combine_dense_rows_too_many"] and f"{R * cfg.max_tokens_per_rank} dense rows" in \
            e["combine_dense_rows_too_many"], e
        assert e["combine_dense_wrong_hidden"] and "expert_out must have shape" in e["combine_dense_wrong_hidden"], e
        assert e["combine_dense_float32"] and "combine_dtype is 'bfloat16'" in e["combine_dense_float32"], e
        assert e["combine_dense_weights"] and "expanded and batched layouts only" in e["combine_dense_weights"], e
        assert e["dispatch_wait_not_served"] and "layout='dense'" in e["dispatch_wait_not_served"] \
            and "including 'dense'" in e["dispatch_wait_not_served"], e
        # the refused calls left the runtime usable
        np.testing.assert_array_equal(res["after_errors"]["out"], want[r].view(np.uint16))
