"""On-disk cache of linked NVSHMEM kernels, so a second start does not compile them again.

Why our own cache: numba-cuda refuses ``cache=True`` for kernels that link files
(``CUDACodeLibrary._reduce_states``: "Cannot pickle CUDACodeLibrary with linking files"), and every
kernel that calls NVSHMEM links nvshmem4py's NVRTC shim. What a launch needs after the link is
plain, though: the linked cubin, the kernel's entry name, whether it launches cooperatively, and
the module setup callbacks (for nvshmem4py, ``nvshmem.core.library_init`` of the loaded module).

One entry per (kernel, argument types, device): a file ``<key>.cubin`` in the cache directory
(``$EP_RUNTIME_KERNEL_CACHE``, default ``~/.cache/ep_runtime/kernels``; ``off`` disables it)::

    MAGIC                       b"EPRT-KCACHE\\n"
    header                      one line of JSON: format, key, sha256 and size of the payload,
                                entry name, cooperative, cc, setup/teardown callbacks by name, ...
    payload                     the linked cubin (bytes)

The key (:func:`~ep_runtime.shmem.cache_key.kernel_key`) is a SHA-256 over the kernel's source and
what its code can freeze at compile time, its argument types, the compute capability and the
versions of the toolchain (:mod:`ep_runtime.shmem.cache_key` lists them): any change gives a new
key, hence a miss.

Reading (:meth:`KernelCache.read`) checks the magic, the header, the key, the size and the
checksum; an entry that fails any check is deleted, logged with the reason, and the kernel is
compiled and stored again. Writes go to a temporary file in the same directory and are renamed
into place, so ranks sharing a machine never see half an entry.

The rebuilt kernel is numba-cuda 0.30.4's own ``_Kernel`` (``_Kernel._rebuild``) around a
``CUDACodeLibrary`` (``CUDACodeLibrary._rebuild``) whose only content is the cubin, with the
original setup and teardown callbacks; it is bound (module loaded, setup run) before it is
installed as the dispatcher's overload, so ``kernel[grid, block, stream](*args)`` launches it.
Private numba-cuda API: pinned in pyproject.toml, like the compile gate.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import tempfile
import time
from pathlib import Path

from ep_runtime.shmem import shim_memo
from ep_runtime.shmem.cache_key import FORMAT, NotCacheable, kernel_key, target_cc

log = logging.getLogger("ep_runtime.shmem.kernel_cache")

#: Environment variable naming the cache directory (``off``, ``0`` or ``none`` disable the cache).
CACHE_ENV = "EP_RUNTIME_KERNEL_CACHE"
DEFAULT_DIR = Path("~/.cache/ep_runtime/kernels")
MAGIC = b"EPRT-KCACHE\n"
SUFFIX = ".cubin"
_DISABLED = ("off", "0", "none", "false", "no")


class CacheEntryError(Exception):
    """A cache entry is unusable: corrupt, truncated, stale or unreadable (``reason`` says which)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


# ------------------------------------------------------------------------------------------------
# entries


@dataclasses.dataclass
class CacheEntry:
    """One cached kernel: its key, its linked cubin and what a launch needs besides."""

    key: str
    cubin: bytes
    #: entry_name, name, cooperative, cc, setup, teardown, lineinfo, max_registers, nvvm_options,
    #: lto, shared_memory_carveout, kernel, argtypes (see :func:`entry_from_kernel`)
    meta: dict

    def encode(self) -> bytes:
        header = dict(self.meta, format=FORMAT, key=self.key, payload_bytes=len(self.cubin),
                      sha256=hashlib.sha256(self.cubin).hexdigest())
        return MAGIC + json.dumps(header, sort_keys=True).encode() + b"\n" + self.cubin

    @classmethod
    def decode(cls, data: bytes, key: str) -> "CacheEntry":
        """Parse and check an entry read for ``key``; raises :class:`CacheEntryError`."""
        if not data.startswith(MAGIC):
            raise CacheEntryError("not a kernel cache entry (bad magic)")
        end = data.find(b"\n", len(MAGIC))
        if end < 0:
            raise CacheEntryError("truncated (no complete header)")
        try:
            header = json.loads(data[len(MAGIC):end])
        except ValueError as exc:
            raise CacheEntryError(f"corrupt header ({exc})") from None
        if not isinstance(header, dict):
            raise CacheEntryError("corrupt header (not an object)")
        if header.get("format") != FORMAT:
            raise CacheEntryError(f"stale: entry format {header.get('format')!r}, this code reads {FORMAT}")
        if header.get("key") != key:
            raise CacheEntryError(f"stale: entry key {str(header.get('key'))[:16]}... does not match "
                                  f"{key[:16]}...")
        payload = data[end + 1:]
        want = header.get("payload_bytes")
        if not isinstance(want, int) or len(payload) != want:
            raise CacheEntryError(f"truncated: payload has {len(payload)} bytes, header says {want}")
        if hashlib.sha256(payload).hexdigest() != header.get("sha256"):
            raise CacheEntryError("corrupt: checksum mismatch")
        for field in ("entry_name", "cooperative", "cc", "setup", "teardown"):
            if field not in header:
                raise CacheEntryError(f"corrupt header (no {field!r})")
        meta = {k: v for k, v in header.items() if k not in ("format", "key", "payload_bytes", "sha256")}
        return cls(key, payload, meta)


def _callback_names():
    """Known module setup/teardown callbacks, by name (only nvshmem4py's, so far)."""
    try:
        from nvshmem.bindings.device.numba import _numbast
    except ImportError:
        return {}
    return {"nvshmem": (_numbast.shim_obj.setup_callback, _numbast.shim_obj.teardown_callback)}


def entry_from_kernel(kernel, key: str, cc: tuple) -> CacheEntry:
    """The entry of a compiled (linked) numba-cuda ``_Kernel`` for ``cc``.

    Raises :class:`NotCacheable` for what a cubin alone cannot reproduce: debug kernels (their
    exception reporting needs the compiler's call helper), argument extensions, launch-config
    sensitive kernels, captured objects, and setup callbacks other than nvshmem4py's.
    """
    lib = kernel.library
    name = getattr(lib, "name", "?")
    if kernel.debug:
        raise NotCacheable(f"{name}: debug kernels are not cached")
    if kernel.extensions:
        raise NotCacheable(f"{name}: kernels with argument extensions are not cached")
    if getattr(kernel, "launch_config_sensitive", False):
        raise NotCacheable(f"{name}: launch-config-sensitive kernels are not cached")
    if lib.referenced_objects:
        raise NotCacheable(f"{name}: the kernel keeps objects alive ({len(lib.referenced_objects)})")
    known = _callback_names()
    by_func = {}
    for cb_name, (setup, teardown) in known.items():
        by_func[("setup", id(setup))] = cb_name
        by_func[("teardown", id(teardown))] = cb_name
    callbacks = {}
    for kind, funcs in (("setup", lib._setup_functions), ("teardown", lib._teardown_functions)):
        names = []
        for f in funcs:
            cb_name = by_func.get((kind, id(f)))
            if cb_name is None:
                raise NotCacheable(f"{name}: unknown module {kind} callback {f!r}")
            names.append(cb_name)
        callbacks[kind] = names
    cubin = lib._cubin_cache.get(tuple(cc))
    if cubin is None:
        raise NotCacheable(f"{name}: no linked cubin for cc {cc} (linked for {list(lib._cubin_cache)})")
    data = bytes(getattr(cubin, "code", cubin))
    if not data:
        raise NotCacheable(f"{name}: empty cubin")
    meta = {
        "kernel": name,
        "entry_name": kernel.entry_name,
        "cooperative": bool(kernel.cooperative),
        "cc": [cc[0], cc[1], cc[2] if len(cc) > 2 else ""],
        "setup": callbacks["setup"],
        "teardown": callbacks["teardown"],
        "lineinfo": bool(kernel.lineinfo),
        "max_registers": lib._max_registers,
        "nvvm_options": lib._nvvm_options,
        "lto": bool(lib._lto),
        "shared_memory_carveout": kernel.shared_memory_carveout,
        "argtypes": [repr(t) for t in kernel.argument_types],
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    return CacheEntry(key, data, meta)


def rebuild_kernel(entry: CacheEntry, argtypes: tuple):
    """A numba-cuda ``_Kernel`` (not yet bound to a context) that launches ``entry``'s cubin with
    the original setup and teardown callbacks. Needs no GPU; :meth:`_Kernel.bind` loads it."""
    from cuda.core import ObjectCode
    from numba.cuda import types
    from numba.cuda.codegen import CUDACodeLibrary
    from numba.cuda.core.callconv import _MinimalCallHelper
    from numba.cuda.dispatcher import _Kernel
    from numba.cuda.typing import signature

    meta = entry.meta
    cc = (int(meta["cc"][0]), int(meta["cc"][1]), str(meta["cc"][2]))
    known = _callback_names()
    missing = set(meta["setup"]) | set(meta["teardown"])
    missing -= set(known)
    if missing:
        raise CacheEntryError(f"stale: needs module callbacks {sorted(missing)} that are not available")
    code = ObjectCode.from_cubin(entry.cubin, name=meta.get("kernel", ""))
    lib = CUDACodeLibrary._rebuild(
        codegen=None, name=meta.get("kernel", ""), entry_name=meta["entry_name"], llvm_strs=[],
        ptx_cache={}, cubin_cache={cc: code}, linkerinfo_cache={},
        max_registers=meta.get("max_registers"), nvvm_options=meta.get("nvvm_options") or {},
        needs_cudadevrt=False, nrt=False, use_cooperative=bool(meta["cooperative"]),
        lto=bool(meta.get("lto")))
    lib._setup_functions = [known[n][0] for n in meta["setup"]]
    lib._teardown_functions = [known[n][1] for n in meta["teardown"]]
    return _Kernel._rebuild(
        cooperative=bool(meta["cooperative"]), name=meta["entry_name"],
        signature=signature(types.void, *argtypes), codelibrary=lib, debug=False,
        lineinfo=bool(meta.get("lineinfo")), call_helper=_MinimalCallHelper(), extensions=[],
        shared_memory_carveout=meta.get("shared_memory_carveout"), launch_config_sensitive=False)


# ------------------------------------------------------------------------------------------------
# the directory


class KernelCache:
    """The cache directory of linked kernels. Build with :meth:`from_env` or a directory.

    ``stats`` counts, per process: ``hits`` (kernels loaded), ``misses`` (compiled), ``stored``,
    ``rejected`` (bad entries deleted), ``uncacheable`` (compiled, not cacheable).
    """

    def __init__(self, directory):
        self.directory = Path(directory).expanduser()
        self.stats = {"hits": 0, "misses": 0, "stored": 0, "rejected": 0, "uncacheable": 0}
        self._write_failed = False

    @classmethod
    def from_env(cls) -> "KernelCache | None":
        """The cache at ``$EP_RUNTIME_KERNEL_CACHE`` (default ``~/.cache/ep_runtime/kernels``);
        None if that variable says ``off``."""
        value = os.environ.get(CACHE_ENV, "").strip()
        if value.lower() in _DISABLED:
            return None
        return cls(value or DEFAULT_DIR)

    def path_for(self, key: str) -> Path:
        return self.directory / (key + SUFFIX)

    # -- reading --------------------------------------------------------------------------------
    def read(self, key: str) -> CacheEntry | None:
        """The checked entry of ``key``, or None (a miss). A bad entry is deleted and logged."""
        path = self.path_for(key)
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return None
        except OSError as exc:
            self._reject(path, None, f"unreadable ({exc})")
            return None
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError as exc:
            self._reject(path, st, f"unreadable ({exc})")
            return None
        try:
            return CacheEntry.decode(data, key)
        except CacheEntryError as exc:
            self._reject(path, st, exc.reason)
            return None

    def reject(self, key: str, reason: str) -> None:
        """Delete ``key``'s entry (e.g. the driver refused its cubin), logging ``reason``."""
        path = self.path_for(key)
        try:
            st = os.stat(path)
        except OSError:
            st = None
        self._reject(path, st, reason)

    def _reject(self, path: Path, st, reason: str) -> None:
        self.stats["rejected"] += 1
        log.warning("kernel cache: %s: %s; deleting it, the kernel is compiled again", path, reason)
        try:
            # Delete only the file we read: another rank may have replaced it with a good one.
            now = os.stat(path)
            if st is None or (now.st_ino, now.st_mtime_ns) == (st.st_ino, st.st_mtime_ns):
                os.unlink(path)
        except OSError:
            pass

    # -- writing --------------------------------------------------------------------------------
    def write(self, entry: CacheEntry) -> Path | None:
        """Store ``entry`` atomically (temporary file, fsync, rename). Returns its path, or None
        if the directory is not writable (logged once; the run goes on without storing)."""
        path = self.path_for(entry.key)
        tmp = None
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=f".{entry.key[:16]}.", suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(entry.encode())
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            tmp = None
        except OSError as exc:
            if not self._write_failed:
                log.warning("kernel cache: cannot write to %s (%s); kernels will be compiled at every "
                            "start (set %s to a writable directory, or 'off')", self.directory, exc, CACHE_ENV)
            self._write_failed = True
            return None
        finally:
            if tmp is not None:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
        self.stats["stored"] += 1
        return path

    # -- the session's entry point --------------------------------------------------------------
    def load_or_compile(self, dispatcher, argtypes: tuple, cc: tuple | None = None, bind: bool = True):
        """The compiled, bound kernel of ``dispatcher`` for ``argtypes``, installed as its overload:
        from the cache if a good entry exists, else compiled (``dispatcher.compile``) and stored.
        Needs the current CUDA context (a GPU) unless ``cc`` is given and ``bind`` is False (tests:
        a loaded kernel is then installed without loading its module)."""
        from numba.cuda.core import sigutils

        argtypes, _ = sigutils.normalize_signature(tuple(argtypes))
        argtypes = tuple(argtypes)
        have = dispatcher.overloads.get(argtypes)
        if have is not None:
            return have
        cc = target_cc() if cc is None else tuple(cc)
        label = getattr(dispatcher, "__qualname__", repr(dispatcher))
        try:
            key = kernel_key(dispatcher, argtypes, cc)
        except NotCacheable as exc:
            self.stats["uncacheable"] += 1
            log.info("kernel cache: %s not cached: %s", label, exc)
            return dispatcher.compile(argtypes)
        kernel = self._load(dispatcher, argtypes, key, label, bind)
        if kernel is not None:
            return kernel
        self.stats["misses"] += 1
        start = time.perf_counter()
        kernel = dispatcher.compile(argtypes)
        try:
            entry = entry_from_kernel(kernel, key, cc)
        except NotCacheable as exc:
            self.stats["uncacheable"] += 1
            log.info("kernel cache: %s not cached: %s", label, exc)
            return kernel
        path = self.write(entry)
        log.info("kernel cache: %s compiled in %.1f s%s", label, time.perf_counter() - start,
                 f", stored as {path.name}" if path else "")
        return kernel

    def prepare(self, dispatcher, argtypes: tuple, cc: tuple) -> str:
        """Store the kernel of ``dispatcher`` for ``argtypes`` on ``cc`` ahead of time, without
        loading it (no module is loaded, so NVSHMEM need not be running): ``"hit"`` when a good
        entry is there already, ``"compiled"`` once compiled and stored. Compiles as
        ``dispatcher.compile`` does (numba-cuda 0.30.4's ``_Kernel(py_func, argtypes,
        **targetoptions)``, private API) and links for ``cc``. Raises :class:`NotCacheable`,
        and OSError when the entry cannot be written (``python -m ep_runtime.tools.prebuild``)."""
        from numba.cuda.core import sigutils
        from numba.cuda.dispatcher import _Kernel

        argtypes = tuple(sigutils.normalize_signature(tuple(argtypes))[0])
        cc = tuple(cc)
        key = kernel_key(dispatcher, argtypes, cc)
        if self.read(key) is not None:
            self.stats["hits"] += 1
            return "hit"
        self.stats["misses"] += 1
        shim_memo.install()
        kernel = _Kernel(dispatcher.py_func, argtypes, **dispatcher.targetoptions)
        kernel.library.get_cubin(cc=cc)  # the link, kept in the library's cubin cache
        if self.write(entry_from_kernel(kernel, key, cc)) is None:
            raise OSError(f"kernel cache: cannot write to {self.directory}")
        return "compiled"

    def _load(self, dispatcher, argtypes, key, label, bind):
        entry = self.read(key)
        if entry is None:
            return None
        start = time.perf_counter()
        try:
            kernel = rebuild_kernel(entry, argtypes)
            if bind:
                kernel.bind()  # load the module into this context and run its setup (library_init)
        except CacheEntryError as exc:
            self.reject(key, exc.reason)
            return None
        except Exception as exc:  # noqa: BLE001 - e.g. the driver refuses the cubin: compile instead
            self.reject(key, f"could not be loaded ({type(exc).__name__}: {exc})")
            return None
        dispatcher.add_overload(kernel, argtypes)
        self.stats["hits"] += 1
        log.info("kernel cache: %s loaded from %s in %.3f s", label, self.path_for(key).name,
                 time.perf_counter() - start)
        return kernel
