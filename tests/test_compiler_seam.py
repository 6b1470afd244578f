"""The compiler seam (ep_runtime/kernels/compiler.py, cuda_api.py): the kernels build with numba-cuda or
numba-cuda-mlir, chosen once per process, explicitly or by the package installed.

Each case runs in a fresh interpreter: the choice is bound when ``cuda_api`` is first imported.
numba-cuda-mlir is replaced where a case needs it present (a package of the same name whose
``cuda`` and ``types`` are marker objects: the seam must hand those to the kernels) or absent (an
import hook hides it), so the cases run alike whether or not it is installed here.
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: A numba-cuda-mlir stand-in: what cuda_api reads of the package, as objects the test can recognise.
STAND_IN = {
    "__init__.py": textwrap.dedent("""\
        from types import SimpleNamespace
        cuda = SimpleNamespace(name="stand-in cuda", jit=lambda *a, **k: None)
        types = SimpleNamespace(**{n: "stand-in " + n for n in
                                   ("int32", "int64", "uint8", "uint16", "uint32", "uint64", "float32")})
        """),
    "numba_cuda/__init__.py": "",
    "numba_cuda/np/__init__.py": "",
    "numba_cuda/np/numpy_support.py": "def from_dtype(dtype):\n    return 'stand-in ' + str(dtype)\n",
}

#: An import hook that makes numba_cuda_mlir absent.
HIDE_MLIR = textwrap.dedent("""\
    import importlib.abc, sys
    class _Hide(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "numba_cuda_mlir" or name.startswith("numba_cuda_mlir."):
                raise ModuleNotFoundError(name)
            return None
    sys.meta_path.insert(0, _Hide())
    """)


def run(code: str, tmp_path: Path, stand_in: bool = False, hide: bool = False, simulate: bool = False) -> dict:
    """Run ``code`` in a fresh interpreter; it prints one JSON line, returned here."""
    path = [str(ROOT)]
    if stand_in:
        for rel, text in STAND_IN.items():
            f = tmp_path / "numba_cuda_mlir" / rel
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_text(text)
        path.insert(0, str(tmp_path))
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    if simulate:
        env["NUMBA_ENABLE_CUDASIM"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(path)
    prelude = (HIDE_MLIR if hide else "") + "import json\n"
    out = subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_numba_cuda_mlir_when_asked(tmp_path):
    got = run("""
        from ep_runtime.kernels import compiler
        compiler.select("numba-cuda-mlir")
        from ep_runtime.kernels import cuda_api
        print(json.dumps({"compiler": cuda_api.COMPILER, "mlir": cuda_api.MLIR, "simulated": cuda_api.SIMULATED,
                          "cuda": cuda_api.cuda.name, "uint64": cuda_api.uint64,
                          "from_dtype": cuda_api.from_dtype("u8")}))
        """, tmp_path, stand_in=True)
    assert got == {"compiler": "numba-cuda-mlir", "mlir": True, "simulated": False, "cuda": "stand-in cuda",
                   "uint64": "stand-in uint64", "from_dtype": "stand-in u8"}


def test_numba_cuda_by_default_where_both_are_installed(tmp_path):
    got = run("""
        import numba
        from ep_runtime.kernels import cuda_api
        print(json.dumps({"compiler": cuda_api.COMPILER, "mlir": cuda_api.MLIR,
                          "numba_types": cuda_api.uint64 is numba.uint64 and cuda_api.int32 is numba.int32,
                          "numba_cuda": cuda_api.cuda is numba.cuda}))
        """, tmp_path, stand_in=True)
    assert got == {"compiler": "numba-cuda", "mlir": False, "numba_types": True, "numba_cuda": True}


def test_asking_for_numba_cuda_mlir_where_it_is_absent_names_the_extra(tmp_path):
    got = run("""
        from ep_runtime.core.errors import MissingDependencyError
        from ep_runtime.kernels import compiler
        try:
            compiler.select("numba-cuda-mlir")
        except MissingDependencyError as exc:
            print(json.dumps({"error": str(exc)}))
        """, tmp_path, hide=True)
    assert got["error"] == "compiler 'numba-cuda-mlir' is not installed: pip install -e \".[gpu-mlir]\""


def test_the_gate_asked_for_numba_cuda_mlir_where_it_is_absent_cannot_run(tmp_path):
    got = run("""
        import contextlib, io
        from ep_runtime.tools import compile_gate
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            rc = compile_gate.main(["--compiler", "numba-cuda-mlir", "--only", "probe_put_fence_signal"])
        print(json.dumps({"rc": rc, "stderr": err.getvalue()}))
        """, tmp_path, hide=True)
    assert got["rc"] == 2
    assert "compiler 'numba-cuda-mlir' is not installed" in got["stderr"] and ".[gpu-mlir]" in got["stderr"]


def test_the_choice_is_fixed_once_the_kernels_are_imported(tmp_path):
    got = run("""
        from ep_runtime.core.errors import EPStateError
        from ep_runtime.kernels import compiler, cuda_api
        compiler.select("numba-cuda")  # the compiler bound: nothing to do
        try:
            compiler.select("numba-cuda-mlir")
        except EPStateError as exc:
            print(json.dumps({"bound": cuda_api.COMPILER, "error": str(exc)}))
        """, tmp_path, stand_in=True)
    assert got["bound"] == "numba-cuda"
    assert got["error"].startswith("the kernels of this process are already built with numba-cuda: select the "
                                   "compiler before importing any ep_runtime.kernels module")


def test_an_unknown_compiler_is_refused_with_the_choices(tmp_path):
    got = run("""
        from ep_runtime.core.errors import EPConfigError
        from ep_runtime.kernels import compiler
        try:
            compiler.select("nvcc")
        except EPConfigError as exc:
            print(json.dumps({"error": str(exc)}))
        """, tmp_path)
    assert got["error"] == "compiler 'nvcc' is not one of ['numba-cuda', 'numba-cuda-mlir']: name one of them"


def test_the_simulator_stays_numba_cudas(tmp_path):
    got = run("""
        from ep_runtime.core.errors import EPConfigError
        from ep_runtime.kernels import compiler
        compiler.select("numba-cuda-mlir")
        try:
            from ep_runtime.kernels import cuda_api
        except EPConfigError as exc:
            print(json.dumps({"error": str(exc)}))
        """, tmp_path, stand_in=True, simulate=True)
    assert "numba-cuda-mlir has no simulator" in got["error"] and "select numba-cuda to simulate" in got["error"]


def test_kernel_source_reaches_the_compiler_only_through_the_seam():
    """No kernel module outside the compilers' backends imports numba itself at module level:
    the scalar types, ``cuda`` and the signatures' types come from cuda_api, so the source the
    simulator runs is the source numba-cuda-mlir builds."""
    import ast

    backends = {"cuda_api.py", "_shmem_nvshmem.py", "_shmem_sim.py", "mlir_intrinsics.py", "_shmem_nvshmem_mlir.py"}
    offenders = []
    for path in sorted((ROOT / "ep_runtime" / "kernels").rglob("*.py")):
        if path.name in backends:
            continue
        for node in ast.parse(path.read_text()).body:  # module level only: compiler branches nest
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(n == "numba" or n.startswith("numba.") for n in names):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not offenders, f"kernel modules importing numba directly: {offenders}"
