"""The compile gate's atomics check (ep_runtime.tools.gate_atomics) on PTX written as the compilers
write it: the global atomics on shared memory numba-cuda-mlir 0.6.0 emitted (an immediate address,
a shared-window address through a chain of arithmetic, a shared variable), and the correct forms
that must pass (a global array's atomic, a shared atomic, the inline-PTX shared atomic of
ep_runtime.kernels.mlir_intrinsics)."""

from ep_runtime.tools.gate_atomics import global_atomics_on_shared

HEADER = """.version 8.8
.target sm_90a
.address_size 64
.shared .align 8 .b8 static_shared_memory_1[32];
"""


def _kernel(body: str, name: str = "k") -> str:
    return HEADER + f".visible .entry {name}(\n\t.param .u64 {name}_param_0\n)\n{{\n{body}\n\tret;\n}}\n"


def test_an_immediate_address_is_reported():
    # relay.chunk_mask's cuda.atomic.or_(cmask, 0, ...) on numba-cuda-mlir 0.6.0
    ptx = _kernel("\tatom.global.or.b32 \t%r88, [0], %r87;")
    assert global_atomics_on_shared(ptx) == ["atom.global.or.b32 \t%r88, [0], %r87;"]


def test_a_shared_window_address_through_arithmetic_is_reported():
    # an inlined device function's atomic on a shared array: the generic address of the window,
    # an index added in two steps, then a global atomic on it
    ptx = _kernel("""\tmov.u64 \t%rd6, static_shared_memory_1;
\tcvta.shared.u64 \t%rd7, %rd6;
\tmul.wide.s32 \t%rd5, %r1, 4;
\tadd.s64 \t%rd2157, %rd7, %rd5;
\tadd.s64 \t%rd2158, 0, %rd2157;
\t@%p3 atom.global.or.b32 \t%r257, [%rd2158], %r59;""")
    assert global_atomics_on_shared(ptx) == ["@%p3 atom.global.or.b32 \t%r257, [%rd2158], %r59;"]


def test_an_offset_from_a_constant_address_is_reported():
    # numba-cuda-mlir's dispatch_async: ranking's shared masks at window offset 0, folded to a constant
    ptx = _kernel("""\tld.param.u64 \t%rd2155, [k_param_0];
\tcvt.s64.s32 \t%rd2156, %r58;
\tshl.b64 \t%rd2157, %rd2156, 2;
\tadd.s64 \t%rd2158, 0, %rd2157;
\tatom.global.or.b32 \t%r257, [%rd2158], %r59;""")
    assert global_atomics_on_shared(ptx) == ["atom.global.or.b32 \t%r257, [%rd2158], %r59;"]


def test_a_shared_variable_and_a_reduction_are_reported():
    ptx = _kernel("""\tmov.u64 \t%rd1, static_shared_memory_1;
\tred.global.add.u32 \t[%rd1+8], 1;
\tatom.global.add.u32 \t%r1, [static_shared_memory_1+4], 1;""")
    assert len(global_atomics_on_shared(ptx)) == 2


def test_global_and_shared_atomics_pass():
    ptx = _kernel("""\tld.param.u64 \t%rd1, [k_param_0];
\tcvta.to.global.u64 \t%rd4, %rd1;
\tadd.s64 \t%rd8, %rd4, 16;
\tatom.global.add.u64 \t%rd9, [%rd8], 1;
\tmov.u64 \t%rd6, static_shared_memory_1;
\tadd.s64 \t%rd13, %rd6, 4;
\tatom.shared.or.b32 \t%r3, [%rd13], 2;
\tcvta.shared.u64 \t%rd7, %rd6;
\t{ .reg .u64 %sa; cvta.to.shared.u64 %sa, %rd7; atom.shared.or.b32 %r1, [%sa], %r6; }
\tatom.or.b32 \t%r4, [%rd7], 1;""")
    assert global_atomics_on_shared(ptx) == []


def test_registers_are_followed_within_their_function_only():
    # the same register name in another function holds a global address there
    first = _kernel("\tmov.u64 \t%rd1, static_shared_memory_1;\n\tcvta.shared.u64 \t%rd2, %rd1;", "a")
    second = _kernel("\tld.param.u64 \t%rd2, [b_param_0];\n\tatom.global.add.u32 \t%r1, [%rd2], 1;", "b")
    assert global_atomics_on_shared(first + second.replace(HEADER, "")) == []
