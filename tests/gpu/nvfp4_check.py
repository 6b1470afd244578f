"""GPU acceptance of the NVFP4 token format (one rank per GPU; or several ranks on one GPU):

    mpirun -np 2 -x PYTHONPATH python3 tests/gpu/nvfp4_check.py [--tokens 4096 128] [--replays 10]
        [--plans default | variants | receiver=wait,transport=puts ...]
    bash tests/gpu/mps_run.sh 2 sh -c 'mpirun -np 2 $EP_MPIRUN_ARGS python3 tests/gpu/nvfp4_check.py'
    NUMBA_ENABLE_CUDASIM=1 mpiexec -n 2 python3 tests/gpu/nvfp4_check.py --backend sim --tokens 6 \\
        --hidden 128 --experts 8 --top-k 2

For each plan of ``--plans`` (one runtime each, as in fp8_check.py) and token count T, on random
routing with awkward blocks planted (zeros, -0.0, inf, NaN, a tiny block whose scale is an E4M3
subnormal, a large value setting the global scale):

- dispatch of bf16 tokens quantized in dispatch_async under the global scale the runtime
  computes on the stream (none given), under a given one (a tenth of the rule's: saturating
  scales and codes), and of pre-quantized codes and scales with their global scale; each with
  row- and column-major scales: codes, scales and every row's global scale equal the NumPy
  reference bit for bit, padding rows zero; the compact layout's defined rows likewise;
- bf16 combine of the decoded rows within the reference's tolerance (a GPU's FMA);
- (GPU only) a CUDA graph of dispatch (the global scale computed inside it, and pre-quantized
  input with its global scale) and combine, replayed ``--replays`` times, each replay's batch equal
  to the eager call's;
- once: the codec's device conversions (``e2m1_code``, ``e4m3_saturated_bits``) against the
  reference for every bf16 pattern (``--backend sim``: every 97th, the simulator being slow).

A plan that cannot run here is a failure; the others still run. Prints a table last (rank 0);
exits non-zero on any failure.
"""

from __future__ import annotations

import argparse
import sys
from types import SimpleNamespace

import harness
import numpy as np

#: Dispatch inputs checked: (name, kind) as tests/test_nvfp4_sim.py names them.
MODES = (("computed", "computed"), ("given/10", "given"), ("pre-quantized", "prequantized"))


def plant_awkward_blocks(xs, BF16) -> None:
    """Token 0: block 1 zeros, block 2 -0.0, a 40.0; token 1 an inf; token 2 a NaN; token 3's
    block 3 tiny (3e-4 scale: an E4M3-subnormal block scale next to the 40.0)."""
    rng = np.random.default_rng(0)
    for x in xs:
        f = x.astype(np.float32)
        if len(f) > 3 and f.shape[1] >= 128:
            f[0, 16:32], f[0, 32:48], f[0, 70] = 0.0, -0.0, 40.0
            f[1, 5], f[2, -3] = np.inf, np.nan
            f[3, 48:64] = 3e-4 * rng.standard_normal(16)
        x[...] = f.astype(BF16)


def check_conversions(backend: str) -> tuple[int, int]:
    """``(values that differ, values checked)``: the codec's E2M1 and saturating E4M3 conversions
    run as a kernel (on the device, or the simulator) against the reference, for every bf16
    pattern but NaN (every 97th on the simulator)."""
    from ep_runtime.core.formats import e2m1_codes, e4m3_saturated
    from ep_runtime.kernels.codecs.nvfp4 import e2m1_code, e4m3_saturated_bits
    from ep_runtime.kernels.cuda_api import cuda as ncuda  # the simulator's kernels need its proxy

    @ncuda.jit
    def convert(q, e2m1, e4m3):
        i = ncuda.grid(1)
        if i < q.size:
            e2m1[i] = e2m1_code(q[i])
            e4m3[i] = e4m3_saturated_bits(q[i])

    q = (np.arange(0, 65536, 97 if backend == "sim" else 1, dtype=np.uint32) << 16).view(np.float32)
    q = q[~np.isnan(q)]
    dq, d2, d4 = ncuda.to_device(q), ncuda.device_array(q.size, np.uint8), ncuda.device_array(q.size, np.uint8)
    convert[(q.size + 127) // 128, 128](dq, d2, d4)
    e2m1, e4m3 = d2.copy_to_host(), d4.copy_to_host()
    return int((e2m1 != e2m1_codes(q)).sum() + (e4m3 != e4m3_saturated(q)).sum()), 2 * q.size


def nvfp4_reference(cfg, T: int, seed: int, me: int, scenario: str) -> SimpleNamespace:
    """What the checks at T compare with on rank ``me``, computed once for every plan."""
    from ep_runtime.core import reference
    from ep_runtime.testing import linear_experts

    fmt = cfg.token_format
    xs, ids, ws = harness.job_inputs(cfg, seed + T, T, scenario)
    plant_awkward_blocks(xs, reference.BF16)
    rule = [fmt.global_scale(x.view(np.uint16)) for x in xs]
    modes = {}
    for name, kind in MODES:
        gs = [g / np.float32(10) for g in rule] if kind == "given" else rule
        enc = [fmt.quantize(x.view(np.uint16), g) for x, g in zip(xs, gs)]
        g = {"token_global_scale": np.array([gs[me]], np.float32)}
        inputs = (xs[me].view(np.uint16), {} if kind == "computed" else g)
        if kind == "prequantized":
            inputs = (enc[me][0], {"token_scales": enc[me][1], **g})
        x_recv, defined, sc_recv = reference.receive_rows(xs, ids, cfg, with_scales=True, global_scales_per_rank=gs)[me]
        modes[name] = SimpleNamespace(inputs=inputs, ref=reference.dispatch(xs, ids, ws, cfg,
                                                                            global_scales_per_rank=gs)[me],
                                      x_recv=x_recv, sc_recv=sc_recv, defined=defined,
                                      g_recv=reference.receive_global_scales(xs, ids, cfg, gs)[me][0])
    refs = reference.dispatch(xs, ids, ws, cfg)  # the combine's: the computed mode's batches
    ys = []
    for r, rb in enumerate(refs):
        dec = fmt.dequantize(rb.x, rb.scales, rb.global_scales)
        dec[~np.isfinite(dec) | (rb.src_rank < 0)[:, None]] = 0.0
        ys.append(linear_experts(dec.astype(reference.BF16), rb.row_offsets, cfg.n_local_experts, r))
    want = reference.combine(ys, refs, ids, cfg, home_ranks=[me])[me].astype(np.float32)
    tol = reference.combine_tolerance(ws[me], float(np.abs(ys[me].astype(np.float32)).max(initial=0)))
    return SimpleNamespace(T=T, modes=modes, ids=ids[me], ws=ws[me], y=ys[me].view(np.uint16), want=want, tol=tol)


def batch_ok(session, b, m, scales: str, check, what: str) -> bool:
    """An expanded batch ``b`` against mode ``m``'s reference, bit for bit; padding rows zero."""
    host = session.to_host
    ref, n = m.ref, m.ref.n_rows
    x, sc, g = host(b.x), host(b.scales), host(b.global_scales)
    sc = sc if scales == "row" else np.ascontiguousarray(sc.T)
    pad = np.flatnonzero(ref.src_rank < 0)
    return (check(np.array_equal(host(b.row_offsets), ref.row_offsets), f"{what}: row_offsets")
            & check(np.array_equal(x[:n], ref.x), f"{what}: codes")
            & check(np.array_equal(sc[:n], ref.scales), f"{what}: scales {scales}-major")
            & check(np.array_equal(g[:n].view(np.uint32), ref.global_scales.view(np.uint32)), f"{what}: global scales")
            & check(not x[pad].any() and not sc[pad].any() and not g[pad].any(), f"{what}: padding rows not zero"))


def check_t(rt, session, d: SimpleNamespace, args, check) -> tuple:
    """Every check at one T on runtime ``rt``: the table row ``(T, rows, combine err, graph
    replays alike, {check: ok})``."""
    from ep_runtime.core import reference

    dev, host = session.to_device, session.to_host
    T, ok = d.T, {}
    tid, tw = dev(d.ids), dev(d.ws)
    for name, m in d.modes.items():
        tok = dev(np.ascontiguousarray(m.inputs[0]))
        kw = {k: dev(v) for k, v in m.inputs[1].items()}
        for scales in ("row", "column"):
            b = rt.dispatch(tok, tid, tw, scales=scales, **kw)
            ok[f"{name}/{scales}"] = batch_ok(session, b, m, scales, check, f"T={T} {name}")
        cb = rt.dispatch(tok, tid, tw, layout="compact", **kw)
        dd = m.defined
        ok[f"{name}/compact"] = (
            check(np.array_equal(host(cb.x)[dd], m.x_recv[dd]), f"T={T} {name} compact codes")
            & check(np.array_equal(np.ascontiguousarray(host(cb.scales))[dd], m.sc_recv[dd]),
                    f"T={T} {name} compact scales")
            & check(np.array_equal(host(cb.global_scales)[dd], m.g_recv[dd]), f"T={T} {name} compact global scales"))

    m = d.modes["computed"]
    tok = dev(np.ascontiguousarray(m.inputs[0]))
    y = dev(np.concatenate([d.y, np.zeros((rt.cfg.recv_rows_capacity - len(d.y), rt.cfg.hidden), np.uint16)]))
    b = rt.dispatch(tok, tid, tw)
    out = host(rt.combine(y, b.handle))
    err = float(np.abs(out.view(reference.BF16).astype(np.float32) - d.want).max()) if T else 0.0
    ok["combine"] = check.no_failure(harness.combine_failure(out, d.want, d.tol, f"T={T}"))
    same = graph_replays(rt, session, d, args, check) if args.backend == "nvshmem" else None
    if same is not None:
        ok["graph"] = check(same == 2 * args.replays, f"T={T}: {2 * args.replays - same} graph replays differ")
    return T, m.ref.n_rows, err, same, ok


def graph_replays(rt, session, d: SimpleNamespace, args, check) -> int:
    """Replays of a captured dispatch and combine whose batch equals the eager call's, for the
    computed global scale (its kernels captured) and for pre-quantized input."""
    import cupy

    stream, same = session.stream, 0
    tid, tw = cupy.asarray(d.ids), cupy.asarray(d.ws)
    y = cupy.zeros((rt.cfg.recv_rows_capacity, rt.cfg.hidden), cupy.uint16)
    for name in ("computed", "pre-quantized"):
        m = d.modes[name]
        tok = cupy.asarray(m.inputs[0])
        kw = {k: cupy.asarray(v) for k, v in m.inputs[1].items()}
        n = m.ref.n_rows
        eager = rt.dispatch(tok, tid, tw, **kw)
        first = [a[:n].copy() for a in (eager.x, eager.scales, eager.global_scales)]
        rt.combine(y, eager.handle)
        session.barrier()
        stream.begin_capture()
        gb = rt.dispatch_wait(rt.dispatch_async(tok, tid, tw, **kw))
        rt.combine_wait(rt.combine_async(y, gb.handle))
        graph = stream.end_capture()
        for _ in range(args.replays):
            for a in (gb.x, gb.scales, gb.global_scales):
                a[:n].fill(0)
            graph.launch(stream)
            stream.synchronize()
            same += all(bool(cupy.array_equal(a[:n].view(cupy.uint8), f.view(cupy.uint8)))
                        for a, f in zip((gb.x, gb.scales, gb.global_scales), first))
        rt.synchronize()
    return same


def main() -> int:
    ap = argparse.ArgumentParser()
    harness.add_layer_options(ap, tokens=(4096, 128), seed=5)
    ap.add_argument("--replays", type=int, default=10)
    harness.add_scenario_option(ap)
    harness.add_backend_option(ap)
    ap.add_argument("--plans", nargs="+", default=["default"], metavar="PLAN", help=harness.PLANS_HELP)
    args = ap.parse_args()
    plans = harness.plan_list(args.plans)

    R = harness.job_comm().Get_size()
    cfg = harness.layer_config(args, R, max(args.tokens), token_dtype="nvfp4")
    session = harness.open_job_session(cfg, backend=args.backend)
    me, failures = session.rank, []
    differ, checked = check_conversions(args.backend)
    if differ:
        failures.append(f"rank {me}: device conversions: {differ} of {checked} values differ from the reference")
    conversion = f"device E2M1 / E4M3 conversions: {checked - differ}/{checked} values as the reference"

    refs = [nvfp4_reference(cfg, T, args.seed, me, args.scenario) for T in args.tokens]
    lines, rows, plan_failures = harness.run_plans(
        session, plans, {"": cfg}, lambda rt, label, check: [check_t(rt, session, d, args, check) for d in refs])
    session.close()

    def table(all_rows) -> list[str]:
        def cells(row) -> str:
            T, n, err, same, ok = row
            graph = "-" if same is None else str(same)
            return f"{T:>5} {n:>6} {err:>11.3g} {graph:>10}  {sum(ok.values())}/{len(ok)} exact"

        columns = f"{'T':>5} {'rows':>6} {'combine err':>11} {'graph same':>10}  checks"
        return [*lines, conversion, *harness.plan_table(all_rows, len(plans), columns, cells)]

    return harness.finish(failures + plan_failures, rows, table)


if __name__ == "__main__":
    sys.exit(main())
