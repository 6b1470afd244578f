"""The NVRTC compile of nvshmem4py's shim is memoized per process (ep_runtime/shmem/shim_memo.py):
the same arguments give the first compile's object, any other argument compiles again, a failed
compile is not kept, and install() puts the memo where numba-cuda's linker calls it."""

from __future__ import annotations

import pytest

from ep_runtime.shmem import shim_memo

CC = (9, 0, "a")


def _counting(fail_first: bool = False):
    calls = []

    def compile_fn(src, name, cc, ltoir=False, lineinfo=False, debug=False):
        calls.append((src, name, cc, ltoir, lineinfo, debug))
        if fail_first and len(calls) == 1:
            raise RuntimeError("NVRTC error")
        return object(), f"log {len(calls)}"

    return compile_fn, calls


def test_the_same_arguments_reuse_the_first_compile():
    compile_fn, calls = _counting()
    memo = shim_memo.memoize(compile_fn)
    first = memo("#include <nvshmem.h>", "shim.cu", CC, ltoir=True)
    assert memo("#include <nvshmem.h>", "shim.cu", list(CC), ltoir=True) is first
    assert len(calls) == 1


@pytest.mark.parametrize("change", [dict(src="#include <nvshmem.h>\n// more"), dict(name="other.cu"),
                                    dict(cc=(9, 0, "")), dict(ltoir=False), dict(lineinfo=True), dict(debug=True)])
def test_any_other_argument_compiles_again(change):
    compile_fn, calls = _counting()
    memo = shim_memo.memoize(compile_fn)
    base = dict(src="#include <nvshmem.h>", name="shim.cu", cc=CC, ltoir=True, lineinfo=False, debug=False)
    first = memo(**base)
    other = memo(**{**base, **change})
    assert other is not first and len(calls) == 2


def test_a_failed_compile_is_not_kept():
    compile_fn, calls = _counting(fail_first=True)
    memo = shim_memo.memoize(compile_fn)
    with pytest.raises(RuntimeError, match="NVRTC error"):
        memo("src", "shim.cu", CC, ltoir=True)
    obj, log = memo("src", "shim.cu", CC, ltoir=True)
    assert log == "log 2" and memo("src", "shim.cu", CC, ltoir=True)[0] is obj and len(calls) == 2


def test_install_puts_the_memo_where_the_linker_calls_it():
    from numba.cuda.cudadrv import driver, nvrtc

    assert shim_memo.install() and shim_memo.install()  # idempotent
    assert hasattr(nvrtc.compile, "memo") and not hasattr(nvrtc.compile.__wrapped__, "memo")
    # numba-cuda's Linker.add_cu calls nvrtc.compile through the module, so the memo is the one called
    assert driver.nvrtc is nvrtc
