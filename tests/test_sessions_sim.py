"""Sessions opened over the job's own group (torch.distributed, mpi4py) on the CPU simulator.

Each job is real processes over a real transport: a torch.distributed gloo job of N ranks
(FileStore rendezvous; the ranks are forked from one launcher that imported torch once), and an
``mpiexec`` job (MPICH). Every rank opens its session over the
group (the simulator's job id goes out over it), builds an EPRuntime and makes a round trip
(:func:`ep_runtime.testing.plan_pe`); the parent checks it against the NumPy reference
(:func:`ep_runtime.testing.assert_calls_are_the_reference`). The torch job also checks
:func:`ep_runtime.shmem.session_for`'s cache rules and grows :func:`ep_runtime.torch.get_buffer`'s
runtime inside the session's heap, and, with 3 ranks, opens a session over the subgroup
``new_group([1, 2])`` (rank 0, outside it, gets an EPInputError). The rank bodies
(``*_main``) live here so that the processes import them by name; each writes its result,
pickled, to ``<out>/<rank>.pkl``.
"""

import datetime
import importlib.util
import os
import pickle
import shutil
import signal
import subprocess
import sys
import traceback
from pathlib import Path

import numpy as np
import pytest

from ep_runtime.core.config import EPConfig
from ep_runtime.core.errors import EPInputError
from ep_runtime.core.layout import BufferLayout
from ep_runtime.shmem import open_session, session_for
from ep_runtime.shmem.bootstrap import bootstrap_group, local_rank_among
from ep_runtime.testing import assert_calls_are_the_reference, input_error_of, plan_pe

#: Limit of one job, start-up included (importing torch takes seconds per process on a 2-core CI machine).
JOB_TIMEOUT_S = 120
SEED = 11
#: Round trips per session (call 0 of ep_runtime.testing.call_inputs: random routing and counts).
CALLS = 1
#: Ranks of the torch subgroup in a world of 3.
SUBGROUP = [1, 2]


def ep_config(n_ranks: int, max_tokens_per_rank: int = 8) -> EPConfig:
    """4 local experts per rank, top-2, hidden 64, up to ``max_tokens_per_rank`` tokens per rank."""
    return EPConfig(n_ranks=n_ranks, n_experts=4 * n_ranks, top_k=2, hidden=64, max_tokens_per_rank=max_tokens_per_rank)


#: Tokens per rank of the buffer get_buffer grows to in the torch job.
GROWN_TOKENS = 16


def heap_bytes(n_ranks: int, max_tokens_per_rank: int = 8) -> int:
    return BufferLayout(ep_config(n_ranks, max_tokens_per_rank)).symmetric_bytes


def buffer_args(cfg: EPConfig) -> dict:
    """ep_runtime.torch.get_buffer's arguments for ``cfg``."""
    return {"hidden_bytes": 2 * cfg.hidden, "n_experts": cfg.n_experts, "top_k": cfg.top_k,
            "max_tokens_per_rank": cfg.max_tokens_per_rank}


def group_checks(boot) -> dict:
    """A broadcast from the last member and an allgather over ``boot`` (a BootstrapGroup)."""
    buf = np.full(8, boot.rank, np.int8)
    boot.broadcast_bytes(buf, root=boot.size - 1)
    return {"rank": boot.rank, "size": boot.size, "local_rank": boot.local_rank, "bcast": buf.tolist(),
            "gathered": boot.allgather_object(("rank", boot.rank))}


def _write(out_dir: str, name, value) -> None:
    with open(os.path.join(out_dir, f"{name}.pkl"), "wb") as f:
        pickle.dump(value, f)


# -- rank bodies ----------------------------------------------------------------------------------
def torch_world(n: int) -> dict:
    """session_for over the default group (its cache rules), get_buffer's runtime of that session
    grown to GROWN_TOKENS inside the heap asked for at first use, a round trip, close."""
    import torch.distributed as dist

    from ep_runtime.testing import plan_round_trips
    from ep_runtime.torch import close_buffers, get_buffer

    heap = heap_bytes(n, GROWN_TOKENS)
    other = dist.new_group(list(range(n)))  # the same ranks, another group object
    session = session_for(dist.group.WORLD, heap, backend="sim")
    got = {"group": group_checks(session.bootstrap),
           "same_for_none": session_for(None, heap // 2, backend="sim") is session,
           "grow": input_error_of(lambda: session_for(dist.group.WORLD, 2 * heap, backend="sim")),
           "other_group": input_error_of(lambda: session_for(other, heap, backend="sim"))}
    first = get_buffer(session_for(dist.group.WORLD, heap, backend="sim"), **buffer_args(ep_config(n)))
    grown = get_buffer(session_for(dist.group.WORLD, heap, backend="sim"), **buffer_args(ep_config(n, GROWN_TOKENS)))
    got["buffer"] = {"grew": grown is not first and grown.cfg == ep_config(n, GROWN_TOKENS),
                     "kept": get_buffer(session, **buffer_args(ep_config(n))) is grown}
    got["run"] = {"calls": plan_round_trips(session, grown, grown.cfg, CALLS, SEED, device_count=False)}
    close_buffers(session)
    session.close()
    return got


def torch_subgroup() -> dict:
    """A session over ``new_group(SUBGROUP)`` on its members; the error of the others."""
    import torch.distributed as dist

    sub = dist.new_group(SUBGROUP)  # every rank of the world calls new_group
    if dist.get_rank() not in SUBGROUP:
        return {"outside": input_error_of(lambda: open_session("sim", heap_bytes(2), group=sub))}
    session = session_for(sub, heap_bytes(2), backend="sim")  # the world's session is closed: a new one
    got = {"group": group_checks(session.bootstrap), "run": plan_pe(session, {}, ep_config(2), CALLS, SEED)}
    session.close()
    return got


def torch_rank_main(rank: int, n: int, store: str, out_dir: str) -> None:
    """One rank of a torch.distributed gloo job of ``n`` ranks."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=n,
                            timeout=datetime.timedelta(seconds=JOB_TIMEOUT_S))
    try:
        got = {"world": torch_world(n)}
        if n == 3:
            got["subgroup"] = torch_subgroup()
        dist.barrier()
    finally:
        dist.destroy_process_group()
    _write(out_dir, rank, got)


def torch_job_main(n: int, store: str, out_dir: str, module: str = "test_sessions_sim") -> None:
    """The ``n`` ranks of a torch job running ``module``'s ``torch_rank_main(rank, n, store,
    out_dir)``, forked from this process once it has imported torch and the simulator (one import
    for all ranks: seconds each on a 2-core machine). Exits 0 when every rank did; when one fails,
    stops the others and exits 1."""
    import importlib

    import torch.distributed  # noqa: F401 - imported before the forks, for every rank

    import ep_runtime.core.runtime  # noqa: F401 - numba in simulator mode, likewise

    rank_main = importlib.import_module(module).torch_rank_main
    pids = {}
    for rank in range(n):
        pid = os.fork()
        if pid == 0:  # the rank: no thread was started before the fork
            code = 1
            try:
                rank_main(rank, n, store, out_dir)
                code = 0
            except BaseException:  # noqa: BLE001 - the rank reports any failure and exits with code 1
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        pids[pid] = rank
    while pids:
        pid, status = os.wait()
        rank = pids.pop(pid)
        if os.waitstatus_to_exitcode(status) != 0:
            print(f"rank {rank} failed: stopping ranks {sorted(pids.values())}", flush=True)
            for other in pids:
                os.kill(other, signal.SIGKILL)
            sys.exit(1)


def mpi_rank_main(out_dir: str) -> None:
    """One rank of an mpiexec job: a session over COMM_WORLD split in reverse rank order (passed
    as ``comm=``, so session rank = size - 1 - world rank), a round trip."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    comm = world.Split(0, world.Get_size() - 1 - world.Get_rank())
    session = open_session("sim", heap_bytes(comm.Get_size()), comm=comm)
    got = {"world_rank": world.Get_rank(), "group": group_checks(session.bootstrap),
           "run": plan_pe(session, {}, ep_config(comm.Get_size()), CALLS, SEED)}
    session.close()
    comm.Free()
    _write(out_dir, got["group"]["rank"], got)


# -- launcher -------------------------------------------------------------------------------------
def _job_env() -> dict:
    return dict(os.environ, NUMBA_ENABLE_CUDASIM="1",
                PYTHONPATH=os.pathsep.join([str(Path(__file__).parent)] + sys.path))


def run_job(command: list[str], tmp_path: Path, n_results: int, timeout_s: float = JOB_TIMEOUT_S) -> list:
    """Run ``command`` (a job launcher: :func:`torch_job_main` or mpiexec) and return the ``n_results``
    pickled results in rank order. Past ``timeout_s`` its whole process group is killed; a failure
    message carries the job's output."""
    out = tmp_path / "out"
    out.mkdir()
    with open(tmp_path / "job.log", "w+") as log:
        # A session of its own, so that its process group (forked ranks, mpiexec's ranks) can be stopped.
        proc = subprocess.Popen(command, env=_job_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.seek(0)
        report = f"job {command[-1]!r}: exit code {proc.returncode}, output:\n{log.read()[-6000:]}"
    assert proc.returncode == 0, report
    results = []
    for rank in range(n_results):
        assert (out / f"{rank}.pkl").exists(), f"rank {rank} wrote no result\n{report}"
        results.append(pickle.loads((out / f"{rank}.pkl").read_bytes()))
    return results


def run_torch_job(module: str, n: int, tmp_path: Path, timeout_s: float = JOB_TIMEOUT_S) -> list:
    """``module``'s ``torch_rank_main`` on the ``n`` ranks of a gloo job (:func:`torch_job_main`,
    its store and results in ``tmp_path``): every rank's pickled result, in rank order."""
    store, out = str(tmp_path / "store"), str(tmp_path / "out")
    launch = f"import test_sessions_sim as t; t.torch_job_main({n}, {store!r}, {out!r}, {module!r})"
    return run_job([sys.executable, "-c", launch], tmp_path, n, timeout_s)


def _check_group(got: list, what: str) -> None:
    """:func:`group_checks` of every member, in rank order."""
    n = len(got)
    for rank, g in enumerate(got):
        assert (g["rank"], g["size"], g["local_rank"]) == (rank, n, rank), f"{what}: {g}"  # one node
        assert g["bcast"] == [n - 1] * 8, f"{what}: rank {rank}"
        assert g["gathered"] == [("rank", r) for r in range(n)], f"{what}: rank {rank}"


# -- tests ----------------------------------------------------------------------------------------
@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="no torch (pip install -e \".[torch]\")")
@pytest.mark.parametrize("n", [3])  # a world of 3 and its subgroup [1, 2]
def test_torch_gloo_group_session_round_trip(tmp_path, n):
    store, out = str(tmp_path / "store"), str(tmp_path / "out")
    results = run_job([sys.executable, "-c",
                       f"import test_sessions_sim as t; t.torch_job_main({n}, {store!r}, {out!r})"], tmp_path, n)
    world = [r["world"] for r in results]
    _check_group([w["group"] for w in world], f"gloo world of {n}")
    for rank, w in enumerate(world):
        assert w["same_for_none"], f"rank {rank}: session_for(None) did not return the default group's session"
        assert "exceeds" in w["grow"] and "first session_for call" in w["grow"], w["grow"]
        assert "already has a sim session" in w["other_group"], w["other_group"]
        assert w["buffer"] == {"grew": True, "kept": True}, f"rank {rank}: get_buffer {w['buffer']}"
    assert_calls_are_the_reference(ep_config(n, GROWN_TOKENS), [w["run"] for w in world], CALLS, SEED,
                                   f"gloo world of {n}")
    if n == 3:
        outside = results[0]["subgroup"]["outside"]
        assert outside is not None and "not a member" in outside, outside
        sub = [results[r]["subgroup"] for r in SUBGROUP]
        _check_group([s["group"] for s in sub], f"gloo subgroup {SUBGROUP}")
        assert_calls_are_the_reference(ep_config(2), [s["run"] for s in sub], CALLS, SEED, f"gloo subgroup {SUBGROUP}")


def _mpiexec():
    """The mpiexec next to this Python (the mpich wheel's, matching mpi4py), else on PATH."""
    beside = Path(sys.executable).with_name("mpiexec")
    return str(beside) if beside.exists() else shutil.which("mpiexec")


@pytest.mark.skipif(_mpiexec() is None, reason="no mpiexec (pip install mpich mpi4py)")
def test_mpi_split_communicator_session_round_trip(tmp_path):
    pytest.importorskip("mpi4py")
    n = 2
    results = run_job([_mpiexec(), "-n", str(n), sys.executable, "-c",
                       f"import test_sessions_sim as t; t.mpi_rank_main({str(tmp_path / 'out')!r})"], tmp_path, n)
    assert [r["world_rank"] for r in results] == [n - 1 - rank for rank in range(n)]
    _check_group([r["group"] for r in results], "reversed split of COMM_WORLD")
    assert_calls_are_the_reference(ep_config(n), [r["run"] for r in results], CALLS, SEED, "MPI split")


@pytest.mark.parametrize("group", [42, "world", object()], ids=["int", "str", "object"])
def test_a_group_that_is_none_of_the_accepted_kinds_is_named(group):
    with pytest.raises(EPInputError) as info:
        bootstrap_group(group)
    message = str(info.value)
    assert type(group).__qualname__ in message, message
    assert "mpi4py intracommunicator" in message and "torch.distributed ProcessGroup" in message, message
    # open_session and session_for check the group before they open anything
    assert input_error_of(lambda: open_session("sim", group=group)) == message
    assert input_error_of(lambda: session_for(group, backend="sim")) == message


def test_open_session_takes_comm_or_group_not_both():
    with pytest.raises(EPInputError, match="comm= or group=, not both"):
        open_session("sim", comm=object(), group=object())


def test_none_in_a_torchrun_job_without_init_process_group_says_so(monkeypatch):
    from ep_runtime.shmem.launch import mpi_rank_size

    for name in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "MV2_COMM_WORLD_RANK", "PMIX_RANK"):
        monkeypatch.delenv(name, raising=False)
    if mpi_rank_size() is not None:
        pytest.skip("MPI is initialized in this process")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(EPInputError, match=r"torchrun job of 4 processes .*init_process_group\(\) first"):
        bootstrap_group(None)


@pytest.mark.parametrize("hosts, want", [
    (["a"], [0]),
    (["a", "a", "a"], [0, 1, 2]),
    (["a", "b", "a", "b", "b"], [0, 0, 1, 1, 2]),
])
def test_local_rank_counts_the_members_before_it_on_its_host(hosts, want):
    assert [local_rank_among(hosts, r) for r in range(len(hosts))] == want
