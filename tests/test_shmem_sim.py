"""The SHMEM facade on the CPU simulator: real kernel source, one OS process per PE.

Each test runs per-rank bodies (functions ``*_pe`` below, imported by name in every PE) with
:func:`ep_runtime.shmem.launch.run_pes` on 2 and 4 PEs and compares with a NumPy oracle
exactly. Payload values encode (source PE, destination PE, element) so a wrong row names its
origin. Must-fail tests check that the simulator turns the bugs it exists to catch (a
missing fence, a wait nobody signals, an off-heap destination, a failing or hanging PE)
into clear errors instead of passes or hangs.

Kernel modules are imported inside the bodies: only the PEs run with
``NUMBA_ENABLE_CUDASIM=1``.
"""

import ast
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from ep_runtime.core.errors import EPInputError, PEFailure
from ep_runtime.shmem import launch
from ep_runtime.shmem.launch import run_pes

WORLD_SIZES = (2, 4)
N = 64          # elements per row (< 256: the payload encoding keeps them apart)
THREADS = 32    # one warp per block
TIMEOUT_S = 60  # per run_pes; a healthy run takes a few seconds


def payload(src: int, dst: int, n: int, dtype) -> np.ndarray:
    """Row sent by PE ``src`` to PE ``dst``: ``1 + src*4096 + dst*256 + i`` (exact in uint16
    and float32 for up to 15 PEs; never 0, the fill of receive buffers)."""
    return (1 + src * 4096 + dst * 256 + np.arange(n)).astype(dtype)


def ring_expected(me: int, n_ranks: int, n: int, epoch: int) -> np.ndarray:
    """What PE ``me`` copies out in ring round ``epoch``: only row ``me - 1``; [n_ranks, n]."""
    want = np.zeros((n_ranks, n), np.int32)
    prev = (me - 1) % n_ranks
    want[prev] = payload(prev, me, n, np.int32) * epoch
    return want


def alltoall_expected(me: int, n_ranks: int, n: int, dtype) -> np.ndarray:
    """What PE ``me`` receives in an all-to-all: row ``s`` from PE ``s``; [n_ranks, n]."""
    return np.stack([payload(src, me, n, dtype) for src in range(n_ranks)])


def _selftest():
    from ep_runtime.kernels import selftest

    return selftest


# -- per-rank bodies (run in the PE processes) ------------------------------------------------
def ring_pe(session, n):
    """Two ring rounds (put_signal_block; put + quiet + signal_op); what arrived each round."""
    k = _selftest()
    me, n_ranks = session.rank, session.n_ranks
    recv = session.alloc_symmetric("ring_recv", (n_ranks, n), np.int32)
    sig = session.alloc_symmetric("ring_sig", (n_ranks,), np.uint64)
    received = []
    for epoch, kernel in ((1, k.ring_put_signal), (2, k.ring_put_quiet_signal)):
        out = session.alloc_local("out", (n_ranks, n), np.int32)
        row = session.to_device(payload(me, (me + 1) % n_ranks, n, np.int32) * epoch)
        session.launch(kernel, 1, THREADS, (recv, row, sig, epoch, out))
        received.append(session.to_host(out))
        session.barrier()
    return received


def peer_store_ring_pe(session, n):
    """Ring by direct stores through a peer view (kernel (f)); what arrived."""
    k = _selftest()
    me, n_ranks = session.rank, session.n_ranks
    recv = session.alloc_symmetric("peer_ring_recv", (n_ranks, n), np.int32)
    sig = session.alloc_symmetric("peer_ring_sig", (n_ranks,), np.uint64)
    out = session.alloc_local("out", (n_ranks, n), np.int32)
    row = session.to_device(payload(me, (me + 1) % n_ranks, n, np.int32))
    peer_row = session.peer_view(recv, (me + 1) % n_ranks)[me]
    session.launch(k.ring_peer_store_signal, 1, THREADS, (peer_row, recv, row, sig, 1, out))
    session.barrier()
    return session.to_host(out)


def alltoall_pe(session, n, dtype_name, fence):
    """All-to-all with put_nbi_block (+ fence unless ``fence`` is False), then signal_wait and
    copy-out. Returns (rows copied out after the signals, recv after a barrier)."""
    k = _selftest()
    me, n_ranks = session.rank, session.n_ranks
    dtype = np.dtype(dtype_name)
    recv = session.alloc_symmetric("a2a_recv", (n_ranks, n), dtype)
    sig = session.alloc_symmetric("a2a_sig", (n_ranks,), np.uint64)
    send = session.to_device(np.stack([payload(me, dst, n, dtype) for dst in range(n_ranks)]))
    out = session.alloc_local("out", (n_ranks, n), dtype)
    send_kernel = k.alltoall_put_nbi_fence if fence else k.alltoall_put_nbi_no_fence
    session.launch(send_kernel, n_ranks, THREADS, (recv, send, sig, 1))
    session.launch(k.wait_all_copy_out, n_ranks, THREADS, (recv, sig, 1, out))
    # Host-side rendezvous that delivers no puts: every PE has copied out before any PE's
    # barrier delivers its queued puts, so a missing fence deterministically shows.
    session.allgather_object(None)
    session.barrier()
    return session.to_host(out), session.to_host(recv)


def warp_alltoall_pe(session, n):
    """All-to-all by warps (put_signal_nbi_warp, SIGNAL_ADD), received with wait_signal_ge;
    then a bounded wait for one signal more than was sent, which must time out quietly."""
    k = _selftest()
    me, n_ranks = session.rank, session.n_ranks
    threads = 2 * THREADS
    recv = session.alloc_symmetric("warp_recv", (n_ranks, n), np.float32)
    sig = session.alloc_symmetric("warp_sig", (n_ranks,), np.uint64)
    send = session.to_device(np.stack([payload(me, dst, n, np.float32) for dst in range(n_ranks)]))
    out = session.alloc_local("out", (n_ranks, n), np.float32)
    seen = session.alloc_local("seen", (n_ranks,), np.uint64)
    session.launch(k.alltoall_put_signal_warp, n_ranks, threads, (recv, send, sig))
    session.launch(k.wait_ge_copy_out, n_ranks, threads, (recv, sig, 2, 10**10, out, seen))
    session.barrier()
    late_out = session.alloc_local("late_out", (n_ranks, n), np.float32)
    late_seen = session.alloc_local("late_seen", (n_ranks,), np.uint64)
    start = time.monotonic()
    session.launch(k.wait_ge_copy_out, n_ranks, THREADS, (recv, sig, 3, 50_000_000, late_out, late_seen))
    late_s = time.monotonic() - start
    return (session.to_host(out), session.to_host(seen), session.to_host(late_out),
            session.to_host(late_seen), late_s)


def counter_pe(session, blocks):
    """Every block of every PE takes a ticket from a counter on PE 0 (atomic_fetch_add)."""
    k = _selftest()
    counter = session.alloc_symmetric("tickets", (1,), np.uint64)
    slots = session.alloc_local("slots", (blocks,), np.uint64)
    session.launch(k.count_on_pe0, blocks, THREADS, (counter, slots))
    session.barrier()
    return session.to_host(slots), int(counter[0])


def atomic_mix_pe(session):
    """Every atomic of the facade once per PE (see selftest.atomic_mix)."""
    k = _selftest()
    counters = session.alloc_symmetric("counters", (5,), np.uint64)
    results = session.alloc_local("results", (3,), np.uint64)
    session.launch(k.atomic_mix, 1, THREADS, (counters, results))
    session.barrier()
    return session.to_host(results), session.to_host(counters)


def put_pattern_pe(session, n):
    """PE ``me`` puts its pattern (symmetric src) into PE ``me + 1``'s symmetric dst."""
    k = _selftest()
    me, n_ranks = session.rank, session.n_ranks
    dst = session.alloc_symmetric("pattern_dst", (n,), np.uint16, fill=0xDEAD)
    src = session.alloc_symmetric("pattern_src", (n,), np.uint16)
    src[:] = session.to_device(payload(me, (me + 1) % n_ranks, n, np.uint16))
    session.barrier()
    session.launch(k.put_pattern, 1, THREADS, (dst, src, (me + 1) % n_ranks))
    session.barrier()
    return session.to_host(dst), session.to_host(src)


def unsignalled_wait_pe(session):
    """Waits for a signal that no PE sends."""
    k = _selftest()
    recv = session.alloc_symmetric("recv", (session.n_ranks, 8), np.int32)
    sig = session.alloc_symmetric("never_sent", (session.n_ranks,), np.uint64)
    out = session.alloc_local("out", (session.n_ranks, 8), np.int32)
    session.launch(k.wait_all_copy_out, session.n_ranks, THREADS, (recv, sig, 1, out))


def heap_misuse_pe(session):
    """Puts to off-heap, peer-view and freed destinations, a double free and an allocation
    that differs between PEs; returns ``{case: (error type, message)}``."""
    k = _selftest()
    me, n_ranks = session.rank, session.n_ranks
    src = session.alloc_symmetric("src", (8,), np.int32)
    dst = session.alloc_symmetric("dst", (8,), np.int32)
    local = session.alloc_local("local", (8,), np.int32)

    def put_into_freed():
        session.free_symmetric(dst)
        session.launch(k.put_pattern, 1, 1, (dst, src, 0))

    cases = {
        "off_heap": lambda: session.launch(k.put_pattern, 1, 1, (local, src, 0)),
        "peer_view": lambda: session.launch(k.put_pattern, 1, 1, (session.peer_view(dst, 1 - me), src, 0)),
        "freed": put_into_freed,
        "double_free": lambda: session.free_symmetric(dst),
        "mismatched_alloc": lambda: session.alloc_symmetric("odd", (8 + me,), np.int32),
    }
    assert n_ranks == 2
    errors = {}
    for case, call in cases.items():
        try:
            call()
        except Exception as err:  # noqa: BLE001 - the type is part of the result
            errors[case] = (type(err).__name__, str(err))
    return errors


def oversized_gather_pe(session):
    """PE 1 gathers more than a mailbox slot holds, then both PEs gather their rank; returns
    (the first gather's error message or None, the second gather)."""
    from ep_runtime.core.errors import ShmemError
    from ep_runtime.shmem.sim_heap import GATHER_SLOT_BYTES

    try:
        session.allgather_object(b"x" * GATHER_SLOT_BYTES if session.rank == 1 else None)
        error = None
    except ShmemError as err:
        error = str(err)
    return error, session.allgather_object(session.rank)


def job_id_pe(session):
    """The job id (names the job's /dev/shm files)."""
    return session.heap.job


def raising_pe(session):
    """PE 1 raises while PE 0 waits for it in a barrier."""
    if session.rank == 1:
        raise ValueError("boom from PE 1")
    session.barrier()


def hanging_pe(session):
    """PE 1 never returns."""
    if session.rank == 1:
        time.sleep(3600)


def exiting_pe(session):
    """PE 1 leaves without a report."""
    if session.rank == 1:
        os._exit(3)
    session.barrier()


def mpi_ring_main():
    """Entry point of one rank under ``mpiexec``: the ring of :func:`ring_pe` in a session
    from :func:`~ep_runtime.shmem.launch.open_sim_session_from_mpi`; prints its verdict."""
    with launch.open_sim_session_from_mpi(heap_bytes=1 << 20, timeout_s=TIMEOUT_S) as session:
        received = ring_pe(session, N)
        me, n_ranks = session.rank, session.n_ranks
    ok = all(np.array_equal(out, ring_expected(me, n_ranks, N, epoch))
             for epoch, out in zip((1, 2), received))
    print(f"PE {me} of {n_ranks}: {'ok' if ok else 'WRONG'}", flush=True)


# -- the simulator backend has the GPU backend's API -------------------------------------------------
def _exported_names(module_file: str) -> list:
    """``__all__`` of a ep_runtime/kernels/ module, read without importing it (no GPU stack needed)."""
    tree = ast.parse((Path(__file__).parents[1] / "ep_runtime" / "kernels" / module_file).read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError(f"{module_file} has no __all__")


def test_sim_backend_exports_the_nvshmem_backend_api():
    assert _exported_names("_shmem_sim.py") == _exported_names("_shmem_nvshmem.py")


# -- exchanges, exact against NumPy -------------------------------------------------------------
@pytest.mark.parametrize("n_ranks", WORLD_SIZES)
def test_ring_put_signal_and_put_quiet_signal(n_ranks):
    results = run_pes(ring_pe, n_ranks, args=(N,), timeout_s=TIMEOUT_S)
    for me, received in enumerate(results):
        for epoch, out in zip((1, 2), received):
            np.testing.assert_array_equal(out, ring_expected(me, n_ranks, N, epoch),
                                          err_msg=f"PE {me}, round {epoch}")


@pytest.mark.parametrize("n_ranks", WORLD_SIZES)
def test_ring_by_direct_stores_into_peer_views(n_ranks):
    for me, out in enumerate(run_pes(peer_store_ring_pe, n_ranks, args=(N,), timeout_s=TIMEOUT_S)):
        np.testing.assert_array_equal(out, ring_expected(me, n_ranks, N, 1), err_msg=f"PE {me}")


@pytest.mark.parametrize("dtype", ["int32", "uint16", "float32"])
@pytest.mark.parametrize("n_ranks", WORLD_SIZES)
def test_alltoall_put_nbi_block_fence_signal(n_ranks, dtype):
    results = run_pes(alltoall_pe, n_ranks, args=(N, dtype, True), timeout_s=TIMEOUT_S)
    for me, (out, recv) in enumerate(results):
        want = alltoall_expected(me, n_ranks, N, dtype)
        np.testing.assert_array_equal(out, want, err_msg=f"PE {me}: rows copied out after the signals")
        np.testing.assert_array_equal(recv, want, err_msg=f"PE {me}: recv after the barrier")


@pytest.mark.parametrize("n_ranks", WORLD_SIZES)
def test_alltoall_put_signal_warp_and_wait_signal_ge(n_ranks):
    results = run_pes(warp_alltoall_pe, n_ranks, args=(N,), timeout_s=TIMEOUT_S)
    for me, (out, seen, late_out, late_seen, late_s) in enumerate(results):
        np.testing.assert_array_equal(out, alltoall_expected(me, n_ranks, N, np.float32))
        np.testing.assert_array_equal(seen, [2] * n_ranks)  # one SIGNAL_ADD per warp
        np.testing.assert_array_equal(late_seen, [2] * n_ranks)  # timed out, last value returned
        assert not late_out.any() and late_s < 5


@pytest.mark.parametrize("n_ranks", WORLD_SIZES)
def test_atomic_fetch_add_tickets_on_pe0(n_ranks):
    blocks = 3
    results = run_pes(counter_pe, n_ranks, args=(blocks,), timeout_s=TIMEOUT_S)
    tickets = np.concatenate([slots for slots, _ in results])
    np.testing.assert_array_equal(np.sort(tickets), np.arange(blocks * n_ranks))
    assert [count for _, count in results] == [blocks * n_ranks] + [0] * (n_ranks - 1)


@pytest.mark.parametrize("n_ranks", WORLD_SIZES)
def test_atomic_mix(n_ranks):
    results = run_pes(atomic_mix_pe, n_ranks, timeout_s=TIMEOUT_S)
    pe0_counters = results[0][1]
    winners = [me for me, (res, _) in enumerate(results) if res[1] == 0]
    assert len(winners) == 1, "exactly one compare_swap sees the initial 0"
    assert list(pe0_counters[:4]) == [n_ranks, n_ranks, n_ranks * (n_ranks + 1) // 2, winners[0] + 1]
    assert sorted(int(res[0]) for res, _ in results) == list(range(n_ranks))
    for me, (res, counters) in enumerate(results):
        assert int(res[2]) == int(counters[4]) == me + 100


@pytest.mark.parametrize("n_ranks", WORLD_SIZES)
def test_put_argument_order_dst_first(n_ranks):
    results = run_pes(put_pattern_pe, n_ranks, args=(N,), timeout_s=TIMEOUT_S)
    for me, (dst, src) in enumerate(results):
        prev = (me - 1) % n_ranks
        np.testing.assert_array_equal(dst, payload(prev, me, N, np.uint16), err_msg=f"PE {me} dst")
        np.testing.assert_array_equal(src, payload(me, (me + 1) % n_ranks, N, np.uint16),
                                      err_msg=f"PE {me} src must be left alone")


# -- bugs the simulator must expose -------------------------------------------------------------
def test_missing_fence_shows_as_wrong_data():
    n_ranks = 2
    results = run_pes(alltoall_pe, n_ranks, args=(N, "int32", False), timeout_s=TIMEOUT_S)
    for me, (out, recv) in enumerate(results):
        want = alltoall_expected(me, n_ranks, N, np.int32)
        assert not np.array_equal(out, want), "the fence-less kernel passed: the simulator hides the bug"
        assert not out.any(), "every signal overtook its data, so every row copied out is stale"
        np.testing.assert_array_equal(recv, want, err_msg="the barrier delivers the late puts")


def test_unsignalled_wait_times_out_with_its_signal_named():
    start = time.monotonic()
    with pytest.raises(PEFailure) as info:
        run_pes(unsignalled_wait_pe, 2, timeout_s=TIMEOUT_S, wait_timeout_s=2)
    assert time.monotonic() - start < 20
    message = str(info.value)
    assert "ShmemTimeoutError" in message
    assert re.search(r"PE \d: signal_wait timed out after 2(\.0)? s on signal 'never_sent'\[0\] "
                     r"at heap offset \d+: waited for sig >= 1 \(CMP_GE\), observed 0", message), message


def test_heap_misuse_is_reported_clearly():
    for me, errors in enumerate(run_pes(heap_misuse_pe, 2, timeout_s=TIMEOUT_S)):
        assert set(errors) == {"off_heap", "peer_view", "freed", "double_free", "mismatched_alloc"}
        kind, message = errors["off_heap"]
        assert kind == "SymmetricAddressError"
        assert f"PE {me}: put: the array at address" in message
        assert "is not on this PE's symmetric heap" in message
        assert "Allocate it with Session.alloc_symmetric" in message
        kind, message = errors["peer_view"]
        assert kind == "SymmetricAddressError" and f"inside PE {1 - me}'s copy (a peer view)" in message
        kind, message = errors["freed"]
        assert kind == "SymmetricAddressError" and "not inside a live symmetric allocation" in message
        kind, message = errors["double_free"]
        assert kind == "SymmetricAddressError" and "free_symmetric" in message
        kind, message = errors["mismatched_alloc"]
        assert kind == "ShmemError" and "alloc_symmetric differs between PEs" in message


def test_oversized_allgather_fails_on_every_pe_and_the_job_goes_on():
    for error, ranks in run_pes(oversized_gather_pe, 2, timeout_s=TIMEOUT_S):
        assert error is not None and "allgather_object: the pickled objects of PE(s) [1] have" in error, error
        assert "mailbox holds" in error and "gather something smaller" in error, error
        assert ranks == [0, 1]


# -- the launcher never hangs -------------------------------------------------------------------
def test_raising_pe_fails_the_job_with_its_traceback():
    start = time.monotonic()
    with pytest.raises(PEFailure) as info:
        run_pes(raising_pe, 2, timeout_s=TIMEOUT_S)
    assert time.monotonic() - start < 20
    message = str(info.value)
    assert "PE 1 raised" in message and "ValueError: boom from PE 1" in message
    assert "in raising_pe" in message


def test_hanging_pe_fails_the_job_at_the_timeout():
    start = time.monotonic()
    with pytest.raises(PEFailure) as info:
        run_pes(hanging_pe, 2, timeout_s=5)
    assert time.monotonic() - start < 15
    message = str(info.value)
    assert "did not finish within 5" in message
    assert "Python stacks of PE 1" in message and "hanging_pe" in message


def test_exiting_pe_fails_the_job():
    with pytest.raises(PEFailure, match="PE 1 exited with code 3"):
        run_pes(exiting_pe, 2, timeout_s=TIMEOUT_S)


def test_job_files_are_removed():
    jobs = set(run_pes(job_id_pe, 2, timeout_s=TIMEOUT_S))
    with pytest.raises(PEFailure) as info:
        run_pes(raising_pe, 2, timeout_s=TIMEOUT_S)
    jobs.add(re.search(r"job=([0-9a-f]+)", str(info.value)).group(1))
    assert len(jobs) == 2
    assert not [f for f in os.listdir("/dev/shm") for job in jobs if f.startswith(f"ep_sim_{job}_")]


# -- launcher helpers ---------------------------------------------------------------------------
def _mpiexec():
    """The mpiexec next to this Python (the mpich wheel's, matching mpi4py), else on PATH."""
    beside = Path(sys.executable).with_name("mpiexec")
    return str(beside) if beside.exists() else shutil.which("mpiexec")


@pytest.mark.skipif(_mpiexec() is None, reason="no mpiexec (pip install mpich mpi4py)")
def test_sim_session_under_mpiexec():
    pytest.importorskip("mpi4py")
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1",
               PYTHONPATH=os.pathsep.join([str(Path(__file__).parent)] + sys.path),
               OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")  # if Open MPI's
    done = subprocess.run([_mpiexec(), "-n", "2", sys.executable, "-c",
                           "import test_shmem_sim as t; t.mpi_ring_main()"],
                          env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stdout + done.stderr
    # the two ranks print at once, so their lines may interleave: find the verdicts anywhere
    verdicts = sorted(re.findall(r"PE \d+ of 2: [a-z]+", done.stdout))  # "ok" or an error word
    assert verdicts == ["PE 0 of 2: ok", "PE 1 of 2: ok"], done.stdout + done.stderr


def test_run_pes_rejects_what_a_pe_cannot_import():
    with pytest.raises(EPInputError, match="module-level function"):
        run_pes(lambda session: None, 2)
    with pytest.raises(EPInputError, match="only 'sim'"):
        run_pes(counter_pe, 2, backend="nvshmem")


MPI_VARIABLES = ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                 "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MV2_COMM_WORLD_RANK",
                 "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_LOCAL_RANK")


@pytest.mark.parametrize("env, want", [
    ({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "1"},
     (3, 8, 1)),
    ({"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "2"}, (2, 4, 2)),
    ({"MV2_COMM_WORLD_RANK": "1", "MV2_COMM_WORLD_SIZE": "2", "MV2_COMM_WORLD_LOCAL_RANK": "0"}, (1, 2, 0)),
])
def test_mpi_rank_size_from_launcher_environment(monkeypatch, env, want):
    for name in MPI_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert (*launch.mpi_rank_size(), launch.local_rank()) == want


def test_no_mpi_launcher_means_no_mpi_job(monkeypatch):
    for name in MPI_VARIABLES + ("PMIX_RANK",):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delitem(sys.modules, "mpi4py.MPI", raising=False)  # as if MPI never started
    assert launch.mpi_rank_size() is None
    assert launch.local_rank() == 0


def test_run_pes_without_numba_says_what_to_install(monkeypatch):
    import importlib.util

    from ep_runtime.core.errors import MissingDependencyError

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "numba" else real(name, *a))
    with pytest.raises(MissingDependencyError, match=r'numba-cuda is not installed; install the simulator\'s extra with '
                                         r'pip install -e "\.\[sim\]"'):
        run_pes(counter_pe, 2)
