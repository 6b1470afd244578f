"""The compile-and-link gate, run as CI runs it: in separate processes, on a CPU-only machine.

Every kernel in ep_runtime.tools.gate_entries must link to a non-empty sm_90a cubin against
nvshmem4py's real device API, and every negative control (tests/gate_negative.py) must fail.
Skipped only where nvshmem4py's Numba bindings (nvshmem4py-cu13[numba] + cffi) are missing.
Where ``$EP_RUNTIME_GATE_RUNS`` names the output of gate runs of this same tree (.ci/run starts
them while the test extras install), their reports are used instead of compiling again; a report
of other sources (its fingerprint) is ignored and the gate runs here.
"""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ep_runtime.tools import compile_gate

pytestmark = pytest.mark.skipif(
    not compile_gate.nvshmem_numba_bindings_installed(),
    reason="nvshmem4py's Numba device bindings are not installed "
           "(pip install 'nvshmem4py-cu13[numba]==0.4.1' cffi, or pip install -e '.[test]')")

REPO = Path(__file__).resolve().parents[1]
NEGATIVE = Path(__file__).with_name("gate_negative.py")
TIMEOUT_S = 540

# name -> a piece of the error it must fail with (a failure for another reason is not a pass).
EXPECTED_ERRORS = {
    "neg_put_signal_int64_signal": "No implementation of function",  # typing: int64 signal
    "neg_put_mixed_dtypes": "No implementation of function",         # typing: uint16 <- int16
    "neg_unresolved_extern": "ep_gate_no_such_symbol",               # link: nvJitLink
}


def _start(*args, **env_overrides):
    env = dict(os.environ)
    # The gate needs the real compiler, whatever the rest of the test session simulates.
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    env.pop("NUMBA_FORCE_CUDA_CC", None)
    env.update(env_overrides)
    # its own process group: a gate killed on timeout takes its compiler processes with it
    return subprocess.Popen([sys.executable, "-m", "ep_runtime.tools.compile_gate", "--json", *args],
                            cwd=REPO, env=env, text=True, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _kill(proc):
    """Kill the gate and every process it started (its pool's workers outlive a killed parent)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _finish(proc):
    try:
        stdout, stderr = proc.communicate(timeout=TIMEOUT_S)
    finally:
        _kill(proc)
    return _parsed(proc.returncode, stdout, stderr)


def _parsed(rc: int, stdout: str, stderr: str):
    """``(rc, report, stderr)`` of a gate run: its report is the last line of its stdout."""
    lines = [ln for ln in stdout.splitlines() if ln.strip()]
    try:
        report = json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        pytest.fail(f"gate printed no JSON report (rc={rc})\n"
                    f"stdout:\n{stdout[-3000:]}\nstderr:\n{stderr[-6000:]}")
    return rc, report, stderr


#: A directory where .ci/run's own gate runs leave their output (``positive.out``, ``.err``, ``.rc``
#: and the same for ``negative``): it starts them as soon as the compile gate's dependencies are
#: installed, while the rest of the test extras install on an otherwise idle core.
RUNS_DIR = "EP_RUNTIME_GATE_RUNS"
RUN_ARGS = {"positive": ("--jobs", str(min(2, os.cpu_count() or 1))), "negative": ("--entries", str(NEGATIVE))}


def _earlier_run(key: str):
    """The ``(rc, report, stderr)`` of gate run ``key`` that .ci/run started (waiting until it
    ends), or None: no such run, or its report is of other sources than this tree's (its
    ``sources`` fingerprint), so the gate runs here."""
    where = os.environ.get(RUNS_DIR)
    if not where:
        return None
    rc_file = Path(where) / f"{key}.rc"
    deadline = time.monotonic() + TIMEOUT_S
    while not rc_file.exists():
        if time.monotonic() > deadline:
            pytest.fail(f"${RUNS_DIR}: the {key} gate run of .ci/run left no {rc_file.name} in {TIMEOUT_S} s")
        time.sleep(1)
    stdout, stderr = ((Path(where) / f"{key}.{ext}").read_text() for ext in ("out", "err"))
    rc, report, stderr = _parsed(int(rc_file.read_text()), stdout, stderr)
    spec = RUN_ARGS[key][1] if key == "negative" else compile_gate.DEFAULT_ENTRIES
    return (rc, report, stderr) if report.get("sources") == compile_gate.source_fingerprint(spec) else None


@pytest.fixture(scope="module")
def gate_runs():
    runs = {key: _earlier_run(key) for key in RUN_ARGS}
    # The rest at once (CI has 2 cores; the negative run is mostly interpreter start-up).
    procs = {key: _start(*args) for key, args in RUN_ARGS.items() if runs[key] is None}
    try:
        return {**runs, **{key: _finish(proc) for key, proc in procs.items()}}
    finally:
        for proc in procs.values():
            _kill(proc)


def _failures(report):
    return "\n\n".join(f"{r['name']} [{r['stage']}]: {r['error']}"
                       for r in report["results"] if not r["ok"])


def test_every_kernel_compiles_and_links_for_sm90(gate_runs):
    rc, report, stderr = gate_runs["positive"]
    assert "setup_error" not in report, report["setup_error"] + "\n" + stderr[-3000:]
    assert rc == 0 and report["ok"], _failures(report)
    assert report["target"] == "sm_90a"
    names = [r["name"] for r in report["results"]]
    assert {"probe_put_fence_signal", "probe_signal_wait_atomics"} <= set(names)
    assert len(names) == len(set(names))
    for r in report["results"]:
        assert r["ok"] and r["cubin_bytes"] > 0, r
        assert 0 < r["registers"] <= 255, r
        assert 0 < r["instructions"] < r["cubin_bytes"] // 16, r
        assert 0 <= r["frame_bytes"] < 1024, r
    # the frame reader finds the stack frames the big senders keep (docs/plans.md's table)
    assert any(r["frame_bytes"] > 0 for r in report["results"]), "no stack frame found in any cubin"


def test_a_stores_build_leaves_no_rma_to_nvshmem(gate_runs):
    """The transport is a build constant (the plan's ``transport``): the stores builds of the bf16
    dispatch_async, of combine_async (both partial formats) and of combine_async_rows move every
    row through the peers' mappings, so their linked code holds no NVSHMEM data transfer (no RMA
    and no put-with-signal, not even a fallback for rows without 16-byte word pairs: a word per
    lane instead), while the puts builds do: dispatch_async puts its rows and publishes them with
    a quiet; combine puts each row with its row flag as the signal (put_signal: the data is
    delivered before the flag), so no quiet. Signals (atomics) stay NVSHMEM's in both."""
    _, report, _ = gate_runs["positive"]
    results = {r["name"]: r for r in report["results"]}

    def moves_data(r):
        return [f for f in r["nvshmem_transfers"] if "rma" in f or "put_signal" in f]

    for kernel, fmt in (("dispatch_async", "bfloat16"), ("combine_async", "bfloat16"),
                        ("combine_async", "bfloat16, f32 partials"), ("combine_async_rows", "bfloat16")):
        stores, puts = results[f"{kernel} [wait/stores, {fmt}]"], results[f"{kernel} [wait/puts, {fmt}]"]
        assert moves_data(stores) == [], stores
        assert moves_data(puts), puts
        for r in (stores, puts):
            assert "nvshmemi_transfer_amo_nonfetch" in r["nvshmem_transfers"], r
        assert "nvshmemi_transfer_quiet" not in stores["nvshmem_transfers"], stores
        if kernel == "dispatch_async":
            assert "nvshmemi_transfer_quiet" in puts["nvshmem_transfers"], puts
        else:
            assert "nvshmemi_transfer_put_signal_dispatch" in puts["nvshmem_transfers"], puts


def test_every_ep_kernel_fits_its_block_size(gate_runs):
    """The runtime launches every EP kernel with GPU_THREADS threads per block: a kernel with
    more registers per thread than a block of that size may hold fails at launch
    (CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES: the FP8 dispatch_async needed 134 at 512 threads).
    kernel_jit caps them; the linked cubins must show it."""
    from ep_runtime.kernels.cuda_api import max_registers_for
    from ep_runtime.core.plan import GPU_THREADS

    _, report, _ = gate_runs["positive"]
    limit = max_registers_for(GPU_THREADS)
    ep = [r for r in report["results"] if r["name"].split(" ")[0] in
          ("dispatch_async", "dispatch_wait", "dispatch_copy", "dispatch_land", "combine_async", "combine_async_rows",
           "combine_wait")]
    assert len(ep) >= 8, [r["name"] for r in report["results"]]
    for r in ep:
        assert r["max_registers"] == limit, r
        assert r["registers"] <= limit, f"{r['name']}: {r['registers']} registers > {limit} ({GPU_THREADS} threads)"


def test_negative_control_fails_for_the_right_reason(gate_runs):
    rc, report, stderr = gate_runs["negative"]
    assert "setup_error" not in report, report["setup_error"] + "\n" + stderr[-3000:]
    assert rc == 1 and not report["ok"]
    results = {r["name"]: r for r in report["results"]}
    assert set(results) == set(EXPECTED_ERRORS)
    for name, needle in EXPECTED_ERRORS.items():
        r = results[name]
        assert not r["ok"], f"{name} compiled: the gate no longer rejects bad SHMEM calls"
        assert needle in (r["error"] or ""), f"{name} failed for another reason:\n{r['error']}"
    assert results["neg_unresolved_extern"]["stage"] == "link"


def test_gate_refuses_the_simulator():
    rc, report, _ = _finish(_start(NUMBA_ENABLE_CUDASIM="1"))
    assert rc == 2 and "NUMBA_ENABLE_CUDASIM" in report["setup_error"]
