"""The SHMEM layer's exchange tests on real NVSHMEM (run on the GPU machine):

    mpirun -np 2 -x PYTHONPATH python3 tests/gpu/shmem_check.py

Runs the per-PE bodies and the exact NumPy checks of tests/test_shmem_sim.py, with every
rank of this mpirun job as one PE of the ``nvshmem`` backend instead of a simulated process:
ring put_signal, all-to-all put_nbi_block + fence + signal (three dtypes), warp put_signal
with SIGNAL_ADD and bounded waits, atomics, and the dst-first argument-order test. Prints a
table last; exits non-zero on any failure.
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys
import traceback

import harness

HERE = pathlib.Path(__file__).resolve().parent


def load_sim_tests():
    spec = importlib.util.spec_from_file_location("test_shmem_sim", HERE.parent / "test_shmem_sim.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main() -> int:
    session = harness.open_job_session(extra_bytes=64 << 20)
    n = session.n_ranks
    tests = load_sim_tests()

    def run_on_this_job(target, n_ranks, args=(), kwargs=None, **_ignored):
        """run_pes stand-in: this rank is one PE; every rank gets every PE's result."""
        if n_ranks != n:
            raise ValueError(f"the job has {n} ranks; the test asked for {n_ranks}")
        return session.allgather_object(target(session, *args, **(kwargs or {})))

    tests.run_pes = run_on_this_job
    checks = [
        ("ring put_signal_block / put+quiet+signal_op", lambda: tests.test_ring_put_signal_and_put_quiet_signal(n)),
        ("all-to-all put_nbi_block+fence int32", lambda: tests.test_alltoall_put_nbi_block_fence_signal(n, "int32")),
        ("all-to-all put_nbi_block+fence uint16", lambda: tests.test_alltoall_put_nbi_block_fence_signal(n, "uint16")),
        ("all-to-all put_nbi_block+fence float32", lambda: tests.test_alltoall_put_nbi_block_fence_signal(n, "float32")),
        ("warp put_signal ADD + wait_signal_ge", lambda: tests.test_alltoall_put_signal_warp_and_wait_signal_ge(n)),
        ("atomic_fetch_add tickets on PE 0", lambda: tests.test_atomic_fetch_add_tickets_on_pe0(n)),
        ("atomics mix (add/inc/cswap/set/fetch)", lambda: tests.test_atomic_mix(n)),
        ("put argument order: dst first", lambda: tests.test_put_argument_order_dst_first(n)),
        ("ring by direct stores into peer views", lambda: tests.test_ring_by_direct_stores_into_peer_views(n)),
    ]
    rows, failures = [], []
    for name, check in checks:
        try:
            check()
            rows.append((name, "PASS", ""))
        except Exception as e:  # report every check, not just the first failure
            why = f"{type(e).__name__}: {e}".splitlines()[0][:200]
            rows.append((name, "FAIL", why))
            failures.append(f"rank {session.rank}: {name}: {why}")
            if session.rank == 0:
                traceback.print_exc()
    session.close()

    def table(every) -> list[str]:  # rank 0's rows (every rank checks every PE's results)
        return [f"SHMEM exchange checks on NVSHMEM, {n} ranks"] + [f"{status:4}  {name}  {why}"
                                                                  for name, status, why in every[0]]

    return harness.finish(failures, rows, table)


if __name__ == "__main__":
    sys.exit(main())
