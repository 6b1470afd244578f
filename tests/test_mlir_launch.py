"""The GPU path of kernels built by numba-cuda-mlir, as far as it runs without a GPU: the GPU checks'
``--compiler`` (tests/gpu/harness.py) selects the compiler or refuses one that is not installed;
the ``nvshmem`` session's precompile path (ep_runtime/shmem/nvshmem_session.py,
ep_runtime/shmem/mlir_launch.py) builds a check's kernels with numba-cuda-mlir, each with NVSHMEM's
module set-up, then asks once for its module to be loaded with arguments of the types it was built
for; that load against a stand-in dispatcher; prebuild's refusal on numba-cuda-mlir.

Each case runs in a fresh interpreter (the compiler is bound once per process). The numba-cuda-mlir
cases need an interpreter with numba-cuda-mlir and nvshmem4py's bindings for it (``.[gpu-mlir]``,
a venv of its own: docs/compilers.md): this one if it has them, else the one
``$EP_RUNTIME_MLIR_PYTHON`` names; they are skipped where there is neither.
"""

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from test_compiler_seam import HIDE_MLIR, run as seam_run

ROOT = Path(__file__).resolve().parents[1]
GPU_TESTS = ROOT / "tests" / "gpu"
#: Names an interpreter with numba-cuda-mlir (``.[gpu-mlir]``) for the cases that build with it.
MLIR_PYTHON_ENV = "EP_RUNTIME_MLIR_PYTHON"


def mlir_python() -> str | None:
    """An interpreter with numba-cuda-mlir: this one, else ``$EP_RUNTIME_MLIR_PYTHON``, else None."""
    if importlib.util.find_spec("numba_cuda_mlir") is not None:
        return sys.executable
    return os.environ.get(MLIR_PYTHON_ENV) or None


def run(code: str, tmp_path: Path, python: str = sys.executable, prelude: str = "") -> dict:
    """Run ``code`` in a fresh ``python`` with the project and tests/gpu on its path (no
    simulator); it prints one JSON line last, returned here."""
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(GPU_TESTS)])
    env["EP_RUNTIME_KERNEL_CACHE"] = "off"
    out = subprocess.run([python, "-c", prelude + "import json\n" + textwrap.dedent(code)], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


# -- the checks' --compiler ------------------------------------------------------------------------------
PARSE = """
    import argparse, contextlib, io
    import harness
    from ep_runtime.kernels import compiler
    ap = argparse.ArgumentParser(prog="ep_check.py")
    harness.add_compiler_option(ap)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args = harness.parse_args(ap, ARGV)
        print(json.dumps({"compiler": args.compiler, "chosen": compiler.chosen()}))
    except SystemExit as exc:
        print(json.dumps({"exit": exc.code, "stderr": err.getvalue()}))
    """


def test_compiler_option_refuses_a_compiler_not_installed_with_its_install_command(tmp_path):
    got = run(PARSE.replace("ARGV", '["--compiler", "numba-cuda-mlir"]'), tmp_path, prelude=HIDE_MLIR)
    assert got["exit"] == 2
    assert ("ep_check.py: error: --compiler numba-cuda-mlir: compiler 'numba-cuda-mlir' is not installed: "
            "pip install -e \".[gpu-mlir]\"") in got["stderr"]


def test_compiler_option_refuses_an_unknown_compiler(tmp_path):
    got = run(PARSE.replace("ARGV", '["--compiler", "nvcc"]'), tmp_path)
    assert got["exit"] == 2 and "argument --compiler: invalid choice: 'nvcc'" in got["stderr"]


def test_compiler_option_selects_numba_cuda(tmp_path):
    got = run(PARSE.replace("ARGV", '["--compiler", "numba-cuda"]'), tmp_path)
    assert got == {"compiler": "numba-cuda", "chosen": "numba-cuda"}


def test_without_the_option_the_installed_compiler_builds(tmp_path):
    got = run(PARSE.replace("ARGV", "[]"), tmp_path, prelude=HIDE_MLIR)
    assert got == {"compiler": None, "chosen": "numba-cuda"}


@pytest.mark.parametrize("script", ["ep_check.py", "fp8_check.py", "graph_check.py"])
def test_the_gpu_checks_take_the_compiler_option(script, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run([sys.executable, str(GPU_TESTS / script), "--help"], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "--compiler {numba-cuda,numba-cuda-mlir}" in out.stdout


# -- numba-cuda-mlir builds through the session's precompile path -----------------------------------------
needs_mlir = pytest.mark.skipif(mlir_python() is None, reason=(
    f"no interpreter with numba-cuda-mlir: install .[gpu-mlir] in a venv of its own and name its python in "
    f"${MLIR_PYTHON_ENV}"))

#: ep_check's layer (tests/gpu/mlir_run.sh: --tokens 1024 64) on 2 GPUs of an NVLink domain; no PDL,
#: as a numba-cuda-mlir session reports (Session.pdl_capable).
PRECOMPILE = """
    from ep_runtime.kernels import compiler
    compiler.select("numba-cuda-mlir")
    from nvshmem.bindings.device.numba_cuda_mlir import _numbast
    from ep_runtime.core.builds import kernel_builds
    from ep_runtime.core.config import EPConfig
    from ep_runtime.core.plan import Topology, choose_plan
    from ep_runtime.shmem import mlir_launch
    from ep_runtime.shmem.nvshmem_session import NvshmemSession
    from ep_runtime.tools.gate_mlir import _fixed_compute_capability, _without_carveout

    cfg = EPConfig(n_ranks=2, n_experts=256, top_k=8, hidden=7168, max_tokens_per_rank=1024)
    plan = choose_plan(cfg, Topology(2, True, 132, False, False))
    loads = []  # what the session asks to load (the load itself needs a GPU)
    mlir_launch.load_module = lambda kernel, argtypes, stream, as_kernel_arg: loads.append(
        (kernel, tuple(argtypes), stream, as_kernel_arg))
    session = NvshmemSession.__new__(NvshmemSession)  # its precompile path, without NVSHMEM or a GPU
    session._numba_stream, session._mlir_loaded = "the session stream", set()
    builds = {}
    for name, kernel, argtypes in kernel_builds(cfg, plan, ONLY):
        # no driver here: numba-cuda-mlir's host compute capability and the carveout it sets through the
        # driver, as the compile gate does (ep_runtime/tools/gate_mlir.py)
        with _fixed_compute_capability((9, 0, "a")), _without_carveout(kernel):
            session.precompile(kernel, argtypes)
            session.precompile(kernel, argtypes)  # as a second runtime of the session does: loaded once
        build = kernel.overloads[tuple(argtypes)]
        builds[name] = {"cubin": len(bytes(build.metadata["cubin"])),
                        "nvshmem_setup": _numbast.shim_obj.setup_callback in kernel._module_setup_callbacks,
                        "loaded": [k is kernel and t == tuple(argtypes) and s == "the session stream" and
                                   a == session.as_kernel_arg for k, t, s, a in loads].count(True)}
    print(json.dumps({"builds": builds, "pdl": plan.pdl}))
    """


@needs_mlir
def test_precompile_builds_ep_checks_kernels_with_numba_cuda_mlir_and_loads_each(tmp_path):
    """dispatch_copy: its NVSHMEM calls are all in device functions (kernel_jit's
    shmem_in_device_functions links the shim); dispatch_wait and combine_wait: the receivers."""
    only = ("dispatch_wait", "dispatch_copy", "combine_wait")
    got = run(PRECOMPILE.replace("ONLY", repr(only)), tmp_path, python=mlir_python())
    assert got["pdl"] is False
    assert sorted(got["builds"]) == sorted(only)
    for name, build in got["builds"].items():
        assert build["cubin"] > 0, name
        assert build["nvshmem_setup"], f"{name}: its build does not run NVSHMEM's module set-up when loaded"
        assert build["loaded"] == 1, f"{name}: two precompiles asked {build['loaded']} times to load its module"


EMPTY_ARGS = """
    from ep_runtime.kernels import compiler
    compiler.select("numba-cuda-mlir")
    import numpy as np
    from numba_cuda_mlir.numba_cuda.typing.typeof import typeof
    from ep_runtime.core.builds import kernel_builds
    from ep_runtime.core.config import EPConfig
    from ep_runtime.core.plan import Topology, choose_plan
    from ep_runtime.shmem import mlir_launch

    cfg = EPConfig(n_ranks=2, n_experts=256, top_k=8, hidden=7168, max_tokens_per_rank=1024)
    plan = choose_plan(cfg, Topology(2, True, 132, False, False))
    same, checked = 0, 0
    for name, kernel, argtypes in kernel_builds(cfg, plan):
        args = mlir_launch.empty_args(argtypes, empty=np.empty)
        same += tuple(typeof(a) for a in args) == tuple(argtypes)
        checked += 1
    try:
        mlir_launch.empty_args((kernel_builds(cfg, plan)[0][2][0].copy(layout="A"),), empty=np.empty)
        refused = None
    except TypeError as exc:
        refused = str(exc)
    print(json.dumps({"same": same, "checked": checked, "refused": refused}))
    """


@needs_mlir
def test_the_empty_arguments_type_as_the_build(tmp_path):
    """The empty arguments that load a build's module type exactly as the build's argument types (the
    dispatcher would otherwise pick, or compile, another build), for every kernel of ep_check's plan."""
    got = run(EMPTY_ARGS, tmp_path, python=mlir_python())
    assert got["checked"] >= 8 and got["same"] == got["checked"]
    assert got["refused"].startswith("argument 0: ") and "neither a C-contiguous array nor an integer" in got["refused"]



def test_prebuild_refuses_where_the_kernels_build_with_numba_cuda_mlir(tmp_path):
    """The kernel cache holds numba-cuda's builds only: prebuild says so instead of failing inside it
    (numba-cuda-mlir replaced by test_compiler_seam's stand-in: nothing is built)."""
    got = seam_run("""
        import contextlib, io
        from ep_runtime.kernels import compiler
        compiler.select("numba-cuda-mlir")
        from ep_runtime.tools import prebuild
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            rc = prebuild.main(["--cc", "9.0a", "--only", "dispatch_wait"])
        print(json.dumps({"rc": rc, "stderr": err.getvalue()}))
        """, tmp_path, stand_in=True)
    assert got["rc"] == 2
    assert got["stderr"].startswith("prebuild: the kernels build with numba-cuda-mlir here, whose builds the kernel "
                                    "cache does not hold")
    assert 'pip install -e ".[sim]"' in got["stderr"]


LOAD_MODULE = """
    import logging
    from ep_runtime.kernels import compiler
    compiler.select("numba-cuda-mlir")
    from numba_cuda_mlir.numba_cuda.cudadrv import devices
    from ep_runtime.kernels.cuda_api import types
    from ep_runtime.shmem import mlir_launch

    class Context:  # what load_module reads of numba-cuda-mlir's context: the modules it loaded
        modules = {}

    devices.get_context = lambda: Context

    def dispatch_wait():
        pass

    class Kernel:
        '''A dispatcher whose launch records its arguments, loads a module or not, then raises.'''
        def __init__(self, loads, error):
            self.loads, self.error, self.launches = loads, error, []
            self._module_setup_callbacks = ["NVSHMEM's set-up"]
            self.py_func = dispatch_wait
        def __getitem__(self, config):
            def launch(*args):
                self.launches.append((config, [type(a).__name__ for a in args]))
                if self.loads:
                    Context.modules[len(Context.modules)] = "a module"
                raise RuntimeError(self.error)
            return launch

    warnings = []
    logging.getLogger("ep_runtime.shmem").addHandler(type("H", (logging.Handler,), {
        "emit": lambda self, record: warnings.append(record.getMessage()) if record.levelno >= logging.WARNING
        else None})())
    out = {}
    refused = "Failed to launch CUDA kernel: CUDA_ERROR_INVALID_VALUE (invalid argument)"
    for case, loads, error in (("loaded", True, refused), ("not loaded", False, refused),
                               ("other error", True, "Failed to load CUDA library from binary data: bad")):
        kernel, before = Kernel(loads, error), len(warnings)
        try:
            mlir_launch.load_module(kernel, (types.int64, types.int32), "the stream", lambda a: a)
            raised = None
        except RuntimeError as exc:
            raised = str(exc)
        out[case] = {"launches": kernel.launches, "raised": raised, "warnings": warnings[before:]}
    print(json.dumps(out))
    """


@needs_mlir
def test_load_module_expects_the_empty_grid_refused_and_warns_when_no_module_loaded(tmp_path):
    got = run(LOAD_MODULE, tmp_path, python=mlir_python())
    launch = [[[0, 1, 1], [1, 1, 1], "the stream"], ["int64", "int32"]]
    assert got["loaded"] == {"launches": [launch], "raised": None, "warnings": []}
    assert got["not loaded"]["raised"] is None and got["not loaded"]["launches"] == [launch]
    assert got["not loaded"]["warnings"] == [
        "dispatch_wait: the launch of an empty grid loaded no module: its first launch will load it and run NVSHMEM's "
        "module set-up, which a CUDA graph capture does not allow"]
    assert got["other error"]["raised"] == "Failed to load CUDA library from binary data: bad"
