"""A symmetric heap too small for a runtime's buffers, or too large for its GPU, is refused before
anything is allocated, naming what needs the room and how to fix it (wide expert parallelism:
the regions grow with n_ranks x max_tokens_per_rank, docs/wide_ep.md, "Memory")."""

import pytest

from ep_runtime import EPConfig
from ep_runtime.core.errors import EPConfigError
from ep_runtime.core.layout import BufferLayout
from ep_runtime.core.runtime import EPRuntime
from ep_runtime.shmem.env import HEAP_SLACK_BYTES
from ep_runtime.shmem.launch import run_pes
from ep_runtime.shmem.nvshmem_session import check_heap_fits_gpu

CFG = dict(n_ranks=2, n_experts=4, top_k=2, hidden=64, max_tokens_per_rank=64)


def build_runtime(session, cfg_dict):
    """One PE: build a runtime on a heap of the session's size; the error text, or None."""
    try:
        EPRuntime(EPConfig(**cfg_dict), session)
    except EPConfigError as exc:
        return str(exc)
    return None


def test_a_runtime_whose_buffers_exceed_the_heap_is_refused_naming_the_regions():
    every = BufferLayout(EPConfig(**CFG)).symmetric_bytes  # every region a plan may allocate
    for text in run_pes(build_runtime, 2, args=(CFG,), heap_bytes=16 << 10, timeout_s=120):
        assert text is not None, "the runtime was built on a 16 KiB heap"
        assert "KiB of symmetric heap, more than the session's 16.0 KiB" in text, text
        assert "dispatch_tokens [2, 64, " in text and "heap_bytes >= BufferLayout(cfg, plan).symmetric_bytes" in text
    # the same config on a heap of its size builds
    assert run_pes(build_runtime, 2, args=(CFG,), heap_bytes=every, timeout_s=120) == [None, None]


def test_the_layout_names_its_largest_regions_largest_first():
    text = BufferLayout(EPConfig(**CFG)).largest(n=2)
    names = [part.split(" ")[0] for part in text.split("; ")]
    layout = BufferLayout(EPConfig(**CFG))
    sizes = sorted((r.nbytes for r in layout.symmetric_regions), reverse=True)
    assert [layout.region(n).nbytes for n in names] == sizes[:2], text


def test_a_heap_past_the_gpus_memory_is_refused_before_nvshmem_starts():
    gib = 1 << 30
    check_heap_fits_gpu(100 * gib, 141 * gib, 0, 0)  # fits an H200
    with pytest.raises(EPConfigError, match=r"rank 3: a symmetric heap of 149\.\d GiB per PE .* cannot fit "
                                            r"GPU 1's 139\.8 GiB.*lower max_tokens_per_rank"):
        check_heap_fits_gpu(149 * gib + (1 << 29) - HEAP_SLACK_BYTES + 1, int(139.8 * gib), 3, 1)
    with pytest.raises(EPConfigError):  # the slack counts
        check_heap_fits_gpu(80 * gib - HEAP_SLACK_BYTES + 1, 80 * gib, 0, 0)
