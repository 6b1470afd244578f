"""Measure the simulator at many PEs (#66; docs/plans.md, "The simulator at many PEs (#66)").

    python tools/sim_pes.py 16 32 64                # a round trip, hierarchical and flat, about 2 minutes on 2 cores
    python tools/sim_pes.py 64 128 --bring-up-only  # sessions and collectives only, any PE count

A round trip is the wide test's (tests/test_wide_sim.py: hidden 8, two tokens a rank, two experts
a rank, top-4, the expanded layout, one dispatch and one combine), on logical nodes of 8 PEs with
the hierarchical transport and on one node with flat puts; it is checked against the reference.
``--bring-up-only`` runs what every job does besides its kernels (bring-up, the logical nodes, an
allocation, 20 barriers, an allgather, close), which runs past the configuration's 64 ranks.

Per run it prints the wall time and when the last PE had started, entered its target, built its
runtime and finished its dispatch and its combine (seconds from the start, the last PE's), the
CPU seconds of a PE (mean, from its start), and the peak of the PEs' proportional set sizes
(Pss) summed, sampled every 2 s. The machine's other work changes the times: it prints the load
average beside them.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ep_runtime.core.config import EPConfig  # noqa: E402
from ep_runtime.core.layout import BufferLayout  # noqa: E402
from ep_runtime.shmem.launch import run_pes  # noqa: E402
from ep_runtime.testing import assert_calls_are_the_reference  # noqa: E402

SEED = 66
NODE_SIZE = 8
BARRIERS = 20
#: the phases a round trip stamps, in order (seconds from the launch, the last PE's)
PHASES = ("entered", "runtime", "dispatch", "combine")


def round_trip_cfg(R: int) -> EPConfig:
    """tests/test_wide_sim.py's configuration."""
    return EPConfig(n_ranks=R, n_experts=2 * R, top_k=4, hidden=8, max_tokens_per_rank=2, layouts=("expanded",),
                    wait_timeout_s=600.0)


def round_trip_pe(session, n_nodes: int, cfg: EPConfig, plan: dict) -> dict:
    """``testing.wide_round_trip_pe`` with a time stamp after each phase."""
    import numpy as np

    from ep_runtime.core.runtime import EPRuntime
    from ep_runtime.testing import call_inputs, dispatch_to_host, expert_outputs, received_batch

    stamps, r = {"entered": time.time()}, session.rank
    if n_nodes > 1:
        session.use_logical_nodes(n_nodes)
    xs, ids, ws = call_inputs(cfg, 0, SEED)
    with EPRuntime(cfg, session, plan=plan) as rt:
        stamps["runtime"] = time.time()
        got, batch = dispatch_to_host(session, rt, cfg, xs[r].view(np.uint16), ids[r], ws[r], "expanded")
        stamps["dispatch"] = time.time()
        y = session.to_device(expert_outputs(cfg, received_batch(got), r))
        got["out"] = session.to_host(rt.combine(y, batch.handle)).copy()[:len(xs[r])]
        stamps["combine"] = time.time()
        transport = rt.plan.as_dict()["transport"]
    return {"calls": [got], "stamps": stamps, "transport": transport, "cpu_s": time.process_time(),
            "started": psutil.Process().create_time()}


def bring_up_pe(session, n_nodes: int) -> dict:
    """Bring-up (before the call), the logical nodes, an allocation, barriers, an allgather."""
    stamps = {"entered": time.time()}
    session.use_logical_nodes(n_nodes)
    session.alloc_symmetric("probe", (1024,), "int32")
    for _ in range(BARRIERS):
        session.barrier()
    session.allgather_object(session.rank)
    stamps["done"] = time.time()
    return {"stamps": stamps, "cpu_s": time.process_time(), "started": psutil.Process().create_time()}


class PssPeak:
    """The peak, sampled every 2 s, of the proportional set sizes of this process's descendants summed."""

    def __init__(self):
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def _sample(self):
        me = psutil.Process()
        while not self._stop.is_set():
            total = 0
            for child in me.children(recursive=True):
                try:
                    total += child.memory_full_info().pss
                except psutil.Error:  # exited meanwhile
                    pass
            self.peak = max(self.peak, total)
            self._stop.wait(2.0)


def measure(R: int, what: str) -> str:
    """One run of ``what`` (``hierarchical``, ``puts`` or ``bring-up``) on ``R`` PEs: a line of the table."""
    if what == "bring-up":
        target, args, heap, phases = bring_up_pe, (R // NODE_SIZE,), 16 << 20, ("entered", "done")
    else:
        cfg = round_trip_cfg(R)
        hierarchical = what == "hierarchical"
        args = (R // NODE_SIZE if hierarchical else 1, cfg, {} if hierarchical else {"transport": "puts"})
        target, heap, phases = round_trip_pe, BufferLayout(cfg).symmetric_bytes, PHASES
    start = time.time()
    with PssPeak() as pss:
        runs = run_pes(target, R, args=args, timeout_s=1800, heap_bytes=heap)
    wall = time.time() - start
    if what != "bring-up":
        assert all(run["transport"] == what for run in runs), [run["transport"] for run in runs]
        assert_calls_are_the_reference(cfg, runs, 1, SEED, what, node_size=NODE_SIZE if hierarchical else 0)
    last = {p: max(run["stamps"][p] for run in runs) - start for p in phases}
    started = max(run["started"] for run in runs) - start
    cpu = sum(run["cpu_s"] for run in runs) / R
    return (f"| {R} | {what} | {wall:.1f} | {started:.1f} | " + " | ".join(f"{last[p]:.1f}" for p in phases)
            + f" | {cpu:.2f} | {pss.peak / 1e6:,.0f} | {os.getloadavg()[0]:.0f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("ranks", type=int, nargs="+", help="PE counts, multiples of 8")
    parser.add_argument("--bring-up-only", action="store_true", help="no runtime: sessions and collectives only")
    args = parser.parse_args()
    whats = ("bring-up",) if args.bring_up_only else ("hierarchical", "puts")
    phases = ("entered", "done") if args.bring_up_only else PHASES
    print("| PEs | run | wall s | last started | " + " | ".join(f"last {p}" for p in phases)
          + " | CPU s a PE | peak Pss MB | load |")
    print("| --- " * (7 + len(phases)) + "|")
    for R in args.ranks:
        for what in whats:
            print(measure(R, what), flush=True)


if __name__ == "__main__":
    main()
