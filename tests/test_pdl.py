"""Programmatic dependent launch (ep_runtime/kernels/pdl.py): the plan's ``pdl`` field builds the kernels with
or without the two instructions, marks them for the fast launcher, and every EP kernel waits for
its predecessor before it reads anything that kernel wrote (on the simulator PDL is off: the
instructions compile to nothing and the results stay exact, which the simulator tests check)."""

import dataclasses
import inspect

import pytest

from ep_runtime.core.config import EPConfig
from ep_runtime.kernels import pdl
from ep_runtime.core.plan import Topology, choose_plan


def test_one_pair_of_device_functions_per_setting():
    assert pdl.make_pdl(True) is pdl.make_pdl(True)
    assert pdl.make_pdl(True) != pdl.make_pdl(False)


@pytest.mark.parametrize("on", [True, False])
def test_the_plans_kernels_are_marked_as_the_plan_says(on):
    from ep_runtime.core.builds import plan_kernels

    cfg = EPConfig(n_ranks=2, n_experts=8, top_k=2, hidden=64, max_tokens_per_rank=4096)
    plan = dataclasses.replace(choose_plan(cfg, Topology.nvlink_gpus(2)), pdl=on)
    kernels = plan_kernels(cfg, plan)
    assert {"dispatch_async", "dispatch_land", "combine_async", "combine_async_rows", "combine_wait"} <= set(kernels)
    for name, kernel in kernels.items():
        assert pdl.is_programmatic(kernel) == (on and name != "validate_routing"), name

    class Kernel:
        pass

    assert pdl.is_programmatic(pdl.programmatic(Kernel(), True)) and not pdl.is_programmatic(Kernel())


def _body(fn) -> list[str]:
    """The lines of a kernel's Python function (its dispatcher's), stripped, comments dropped."""
    src = inspect.getsource(fn.py_func).splitlines()
    return [ln.split("#")[0].strip() for ln in src if ln.split("#")[0].strip()]


def _kernels():
    from ep_runtime.core.builds import plan_kernels

    cfg = EPConfig(n_ranks=2, n_experts=8, top_k=2, hidden=64, max_tokens_per_rank=4096)
    land = plan_kernels(cfg, choose_plan(cfg, Topology.nvlink_gpus(2)))
    first = plan_kernels(cfg, choose_plan(cfg, Topology.nvlink_gpus(2), {"receiver": "route_first"}))
    return {**land, "dispatch_wait": first["dispatch_wait"], "dispatch_copy": first.get("dispatch_copy")}


@pytest.mark.parametrize("name", ["dispatch_async", "dispatch_copy", "combine_async", "combine_async_rows"])
def test_the_senders_wait_before_their_first_read(name):
    """A kernel that reads what its predecessor wrote waits first (``pdl_wait`` before the first
    ``status`` read); dispatch_async and combine_async trigger their dependents after the wait,
    so a receiver started early finds everything before them complete."""
    from ep_runtime.kernels.codecs import WORDS
    from ep_runtime.kernels.layouts.expanded import make_dispatch_copy

    kernel = _kernels()[name] or make_dispatch_copy(512, WORDS, True)
    body = _body(kernel)
    first_read = next(i for i, ln in enumerate(body) if "status[STATUS_CODE]" in ln)
    waits = [i for i, ln in enumerate(body) if ln == "pdl_wait()"]
    triggers = [i for i, ln in enumerate(body) if ln == "pdl_trigger()"]
    assert waits and waits[0] < first_read, (name, body[:first_read + 1])
    assert triggers and triggers[0] < first_read
    if name != "dispatch_copy":
        assert waits[0] < triggers[0], f"{name} triggers before its own wait"


@pytest.mark.parametrize("name", ["dispatch_wait", "dispatch_land", "combine_wait"])
def test_the_receivers_wait_before_they_end(name):
    """A receive kernel starts early and reads only what completed before its predecessor
    started (its call number, an earlier call's error) and what peers signal; it triggers its
    dependents first and waits for its predecessor on every way out, so stream order holds for
    what follows."""
    fn = _kernels()[name].py_func
    src = [ln.split("#")[0].rstrip() for ln in inspect.getsource(fn).splitlines()]
    src = [ln for ln in src if ln.strip()]
    body = [ln.strip() for ln in src]
    top = min(len(ln) - len(ln.lstrip()) for ln in src[1:] if not ln.strip().startswith(("def ", '"""')))
    assert "pdl_trigger()" in body[:body.index("pdl_wait()")], name
    # a wait at the kernel's top level: every way out after it has waited
    top_wait = next((i for i, ln in enumerate(src) if ln == " " * top + "pdl_wait()"), len(src))
    for i, ln in enumerate(body):
        if ln == "return" and i < top_wait:  # an early way out waits itself
            assert body[i - 1] == "pdl_wait()", (name, body[i - 3:i + 1])
    assert top_wait < len(src), f"{name} has no wait at its top level"


@pytest.mark.parametrize("enabled", [True, False])
def test_the_instructions_are_compiled_in_exactly_when_enabled(enabled):
    """PTX for sm_90 of a kernel that calls the two functions, with the compile gate's stand-in
    for the missing driver (a fresh interpreter: the simulator may be on in this one)."""
    import os
    import subprocess
    import sys

    code = (
        "from numba import cuda\n"
        "from ep_runtime.tools.compile_gate import _fixed_compute_capability\n"
        "from ep_runtime.kernels.pdl import make_pdl\n"
        f"pdl_wait, pdl_trigger = make_pdl({enabled})\n"
        "def k(a):\n"
        "    pdl_trigger()\n"
        "    pdl_wait()\n"
        "    a[0] = 1\n"
        "with _fixed_compute_capability():\n"
        "    ptx, _ = cuda.compile_ptx(k, 'void(int32[:])', cc=(9, 0))\n"
        "print('griddepcontrol.wait;' in ptx, 'griddepcontrol.launch_dependents;' in ptx)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-2:] == [str(enabled), str(enabled)], out.stdout
