"""Blockwise FP8 token formats (issue #6): the device conversions and the NumPy reference.

(a) ep_runtime/kernels/fp8.py on Numba's CUDA simulator, against ``ml_dtypes``: every bf16 bit pattern
    divided by a few scales, float32 values on and next to every E4M3 rounding boundary and the
    specials, all 256 codes, the scales of every bf16 amax, and whole tokens encoded into
    messages and decoded by a device kernel, compared with :mod:`ep_runtime.core.formats`. The
    simulator is chosen when numba is imported, so it runs in one subprocess
    (``NUMBA_ENABLE_CUDASIM=1``) that imports this module and saves what the kernels wrote.
(b) ep_runtime.core.formats: message layouts, hidden validation, round trips, zero and non-finite
    blocks, scales against an independent exact computation, the stated error bound.
(c) the test kernels (hence every device function) compile and link to an sm_90a cubin on a
    CPU-only machine through ep_runtime.tools.compile_gate, and the device functions' PTX has no
    float64 (with a control that does). Another subprocess, without the simulator.

The simulator is slow per converted value (one simulated thread per block: more threads per
block only add GIL contention), so (a) converts ~230k values, seconds of CPU.
"""

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from numba import uint32, uint64

from ep_runtime.core import formats as F
from ep_runtime.core.errors import EPConfigError, EPInputError
from ep_runtime.kernels import fp8
from ep_runtime.kernels.bits import bf16_to_f32, f32_bits
from ep_runtime.kernels.cuda_api import cuda

REPO = Path(__file__).resolve().parents[1]
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
BF16 = np.dtype(ml_dtypes.bfloat16)
FP8_FORMATS = (F.FP8_E4M3, F.FP8_E4M3_UE8M0)
#: Limit of each subprocess (the simulator run takes ~15 s on a 2-core CI machine).
SUBPROCESS_TIMEOUT_S = 300
#: Simulator launch shape: few threads (see the module docstring), strided loops.
SIM_GRID, SIM_BLOCK = 2, 2
#: Divisors of the all-bf16 sweep: 1 puts every E4M3 value, rounding midpoint and subnormal
#: step on a bf16 value; 3 and 0.1 give full float32 mantissas (sticky bits, near-ties) and,
#: for 0.1, overflow to inf.
SWEEP_SCALES = (1.0, 3.0, 0.1)
#: Hidden size of the simulated tokens: a multiple of 128, not of 1024.
SIM_HIDDEN = 384


# -- inputs (built identically in the simulator process and here) ------------------------------
def bf16_sweep() -> np.ndarray:
    """Every bf16 bit pattern, as float32 [65536]."""
    return (np.arange(1 << 16, dtype=np.uint32) << 16).view(np.float32)


#: UE8M0 codes of the power-of-two quantization check: the extremes (2**-127, a float32
#: subnormal, and 2**127), around 1, and NaN.
POW2_CODES = (0, 1, 2, 100, 126, 127, 128, 200, 252, 253, 254, 255)


def pow2_words() -> np.ndarray:
    """[64] uint64 words of 4 bf16 values: every 257th bf16 pattern (both signs, every exponent,
    inf), so quotients span subnormal to overflow at the extreme scales."""
    bits = (np.arange(256, dtype=np.uint64) * np.uint64(257)).astype(np.uint16)
    return bits.view(np.uint64).copy()


def e4m3_points() -> tuple[np.ndarray, np.ndarray]:
    """(values, midpoints) float64: the 127 non-negative finite E4M3 values, and the rounding
    boundaries between neighbours plus 464 (between 448 and the absent 480)."""
    values = np.arange(0x7F, dtype=np.uint8).view(E4M3).astype(np.float64)
    mids = np.concatenate([(values[:-1] + values[1:]) / 2, [464.0]])
    return values, mids


def edge_values() -> np.ndarray:
    """float32 values on, just below and just above every E4M3 value and rounding boundary,
    and the specials (zeros, infinities, NaNs with payloads, float32 subnormals and extremes),
    with both signs."""
    values, mids = e4m3_points()
    pts = np.concatenate([values, mids, [480.0, 496.0, 1e10, 2.0**-126, 2.0**-127]]).astype(np.float32)
    with np.errstate(all="ignore"):
        near = np.concatenate([pts, np.nextafter(pts, np.float32(np.inf)), np.nextafter(pts, np.float32(0))])
    specials = np.array([0x7F800000, 0x7F800001, 0x7FA00000, 0x7FC00000, 0x7FFFFFFF, 0x7F7FFFFF,
                         0x00000001, 0x007FFFFF, 0x00800000, 0x3A800000, 0x3A800001, 0x3A7FFFFF],
                        np.uint32).view(np.float32)
    v = np.concatenate([near, specials])
    return np.concatenate([v, -v])


def amax_values() -> np.ndarray:
    """float32 amaxes: every non-negative bf16 pattern (NaNs and inf included), and float32
    values on and next to each UE8M0 threshold 448 * 2**k, and float32 subnormals."""
    bf = (np.arange(0x8000, dtype=np.uint32) << 16).view(np.float32)
    thresholds = np.array([448.0 * 2.0**k for k in range(-127, 120)], np.float32)
    with np.errstate(all="ignore"):
        near = np.concatenate([thresholds, np.nextafter(thresholds, np.float32(np.inf)),
                               np.nextafter(thresholds, np.float32(0))])
    subnormals = np.array([1, 2, 3, 0x12345, 0x7FFFFF], np.uint32).view(np.float32)
    return np.concatenate([bf, near, subnormals, [np.finfo(np.float32).max]]).astype(np.float32)


def token_cases(T: int = 6, H: int = SIM_HIDDEN) -> np.ndarray:
    """[T, H] uint16 bf16 tokens whose 128-element blocks cover the cases: random values of
    magnitudes 2**-30 .. 2**30, all-zero blocks (+0 and -0), NaN and -inf blocks, values near
    the bf16 maximum, an amax exactly on and just past a UE8M0 threshold (56 = 448 / 8), bf16
    subnormals, amax below 2**-118 (the UE8M0 floor), and E4M3 rounding ties at scale 1."""
    rng = np.random.default_rng(6)
    nb = H // 128
    mags = 2.0 ** rng.integers(-30, 31, size=(T, nb, 1))
    x = (rng.standard_normal((T, nb, 128)) * mags).reshape(T, H).astype(BF16).view(np.uint16)
    x[1, 0:128] = 0
    x[1, 128:256] = rng.choice(np.array([0x0000, 0x8000], np.uint16), 128)
    x[2, 5] = 0x7FC0                       # NaN in block 0
    x[2, 200] = 0xFF80                     # -inf in block 1
    x[3, 0:128] = rng.integers(0x7F00, 0x7F80, 128) | rng.choice(np.array([0, 0x8000], np.uint16), 128)
    x[3, 128:384] = 0x3F00                 # 0.5
    x[3, 130] = 0x4260                     # 56: block 1's amax on the threshold 448 * 2**-3
    x[3, 300] = 0xC261                     # -(56 + 1 bf16 ulp): block 2's amax just past it
    x[4, 0:128] = rng.integers(1, 0x80, 128) | rng.choice(np.array([0, 0x8000], np.uint16), 128)
    x[4, 128:256] = rng.integers(0x0001, 0x0200, 128)
    x[4, 256:384] = rng.integers(0x0400, 0x0480, 128)                  # ~2**-119 .. 2**-118
    values, mids = e4m3_points()
    ties = np.concatenate([mids[:-1], values])[rng.permutation(253)[:127]]
    x[5, 0:127] = (ties * rng.choice([-1.0, 1.0], 127)).astype(BF16).view(np.uint16)
    x[5, 127] = np.float32(448.0).astype(BF16).view(np.uint16)          # scale exactly 1
    return x


# -- test kernels ----------------------------------------------------------------------------------
@cuda.jit
def sweep_kernel(xs, scales, out):
    """out[s, i] = e4m3_quantize(xs[i], scales[s]): xs [N] float32, scales [S] float32,
    out [S, N] uint32. Each thread takes every gridsize-th i."""
    for s in range(scales.shape[0]):
        for i in range(cuda.grid(1), xs.shape[0], cuda.gridsize(1)):
            out[s, i] = fp8.e4m3_quantize(xs[i], scales[s])


@cuda.jit
def bits_kernel(xs, out):
    """out[i] = e4m3_bits(xs[i]): xs [N] float32, out [N] uint32."""
    for i in range(cuda.grid(1), xs.shape[0], cuda.gridsize(1)):
        out[i] = fp8.e4m3_bits(xs[i])


@cuda.jit
def decode_kernel(codes, values, scales):
    """values[i] = e4m3_value(codes[i]), scales[i] = ue8m0_value(codes[i]): codes [N] uint32."""
    for i in range(cuda.grid(1), codes.shape[0], cuda.gridsize(1)):
        values[i] = fp8.e4m3_value(codes[i])
        scales[i] = fp8.ue8m0_value(codes[i])


@cuda.jit
def scale_kernel(amax, e4m3_scales, ue8m0_scales, ue8m0_codes, e4m3_inverses):
    """Both scale rules and FP8_E4M3's multiplier for each amax [N] float32 (float32, float32,
    uint32, float32 outputs)."""
    for i in range(cuda.grid(1), amax.shape[0], cuda.gridsize(1)):
        e4m3_scales[i] = fp8.e4m3_scale(amax[i])
        e4m3_inverses[i] = fp8.e4m3_inverse(amax[i])
        s, c = fp8.ue8m0_scale(amax[i])
        ue8m0_scales[i] = s
        ue8m0_codes[i] = c


@cuda.jit
def pow2_kernel(words, codes, inverses, by_division, by_product):
    """For each UE8M0 code (``codes`` [C] uint32): its exact reciprocal (``inverses`` [C]
    float32), and each bf16 word (``words`` [N] uint64, 4 values) quantized by division by the
    scale (``quantize4_software``) and by multiplication with the reciprocal
    (``quantize4_by_software``, the encoder's UE8M0 path): ``by_*`` [C, N] uint32."""
    for c in range(cuda.grid(1), codes.shape[0], cuda.gridsize(1)):
        scale = fp8.ue8m0_value(codes[c])
        inv = fp8.ue8m0_inverse(codes[c])
        inverses[c] = inv
        for w in range(words.shape[0]):
            by_division[c, w] = fp8.quantize4_software(words[w], scale)
            by_product[c, w] = fp8.quantize4_by_software(words[w], scale, inv)


@cuda.jit
def rows_kernel(tokens, ue8m0, messages, decoded):
    """Encode each token into its message and decode it back, one thread per token.

    tokens [T, H/4] uint64 (4 bf16 per word); ue8m0 (int): 0 FP8_E4M3, 1 FP8_E4M3_UE8M0;
    messages [T, W] uint64 in the formats' layout (codes of block j in words 16 j .. 16 j + 15,
    then the scales packed little-endian from word H / 8, zero padding to a word pair);
    decoded [T, H] float32.
    """
    n_words = tokens.shape[1]
    H = n_words * 4
    payload_words = H // 8
    per_word = 8 if ue8m0 else 2  # scales per message word
    for t in range(cuda.grid(1), tokens.shape[0], cuda.gridsize(1)):
        scale_word = uint64(0)
        for j in range(H // 128):
            acc = uint32(0)
            for w in range(32 * j, 32 * j + 32):
                acc = fp8.bf16_abs_max(acc, tokens[t, w])
            amax = bf16_to_f32(acc)
            if ue8m0:
                scale, code = fp8.ue8m0_scale(amax)
                inv = fp8.ue8m0_inverse(code)
                scale_word |= uint64(code) << uint64(8 * (j % 8))
            else:
                scale = fp8.e4m3_scale(amax)
                inv = fp8.e4m3_inverse(amax)
                scale_word |= uint64(f32_bits(scale)) << uint64(32 * (j % 2))
            if (j + 1) % per_word == 0 or j == H // 128 - 1:
                messages[t, payload_words + j // per_word] = scale_word
                scale_word = uint64(0)
            for m in range(16):
                w0 = tokens[t, 32 * j + 2 * m]
                w1 = tokens[t, 32 * j + 2 * m + 1]
                lo = fp8.quantize4_by_software(w0, scale, inv)  # the encoder's rule, in software
                hi = fp8.quantize4_by_software(w1, scale, inv)
                messages[t, 16 * j + m] = fp8.pack8(lo, hi)
            if ue8m0:  # decode with the scale the stored code stands for
                scale = fp8.ue8m0_value(code)
            for h in range(128 * j, 128 * j + 128):
                decoded[t, h] = fp8.e4m3_value(fp8.code_at(messages[t, h // 8], h % 8)) * scale
        for w in range(payload_words + (H // 128 + per_word - 1) // per_word, messages.shape[1]):
            messages[t, w] = 0  # the padding to a word pair


def f64_control(x):
    """A float32 function that computes in float64 (the Python constant is a double): its PTX
    must show .f64, or the PTX check below sees nothing."""
    return x * 0.1


# -- the two subprocesses --------------------------------------------------------------------------
def simulate_main(path: str) -> None:
    """Simulator process: run every test kernel and save what it wrote to ``path`` (.npz)."""
    from numba.cuda import config

    from ep_runtime.shmem import sim_block

    assert config.ENABLE_CUDASIM, "run with NUMBA_ENABLE_CUDASIM=1"
    sim_block.install()  # the simulated threads take the launcher's NumPy error state
    out, seconds = {}, {}

    def launch(name, kernel, *args):
        start = time.perf_counter()
        # x / scale overflows to inf on purpose (scale 0.1), and NaN inputs are swept: a GPU
        # raises nothing, and a warning per simulated operation would cost most of the sweep
        with np.errstate(all="ignore"):
            kernel[SIM_GRID, SIM_BLOCK](*args)
        seconds[name] = time.perf_counter() - start

    xs, scales = bf16_sweep(), np.array(SWEEP_SCALES, np.float32)
    out["sweep"] = np.full((len(scales), len(xs)), 0xDEAD, np.uint32)
    launch("sweep", sweep_kernel, xs, scales, out["sweep"])
    edges = edge_values()
    out["edges"] = np.full(len(edges), 0xDEAD, np.uint32)
    launch("edges", bits_kernel, edges, out["edges"])
    codes = np.arange(256, dtype=np.uint32)
    out["values"], out["ue8m0_values"] = np.zeros(256, np.float32), np.zeros(256, np.float32)
    launch("decode", decode_kernel, codes, out["values"], out["ue8m0_values"])
    amax = amax_values()
    out["e4m3_scales"], out["ue8m0_scales"] = np.zeros_like(amax), np.zeros_like(amax)
    out["ue8m0_codes"] = np.full(len(amax), 0xDEAD, np.uint32)
    out["e4m3_inverses"] = np.full(len(amax), np.float32(-1.0))
    launch("scales", scale_kernel, amax, out["e4m3_scales"], out["ue8m0_scales"], out["ue8m0_codes"],
           out["e4m3_inverses"])
    words, pow2_codes = pow2_words(), np.array(POW2_CODES, np.uint32)
    out["pow2_inverses"] = np.zeros(len(pow2_codes), np.float32)
    out["pow2_division"] = np.full((len(pow2_codes), len(words)), 0xDEAD, np.uint32)
    out["pow2_product"] = np.full((len(pow2_codes), len(words)), 0xBEEF, np.uint32)
    launch("pow2", pow2_kernel, words, pow2_codes, out["pow2_inverses"], out["pow2_division"], out["pow2_product"])
    tokens = token_cases()
    for flag, fmt in enumerate(FP8_FORMATS):
        W = fmt.message_words(tokens.shape[1])
        out[f"messages_{fmt.name}"] = np.full((tokens.shape[0], W), 0xA5A5A5A5A5A5A5A5, np.uint64)
        out[f"decoded_{fmt.name}"] = np.full(tokens.shape, np.float32(-12345.0))
        launch(f"rows_{fmt.name}", rows_kernel, tokens.view(np.uint64), flag,
               out[f"messages_{fmt.name}"], out[f"decoded_{fmt.name}"])
    np.savez(path, **out)
    print("SIM_SECONDS " + json.dumps({k: round(v, 2) for k, v in seconds.items()}))


def _device_signatures():
    """(name, argument types) of each device function, for the PTX check."""
    from numba import types

    u8, u32, u64, i64, f32 = types.uint8, types.uint32, types.uint64, types.int64, types.float32
    return [("e4m3_bits", (f32,)), ("e4m3_value", (u32,)), ("e4m3_value", (u8,)),
            ("e4m3_quantize", (f32, f32)), ("e4m3_scale", (f32,)), ("ue8m0_scale", (f32,)),
            ("ue8m0_value", (u32,)), ("ue8m0_inverse", (u32,)), ("e4m3_inverse", (f32,)),
            ("quantize4_by_software", (u64, f32, f32)),
            ("bf16_abs_max", (u32, u64)), ("bf16_abs_max4", (u64, u64, u64, u64)),
            ("block_scale", (f32, types.boolean)), ("scaled_directly", (f32, f32)), ("quantize4_scaled", (u64, f32)),
            ("quantize4_scaled_software", (u64, f32)), ("pack4", (u32, u32, u32, u32)),
            ("pack8", (u32, u32)), ("code_at", (u64, i64))]


def _kernel_entries():
    from numba import types

    def c(dtype, ndim=1):
        return types.Array(dtype, ndim, "C")

    u32, u64, i64, f32 = types.uint32, types.uint64, types.int64, types.float32
    return [("sweep_kernel", sweep_kernel, (c(f32), c(f32), c(u32, 2))),
            ("bits_kernel", bits_kernel, (c(f32), c(u32))),
            ("decode_kernel", decode_kernel, (c(u32), c(f32), c(f32))),
            ("scale_kernel", scale_kernel, (c(f32), c(f32), c(f32), c(u32), c(f32))),
            ("pow2_kernel", pow2_kernel, (c(u64), c(u32), c(f32), c(u32, 2), c(u32, 2))),
            ("rows_kernel", rows_kernel, (c(u64, 2), i64, c(u64, 2), c(f32, 2)))]


def compile_main() -> None:
    """Compiler process: link each test kernel for sm_90a and collect the float64 lines of each
    device function's PTX; print one JSON line."""
    from numba import cuda as numba_cuda, types
    from numba.cuda.cudadrv import nvvm

    from ep_runtime.tools import compile_gate

    report = {"skip": None, "kernels": [], "f64_lines": {}, "control_f64_lines": []}
    try:
        nvvm.NVVM()
    except Exception as exc:  # noqa: BLE001 - no libnvvm: the capability is absent
        report["skip"] = f"the CUDA compiler (libnvvm) is not installed: {exc}"
        print(json.dumps(report))
        return
    for name, kernel, argtypes in _kernel_entries():
        r = compile_gate.compile_for_sm90(kernel, argtypes, name=name)
        report["kernels"].append({"name": r.name, "ok": r.ok, "cubin_bytes": r.cubin_bytes,
                                  "error": r.error, "seconds": round(r.seconds, 2)})

    def f64_lines(func, sig):
        ptx, _ = numba_cuda.compile_ptx(func, sig, device=True, cc=compile_gate.TARGET_CC[:2])
        return [ln.strip() for ln in ptx.splitlines() if ".f64" in ln and not ln.strip().startswith("//")]

    # WAR: compile_ptx compiles the callee device functions through the dispatcher, which asks the
    # driver for the compute capability; the gate's context manager answers it (CPU, no driver).
    with compile_gate._fixed_compute_capability():
        for name, sig in _device_signatures():
            report["f64_lines"][f"{name}{sig}"] = f64_lines(getattr(fp8, name).py_func, sig)
        report["control_f64_lines"] = f64_lines(f64_control, (types.float32,))
    print(json.dumps(report))


def _start(entry: str, *args: str, simulate: bool) -> subprocess.Popen:
    env = dict(os.environ)
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    env.pop("NUMBA_FORCE_CUDA_CC", None)
    if simulate:
        env["NUMBA_ENABLE_CUDASIM"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent)] + sys.path)
    code = f"import test_formats as t; t.{entry}(*{list(args)!r})"
    return subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _finish(proc: subprocess.Popen, what: str) -> str:
    try:
        stdout, stderr = proc.communicate(timeout=SUBPROCESS_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if proc.returncode != 0:
        pytest.fail(f"{what} process failed (rc={proc.returncode})\nstdout:\n{stdout[-3000:]}\n"
                    f"stderr:\n{stderr[-6000:]}")
    return stdout


@pytest.fixture(scope="module")
def device_processes(tmp_path_factory):
    """Start the simulator and the compiler processes together (CI has 2 cores)."""
    path = tmp_path_factory.mktemp("fp8_sim") / "out.npz"
    procs = {"sim": _start("simulate_main", str(path), simulate=True),
             "compile": _start("compile_main", simulate=False)}
    yield procs, path
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def sim(device_processes):
    procs, path = device_processes
    _finish(procs["sim"], "simulator")
    with np.load(path) as data:
        return {k: data[k] for k in data.files}


@pytest.fixture(scope="module")
def compiled(device_processes):
    procs, _ = device_processes
    lines = [ln for ln in _finish(procs["compile"], "compiler").splitlines() if ln.strip()]
    report = json.loads(lines[-1])
    if report["skip"]:
        pytest.skip(report["skip"])
    return report


# -- helpers ---------------------------------------------------------------------------------------
def ml_codes(x) -> np.ndarray:
    """E4M3 codes of float32 ``x`` by ml_dtypes (uint8)."""
    with np.errstate(all="ignore"):
        return np.asarray(x, np.float32).astype(E4M3).view(np.uint8)


def assert_same_floats(got, want, what: str):
    """Equal bit patterns, except that any NaN matches any NaN."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    same = (got.view(np.uint32) == want.view(np.uint32)) | (np.isnan(got) & np.isnan(want))
    bad = np.argwhere(~same)
    assert bad.size == 0, (f"{what}: {len(bad)} differ; first at {bad[0].tolist()}: got "
                           f"{got[tuple(bad[0])]!r} want {want[tuple(bad[0])]!r}")


def assert_same_codes(got, want, inputs, what: str):
    got, want = np.asarray(got).astype(np.uint32), np.asarray(want).astype(np.uint32)
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, (f"{what}: {bad.size} codes differ; first: input {inputs[bad[0]]!r} "
                           f"(bits {np.float32(inputs[bad[0]]).view(np.uint32):#010x}) got "
                           f"{got[bad[0]]:#04x} want {want[bad[0]]:#04x}")


def exact_e4m3_scale(amax: float) -> np.float32:
    """amax / 448 rounded once to float32. The float64 quotient cannot sit on a float32 rounding
    midpoint (x / 7 is exact or has a period-3 binary expansion, never 1000...0 over 29 bits),
    so rounding it again to float32 is the single correct rounding."""
    if not math.isfinite(amax):
        return np.float32(np.nan)
    return np.float32(1.0) if amax == 0 else np.float32(np.float64(amax) / 448.0)


def exact_ue8m0_code(amax: float) -> int:
    """Smallest k >= -127 with amax <= 448 * 2**k, by exact comparison; the code is k + 127."""
    if not math.isfinite(amax):
        return 255
    if amax == 0:
        return 127
    k = max(-127, math.frexp(amax)[1] - 12)
    while amax > math.ldexp(448.0, k):  # Python floats: both sides exact, so the test is exact
        k += 1
    assert k == -127 or amax > math.ldexp(448.0, k - 1)
    return k + 127


# == (a) device functions on the simulator ===========================================================
def test_sweep_of_every_bf16_pattern_matches_ml_dtypes(sim):
    xs = bf16_sweep()
    values, mids = e4m3_points()
    # the scale-1 sweep lands on every E4M3 value and every rounding boundary, both signs
    assert np.isin(np.concatenate([values, mids, -values, -mids]).astype(np.float32), xs).all()
    for s, scale in enumerate(np.array(SWEEP_SCALES, np.float32)):
        with np.errstate(all="ignore"):
            want = ml_codes(xs / scale)
        assert_same_codes(sim["sweep"][s], want, xs, f"e4m3_quantize(x, {scale})")
        assert len(np.unique(want)) == 256, f"scale {scale}: the sweep misses some codes"


def test_edge_values_match_ml_dtypes(sim):
    edges = edge_values()
    assert_same_codes(sim["edges"], ml_codes(edges), edges, "e4m3_bits")


def test_documented_conversions():
    """What ml_dtypes (and so e4m3_bits) does at the edges, as the docstrings state it."""
    cases = {448.0: 0x7E, 463.99997: 0x7E, 464.0: 0x7E, 464.00003: 0x7F, 480.0: 0x7F, 1e10: 0x7F,
             np.inf: 0x7F, -np.inf: 0xFF, np.nan: 0x7F, -np.nan: 0xFF, -0.0: 0x80, 2.0**-10: 0x00,
             -(2.0**-10): 0x80, 2.0**-9: 0x01, 3 * 2.0**-10: 0x02, 5 * 2.0**-10: 0x02}
    x = np.array(list(cases), np.float32)
    assert_same_codes(ml_codes(x), np.array(list(cases.values())), x, "ml_dtypes")


def test_decode_every_code(sim):
    codes = np.arange(256, dtype=np.uint8)
    assert_same_floats(sim["values"], codes.view(E4M3).astype(np.float32), "e4m3_value")
    nan_codes = (codes & 0x7F) == 0x7F
    assert (sim["values"].view(np.uint32)[nan_codes] == [0x7FC00000, 0xFFC00000]).all()
    want = np.array([np.ldexp(np.float32(1), int(c) - 127) for c in codes[:255]] + [np.nan], np.float32)
    assert_same_floats(sim["ue8m0_values"], want, "ue8m0_value")
    assert sim["ue8m0_values"].view(np.uint32)[0] == 0x00400000  # 2**-127, a float32 subnormal


def test_scales_of_every_amax(sim):
    amax = amax_values()
    e4m3_want = np.array([exact_e4m3_scale(float(a)) for a in amax], np.float32)
    codes_want = np.array([exact_ue8m0_code(float(a)) for a in amax], np.uint32)
    assert_same_floats(sim["e4m3_scales"], e4m3_want, "e4m3_scale")
    bad = np.flatnonzero(sim["ue8m0_codes"] != codes_want)
    assert bad.size == 0, f"ue8m0_scale: amax {amax[bad[0]]!r} gave code {sim['ue8m0_codes'][bad[0]]}, " \
                          f"want {codes_want[bad[0]]}"
    assert_same_floats(sim["ue8m0_scales"], F.ue8m0_value(codes_want.astype(np.uint8)), "ue8m0_scale value")
    # the device rule and the reference's agree, NaN bit patterns included
    ref_scale, _ = F.FLOAT32_SCALE.from_amax(amax)
    assert (sim["e4m3_scales"].view(np.uint32) == ref_scale.view(np.uint32)).all()
    assert (sim["ue8m0_codes"] == F.UE8M0_SCALE.from_amax(amax)[1]).all()

    # FP8_E4M3's multiplier: 448 / amax exactly as NumPy's float32 division, 1 for 0, and 0 (divide
    # instead) where that overflows or amax is not finite; the device and the reference agree
    with np.errstate(all="ignore"):
        want = np.float32(448.0) / amax
    want = np.where(amax == 0, np.float32(1.0), want)
    want = np.where(np.isfinite(amax) & np.isfinite(want), want, np.float32(0.0)).astype(np.float32)
    assert_same_floats(sim["e4m3_inverses"], want, "e4m3_inverse")
    assert_same_floats(F.FLOAT32_SCALE.inverse(amax, ref_scale), want, "FLOAT32_SCALE.inverse")
    finite = np.isfinite(amax) & (amax > 0)
    assert (want[finite] == 0).any() and (want[finite] != 0).any(), "both branches must be exercised"


def test_power_of_two_scales_quantize_by_their_exact_reciprocal(sim):
    """The encoder's UE8M0 path multiplies by ``ue8m0_inverse(code)`` (``quantize4_by``) instead
    of dividing by the scale, and FP8_E4M3_UE8M0's rule is unchanged by it: the reciprocal is
    exactly 2**(127 - code) (NaN for code 255), and the codes equal the division's for every
    word, at the extreme scales too (subnormal and overflowing quotients)."""
    codes = np.array(POW2_CODES)
    with np.errstate(all="ignore"):
        want = np.where(codes == 255, np.float32(np.nan), np.ldexp(np.float32(1.0), 127 - codes).astype(np.float32))
    assert_same_floats(sim["pow2_inverses"], want, "ue8m0_inverse")
    assert_same_floats(F.UE8M0_SCALE.inverse(None, codes.astype(np.uint8)), np.where(codes == 255, 0, want),
                       "UE8M0_SCALE.inverse")
    assert (sim["pow2_division"] != 0xDEAD).all() and (sim["pow2_product"] != 0xBEEF).all(), "not written"
    bad = np.argwhere(sim["pow2_division"] != sim["pow2_product"])
    assert bad.size == 0, (f"{len(bad)} words differ; first: code {codes[bad[0][0]]}, word "
                           f"{pow2_words()[bad[0][1]]:#018x}")
    # and the check has teeth: every scale gives other codes
    assert len({tuple(row) for row in sim["pow2_product"].tolist()}) == len(codes)


@pytest.mark.parametrize("fmt", FP8_FORMATS, ids=lambda f: f.name)
def test_device_messages_match_reference(sim, fmt):
    tokens = token_cases()
    payload, scales = fmt.quantize(tokens)
    want = fmt.pack_messages(payload, scales)
    got = sim[f"messages_{fmt.name}"]
    bad = np.argwhere(got != want)
    assert bad.size == 0, (f"{fmt.name}: {len(bad)} message words differ; first token {bad[0][0]} "
                           f"word {bad[0][1]}: got {got[tuple(bad[0])]:#018x} want {want[tuple(bad[0])]:#018x}")
    assert_same_floats(sim[f"decoded_{fmt.name}"], fmt.dequantize(payload, scales), f"{fmt.name} decode")
    # the cases are there: zero blocks, NaN blocks, ties at scale 1
    stored = fmt.scale.value(scales)
    assert (stored == 1).sum() >= 3 and np.isnan(stored).sum() == 2


# == (b) the reference formats ======================================================================
LAYOUTS = {  # (format, hidden): payload, scale count, scale bytes, message bytes, message words
    ("bf16", 128): (256, 0, 0, 256, 32), ("bf16", 384): (768, 0, 0, 768, 96),
    ("bf16", 7168): (14336, 0, 0, 14336, 1792),
    ("fp8_e4m3", 128): (128, 1, 4, 256, 32), ("fp8_e4m3", 384): (384, 3, 12, 512, 64),
    ("fp8_e4m3", 7168): (7168, 56, 224, 7424, 928),
    ("fp8_e4m3_ue8m0", 128): (128, 1, 1, 256, 32), ("fp8_e4m3_ue8m0", 384): (384, 3, 3, 512, 64),
    ("fp8_e4m3_ue8m0", 7168): (7168, 56, 56, 7296, 912),
}


@pytest.mark.parametrize("name, hidden", list(LAYOUTS))
def test_message_layout(name, hidden):
    fmt = F.get_format(name)
    got = (fmt.payload_bytes(hidden), fmt.scale_count(hidden), fmt.scale_bytes(hidden),
           fmt.message_bytes(hidden), fmt.message_words(hidden))
    assert got == LAYOUTS[name, hidden]
    assert fmt.scale_offset_bytes(hidden) == fmt.payload_bytes(hidden)
    assert fmt.scale_offset_bytes(hidden) % F.MESSAGE_ALIGN == 0
    if fmt.quantized:  # slots of word pairs: the encoder's 16-byte stores stay aligned
        assert fmt.message_bytes(hidden) % 16 == 0 and fmt.message_words(hidden) % 2 == 0


def test_format_attributes():
    assert (F.BF16.element_dtype, F.BF16.block, F.BF16.scale_dtype) == (np.uint16, None, None)
    assert (F.FP8_E4M3.element_dtype, F.FP8_E4M3.block, F.FP8_E4M3.scale_dtype) == (np.uint8, 128, np.float32)
    assert (F.FP8_E4M3_UE8M0.element_dtype, F.FP8_E4M3_UE8M0.block,
            F.FP8_E4M3_UE8M0.scale_dtype) == (np.uint8, 128, np.uint8)
    for name, fmt in F.FORMATS.items():
        assert F.get_format(name) is fmt and F.get_format(fmt) is fmt
    with pytest.raises(EPConfigError, match="unknown token format 'fp4'.*bf16, fp8_e4m3, fp8_e4m3_ue8m0"):
        F.get_format("fp4")


@pytest.mark.parametrize("fmt", FP8_FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("hidden, fix", [(100, "pad hidden to 128"), (64, "pad hidden to 128"),
                                         (1000, "pad hidden to 1024"), (7200, "pad hidden to 7296")])
def test_fp8_rejects_hidden_not_a_multiple_of_128(fmt, hidden, fix):
    with pytest.raises(EPConfigError, match=f"hidden={hidden} must be a multiple of 128.*{fix}"):
        fmt.validate_hidden(hidden)
    with pytest.raises(EPConfigError):
        fmt.message_words(hidden)


@pytest.mark.parametrize("fmt", list(F.FORMATS.values()), ids=lambda f: f.name)
def test_hidden_must_be_a_positive_int(fmt):
    for bad in (0, -128, 128.0, True, "128"):
        with pytest.raises(EPConfigError, match="hidden"):
            fmt.validate_hidden(bad)
    fmt.validate_hidden(np.int64(1024))


def test_bf16_takes_any_hidden_and_is_the_identity():
    F.BF16.validate_hidden(7)
    assert F.BF16.message_bytes(7) == 16 and F.BF16.message_words(7) == 2
    x = np.random.default_rng(1).integers(0, 1 << 16, (3, 7), dtype=np.uint16)
    payload, scales = F.BF16.quantize(x)
    assert scales is None and payload.dtype == np.uint16 and np.array_equal(payload, x)
    p2, s2 = F.BF16.unpack_messages(F.BF16.pack_messages(payload, None), 7)
    assert s2 is None and np.array_equal(p2, x)
    assert_same_floats(F.BF16.dequantize(payload, None), x.view(BF16).astype(np.float32), "bf16 decode")


def random_tokens(T: int, H: int, seed: int) -> np.ndarray:
    """[T, H] uint16 bf16: normal values, block magnitudes 2**-40 .. 2**40, one zero block."""
    rng = np.random.default_rng(seed)
    mags = 2.0 ** rng.integers(-40, 41, size=(T, H // 128, 1))
    x = (rng.standard_normal((T, H // 128, 128)) * mags).reshape(T, H).astype(BF16).view(np.uint16)
    x[0, :128] = 0
    return x


@pytest.mark.parametrize("fmt", FP8_FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("hidden", [128, 384, 1152, 7168])
def test_round_trip(fmt, hidden):
    x = random_tokens(5, hidden, seed=hidden)
    payload, scales = fmt.quantize(x)
    assert payload.shape == (5, hidden) and payload.dtype == np.uint8
    assert scales.shape == (5, hidden // 128) and scales.dtype == fmt.scale_dtype
    messages = fmt.pack_messages(payload, scales)
    assert messages.shape == (5, fmt.message_words(hidden)) and messages.dtype == np.uint64
    raw = messages.view(np.uint8)
    assert np.array_equal(raw[:, :hidden], payload)
    assert np.array_equal(raw[:, hidden:hidden + fmt.scale_bytes(hidden)], scales.view(np.uint8))
    assert not raw[:, hidden + fmt.scale_bytes(hidden):].any(), "padding must be zero"
    p2, s2 = fmt.unpack_messages(messages, hidden)
    assert np.array_equal(p2, payload) and np.array_equal(s2.view(np.uint8), scales.view(np.uint8))
    assert np.isfinite(fmt.dequantize(p2, s2)).all()
    assert ((payload & 0x7F) != 0x7F).all(), "finite blocks never give NaN codes"


@pytest.mark.parametrize("fmt", FP8_FORMATS, ids=lambda f: f.name)
def test_error_bound(fmt):
    """|d - x| <= 2**-4 max(|x|, 2**-6 s) (1 + 2**-18), and the bound is nearly reached."""
    x = random_tokens(64, 1024, seed=7)
    x[:, 3::128] = (x[:, 3::128].view(BF16).astype(np.float32) * 2.0**-14).astype(BF16).view(np.uint16)
    payload, scales = fmt.quantize(x)
    d = fmt.dequantize(payload, scales).astype(np.float64)
    xf = x.view(BF16).astype(np.float64)
    s = np.repeat(fmt.scale.value(scales).astype(np.float64), 128, axis=1)
    floor = np.maximum(np.abs(xf), 2.0**-6 * s)
    ratio = np.abs(d - xf) / floor
    assert ratio.max() <= 2.0**-4 * (1 + 2.0**-18), f"error bound exceeded: {ratio.max() * 16} * 2**-4"
    assert ratio.max() > 0.9 * 2.0**-4, "the bound should be nearly reached (half an E4M3 ulp)"
    assert (np.abs(xf) < 2.0**-6 * s).any(), "the sample has no E4M3-subnormal elements"
    amax = np.repeat(np.abs(xf).reshape(64, 8, 128).max(axis=2), 128, axis=1)
    assert (np.abs(d - xf) <= 2.0**-4 * amax * (1 + 2.0**-18)).all()


def test_hand_computed_blocks():
    x = np.zeros((1, 384), np.float32)
    x[0, :128] = np.linspace(-7, 7, 128)           # amax 7 -> scale 1/64 (both rules)
    x[0, 128:256] = np.linspace(-7.5, 7.5, 128)    # amax 7.5 -> 7.5 / 448; UE8M0 2**-5
    x[0, 256] = 1.0                                # amax 1 -> 1 / 448; UE8M0 2**-8 (1 <= 1.75)
    bits = x.astype(BF16).view(np.uint16)
    _, s = F.FP8_E4M3.quantize(bits)
    assert s.tolist() == [[np.float32(1 / 64), np.float32(7.5) / np.float32(448), np.float32(1) / np.float32(448)]]
    payload, codes = F.FP8_E4M3_UE8M0.quantize(bits)
    assert codes.tolist() == [[121, 122, 119]]
    assert np.array_equal(payload[0, :128], ml_codes(x[0, :128].astype(BF16).astype(np.float32) * 64))


@pytest.mark.parametrize("fmt", FP8_FORMATS, ids=lambda f: f.name)
def test_zero_blocks(fmt):
    x = random_tokens(2, 384, seed=3)
    x[1, 128:256] = 0x8000                             # -0.0 everywhere
    x[1, 200] = 0x0000
    payload, scales = fmt.quantize(x)
    one = np.float32(1.0) if fmt is F.FP8_E4M3 else F.UE8M0_ONE
    assert scales[0, 0] == one and scales[1, 1] == one
    assert (payload[0, :128] == 0).all()
    assert (payload[1, 128:256] == np.where(np.arange(128, 256) == 200, 0x00, 0x80)).all()
    d = fmt.dequantize(payload, scales)
    assert (d[1, 128:256] == 0).all() and np.signbit(d[1, 128:256]).sum() == 127
    # a zero block leaves its neighbours alone
    alone = fmt.quantize(np.ascontiguousarray(x[1:, :128]))
    assert np.array_equal(alone[0], payload[1:, :128])


@pytest.mark.parametrize("fmt", FP8_FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("bad", [0x7FC0, 0xFFC1, 0x7F80, 0xFF80], ids=["nan", "-nan", "inf", "-inf"])
def test_non_finite_block_decodes_to_nan_and_spares_the_others(fmt, bad):
    x = random_tokens(1, 384, seed=4)
    clean_payload, clean_scales = fmt.quantize(x)
    x[0, 130] = bad
    payload, scales = fmt.quantize(x)
    assert (payload[0, 128:256] == F.E4M3_NAN).all()
    if fmt is F.FP8_E4M3:
        assert scales.view(np.uint32)[0, 1] == 0x7FC00000
    else:
        assert scales[0, 1] == F.UE8M0_NAN
    assert np.isnan(fmt.dequantize(payload, scales)[0, 128:256]).all()
    keep = np.r_[0:128, 256:384]
    assert np.array_equal(payload[:, keep], clean_payload[:, keep])
    assert np.array_equal(scales[:, [0, 2]].view(np.uint8), clean_scales[:, [0, 2]].view(np.uint8))


@pytest.mark.parametrize("fmt", FP8_FORMATS, ids=lambda f: f.name)
def test_tiny_amax(fmt):
    """bf16 subnormal blocks: FP8_E4M3's scale is a float32 subnormal (amax / 448 rounded with
    few bits), UE8M0 stops at 2**-127; neither produces NaN codes and decoding stays close."""
    x = np.zeros((1, 256), np.uint16)
    x[0, :128] = 0x0001                                # the smallest bf16, 2**-133
    x[0, 1] = 0x8001
    x[0, 128:256] = np.arange(128, dtype=np.uint16) + 0x0400   # around 2**-119
    payload, scales = fmt.quantize(x)
    assert ((payload & 0x7F) != 0x7F).all()
    if fmt is F.FP8_E4M3:
        assert scales[0, 0] < np.finfo(np.float32).tiny
        assert payload[0, 0] == 0x7E                   # 2**-133 / scale is 448.9, rounds to 448
    else:
        assert scales.tolist() == [[0, exact_ue8m0_code(float(np.uint32(0x047F << 16).view(np.float32)))]]
    d = fmt.dequantize(payload, scales)
    xf = x.view(BF16).astype(np.float32)
    assert (np.abs(d - xf) <= 2.0**-4 * np.abs(xf).max()).all()


def test_e4m3_codes_are_the_products_by_448_over_amax():
    """FP8_E4M3 quantizes ``x * (448 / amax)`` (float32, DeepEP's form), not ``x / (amax / 448)``:
    the reference's codes equal ml_dtypes' conversion of the products, and differ from the
    quotients' somewhere in these tokens (so the rule is really the product)."""
    x = random_tokens(64, 1024, seed=21)
    payload, scales = F.FP8_E4M3.quantize(x)
    xf = x.view(BF16).astype(np.float32).reshape(64, 8, 128)
    amax = np.abs(xf).max(axis=2, keepdims=True)
    with np.errstate(divide="ignore"):
        inv = np.where(amax == 0, np.float32(1.0), np.float32(448.0) / amax).astype(np.float32)  # a zero block: 1
    want = ml_codes((xf * inv).astype(np.float32)).reshape(64, 1024)
    assert np.array_equal(payload, want)
    by_division = ml_codes((xf / scales[:, :, None]).astype(np.float32)).reshape(64, 1024)
    assert (payload != by_division).any(), "no element tells the two rules apart: the check proves nothing"


def test_reference_scales_match_exact_computation():
    """Reference scales of random tokens and of every bf16 amax, against the exact rules."""
    amax = (np.arange(0x8000, dtype=np.uint32) << 16).view(np.float32)
    s, stored = F.FLOAT32_SCALE.from_amax(amax)
    assert stored is s
    assert_same_floats(s, [exact_e4m3_scale(float(a)) for a in amax], "FLOAT32_SCALE")
    scale, codes = F.UE8M0_SCALE.from_amax(amax)
    assert codes.dtype == np.uint8
    assert codes.tolist() == [exact_ue8m0_code(float(a)) for a in amax]
    assert_same_floats(scale, F.ue8m0_value(codes), "UE8M0 scale value")
    x = random_tokens(4, 1024, seed=9)
    block_amax = np.abs(x.view(BF16).astype(np.float32)).reshape(4, 8, 128).max(axis=2)
    assert_same_floats(F.FP8_E4M3.quantize(x)[1], [[exact_e4m3_scale(float(a)) for a in r] for r in block_amax],
                       "FP8_E4M3 scales")
    assert F.FP8_E4M3_UE8M0.quantize(x)[1].tolist() == [[exact_ue8m0_code(float(a)) for a in r] for r in block_amax]


def test_argument_errors():
    with pytest.raises(EPInputError, match="uint16 bf16 bit patterns"):
        F.FP8_E4M3.quantize(np.zeros((2, 128), np.float32))
    with pytest.raises(EPInputError, match=r"scales must be \[2, 1\] float32"):
        F.FP8_E4M3.pack_messages(np.zeros((2, 128), np.uint8), np.zeros((2, 1), np.uint8))
    with pytest.raises(EPInputError, match=r"\[T, 32\] uint64"):
        F.FP8_E4M3_UE8M0.unpack_messages(np.zeros((2, 16), np.uint64), 128)
    with pytest.raises(EPConfigError, match="multiple of 128"):
        F.FP8_E4M3.quantize(np.zeros((2, 100), np.uint16))


# == (c) the device functions compile for the GPU ====================================================
def test_device_functions_compile_and_link_for_sm90(compiled):
    names = [k["name"] for k in compiled["kernels"]]
    assert names == [e[0] for e in _kernel_entries()]
    for k in compiled["kernels"]:
        assert k["ok"] and k["cubin_bytes"] > 0, f"{k['name']}: {k['error']}"


def test_device_functions_use_no_float64(compiled):
    assert compiled["control_f64_lines"], "the control computes in float64: the PTX check is blind"
    assert len(compiled["f64_lines"]) == len(_device_signatures())
    used = {name: lines for name, lines in compiled["f64_lines"].items() if lines}
    assert not used, f"float64 in device functions: {used}"
