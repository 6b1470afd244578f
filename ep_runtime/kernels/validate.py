"""Device-side routing check (debug mode): expert ids in ``[-1, n_experts)`` (-1: a masked slot)
and distinct per token (masked slots aside), the router weights of unmasked slots finite (and
non-negative unless allowed; a masked slot's weight is ignored, whatever it holds). Stricter than
dispatch_async itself, which drops an out-of-range id (recorded) and counts a repeated id once.

Launched by the runtime just before ``dispatch_async`` when checks are on. It reads the
``[T, K]`` ids and weights once (one thread per token, ``K * (K - 1) / 2`` id comparisons) and
records the first violation in the error record; ``dispatch_async`` then sends nothing, the
host raises :class:`~ep_runtime.core.errors.EPInputError` at its next synchronization, and the
peers' waits time out naming this rank.
"""


#: Largest finite float32: |w| <= FLOAT32_MAX is false exactly for NaN and infinities.
FLOAT32_MAX = 3.4028234663852886e38

from ep_runtime.kernels import shmem
from ep_runtime.kernels.bits import f32_bits
from ep_runtime.kernels.block import record_error
from ep_runtime.kernels.cuda_api import cuda, int64
from ep_runtime.kernels.protocol import (ERR_BAD_EXPERT_ID, ERR_BAD_WEIGHT, ERR_DUPLICATE_EXPERT,
                                         KERNEL_VALIDATE_ROUTING, MASKED_SLOT)


@cuda.jit
def validate_routing(topk_ids, topk_weights, valid_tokens, use_valid, n_experts, allow_negative, status):
    """topk_ids [Tc, K] int32, topk_weights [Tc, K] float32, n_experts and allow_negative int64, status [8]
    int64. Checks the first T rows: T = Tc, or ``min(Tc, valid_tokens[0])`` when use_valid (int64) is nonzero
    (valid_tokens [1] int32, as dispatch_async reads it). Error fields: peer = token, counter = k slot,
    expected = the rule's bound (n_experts, or the other k slot of a duplicate), observed = the offending id
    (or the weight's float32 bit pattern).
    """
    me = shmem.my_pe()
    K = topk_ids.shape[1]
    T = topk_ids.shape[0]
    if use_valid != 0:
        T = max(0, min(T, valid_tokens[0]))
    t = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    stride = cuda.gridDim.x * cuda.blockDim.x
    while t < T:
        for k in range(K):
            e = topk_ids[t, k]
            if e < MASKED_SLOT or e >= n_experts:
                record_error(status, ERR_BAD_EXPERT_ID, KERNEL_VALIDATE_ROUTING, me, t, k, n_experts, e, -1)
            for k2 in range(k + 1, K):
                if e != MASKED_SLOT and topk_ids[t, k2] == e:
                    record_error(status, ERR_DUPLICATE_EXPERT, KERNEL_VALIDATE_ROUTING, me, t, k, k2, e, -1)
            w = topk_weights[t, k]
            if e != MASKED_SLOT and (not (abs(w) <= FLOAT32_MAX) or (allow_negative == 0 and w < 0)):
                record_error(status, ERR_BAD_WEIGHT, KERNEL_VALIDATE_ROUTING, me, t, k, allow_negative,
                             int64(f32_bits(w)), -1)
        t += stride
