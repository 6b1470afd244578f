"""Pure arithmetic of the kernels' block helpers (``ep_runtime/kernels/block.py``), their Python source
called on the host (``py_func``): ``interleaved_item``, which deals the combine kernels' rows of every
source to the warps, must be a bijection for every grid and rank count (a row dealt twice is
sent twice, a row never dealt is never sent) and must alternate a warp's sources. ``udiv32``
(a token's destination rank, ``id // L``): the simulator's quotient must be Python's, and the
GPU build must be one 32-bit division (each checked in a fresh interpreter: the simulator or the
GPU compiler on this CPU)."""

import pytest

from ep_runtime.kernels import block

#: the device function's own Python source (a @cuda.jit device function is not callable here)
interleaved_item = getattr(block.interleaved_item, "py_func", block.interleaved_item)


@pytest.mark.parametrize("R", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("all_warps", [1, 2, 3, 7, 16, 2112])
def test_interleaved_item_deals_every_source_item_once(R, all_warps):
    n = 41  # items per source (token row parts)
    dealt = [interleaved_item(q, all_warps, R) for q in range(R * n)]
    assert sorted(dealt) == sorted((s, i) for s in range(R) for i in range(n))


def test_a_warp_alternates_its_sources():
    """132 blocks x 16 warps, 2 ranks: warp w's items q = w, w + 2112, ... change source every
    pass (rows for this rank and for the peer overlap in time)."""
    A = 2112
    for w in (0, 1, 777, 2111):
        sources = [interleaved_item(w + p * A, A, 2)[0] for p in range(6)]
        assert all(a != b for a, b in zip(sources, sources[1:])), (w, sources)


# -- udiv32: a 32-bit quotient ---------------------------------------------------------------------
_UDIV32_SIM = r"""
import json
import numpy as np
from ep_runtime.kernels.block import udiv32

rng = np.random.default_rng(7)
a = np.concatenate([rng.integers(0, 2**32, 2000, dtype=np.uint64), np.array([0, 1, 255, 2**31, 2**32 - 1], np.uint64)])
b = np.concatenate([rng.integers(1, 2**32, 1000, dtype=np.uint64), rng.integers(1, 300, 1005, dtype=np.uint64)])
bad = [(x, y, int(udiv32(x, y))) for x, y in zip(a.tolist(), b.tolist())
       if int(udiv32(x, y)) != x // y or np.asarray(udiv32(x, y)).dtype != np.uint32]
print(json.dumps({"checked": len(a), "bad": bad[:5]}))
"""


def _run(script: str, simulator: bool) -> dict:
    """Run ``script`` in a fresh interpreter (on the simulator, or the GPU compiler on a CPU
    like the compile gate) and return the JSON it prints last."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_ENABLE_CUDASIM", "NUMBA_FORCE_CUDA_CC")}
    if simulator:
        env["NUMBA_ENABLE_CUDASIM"] = "1"
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_udiv32_is_the_unsigned_32_bit_quotient():
    """The simulator's udiv32 (what the simulated kernels run) against Python's //, over values
    up to 2**32 - 1 (token ids over experts per rank, and beyond 2**31)."""
    assert _run(_UDIV32_SIM, simulator=True) == {"checked": 2005, "bad": []}


_UDIV32_PTX = r"""
import json
from numba import types
from numba.cuda.dispatcher import _Kernel
from ep_runtime.tools import compile_gate as cg
from ep_runtime.kernels.block import udiv32

def k(out, a, b):
    out[0] = udiv32(a[0], b)

with cg._fixed_compute_capability():
    kern = _Kernel(k, (types.uint32[::1], types.int32[::1], types.int64), **cg._kernel_parts(k)[1])
    ptx = kern.library.get_asm_str(cc=cg.TARGET_CC)
print(json.dumps({"div_u32": ptx.count("div.u32"), "div64": ptx.count("div.s64") + ptx.count("div.u64")}))
"""


def test_udiv32_compiles_to_one_32_bit_division():
    """On the GPU compiler (no simulator; CPU-only, like the compile gate): udiv32 of an int32
    and an int64 is one ``div.u32`` and no 64-bit division, which is its reason to exist."""
    from ep_runtime.tools import compile_gate

    if not compile_gate.nvshmem_numba_bindings_installed():
        pytest.skip("the GPU compiler's bindings are not installed (pip install -e '.[test]')")
    assert _run(_UDIV32_PTX, simulator=False) == {"div_u32": 1, "div64": 0}
