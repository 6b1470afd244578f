"""Setup errors a newcomer meets: each names what is missing and the way forward.

- A missing optional dependency raises :class:`MissingDependencyError` (or the compile gate's
  setup error) naming the pip extra of pyproject.toml that installs it, and that extra lists
  the missing package.
- Every ``pip install`` hint in the package's source names extras that exist.
- ``open_session("nvshmem")`` on a machine without a CUDA driver or GPU raises
  :class:`GPUUnavailableError` naming the simulator, before MPI or NVSHMEM start.
"""

from __future__ import annotations

import ast
import importlib
import re
import sys
from pathlib import Path

import pytest

from ep_runtime.tools import compile_gate
from ep_runtime.core.errors import EPError, GPUUnavailableError, MissingDependencyError
from ep_runtime.shmem import gpu_visible, launch, mpi, open_session, require_gpu

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_SOURCES = sorted((ROOT / "ep_runtime").rglob("*.py"))
HINT = re.compile(r'pip install -e "\.\[([a-z0-9_,-]+)\]"|"\.\[([a-z0-9_,-]+)\]"')


def _extras() -> dict[str, list[str]]:
    """Extra name -> its requirement names (lower case, without versions or extras)."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    return {name: [re.split(r"[\[<>=!~; ]", req, maxsplit=1)[0].lower() for req in reqs]
            for name, reqs in extras.items()}


def _named_extras(message: str) -> list[str]:
    return [name for match in HINT.finditer(message) for group in match.groups() if group
            for name in group.split(",")]


def _string_constants(path: Path) -> list[tuple[int, str]]:
    """``(line, text)`` of every string literal of a module; an f-string's literal parts joined."""
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            found.append((node.lineno, "".join(v.value for v in node.values if isinstance(v, ast.Constant))))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            found.append((node.lineno, node.value))
    return found


def test_every_pip_install_hint_in_the_package_names_extras_that_exist():
    extras = _extras()
    hints = [(path.relative_to(ROOT), line, text) for path in PACKAGE_SOURCES
             for line, text in _string_constants(path) if "pip install" in text]
    assert hints, "no install hint found: the scan is broken"
    for where, line, text in hints:
        named = _named_extras(text)
        assert named, f"{where}:{line}: an install hint that names no extra of pyproject.toml: {text!r}"
        unknown = sorted(set(named) - set(extras))
        assert not unknown, f"{where}:{line}: names extras {unknown} that pyproject.toml lacks: {text!r}"


def _without_numba(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "numba" else real(name, *a))


def _run_pes_without_numba(monkeypatch):
    _without_numba(monkeypatch)
    launch.run_pes(launch.new_job_id, 2)


def _mpi_sim_session_without_numba(monkeypatch):
    _without_numba(monkeypatch)
    launch.open_sim_session_from_mpi()


def _mpi_sim_session_without_mpi4py(monkeypatch):
    monkeypatch.setitem(sys.modules, "mpi4py", None)
    launch.open_sim_session_from_mpi()


def _nvshmem_without_cupy(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)
    open_session("nvshmem")


def _torch_module_without_torch(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)
    import ep_runtime.integrations

    for name in ("ep_runtime.torch", "ep_runtime.integrations.torch"):  # (imported by an earlier test, maybe)
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.delattr(ep_runtime.integrations, "torch", raising=False)
    importlib.import_module("ep_runtime.torch")


def _compile_gate_without_bindings(monkeypatch):
    for name in ("NUMBA_ENABLE_CUDASIM", "NUMBA_FORCE_CUDA_CC"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(compile_gate, "nvshmem_numba_bindings_installed", lambda: False)
    compile_gate.check_environment()


@pytest.mark.parametrize("call, error, extra, package", [
    (_run_pes_without_numba, MissingDependencyError, "sim", "numba-cuda"),
    (_mpi_sim_session_without_numba, MissingDependencyError, "sim", "numba-cuda"),
    (_mpi_sim_session_without_mpi4py, MissingDependencyError, "mpi", "mpi4py"),
    (_nvshmem_without_cupy, MissingDependencyError, "gpu", "cupy-cuda13x"),
    (_torch_module_without_torch, MissingDependencyError, "torch", "torch"),
    (_compile_gate_without_bindings, compile_gate.GateSetupError, "test", "nvshmem4py-cu13"),
], ids=["run_pes-numba", "mpiexec-numba", "mpiexec-mpi4py", "nvshmem-cupy", "ep_runtime.torch-torch",
        "compile_gate-nvshmem4py"])
def test_a_missing_dependency_names_the_extra_that_installs_it(monkeypatch, call, error, extra, package):
    with pytest.raises(error) as info:
        call(monkeypatch)
    message = str(info.value)
    assert extra in _named_extras(message), message
    assert package in _extras()[extra], f"extra {extra!r} does not install {package}"
    if error is MissingDependencyError:
        assert isinstance(info.value, ImportError) and isinstance(info.value, EPError)


def test_nvshmem_without_a_gpu_says_so_and_names_the_simulator():
    pytest.importorskip("cupy")
    if gpu_visible():
        pytest.skip("a GPU is visible: this test is for machines without one")
    mpi_was_started = mpi.mpi_initialized()
    with pytest.raises(GPUUnavailableError) as info:
        open_session("nvshmem")
    message = str(info.value)
    assert message.startswith("open_session('nvshmem'): ")
    assert "no CUDA driver or GPU found" in message or "sees no GPU" in message, message
    assert "open_session('sim')" in message and "python -m ep_runtime demo --backend sim" in message
    assert "sim" in _named_extras(message)
    # The check comes first: MPI was not started for a session that cannot open.
    assert mpi.mpi_initialized() == mpi_was_started


def test_require_gpu_reports_hidden_gpus(monkeypatch):
    cupy = pytest.importorskip("cupy")
    monkeypatch.setattr(cupy.cuda.runtime, "getDeviceCount", lambda: 0)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(GPUUnavailableError, match=r"sees no GPU \(CUDA_VISIBLE_DEVICES='' hides them\)"):
        require_gpu("test")


def test_the_bench_plot_without_matplotlib_names_the_extra_before_running(monkeypatch, capsys, tmp_path):
    from ep_runtime.tools.bench.__main__ import main as bench_main

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(SystemExit) as info:
        bench_main(["--plot", str(tmp_path / "bench.png")])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "plot" in _named_extras(err), err
    assert "matplotlib" in _extras()["plot"]
    assert "ep_runtime.tools.bench: [1/" not in err  # refused before any configuration ran
