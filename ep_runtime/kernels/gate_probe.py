"""Probe kernels for the compile-and-link gate (:mod:`ep_runtime.tools.compile_gate`).

They are never launched. Together they call every part of the SHMEM facade that the EP kernels
rely on, so the gate shows on a CPU-only machine that the facade compiles and links against
nvshmem4py's device API for sm_90.
"""

from ep_runtime.kernels import shmem
from ep_runtime.kernels.cuda_api import cuda


@cuda.jit
def probe_put_fence_signal(dst_tokens, src_tokens, dst_meta, src_meta, sig, pe):
    """Block-wide puts of one uint16 (bf16 bits) token row and a uint64 payload, a fence, then
    one signal. Token buffers are 2-D (tokens x hidden); a row of a C array is C-contiguous."""
    row = cuda.blockIdx.x
    shmem.put_nbi_block(dst_tokens[row], src_tokens[row], pe)
    shmem.put_nbi_block(dst_meta, src_meta, pe)
    cuda.syncthreads()
    if cuda.threadIdx.x == 0:
        shmem.fence()
        shmem.signal_op(sig[0:1], 1, shmem.SIGNAL_ADD, pe)


@cuda.jit
def probe_signal_wait_atomics(dst, src, sig, counter, out, want, timeout_ns):
    """put_signal_nbi to the next PE, bounded wait on our own signal, int64 atomics, timer."""
    if cuda.threadIdx.x == 0 and cuda.blockIdx.x == 0:
        me = shmem.my_pe()
        npes = shmem.n_pes()
        peer = (me + 1) % npes
        t0 = shmem.globaltimer_ns()
        shmem.put_signal_nbi(dst, src, sig[0:1], 1, shmem.SIGNAL_ADD, peer)
        shmem.quiet()
        old = shmem.atomic_fetch_add(counter[0:1], 1, peer)
        seen = shmem.wait_signal_ge(sig[1:2], want, timeout_ns)
        out[0] = old
        out[1] = seen
        out[2] = shmem.signal_fetch(sig[0:1])
        out[3] = shmem.globaltimer_ns() - t0
