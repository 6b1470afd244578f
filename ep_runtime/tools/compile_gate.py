"""Compile-and-link gate: every NVSHMEM-calling kernel must build for sm_90 on a CPU-only machine.

``python -m ep_runtime.tools.compile_gate [--json] [--entries SPEC] [--only NAME ...] [--jobs N]
[--compiler numba-cuda|numba-cuda-mlir]``

Each entry ``(name, kernel, argtypes)`` is compiled the way ``Dispatcher.compile`` does it on a
GPU (``_Kernel(py_func, argtypes, **targetoptions)``; LTO on, as numba-cuda picks when nvJitLink is
present) and then linked to a cubin for the compute capability numba-cuda 0.30.4 uses on an
sm_90 device, ``(9, 0, "a")``. The link runs NVRTC over NVSHMEM's headers (nvshmem4py's shim)
and nvJitLink over everything, so typing errors against nvshmem4py's overloads, lowering
errors and unresolved device symbols all show up here, without a GPU and without a driver.
numba-cuda-mlir's builds (:mod:`ep_runtime.tools.gate_mlir`) are also checked for global atomics
on shared memory in their PTX after link-time optimization (:mod:`ep_runtime.tools.gate_atomics`,
that compiler's fault); numba-cuda's are not (it lowers them as shared or generic atomics, and the
check's extra link of every build would lengthen CI's gate).

Each result also reports what the linked code holds: registers per thread, SASS instructions
(code a kernel runs once per call costs its fetch) and the NVSHMEM transfer routines it still
calls (what its send path leaves to NVSHMEM).

Entries come from ``ep_runtime.tools.gate_entries.gate_entries()`` (a cross-section of the EP builds:
see that module) unless ``--entries`` names another module (dotted name or ``.py`` path) with a
``gate_entries()`` function, or ``MODULE:FUNCTION``: ``ep_runtime.tools.gate_entries:every_build``
builds every EP kernel of every plan variant and format; the tests use a file of entries for
the negative control, which must FAIL.

``--compiler numba-cuda-mlir`` builds the same entries with numba-cuda-mlir instead
(:mod:`ep_runtime.tools.gate_mlir`; without ``--compiler``, the compiler installed:
:mod:`ep_runtime.kernels.compiler`).

Exit status: 0 every entry compiled and linked; 1 some entry failed; 2 the gate could not run
(simulator on, nvshmem4py's Numba bindings missing, no entries, bad arguments).

Private numba-cuda API
----------------------
numba-cuda asks the CUDA driver for the compute capability, and there is none here. Two
attributes are patched, only while :func:`compile_for_sm90` runs and only in this process
(see :func:`_fixed_compute_capability`, the ``WAR:`` comments). Both exist in
numba-cuda==0.30.4, which pyproject pins; a different version gets a warning, and the negative
control (tests/gate_negative.py) shows the gate still rejects bad kernels.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import importlib
import importlib.util
import json
import os
import sys
import time
import traceback
from types import SimpleNamespace

#: What the gate builds for: the compute capability numba-cuda 0.30.4 derives for an sm_90 device
#: in ``CUDACodeLibrary._ensure_cc`` (arch-specific "a" for cc >= 9.0), i.e. what
#: ``get_cufunc`` links on an H100/H200.
TARGET_CC = (9, 0, "a")
#: The numba-cuda release whose private API the patches below target (pinned in pyproject.toml).
PINNED_NUMBA_CUDA = "0.30.4"
#: Module whose ``gate_entries()`` lists the project's kernels.
DEFAULT_ENTRIES = "ep_runtime.tools.gate_entries"


class GateSetupError(RuntimeError):
    """The gate cannot run in this environment (not a kernel failure)."""


@dataclasses.dataclass
class CompileResult:
    name: str
    ok: bool
    seconds: float
    cubin_bytes: int = 0
    #: "compile" (typing, lowering, NVVM), "link" (NVRTC shim + nvJitLink) or "atomics" (a global
    #: atomic on shared memory in numba-cuda-mlir's linked PTX: :mod:`ep_runtime.tools.gate_atomics`);
    #: None when ok.
    stage: str | None = None
    error: str | None = None
    #: numba-cuda will launch it cooperatively (grid must be co-resident). None when not built.
    cooperative: bool | None = None
    #: registers per thread of the linked kernel (the cubin's EIATTR_REGCOUNT), and the cap it
    #: was compiled under (``max_registers``; None: no cap). None when not built.
    registers: int | None = None
    max_registers: int | None = None
    #: SASS instructions of the linked cubin's code (``.text`` sections, 16 bytes each): code a
    #: kernel runs once per call is fetched cold, a cost per instruction (docs/plans.md). None
    #: when not built.
    instructions: int | None = None
    #: per-thread stack frame bytes (spills and local arrays); None when not built.
    frame_bytes: int | None = None
    #: the NVSHMEM transfer routines (``nvshmemi_transfer_*``) the linked code still calls, by
    #: name, sorted: what a build's send path leaves to NVSHMEM. None when not built.
    nvshmem_transfers: list | None = None
    #: SHA-256 of the linked code (the ``.text`` sections, in section order): equal digests
    #: before and after a change mean the same machine code. None when not built.
    text_sha256: str | None = None

    def line(self) -> str:
        size = f"{self.cubin_bytes / 1024:8.1f} KB" if self.ok else "       - KB"
        text = f"{self.name:<44} {'OK' if self.ok else 'FAIL':<4} {self.seconds:7.2f} s {size}"
        if self.registers is not None:
            text += f" {self.registers:4d} regs"
        if self.instructions is not None:
            text += f" {self.instructions:6d} instr"
        if self.frame_bytes:
            text += f" {self.frame_bytes:4d} B frame"
        if not self.ok:
            text += f"  [{self.stage}]"
            detail = (self.error or "").strip().splitlines()
            text += "".join(f"\n    {ln}" for ln in detail[:12])
            if len(detail) > 12:
                text += f"\n    ... ({len(detail) - 12} more lines; --json has all)"
        return text


# --------------------------------------------------------------------------------------------
# environment checks


def _simulator_requested() -> bool:
    # Same rule as numba's config: an int, 0 (or unset/empty) means off.
    value = os.environ.get("NUMBA_ENABLE_CUDASIM", "").strip()
    return value not in ("", "0")


def check_environment() -> None:
    """Raise :class:`GateSetupError` unless the real compiler and nvshmem4py's bindings are here."""
    from ep_runtime.kernels import compiler

    if compiler.chosen() == compiler.NUMBA_CUDA_MLIR:
        from ep_runtime.tools import gate_mlir

        lacking = gate_mlir.missing()
        if _simulator_requested() or lacking:
            raise GateSetupError(lacking or "NUMBA_ENABLE_CUDASIM is set: numba-cuda-mlir has no simulator; unset it.")
        return
    if _simulator_requested():
        raise GateSetupError(
            "NUMBA_ENABLE_CUDASIM is set: the compile gate needs the real CUDA compiler "
            "(the simulator type-checks nothing). Unset it for this process.")
    if os.environ.get("NUMBA_FORCE_CUDA_CC"):
        raise GateSetupError(
            "NUMBA_FORCE_CUDA_CC is set: it would override the gate's target sm_90a. Unset it.")
    from numba.cuda import config as cuda_config
    if cuda_config.ENABLE_CUDASIM:
        raise GateSetupError("numba.cuda is running its simulator; the gate needs the real compiler.")
    if not nvshmem_numba_bindings_installed():
        raise GateSetupError(
            "nvshmem4py's Numba device bindings are not installed (need nvshmem4py-cu13[numba] "
            "and cffi: pip install -e \".[test]\", the CPU test suite's extra, or \".[gpu]\").")


def nvshmem_device_bindings_present(compiler_dir: str) -> bool:
    """Whether nvshmem4py's device bindings for one kernel compiler (``compiler_dir``: its
    folder under ``nvshmem/core/device`` and ``nvshmem/bindings/device``, ``"numba"`` or
    ``"numba_cuda_mlir"``) and their undeclared dependency cffi are present.

    Looks at files only (imports nothing of numba or nvshmem): nvshmem4py ships stubs and warns
    "Numba device bindings are not enabled" when ``rma.py`` / ``_numbast.py`` are absent.
    """
    try:
        spec = importlib.util.find_spec("nvshmem")
    except (ImportError, ValueError):
        return False
    if spec is None or not spec.submodule_search_locations:
        return False
    root = list(spec.submodule_search_locations)[0]
    needed = [os.path.join(root, "core", "device", compiler_dir, "rma.py"),
              os.path.join(root, "bindings", "device", compiler_dir, "_numbast.py")]
    return all(os.path.exists(p) for p in needed) and importlib.util.find_spec("cffi") is not None


def nvshmem_numba_bindings_installed() -> bool:
    """Whether nvshmem4py's Numba device bindings, cffi and numba-cuda are present (files only,
    :func:`nvshmem_device_bindings_present`)."""
    return nvshmem_device_bindings_present("numba") and importlib.util.find_spec("numba_cuda") is not None


def _numba_cuda_version() -> str:
    try:
        from importlib.metadata import version
        return version("numba-cuda")
    except Exception:  # pragma: no cover - metadata missing
        return "unknown"


# --------------------------------------------------------------------------------------------
# compiling


@contextlib.contextmanager
def _fixed_compute_capability(cc=TARGET_CC):
    """Answer numba-cuda's two compute-capability questions with ``cc`` instead of the driver.

    Scope: the ``with`` block, this process. Restores the originals on exit.
    """
    from numba.cuda import codegen, dispatcher

    lib_cls = codegen.CUDACodeLibrary
    if not hasattr(dispatcher, "get_current_device") or not hasattr(lib_cls, "_ensure_cc"):
        raise GateSetupError(
            f"numba-cuda {_numba_cuda_version()} lacks dispatcher.get_current_device or "
            f"CUDACodeLibrary._ensure_cc; the gate targets numba-cuda=={PINNED_NUMBA_CUDA}.")
    saved_device = dispatcher.get_current_device
    saved_ensure = lib_cls.__dict__["_ensure_cc"]

    # WAR: _Kernel.__init__ (numba/cuda/dispatcher.py) starts with
    # `cc = get_current_device().compute_capability`, a driver call that fails without a GPU.
    # It reads only `.compute_capability`. Patch the name numba.cuda.dispatcher imported, not
    # numba.cuda.api.get_current_device, so nothing outside kernel compilation sees a fake device.
    fake_device = SimpleNamespace(compute_capability=tuple(cc[:2]))
    dispatcher.get_current_device = lambda: fake_device

    # WAR: _Kernel.__init__ then calls lib.get_asm_str() with cc=None (to find cooperative
    # launch and NRT use), and CUDACodeLibrary._ensure_cc(None) reads the compute capability
    # from the current driver context. Return what it would return on an sm_90 device;
    # explicit ccs pass through unchanged, as in the original.
    def _ensure_cc(self, want):
        return want if want is not None else cc

    lib_cls._ensure_cc = _ensure_cc
    try:
        yield
    finally:
        dispatcher.get_current_device = saved_device
        lib_cls._ensure_cc = saved_ensure


def _kernel_parts(func):
    """(py_func, targetoptions) for a ``@cuda.jit`` dispatcher or a plain Python function."""
    from numba.cuda.dispatcher import CUDADispatcher

    if isinstance(func, CUDADispatcher):
        # Exactly what CUDADispatcher.compile passes to _Kernel.
        return func.py_func, dict(func.targetoptions)
    if callable(func) and hasattr(func, "__code__"):
        from numba.cuda.cudadrv.driver import _have_nvjitlink
        # @cuda.jit's default: LTO when nvJitLink is present (debug off).
        return func, {"lto": _have_nvjitlink()}
    raise TypeError(f"not a @cuda.jit kernel or Python function: {func!r}")


#: .nv.info attributes holding a function's register count and stack frame size, and the
#: attribute format with a size-prefixed payload (CUDA's ELF notes: EIATTR_REGCOUNT = 0x2f,
#: EIATTR_FRAME_SIZE = 0x11, EIFMT_SVAL = 4).
_EIATTR_REGCOUNT = 0x2F
_EIATTR_FRAME_SIZE = 0x11
_EIFMT_SVAL = 4


def _elf_sections(cubin: bytes) -> list[tuple[bytes, int, int]]:
    """``(name, offset, size)`` of every section of an ELF64 cubin."""
    import struct

    if cubin[:4] != b"\x7fELF" or cubin[4] != 2:
        raise ValueError("not an ELF64 cubin")
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    names_at = sections[shstrndx][4]
    return [(cubin[names_at + name_off:cubin.index(b"\0", names_at + name_off)], offset, size)
            for name_off, _, _, _, offset, size, *_ in sections]


def _nv_info_values(cubin: bytes, attr: int) -> list[int]:
    """The values of one per-function attribute (an EIATTR with an 8-byte payload: function
    index, value) in the ``.nv.info`` sections of a linked sm_90 cubin (an ELF64 file)."""
    values = []
    for name, offset, size in _elf_sections(cubin):
        if not name.startswith(b".nv.info"):
            continue
        data, i = cubin[offset:offset + size], 0
        while i + 4 <= len(data):
            fmt, key, n = data[i], data[i + 1], int.from_bytes(data[i + 2:i + 4], "little")
            if fmt != _EIFMT_SVAL:
                i += 4  # value formats without a payload: 2 bytes of value in the header
                continue
            if key == attr and n == 8:
                values.append(int.from_bytes(data[i + 8:i + 12], "little"))
            i += 4 + n
    return values


def cubin_registers(cubin: bytes) -> int:
    """Registers per thread of the most demanding function in a linked sm_90 cubin: the largest
    EIATTR_REGCOUNT. What the driver reports as the kernel's NUM_REGS, read here without a GPU,
    so a kernel too large for its block size fails the gate instead of its first launch."""
    regs = _nv_info_values(cubin, _EIATTR_REGCOUNT)
    if not regs:
        raise ValueError("no EIATTR_REGCOUNT in the cubin")
    return max(regs)


def cubin_frame_bytes(cubin: bytes) -> int:
    """Bytes of per-thread stack frame of the most demanding function (EIATTR_FRAME_SIZE): local
    memory for spilled registers and arrays the compiler could not keep in registers; 0 when
    none."""
    return max(_nv_info_values(cubin, _EIATTR_FRAME_SIZE), default=0)


def cubin_instructions(cubin: bytes) -> int:
    """SASS instructions in a linked sm_90 cubin: its ``.text`` sections' bytes over 16 (one
    instruction each), the kernel and any function not inlined into it."""
    return sum(size for name, _, size in _elf_sections(cubin) if name.startswith(b".text")) // 16


def cubin_text_sha256(cubin: bytes) -> str:
    """SHA-256 of a linked cubin's code: its ``.text`` sections' bytes in section order."""
    digest = hashlib.sha256()
    for name, offset, size in _elf_sections(cubin):
        if name.startswith(b".text"):
            digest.update(cubin[offset:offset + size])
    return digest.hexdigest()


def cubin_nvshmem_transfers(cubin: bytes) -> list[str]:
    """Names of the NVSHMEM transfer routines (``nvshmemi_transfer_<what>``, from their mangled
    symbols) a linked cubin still holds, sorted and without repeats."""
    import re

    return sorted({m.decode() for m in re.findall(rb"nvshmemi_transfer_[a-z_]+[a-z]", cubin)})


def compile_for_sm90(py_func, argtypes, name: str | None = None) -> CompileResult:
    """Compile ``py_func`` (a ``@cuda.jit`` kernel or plain function) for ``argtypes`` and link
    it to an sm_90a cubin, as a launch on an H100/H200 would. Never raises for kernel errors:
    they come back as ``ok=False`` with the error text.
    """
    name = name or getattr(py_func, "__name__", repr(py_func))
    return run_gate([(name, py_func, argtypes)])[0]


def _failure(name: str, stage: str, start: float, exc: Exception) -> CompileResult:
    text = f"{type(exc).__name__}: {exc}"
    if not str(exc).strip():
        text += "\n" + traceback.format_exc()
    return CompileResult(name, False, time.perf_counter() - start, stage=stage, error=text)


def _lower(name: str, py_func, argtypes):
    """Stage 1: type, lower and compile one entry to PTX/LTO-IR (``_Kernel``). Returns
    ``(kernel, options, seconds)`` or a failed :class:`CompileResult`."""
    from numba.cuda.dispatcher import _Kernel

    start = time.perf_counter()
    try:
        func, options = _kernel_parts(py_func)
        with _fixed_compute_capability():
            kernel = _Kernel(func, tuple(argtypes), **options)
        return kernel, options, time.perf_counter() - start
    except GateSetupError:
        raise
    except Exception as exc:  # noqa: BLE001 - every kernel error is a gate FAIL
        return _failure(name, "compile", start, exc)


#: The error of a build whose linked PTX has a global atomic on shared memory (stage "atomics").
ATOMICS_ERROR = "global atomic on a shared-window address (ep_runtime.tools.gate_atomics):\n"


def _link(name: str, kernel, options: dict, lowered_s: float) -> CompileResult:
    """Stage 2: link one lowered entry to an sm_90a cubin and read what the cubin holds."""
    start = time.perf_counter() - lowered_s
    try:
        with _fixed_compute_capability():
            cubin = kernel.library.get_cubin(cc=TARGET_CC)
        data = bytes(getattr(cubin, "code", cubin))  # cuda.core ObjectCode in 0.30.4; bytes before
        if not data:
            raise RuntimeError("linker returned an empty cubin")
        return CompileResult(name, True, time.perf_counter() - start, len(data),
                             cooperative=bool(kernel.cooperative), registers=cubin_registers(data),
                             max_registers=options.get("max_registers"), instructions=cubin_instructions(data),
                             frame_bytes=cubin_frame_bytes(data), nvshmem_transfers=cubin_nvshmem_transfers(data),
                             text_sha256=cubin_text_sha256(data))
    except GateSetupError:
        raise
    except Exception as exc:  # noqa: BLE001 - every kernel error is a gate FAIL
        return _failure(name, "link", start, exc)


def run_gate(entries) -> list[CompileResult]:
    """Compile and link each ``(name, kernel, argtypes)`` entry in this process; results in
    entry order.

    Every entry is lowered before any is linked. Lowering a kernel adds the NVSHMEM functions
    it calls to nvshmem4py's shim (CUDA source that every link compiles with NVRTC, the
    largest single cost of a link on a CPU), so after all lowering the shim is complete: every
    link of the process compiles the same source, once (:mod:`ep_runtime.shmem.shim_memo`).
    """
    if _simulator_requested():
        raise GateSetupError("NUMBA_ENABLE_CUDASIM is set: the compile gate needs the real compiler.")
    from ep_runtime.kernels.cuda_api import MLIR
    from ep_runtime.shmem import shim_memo

    if MLIR:
        from ep_runtime.tools import gate_mlir

        return gate_mlir.run(entries, TARGET_CC)

    shim_memo.install()
    lowered = [_lower(name, func, argtypes) for name, func, argtypes in entries]
    return [step if isinstance(step, CompileResult) else _link(name, *step)
            for (name, _, _), step in zip(entries, lowered)]


# --------------------------------------------------------------------------------------------
# entries


def _load_module(spec: str):
    if spec.endswith(".py") or os.sep in spec:
        path = os.path.abspath(spec)
        mod_name = "_ep_gate_entries_" + os.path.splitext(os.path.basename(path))[0]
        if mod_name in sys.modules:
            return sys.modules[mod_name]
        file_spec = importlib.util.spec_from_file_location(mod_name, path)
        if file_spec is None or file_spec.loader is None:
            raise GateSetupError(f"cannot load entries from {spec}")
        module = importlib.util.module_from_spec(file_spec)
        sys.modules[mod_name] = module
        file_spec.loader.exec_module(module)
        return module
    return importlib.import_module(spec)


def load_entries(spec: str = DEFAULT_ENTRIES) -> list[tuple]:
    """The entries ``spec`` names, checked: ``MODULE`` (a dotted name or a .py path) for its
    ``gate_entries()``, or ``MODULE:FUNCTION`` for another function of it."""
    module, _, function = spec.rpartition(":") if ":" in spec else (spec, "", "gate_entries")
    if module == DEFAULT_ENTRIES and importlib.util.find_spec(module) is None:
        return []
    entries_fn = getattr(_load_module(module), function, None)
    if not callable(entries_fn):
        raise GateSetupError(f"{module} has no function {function}() listing gate entries")
    entries = list(entries_fn())
    seen = set()
    for entry in entries:
        if not (isinstance(entry, tuple) and len(entry) == 3 and isinstance(entry[0], str)
                and isinstance(entry[2], tuple)):
            raise GateSetupError(f"bad gate entry (want (name, kernel, argtypes tuple)): {entry!r}")
        if entry[0] in seen:
            raise GateSetupError(f"duplicate gate entry name {entry[0]!r}")
        seen.add(entry[0])
    return entries


def gate_entries() -> list[tuple]:
    """The project's gate entries: ``ep_runtime.tools.gate_entries.gate_entries()`` if present."""
    return load_entries(DEFAULT_ENTRIES)


def source_fingerprint(spec: str = DEFAULT_ENTRIES) -> str:
    """SHA-256 of what a gate run of ``spec`` compiles: every ``.py`` file of the ``ep_runtime``
    package and of its kernels (wherever the install maps them), the entries' own file when
    ``spec`` names one, and ``spec`` itself. A report carries it (``"sources"``), so a report
    written earlier (``.ci/run`` runs the gate while the rest of the test extras install) is
    used only for the tree it was made from."""
    import ep_runtime
    import ep_runtime.kernels

    files = set()
    for package in (ep_runtime, ep_runtime.kernels):
        root = os.path.dirname(os.path.abspath(package.__file__))
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = [d for d in dirnames if d != "__pycache__"]
            files.update(os.path.join(dirpath, f) for f in filenames if f.endswith(".py"))
    module, _, function = spec.rpartition(":") if ":" in spec else (spec, "", "")
    name = spec
    if module.endswith(".py") or os.sep in module:  # a file: its content and name, wherever it lies
        files.add(os.path.abspath(module))
        name = f"{os.path.basename(module)}:{function}"
    digest = hashlib.sha256(name.encode())
    for path in sorted(files):
        digest.update(os.path.relpath(path, os.path.dirname(os.path.dirname(os.path.abspath(ep_runtime.__file__))))
                      .encode())
        with open(path, "rb") as f:
            digest.update(hashlib.sha256(f.read()).digest())
    return digest.hexdigest()


def _compile_in_worker(spec: str, names: list[str], compiler_name: str) -> list[CompileResult]:
    from ep_runtime.kernels import compiler

    compiler.select(compiler_name)
    entries = {e[0]: e for e in load_entries(spec)}
    return run_gate([entries[n] for n in names])


def _run_parallel(spec: str, names: list[str], jobs: int) -> list[CompileResult]:
    """The entries ``names`` of ``spec`` in ``jobs`` processes; results in the order of
    ``names``. Each process lowers its whole share before linking (:func:`run_gate`), so the
    shares are fixed up front: builds of one kernel cost alike, so they are dealt out in turn
    (sorted by kernel name, every ``jobs``-th to the same process)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from ep_runtime.kernels import compiler

    ctx = multiprocessing.get_context("spawn")  # fresh interpreters: no forked compiler state
    by_kernel = sorted(names, key=lambda n: n.split(" ")[0])
    shares = [by_kernel[i::jobs] for i in range(jobs)]
    with ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
        futures = [pool.submit(_compile_in_worker, spec, share, compiler.chosen()) for share in shares if share]
        by_name = {r.name: r for f in futures for r in f.result()}
    return [by_name[n] for n in names]


# --------------------------------------------------------------------------------------------
# command line


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ep_runtime.tools.compile_gate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object (last stdout line)")
    parser.add_argument("--entries", default=DEFAULT_ENTRIES,
                        help=f"module or .py file with gate_entries(), or MODULE:FUNCTION (default {DEFAULT_ENTRIES}; "
                             f"{DEFAULT_ENTRIES}:every_build adds every FP8 build of every plan variant)")
    parser.add_argument("--only", action="append", metavar="NAME", help="compile only these entries")
    parser.add_argument("--jobs", "-j", type=int, default=1, help="compile in N processes (default 1)")
    parser.add_argument("--compiler", choices=("numba-cuda", "numba-cuda-mlir"),
                        help="build the kernels with this compiler (default: the one installed, numba-cuda first)")
    args = parser.parse_args(argv)

    from ep_runtime.core.errors import EPError
    from ep_runtime.kernels import compiler

    version = _numba_cuda_version()
    started = time.perf_counter()
    try:
        try:
            name = compiler.select(args.compiler) if args.compiler else compiler.chosen()
        except EPError as exc:
            raise GateSetupError(str(exc)) from None
        if name == compiler.NUMBA_CUDA_MLIR:
            from ep_runtime.tools.gate_mlir import numba_cuda_mlir_version

            built_by = f"numba-cuda-mlir {numba_cuda_mlir_version()}"
        else:
            built_by = f"numba-cuda {version}"
        check_environment()
        # Keep stdout for our report: numba/nvshmem chatter during import and compile goes to stderr.
        with contextlib.redirect_stdout(sys.stderr):
            entries = load_entries(args.entries)
            if args.only:
                unknown = set(args.only) - {e[0] for e in entries}
                if unknown:
                    raise GateSetupError(f"unknown entries: {sorted(unknown)}")
                entries = [e for e in entries if e[0] in args.only]
            if not entries:
                raise GateSetupError(f"no gate entries from {args.entries}")
            if name == compiler.NUMBA_CUDA and version != PINNED_NUMBA_CUDA:
                print(f"warning: numba-cuda {version}, the gate's patches target "
                      f"{PINNED_NUMBA_CUDA}", file=sys.stderr)
            if args.jobs > 1 and len(entries) > 1:
                results = _run_parallel(args.entries, [e[0] for e in entries], args.jobs)
            else:
                results = run_gate(entries)
    except GateSetupError as exc:
        if args.json:
            print(json.dumps({"ok": False, "setup_error": str(exc), "results": [],
                              "sources": source_fingerprint(args.entries)}))
        else:
            print(f"compile gate: cannot run: {exc}", file=sys.stderr)
        return 2

    ok = all(r.ok for r in results)
    wall = time.perf_counter() - started
    if args.json:
        print(json.dumps({
            "ok": ok, "target": "sm_%d%d%s" % TARGET_CC, "numba_cuda": version, "compiler": built_by,
            "seconds": round(wall, 2), "results": [dataclasses.asdict(r) for r in results],
            "sources": source_fingerprint(args.entries),
        }))
    else:
        for r in results:
            print(r.line())
        n_ok = sum(r.ok for r in results)
        print(f"compile gate: {n_ok}/{len(results)} OK for sm_{TARGET_CC[0]}{TARGET_CC[1]}{TARGET_CC[2]} "
              f"({built_by}) in {wall:.1f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
