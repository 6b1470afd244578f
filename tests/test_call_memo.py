"""The runtime reuses a call's checked launch arguments only while they still hold
(:mod:`ep_runtime.core.call_memo`).

Unit tests of :class:`CallMemo` and :func:`~ep_runtime.core.arrays.fingerprint`, then the runtime on
the simulator (2 ranks, the real kernels): the same array objects refilled in place give the
new data's exact results without being checked again; an array whose shape or dtype was changed
in place, and an ``out`` from a call with another token count, are checked again and refused
before anything is launched; a new array object is prepared afresh.
"""

from __future__ import annotations

import numpy as np
import pytest

from ep_runtime.core import reference
from ep_runtime.core.arrays import fingerprint
from ep_runtime.core.call_memo import CallMemo, PreparedCall
from ep_runtime.core.config import EPConfig
from ep_runtime.shmem.launch import run_pes
from ep_runtime.testing import expert_outputs, input_error_of, make_inputs

RUN_TIMEOUT_S = 240


# -- CallMemo ------------------------------------------------------------------------------------
def _prepared(tag):
    return PreparedCall(kernel=tag, args=(tag,))


def test_memo_reuses_only_the_same_objects_with_the_same_key_and_fingerprints():
    memo, made = CallMemo(), []

    def prepare(tag):
        made.append(tag)
        return _prepared(tag)

    a, b = np.zeros((4, 8), np.uint16), np.zeros(3, np.int32)
    first = memo.get_or_prepare("site", (1,), (a, b, None), lambda: prepare("first"))
    assert memo.get_or_prepare("site", (1,), (a, b, None), lambda: prepare("again")) is first
    assert made == ["first"]
    assert memo.get("site", (2,), (a, b, None)) is None, "another key"
    assert memo.get("site", (1,), (a.copy(), b, None)) is None, "an equal but other object"
    assert memo.get("site", (1,), (a, b)) is None, "fewer objects"
    assert memo.get("other", (1,), (a, b, None)) is None, "another site"
    a.shape = (8, 4)
    assert memo.get("site", (1,), (a, b, None)) is None, "shape changed in place"
    a.shape = (4, 8)
    assert memo.get("site", (1,), (a, b, None)) is first
    b.dtype = np.float32
    assert memo.get("site", (1,), (a, b, None)) is None, "dtype changed in place"
    b.dtype = np.int32
    memo.clear()
    assert memo.get("site", (1,), (a, b, None)) is None


def test_a_failed_prepare_stores_nothing():
    memo = CallMemo()
    a = np.zeros(2)
    kept = memo.get_or_prepare("site", (), (a,), lambda: _prepared("kept"))

    def refuse():
        raise ValueError("bad input")

    with pytest.raises(ValueError):
        memo.get_or_prepare("site", (), (np.zeros(2),), refuse)
    assert memo.get("site", (), (a,)) is kept


def test_fingerprint_sees_address_shape_strides_and_dtype():
    a = np.zeros((4, 6), np.uint16)
    fp = fingerprint(a)
    assert fingerprint(a) == fp and fingerprint(None) is None
    assert fingerprint(a[:, ::2]) != fp
    assert fingerprint(a[1:]) != fp
    assert fingerprint(a.view(np.int16)) != fp
    assert fingerprint(a.reshape(6, 4)) != fp
    other = object()
    assert fingerprint(other) != fingerprint(other), "unknown types are never reused"


# -- the runtime on the simulator ----------------------------------------------------------------
def config(R: int) -> EPConfig:
    return EPConfig(n_ranks=R, n_experts=2 * R, top_k=2, hidden=16, max_tokens_per_rank=8)


def rounds(cfg: EPConfig):
    """Two input sets of the full token count (refilled into the same arrays) and one of 5
    tokens per rank."""
    R = cfg.n_ranks
    return [make_inputs(cfg, "random", 11, [8] * R), make_inputs(cfg, "random", 12, [8] * R),
            make_inputs(cfg, "random", 13, [5] * R)]


def memo_pe(session, R: int) -> dict:
    from ep_runtime.core.runtime import EPRuntime

    cfg, r = config(R), session.rank
    sets = rounds(cfg)
    prepared = []
    got = {"x": [], "out": [], "prepares": [], "errors": {}}
    with EPRuntime(cfg, session) as rt:
        for name in ("_prepare_dispatch_async", "_prepare_combine_async", "_prepare_combine_wait"):
            inner = getattr(rt, name)

            def counted(*a, _inner=inner, _name=name, **k):
                prepared.append(_name)
                return _inner(*a, **k)

            setattr(rt, name, counted)
        tok = np.empty((8, cfg.hidden), np.uint16)
        ids = np.empty((8, cfg.top_k), np.int32)
        ws = np.empty((8, cfg.top_k), np.float32)
        y = np.empty((cfg.recv_rows_capacity, cfg.hidden), np.uint16)
        out = np.empty((8, cfg.hidden), np.uint16)

        def round_trip(t, i, w, xs_ids_ws, o):
            xs, all_ids, all_ws = xs_ids_ws
            batch = rt.dispatch(t, i, w)
            got["x"].append(session.to_host(batch.x))
            y[...] = expert_outputs(cfg, reference.dispatch(xs, all_ids, all_ws, cfg)[r], r)
            got["out"].append(session.to_host(rt.combine(y, batch.handle, out=o)).copy())
            got["prepares"].append(list(prepared))
            prepared.clear()

        for xs, all_ids, all_ws in sets[:2]:  # the same objects, refilled in place
            tok[...], ids[...], ws[...] = xs[r].view(np.uint16), all_ids[r], all_ws[r]
            round_trip(tok, ids, ws, (xs, all_ids, all_ws), out)

        ids.dtype = np.uint32  # changed in place: must be checked again and refused
        got["errors"]["ids_dtype"] = input_error_of(lambda: rt.dispatch_async(tok, ids, ws))
        ids.dtype = np.int32
        tok.shape = (16, cfg.hidden // 2)
        got["errors"]["tokens_shape"] = input_error_of(lambda: rt.dispatch_async(tok, ids, ws))
        tok.shape = (8, cfg.hidden)
        prepared.clear()

        xs, all_ids, all_ws = sets[2]  # new objects of 5 tokens; combine_wait's old out no longer fits
        small = (xs[r].view(np.uint16).copy(), all_ids[r].copy(), all_ws[r].copy())
        batch = rt.dispatch(*small)
        y[...] = expert_outputs(cfg, reference.dispatch(xs, all_ids, all_ws, cfg)[r], r)
        handle = rt.combine_async(y, batch.handle)
        got["errors"]["old_out"] = input_error_of(lambda: rt.combine_wait(handle, out=out))
        got["x"].append(session.to_host(batch.x))
        got["out"].append(session.to_host(rt.combine_wait(handle, out=np.empty((5, cfg.hidden), np.uint16))))
        got["prepares"].append(list(prepared))
    return got


@pytest.fixture(scope="module")
def sim():
    R = 2
    return R, run_pes(memo_pe, R, args=(R,), timeout_s=RUN_TIMEOUT_S)


def test_reused_and_fresh_calls_give_the_reference_results(sim):
    R, per_rank = sim
    cfg = config(R)
    for k, (xs, ids, ws) in enumerate(rounds(cfg)):
        refs = reference.dispatch(xs, ids, ws, cfg)
        want = reference.combine([expert_outputs(cfg, b, r) for r, b in enumerate(refs)], refs, ids, cfg)
        for r, got in enumerate(per_rank):
            n = refs[r].n_rows
            np.testing.assert_array_equal(got["x"][k][:n], refs[r].x.view(np.uint16), err_msg=f"round {k} rank {r}")
            np.testing.assert_array_equal(got["out"][k], want[r].view(np.uint16), err_msg=f"round {k} rank {r}")


def test_the_same_unchanged_arrays_are_not_checked_again(sim):
    _, per_rank = sim
    every = ["_prepare_dispatch_async", "_prepare_combine_async", "_prepare_combine_wait"]
    for r, got in enumerate(per_rank):
        assert got["prepares"][0] == every, f"rank {r}: the first round prepares every call"
        assert got["prepares"][1] == [], f"rank {r}: the refilled arrays were checked again: {got['prepares'][1]}"
        # new token arrays, the same expert outputs, a refused out, then a fitting one
        assert got["prepares"][2] == ["_prepare_dispatch_async"] + ["_prepare_combine_wait"] * 2, \
            f"rank {r}: new arrays (and the refused out) must be prepared afresh: {got['prepares'][2]}"


def test_arrays_changed_in_place_are_checked_again_and_refused(sim):
    _, per_rank = sim
    want = {"ids_dtype": "dispatch_async: topk_ids must have dtype int32",
            "tokens_shape": "dispatch_async: tokens must have shape [*, 16]; got [16, 8]",
            "old_out": "combine_wait: out must have shape [5, 16]; got [8, 16]"}
    for r, got in enumerate(per_rank):
        for case, fragment in want.items():
            message = got["errors"][case]
            assert message is not None and fragment in message, f"rank {r} {case}: {message!r}"
