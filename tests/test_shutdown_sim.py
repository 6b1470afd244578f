"""Stopping a simulated job never leaves files in /dev/shm, and never leaves a PE hanging.

Each test starts tests/shutdown_job.py (two PEs that wait in barriers forever) as a
subprocess, waits until both PEs report that bring-up is done, then stops the job one way:
SIGTERM to the whole process group (what ``timeout`` does), SIGTERM or SIGINT to the
launcher, SIGKILL of one PE, of the launcher, or of every process. It then checks that
every process of the job ended within :data:`STOP_WITHIN_S`, with the status and the
message the way of stopping calls for, and that no file of the job (``ep_sim_<job>_*``)
is left in /dev/shm. Only the job's own files are looked at: other jobs may be running.
"""

from __future__ import annotations

import glob
import os
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ep_runtime.shmem.sim_job_files import job_path

JOB_SCRIPT = Path(__file__).with_name("shutdown_job.py")
# Seconds a stopped job may take to end; its PEs' own timeouts are 120 s (shutdown_job.py).
STOP_WITHIN_S = 15.0
# Seconds bring-up may take (two interpreters importing numba on a loaded CI machine).
START_WITHIN_S = 60.0
READY = re.compile(r"PE (\d+) pid (\d+) job ([0-9a-f]+)")


def _start(*args: str, env: dict | None = None) -> subprocess.Popen:
    """The job script in a process group of its own, so the test can signal all of it."""
    return subprocess.Popen([sys.executable, str(JOB_SCRIPT), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env=env or dict(os.environ))


def _wait_ready(procs: list[subprocess.Popen], n_ranks: int = 2) -> tuple[str, dict[int, int]]:
    """``(job id, {rank: pid})`` once every PE printed its line; fails on timeout or early exit."""
    text = {p.stdout.fileno(): "" for p in procs}
    deadline = time.monotonic() + START_WITHIN_S
    while True:
        found = [m.groups() for t in text.values() for m in READY.finditer(t)]
        if len(found) == n_ranks:
            break
        remaining = deadline - time.monotonic()
        assert remaining > 0, f"the job did not start within {START_WITHIN_S} s: {text}"
        assert all(p.poll() is None for p in procs), ("the job exited during bring-up:\n"
                                                       + "".join(p.stderr.read() for p in procs))
        # Raw reads: a buffered readline could hold a second line select() no longer reports.
        for fd in select.select(list(text), [], [], min(remaining, 1.0))[0]:
            text[fd] += os.read(fd, 1 << 16).decode()
    jobs = {job for _, _, job in found}
    assert len(jobs) == 1, jobs
    return jobs.pop(), {int(rank): int(pid) for rank, pid, _ in found}


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped, counts as ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _ended(proc: subprocess.Popen, pids: list[int]) -> tuple[int, str]:
    """``(exit status, stderr)`` of ``proc`` once it and the PEs ``pids`` ended; fails if they
    did not within :data:`STOP_WITHIN_S`."""
    try:
        _, err = proc.communicate(timeout=STOP_WITHIN_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"the job did not end within {STOP_WITHIN_S} s")
    deadline = time.monotonic() + STOP_WITHIN_S
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    running = [pid for pid in pids if _alive(pid)]
    for pid in running:
        os.kill(pid, signal.SIGKILL)
    assert not running, f"PE processes {running} outlived the job"
    return proc.returncode, err


def _files(job: str) -> list[str]:
    return sorted(glob.glob(job_path(job, "*")))


def _stop_and_check(signum: int, whom: str):
    """Start a launched job, send ``signum`` to ``whom`` ('group', 'launcher', 'pe1'); the
    launcher's ``(exit status, stderr)`` once everything ended without files left."""
    proc = _start("launcher")
    try:
        job, pids = _wait_ready([proc])
        # Past bring-up the job's files are already gone: nothing to leak however it ends.
        assert _files(job) == []
        if whom == "group":
            os.killpg(proc.pid, signum)
        elif whom == "launcher":
            os.kill(proc.pid, signum)
        else:
            os.kill(pids[1], signum)
        status, err = _ended(proc, list(pids.values()))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert _files(job) == [], f"left in /dev/shm: {_files(job)}"
    return status, err


@pytest.mark.parametrize("whom", ["group", "launcher"])
def test_sigterm_stops_the_job_and_dies_of_it(whom):
    status, err = _stop_and_check(signal.SIGTERM, whom)
    assert status == -signal.SIGTERM, err
    assert "got SIGTERM: stopped its PEs and removed the job's /dev/shm files" in err, err


def test_sigint_stops_the_job_and_raises_keyboard_interrupt():
    status, err = _stop_and_check(signal.SIGINT, "launcher")
    assert status == -signal.SIGINT, err  # Python ends of an uncaught KeyboardInterrupt by SIGINT
    assert "got SIGINT: stopped its PEs" in err and "KeyboardInterrupt" in err, err


def test_a_killed_pe_fails_the_job_naming_it_and_the_signal():
    start = time.monotonic()
    status, err = _stop_and_check(signal.SIGKILL, "pe1")
    assert status == 1, err
    assert re.search(r"PEFailure: run_pes\(.*\): PE 1 was killed by SIGKILL \(exit code -9\)", err), err
    assert time.monotonic() - start < START_WITHIN_S + STOP_WITHIN_S


def test_a_killed_launcher_takes_its_pes_with_it():
    status, _ = _stop_and_check(signal.SIGKILL, "launcher")
    assert status == -signal.SIGKILL


def test_killing_every_process_leaves_no_file():
    status, _ = _stop_and_check(signal.SIGKILL, "group")
    assert status == -signal.SIGKILL


def test_ranks_without_a_launcher_name_the_rank_that_died():
    """Ranks opened directly (as under mpiexec): when one is killed, the other ends its wait
    at once with PEFailure naming it, long before its 120 s timeout."""
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    job = f"{os.getpid():x}-{time.monotonic_ns() & 0xFFFFFF:x}"
    ranks = [_start("rank", str(rank), job, env=env) for rank in range(2)]
    try:
        _, pids = _wait_ready(ranks)
        assert _files(job) == []
        start = time.monotonic()
        os.kill(pids[1], signal.SIGKILL)
        status, err = _ended(ranks[0], [pids[0]])
        assert time.monotonic() - start < STOP_WITHIN_S
        ranks[1].communicate()
    finally:
        for proc in ranks:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
    assert status == 1, err
    assert re.search(rf"PEFailure: PE 0: PE 1 \(pid {pids[1]}\) of job {job} exited while this PE waited", err), err
    assert _files(job) == []
