"""The kernel cache's key: what a linked NVSHMEM kernel depends on, hashed.

The key (:func:`kernel_key`) is a SHA-256 over: the source text of every file of the
``ep_runtime.kernels`` package and of every project module the kernel reaches; the kernel's
qualified name; the values its code can freeze at compile time (closure cells such as the block
size, global constants, captured device functions, recursively, and what it reads through a
project module, such as ``pdl.dependency_wait`` and the ``pdl.ENABLED`` that function reads);
its target options; the argument types; the compute capability; and the versions of numba-cuda,
numba, llvmlite, nvshmem4py, NVSHMEM (its version header), NVRTC, nvJitLink and NVVM. Any change
gives a new key, hence a miss.

:func:`key_material` returns what the key hashes (to see why two keys differ). The cache that
stores kernels under their keys is :mod:`ep_runtime.shmem.kernel_cache`.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import os
import sys
import types as pytypes

import numpy as np

#: Bumped whenever the entry layout or the key recipe changes (old entries then miss).
FORMAT = 1
#: The package whose every source file is part of every key (the kernels and their device code).
KERNEL_PACKAGE = "ep_runtime.kernels"


class NotCacheable(Exception):
    """This kernel cannot be cached safely (it is compiled as usual); the message says why."""


def _file_sha(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _package_files(package: str) -> dict[str, str]:
    """``{module name: sha256 of its source}`` for every ``.py`` file of ``package`` (one level)."""
    import importlib

    mod = importlib.import_module(package)
    out = {}
    for root in getattr(mod, "__path__", []):
        for name in sorted(os.listdir(root)):
            if name.endswith(".py"):
                out[f"{package}.{name[:-3]}"] = _file_sha(os.path.join(root, name))
    return out


def _code_names(code: pytypes.CodeType) -> set[str]:
    """Global names a code object (and the code objects nested in it) may read."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, pytypes.CodeType):
            names |= _code_names(const)
    return names


#: code object -> (sha256 of its function's source text, source file): the functions of every
#: closure a factory makes share one code object, and finding a function's source (tokenizing
#: its file from the first line) is most of a key's cost.
_SOURCE_DIGESTS: dict[pytypes.CodeType, tuple[str, str | None]] = {}


def _source_digest(func, name: str) -> tuple[str, str | None]:
    """``(sha256 of func's source text, its source file)``; :class:`NotCacheable` without one."""
    code = func.__code__
    hit = _SOURCE_DIGESTS.get(code)
    if hit is None:
        try:
            source = inspect.getsource(func)
            path = inspect.getsourcefile(func)
        except (OSError, TypeError) as exc:
            raise NotCacheable(f"no source for {name} ({exc})") from None
        hit = _SOURCE_DIGESTS[code] = (hashlib.sha256(source.encode()).hexdigest(), path)
    return hit


class _Describer:
    """Turns what a kernel's code can freeze at compile time into JSON-able values.

    Functions of the project (module ``ep_runtime*`` or the kernel's own module) are followed:
    their source text, closure cells and the globals their code names. Everything else is named
    by module and qualified name (its code is fixed by the versions in the key).
    """

    def __init__(self, root_module: str):
        self.root_module = root_module
        self.files: dict[str, str] = {}
        self._seen: dict[int, str] = {}

    def _ours(self, module: str | None) -> bool:
        return bool(module) and (module == self.root_module or module == "ep_runtime"
                                 or module.startswith("ep_runtime."))

    def function(self, func) -> dict:
        name = f"{func.__module__}.{func.__qualname__}"
        if id(func) in self._seen:
            return {"ref": name}
        self._seen[id(func)] = name
        source_sha, path = _source_digest(func, name)
        if path:
            self.files[func.__module__] = _file_sha(path)
        out = {"function": name, "source": source_sha}
        if func.__closure__:
            out["closure"] = {var: self.value(cell.cell_contents, strict=True, where=f"{name}:{var}")
                              for var, cell in zip(func.__code__.co_freevars, func.__closure__)}
        glob = func.__globals__
        names = sorted(_code_names(func.__code__))
        out["globals"] = {n: self.value(glob[n], strict=False, where=f"{name}:{n}", attributes=names)
                          for n in names if n in glob}
        return out

    def value(self, v, strict: bool, where: str, attributes=()):
        """A JSON-able description of ``v``. ``strict``: an object we cannot describe by value
        makes the kernel uncacheable (closure cells); otherwise it is named by type (globals).
        A project module is described with those of ``attributes`` (the names the referring
        code uses) it has: code that calls ``pdl.dependency_wait()`` freezes that function, and
        what it reads (``pdl.ENABLED``, set from the environment at import) into the kernel."""
        from ep_runtime.kernels.cuda_api import dispatcher_class, types as nbtypes

        dispatcher_type = dispatcher_class()

        if v is None or isinstance(v, (bool, int, float, str)):
            return [type(v).__name__, v if not isinstance(v, float) else repr(v)]
        if isinstance(v, (bytes, complex)):
            return [type(v).__name__, repr(v)]
        if isinstance(v, np.generic):
            return ["np." + type(v).__name__, repr(v.item())]
        if isinstance(v, np.dtype):
            return ["np.dtype", v.str]
        if isinstance(v, np.ndarray):  # Numba freezes global arrays into the kernel
            return ["np.ndarray", v.dtype.str, list(v.shape),
                    hashlib.sha256(np.ascontiguousarray(v).tobytes()).hexdigest()]
        if isinstance(v, nbtypes.Type):
            return ["numba.type", repr(v)]
        if isinstance(v, (tuple, list, frozenset)):
            items = sorted(v, key=repr) if isinstance(v, frozenset) else v
            return [type(v).__name__, [self.value(x, strict, where) for x in items]]
        if isinstance(v, pytypes.ModuleType):
            if not self._ours(v.__name__):
                return ["module", v.__name__]
            return ["module", v.__name__, {a: self.value(getattr(v, a), strict=False, where=f"{where}.{a}")
                                           for a in attributes if hasattr(v, a)}]
        if isinstance(v, type):  # e.g. a NumPy scalar type such as np.uint32
            return ["class", f"{v.__module__}.{v.__qualname__}"]
        if isinstance(v, dispatcher_type):
            func = v.py_func
            if self._ours(getattr(func, "__module__", None)):
                return ["dispatcher", self.function(func), self.options(v.targetoptions, where)]
            return ["dispatcher", f"{func.__module__}.{func.__qualname__}"]
        if isinstance(v, pytypes.FunctionType):
            if self._ours(v.__module__):
                return ["function", self.function(v)]
            return ["function", f"{v.__module__}.{v.__qualname__}"]
        if strict:
            raise NotCacheable(f"{where} holds a {type(v).__module__}.{type(v).__qualname__}, "
                               f"which the key cannot describe by value")
        t = type(v)
        named = getattr(v, "__qualname__", None) or getattr(v, "__name__", None)
        return ["object", f"{t.__module__}.{t.__qualname__}", str(named) if named else None]

    def options(self, targetoptions: dict, where: str) -> dict:
        out = {}
        for k in sorted(targetoptions):
            val = targetoptions[k]
            if k == "extensions" and val:
                raise NotCacheable(f"{where}: kernels with argument extensions are not cached")
            # code linked in (numba-cuda-mlir's nvshmem4py shim, cuda_api.kernel_jit) is named by type:
            # which of it the kernel uses, its own code (in the key) decides
            strict = k != "link"
            out[k] = self.value(val, strict=strict, where=f"{where}:option {k}")
        return out


@functools.lru_cache(maxsize=1)
def environment_fingerprint() -> dict:
    """Versions of everything that shapes a linked cubin besides our source (computed once)."""
    from importlib.metadata import PackageNotFoundError, version

    env = {"python": f"{sys.version_info[0]}.{sys.version_info[1]}"}
    # the CUDA 13 stack's packages, then the CUDA 12 builds of the same (the gpu-cu12 extra; NVVM
    # is in nvidia-cuda-nvcc-cu12 there), and the second compiler
    for dist in ("numba-cuda", "numba", "llvmlite", "nvshmem4py-cu13", "nvidia-nvshmem-cu13",
                 "cuda-bindings", "cuda-core", "nvidia-cuda-nvrtc", "nvidia-nvjitlink", "nvidia-nvvm",
                 "nvshmem4py-cu12", "nvidia-nvshmem-cu12", "nvidia-cuda-nvrtc-cu12", "nvidia-nvjitlink-cu12",
                 "nvidia-cuda-nvcc-cu12", "numba-cuda-mlir"):
        try:
            env[dist] = version(dist)
        except PackageNotFoundError:
            env[dist] = None
    env["nvshmem_headers"] = _nvshmem_header_version()
    env["toolchain"] = _toolchain_versions()
    try:
        from numba.cuda.core import config

        env["numba_config"] = {k: repr(getattr(config, k, None))
                               for k in ("OPT", "CUDA_ENABLE_NRT", "CUDA_DEBUGINFO_DEFAULT",
                                         "CUDA_DEFAULT_PTX_CC")}
    except ImportError:
        env["numba_config"] = None
    return env


def _nvshmem_header_version():
    """The NVSHMEM version NVRTC compiles the shim against: its version header, hashed (the
    wheel's metadata can disagree with headers laid over it, as on the lent GPU machines)."""
    try:
        from cuda.pathfinder import find_nvidia_header_directory

        path = os.path.join(find_nvidia_header_directory("nvshmem"), "non_abi", "nvshmem_version.h")
        text = open(path, "rb").read()
    except Exception:  # noqa: BLE001 - missing headers: the key says so
        return None
    release = None
    for line in text.decode(errors="replace").splitlines():
        if "NVSHMEM_VENDOR_BASE_VERSION_STRING" in line:
            release = line.split()[-1].strip('"')
    return {"version": release, "sha256": hashlib.sha256(text).hexdigest()}


def _toolchain_versions() -> dict:
    """NVRTC, nvJitLink and NVVM versions as loaded (best effort: None if one cannot be asked)."""
    out = {}
    try:
        from cuda.bindings import nvrtc

        err, major, minor = nvrtc.nvrtcVersion()
        out["nvrtc"] = f"{major}.{minor}"
    except Exception:  # noqa: BLE001
        out["nvrtc"] = None
    try:
        from cuda.bindings import nvjitlink

        out["nvjitlink"] = ".".join(map(str, nvjitlink.version()))
    except Exception:  # noqa: BLE001
        out["nvjitlink"] = None
    try:
        from numba.cuda.cudadrv import nvvm

        out["nvvm"] = ".".join(map(str, nvvm.NVVM().get_version()))
    except Exception:  # noqa: BLE001
        out["nvvm"] = None
    return out


def key_material(dispatcher, argtypes: tuple, cc: tuple, env: dict | None = None) -> dict:
    """Everything :func:`kernel_key` hashes, as a JSON-able dict (useful to see why keys differ).

    Raises :class:`NotCacheable` if the kernel holds something the key cannot describe.
    """
    func = dispatcher.py_func
    d = _Describer(func.__module__)
    code = d.function(func)
    options = d.options(dispatcher.targetoptions, f"{func.__module__}.{func.__qualname__}")
    files = dict(_package_files(KERNEL_PACKAGE))
    files.update(d.files)
    return {
        "format": FORMAT,
        "kernel": f"{func.__module__}.{func.__qualname__}",
        "files": dict(sorted(files.items())),
        "code": code,
        "options": options,
        "argtypes": [repr(t) for t in argtypes],
        "cc": [str(c) for c in cc],
        "env": environment_fingerprint() if env is None else env,
    }


def kernel_key(dispatcher, argtypes: tuple, cc: tuple, env: dict | None = None) -> str:
    """The cache key (64 hex digits) of ``dispatcher`` compiled for ``argtypes`` on ``cc``."""
    blob = json.dumps(key_material(dispatcher, argtypes, cc, env), sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def target_cc() -> tuple:
    """The compute capability numba-cuda links for on the current device: numba-cuda 0.30.4's
    ``CUDACodeLibrary._ensure_cc(None)`` rule (arch-specific ``"a"`` from 9.0 on)."""
    from numba.cuda.cudadrv import devices

    cc = tuple(devices.get_context().device.compute_capability)
    return (cc[0], cc[1], "a" if cc >= (9, 0) else "")
