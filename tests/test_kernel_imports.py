"""Device code depends on nothing of the host's policy: every module of ``ep_runtime/kernels/`` imports only
the standard library, the CUDA toolchain's Python packages, its own package (with the leaf
``ep_runtime.kernels.protocol`` of constants shared with the host) and ``ep_runtime.core.errors``;
the simulator's SHMEM backend alone also reaches the simulated heap it runs on."""

import ast
import pathlib
import sys

KERNELS = pathlib.Path(__file__).resolve().parents[1] / "ep_runtime" / "kernels"
#: Third-party packages device code may import.
TOOLCHAIN = {"numba", "numba_cuda_mlir", "llvmlite", "numpy", "cffi", "nvshmem", "cuda"}
#: Project modules outside the kernels package that a kernel module may import, per module.
ALLOWED_PROJECT = {"ep_runtime.core.errors"}
SIM_BACKEND = {"_shmem_sim.py": {"ep_runtime.shmem.sim_heap"}}


def imported_modules(path: pathlib.Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: inside the kernels package
                names.add("ep_runtime.kernels" + ("." + node.module if node.module else ""))
            else:
                names.add(node.module)
    return names


def test_kernels_import_only_the_protocol_leaf_and_the_toolchain():
    bad = {}
    for path in sorted(KERNELS.glob("*.py")):
        allowed = ALLOWED_PROJECT | SIM_BACKEND.get(path.name, set())
        for mod in imported_modules(path):
            top = mod.split(".")[0]
            if mod.startswith("ep_runtime.kernels") or mod in allowed:
                continue
            if top in TOOLCHAIN or top in sys.stdlib_module_names:
                continue
            bad.setdefault(path.name, []).append(mod)
    assert not bad, f"kernel modules import host policy: {bad}"


def test_the_protocol_module_is_a_leaf():
    mods = imported_modules(KERNELS / "protocol.py")
    assert not {m for m in mods if m.startswith("ep_runtime")}, mods


def test_the_rule_catches_a_host_import(tmp_path):
    bad = tmp_path / "k.py"
    bad.write_text("from ep_runtime.core.layout import PEER_TOKENS\nimport ep_runtime.core.config\n")
    assert imported_modules(bad) == {"ep_runtime.core.layout", "ep_runtime.core.config"}
