"""The kernel cache and the fast launch path, on a CPU (no GPU, no driver).

What runs here: cache keys (they change with kernel source, package source, closure constants,
argument types, compute capability and versions); a store/load round trip of a real NVSHMEM
kernel linked for sm_90a the way the compile gate links it; detection, deletion and rebuild of
corrupt, truncated, stale and unreadable entries; atomic writes under concurrent writers; and the
fast path's kernel parameters compared byte for byte with what numba-cuda's own
``_Kernel._prepare_args`` hands to cuda.core's parameter packer (``ParamHolder``, which
``cuda.core.launch`` uses). Loading a cubin into a context, NVSHMEM's module setup and the driver
launch itself need a GPU: tests/gpu/startup_check.py.
"""

import ctypes
import importlib
import json
import logging
import multiprocessing
import sys
import textwrap
import time
from types import SimpleNamespace

import numpy as np
import pytest

from ep_runtime.tools import compile_gate
from ep_runtime.shmem import cache_key as ck
from ep_runtime.shmem import kernel_cache as kc
from ep_runtime.shmem import fast_launch as fl

pytestmark = pytest.mark.skipif(
    not compile_gate.nvshmem_numba_bindings_installed(),
    reason="nvshmem4py's Numba device bindings are not installed (pip install -e '.[test]')")

CC = (9, 0, "a")


@pytest.fixture(autouse=True, scope="module")
def _real_compiler():
    from numba.cuda import config

    if config.ENABLE_CUDASIM:
        pytest.fail("these tests need Numba's real CUDA compiler: run pytest without NUMBA_ENABLE_CUDASIM")


def _types():
    from numba.cuda import types

    return types


def _c(dtype, ndim=1, layout="C"):
    return _types().Array(dtype, ndim, layout)


# ------------------------------------------------------------------------------------------------
# keys

KERNEL_V1 = """
from numba import cuda

SCALE = 3

@cuda.jit(device=True)
def helper(x):
    return x + 1

def make(threads):
    @cuda.jit
    def kern(dst, src, n):
        i = cuda.grid(1)
        if i < n and i < threads:
            dst[i] = helper(src[i]) * SCALE
    return kern
"""


def _load_module(tmp_path, name, text):
    """``text`` imported as module ``name`` from ``tmp_path``, without bytecode: a test's versions
    of one module differ by a character within the same second, which a cached .pyc (keyed by
    the source's size and mtime) would not see."""
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(text))
    sys.path.insert(0, str(tmp_path))
    writes_bytecode, sys.dont_write_bytecode = sys.dont_write_bytecode, True
    try:
        sys.modules.pop(name, None)
        importlib.invalidate_caches()
        return importlib.import_module(name)
    finally:
        sys.dont_write_bytecode = writes_bytecode
        sys.path.remove(str(tmp_path))


@pytest.fixture
def kernel_mod(tmp_path):
    return lambda text, name="kc_probe": _load_module(tmp_path, name, text)


ENV = {"numba-cuda": "0.30.4", "nvshmem4py-cu13": "0.4.1", "nvshmem_headers": {"version": "3.8.0"}}


def _key(kernel, argtypes=None, cc=CC, env=ENV):
    t = _types()
    argtypes = argtypes or (_c(t.int32), _c(t.int32), t.int64)
    return ck.kernel_key(kernel, argtypes, cc, env)


def test_key_is_stable_and_a_sha256(kernel_mod):
    mod = kernel_mod(KERNEL_V1)
    k1, k2 = _key(mod.make(128)), _key(mod.make(128))
    assert k1 == k2 and len(k1) == 64 and int(k1, 16) >= 0


def test_key_changes_with_kernel_source(kernel_mod):
    before = _key(kernel_mod(KERNEL_V1).make(128))
    after = _key(kernel_mod(KERNEL_V1.replace("* SCALE", "* SCALE + 1")).make(128))
    assert before != after


def test_key_changes_with_device_function_and_global_constant(kernel_mod):
    base = _key(kernel_mod(KERNEL_V1).make(128))
    assert _key(kernel_mod(KERNEL_V1.replace("return x + 1", "return x + 2")).make(128)) != base
    assert _key(kernel_mod(KERNEL_V1.replace("SCALE = 3", "SCALE = 4")).make(128)) != base


def test_key_follows_the_pdl_build():
    """The kernels call ``pdl_wait()``, built by ``make_pdl`` with the plan's ``pdl`` as a closure
    constant: a build with PDL on (the wait compiled in) and one with it off must not share a
    cache entry (a cached kernel without the wait, launched with the PDL attribute, would race
    its predecessor); the same build keys alike every time."""
    from ep_runtime.kernels.combine import make_combine_kernels
    from ep_runtime.kernels.variant import CombineVariant, Transport

    def key(on):
        wait = make_combine_kernels(CombineVariant(512, "uint64", False, Transport.STORES, on))["combine_wait"]
        return ck.kernel_key(wait, (), CC, ENV)

    assert key(False) != key(True)
    assert key(True) == key(True)


def test_key_changes_with_closure_constant(kernel_mod):
    mod = kernel_mod(KERNEL_V1)
    assert _key(mod.make(128)) != _key(mod.make(256))
    material = ck.key_material(mod.make(256), (_c(_types().int32),) * 2 + (_types().int64,), CC, ENV)
    assert material["code"]["closure"]["threads"] == ["int", 256]


def test_key_changes_with_kernel_package_source(kernel_mod, tmp_path, monkeypatch):
    pkg = tmp_path / "kc_fake_kernels"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "bits.py").write_text("A = 1\n")
    sys.path.insert(0, str(tmp_path))
    monkeypatch.setattr(ck, "KERNEL_PACKAGE", "kc_fake_kernels")
    try:
        kern = kernel_mod(KERNEL_V1).make(128)
        before = _key(kern)
        (pkg / "bits.py").write_text("A = 2\n")  # a file the kernel does not even name
        assert _key(kern) != before
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("kc_fake_kernels", None)


def test_key_changes_with_argtypes_cc_and_versions(kernel_mod):
    t = _types()
    kern = kernel_mod(KERNEL_V1).make(128)
    base = _key(kern)
    assert _key(kern, argtypes=(_c(t.int64), _c(t.int32), t.int64)) != base
    assert _key(kern, argtypes=(_c(t.int32, 1, "A"), _c(t.int32), t.int64)) != base
    assert _key(kern, cc=(9, 0, "")) != base
    assert _key(kern, cc=(10, 0, "a")) != base
    for field, value in [("numba-cuda", "0.31.0"), ("nvshmem4py-cu13", "0.4.2"),
                         ("nvshmem_headers", {"version": "3.9.0"})]:
        assert _key(kern, env=dict(ENV, **{field: value})) != base, field


def test_environment_fingerprint_names_the_versions():
    env = ck.environment_fingerprint()
    assert env["numba-cuda"] == compile_gate.PINNED_NUMBA_CUDA
    assert env["nvshmem4py-cu13"] and env["nvshmem_headers"]["version"].startswith("3.")
    assert len(env["nvshmem_headers"]["sha256"]) == 64


def test_key_refuses_closures_it_cannot_describe(kernel_mod):
    mod = kernel_mod(KERNEL_V1.replace("if i < n and i < threads:", "if i < n and threads is not None:"))
    with pytest.raises(ck.NotCacheable, match="threads"):
        ck.key_material(mod.make(object()), (_c(_types().int32),) * 2 + (_types().int64,), CC, ENV)


def test_project_kernels_have_keys():
    from ep_runtime.tools import gate_entries as signatures

    keys = {name: ck.kernel_key(k, at, CC) for name, k, at in signatures.ep_kernel_entries()}
    assert len(set(keys.values())) == len(keys)  # one entry per kernel


# ------------------------------------------------------------------------------------------------
# a real linked kernel, as the compile gate builds it


@pytest.fixture(scope="module")
def linked():
    """(dispatcher, argtypes, _Kernel) of a real NVSHMEM kernel that waits (cooperative), linked
    for sm_90a on this CPU with the compile gate's compute-capability patch."""
    from numba.cuda.dispatcher import _Kernel

    from ep_runtime.kernels import selftest

    t = _types()
    argtypes = (_c(t.int32, 2), _c(t.uint64), t.int64, _c(t.int32, 2))  # as in ep_runtime/tools/gate_entries.py
    func, options = compile_gate._kernel_parts(selftest.wait_all_copy_out)
    with compile_gate._fixed_compute_capability(CC):
        kernel = _Kernel(func, argtypes, **options)
        kernel.library.get_cubin(cc=CC)
    return selftest.wait_all_copy_out, argtypes, kernel


def _fresh_dispatcher(dispatcher):
    from numba.cuda.dispatcher import CUDADispatcher

    return CUDADispatcher(dispatcher.py_func, targetoptions=dict(dispatcher.targetoptions))


def test_entry_round_trip_of_a_real_cubin(linked, tmp_path):
    from nvshmem.bindings.device.numba import _numbast

    dispatcher, argtypes, kernel = linked
    cache = kc.KernelCache(tmp_path)
    key = ck.kernel_key(dispatcher, argtypes, CC)
    entry = kc.entry_from_kernel(kernel, key, CC)
    cubin = bytes(kernel.library.get_cubin(cc=CC).code)
    assert entry.cubin == cubin and len(cubin) > 1000
    assert entry.meta["cooperative"] is True and kernel.cooperative
    n_setup = len(kernel.library._setup_functions)
    assert n_setup >= 1 and entry.meta["setup"] == ["nvshmem"] * n_setup
    assert cache.write(entry) == cache.path_for(key)

    back = cache.read(key)
    assert back is not None and back.cubin == cubin and back.meta == json.loads(json.dumps(entry.meta))

    rebuilt = kc.rebuild_kernel(back, argtypes)
    lib = rebuilt.library
    assert bytes(lib._cubin_cache[CC].code) == cubin
    assert rebuilt.entry_name == kernel.entry_name == lib._entry_name
    assert rebuilt.cooperative is True and lib.use_cooperative is True
    assert tuple(rebuilt.argument_types) == argtypes
    assert all(f is _numbast.shim_obj.setup_callback for f in lib._setup_functions)
    assert all(f is _numbast.shim_obj.teardown_callback for f in lib._teardown_functions)
    assert len(lib._setup_functions) == n_setup

    fresh = _fresh_dispatcher(dispatcher)
    start = time.perf_counter()
    got = cache.load_or_compile(fresh, argtypes, cc=CC, bind=False)
    assert got.library._cubin_cache[CC].code == cubin
    assert fresh.overloads[argtypes] is got
    assert fresh.compile(argtypes) is got  # the dispatcher's own lookup finds the cached kernel
    assert time.perf_counter() - start < 2.0 and cache.stats["hits"] == 1 and cache.stats["misses"] == 0


class _StubDispatcher:
    """A dispatcher whose compile() returns a prebuilt kernel and counts calls (no driver here)."""

    def __init__(self, dispatcher, kernel):
        self.py_func = dispatcher.py_func
        self.targetoptions = dispatcher.targetoptions
        self.__qualname__ = dispatcher.py_func.__qualname__
        self.overloads = {}
        self.compiled = 0
        self._kernel = kernel

    def compile(self, argtypes):
        self.compiled += 1
        self.overloads[tuple(argtypes)] = self._kernel
        return self._kernel

    def add_overload(self, kernel, argtypes):
        self.overloads[tuple(argtypes)] = kernel


BAD_ENTRIES = {
    "checksum": lambda data: data[:-10] + bytes([data[-10] ^ 0xFF]) + data[-9:],
    "truncated": lambda data: data[: len(data) - 1000],
    "bad magic": lambda data: b"garbage" + data[7:],
    "stale": lambda data: data.replace(b'"format": 1', b'"format": 0', 1),
    "corrupt header": lambda data: data[:20] + b"{{{" + data[23:],
}


@pytest.mark.parametrize("damage", sorted(BAD_ENTRIES))
def test_bad_entry_is_deleted_logged_and_rebuilt(linked, tmp_path, caplog, damage):
    dispatcher, argtypes, kernel = linked
    cache = kc.KernelCache(tmp_path)
    first = _StubDispatcher(dispatcher, kernel)
    assert cache.load_or_compile(first, argtypes, cc=CC, bind=False) is kernel
    assert first.compiled == 1 and cache.stats["stored"] == 1
    key = ck.kernel_key(dispatcher, argtypes, CC)
    path = cache.path_for(key)
    path.write_bytes(BAD_ENTRIES[damage](path.read_bytes()))

    second = _StubDispatcher(dispatcher, kernel)
    with caplog.at_level(logging.WARNING, logger="ep_runtime.shmem.kernel_cache"):
        assert cache.load_or_compile(second, argtypes, cc=CC, bind=False) is kernel
    assert second.compiled == 1, "a bad entry must be rebuilt by compiling"
    assert cache.stats["rejected"] == 1 and cache.stats["stored"] == 2
    assert any(damage in r.getMessage() and "deleting" in r.getMessage() for r in caplog.records), \
        [r.getMessage() for r in caplog.records]

    third = _StubDispatcher(dispatcher, kernel)
    got = cache.load_or_compile(third, argtypes, cc=CC, bind=False)
    assert third.compiled == 0 and got is not kernel and cache.stats["hits"] == 1  # the rebuilt entry loads


def test_entry_of_another_key_is_stale(linked, tmp_path):
    dispatcher, argtypes, kernel = linked
    cache = kc.KernelCache(tmp_path)
    entry = kc.entry_from_kernel(kernel, "a" * 64, CC)
    cache.path_for("b" * 64).write_bytes(entry.encode())
    with pytest.raises(kc.CacheEntryError, match="stale: entry key"):
        kc.CacheEntry.decode(cache.path_for("b" * 64).read_bytes(), "b" * 64)
    assert cache.read("b" * 64) is None and not cache.path_for("b" * 64).exists()


def test_unreadable_entry_is_a_miss(tmp_path, caplog):
    cache = kc.KernelCache(tmp_path)
    cache.path_for("c" * 64).mkdir()  # reading it fails (IsADirectoryError)
    with caplog.at_level(logging.WARNING, logger="ep_runtime.shmem.kernel_cache"):
        assert cache.read("c" * 64) is None
    assert cache.stats["rejected"] == 1 and "unreadable" in caplog.text


def test_missing_entry_is_a_plain_miss(tmp_path):
    cache = kc.KernelCache(tmp_path)
    assert cache.read("d" * 64) is None and cache.stats["rejected"] == 0


def test_uncacheable_kernels_are_compiled_not_stored(linked, tmp_path):
    dispatcher, argtypes, kernel = linked
    debug_kernel = SimpleNamespace(**{k: getattr(kernel, k) for k in ("extensions", "library")}, debug=True)
    with pytest.raises(ck.NotCacheable, match="debug"):
        kc.entry_from_kernel(debug_kernel, "e" * 64, CC)
    with pytest.raises(ck.NotCacheable, match="no linked cubin"):
        kc.entry_from_kernel(kernel, "e" * 64, (8, 0, ""))


def test_cache_dir_from_env(monkeypatch, tmp_path):
    monkeypatch.setenv(kc.CACHE_ENV, str(tmp_path / "k"))
    assert kc.KernelCache.from_env().directory == tmp_path / "k"
    monkeypatch.setenv(kc.CACHE_ENV, "off")
    assert kc.KernelCache.from_env() is None
    monkeypatch.delenv(kc.CACHE_ENV)
    assert kc.KernelCache.from_env().directory == kc.DEFAULT_DIR.expanduser()


# ------------------------------------------------------------------------------------------------
# atomic writes


def _entry(key, fill, size=200_000):
    return kc.CacheEntry(key, bytes([fill]) * size, {"entry_name": "k", "cooperative": False, "cc": [9, 0, "a"],
                                                      "setup": [], "teardown": []})


def _writer(directory, key, fill, rounds):
    cache = kc.KernelCache(directory)
    for _ in range(rounds):
        assert cache.write(_entry(key, fill)) is not None


def test_concurrent_writers_never_expose_a_partial_entry(tmp_path):
    key = "f" * 64
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_writer, args=(tmp_path, key, fill, 40)) for fill in (1, 2, 3)]
    for p in procs:
        p.start()
    cache = kc.KernelCache(tmp_path)
    seen = set()
    while any(p.is_alive() for p in procs):
        e = cache.read(key)
        if e is not None:
            assert len(set(e.cubin)) == 1  # one writer's bytes, whole
            seen.add(e.cubin[0])
    for p in procs:
        p.join()
        assert p.exitcode == 0
    assert cache.stats["rejected"] == 0, "a reader saw a partial entry"
    assert cache.read(key) is not None and seen
    assert [p.name for p in tmp_path.iterdir()] == [key + kc.SUFFIX]  # no temporary files left


def test_unwritable_directory_is_logged_not_raised(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    cache = kc.KernelCache(blocker / "sub")
    with caplog.at_level(logging.WARNING, logger="ep_runtime.shmem.kernel_cache"):
        assert cache.write(_entry("a" * 64, 1)) is None
    assert "cannot write" in caplog.text and cache.stats["stored"] == 0


# ------------------------------------------------------------------------------------------------
# fast launch: parameters, field by field, against numba-cuda's own argument preparation


class _FakeDeviceMemory:
    """What DeviceNDArray needs of its gpu_data to describe an allocation (no driver)."""

    def __init__(self, ptr):
        self.device_ctypes_pointer = ctypes.c_size_t(ptr)


def _devarray(shape, dtype, ptr, order="C", strides=None):
    from numba.cuda.cudadrv.devicearray import DeviceNDArray
    from numba.cuda.np import numpy_support

    dtype = np.dtype(dtype)
    if strides is None:
        strides = numpy_support.strides_from_shape(shape=shape, itemsize=dtype.itemsize,
                                                   c_contiguous=order == "C", f_contiguous=order == "F")
    return DeviceNDArray(shape, strides, dtype, gpu_data=_FakeDeviceMemory(ptr))


def _numba_params(argtypes, args):
    """What numba-cuda 0.30.4 passes to the driver: ``_Kernel._prepare_args`` for each argument,
    packed by cuda.core's ``ParamHolder`` (as ``cuda.core.launch`` does); one bytes per param."""
    from cuda.core._kernel_arg_handler import ParamHolder
    from numba.cuda.dispatcher import _Kernel

    kernel = _Kernel._rebuild(False, "probe", None, None, False, False, None, [])
    kernelargs, retr = [], []
    for ty, val in zip(argtypes, args):
        kernel._prepare_args(ty, val, 0, retr, kernelargs)
    holder = ParamHolder(kernelargs)
    pointers = (ctypes.c_void_p * len(kernelargs)).from_address(holder.ptr)
    out = []
    for k, v in enumerate(kernelargs):
        if isinstance(v, (bool, np.bool_)):
            size = 1
        elif isinstance(v, int):
            size = ctypes.sizeof(ctypes.c_void_p)  # intptr_t
        else:
            size = ctypes.sizeof(v)
        out.append(ctypes.string_at(pointers[k], size))
    return out


def _case():
    t = _types()
    argtypes = (_c(t.uint16, 2), _c(t.uint64), t.int64, t.int32, t.uint64, t.float32, t.float64, t.boolean,
                _c(t.float32, 3), _c(t.int8, 2, "F"), t.int64, t.uint8)
    args = (_devarray((4, 7), np.uint16, 0x7F0000001000), _devarray((9,), np.uint64, 0x7F0000200000),
            np.int64(-5), np.int32(-7), np.uint64(2**64 - 3), np.float32(1.5), -2.25, True,
            _devarray((2, 3, 5), np.float32, 0x7F0000300000), _devarray((3, 4), np.int8, 0x7F0000400000, "F"),
            123456789012, np.uint8(250))
    return argtypes, args


def test_params_match_numba_field_by_field():
    argtypes, args = _case()
    want = _numba_params(argtypes, args)
    buf = fl.ParamBuffer(argtypes)
    assert buf.pack(args)
    # arrays: 5 fields + shape + strides (9 + 7 + 11 + 9); scalars: one each (8)
    assert buf.n_params == len(want) == 36 + 8
    for k, w in enumerate(want):
        assert buf.slot_bytes(k)[: len(w)] == w, f"parameter {k}"
    # and the pointer array the driver reads points at the slots, in order
    assert [buf.pointers[k] for k in range(buf.n_params)] == \
        [ctypes.addressof(buf.slots) + 8 * k for k in range(buf.n_params)]
    assert buf.address == ctypes.addressof(buf.pointers)


def test_params_as_one_block_only_where_every_parameter_is_8_bytes():
    """The ``extra`` block the driver copies in one piece is the slots themselves, which is the
    kernel's parameter layout only when every parameter is 8 bytes; a 4- or 1-byte scalar
    (packed at its own alignment by the ABI) leaves the launcher on a pointer per parameter."""
    t = _types()
    wide = (_c(t.uint16, 2), t.int64, _c(t.float32, 3), t.uint64, t.float64)
    buf = fl.ParamBuffer(wide)
    assert buf.abi_block and buf.n_params == 9 + 1 + 11 + 1 + 1
    extra = (ctypes.c_void_p * 5).from_address(buf.extra)
    size = ctypes.c_size_t.from_address(extra[3]).value
    assert [extra[0], extra[2], extra[4]] == [1, 2, None]  # BUFFER_POINTER, BUFFER_SIZE, END
    assert extra[1] == ctypes.addressof(buf.slots) and size == 8 * buf.n_params
    for narrow in (t.int32, t.float32, t.boolean, t.uint8):
        b = fl.ParamBuffer(wide + (narrow,))
        assert not b.abi_block and b.extra is None
    argtypes, _ = _case()
    assert fl.ParamBuffer(argtypes).extra is None  # int32, float32, bool, uint8 among them


def test_params_follow_new_objects_and_skip_unchanged_ones():
    argtypes, args = _case()
    buf = fl.ParamBuffer(argtypes)
    assert buf.pack(args)
    buf.slots[buf.offsets[2]] = 99  # same object next call: the slot is not rewritten
    assert buf.pack(args) and buf.slots[buf.offsets[2]] == 99
    moved = list(args)
    moved[0] = _devarray((6, 7), np.uint16, 0x7F0000900000)
    moved[2] = np.int64(11)
    assert buf.pack(tuple(moved))
    want = _numba_params(argtypes, moved)
    for k in list(range(0, 9)) + [buf.offsets[2]]:
        assert buf.slot_bytes(k)[: len(want[k])] == want[k], f"parameter {k}"
    buf.forget_args()
    assert buf.pack(args) and buf.slots[buf.offsets[2]] == -5


def test_a_failed_pack_does_not_let_the_last_tuple_skip_its_checks():
    """The last tuple packed whole is skipped when it comes again; a pack that fails part way
    (slot 0 rewritten, then a bad argument) must make it be checked again."""
    argtypes, args = _case()
    buf = fl.ParamBuffer(argtypes)
    assert buf.pack(args) and buf.pack(args)
    good = buf.slot_bytes(4)  # the first array's data pointer
    half = list(args)
    half[0] = _devarray((6, 7), np.uint16, 0x7F0000900000)
    half[2] = "not an int64"
    assert not buf.pack(tuple(half))
    assert buf.slot_bytes(4) != good
    assert buf.pack(args) and buf.slot_bytes(4) == good


WRONG_ARGS = {
    "array of another dtype": (0, lambda: _devarray((4, 7), np.int16, 0x1000)),
    "array of another ndim": (0, lambda: _devarray((4, 7, 1), np.uint16, 0x1000)),
    "F-ordered array for C": (0, lambda: _devarray((4, 7), np.uint16, 0x1000, "F")),
    "not a Numba device array": (1, lambda: SimpleNamespace(__cuda_array_interface__={})),
    "int32 for int64": (2, lambda: np.int32(1)),
    "bool for int64": (2, lambda: True),
    "Python int for int32": (3, lambda: 5),
    "Python float for float32": (5, lambda: 1.5),
    "int for boolean": (7, lambda: 1),
}


@pytest.mark.parametrize("case", sorted(WRONG_ARGS))
def test_params_refuse_what_numba_would_type_differently(case):
    argtypes, args = _case()
    index, make = WRONG_ARGS[case]
    bad = list(args)
    bad[index] = make()
    assert fl.ParamBuffer(argtypes).pack(args)
    assert not fl.ParamBuffer(argtypes).pack(tuple(bad))
    assert not fl.ParamBuffer(argtypes).pack(args[:-1])  # wrong count


def test_unsupported_types_and_kernels():
    t = _types()
    with pytest.raises(fl.Unsupported, match="argument 1"):
        fl.ParamBuffer((t.int64, t.complex64))
    with pytest.raises(fl.Unsupported, match="read-only"):
        fl.ParamBuffer((t.Array(t.int32, 1, "C", readonly=True),))
    base = dict(debug=False, extensions=[], launch_config_sensitive=False)
    for field, value, why in [("debug", True, "debug"), ("extensions", [object()], "extensions"),
                              ("launch_config_sensitive", True, "launch-config")]:
        with pytest.raises(fl.Unsupported, match=why):
            fl.FastLauncher(SimpleNamespace(**dict(base, **{field: value})), 0)


def test_session_launch_prefers_the_fast_launcher_and_falls_back():
    from ep_runtime.shmem.nvshmem_session import NvshmemSession

    calls = []

    class Kernel:
        def __getitem__(self, cfg):
            return lambda *args: calls.append(("numba", cfg, args))

    class Launcher:
        def __init__(self, accept):
            self.accept = accept

        def launch(self, grid, block, args):
            if self.accept:
                calls.append(("fast", grid, block, args))
            return self.accept

    session = NvshmemSession.__new__(NvshmemSession)
    session._numba_stream = "stream"
    session.launch_counts = {"fast": 0, "numba": 0}
    session.fast_launch = True
    kern = Kernel()
    session._fast = {id(kern): [(kern, Launcher(True))]}
    session.launch(kern, 4, 32, (1,))
    session._fast = {id(kern): [(kern, Launcher(False))]}  # arguments it cannot take: Numba's path
    session.launch(kern, 4, 32, (2,))
    session._fast = {id(kern): [(kern, Launcher(True))]}
    session.fast_launch = False
    session.launch(kern, 4, 32, (3,))
    assert calls == [("fast", 4, 32, (1,)), ("numba", (4, 32, "stream"), (2,)), ("numba", (4, 32, "stream"), (3,))]
    assert session.launch_counts == {"fast": 1, "numba": 2}


@pytest.mark.parametrize("cooperative, uses_block", [(False, True), (True, False)])
def test_launcher_hands_the_driver_the_block_or_the_pointers(cooperative, uses_block):
    """A launch passes ``extra`` = the parameter block (kernelParams NULL) where every parameter is
    8 bytes, else ``kernelParams`` = the pointer array (extra NULL); cooperative launches have no
    extra."""
    driver = pytest.importorskip("cuda.bindings.driver")
    t = _types()
    argtypes = (_c(t.uint16, 2), t.int64)
    kernel = SimpleNamespace(debug=False, extensions=[], launch_config_sensitive=False, entry_name="k",
                             cooperative=cooperative, argument_types=argtypes,
                             library=SimpleNamespace(get_cufunc=lambda: SimpleNamespace(handle=driver.CUfunction())))
    launcher = fl.FastLauncher(kernel, 0)
    assert launcher.param_block == uses_block
    seen = []
    launcher._launch = lambda *a: seen.append(a) or (driver.CUresult.CUDA_SUCCESS,)
    assert launcher.launch(2, 32, (_devarray((4, 7), np.uint16, 0x7F0000001000), np.int64(3)))
    params = launcher.params
    if cooperative:  # cuLaunchCooperativeKernel(f, grid, block, shared, stream, kernelParams)
        assert seen[0][-1] == params.address
    else:  # cuLaunchKernel(f, grid, block, shared, stream, kernelParams, extra)
        assert seen[0][-2:] == ((0, params.extra) if uses_block else (params.address, 0))
    assert params.slots[params.offsets[1]] == 3
