"""Combine's lanes past a row's end do no arithmetic on words they never loaded.

combine_async and combine_wait give each lane ``U`` words of a row per pass; the slots past the
row's end are summed into accumulators that are never stored. Those slots must hold zeros, not
whatever the local array held: in the simulator a local array starts as ``np.empty`` memory,
and summing it printed NumPy RuntimeWarnings ("invalid value", "overflow") from ep_runtime/kernels/combine.py
at ``python -m ep_runtime demo --hidden 7``, before a correct PASS.

Here every simulated local array of 16-bit or wider elements starts as signalling NaNs (bf16
0x7F81 in every element; float32 0x7F817F81): NumPy raises the invalid-operation warning on any
arithmetic with one, so a single sum of an unloaded slot is caught, whatever memory the run
would otherwise have found. The round trip must stay exact and warning-free, on the single-word
loops (rows of an odd number of words: hidden 7 in uint16 words, 6 in uint32, 12 in uint64, and
float32 partials) and on the word-pair loops (hidden 64).
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from ep_runtime import EPConfig
from ep_runtime.core.layout import BufferLayout
from ep_runtime.shmem.launch import run_pes

#: bf16 signalling NaN (exponent all ones, quiet bit clear, payload 1): widened to float32 it
#: stays signalling, and NumPy warns "invalid value encountered" on any arithmetic with it.
SIGNALLING_NAN_BF16 = 0x7F81


def poisoned_round_trip(session, cfg_fields: dict, seed: int):
    """The demo's round trip on this PE with simulated local arrays poisoned (module
    docstring); ``(summary, RuntimeWarnings as "file:line: message")``."""
    from numba.cuda.simulator import kernelapi

    from ep_runtime.tools.demo import demo_rank

    empty_array = kernelapi.FakeCUDALocal.array

    def poisoned_array(self, shape, dtype, alignment=None):
        a = empty_array(self, shape, dtype, alignment)
        if a.dtype.itemsize >= 2 and a.dtype.kind in "uif":
            a.view(np.uint16)[...] = SIGNALLING_NAN_BF16
        return a

    kernelapi.FakeCUDALocal.array = poisoned_array
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # the simulated threads share this process's filters
        summary = demo_rank(session, cfg_fields, "random", seed)
    return summary, [f"{w.filename}:{w.lineno}: {w.message}" for w in caught if issubclass(w.category, RuntimeWarning)]


@pytest.mark.parametrize("hidden, combine_dtype", [(7, "bfloat16"), (6, "bfloat16"), (12, "bfloat16"),
                                                   (12, "float32"), (64, "bfloat16")])
def test_combine_sums_only_loaded_words(hidden, combine_dtype):
    cfg = EPConfig(n_ranks=2, n_experts=4, top_k=2, hidden=hidden, max_tokens_per_rank=6,
                   combine_dtype=combine_dtype)
    for summary, caught in run_pes(poisoned_round_trip, 2, args=(cfg.as_dict(), 5), timeout_s=300,
                                   heap_bytes=BufferLayout(cfg).symmetric_bytes):
        where = f"rank {summary['rank']}, hidden {hidden}, {combine_dtype} partials"
        assert not caught, f"{where}: arithmetic on words no lane loaded:\n" + "\n".join(caught[:5])
        assert summary["dispatch_exact"] and summary["combine_ok"], f"{where}: {summary}"
        assert summary["combine_max_err"] == 0.0, f"{where}: the simulator's combine must match the reference exactly"
