"""A simulated job that runs until it is stopped, for tests/test_shutdown_sim.py.

``python shutdown_job.py launcher``: two PEs under :func:`~ep_runtime.shmem.launch.run_pes`.
``python shutdown_job.py rank R JOB`` (with ``NUMBA_ENABLE_CUDASIM=1``): PE ``R`` of a
two-PE job ``JOB`` opened directly with ``SimSession.open``, the way ranks under ``mpiexec``
open theirs (no launcher process watches them).

Once bring-up is done, every PE prints ``PE <rank> pid <pid> job <job>`` and then waits in
barriers forever. A :class:`~ep_runtime.core.errors.PEFailure` is printed to stderr as
``PEFailure: <message>`` and the process exits with status 1.
"""

from __future__ import annotations

import os
import signal
import sys
import time

from ep_runtime.core.errors import PEFailure
from ep_runtime.shmem.launch import run_pes

N_RANKS = 2
HEAP_BYTES = 1 << 20
# Far above the time the tests allow for a stop: a job that ends is stopped, not timed out.
TIMEOUT_S = 120.0


def wait_forever(session) -> None:
    """Report this PE's pid and job once bring-up is done, then wait in barriers."""
    # One write of a short line: the PEs share the launcher's stdout, and it stays whole.
    os.write(sys.stdout.fileno(), f"PE {session.rank} pid {os.getpid()} job {session.heap.job}\n".encode())
    while True:
        session.barrier()
        time.sleep(0.01)


def main(argv: list[str]) -> int:
    # As started from a terminal: Python's Ctrl-C handler, even when the process that started
    # this one ignored SIGINT (a pytest-xdist worker does, and the ignoring is inherited)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        if argv[0] == "launcher":
            run_pes(wait_forever, N_RANKS, timeout_s=TIMEOUT_S, heap_bytes=HEAP_BYTES)
        elif argv[0] == "rank":
            from ep_runtime.shmem.sim_session import SimSession

            wait_forever(SimSession.open(int(argv[1]), N_RANKS, argv[2], HEAP_BYTES, TIMEOUT_S))
    except PEFailure as err:
        print(f"PEFailure: {err}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
