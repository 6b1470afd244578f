"""The /dev/shm files of a simulated job: their names, the job's lock, and how a PE publishes,
maps and removes them.

PE ``p``'s heap is the file ``/dev/shm/ep_sim_<job>_<p>`` and the job's one cross-process lock
``/dev/shm/ep_sim_<job>_lock``. They exist only during bring-up
(:meth:`~ep_runtime.shmem.sim_heap.SimHeap.open`, whose module describes the heap file's layout);
files left by a job that died during bring-up are removed by :func:`remove_job_files`.
"""

from __future__ import annotations

import fcntl
import glob
import mmap
import os
import threading

import numpy as np

SHM_DIR = "/dev/shm"


def job_path(job: str, suffix: str) -> str:
    """Path of the job's file ``/dev/shm/ep_sim_<job>_<suffix>``."""
    return os.path.join(SHM_DIR, f"ep_sim_{job}_{suffix}")


def remove_job_files(job: str) -> None:
    """Remove every /dev/shm file of ``job`` (heap files and lock of a bring-up, and their
    temporary names); tolerates missing ones. A job past bring-up has no files left."""
    for path in glob.glob(job_path(job, "*")):
        _unlink(path)


def remove_job_file(job: str, suffix: str) -> None:
    """Remove the job's file ``job_path(job, suffix)``; tolerates a missing one."""
    _unlink(job_path(job, suffix))


class JobLock:
    """The job's one cross-process lock: ``flock`` on a /dev/shm file plus a thread lock
    (``flock`` is per open file, and the simulator's threads share this process's file)."""

    def __init__(self, path: str):
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        self._threads = threading.Lock()

    def __enter__(self):
        self._threads.acquire()
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        self._threads.release()
        return False

    def close(self) -> None:
        os.close(self._fd)


def publish_heap_file(path: str, file_bytes: int, control: np.ndarray) -> None:
    """Create the file at full size with the words ``control`` at its start (this PE's part of
    the control area), under a temporary name, then rename: peers never see it partly written."""
    fd = os.open(path + ".tmp", os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.ftruncate(fd, file_bytes)
        os.pwrite(fd, control.tobytes(), 0)
    finally:
        os.close(fd)
    os.replace(path + ".tmp", path)


def map_file(path: str, file_bytes: int) -> np.ndarray:
    """The file at ``path`` (``file_bytes`` long) mapped shared and writable, as a uint8 array."""
    fd = os.open(path, os.O_RDWR)
    try:
        return np.frombuffer(mmap.mmap(fd, file_bytes), dtype=np.uint8)
    finally:
        os.close(fd)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
