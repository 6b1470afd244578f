"""What the GPU check scripts of this folder share: their common options, the job's session, inputs,
the checks against the NumPy reference, the plans of a multi-plan check, and the report.

Every script runs as one rank of an MPI job, from the repository root::

    mpirun -np N python3 tests/gpu/<script>.py ...

(this folder is then on ``sys.path``, so a script imports this module as ``harness``). A rank
collects its failures (:class:`Checks`); :func:`finish`, collective, gathers every rank's failures
and table rows to rank 0, which prints ``FAIL: ...`` lines, the table and ``PASS`` or ``FAIL``;
every rank returns the exit status (1 where any rank failed). Inputs come from
:mod:`ep_runtime.testing`, whose token rows encode their source rank and token, so
:func:`batch_failure` names the row, the expert and the source rank, token and slot of the first
row that differs; :func:`combine_failure` names the worst token and column.

Imports here are deferred to the functions that need them: a script sets its environment (e.g.
``EP_RUNTIME_TRACE``) before any kernel module loads.
"""

from __future__ import annotations

import sys
import time
from typing import Callable

import numpy as np

#: The four calls of a round trip, in order (:func:`round_trip`'s timed names).
CALLS = ("dispatch_async", "dispatch_wait", "combine_async", "combine_wait")
#: What ``--plans`` takes (ep_check.py, fp8_check.py, graph_check.py, bad_ids_check.py).
PLANS_HELP = ("execution plans to check, one runtime each on one session: 'default' (the rules' plan with "
              "EP_RUNTIME_PLAN's overrides), plan overrides such as receiver=land,transport=puts, or 'variants' "
              "(default, then every receiver on every transport it can run on)")


# -- the command line ----------------------------------------------------------------------------------
def add_layer_options(ap, tokens=(4096, 128), hidden: int = 7168, experts: int = 256, top_k: int = 8,
                      seed: int | None = None, token_dtype: bool = False) -> None:
    """The layer's options: ``--tokens`` (several counts where ``tokens`` is a tuple, one where
    an int, none where None), ``--hidden``, ``--experts``, ``--top-k``; ``--seed`` where ``seed``
    is given; ``--token-dtype`` (EPConfig.token_dtype, default bfloat16) where asked for."""
    if isinstance(tokens, tuple):
        ap.add_argument("--tokens", type=int, nargs="+", default=list(tokens))
    elif tokens is not None:
        ap.add_argument("--tokens", type=int, default=tokens)
    ap.add_argument("--hidden", type=int, default=hidden)
    ap.add_argument("--experts", type=int, default=experts)
    ap.add_argument("--top-k", type=int, default=top_k)
    if seed is not None:
        ap.add_argument("--seed", type=int, default=seed)
    if token_dtype:
        ap.add_argument("--token-dtype", default="bfloat16",
                        help="EPConfig.token_dtype (an FP8 format: quantized in dispatch_async)")


def add_scenario_option(ap) -> None:
    """``--scenario``: the routing of the inputs (ep_runtime.testing.SCENARIOS)."""
    ap.add_argument("--scenario", default="random", help="routing (ep_runtime.testing.SCENARIOS; masked: -1 slots)")


def add_backend_option(ap) -> None:
    """``--backend``: ``nvshmem`` (GPUs, the default) or ``sim`` (the simulator: run the job with
    ``NUMBA_ENABLE_CUDASIM=1 mpiexec -n N``)."""
    ap.add_argument("--backend", default="nvshmem", choices=("nvshmem", "sim"),
                    help="sim: the simulator, under NUMBA_ENABLE_CUDASIM=1 mpiexec -n N")


def add_compiler_option(ap) -> None:
    """``--compiler``: the kernel compiler of this process (``ep_runtime.kernels.compiler``;
    default: the one installed, numba-cuda first). Parse with :func:`parse_args`, which selects it."""
    from ep_runtime.kernels.compiler import COMPILERS

    ap.add_argument("--compiler", choices=sorted(COMPILERS), default=None,
                    help="build the kernels with this compiler (default: the one installed, numba-cuda first)")


def parse_args(ap, argv=None):
    """``ap.parse_args(argv)``, then the compiler of ``--compiler`` (:func:`add_compiler_option`)
    selected for this process, before any kernel module is imported; one that is not installed
    ends the script through ``ap.error`` with its install command."""
    from ep_runtime.core.errors import EPError
    from ep_runtime.kernels import compiler

    args = ap.parse_args(argv)
    if getattr(args, "compiler", None) is not None:
        try:
            compiler.select(args.compiler)
        except EPError as exc:
            ap.error(f"--compiler {args.compiler}: {exc}")
    return args


# -- the job -------------------------------------------------------------------------------------------
def job_comm():
    """The job's communicator (mpi4py's ``COMM_WORLD``): one rank per GPU under mpirun."""
    from mpi4py import MPI

    return MPI.COMM_WORLD


def layer_config(args, n_ranks: int, max_tokens: int, **fields):
    """The :class:`~ep_runtime.EPConfig` of the layer options (:func:`add_layer_options`) on
    ``n_ranks`` ranks with capacity ``max_tokens`` a rank; ``fields``: more EPConfig fields."""
    from ep_runtime import EPConfig

    return EPConfig(n_ranks=n_ranks, n_experts=args.experts, top_k=args.top_k, hidden=args.hidden,
                    max_tokens_per_rank=max_tokens, **fields)


def open_job_session(*cfgs, backend: str = "nvshmem", extra_bytes: int = 0, logical_nodes: int = 1):
    """Collective: this rank's session of the job (``ep_runtime.shmem.open_session`` over the
    job's group), its symmetric heap the largest ``BufferLayout`` of ``cfgs`` plus
    ``extra_bytes``; ``logical_nodes`` > 1 splits the ranks into that many logical nodes."""
    from ep_runtime.core.layout import BufferLayout
    from ep_runtime.shmem import open_session

    heap = max([0] + [BufferLayout(c).symmetric_bytes for c in cfgs]) + extra_bytes
    return open_session(backend, heap_bytes=heap, logical_nodes=logical_nodes if logical_nodes > 1 else None)


# -- inputs --------------------------------------------------------------------------------------------
def job_inputs(cfg, seed: int, tokens: int | None = None, scenario: str = "random"):
    """Every rank's inputs (``ep_runtime.testing.make_inputs``: token rows [T, H] bf16 that
    encode their rank and token, ids [T, K] int32, weights [T, K] float32), ``tokens`` on every
    rank (default: the capacity)."""
    from ep_runtime.testing import make_inputs

    T = cfg.max_tokens_per_rank if tokens is None else tokens
    return make_inputs(cfg, scenario, seed, n_tokens=[T] * cfg.n_ranks)


def device_inputs(session, xs, ids, ws) -> tuple:
    """This rank's inputs of :func:`job_inputs` on the device (``session.to_device``, ordered on
    the session stream): tokens as bf16 bits [T, H] uint16, ids, weights."""
    r = session.rank
    return tuple(session.to_device(np.ascontiguousarray(a)) for a in (xs[r].view(np.uint16), ids[r], ws[r]))


def expert_rows(cfg, layout: str) -> int:
    """Rows of the expert outputs a combine of ``layout`` reads: the batch's capacity
    (expanded), or one row per received token (compact)."""
    return cfg.recv_rows_capacity if layout == "expanded" else cfg.n_ranks * cfg.max_tokens_per_rank


def round_trip_cases(session, cfg, tokens, layouts, fill: int = 0):
    """A probe's cases, each token count T of ``tokens`` (T tokens on every rank, seed T) in each
    layout of ``layouts``: ``(T, layout, (tok, tid, tw), y, out)``, this rank's inputs on the
    device (:func:`device_inputs`), expert outputs ``y`` [expert_rows, H] uint16 holding ``fill``
    and the combine's output ``out`` [T, H] uint16 (CuPy arrays; the inputs and ``out`` shared by
    a T's layouts)."""
    import cupy

    for T in tokens:
        inputs = device_inputs(session, *job_inputs(cfg, T, T))
        out = cupy.empty((T, cfg.hidden), cupy.uint16)
        for layout in layouts:
            yield T, layout, inputs, cupy.full((expert_rows(cfg, layout), cfg.hidden), fill, cupy.uint16), out


def round_trip(rt, tok, tid, tw, y, out, times: dict | None = None):
    """One dispatch and combine of this rank's device inputs (expert outputs ``y``, the combine
    written into ``out``); the batch. ``times``: each of :data:`CALLS` appends its host seconds
    (``time.perf_counter`` around the Python call only)."""
    pc = time.perf_counter
    t0 = pc()
    h = rt.dispatch_async(tok, tid, tw)
    t1 = pc()
    batch = rt.dispatch_wait(h)
    t2 = pc()
    ch = rt.combine_async(y, batch.handle)
    t3 = pc()
    rt.combine_wait(ch, out=out)
    t4 = pc()
    if times is not None:
        for name, dt in zip(CALLS, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            times[name].append(dt)
    return batch


# -- checks against the reference ----------------------------------------------------------------------
class Checks:
    """One rank's failures, each message after ``prefix`` (e.g. its plan and rank)."""

    def __init__(self, prefix: str = ""):
        self.prefix = prefix
        self.failures: list[str] = []

    def __call__(self, ok, what: str) -> bool:
        """Record ``what`` unless ``ok``; whether it held."""
        if not ok:
            self.failures.append(self.prefix + what)
        return bool(ok)

    def no_failure(self, failure: str | None) -> bool:
        """Record the message of a ``*_failure`` function (None: it held); whether it held."""
        return self(failure is None, failure or "")


#: The batch fields with a row per expert-batch row (the expanded layout's ``x`` too).
ROW_FIELDS = ("src_rank", "src_token", "src_k", "weight", "gather")


def batch_to_host(session, batch, layout: str = "expanded", rows: int | None = None) -> dict:
    """Host copies of a batch's ``ep_runtime.testing.BATCH_FIELDS`` (and of the compact layout's
    ``gather`` and ``recv_tokens``), as :func:`batch_failure` takes them; ``rows``: only the
    first rows of the fields with a row per batch row (a batch's capacity can far exceed its
    rows)."""
    from ep_runtime.testing import BATCH_FIELDS

    names = BATCH_FIELDS + (("gather", "recv_tokens") if layout == "compact" else ())
    per_row = ROW_FIELDS + (("x",) if layout == "expanded" else ())
    return {k: session.to_host(getattr(batch, k)[:rows] if rows is not None and k in per_row
                               else getattr(batch, k)).copy() for k in names}


def batch_failure(got: dict, ref, layout: str, xs, cfg, what: str) -> str | None:
    """None where this rank's batch ``got`` (:func:`batch_to_host`) is the reference's batch
    ``ref`` bit for bit (``ep_runtime.testing.assert_batch_is_the_reference``; ``xs``: every
    rank's tokens), else what differs: the first differing row, its expert and the source rank,
    token and slot the reference put there, and the assertion's message."""
    from ep_runtime.testing import assert_batch_is_the_reference

    try:
        assert_batch_is_the_reference(got, ref, layout, xs, cfg, "the batch")
    except AssertionError as exc:
        return f"{what}: {first_bad_row(got, ref, layout)}; {' '.join(str(exc).split())[:300]}"
    return None


def first_bad_row(got: dict, ref, layout: str) -> str:
    """Where ``got`` first differs from ``ref`` (:func:`batch_failure`), row by row: the row, its
    local expert, the source (rank, token, slot) the reference put there and the one ``got``
    names, and (bf16 rows) the origin that row's data encodes."""
    from ep_runtime.core.reference import BF16
    from ep_runtime.testing import describe_row

    n = ref.n_rows
    pairs = {k: (got[k][:n], getattr(ref, k)) for k in ("src_rank", "src_token", "src_k")}
    pairs["weight"] = (got["weight"][:n].view(np.uint32), ref.weight.view(np.uint32))
    bf16_rows = ref.x.dtype == BF16
    if layout == "expanded":
        x, compared = got["x"][:n], np.ones(n, bool)
    else:  # the received row each gather index picks; padding rows (index -1) pick none
        x, compared = got["x"][np.maximum(got["gather"][:n], 0)], got["gather"][:n] >= 0
    if bf16_rows:
        pairs["x"] = (x, ref.x.view(np.uint16))
    bad = np.zeros(n, bool)
    for k, (a, b) in pairs.items():
        if a.shape != b.shape:
            return f"{k}: {a.shape[0]} rows where the reference has {b.shape[0]}"
        differs = (a != b).reshape(n, -1).any(axis=1)
        bad |= differs & compared if k == "x" else differs
    if not bad.any():
        return "every row's source, weight and data as the reference's"
    i = int(np.flatnonzero(bad)[0])
    e = int(np.searchsorted(ref.row_offsets, i, side="right")) - 1

    def source(field) -> str:
        return f"rank {int(field('src_rank')[i])} token {int(field('src_token')[i])} slot {int(field('src_k')[i])}"

    data = f"; its data: {describe_row(x[i].view(BF16))}" if bf16_rows and compared[i] else ""
    return (f"{int(bad.sum())} rows differ, first row {i} (local expert {e}): the reference's "
            f"{source(lambda k: getattr(ref, k))}, got {source(got.__getitem__)}{data}")


def combine_failure(out: np.ndarray, want: np.ndarray, tol, what: str) -> str | None:
    """None where every token of ``out`` ([T, H] bf16 bits, host) is within ``tol`` ([T, 1] or a
    scalar, float32: ``reference.combine_tolerance``) of ``want`` ([T, H] float32), else how many
    tokens are over, naming the worst token and column (a NaN counts as over)."""
    from ep_runtime.core.reference import BF16

    got = np.asarray(out).view(BF16).astype(np.float32)
    err = np.abs(got - want)
    over = ~(err <= tol)
    if not over.any():
        return None
    t, c = np.unravel_index(int(np.argmax(np.where(over, np.nan_to_num(err, nan=np.inf), -1))), err.shape)
    bound = float(np.broadcast_to(tol, err.shape)[t, c])
    return (f"{what}: combine: {int(over.any(axis=1).sum())} of {len(err)} tokens over tolerance; worst token {t} "
            f"column {c}: got {got[t, c]:.6g}, want {want[t, c]:.6g}, tolerance {bound:.3g}")


def reference_combine_failure(cfg, refs, ids, ws, rank: int, out: np.ndarray, what: str,
                              node_size: int = 0) -> str | None:
    """None where ``out`` (rank ``rank``'s combine of every rank's ``testing.expert_outputs`` of
    the reference batches ``refs``) is within tolerance (``testing.combine_over_tolerance``),
    else the largest error."""
    from ep_runtime.testing import combine_over_tolerance

    err = combine_over_tolerance(cfg, refs, ids, ws, rank, out, node_size)
    return None if err is None else f"{what}: the combine is off by {err}, over its tolerance"


# -- plans: one runtime each, one after another on one session ----------------------------------------
def plan_list(items) -> list[str]:
    """``--plans`` as the plans to run, in order, each once: ``default`` (``EPRuntime(plan=None)``),
    ``key=value,...`` override strings, and ``variants`` for ``default`` followed by
    ``receiver=R,transport=T`` for every (R, T) of ep_runtime.tools.gate_entries.PLAN_VARIANTS. Every
    override string is parsed here (ep_runtime.core.plan.parse_overrides), so that a typo stops every
    rank before the session opens (an impossible combination fails later, when its runtime is
    built)."""
    from ep_runtime.core.errors import EPConfigError
    from ep_runtime.core.plan import parse_overrides

    out = []
    for item in items:
        if item == "variants":
            from ep_runtime.tools.gate_entries import PLAN_VARIANTS

            texts = ["default"] + [f"receiver={r},transport={t}" for r, t in PLAN_VARIANTS]
        else:
            texts = [item]
        for text in texts:
            if text != "default":
                try:
                    parse_overrides(text, f"--plans {text!r}")
                except EPConfigError as exc:
                    raise SystemExit(str(exc)) from None
            if text not in out:
                out.append(text)
    return out


def runtime_for(cfg, session, text: str):
    """The runtime of plan ``text`` (a :func:`plan_list` item; collective): ``(rt, seconds to
    build it)``, or ``(None, the error)`` where that plan cannot run here (EPConfigError: raised
    alike on every rank, so every rank skips the plan)."""
    from ep_runtime import EPConfigError, EPRuntime

    t0 = time.perf_counter()
    try:
        rt = EPRuntime(cfg, session, plan=None if text == "default" else text)
    except EPConfigError as exc:
        return None, f"EPRuntime(plan={text!r}) raised EPConfigError: {exc}"
    return rt, time.perf_counter() - t0


def plan_label(plan, text: str, n_plans: int) -> str:
    """The table's plan column: ``receiver/transport`` of the runtime's plan; ``*`` marks the
    default plan (``text`` ``default``) when several plans run."""
    label = f"{plan.receiver.value}/{plan.transport.value}"
    return label + "*" if text == "default" and n_plans > 1 else label


def run_plans(session, plans: list[str], cfgs: dict, body: Callable, build_time: bool = False) -> tuple:
    """Every plan of ``plans`` on every config of ``cfgs`` (``{key: EPConfig}``, key ``""`` where
    there is one), a runtime each, built one after another on ``session``, closed after
    ``body(rt, label, check)`` returned its table rows (``check``: the :class:`Checks` of the
    plan, its messages prefixed ``<label>: rank <r>: ``). A plan that cannot run here
    (EPConfigError when its runtime is built) is a failure (rank 0's) and a row ``None``; the
    other plans still run. Any other error stops the job.

    Returns ``(lines, rows, failures)``: a line per plan (its label, its overrides and its plan's
    summary; with ``build_time``, how long building it took), this rank's rows ``(plan index,
    label, key, row)`` for :func:`plan_table`, and this rank's failures.
    """
    me, lines, rows, failures = session.rank, [], [], []
    for i, text in enumerate(plans):
        for key, cfg in cfgs.items():
            where = f" ({key})" if key else ""
            rt, built = runtime_for(cfg, session, text)
            if rt is None:  # every rank: the plan cannot run here; rank 0 reports it
                lines.append(f"plan {text}: not built{where}")
                rows += [(i, text, key, None)] if me == 0 else []
                failures += [f"{text}: {key + ': ' if key else ''}{built}"] if me == 0 else []
                continue
            label = plan_label(rt.plan, text, len(plans))
            check = Checks(f"{label}: rank {me}: ")
            try:
                plan_rows = body(rt, label, check)
            except Exception:  # not a plan that cannot run: the job stops, as without --plans
                print(f"rank {me}: plan {text!r}{where} raised; the plans after it did not run", file=sys.stderr,
                      flush=True)
                raise
            line = f"plan {label} = {text}: " + (f"runtime init (kernels compiled) {built:.2f} s; " if build_time
                                                 else "") + rt.plan.summary()
            rt.close()
            if line not in lines:  # a plan's line once (the configs' plans are alike)
                lines.append(line)
            rows += [(i, label, key, row) for row in plan_rows]
            failures += check.failures
    return lines, rows, failures


def plan_table(all_rows: list, n_plans: int, columns: str, cells: Callable, key_column=None) -> list[str]:
    """Rank 0's table of :func:`run_plans`' rows of every rank (``all_rows``), plan by plan: a
    line per rank and row, ``rank plan [key] cells(row)`` (``runtime not built`` for a row
    None). ``columns``: the header after ``rank plan``; ``key_column``: ``(name, width)`` of the
    key's column, where the configs have keys."""
    w = max([4] + [len(label) for rr in all_rows for _, label, _, _ in rr])
    key_name, key_w = key_column or ("", 0)
    key = (lambda k: f"{k:>{key_w}} ") if key_column else (lambda k: "")
    lines = [f"{'rank':>4} {'plan':<{w}} {key(key_name)}{columns}"]
    for i in range(n_plans):
        for r, rr in enumerate(all_rows):
            for _, label, k, row in (x for x in rr if x[0] == i):
                lines.append(f"{r:>4} {label:<{w}} {key(k)}"
                             + ("runtime not built (FAIL above)" if row is None else cells(row)))
    return lines


# -- the report ----------------------------------------------------------------------------------------
def gather(obj):
    """Collective: every rank's ``obj`` in rank order on rank 0, None on the others."""
    return job_comm().gather(obj, root=0)


def finish(failures: list[str], rows=None, table: Callable = lambda all_rows: [], most: int | None = None) -> int:
    """Collective, the end of a check: every rank's ``failures`` and ``rows`` gathered to rank
    0, which prints each failure as ``FAIL: ...`` (the first ``most`` where given), then the
    lines ``table(every rank's rows)``, then PASS or FAIL. Returns the exit status on every rank:
    1 where any rank failed."""
    from ep_runtime.testing import gpu_check_report

    comm = job_comm()
    every = comm.gather((list(failures), rows), root=0)
    if comm.Get_rank() == 0:
        flat = [f for fails, _ in every for f in fails]
        shown = flat if most is None else flat[:most]
        more = [f"({len(flat) - len(shown)} more failures not shown)"] if len(shown) < len(flat) else []
        gpu_check_report([shown], more + list(table([r for _, r in every])))
    return 1 if comm.allreduce(len(failures)) else 0
