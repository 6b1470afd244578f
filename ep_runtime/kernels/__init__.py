"""Device code of ep_runtime (installed as ``ep_runtime.kernels``).

Kernels are Numba-CUDA functions that reach SHMEM only through :mod:`ep_runtime.kernels.shmem`,
so the same source runs on NVSHMEM (GPU) and on the CPU simulator (``NUMBA_ENABLE_CUDASIM=1``).
"""
