"""The one place that sets environment variables for NVSHMEM (and logs them).

NVSHMEM reads its environment at ``nvshmem.core.init``; everything it needs from us is set
here, before init, and logged at INFO level on logger ``ep_runtime.shmem``:

- ``NVSHMEM_SYMMETRIC_SIZE``: bytes of symmetric heap per PE. NVSHMEM's default (1 GiB) is
  too small for large layers; we set the layout's need plus :data:`HEAP_SLACK_BYTES` unless
  the user already asked for at least that much.
- ``NVSHMEM_DISABLE_NVLS=1``: NVLink multicast stays off (it can take shared hosts' GPUs out
  of service); we set it unless the user set it.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger("ep_runtime.shmem")

#: Room NVSHMEM needs on the heap besides our regions (its signals, barriers, teams).
HEAP_SLACK_BYTES = 64 << 20


def _parse_size(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    text = text.strip().lower().rstrip("b")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def configure_nvshmem_env(heap_bytes: int) -> dict:
    """Set NVSHMEM's variables for a heap of ``heap_bytes`` per PE; returns what was set."""
    changes = {}
    want = int(heap_bytes) + HEAP_SLACK_BYTES
    have = os.environ.get("NVSHMEM_SYMMETRIC_SIZE")
    if have is None or _parse_size(have) < want:
        changes["NVSHMEM_SYMMETRIC_SIZE"] = str(want)
    if "NVSHMEM_DISABLE_NVLS" not in os.environ:
        changes["NVSHMEM_DISABLE_NVLS"] = "1"
    os.environ.update(changes)
    for k, v in changes.items():
        log.info("set %s=%s", k, v)
    return changes
