"""Start the PEs of a job: simulated PEs as local processes, and rank discovery under MPI.

- :func:`run_pes` runs ``target(session, *args, **kwargs)`` on ``n_ranks`` fresh processes,
  one :class:`~ep_runtime.shmem.sim_session.SimSession` each, and returns their results. It
  never hangs: a PE that raises, exits early or runs past ``timeout_s`` stops the whole job
  with :class:`~ep_runtime.core.errors.PEFailure` (its traceback, the signal that killed it, or
  the Python stacks of the PEs still running).
- :func:`mpi_rank_size` and :func:`local_rank` read the MPI launcher's environment;
  :func:`open_sim_session` opens a simulated session over the job's group (an mpi4py
  communicator under ``mpiexec -n N``, a torch.distributed process group under torchrun;
  every process started with ``NUMBA_ENABLE_CUDASIM=1``), :func:`open_sim_session_from_mpi`
  over an mpi4py communicator.

Shutdown: a simulated job keeps nothing in /dev/shm past bring-up (see
:mod:`~ep_runtime.shmem.sim_heap`), so a job that ends in any way, SIGKILL included, frees its
memory. :func:`run_pes` owns what bring-up leaves: on SIGTERM, SIGHUP or SIGINT it stops its
PEs, removes the job's files and then lets the signal take its usual course (the process dies
of it, or the handler that was installed before runs). Its PEs exit as soon as the launcher is
gone, killed or not. A PE whose peer process dies fails its next wait at once with
:class:`~ep_runtime.core.errors.PEFailure` naming that peer.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import importlib
import importlib.util
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import threading
import time
import traceback
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ep_runtime.core.errors import EPInputError, MissingDependencyError, PEFailure
from ep_runtime.shmem.mpi import local_rank, mpi_module, mpi_rank_size  # noqa: F401 (public here too)
from ep_runtime.shmem.sim_heap import DEFAULT_HEAP_BYTES, WAIT_TIMEOUT_ENV
from ep_runtime.shmem.sim_job_files import remove_job_files

log = logging.getLogger("ep_runtime.shmem")

# A PE's own barriers time out this much later than the launcher, so a hang is reported by
# the launcher, which sees every PE and can dump their stacks.
_PE_TIMEOUT_MARGIN_S = 10.0
# Time a PE gets to write its stacks after SIGUSR1, and to exit after SIGTERM.
_STACK_DUMP_WAIT_S = 0.5
_TERMINATE_WAIT_S = 2.0
# Signals after which run_pes stops its PEs and removes the job's files before the signal
# takes its course: termination (kill, timeout), a closed terminal, Ctrl-C.
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)



#: Marks a target module given as a script path (a function of the launching script's __main__).
_SCRIPT_PREFIX = "script:"


@dataclass(frozen=True)
class _PESpec:
    """What one PE process needs (pickled to the child)."""

    rank: int
    n_ranks: int
    job: str
    heap_bytes: int
    session_timeout_s: float
    target: tuple[str, str]
    args: tuple
    kwargs: dict
    #: the launcher's environment when the job started, the PE's from its first instruction
    environ: dict | None = None


#: Length of a job id (hex digits).
_JOB_ID_BYTES = 16


def new_job_id() -> str:
    """A fresh job id (16 hex digits) naming a job's /dev/shm files."""
    return uuid.uuid4().hex[:_JOB_ID_BYTES]


def run_pes(target: Callable, n_ranks: int, args: tuple = (), kwargs: dict | None = None,
            timeout_s: float = 120.0, backend: str = "sim", heap_bytes: int = DEFAULT_HEAP_BYTES,
            wait_timeout_s: float | None = None) -> list:
    """Run ``target(session, *args, **kwargs)`` on ``n_ranks`` simulated PEs; their results.

    Parameters
    ----------
    target : callable
        A module-level function (imported by name in each PE, after the PE's environment
        has ``NUMBA_ENABLE_CUDASIM=1``, so numba starts in simulator mode there). PEs are
        spawned: a script calling run_pes needs the ``if __name__ == "__main__":`` guard.
    n_ranks : int
        Number of PEs, one spawned OS process each.
    args, kwargs
        Picklable extra arguments, the same for every PE.
    timeout_s : float
        Limit of the whole job, start-up included.
    backend : str
        ``"sim"`` (the only backend that runs on local processes).
    heap_bytes : int
        Symmetric heap per PE (a sparse /dev/shm file).
    wait_timeout_s : float, optional
        Limit of each simulated signal wait (``EP_SIM_WAIT_TIMEOUT`` in the PEs).

    Returns
    -------
    list
        ``target``'s (picklable) return value of each PE, in rank order.

    Raises
    ------
    PEFailure
        A PE raised (its traceback), exited before reporting (its exit code, or the signal
        that killed it), or did not finish within ``timeout_s`` (the Python stacks of the
        PEs still running). Every PE is stopped and the job's /dev/shm files are removed
        before it is raised.

    Notes
    -----
    Called from the main thread, run_pes handles SIGTERM, SIGHUP and SIGINT while it runs
    (each unless ignored): it stops the PEs and removes the job's files, then delivers the
    signal again under the handler that was there before (by default SIGTERM and SIGHUP kill
    the process and SIGINT raises KeyboardInterrupt); if that handler returns, run_pes
    raises :class:`PEFailure` naming the signal.
    """
    ref = _check_run_args(target, n_ranks, timeout_s, backend)
    job = new_job_id()
    what = f"run_pes({ref[0]}.{ref[1]}, n_ranks={n_ranks}, job={job})"
    env = {"NUMBA_ENABLE_CUDASIM": "1"}
    if wait_timeout_s is not None:
        env[WAIT_TIMEOUT_ENV] = str(wait_timeout_s)
    specs = [_PESpec(rank, n_ranks, job, heap_bytes, timeout_s + _PE_TIMEOUT_MARGIN_S, ref,
                     tuple(args), dict(kwargs or {})) for rank in range(n_ranks)]
    procs, conns, stacks = [], [], []
    with _StopOnSignals(what) as stop:
        try:
            with stop.held():
                _start_pes(specs, env, procs, conns, stacks)
            return _collect(procs, conns, stacks, timeout_s, what)
        finally:
            # A stop signal that arrives from here on waits until the PEs are stopped and
            # the files removed.
            stop.defer()
            _stop(procs, conns + stacks)
            remove_job_files(job)


def job_backend(backend: str = "auto") -> str:
    """``backend``, with ``"auto"`` resolved: ``"nvshmem"`` under mpirun when a GPU is visible,
    else ``"sim"``."""
    if backend != "auto":
        return backend
    from ep_runtime.shmem import gpu_visible

    return "nvshmem" if mpi_rank_size() is not None and gpu_visible() else "sim"


def job_ranks(default: int) -> int:
    """Ranks of the job: the MPI job's size under mpirun, else ``default`` (simulated PEs)."""
    mpi = mpi_rank_size()
    return mpi[1] if mpi is not None else default


def run_job(target: Callable, n_ranks: int, args: tuple = (), backend: str = "auto",
            heap_bytes: int = DEFAULT_HEAP_BYTES, timeout_s: float = 600.0) -> list | None:
    """Run ``target(session, *args)`` on every rank of the job, the way the command-line tools do.

    Under mpirun this process is one rank (collective: every rank calls) and rank 0 gets every
    rank's result in rank order, the others ``None``; otherwise ``n_ranks`` simulated PEs run as
    processes (:func:`run_pes`). ``backend`` as in :func:`job_backend`.
    """
    backend = job_backend(backend)
    if mpi_rank_size() is None:
        if backend != "sim":
            raise EPInputError(f"backend {backend!r} needs mpirun (one rank per GPU): mpirun -np 2 python ...")
        return run_pes(target, n_ranks, args=args, timeout_s=timeout_s, heap_bytes=heap_bytes)
    MPI = mpi_module("run_job under mpirun")
    from ep_runtime.shmem import open_session

    with open_session(backend, heap_bytes=heap_bytes) as session:
        result = target(session, *args)
    return MPI.COMM_WORLD.gather(result, root=0)


def open_sim_session(group=None, heap_bytes: int = DEFAULT_HEAP_BYTES, timeout_s: float = 60.0):
    """Open a :class:`~ep_runtime.shmem.sim_session.SimSession` over the job's group, one PE per
    member (PE index: group rank). Collective over ``group``.

    ``group``: what :func:`~ep_runtime.shmem.bootstrap.bootstrap_group` accepts (``None``: the
    job's group; an mpi4py communicator; a torch.distributed ProcessGroup). Every process must
    have started with ``NUMBA_ENABLE_CUDASIM=1``. Group rank 0 makes the job id and broadcasts
    it over the group. All members must run on one node (the heaps are /dev/shm files). The
    files exist only during bring-up; a rank whose bring-up fails removes them, and only a job
    whose every rank is killed during bring-up leaves them (empty, sparse): remove them with
    :func:`ep_runtime.shmem.sim_job_files.remove_job_files`. A rank whose peer process dies gets
    :class:`~ep_runtime.core.errors.PEFailure` naming it at its next wait. The simulated kernels of a
    process use its one current heap: one open session per process.
    """
    _require_simulator("open_sim_session")
    from ep_runtime.shmem.bootstrap import bootstrap_group
    from ep_runtime.shmem.sim_session import SimSession

    boot = bootstrap_group(group)
    job = np.zeros(_JOB_ID_BYTES, np.uint8)
    if boot.rank == 0:
        job[:] = np.frombuffer(new_job_id().encode(), np.uint8)
    boot.broadcast_bytes(job, root=0)
    return SimSession.open(boot.rank, boot.size, job.tobytes().decode(), heap_bytes, timeout_s, bootstrap=boot)


def open_sim_session_from_mpi(heap_bytes: int = DEFAULT_HEAP_BYTES, timeout_s: float = 60.0, comm=None):
    """:func:`open_sim_session` over the mpi4py communicator ``comm`` (default ``COMM_WORLD``), in
    a script started with ``mpiexec -n N`` and ``NUMBA_ENABLE_CUDASIM=1``. Collective."""
    _require_simulator("open_sim_session_from_mpi")
    MPI = mpi_module("open_sim_session_from_mpi")
    return open_sim_session(comm if comm is not None else MPI.COMM_WORLD, heap_bytes, timeout_s)


def _require_simulator(what: str) -> None:
    """:class:`MissingDependencyError` naming the ``sim`` extra unless numba-cuda, whose CUDA
    simulator runs the kernels, is installed."""
    if importlib.util.find_spec("numba") is None:
        raise MissingDependencyError(
            f"{what}: the simulator runs kernels under Numba's CUDA simulator, and numba-cuda is not "
            "installed; install the simulator's extra with pip install -e \".[sim]\" (or run the demo "
            "with --backend reference, which needs only NumPy)")


# -- parent side -------------------------------------------------------------------------------
def _check_run_args(target, n_ranks: int, timeout_s: float, backend: str) -> tuple[str, str]:
    """Validate run_pes's arguments; ``target`` as ``(module, qualified name)``."""
    if backend != "sim":
        raise EPInputError(f"run_pes: backend={backend!r}: only 'sim' runs on local processes; "
                           "start nvshmem jobs with mpirun")
    _require_simulator("run_pes")
    if not isinstance(n_ranks, int) or n_ranks < 1:
        raise EPInputError(f"run_pes: n_ranks={n_ranks!r} must be a positive int")
    if timeout_s <= 0:
        raise EPInputError(f"run_pes: timeout_s={timeout_s} must be positive")
    module = getattr(target, "__module__", None)
    qualname = getattr(target, "__qualname__", "")
    if not callable(target) or module is None or "<" in qualname:
        raise EPInputError(f"run_pes: target {target!r} must be a module-level function (the "
                           "PEs import it by name; lambdas and nested functions cannot be)")
    if module == "__main__":  # a script's own function: the PEs load the script by its path
        path = getattr(sys.modules["__main__"], "__file__", None)
        if path is None:
            raise EPInputError(f"run_pes: target {qualname} is defined interactively; define it in a module "
                               "(or a script file) the PEs can import")
        module = _SCRIPT_PREFIX + os.path.abspath(path)
    return module, qualname


@contextmanager
def _environment(env: dict[str, str | None]):
    """Set ``env`` in os.environ for the block (a name whose value is None: unset): spawned PEs
    inherit it from their first instruction, before any module (numba included) is imported
    there."""
    saved = {name: os.environ.get(name) for name in env}
    for name, value in env.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


class _StopOnSignals:
    """While a job runs (main thread only): a stop signal raises :class:`_Stopped` at once, or,
    after :meth:`defer`, is held until the block ends; on leaving the block, the previous
    handlers come back and a signal that arrived is delivered again under them."""

    def __init__(self, what: str):
        self._what = what
        self._previous: dict[int, Any] = {}
        self._deferred = False
        self._received: int | None = None

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for signum in _STOP_SIGNALS:
                previous = signal.getsignal(signum)
                if previous not in (signal.SIG_IGN, None):  # None: installed outside Python
                    self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def defer(self) -> None:
        """From now on, hold stop signals until the block ends."""
        self._deferred = True

    @contextmanager
    def held(self):
        """Hold stop signals inside this block; one that arrived raises :class:`_Stopped` when
        it ends (starting PEs: a PE is stopped by its pid, which its start returns last)."""
        self._deferred = True
        yield  # an exception leaves them held: the caller's cleanup follows
        if self._received is not None:
            raise _Stopped(self._received)  # held from here on, as after _handle
        self._deferred = False

    def _handle(self, signum, frame) -> None:
        if self._received is None:
            self._received = signum
        if not self._deferred:
            # Set before raising: a second signal must not interrupt the cleanup this starts.
            self._deferred = True
            raise _Stopped(signum)

    def __exit__(self, exc_type, exc, tb):
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        if self._received is None:
            return False
        name = signal.Signals(self._received).name
        log.warning("%s: got %s: stopped its PEs and removed the job's /dev/shm files", self._what, name)
        # Under the previous handler: the default one ends the process (SIGTERM, SIGHUP) or
        # raises KeyboardInterrupt (SIGINT); a Python handler runs here and may raise.
        signal.raise_signal(self._received)
        raise PEFailure(f"{self._what}: stopped by {name}; its PEs were stopped and the job's "
                        "/dev/shm files removed") from (exc if isinstance(exc, _Stopped) else None)


class _Stopped(BaseException):
    """A stop signal arrived while run_pes waited (BaseException: no ``except Exception``
    between the handler and run_pes may swallow it)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


#: What the PE server imports once, in simulator mode: numba, the simulator's session and
#: runtime, the kernel modules a runtime builds its kernels from (every family
#: ``core.builds.plan_kernels`` imports, every transport and codec) and the tests' inputs and PE
#: functions (ep_runtime.testing). Imported in each PE instead, they would cost every PE the
#: imports (and, without cached bytecode, a compile of every module): with many PEs a core, most
#: of a job's CPU.
_PE_PRELOAD = ("numpy", "numba.cuda", "ep_runtime.shmem.sim_session", "ep_runtime.core.runtime",
               "ep_runtime.core.formats", "ep_runtime.kernels.dispatch", "ep_runtime.kernels.combine",
               "ep_runtime.kernels.combine_dense", "ep_runtime.kernels.layouts.dense",
               "ep_runtime.kernels.layouts.batched", "ep_runtime.kernels.slot_values",
               "ep_runtime.kernels.routing_keep", "ep_runtime.kernels.validate",
               "ep_runtime.kernels.transport.stores", "ep_runtime.kernels.transport.puts",
               "ep_runtime.kernels.transport.hierarchical", "ep_runtime.kernels.codecs.words",
               "ep_runtime.kernels.codecs.fp8", "ep_runtime.kernels.codecs.nvfp4", "ep_runtime.testing")
#: Environment variables that the preloaded modules read once, when imported (``EP_RUNTIME_TRACE``:
#: kernels/trace.py). The server starts without them; a job that sets one spawns its PEs.
_IMPORT_ENVIRONMENT = ("EP_RUNTIME_TRACE",)
_pe_server_lock = threading.Lock()
_pe_server_started = False


def _pe_context(environ: dict[str, str]):
    """The multiprocessing context the PEs of a job with environment ``environ`` start in.

    multiprocessing's fork server, started by this module with ``NUMBA_ENABLE_CUDASIM=1`` and
    :data:`_PE_PRELOAD` imported: each PE is a fork of that single-threaded, warm interpreter
    (numba already in simulator mode, the kernel modules imported, no threads or locks of the
    launcher), then runs multiprocessing's usual preparation (the launcher's sys.path and main
    module) and takes the launcher's environment (:func:`_pe_main`). Each PE is spawned as a
    fresh interpreter instead where ``environ`` sets a variable of :data:`_IMPORT_ENVIRONMENT`
    (the server's modules were imported without it), where this process already runs a fork
    server that this module did not start (its preload and environment are someone else's), or
    where the platform has none.
    """
    global _pe_server_started
    if any(name in environ for name in _IMPORT_ENVIRONMENT):
        return multiprocessing.get_context("spawn")
    try:
        from multiprocessing import forkserver
        server = forkserver._forkserver
        context = multiprocessing.get_context("forkserver")
    except (ImportError, AttributeError, ValueError):
        return multiprocessing.get_context("spawn")
    with _pe_server_lock:
        if not _pe_server_started:
            if getattr(server, "_forkserver_pid", None) is not None:
                return multiprocessing.get_context("spawn")
            server.set_forkserver_preload(list(_PE_PRELOAD))
            with _environment({"NUMBA_ENABLE_CUDASIM": "1", **{name: None for name in _IMPORT_ENVIRONMENT}}):
                server.ensure_running()
            _pe_server_started = True
    return context


def _start_pes(specs: list[_PESpec], env: dict[str, str], procs: list, conns: list, stacks: list) -> None:
    # A fresh interpreter's worth of state per PE (numba must start in simulator mode; no
    # forked threads or locks): see _pe_context. The preparation data carries the parent's
    # sys.path, so test modules import in the PEs.
    context = _pe_context({**os.environ, **env})
    with _environment(env):
        environ = dict(os.environ)
        for spec in specs:
            spec = dataclasses.replace(spec, environ=environ)
            receiver, sender = context.Pipe(duplex=False)
            # The PE's stack dumps (SIGUSR1, on a hang) come back through a pipe, not a file.
            stack_reader, stack_writer = context.Pipe(duplex=False)
            proc = context.Process(target=_pe_main, args=(spec, sender, stack_writer),
                                   name=f"ep_sim_pe{spec.rank}", daemon=True)
            # Listed before it starts, so a stop signal during start() still stops it.
            procs.append(proc)
            conns.append(receiver)
            stacks.append(stack_reader)
            try:
                proc.start()
            finally:
                sender.close()
                stack_writer.close()


def _collect(procs: list, conns: list, stacks: list, timeout_s: float, what: str) -> list:
    """Wait for every PE's report; the results in rank order, or :class:`PEFailure`."""
    results: list[Any] = [None] * len(procs)
    pending = set(range(len(procs)))
    deadline = time.monotonic() + timeout_s
    while pending:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise PEFailure(_hang_message(procs, stacks, pending, timeout_s, what))
        multiprocessing.connection.wait(
            [conns[r] for r in pending] + [procs[r].sentinel for r in pending], remaining)
        exited, raised = [], []
        for rank in sorted(pending):
            state, payload = _report(procs[rank], conns[rank])
            if state == "ok":
                results[rank] = payload
                pending.discard(rank)
            elif state == "exited":
                exited.append(_exit_message(rank, payload))
            elif state == "error":
                raised.append(f"PE {rank} raised:\n{payload}")
        if exited or raised:
            # PEs that died first: the others' errors are usually waits on them.
            raise PEFailure(f"{what}: " + "\n".join(exited + raised))
    return results


def _report(proc, conn) -> tuple[str, Any]:
    """PE state: ``("ok", value)``, ``("error", traceback)``, ``("exited", exit code)`` or
    ``("running", None)``."""
    # Liveness first: a PE that reports and exits between a poll and a liveness check would
    # read as exited without a report; once it has exited, everything it sent is in the pipe.
    alive = proc.is_alive()
    if conn.poll():
        try:
            return conn.recv()
        except EOFError:
            proc.join(_TERMINATE_WAIT_S)
            return "exited", proc.exitcode
    if not alive:
        return "exited", proc.exitcode
    return "running", None


def _exit_message(rank: int, code: int | None) -> str:
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return (f"PE {rank} was killed by {name} (exit code {code}) before reporting (kill, the "
                "out-of-memory killer, or a crash of the interpreter: see its stderr)")
    return (f"PE {rank} exited with code {code} before reporting (os._exit, sys.exit, a crash of "
            "the interpreter, or a failed start: see its stderr; a script that calls run_pes needs "
            "the `if __name__ == '__main__':` guard)")


def _hang_message(procs: list, stacks: list, pending: set[int], timeout_s: float, what: str) -> str:
    done = sorted(set(range(len(procs))) - pending)
    running = sorted(pending)
    for rank in running:
        if procs[rank].is_alive():
            os.kill(procs[rank].pid, signal.SIGUSR1)
    dumps = _read_stacks({rank: stacks[rank] for rank in running}, _STACK_DUMP_WAIT_S)
    text = [f"--- Python stacks of PE {rank} ---\n{dumps[rank]}" if dumps[rank]
            else f"--- PE {rank}: no stacks (it had not started) ---" for rank in running]
    return (f"{what}: PE(s) {running} did not finish within {timeout_s} s (finished: {done}); "
            "a deadlock (a wait nobody signals, a skipped collective) or too short a timeout.\n"
            + "\n".join(text))


def _read_stacks(readers: dict, wait_s: float) -> dict[int, str]:
    """What each PE's stack pipe holds after ``wait_s`` seconds (raw faulthandler text)."""
    chunks: dict[int, list[bytes]] = {rank: [] for rank in readers}
    open_readers = dict(readers)
    deadline = time.monotonic() + wait_s
    while open_readers and (remaining := deadline - time.monotonic()) > 0:
        for reader in multiprocessing.connection.wait(list(open_readers.values()), remaining):
            rank = next(r for r, c in open_readers.items() if c is reader)
            data = os.read(reader.fileno(), 1 << 16)
            if data:
                chunks[rank].append(data)
            else:  # the PE exited: nothing more will come
                del open_readers[rank]
    return {rank: b"".join(parts).decode(errors="replace") for rank, parts in chunks.items()}


def _stop(procs: list, conns: list) -> None:
    procs = [proc for proc in procs if proc.pid is not None]  # started
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    for proc in procs:
        proc.join(_TERMINATE_WAIT_S)
        if proc.is_alive():
            proc.kill()
            proc.join()
    for conn in conns:
        conn.close()


# -- PE side -----------------------------------------------------------------------------------
def _pe_main(spec: _PESpec, conn, stacks) -> None:
    """Entry point of a PE process: run the target in a session, report to the launcher."""
    # SIGUSR1 dumps every thread's stack into the stack pipe (``stacks``, open for the
    # process's life): the launcher asks for it on a hang.
    faulthandler.register(signal.SIGUSR1, file=stacks.fileno(), all_threads=True)
    if spec.environ is not None:  # a fork of the PE server has the server's environment
        os.environ.clear()
        os.environ.update(spec.environ)
    threading.Thread(target=_exit_with_launcher, args=(spec.job,), daemon=True).start()
    try:
        conn.send(("ok", _run_pe(spec)))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


def _exit_with_launcher(job: str) -> None:
    """Leave (removing the files of a bring-up in progress) as soon as the launcher is gone,
    killed or not, so no PE outlives it."""
    multiprocessing.connection.wait([multiprocessing.parent_process().sentinel])
    remove_job_files(job)
    os._exit(1)


def _import_target_module(name: str):
    """The target's module: by import name, or a script loaded from its path under a name
    other than ``__main__`` (so its ``if __name__ == "__main__":`` block does not run again)."""
    if not name.startswith(_SCRIPT_PREFIX):
        return importlib.import_module(name)
    path = name[len(_SCRIPT_PREFIX):]
    spec = importlib.util.spec_from_file_location("ep_runtime_pe_script", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _run_pe(spec: _PESpec):
    # NUMBA_ENABLE_CUDASIM=1 came with the environment at spawn, so the target's module and
    # numba are imported in simulator mode.
    from ep_runtime.shmem.sim_session import SimSession

    module_name, qualname = spec.target
    target = _import_target_module(module_name)
    for name in qualname.split("."):
        target = getattr(target, name)
    session = SimSession.open(spec.rank, spec.n_ranks, spec.job, spec.heap_bytes,
                              spec.session_timeout_s)
    # If the target raises, the session is not closed: close is collective and the other PEs
    # may be stuck; the launcher stops them all and removes the job's files.
    value = target(session, *spec.args, **spec.kwargs)
    session.close()
    return value
