"""Small SHMEM exchange kernels that check the facade itself.

Written only against :mod:`ep_runtime.kernels.shmem`, so the same source runs on the CPU
simulator (tests/test_shmem_sim.py), on GPUs under NVSHMEM, and through the compile-and-link
gate. Arguments are C-contiguous int32/uint16/float32/uint64 arrays and int scalars.

Shared layout (``P = n_pes()``, ``me = my_pe()``, ``n`` elements per row):

=========  ============  =========  ==========================================================
argument   shape         where      meaning
=========  ============  =========  ==========================================================
recv       [P, n]        symmetric  row ``s`` is written by PE ``s``
send       [P, n]        any        row ``d`` goes to PE ``d``
row        [n]           any        this PE's row of a ring
sig        [P] uint64    symmetric  ``sig[s]`` is signalled by PE ``s``; starts at 0
out        [P, n]        any        the rows received, copied out after their signal
epoch      int >= 1      scalar     the signal value of this round (monotonic, compared >=)
=========  ============  =========  ==========================================================
"""

from ep_runtime.kernels import shmem
from ep_runtime.kernels.cuda_api import cuda


@cuda.jit
def ring_put_signal(recv, row, sig, epoch, out):
    """(a) Ring with ``put_signal_block``: PE ``me`` writes ``row`` into ``recv[me]`` of PE
    ``me + 1`` and sets its ``sig[me]`` to ``epoch``; then waits for ``sig[me - 1] >= epoch``
    and copies ``recv[me - 1]`` into ``out[me - 1]``. Launch with one block."""
    me = shmem.my_pe()
    npes = shmem.n_pes()
    shmem.put_signal_block(recv[me], row, sig[me:me + 1], epoch, shmem.SIGNAL_SET, (me + 1) % npes)
    _copy_row_when_signalled(recv, sig, epoch, out, (me + npes - 1) % npes)


@cuda.jit
def ring_put_quiet_signal(recv, row, sig, epoch, out):
    """(a) Ring with ``put``, ``quiet``, ``signal_op`` by thread 0: otherwise the same as
    :func:`ring_put_signal`. Launch with one block."""
    me = shmem.my_pe()
    npes = shmem.n_pes()
    if cuda.threadIdx.x == 0:
        shmem.put(recv[me], row, (me + 1) % npes)
        shmem.quiet()
        shmem.signal_op(sig[me:me + 1], epoch, shmem.SIGNAL_SET, (me + 1) % npes)
    _copy_row_when_signalled(recv, sig, epoch, out, (me + npes - 1) % npes)


@cuda.jit(device=True)
def _copy_row_when_signalled(recv, sig, epoch, out, src_pe):
    """Thread 0 waits until ``sig[src_pe] >= epoch``; then the block copies ``recv[src_pe]``
    into ``out[src_pe]``. Every thread of the block calls."""
    if cuda.threadIdx.x == 0:
        shmem.signal_wait(sig[src_pe:src_pe + 1], shmem.CMP_GE, epoch)
    cuda.syncthreads()
    for i in range(cuda.threadIdx.x, recv.shape[1], cuda.blockDim.x):
        out[src_pe, i] = recv[src_pe, i]


@cuda.jit
def alltoall_put_nbi_fence(recv, send, sig, epoch):
    """(b) All-to-all: block ``d`` sends ``send[d]`` into PE ``d``'s ``recv[me]``
    (``put_nbi_block``), then thread 0 fences and sets PE ``d``'s ``sig[me]`` to ``epoch``.
    Launch with ``P`` blocks."""
    me = shmem.my_pe()
    dst_pe = cuda.blockIdx.x
    shmem.put_nbi_block(recv[me], send[dst_pe], dst_pe)
    if cuda.threadIdx.x == 0:
        # The fence orders the put before the signal: the receiver may read once signalled.
        shmem.fence()
        shmem.signal_op(sig[me:me + 1], epoch, shmem.SIGNAL_SET, dst_pe)


@cuda.jit
def alltoall_put_nbi_no_fence(recv, send, sig, epoch):
    """(b) Deliberately broken twin of :func:`alltoall_put_nbi_fence` without the fence: the
    signal may overtake the data. Tests use it to check that the simulator shows the bug."""
    me = shmem.my_pe()
    dst_pe = cuda.blockIdx.x
    shmem.put_nbi_block(recv[me], send[dst_pe], dst_pe)
    if cuda.threadIdx.x == 0:
        shmem.signal_op(sig[me:me + 1], epoch, shmem.SIGNAL_SET, dst_pe)


@cuda.jit
def wait_all_copy_out(recv, sig, epoch, out):
    """(c) Block ``s``: thread 0 waits until ``sig[s] >= epoch``, then the block copies
    ``recv[s]`` into ``out[s]``. Launch with ``P`` blocks."""
    _copy_row_when_signalled(recv, sig, epoch, out, cuda.blockIdx.x)


@cuda.jit
def count_on_pe0(counter, slots):
    """(d) Thread 0 of each block takes a ticket ``slots[block] = counter[0]++`` on PE 0
    (``atomic_fetch_add``). ``counter``: symmetric uint64[1]; ``slots``: uint64[blocks]."""
    if cuda.threadIdx.x == 0:
        slots[cuda.blockIdx.x] = shmem.atomic_fetch_add(counter[0:1], 1, 0)


@cuda.jit
def put_pattern(dst, src, pe):
    """(e) Thread 0 puts ``src`` into PE ``pe``'s ``dst`` and completes it (``quiet``). With
    both arrays symmetric and distinct patterns, swapped dst/src moves the wrong data."""
    if cuda.threadIdx.x == 0:
        shmem.put(dst, src, pe)
        shmem.quiet()


@cuda.jit
def alltoall_put_signal_warp(recv, send, sig):
    """Warp-scope all-to-all: block ``d`` sends ``send[d]`` to PE ``d``, each warp one chunk
    of ``n / warps`` elements with ``put_signal_nbi_warp`` and ``SIGNAL_ADD 1`` on
    ``sig[me]``, so PE ``d``'s ``sig[me]`` grows by the number of warps. Launch with ``P``
    blocks of a multiple of 32 threads that divides ``n`` into equal chunks."""
    me = shmem.my_pe()
    dst_pe = cuda.blockIdx.x
    warps = cuda.blockDim.x // 32
    chunk = recv.shape[1] // warps
    lo = (cuda.threadIdx.x // 32) * chunk
    shmem.put_signal_nbi_warp(recv[me, lo:lo + chunk], send[dst_pe, lo:lo + chunk],
                              sig[me:me + 1], 1, shmem.SIGNAL_ADD, dst_pe)


@cuda.jit
def wait_ge_copy_out(recv, sig, target, timeout_ns, out, seen):
    """Block ``s``: thread 0 waits at most ``timeout_ns`` for ``sig[s] >= target``
    (``wait_signal_ge``) and stores the observed value in ``seen[s]`` (uint64); the block
    then copies ``recv[s]`` into ``out[s]`` if the wait succeeded. Launch with ``P`` blocks."""
    src_pe = cuda.blockIdx.x
    if cuda.threadIdx.x == 0:
        seen[src_pe] = shmem.wait_signal_ge(sig[src_pe:src_pe + 1], target, timeout_ns)
    cuda.syncthreads()
    if seen[src_pe] >= target:
        for i in range(cuda.threadIdx.x, recv.shape[1], cuda.blockDim.x):
            out[src_pe, i] = recv[src_pe, i]


@cuda.jit
def atomic_mix(counters, results):
    """Thread 0: on PE 0, ``counters[0] += 1`` (atomic_inc), ``results[0] = counters[1]++``
    (atomic_fetch_inc), ``counters[2] += me + 1`` (atomic_add), ``results[1] =
    compare_swap(counters[3], 0 -> me + 1)``; on this PE ``counters[4] = me + 100``
    (atomic_set) and ``results[2] = counters[4]`` (atomic_fetch). ``counters``: symmetric
    uint64[5] of zeros; ``results``: uint64[3]."""
    if cuda.threadIdx.x == 0:
        me = shmem.my_pe()
        shmem.atomic_inc(counters[0:1], 0)
        results[0] = shmem.atomic_fetch_inc(counters[1:2], 0)
        shmem.atomic_add(counters[2:3], me + 1, 0)
        results[1] = shmem.atomic_compare_swap(counters[3:4], 0, me + 1, 0)
        shmem.atomic_set(counters[4:5], me + 100, me)
        results[2] = shmem.atomic_fetch(counters[4:5], me)



@cuda.jit
def ring_peer_store_signal(peer_recv_row, recv, row, sig, epoch, out):
    """(f) Ring with direct stores into an NVLink peer's copy: the block stores ``row`` through
    ``peer_recv_row`` (a host-made peer view of PE ``me + 1``'s ``recv[me]``), every storing
    thread fences at system scope, then thread 0 sets PE ``me + 1``'s ``sig[me]`` to ``epoch``;
    then, as :func:`ring_put_signal`, copies this PE's ``recv[me - 1]`` out once it is
    signalled. Launch with one block."""
    me = shmem.my_pe()
    npes = shmem.n_pes()
    for i in range(cuda.threadIdx.x, row.shape[0], cuda.blockDim.x):
        peer_recv_row[i] = row[i]
    cuda.threadfence_system()
    cuda.syncthreads()
    if cuda.threadIdx.x == 0:
        shmem.signal_op(sig[me:me + 1], epoch, shmem.SIGNAL_SET, (me + 1) % npes)
    _copy_row_when_signalled(recv, sig, epoch, out, (me + npes - 1) % npes)
