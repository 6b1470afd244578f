"""Both ways the kernels send, and both widths they move rows in, on the simulator (the real
kernels, one process per rank), exact against the reference.

- Sending: dispatch_async, combine_async and combine_async_rows store into peers' heaps through
  their mappings (``transport=stores``, where every PE's heap is mapped) or send with NVSHMEM puts
  (``transport=puts``).
- Width: rows move as word pairs (``ep_runtime/kernels/vec.py``: one 16-byte access per pair of uint64
  words) where every row starts 16-byte aligned, one word at a time otherwise: here the
  caller's tokens, expert outputs and combine outputs placed 8 bytes off a 16-byte boundary.
- The expanded copy: in dispatch_copy (the ``wait`` receiver) and in one route-first launch.

Each combination runs bf16 dispatch (expanded and compact, the copy loops' full passes and
tail: hidden 552 is 138 words) and combine (expanded and compact, bf16 and float32 partials)
and must give the reference's bits: the paths move the same words and sum in the same order.
"""

from __future__ import annotations

import numpy as np
import pytest

from ep_runtime.core import reference
from ep_runtime.core.config import EPConfig
from ep_runtime.core.reference import BF16
from ep_runtime.shmem.launch import run_pes
from ep_runtime.testing import POISON_BF16, make_inputs, off_by_8
from ep_runtime.testing import expert_outputs as expanded_outputs

RUN_TIMEOUT_S = 240
#: mode name -> (plan overrides, caller arrays 8 bytes off a 16-byte boundary)
MODES = {"peer_stores": ({"transport": "stores"}, False), "puts": ({"transport": "puts"}, False),
         "peer_stores_misaligned": ({"transport": "stores"}, True), "puts_misaligned": ({"transport": "puts"}, True),
         "one_launch_copy": ({"receiver": "route_first", "expanded_copy": "in_wait"}, False),
         "one_launch_copy_misaligned": ({"receiver": "route_first", "expanded_copy": "in_wait"}, True),
         # two placing blocks share the descriptions at every size; the other blocks copy
         "one_launch_copy_two_placers": ({"receiver": "route_first", "expanded_copy": "in_wait",
                                          "share_from_tokens": 1, "placing_blocks": 2}, False)}


def cases(R: int) -> list:
    """(name, config dict, seed, token counts)."""
    base = dict(n_ranks=R, n_experts=2 * R, top_k=2, max_tokens_per_rank=12)
    return [
        ("hidden_16", {**base, "hidden": 16}, 1, None),
        ("hidden_552_two_passes_and_tail", {**base, "hidden": 552, "n_sms": 2}, 2, (12,) * R),
        ("float32_partials", {**base, "hidden": 16, "combine_dtype": "float32"}, 3, None),
        # a grid of 4: a copying route-first dispatch_wait places in two blocks and copies in two
        ("hidden_16_n_sms_4", {**base, "hidden": 16, "n_sms": 4}, 4, None),
    ]


def inputs(cfg: EPConfig, seed, counts):
    return make_inputs(cfg, "random", seed, None if counts is None else list(counts))


def compact_rows(cfg: EPConfig, xs, ids, rank: int) -> np.ndarray:
    """[R * T, H] in the partials' dtype: (rank + 2) x the received row, NaN where none came."""
    x, defined = reference.receive_rows(xs, ids, cfg)[rank]
    rows = x.astype(np.float32) * np.float32(rank + 2)
    if cfg.combine_dtype == "float32":
        rows[~defined] = np.nan
        return rows
    rows = rows.astype(BF16).view(np.uint16)
    rows[~defined] = POISON_BF16
    return rows


# -- per-rank body ------------------------------------------------------------------------------
def paths_pe(session, R: int, plan: dict, misaligned: bool) -> dict:
    from ep_runtime.core.runtime import EPRuntime

    r = session.rank
    place = off_by_8 if misaligned else np.ascontiguousarray
    results = {}
    for name, cfg_d, seed, counts in cases(R):
        cfg = EPConfig(**cfg_d)
        xs, ids, ws = inputs(cfg, seed, counts)
        T = len(xs[r])
        with EPRuntime(cfg, session, plan=plan) as rt:
            got = {"plan": rt.plan.as_dict(),
                   "built_for": {k: transport_modules(rt._kernels[k]) for k in
                                 ("dispatch_async", "combine_async", "combine_async_rows")}}
            batch = rt.dispatch(place(xs[r].view(np.uint16)), ids[r], ws[r])
            got["x"] = session.to_host(batch.x)
            y = expanded_outputs(cfg, reference.dispatch(xs, ids, ws, cfg)[r], r)
            out = place(np.zeros((T, cfg.hidden), np.uint16))
            got["out"] = session.to_host(rt.combine(place(y), batch.handle, out=out))
            cbatch = rt.dispatch(place(xs[r].view(np.uint16)), ids[r], ws[r], layout="compact")
            got["compact_x"] = session.to_host(cbatch.x)
            out = place(np.zeros((T, cfg.hidden), np.uint16))
            got["compact_out"] = session.to_host(rt.combine(place(compact_rows(cfg, xs, ids, r)), cbatch.handle,
                                                            layout="compact", out=out))
        results[name] = got
    return results


def transport_modules(kernel) -> set:
    """The transport modules whose device functions a kernel was built with, through every
    device function it calls (their closure cells): ``stores``, ``puts`` or ``hierarchical`` of
    ``ep_runtime.kernels.transport``."""
    seen, found, todo = set(), set(), [kernel]
    while todo:
        item = todo.pop()
        func = getattr(item, "py_func", item)  # a dispatcher's function, or the simulator's plain one
        if id(func) in seen or not hasattr(func, "__code__"):
            continue
        seen.add(id(func))
        package, _, name = func.__module__.rpartition(".")
        if package == "ep_runtime.kernels.transport" and name != "common":
            found.add(name)
        todo += [c.cell_contents for c in func.__closure__ or () if callable(c.cell_contents)]
    return found


@pytest.fixture(scope="module", params=sorted(MODES))
def sim(request):
    mode = request.param
    plan, misaligned = MODES[mode]
    R = 2
    per_rank = run_pes(paths_pe, R, args=(R, plan, misaligned), timeout_s=RUN_TIMEOUT_S)
    return mode, R, per_rank


def test_the_runtime_takes_the_send_path_asked_for(sim):
    mode, R, per_rank = sim
    for res in per_rank:
        for name, got in res.items():
            for key, value in MODES[mode][0].items():
                assert got["plan"][key] == value, f"{mode} {name}: {key}"
            # the transport is compiled in: the kernels the runtime launches call its device module
            want = {got["plan"]["transport"]}
            assert all(b == want for b in got["built_for"].values()), (mode, name, got["built_for"])


def test_dispatch_equals_the_reference_exactly(sim):
    mode, R, per_rank = sim
    for name, cfg_d, seed, counts in cases(R):
        cfg = EPConfig(**cfg_d)
        xs, ids, ws = inputs(cfg, seed, counts)
        refs = reference.dispatch(xs, ids, ws, cfg)
        recv = reference.receive_rows(xs, ids, cfg)
        for r, res in enumerate(per_rank):
            got = res[name]
            n = refs[r].n_rows
            np.testing.assert_array_equal(got["x"][:n], refs[r].x.view(np.uint16), err_msg=f"{mode} {name} rank {r}")
            x_ref, defined = recv[r]
            np.testing.assert_array_equal(got["compact_x"][defined], x_ref.view(np.uint16)[defined],
                                          err_msg=f"{mode} {name} rank {r} (compact)")


def test_combine_equals_the_reference_bit_for_bit(sim):
    mode, R, per_rank = sim
    for name, cfg_d, seed, counts in cases(R):
        cfg = EPConfig(**cfg_d)
        xs, ids, ws = inputs(cfg, seed, counts)
        refs = reference.dispatch(xs, ids, ws, cfg)
        want = reference.combine([expanded_outputs(cfg, b, r) for r, b in enumerate(refs)], refs, ids, cfg)
        want_rows = reference.combine_rows([compact_rows(cfg, xs, ids, r) for r in range(R)], ids, cfg)
        for r, res in enumerate(per_rank):
            np.testing.assert_array_equal(res[name]["out"], want[r].view(np.uint16), err_msg=f"{mode} {name} rank {r}")
            np.testing.assert_array_equal(res[name]["compact_out"], want_rows[r].view(np.uint16),
                                          err_msg=f"{mode} {name} rank {r} (compact)")
