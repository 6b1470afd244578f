"""Phase time stamps (``ep_runtime/kernels/trace.py``, ``EP_RUNTIME_TRACE=1``) on the simulator: the real
kernels, one process per rank.

With the switch on, every receiver's round trip is stamped (``wait``, ``land``, route first with
its copy in one launch and with dispatch_copy; the plan from ``EP_RUNTIME_PLAN``): each kernel's
points come after its start, the kernels come in stream order, each receiver stamps the points
of its own mechanism and none of another's; the results stay exact (tracing writes only the
trace words). With it off (the default), the trace words stay zero.
"""

from __future__ import annotations

import numpy as np
import pytest

from ep_runtime.core import reference
from ep_runtime.core.config import EPConfig
from ep_runtime.shmem.launch import run_pes
from ep_runtime.testing import make_inputs

CFG = dict(n_ranks=2, n_experts=4, top_k=2, hidden=16, max_tokens_per_rank=6)
SEED = 5


def trace_pe(session) -> dict:
    from ep_runtime.kernels.trace import TRACE
    from ep_runtime.core.layout import TRACE_BASE
    from ep_runtime.core.runtime import EPRuntime

    cfg = EPConfig(**CFG)
    xs, ids, ws = make_inputs(cfg, "random", SEED)
    r = session.rank
    out = {"trace_on": TRACE}
    with EPRuntime(cfg, session) as rt:
        out["plan"] = rt.plan.as_dict()
        status = rt.buffers["status"]
        for layout in ("expanded", "compact"):
            status[TRACE_BASE:] = 0
            batch = rt.dispatch(xs[r].view(np.uint16), ids[r], ws[r], layout=layout)
            out[layout] = {"x": session.to_host(batch.x).copy(),
                           "rows": int(session.to_host(batch.row_offsets)[-1]),
                           "stamps": session.to_host(status)[TRACE_BASE:].copy()}
    return out


#: run -> plan overrides (the trace switch is on in every run but "off")
RUNS = {"on": "receiver=wait", "off": "receiver=wait", "on_land": "receiver=land",
        "on_first": "receiver=route_first,expanded_copy=in_wait",
        "on_first_copy": "receiver=route_first,expanded_copy=dispatch_copy"}


@pytest.fixture(scope="module", params=list(RUNS))
def traced(request):
    with pytest.MonkeyPatch.context() as mp:  # the PEs are spawned with this environment
        mp.setenv("EP_RUNTIME_TRACE", "0" if request.param == "off" else "1")
        mp.setenv("EP_RUNTIME_PLAN", RUNS[request.param])
        return request.param.partition("_")[0], run_pes(trace_pe, CFG["n_ranks"], timeout_s=240)


def slots_of(kernel: str) -> dict:
    from ep_runtime.kernels.trace import SLOTS

    return {point: slot for slot, (k, point) in SLOTS.items() if k == kernel}


def test_the_switch_reaches_the_kernels(traced):
    mode, per_rank = traced
    for res in per_rank:
        assert res["trace_on"] == (mode == "on")


def test_dispatch_stays_exact_with_tracing(traced):
    mode, per_rank = traced
    cfg = EPConfig(**CFG)
    xs, ids, ws = make_inputs(cfg, "random", SEED)
    refs = reference.dispatch(xs, ids, ws, cfg)
    for r, res in enumerate(per_rank):
        n = refs[r].n_rows
        assert res["expanded"]["rows"] == n
        np.testing.assert_array_equal(res["expanded"]["x"][:n], refs[r].x.view(np.uint16), err_msg=f"{mode} rank {r}")


#: receiver -> (kernel, point) its runs must stamp: the mechanism it has and the others do not
OWN_POINTS = {"wait": ("dispatch_wait", "offsets written (last block)"),
              "land": ("dispatch_land", "rows placed and landed (last block)"),
              "route_first": ("dispatch_wait", "rows placed (route first)")}


def test_stamps_are_written_in_order_only_when_on(traced):
    mode, per_rank = traced
    for res in per_rank:
        plan = res["plan"]
        receiver, copy = plan["receiver"], plan["expanded_copy"]
        for layout in ("expanded", "compact"):
            st = res[layout]["stamps"]
            if mode == "off":
                assert not st.any(), f"{layout}: trace words written with tracing off"
                continue
            receive = "dispatch_land" if receiver == "land" else "dispatch_wait"
            kernels = ["dispatch_async", receive] + (["dispatch_copy"] if layout == "expanded" and
                                                     copy == "dispatch_copy" else [])
            starts = []
            for k in kernels:
                points = slots_of(k)
                start = st[points.pop("start")]
                assert start > 0, f"{layout}: {k} start not stamped"
                for point, slot in points.items():
                    assert st[slot] == 0 or st[slot] >= start, f"{layout}: {k} '{point}' before its start"
                    if "(route first)" in point and receiver != "route_first":
                        assert st[slot] == 0, f"{layout}: {k} '{point}' stamped by the {receiver} receiver"
                starts.append(start)
            assert starts == sorted(starts), f"{layout}: kernels out of stream order {starts}"
            kernel, point = OWN_POINTS[receiver]
            assert st[slots_of(kernel)[point]] >= st[slots_of(kernel)["start"]] > 0, (layout, kernel, point)
            if "dispatch_copy" not in kernels and not (copy == "in_wait" and layout == "expanded"):
                assert st[slots_of("dispatch_copy")["start"]] == 0, f"{layout}: dispatch_copy ran"
            other = "dispatch_wait" if receiver == "land" else "dispatch_land"
            assert st[slots_of(other)["start"]] == 0, f"{layout}: {other} ran"
