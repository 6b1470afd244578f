"""GPU acceptance of the FP8 token formats (run on the GPU machine, one rank per GPU):

    mpirun -np 2 -x PYTHONPATH python3 tests/gpu/fp8_check.py [--tokens 4096 128] [--replays 20]
        [--plans default | variants | receiver=wait,transport=puts ...]
        [--compiler numba-cuda | numba-cuda-mlir]

For each execution plan of ``--plans`` (as in ep_check.py: ``default``, plan overrides, or
``variants``; one runtime per plan and format, built one after another on one NVSHMEM
session), each format (``fp8_e4m3``, ``fp8_e4m3_ue8m0``) and token count T, on random routing
with awkward blocks planted (a block of zeros: amax 0; an inf and a NaN: non-finite blocks;
the reference data of each format and T computed once, for every plan):

- dispatch quantizing bf16 tokens in dispatch_async, and dispatch of pre-quantized codes with
  their scales, each with row- and column-major scales: codes and scales equal the NumPy
  reference bit for bit, padding rows zero;
- the compact layout: every defined received row's message equals the reference's;
- bf16 combine in the FP8 config within the stated tolerance;
- a CUDA graph of the four calls replayed ``--replays`` times, each replay's codes and scales
  identical to the eager call's;
- the encoder's hardware conversion (``kernels.fp8.quantize4``: ``cvt.rn.satfinite.e4m3x2.f32``)
  against its software rule (``quantize4_software``, checked against ml_dtypes for every bf16
  pattern by tests/test_formats.py) for every bf16 pattern under scales 1 (every E4M3 rounding
  tie of a bf16 value), arbitrary float32, power-of-two, float32-subnormal (quotients past
  464: the software fallback) and NaN; and the encoder's unchecked fast path
  (``quantize4_scaled``, taken where ``scaled_directly`` holds) for every bf16 word in blocks
  whose amax is the word's own or a few multiples of it, E4M3 and UE8M0 scales (once: it does
  not depend on the plan).

A plan that cannot run here (EPConfigError when its runtime is built) is a failure; the other
plans still run. Prints a table last (rank 0); exits non-zero on any failure.
"""

from __future__ import annotations

import argparse
import sys
from types import SimpleNamespace

import harness
import numpy as np

FORMATS = ("fp8_e4m3", "fp8_e4m3_ue8m0")


def plant_awkward_blocks(xs, BF16) -> None:
    """Token 0's block 1 all zero, token 1's block 0 holds an inf, token 2's last block a NaN."""
    for x in xs:
        f = x.astype(np.float32)
        if len(f) > 2:
            f[0, 128:256] = 0.0
            f[1, 5] = np.inf
            f[2, -3] = np.nan
        x[...] = f.astype(BF16)


#: Scales for the hardware-conversion check: 1, arbitrary float32 values (amax / 448 of a few
#: amaxes), powers of two, a float32-subnormal scale (quotients beyond 464) and NaN.
CONVERSION_SCALES = (1.0, 0.37109375 / 448, 3.0 / 448, 1234.5 / 448, 2.0 ** -9, 2.0 ** 7, 1.5e-39, float("nan"))


#: Factors on a word's own amax for the fast path's check (1: the word holds the block's amax).
SCALED_WIDEN = (1.0, 1.0009765625, 1.5, 3.0, 1000.0)


def check_hardware_conversion() -> tuple[int, int]:
    """``(words that differ, words checked)`` between quantize4 and quantize4_software on the
    GPU, for every bf16 pattern (as 16,384 words of 4) under each of CONVERSION_SCALES; and
    between the encoder's unchecked fast path (``quantize4_scaled``) and the software rule for
    every bf16 word whose block amax is its own times each of SCALED_WIDEN, in both scale
    kinds, wherever ``scaled_directly`` admits the block."""
    import cupy

    from ep_runtime.kernels.bits import bf16_to_f32
    from ep_runtime.kernels.cuda_api import cuda as ncuda
    from ep_runtime.kernels.fp8 import (bf16_abs_max4, block_scale, quantize4, quantize4_by_software, quantize4_scaled,
                                        quantize4_software, scaled_directly)

    @ncuda.jit
    def both(words, scales, hw, sw):
        i = ncuda.grid(1)
        if i < words.size * scales.size:
            w = words[i % words.size]
            s = scales[i // words.size]
            hw[i] = quantize4(w, s)
            sw[i] = quantize4_software(w, s)

    @ncuda.jit
    def scaled(words, widen, hw, sw, used):
        """The encoder's fast path: a block whose amax is the word's own (times ``widen``),
        its E4M3 and UE8M0 scales, and where ``scaled_directly`` lets the encoder skip the
        checks, ``quantize4_scaled`` against the checked software rule."""
        i = ncuda.grid(1)
        n = words.size * widen.size
        if i < n:
            w = words[i % words.size]
            amax = bf16_to_f32(bf16_abs_max4(w, w, w, w)) * widen[i // words.size]
            for kind in range(2):
                scale, code, inv = block_scale(amax, kind == 1)
                j = kind * n + i
                if scaled_directly(scale, inv):
                    used[j] = 1
                    hw[j] = quantize4_scaled(w, inv)
                    sw[j] = quantize4_by_software(w, scale, inv)

    words = cupy.asarray(np.arange(65536, dtype=np.uint16).view(np.uint64))
    scales = cupy.asarray(np.array(CONVERSION_SCALES, np.float32))
    n = words.size * scales.size
    hw, sw = cupy.zeros(n, cupy.uint32), cupy.ones(n, cupy.uint32)
    both[(n + 255) // 256, 256](words, scales, hw, sw)
    widen = cupy.asarray(np.array(SCALED_WIDEN, np.float32))
    m = words.size * widen.size
    hw2, sw2, used = cupy.zeros(2 * m, cupy.uint32), cupy.zeros(2 * m, cupy.uint32), cupy.zeros(2 * m, cupy.uint8)
    scaled[(m + 255) // 256, 256](words, widen, hw2, sw2, used)
    cupy.cuda.runtime.deviceSynchronize()
    assert int(used.sum()) > m, "the fast path's check took too few words"
    return int((hw != sw).sum()) + int((hw2 != sw2).sum()), n + int(used.sum())



def fp8_reference(cfg, T: int, seed: int, me: int, scenario: str = "random") -> SimpleNamespace:
    """What the checks of ``cfg``'s format at T compare with on rank ``me``, computed once for
    every plan (only this rank's parts kept)."""
    from ep_runtime.core import reference
    from ep_runtime.testing import linear_experts

    xs, ids, ws = harness.job_inputs(cfg, seed + T, T, scenario)
    plant_awkward_blocks(xs, reference.BF16)
    codes, scales = cfg.token_format.quantize(xs[me].view(np.uint16))
    x_recv, defined, sc_recv = reference.receive_rows(xs, ids, cfg, with_scales=True)[me]
    # bf16 combine in the FP8 config (expert outputs: the decoded rows, scaled per rank)
    refs = reference.dispatch(xs, ids, ws, cfg)
    ys = []
    for r, rb in enumerate(refs):
        dec = cfg.token_format.dequantize(rb.x, rb.scales)
        dec[~np.isfinite(dec)] = 0.0
        dec[rb.src_rank < 0] = 0.0
        ys.append(linear_experts(dec.astype(reference.BF16), rb.row_offsets, cfg.n_local_experts, r))
    want = reference.combine(ys, refs, ids, cfg, home_ranks=[me])[me].astype(np.float32)
    ref, y = refs[me], ys[me]
    tol = reference.combine_tolerance(ws[me], float(np.abs(y.astype(np.float32)).max()))
    return SimpleNamespace(T=T, ref=ref, pad=np.flatnonzero(ref.src_rank < 0), tokens=xs[me].view(np.uint16),
                           codes=codes, scales=scales, ids=ids[me], ws=ws[me], x_recv=x_recv, defined=defined,
                           sc_recv=sc_recv, y=y.view(np.uint16), want=want, tol=tol)


def check_format(rt, session, d: SimpleNamespace, args, check, fmt: str) -> tuple:
    """Every check at one T (``d``: its fp8_reference) on the runtime ``rt`` of format ``fmt``;
    the table row ``(T, rows, scales per row, combine error, graph replays alike, {check: ok})``."""
    import cupy

    from ep_runtime.core import reference

    cfg, stream = rt.cfg, session.stream
    T, ref, pad = d.T, d.ref, d.pad
    n = ref.n_rows
    S = cfg.token_format.scale_count(cfg.hidden)
    inputs = {"bf16 in-kernel": (cupy.asarray(d.tokens), {}),
              "pre-quantized": (cupy.asarray(d.codes), {"token_scales": cupy.asarray(d.scales)})}
    tid, tw = cupy.asarray(d.ids), cupy.asarray(d.ws)
    ok = {}
    for mode, (tok, kw) in inputs.items():
        for layout_s in ("row", "column"):
            b = rt.dispatch(tok, tid, tw, scales=layout_s, **kw)
            x = cupy.asnumpy(b.x)
            sc = cupy.asnumpy(b.scales)
            sc = sc if layout_s == "row" else np.ascontiguousarray(sc.T)
            good = check(np.array_equal(cupy.asnumpy(b.row_offsets), ref.row_offsets),
                         f"{fmt} T={T} {mode} row_offsets")
            good &= check(np.array_equal(x[:n], ref.x), f"{fmt} T={T} {mode} codes")
            good &= check(np.array_equal(sc[:n].view(np.uint8), ref.scales.view(np.uint8)),
                          f"{fmt} T={T} {mode} scales {layout_s}-major")
            good &= check(not x[pad].any() and not sc[pad].view(np.uint8).any(),
                          f"{fmt} T={T} {mode} padding rows not zero")
            ok[f"{mode}/{layout_s}"] = good
        cb = rt.dispatch(tok, tid, tw, layout="compact", **kw)
        ok[f"{mode}/compact"] = (
            check(np.array_equal(cupy.asnumpy(cb.x)[d.defined], d.x_recv[d.defined]), f"{fmt} T={T} {mode} compact codes")
            & check(np.array_equal(np.ascontiguousarray(cupy.asnumpy(cb.scales))[d.defined].view(np.uint8),
                                   d.sc_recv[d.defined].view(np.uint8)), f"{fmt} T={T} {mode} compact scales"))

    # bf16 combine in the FP8 config (expert outputs: the decoded rows, scaled per rank)
    tok = inputs["bf16 in-kernel"][0]
    y = cupy.zeros((cfg.recv_rows_capacity, cfg.hidden), cupy.uint16)
    y[:n] = cupy.asarray(d.y)
    b = rt.dispatch(tok, tid, tw)
    out = cupy.asnumpy(rt.combine(y, b.handle))
    err = float(np.abs(out.view(reference.BF16).astype(np.float32) - d.want).max()) if T else 0.0
    ok["combine"] = check.no_failure(harness.combine_failure(out, d.want, d.tol, f"{fmt} T={T}"))

    # CUDA graph of the four calls, replayed: codes and scales as the eager call's
    first_x, first_s = b.x[:n].copy(), b.scales[:n].copy()
    session.barrier()
    stream.begin_capture()
    gb = rt.dispatch_wait(rt.dispatch_async(tok, tid, tw))
    rt.combine_wait(rt.combine_async(y, gb.handle))
    graph = stream.end_capture()
    same = 0
    for _ in range(args.replays):
        gb.x[:n].fill(0)
        graph.launch(stream)
        stream.synchronize()
        same += int(bool(cupy.array_equal(gb.x[:n], first_x))  # scales as bytes: NaN scales compare equal
                    and bool(cupy.array_equal(gb.scales[:n].view(cupy.uint8), first_s.view(cupy.uint8))))
    rt.synchronize()
    ok["graph"] = check(same == args.replays, f"{fmt} T={T} {args.replays - same} graph replays differ")
    return T, n, S, err, same, ok


def main() -> int:
    ap = argparse.ArgumentParser()
    harness.add_layer_options(ap, tokens=(4096, 128), seed=3)
    ap.add_argument("--replays", type=int, default=20)
    harness.add_scenario_option(ap)
    ap.add_argument("--plans", nargs="+", default=["default"], metavar="PLAN",
                    help=harness.PLANS_HELP + "; one runtime per plan and format")
    harness.add_compiler_option(ap)
    args = harness.parse_args(ap)
    plans = harness.plan_list(args.plans)

    R = harness.job_comm().Get_size()
    cfgs = {f: harness.layer_config(args, R, max(args.tokens), token_dtype=f) for f in FORMATS}
    session = harness.open_job_session(*cfgs.values())
    me = session.rank
    failures = []

    differ, checked = check_hardware_conversion()
    if differ:
        failures.append(f"rank {me}: hardware E4M3 conversion: {differ} of {checked} words differ from the software "
                        f"rule")
    conversion = f"hardware E4M3 conversion: {checked - differ}/{checked} words as the software rule"

    refs = {fmt: [fp8_reference(cfg, T, args.seed, me, args.scenario) for T in args.tokens]
            for fmt, cfg in cfgs.items()}
    lines, rows, plan_failures = harness.run_plans(
        session, plans, cfgs, lambda rt, label, check: [check_format(rt, session, d, args, check, rt.cfg.token_dtype)
                                                        for d in refs[rt.cfg.token_dtype]])
    session.close()

    def table(all_rows) -> list[str]:
        def cells(row) -> str:
            T, n, S, err, same, ok = row
            return f"{T:>5} {n:>6} {S:>10} {err:>11.3g} {same:>10}  {sum(ok.values())}/{len(ok)} exact"

        columns = f"{'T':>5} {'rows':>6} {'scales/row':>10} {'combine err':>11} {'graph same':>10}  checks"
        return [*lines, conversion, *harness.plan_table(all_rows, len(plans), columns, cells, ("format", 15))]

    return harness.finish(failures + plan_failures, rows, table)


if __name__ == "__main__":
    sys.exit(main())
