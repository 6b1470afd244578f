"""Negative control for the compile-and-link gate: every entry here must FAIL.

Run: ``python -m ep_runtime.tools.compile_gate --entries tests/gate_negative.py`` (exit status 1).
If one of these ever compiles, the gate is no longer checking what it claims (for instance a
numba-cuda upgrade changed the private API it patches). tests/test_compile_gate.py checks that
each fails with its own error (``EXPECTED_ERRORS`` there), so a broken environment does not pass
as a "failure".
"""

from numba import cuda, types

from ep_runtime.kernels import shmem


@cuda.jit
def neg_put_signal_int64_signal(dst, src, sig, pe):
    # NVSHMEM signals are uint64: nvshmem4py has no overload for an int64 signal array.
    shmem.put_signal(dst, src, sig[0:1], 1, shmem.SIGNAL_SET, pe)


@cuda.jit
def neg_put_mixed_dtypes(dst, src, pe):
    # A put needs dst and src of one dtype (bf16 travels as uint16, never as int16 <- uint16).
    shmem.put(dst, src, pe)


_no_such_symbol = cuda.declare_device("ep_gate_no_such_symbol", "int32(int32)")


@cuda.jit
def neg_unresolved_extern(out, pe):
    # Types and lowers fine; only the link can fail: proves the gate really links.
    out[0] = _no_such_symbol(pe)


def _c(dtype, ndim=1):
    return types.Array(dtype, ndim, "C")


def gate_entries():
    return [
        ("neg_put_signal_int64_signal", neg_put_signal_int64_signal,
         (_c(types.uint16), _c(types.uint16), _c(types.int64), types.int32)),
        ("neg_put_mixed_dtypes", neg_put_mixed_dtypes,
         (_c(types.uint16), _c(types.int16), types.int32)),
        ("neg_unresolved_extern", neg_unresolved_extern, (_c(types.int32), types.int32)),
    ]
