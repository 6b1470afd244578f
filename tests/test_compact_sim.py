"""The compact layout on the simulator (real kernels, one process per rank): dispatch_wait(layout=
"compact") leaves the received rows where they landed and lists per local expert the rows to
gather; combine_async(layout="compact") takes one row per received token. Both exact against
the reference (:func:`ep_runtime.core.reference.receive_rows`, :func:`~ep_runtime.core.reference.gather_index`,
:func:`~ep_runtime.core.reference.combine_rows`), including the awkward routings, mixed with expanded
calls on one runtime (the routing groups alternate; the token rows share one buffer), and with bad
arguments refused.
"""

from __future__ import annotations

import numpy as np
import pytest

from ep_runtime.core import reference
from ep_runtime.core.config import EPConfig
from ep_runtime.core.layout import dispatch_signal_value
from ep_runtime.core.reference import BF16
from ep_runtime.shmem.launch import run_pes
from ep_runtime.testing import POISON_BF16, input_error_of, make_inputs
from ep_runtime.testing import expert_outputs as expanded_outputs

RUN_TIMEOUT_S = 240
BATCH_FIELDS = ("row_offsets", "expert_counts", "gather", "src_rank", "src_token", "src_k", "weight")


def base_cfg(R: int, **changes) -> dict:
    return {**dict(n_ranks=R, n_experts=2 * R, top_k=2, hidden=16, max_tokens_per_rank=6), **changes}


def cases(R: int) -> list:
    """(name, config dict, scenario, seed, token counts or None)."""
    return [
        ("random", base_cfg(R), "random", 1, None),
        ("zero_rank", base_cfg(R), "zero_rank", 3, None),
        ("empty_expert", base_cfg(R), "empty_expert", 4, None),
        ("one_expert", base_cfg(R), "one_expert", 5, None),
        ("top_k_1", base_cfg(R, top_k=1), "random", 6, None),
        # a long expert list per token (top-k 17) through the routing block's loops over k
        ("top_k_17", base_cfg(R, n_experts=10 * R, top_k=17), "random", 7, None),
        ("pad_4", base_cfg(R, pad_multiple=4), "random", 9, None),
        ("hidden_5_uint16_words", base_cfg(R, hidden=5), "random", 13, None),
        # rows longer than one pass of the copy loop (138 uint64 words > 8 lanes x 8 words x 2)
        ("hidden_552_n_sms_3", base_cfg(R, hidden=552, n_sms=3), "random", 15, (6,) * R),
        ("no_tokens_anywhere", base_cfg(R), "random", 17, (0,) * R),
    ]


def inputs(cfg: EPConfig, scenario, seed, counts):
    return make_inputs(cfg, scenario, seed, None if counts is None else list(counts))


def compact_rows(cfg: EPConfig, xs, ids, rank: int) -> np.ndarray:
    """The compact combine input of ``rank``: [R * T, H] bf16 bits, row ``s * T + t`` =
    bf16((rank + 2) * x_s[t]) where token (s, t) came here, POISON_BF16 elsewhere."""
    x, defined = reference.receive_rows(xs, ids, cfg)[rank]
    rows = (x.astype(np.float32) * np.float32(rank + 2)).astype(BF16).view(np.uint16)
    rows[~defined] = POISON_BF16
    return rows


# -- per-rank body ------------------------------------------------------------------------------
def compact_pe(session, R: int) -> dict:
    from ep_runtime.core.runtime import EPRuntime

    r = session.rank

    def host(batch) -> dict:
        got = {k: session.to_host(getattr(batch, k)) for k in BATCH_FIELDS}
        got["x"] = session.to_host(batch.x)
        got["recv_tokens"] = session.to_host(batch.recv_tokens)
        return got

    def round_trip(rt, cfg, xs, ids, ws, combine_layout):
        batch = rt.dispatch(xs[r].view(np.uint16), ids[r], ws[r], layout="compact")
        got = host(batch)
        got["counts"] = session.to_host(rt.buffers["dispatch_counts"])[(rt.calls - 1) % 2]
        got["signal"] = session.to_host(rt.buffers["dispatch_signal"])[(rt.calls - 1) % 2]
        got["call"] = rt.calls - 1
        if combine_layout == "compact":
            y = compact_rows(cfg, xs, ids, r)
        else:  # a gathering GEMM writes its outputs in the expanded order
            y = expanded_outputs(cfg, reference.dispatch(xs, ids, ws, cfg)[r], r)
        out = rt.combine(y, batch.handle, layout=combine_layout)
        return {"batch": got, "out": session.to_host(out)}

    results = {}
    for name, cfg_d, scenario, seed, counts in cases(R):
        cfg = EPConfig(**cfg_d)
        xs, ids, ws = inputs(cfg, scenario, seed, counts)
        with EPRuntime(cfg, session) as rt:
            results[name] = {layout: round_trip(rt, cfg, xs, ids, ws, layout) for layout in ("compact", "expanded")}

    # one runtime, calls alternating compact / expanded dispatch (routing groups alternate)
    cfg = EPConfig(**base_cfg(R))
    seq = []
    with EPRuntime(cfg, session) as rt:
        for call in range(5):
            counts = tuple((2 * call + r2 + 1) % (cfg.max_tokens_per_rank + 1) for r2 in range(R))
            xs, ids, ws = inputs(cfg, "random", 400 + call, counts)
            if call % 2:
                batch = rt.dispatch(xs[r].view(np.uint16), ids[r], ws[r])
                y = expanded_outputs(cfg, reference.dispatch(xs, ids, ws, cfg)[r], r)
                out = rt.combine(y, batch.handle)
                seq.append({"layout": "expanded", "x": session.to_host(batch.x), "out": session.to_host(out)})
            else:
                res = round_trip(rt, cfg, xs, ids, ws, "compact")
                seq.append({"layout": "compact", **res})
        errors = {}
        xs, ids, ws = inputs(cfg, "random", 499, None)
        handle = rt.dispatch_async(xs[r], ids[r], ws[r])
        errors["dispatch_wait_layout"] = input_error_of(lambda: rt.dispatch_wait(handle, layout="rows"))
        batch = rt.dispatch_wait(handle, layout="compact")
        wrong = np.zeros((cfg.recv_rows_capacity, cfg.hidden), np.uint16)  # expanded-sized rows
        for what, call in {
            "combine_layout": lambda: rt.combine_async(compact_rows(cfg, xs, ids, r), batch.handle, layout="rows"),
            "combine_compact_shape": lambda: rt.combine_async(wrong, batch.handle, layout="compact"),
        }.items():
            errors[what] = input_error_of(call)
        out = rt.combine(compact_rows(cfg, xs, ids, r), batch.handle, layout="compact")
        after = {"out": session.to_host(out)}
    return {"cases": results, "sequence": seq, "errors": errors, "after_errors": after}


@pytest.fixture(scope="module", params=[2, 4])
def sim(request):
    R = request.param
    return R, run_pes(compact_pe, R, args=(R,), timeout_s=RUN_TIMEOUT_S)


# -- checks -----------------------------------------------------------------------------------
def check_compact_batch(got: dict, cfg: EPConfig, xs, ids, ws, r: int, what: str, fresh: bool = True) -> None:
    """``fresh``: the runtime's first call, so rows past the batch still hold their initial -1."""
    ref = reference.dispatch(xs, ids, ws, cfg)[r]
    x_ref, defined = reference.receive_rows(xs, ids, cfg)[r]
    n = ref.n_rows
    assert got["x"].shape == (cfg.n_ranks * cfg.max_tokens_per_rank, cfg.hidden), what
    bad = np.flatnonzero((got["x"][defined] != x_ref.view(np.uint16)[defined]).any(axis=1))
    assert not len(bad), f"{what}: rank {r}: received rows {np.flatnonzero(defined)[bad][:8]} differ"
    assert got["recv_tokens"].tolist() == [len(x) for x in xs], what
    if "counts" in got:  # [src, :L]: per-expert counts, stored by each source's routing block
        L = cfg.n_local_experts
        flat = [np.asarray(i).reshape(-1) for i in ids]
        per_source = np.array([np.bincount(f[f // L == r] - r * L, minlength=L) for f in flat])
        np.testing.assert_array_equal(got["counts"][:, :L], per_source, err_msg=f"{what}: counts")
        # each source's signal carries its call and its token count
        assert got["signal"].tolist() == [dispatch_signal_value(got["call"], len(x)) for x in xs], what
    np.testing.assert_array_equal(got["expert_counts"], ref.expert_counts, err_msg=what)
    np.testing.assert_array_equal(got["gather"][:n], reference.gather_index(ref, cfg), err_msg=what)
    if fresh:
        assert (got["gather"][n:] == -1).all(), f"{what}: gather written past row {n}"
    for k in ("src_rank", "src_token", "src_k"):
        np.testing.assert_array_equal(got[k][:n], getattr(ref, k), err_msg=f"{what}: {k}")
    np.testing.assert_array_equal(got["weight"][:n].view(np.uint32), ref.weight.view(np.uint32), err_msg=what)
    real = got["gather"][:n] >= 0
    np.testing.assert_array_equal(got["x"][got["gather"][:n][real]], ref.x.view(np.uint16)[real],
                                  err_msg=f"{what}: x[gather] is not the expanded batch")


def test_compact_dispatch_equals_the_reference_exactly(sim):
    R, per_rank = sim
    for name, cfg_d, scenario, seed, counts in cases(R):
        cfg = EPConfig(**cfg_d)
        xs, ids, ws = inputs(cfg, scenario, seed, counts)
        for r, res in enumerate(per_rank):
            for layout in ("compact", "expanded"):  # a fresh runtime per case, two calls on it
                check_compact_batch(res["cases"][name][layout]["batch"], cfg, xs, ids, ws, r, f"{name} ({layout})",
                                    fresh=layout == "compact")


def test_compact_combine_equals_the_reference_exactly(sim):
    """Rows of tokens that did not come to a rank hold NaN there: reading one would show."""
    R, per_rank = sim
    for name, cfg_d, scenario, seed, counts in cases(R):
        cfg = EPConfig(**cfg_d)
        xs, ids, ws = inputs(cfg, scenario, seed, counts)
        want = reference.combine_rows([compact_rows(cfg, xs, ids, r) for r in range(R)], ids, cfg)
        for r, res in enumerate(per_rank):
            got = res["cases"][name]["compact"]["out"]
            assert got.shape == want[r].shape, name
            np.testing.assert_array_equal(got, want[r].view(np.uint16), err_msg=f"{name}: rank {r}")


def test_expanded_combine_after_a_compact_dispatch_equals_the_reference(sim):
    """A GEMM gathering the compact batch writes expanded-order outputs: combine takes them."""
    R, per_rank = sim
    for name, cfg_d, scenario, seed, counts in cases(R):
        cfg = EPConfig(**cfg_d)
        xs, ids, ws = inputs(cfg, scenario, seed, counts)
        refs = reference.dispatch(xs, ids, ws, cfg)
        want = reference.combine([expanded_outputs(cfg, b, r) for r, b in enumerate(refs)], refs, ids, cfg)
        for r, res in enumerate(per_rank):
            np.testing.assert_array_equal(res["cases"][name]["expanded"]["out"], want[r].view(np.uint16),
                                          err_msg=f"{name}: rank {r}")


def test_compact_and_expanded_calls_alternate_on_one_runtime(sim):
    R, per_rank = sim
    cfg = EPConfig(**base_cfg(R))
    for call in range(5):
        counts = tuple((2 * call + r2 + 1) % (cfg.max_tokens_per_rank + 1) for r2 in range(R))
        xs, ids, ws = inputs(cfg, "random", 400 + call, counts)
        refs = reference.dispatch(xs, ids, ws, cfg)
        if call % 2:
            want = reference.combine([expanded_outputs(cfg, b, r) for r, b in enumerate(refs)], refs, ids, cfg)
        else:
            want = reference.combine_rows([compact_rows(cfg, xs, ids, r) for r in range(R)], ids, cfg)
        for r, res in enumerate(per_rank):
            got = res["sequence"][call]
            if got["layout"] == "compact":
                check_compact_batch(got["batch"], cfg, xs, ids, ws, r, f"call {call}", fresh=call == 0)
            else:
                np.testing.assert_array_equal(got["x"][:refs[r].n_rows], refs[r].x.view(np.uint16))
            np.testing.assert_array_equal(got["out"], want[r].view(np.uint16), err_msg=f"call {call}: rank {r}")


def test_bad_layouts_and_shapes_are_refused_before_launch(sim):
    R, per_rank = sim
    cfg = EPConfig(**base_cfg(R))
    rows = R * cfg.max_tokens_per_rank
    xs, ids, ws = inputs(cfg, "random", 499, None)
    want = reference.combine_rows([compact_rows(cfg, xs, ids, r) for r in range(R)], ids, cfg)
    for r, res in enumerate(per_rank):
        e = res["errors"]
        assert e["dispatch_wait_layout"] and "layout='rows'" in e["dispatch_wait_layout"] \
            and "'compact'" in e["dispatch_wait_layout"], e
        assert e["combine_layout"] and "layout='rows'" in e["combine_layout"], e
        assert e["combine_compact_shape"] and f"[n_ranks * max_tokens_per_rank = {rows}" in e["combine_compact_shape"], e
        # the refused calls left the runtime usable
        np.testing.assert_array_equal(res["after_errors"]["out"], want[r].view(np.uint16))
