"""Summary statistics of timing samples."""

from __future__ import annotations

import numpy as np


def summarize(samples_us) -> dict:
    """``{"median", "p10", "p90", "n"}`` of a list of microsecond samples."""
    a = np.asarray(samples_us, dtype=np.float64)
    if a.size == 0:
        return {"median": float("nan"), "p10": float("nan"), "p90": float("nan"), "n": 0}
    return {"median": float(np.median(a)), "p10": float(np.percentile(a, 10)),
            "p90": float(np.percentile(a, 90)), "n": int(a.size)}


def gbps(nbytes: int, us: float) -> float:
    """GB/s (1e9 bytes per second) of ``nbytes`` moved in ``us`` microseconds."""
    return nbytes / (us * 1e3) if us > 0 else float("nan")
