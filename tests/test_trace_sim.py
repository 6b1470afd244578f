"""Phase time stamps (``kernels/trace.py``, ``EP_RUNTIME_TRACE=1``) on the simulator: the real
kernels, one process per rank.

With the switch on, every traced point of a round trip is stamped (the landing, placing and
route-first runtimes' too, ``EP_RUNTIME_DISPATCH_LAND=1``, ``..._PLACE=1``, ``..._ROUTE_FIRST=1``),
each kernel's points come after its start, and the kernels come
in stream order; the results stay exact (tracing writes
only the trace words). With it off (the default), the trace words stay zero.
"""

from __future__ import annotations

import numpy as np
import pytest

from ep_runtime import reference
from ep_runtime.config import EPConfig
from ep_runtime.shmem.launch import run_pes
from ep_runtime.testing import make_inputs

CFG = dict(n_ranks=2, n_experts=4, top_k=2, hidden=16, max_tokens_per_rank=6)
SEED = 5


def trace_pe(session) -> dict:
    from ep_runtime.kernels.trace import TRACE
    from ep_runtime.layout import STATUS_LEN
    from ep_runtime.runtime import EPRuntime

    cfg = EPConfig(**CFG)
    xs, ids, ws = make_inputs(cfg, "random", SEED)
    r = session.rank
    out = {"trace_on": TRACE}
    with EPRuntime(cfg, session) as rt:
        out["fused_copy"] = rt.fused_copy
        out["land"] = rt.dispatch_land
        out["place"] = rt.dispatch_place
        out["route_first"] = rt.dispatch_route_first
        status = rt.buffers["status"]
        for layout in ("expanded", "compact"):
            status[STATUS_LEN:] = 0
            batch = rt.dispatch(xs[r].view(np.uint16), ids[r], ws[r], layout=layout)
            out[layout] = {"x": session.to_host(batch.x).copy(),
                           "rows": int(session.to_host(batch.row_offsets)[-1]),
                           "stamps": session.to_host(status)[STATUS_LEN:].copy()}
    return out


@pytest.fixture(scope="module", params=["on", "off", "on_separate_copy", "on_land", "on_place", "on_first"])
def traced(request):
    with pytest.MonkeyPatch.context() as mp:  # the PEs are spawned with this environment
        mp.setenv("EP_RUNTIME_TRACE", "0" if request.param == "off" else "1")
        mp.setenv("EP_RUNTIME_FUSED_COPY", "0" if request.param == "on_separate_copy" else "auto")
        mp.setenv("EP_RUNTIME_DISPATCH_LAND", "1" if request.param == "on_land" else "0")
        mp.setenv("EP_RUNTIME_DISPATCH_PLACE", "1" if request.param == "on_place" else "0")
        mp.setenv("EP_RUNTIME_DISPATCH_ROUTE_FIRST", "1" if request.param == "on_first" else "0")
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


def test_stamps_are_written_in_order_only_when_on(traced):
    mode, per_rank = traced
    for res in per_rank:
        for layout in ("expanded", "compact"):
            st = res[layout]["stamps"]
            if mode == "off":
                assert not st.any(), f"{layout}: trace words written with tracing off"
                continue
            # (a route-first runtime's fused copy is dispatch_copy's, run by dispatch_wait's blocks:
            # its points are stamped, after dispatch_wait's start)
            copy_kernel = layout == "expanded" and (res["route_first"] or not res["fused_copy"]) and not res["land"]
            kernels = ["dispatch_async", "dispatch_land" if res["land"] else "dispatch_wait"]
            kernels += ["dispatch_copy"] if copy_kernel else []
            starts = []
            for k in kernels:
                points = slots_of(k)
                start = st[points.pop("start")]
                assert start > 0, f"{layout}: {k} start not stamped"
                for point, slot in points.items():
                    if "route-first" in point and res["route_first"]:  # its routing block, its one block
                        assert st[slot] >= start, f"{layout}: {k} '{point}' ({st[slot]}) before its start ({start})"
                        continue
                    if "route-first builds" in point:
                        assert st[slot] == 0, f"{layout}: {k} '{point}' stamped in a runtime without route first"
                        continue
                    if res["route_first"] and (point.startswith(("offsets", "ranks computed"))
                                               or point == "signals seen (block 0)"):
                        # nothing ranked in dispatch_async; the one block's points are its own
                        assert st[slot] == 0, f"{layout}: {k} '{point}' stamped in a route-first runtime"
                        continue
                    if "copy engine" in point:  # this runtime stores the rows: never stamped
                        assert st[slot] == 0, f"{layout}: {k} '{point}' stamped without the copy engine"
                        continue
                    if "landing calls" in point and not res["land"]:
                        assert st[slot] == 0, f"{layout}: {k} '{point}' stamped in a call that does not land"
                        continue
                    if "placing builds" in point and not res["place"]:
                        assert st[slot] == 0, f"{layout}: {k} '{point}' stamped in a runtime that does not place"
                        continue
                    if res["place"] and k == "dispatch_wait" and point.startswith("offsets"):
                        # a placing dispatch_wait only waits for the signals: dispatch_async placed
                        assert st[slot] == 0, f"{layout}: {k} '{point}' stamped in a runtime that places"
                        continue
                    assert st[slot] >= start, f"{layout}: {k} '{point}' ({st[slot]}) before its start ({start})"
                starts.append(start)
            assert starts == sorted(starts), f"{layout}: kernels out of stream order {starts}"
            if not copy_kernel:
                assert st[slots_of("dispatch_copy")["start"]] == 0, f"{layout}: dispatch_copy ran"
            other = "dispatch_wait" if res["land"] else "dispatch_land"
            assert st[slots_of(other)["start"]] == 0, f"{layout}: {other} ran"
