"""Which peer PEs of a simulated job have exited: a pidfd per peer process, opened at bring-up.

A PE publishes its process id and start time in its heap file's control area
(:mod:`ep_runtime.shmem.sim_heap`); its peers watch that process, so a wait for it (a barrier, a
simulated signal wait: :func:`~ep_runtime.shmem.sim_heap.poll`) fails at once with
:class:`~ep_runtime.core.errors.PEFailure` naming the PE once it has exited, instead of at its
timeout.
"""

from __future__ import annotations

import os
import select
import threading


class PeerWatch:
    """Which peer PEs' processes have exited: a pidfd per peer, readable once it exits.

    A peer is watched only if its pidfd opens and the process behind it started when the
    peer's heap file says (a pid reused by another process, or one from another pid
    namespace, is not watched; its waits still end at their timeout).
    """

    def __init__(self, fds: dict[int, tuple[int, int]]):
        self._fds = fds  # PE -> (pidfd, pid)
        # One poll set for the job's life: every wait of the simulator checks it on each of its
        # polls, so it is one system call, not a registration per peer each time (poll, not
        # select: a pidfd may be numbered past select's limit of 1024). The simulator's threads
        # share it under a lock: a poll object refuses concurrent calls.
        self._poller = select.poll()
        self._poller_lock = threading.Lock()
        for fd, _ in fds.values():
            self._poller.register(fd, select.POLLIN)

    @classmethod
    def open(cls, rank: int, pids: list[int], starts: list[int]) -> PeerWatch:
        """Watch PE ``rank``'s peers: ``pids[pe]`` and ``starts[pe]`` are PE ``pe``'s process id
        and start time as its heap file's control area holds them."""
        fds = {}
        for pe, (pid, start) in enumerate(zip(pids, starts)):
            if pe == rank or pid <= 0 or not hasattr(os, "pidfd_open"):
                continue
            try:
                fd = os.pidfd_open(pid)
            except OSError:
                continue
            if start_time(pid) == start:
                fds[pe] = (fd, pid)
            else:
                os.close(fd)
        return cls(fds)

    def exited(self) -> list[int]:
        """The watched PEs whose process has exited, in rank order."""
        if not self._fds:
            return []
        with self._poller_lock:
            ready = {fd for fd, _ in self._poller.poll(0)}
        return sorted(pe for pe, (fd, _) in self._fds.items() if fd in ready)

    def pid(self, pe: int) -> int:
        return self._fds[pe][1]

    def close(self) -> None:
        for fd, _ in self._fds.values():
            self._poller.unregister(fd)
            os.close(fd)
        self._fds = {}


def start_time(pid: int) -> int:
    """Start time of process ``pid`` in clock ticks after boot (/proc/<pid>/stat field 22),
    0 if unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            # Fields after the command name, which is in parentheses and may hold spaces.
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return 0
