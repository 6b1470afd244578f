"""Programmatic dependent launch switch (kernels/pdl.py): the environment variable, the kernel
marks the fast launcher reads, and the kernels' waits (on the simulator PDL is off: the
instructions compile to nothing and the results stay exact, which test_ep_sim checks)."""

import pytest

from ep_runtime.errors import EPConfigError
from ep_runtime.kernels import pdl


@pytest.mark.parametrize("value, cc_major, expected", [
    ("auto", 9, True), ("auto", 10, True), ("auto", 8, False), ("auto", 0, False),  # 0: no GPU to ask
    ("1", 8, True), ("on", 0, True), ("0", 9, False), ("off", 10, False)])
def test_the_switch_follows_the_variable_and_the_device(monkeypatch, value, cc_major, expected):
    monkeypatch.setenv(pdl.ENV, value)
    monkeypatch.setattr(pdl, "SIMULATED", False)
    monkeypatch.setattr(pdl, "_device_cc_major", lambda: cc_major)
    assert pdl._enabled() is expected


@pytest.mark.parametrize("value", ["auto", "1"])
def test_the_simulator_never_enables_pdl(monkeypatch, value):
    monkeypatch.setenv(pdl.ENV, value)
    monkeypatch.setattr(pdl, "SIMULATED", True)
    monkeypatch.setattr(pdl, "_device_cc_major", lambda: 9)
    assert pdl._enabled() is False


@pytest.mark.parametrize("value", ["2", "maybe", "enable"])
def test_a_bad_value_is_a_config_error_naming_the_variable(monkeypatch, value):
    monkeypatch.setenv(pdl.ENV, value)
    with pytest.raises(EPConfigError) as info:
        pdl._enabled()
    assert pdl.ENV in str(info.value) and repr(value) in str(info.value)


def test_the_ep_kernels_are_marked_and_others_are_not(monkeypatch):
    from ep_runtime.kernels.combine import make_combine_kernels
    from ep_runtime.kernels.dispatch import make_dispatch_kernels
    import numpy as np

    dispatch_async, dispatch_wait, dispatch_copy, dispatch_signal, dispatch_land = make_dispatch_kernels(8)
    kernels = [dispatch_async, dispatch_wait, dispatch_copy, dispatch_land]
    kernels += list(make_combine_kernels(8, np.uint64))
    # dispatch_signal follows the join with the copy stream (an event wait): never with PDL
    assert not pdl.is_programmatic(dispatch_signal)
    assert all(hasattr(k, pdl.MARK) for k in kernels)
    # the mark follows ENABLED (as this process found it): launchers get the attribute only then
    assert all(pdl.is_programmatic(k) == pdl.ENABLED for k in kernels)
    monkeypatch.setattr(pdl, "ENABLED", True)

    class Kernel:
        pass

    marked, unmarked = pdl.programmatic(Kernel()), Kernel()
    assert pdl.is_programmatic(marked) and not pdl.is_programmatic(unmarked)


def test_every_ep_kernel_waits_before_its_first_status_read():
    """The wait must come before anything stream-ordered is read: in the kernels' source every
    ``status[STATUS_CODE]`` check (each kernel's first load) follows a dependency_wait. The
    receiving dispatch kernels trigger their dependents first; dispatch_async and the
    combine_async kernels after their wait (the receiver may then start early: docs/protocol.md,
    "Dispatch rows as they land", "Combine rows as they land"); dispatch_land never waits
    first (its work reads only what the previous calls completed and what peers signal) and
    waits before it exits, as does a placing build's dispatch_wait (``await_placed``, v27) and a
    route-first build's (``place_from_routing``, v29, and its copy, v30);
    combine_wait skips its first wait only in a call with flagged rows, and then waits before
    it exits."""
    import inspect

    from ep_runtime.kernels import combine, dispatch

    def first_status_reads(lines):
        """Lines that read the error word first in a kernel: the check itself, or the load of
        ``code`` that a prologue issues together with the call counter's before its branch."""
        return [i for i, ln in enumerate(lines)
                if "if status[STATUS_CODE] != 0:" in ln or ln.strip().startswith("code = status[STATUS_CODE]")]

    def before(lines, i, back):
        """The ``back``-th line of code (comments and blank lines skipped) before line ``i``."""
        code = [ln for ln in lines[:i] if ln.strip() and not ln.strip().startswith("#")]
        return code[-back]

    lines = inspect.getsource(dispatch).splitlines()
    checks = first_status_reads(lines)
    assert len(checks) == 6
    kernel_of = {i: next(ln for ln in reversed(lines[:i]) if ln.strip().startswith("def ")).split("(")[0].split()[-1]
                 for i in checks}
    assert sorted(kernel_of.values()) == sorted(["dispatch_async", "dispatch_signal", "dispatch_wait", "land_rows",
                                                 "dispatch_copy", "await_placed"]), kernel_of
    for i, name in kernel_of.items():
        if name == "await_placed":  # a placing dispatch_wait's body: called before its wait, which follows it
            start = next(j for j, ln in enumerate(lines) if ln.strip().startswith("def dispatch_wait("))
            call = next(j for j in range(start, len(lines)) if lines[j].strip().startswith("await_placed("))
            assert "pdl.dependency_wait()" not in "".join(lines[start:call])
            assert lines[call + 1].strip().startswith("pdl.dependency_wait()"), lines[call + 1]
            assert lines[call + 2].strip() == "return", lines[call + 2]
        elif name == "dispatch_async":
            assert "pdl.trigger_dependents()" in before(lines, i, 1), f"dispatch line {i + 1}"
            assert "pdl.dependency_wait()" in before(lines, i, 2), f"dispatch line {i + 1}"
        elif name == "land_rows":  # dispatch_land's body: no wait before it, one after it
            start = next(j for j, ln in enumerate(lines) if ln.strip().startswith("def dispatch_land("))
            end = next(j for j in range(start, len(lines)) if lines[j].strip().startswith("land_rows("))
            body = [ln.strip() for ln in lines[start:end]]
            assert "pdl.trigger_dependents()" in body and "pdl.dependency_wait()" not in body
            nxt = next(ln.strip() for ln in lines[end + 1:] if ln.strip().startswith(("pdl.", "return", "if ", "for ")))
            assert nxt.startswith("pdl.dependency_wait()"), nxt
        elif name == "dispatch_wait":  # after its placing build's branch (above), it reads only an
            # earlier call's error and its call number, waits for the signals, then for its predecessor
            assert before(lines, i, 4).strip().startswith("if EARLY:"), before(lines, i, 4)
            assert "pdl.trigger_dependents()" in before(lines, i, 5), f"dispatch line {i + 1}"
            assert "n = land_sync[LAND_CALLS]" in lines[i + 1], lines[i + 1]
            body = [ln.strip() for ln in lines[i:]]
            sig = next(j for j, ln in enumerate(body) if ln.startswith("ok = await_sources("))
            assert "pdl.dependency_wait()" in body[sig + 2], body[sig + 2]
            waits = [j for j in range(sig) if body[j].startswith("pdl.dependency_wait()")]
            # before the signals: on an earlier call's error, or after a route-first build's
            # placement (v29: it reads only what the routing and dispatch signals publish) and
            # its copy (v30: what the placing block published; the batch's previous readers
            # completed before this call's dispatch_async let this kernel start)
            first = next(j for j, ln in enumerate(body) if ln.startswith("if FIRST:"))
            placed = next(j for j in range(first, sig) if body[j].startswith("ok = place_from_routing("))
            copied = next(j for j in range(placed, sig) if body[j].startswith("expand_rows_in_wait("))
            # (the copying blocks also wait first, idle while dispatch_async sends)
            idle = [j for j in waits if body[j - 1].startswith("else:") and placed < j < copied]
            assert len(idle) == 1, idle
            assert all(body[j + 1] == "return" and (body[j - 1] == "if code != 0:" or first < placed < copied < j
                                                    < first + 40) for j in waits if j not in idle), waits
        else:
            assert "pdl.dependency_wait()" in before(lines, i, 1), f"dispatch line {i + 1}"
            assert "pdl.trigger_dependents()" in before(lines, i, 2), f"dispatch line {i + 1}"

    lines = inspect.getsource(combine).splitlines()
    checks = first_status_reads(lines)
    assert len(checks) == 3
    for i in checks[:2]:  # combine_async, combine_async_rows
        assert "pdl.trigger_dependents()" in lines[i - 1], f"combine line {i + 1}"
        assert "pdl.dependency_wait()" in lines[i - 2], f"combine line {i + 1}"
    i = checks[2]  # combine_wait
    assert lines[i - 2].strip() == "if not flagged:" and "pdl.dependency_wait()" in lines[i - 1], lines[i - 2:i]
    assert "pdl.dependency_wait()" in lines[i + 1], "combine_wait's early return must wait first"
    body = lines[i:]
    end = next(j for j, ln in enumerate(body) if "return pdl.programmatic(combine_async)" in ln)
    last_wait = max(j for j, ln in enumerate(body[:end]) if "pdl.dependency_wait()" in ln)
    assert "stamp_last(status, 22)" in body[last_wait - 1], "combine_wait must wait for combine_async last"


@pytest.mark.parametrize("value, present", [("1", True), ("0", False)])
def test_the_instructions_are_compiled_in_exactly_when_enabled(value, present):
    """PTX for sm_90 of a kernel that calls the two functions (compiled in a fresh interpreter:
    ENABLED is fixed when the module is imported), with the compile gate's stand-in for the
    missing driver."""
    import os
    import subprocess
    import sys

    code = (
        "from numba import cuda\n"
        "from ep_runtime.compile_gate import _fixed_compute_capability\n"
        "from ep_runtime.kernels import pdl\n"
        "def k(a):\n"
        "    pdl.trigger_dependents()\n"
        "    pdl.dependency_wait()\n"
        "    a[0] = 1\n"
        "with _fixed_compute_capability():\n"
        "    ptx, _ = cuda.compile_ptx(k, 'void(int32[:])', cc=(9, 0))\n"
        "print('griddepcontrol.wait;' in ptx, 'griddepcontrol.launch_dependents;' in ptx)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env[pdl.ENV] = value
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-2:] == [str(present), str(present)], out.stdout
