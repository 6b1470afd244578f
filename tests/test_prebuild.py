"""``python -m ep_runtime.prebuild``: the kernel cache filled ahead of time, without a GPU here
(``--cc 9.0a``, the compile gate's way), with the runtime's own kernels and signatures.

The entry it stores must be the one a runtime looks for (its file name is the key of the
kernel and signature :func:`ep_runtime.core.builds.kernel_builds` lists for the runtime's plan), a
second run must find it (a hit, nothing compiled), a damaged entry must be rebuilt, and bad
settings must stop it before anything is compiled. It builds the kernels of the plans the jobs
choose (each format, tokens per rank on both sides of every rule's threshold, each set of
layouts served), or with ``--all-variants`` of every receiver on every transport.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ep_runtime.tools import compile_gate

pytestmark = pytest.mark.skipif(
    not compile_gate.nvshmem_numba_bindings_installed(),
    reason="nvshmem4py's Numba device bindings are not installed (pip install -e '.[test]')")

REPO = Path(__file__).resolve().parents[1]
#: The smallest kernel of the runtime (no NVSHMEM transfer code): a fast compile.
#: one small kernel (the kept routing's copy: no NVSHMEM call, so no shim to link; a third of
#: validate_routing's build time)
ONLY = ["--only", "routing_copy", "--token-dtype", "bfloat16", "--combine-dtype", "bfloat16"]


def _env(cache, **extra) -> dict:
    env = dict(os.environ)
    env.pop("NUMBA_ENABLE_CUDASIM", None)  # the real compiler, whatever the test session simulates
    env.pop("NUMBA_FORCE_CUDA_CC", None)
    env.update(EP_RUNTIME_KERNEL_CACHE=str(cache), **extra)
    return env


def prebuild(cache, *args, **extra):
    proc = subprocess.run([sys.executable, "-m", "ep_runtime.prebuild", *args], cwd=REPO, env=_env(cache, **extra),
                          text=True, capture_output=True, timeout=600)
    return proc.returncode, proc.stdout, proc.stderr


def expected_key(cache) -> str:
    """The key a runtime computes for routing_copy on sm_90a (in a process like the tool's)."""
    code = ("from ep_runtime.core.builds import kernel_builds\n"
            "from ep_runtime.core.config import EPConfig\n"
            "from ep_runtime.core.plan import Topology, choose_plan\n"
            "from ep_runtime.shmem.cache_key import kernel_key\n"
            "cfg = EPConfig(n_ranks=4, n_experts=64, top_k=6, hidden=7168, max_tokens_per_rank=300)\n"
            "plan = choose_plan(cfg, Topology.nvlink_gpus(4))\n"
            "(_, k, types), = kernel_builds(cfg, plan, ('routing_copy',))\n"
            "print(kernel_key(k, types, (9, 0, 'a')))\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=_env(cache), text=True, capture_output=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()[-1]


def test_stores_the_runtime_s_entry_then_hits_then_rebuilds_a_damaged_one(tmp_path):
    cache = tmp_path / "kc"
    rc, out, err = prebuild(cache, "--cc", "9.0a", "--jobs", "1", *ONLY)
    assert rc == 0, out + err[-3000:]
    assert "routing_copy (bfloat16; " in out and "compiled" in out, out
    assert "1 kernels" in out and "0 hit, 1 compiled, 0 FAILED" in out, out
    entries = sorted(cache.glob("*.cubin"))
    # the entry a runtime of any size with these formats looks for (sizes do not enter the key)
    assert [p.stem for p in entries] == [expected_key(cache)]
    good = entries[0].read_bytes()
    assert good.startswith(b"EPRT-KCACHE\n") and len(good) > 10_000

    rc, out, err = prebuild(cache, "--cc", "9.0a", "--jobs", "1", *ONLY)
    assert rc == 0 and "1 hit, 0 compiled" in out, out + err[-3000:]
    assert entries[0].read_bytes() == good

    entries[0].write_bytes(good[: len(good) // 2])  # a truncated entry: rejected, compiled again
    rc, out, err = prebuild(cache, "--cc", "9.0a", "--jobs", "1", *ONLY)
    assert rc == 0 and "0 hit, 1 compiled" in out, out + err[-3000:]
    assert "deleting it" in err
    assert len(entries[0].read_bytes()) > len(good) // 2  # whole again
    from ep_runtime.shmem.kernel_cache import KernelCache

    assert KernelCache(cache).read(entries[0].stem) is not None  # and good: what a later run hits


def test_plans_every_kernel_of_the_jobs_plans_once(monkeypatch):
    from ep_runtime.core.config import COMBINE_DTYPES, TOKEN_DTYPES
    from ep_runtime.prebuild import plan

    monkeypatch.delenv("EP_RUNTIME_PLAN", raising=False)
    jobs = plan(7168, TOKEN_DTYPES, COMBINE_DTYPES)
    labels = [j[0] for j in jobs]
    assert len(labels) == len(set(labels))
    receivers = {"bfloat16": {"route_first", "wait", "land", "route_first_chunked"},
                 "fp8_e4m3": {"route_first", "wait", "route_first_chunked"},
                 "fp8_e4m3_ue8m0": {"route_first", "wait", "route_first_chunked"}}
    for fmt, want in receivers.items():  # each format's dispatch_async in each plan its jobs choose
        got = {j[0].split("; ")[1].split("/")[0] for j in jobs if j[0].startswith(f"dispatch_async ({fmt};")}
        assert got == want, (fmt, got)
    assert any(j[0].startswith("dispatch_land (bfloat16;") for j in jobs)
    assert not any(j[0].startswith("dispatch_land (fp8") for j in jobs)  # FP8 never lands by default
    assert any(j[0].startswith("combine_wait (bfloat16, float32 partials;") for j in jobs)

    every = [j[0] for j in plan(7168, ["bfloat16"], ["bfloat16"], all_variants=True)]
    # the receive kernels do not read the transport: one build serves both
    assert {"dispatch_land (bfloat16; land/puts expanded land/stores expanded)", "dispatch_async (bfloat16; wait/puts)",
            "dispatch_async (bfloat16; land/puts)", "dispatch_wait (bfloat16; route_first_chunked/stores expanded)"} \
        <= set(every), every

    monkeypatch.setenv("EP_RUNTIME_PLAN", "receiver=wait")  # the job's overrides: one receiver everywhere
    labels = [j[0] for j in plan(7168, TOKEN_DTYPES, COMBINE_DTYPES)]
    assert not any("land" in x or "route_first" in x for x in labels), labels


@pytest.mark.parametrize("args,env,message", [
    (["--cc", "9.0a", "--only", "no_such_kernel"], {}, "no kernel matches"),
    (["--cc", "9.0a"], {"NUMBA_ENABLE_CUDASIM": "1"}, "the simulator compiles nothing"),
    (["--cc", "9.0a"], {"EP_RUNTIME_KERNEL_CACHE": "off"}, "the kernel cache is off"),
    (["--cc", "sm_nine"], {}, "expected a compute capability"),
])
def test_bad_settings_stop_before_compiling(tmp_path, args, env, message):
    extra = dict(env)
    cache = extra.pop("EP_RUNTIME_KERNEL_CACHE", tmp_path / "kc")
    rc, out, err = prebuild(cache, *args, **extra)
    assert rc != 0 and message in out + err, (rc, out, err[-2000:])
    assert not list(Path(tmp_path).glob("kc/*.cubin"))
