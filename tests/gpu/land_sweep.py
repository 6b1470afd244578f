"""Dispatch rows as they land (v18, ``EP_RUNTIME_DISPATCH_LAND=1``) against dispatch_wait, in one
device call: the benchmark once per setting, then one table.

    python3 tests/gpu/land_sweep.py [--ranks 2] [--tokens 128 4096] [--sms 24 48 64]
        [--token-dtype bfloat16 fp8_e4m3] [--out DIR] [--bench-args "--samples 50"]

Settings: ``dispatch_wait`` (the knob off), then the knob on with each ``EP_RUNTIME_DISPATCH_LAND_SMS``
of ``--sms`` (the SMs dispatch_async leaves to dispatch_land's early blocks). Each setting runs
``mpirun -np RANKS python3 -m ep_runtime.bench --mode graph --layout expanded compact
--no-baselines`` (``--backend sim`` instead runs the bench's simulator smoke, eager: the kernels
run one after another there, so its times say nothing of the overlap) with ``--json`` into
``--out`` (default ``$OUT`` or /tmp/land_sweep). The table (rank 0, medians in us): each setting's
dispatch (async + wait, one graph each) and combine, and the dispatch's change against
dispatch_wait of the same run. docs/throughput.md, "v18", says what to look for.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

LAND_ENV = "EP_RUNTIME_DISPATCH_LAND"
LAND_SMS_ENV = "EP_RUNTIME_DISPATCH_LAND_SMS"


def settings(sms: list[int]) -> list[tuple[str, dict]]:
    """``(name, environment)`` of each run: the knob off, then on with each SM count."""
    return [("dispatch_wait", {LAND_ENV: "0"})] + [(f"land, {n} SMs left", {LAND_ENV: "1", LAND_SMS_ENV: str(n)})
                                                   for n in sms]


def bench_command(args, json_path: Path) -> list[str]:
    common = ["-m", "ep_runtime.bench", "--tokens", *map(str, args.tokens), "--token-dtype", *args.token_dtype,
              "--layout", "expanded", "compact", "--json", str(json_path), *shlex.split(args.bench_args)]
    if args.backend == "sim":
        return [sys.executable, *common, "--backend", "sim", "--ranks", str(args.ranks), "--mode", "eager"]
    return ["mpirun", "-np", str(args.ranks), "-x", "PYTHONPATH", "-x", LAND_ENV, "-x", LAND_SMS_ENV,
            "python3", *common, "--mode", "graph", "--no-baselines"]


def rows_of(path: Path, landing: bool) -> dict:
    """``{(T, token format, layout): (dispatch, async, wait, combine)}`` medians of rank 0 (each
    result's runtime must have landed its dispatches exactly when ``landing``)."""
    out = {}
    for res in json.loads(path.read_text())["results"][0]:
        if res["paths"].get("dispatch_land") != landing:
            raise SystemExit(f"{path}: the runtime's dispatch_land is {res['paths'].get('dispatch_land')}, expected "
                             f"{landing}: {LAND_ENV} did not reach the ranks (mpirun -x)")
        t, cfg = res["times_us"], res["config"]
        key = (cfg["max_tokens_per_rank"], cfg["token_dtype"], res["layout"])
        out[key] = tuple(t[k]["median"] for k in ("dispatch", "dispatch_async", "dispatch_wait", "combine"))
    return out


def table(results: dict) -> str:
    """One line per (setting, T, token format, layout), with the change against dispatch_wait."""
    base = results.get("dispatch_wait", {})
    lines = [f"{'setting':>22} {'T':>5} {'tokens':>10} {'layout':>8} | {'dispatch (async + wait)':>26} "
             f"{'vs wait':>8} | {'combine':>8}"]
    for name, rows in results.items():
        for key, (d, a, w, c) in sorted(rows.items()):
            delta = f"{d - base[key][0]:+8.1f}" if key in base and name != "dispatch_wait" else f"{'':>8}"
            lines.append(f"{name:>22} {key[0]:>5} {key[1]:>10} {key[2]:>8} | {d:>9.1f} ({a:>6.1f} + {w:>6.1f}) "
                         f"{delta} | {c:>8.1f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--tokens", type=int, nargs="+", default=[128, 4096])
    p.add_argument("--sms", type=int, nargs="+", default=[24, 48, 64], help="EP_RUNTIME_DISPATCH_LAND_SMS values")
    p.add_argument("--token-dtype", nargs="+", default=["bfloat16"])
    p.add_argument("--backend", choices=("nvshmem", "sim"), default="nvshmem")
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/land_sweep"))
    p.add_argument("--bench-args", default="", help="more arguments for ep_runtime.bench (one string)")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    for i, (name, env) in enumerate(settings(args.sms)):
        path = out / f"land_sweep_{i}.json"
        cmd = bench_command(args, path)
        print(f"== {name}: {' '.join(cmd)}", flush=True)
        proc = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True)
        (out / f"land_sweep_{i}.log").write_text(proc.stdout + proc.stderr)
        if proc.returncode != 0:
            print(f"== {name}: exit {proc.returncode}\n{proc.stderr[-3000:]}", flush=True)
            return 1
        results[name] = rows_of(path, env[LAND_ENV] == "1")
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
