"""``combine_async(..., weights=)`` on the simulator, exact against the reference: the dispatch's
router weights (the default), no weights (``None``: each partial the plain sum of a token's rows,
as Megatron's HybridEP and DeepEP combine, and as an autograd backward sums gradients), and
explicit per-row weights; every plan the simulator runs, both dispatch layouts feeding an
expanded combine; and the arguments refused before any launch."""

from __future__ import annotations

import numpy as np
import pytest

from ep_runtime.core import reference
from ep_runtime.core.config import EPConfig
from ep_runtime.shmem.launch import run_pes
from ep_runtime.testing import expert_outputs, make_inputs

RUN_TIMEOUT_S = 240
SEED = 41
MODES = ("dispatch", "none", "explicit")


def case_cfg(R: int) -> EPConfig:
    return EPConfig(n_ranks=R, n_experts=2 * R, top_k=2, hidden=32, max_tokens_per_rank=6, wait_timeout_s=60.0)


def explicit_weights(cfg: EPConfig, batches) -> list:
    """Per rank a float32 [capacity] array: a weight per row, unlike any router weight."""
    rng = np.random.default_rng(SEED + 7)
    return [rng.uniform(-2, 2, cfg.recv_rows_capacity).astype(np.float32) for _ in batches]


def weights_pe(session, cfg: EPConfig) -> dict:
    from ep_runtime.core.errors import EPInputError
    from ep_runtime.core.runtime import EPRuntime

    r, res = session.rank, {}
    xs, ids, ws = make_inputs(cfg, "masked", SEED)
    refs = reference.dispatch(xs, ids, ws, cfg)
    y = expert_outputs(cfg, refs[r], r)
    explicit = explicit_weights(cfg, refs)[r]
    with EPRuntime(cfg, session) as rt:
        for layout in ("expanded", "compact"):
            for mode in MODES:
                batch = rt.dispatch_wait(rt.dispatch_async(xs[r].view(np.uint16), ids[r], ws[r]), layout=layout)
                w = {"dispatch": "dispatch", "none": None, "explicit": explicit}[mode]
                res[layout, mode] = session.to_host(rt.combine(y, batch.handle, weights=w)).copy()[:len(xs[r])]
        errors = {}
        bad = {"compact_rows_with_weights": dict(layout="compact", weights=None),
               "weights_float64": dict(weights=explicit.astype(np.float64)),
               "weights_too_short": dict(weights=explicit[:3]),
               "weights_unknown_string": dict(weights="router")}
        for name, kw in bad.items():
            batch = rt.dispatch_wait(rt.dispatch_async(xs[r].view(np.uint16), ids[r], ws[r]))
            rows = np.zeros((cfg.n_ranks * cfg.max_tokens_per_rank, cfg.hidden), np.uint16)
            try:
                rt.combine_async(rows if kw.get("layout") == "compact" else y, batch.handle, **kw)
                errors[name] = None
            except EPInputError as e:
                errors[name] = str(e)
            rt.combine(y, batch.handle)  # the runtime goes on: the refused call launched nothing
        res["errors"] = errors
    return res


@pytest.fixture(scope="module", params=[2, 3])
def run(request):
    cfg = case_cfg(request.param)
    return cfg, run_pes(weights_pe, request.param, args=(cfg,), timeout_s=RUN_TIMEOUT_S)


@pytest.mark.parametrize("layout", ["expanded", "compact"])
@pytest.mark.parametrize("mode", MODES)
def test_combine_applies_the_weights_asked_for(run, mode, layout):
    cfg, per_rank = run
    xs, ids, ws = make_inputs(cfg, "masked", SEED)
    refs = reference.dispatch(xs, ids, ws, cfg)
    weights = {"dispatch": "dispatch", "none": None, "explicit": explicit_weights(cfg, refs)}[mode]
    want = reference.combine([expert_outputs(cfg, refs[s], s) for s in range(cfg.n_ranks)], refs, ids, cfg,
                             weights=weights)
    for r, res in enumerate(per_rank):
        np.testing.assert_array_equal(res[layout, mode], want[r].view(np.uint16), err_msg=f"rank {r} {mode} {layout}")
    if mode != "dispatch":  # the weights changed the output (where any token has a row)
        default = [res[layout, "dispatch"] for res in per_rank]
        assert any(not np.array_equal(a, res[layout, mode]) for a, res in zip(default, per_rank))


def test_bad_weights_are_refused_before_launch(run):
    cfg, per_rank = run
    for r, res in enumerate(per_rank):
        errors = res["errors"]
        for name, frag in (("compact_rows_with_weights", "weights= applies to the expanded and batched layouts only"),
                           ("weights_float64", "weights must have dtype float32"),
                           ("weights_too_short", "weights must have shape"),
                           ("weights_unknown_string", "expected 'dispatch', None or a float32")):
            assert errors[name] is not None and frag in errors[name], f"rank {r} {name}: {errors[name]!r}"
