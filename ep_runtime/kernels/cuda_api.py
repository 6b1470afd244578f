"""``cuda`` and the scalar types for device code, from the compiler the process builds with.

Kernel modules and device helpers write ``from ep_runtime.kernels.cuda_api import cuda`` instead
of ``from numba import cuda``, and take ``int32``, ``uint64``, ``float32`` ... (and ``types``,
``from_dtype`` for signatures) from here instead of ``numba``: the same source then builds with
numba-cuda or numba-cuda-mlir (:mod:`ep_runtime.kernels.compiler` says which, once per process;
:data:`COMPILER` names it).

WAR: Numba's CUDA simulator makes ``cuda.threadIdx``, ``cuda.atomic``, ``cuda.shared`` ...
work by swapping every module global that *is* ``numba.cuda`` for the running kernel's fake
module when a kernel or device function is entered, and swapping it back on exit. A device
function in another module than its kernel, entered by many simulated threads at once, is
swapped back by the first thread to leave while the others still run, and they then find
the plain simulator module, which has no ``threadIdx`` or ``atomic``. The proxy below is not
``numba.cuda``, so nothing swaps it; it forwards to the running kernel's context (one kernel
per process in the simulator) and otherwise to numba.cuda (for ``jit``, ``local`` ...).
"""

from ep_runtime.kernels import compiler as _compiler

#: The compiler this process builds the kernels with (``"numba-cuda"`` or ``"numba-cuda-mlir"``).
COMPILER = _compiler.bind()
MLIR = COMPILER == _compiler.NUMBA_CUDA_MLIR

if MLIR:
    from numba_cuda_mlir import cuda as _cuda, types
    from numba_cuda_mlir.numba_cuda.np.numpy_support import from_dtype

    #: numba-cuda-mlir has no simulator (compiler.bind refuses it under NUMBA_ENABLE_CUDASIM)
    SIMULATED = False
else:
    from numba import cuda as _cuda, from_dtype, types
    from numba.cuda import config as _config

    SIMULATED = bool(_config.ENABLE_CUDASIM)

int32, int64, uint8, uint16 = types.int32, types.int64, types.uint8, types.uint16
uint32, uint64, float32 = types.uint32, types.uint64, types.float32

if SIMULATED:
    from numba.cuda.simulator.kernel import _get_kernel_context

    _MISSING = object()

    def _sim_device_function(fn):
        """A device function for the simulator: ``fn`` itself where its module holds no
        ``numba.cuda`` (it reaches the kernel's context through this proxy), so a call costs a
        Python call, not the simulator's module swap with its three locks per call, which the
        simulated threads of a block contend for; numba's device wrapper otherwise."""
        if any(v is _cuda for v in fn.__globals__.values()):
            return _cuda.jit(device=True)(fn)
        return fn

    class _SimulatedCuda:
        """Forwards attribute access to the running simulated kernel's fake ``cuda`` module."""

        def __getattr__(self, name):
            ctx = _get_kernel_context()
            if ctx is not None:
                value = getattr(ctx, name, _MISSING)
                if value is not _MISSING:
                    return value
            return getattr(_cuda, name)

        def jit(self, func_or_sig=None, device=False, **options):
            """numba.cuda.jit, but a device function is :func:`_sim_device_function`'s."""
            if not device:
                return _cuda.jit(func_or_sig, device=device, **options) if func_or_sig is not None \
                    else _cuda.jit(device=device, **options)
            if callable(func_or_sig):
                return _sim_device_function(func_or_sig)
            return _sim_device_function

    cuda = _SimulatedCuda()
else:
    cuda = _cuda

# ``shared_atomic.or_(ary, i, v)`` (uint32) and ``shared_atomic.add(ary, i, v)`` (int32): an atomic on
# a shared array, returning the word before, where the array reaches the atomic as a device function's
# argument. On numba-cuda it *is* ``cuda.atomic`` (the same typing and lowering, so the same code).
# WAR: numba-cuda-mlir 0.6.0 lowers an atomic on a device function's array argument as a global one
# whatever the array's memory (docs/upstream/numba-cuda-mlir-shared-atomic.md); its ``shared_atomic``
# issues ``atom.shared`` (mlir_intrinsics). Drop the name for ``cuda.atomic`` once numba-cuda-mlir keeps
# the array's address space. An atomic on a global or symmetric array stays ``cuda.atomic``.
if SIMULATED:
    class _SimulatedSharedAtomic:
        """Forwards ``shared_atomic.<op>`` to the running simulated kernel's ``cuda.atomic.<op>``."""

        def __getattr__(self, name):
            return getattr(cuda.atomic, name)

    shared_atomic = _SimulatedSharedAtomic()
elif not MLIR:
    from numba.cuda.cudadecl import registry as _typing_registry

    shared_atomic = _cuda.atomic
    # numba-cuda types ``cuda.atomic`` as the module type its atomics' typing is keyed on only when
    # reached as ``cuda.atomic``; registering that type for the object makes ``shared_atomic.or_``
    # type, and lower, exactly as ``cuda.atomic.or_``
    _typing_registry.register_global(shared_atomic, types.Module(shared_atomic))


def __getattr__(name):
    # numba-cuda-mlir's shared_atomic, from mlir_intrinsics when a kernel module first imports it
    # (importing it defines its lowerings: not before a process builds kernels)
    if name == "shared_atomic" and MLIR:
        from ep_runtime.kernels.mlir_intrinsics import shared_atomic

        return shared_atomic
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def kernel_jit(threads: int, one_block_per_sm: bool = False, shmem_in_device_functions: bool = False):
    """``@cuda.jit`` for a kernel launched with blocks of ``threads`` threads.

    ``one_block_per_sm``: the smallest shared-memory carveout that holds one block
    (``shared_memory_carveout="MaxL1"``), so at most one block of the kernel runs on an SM. For
    a kernel whose blocks a PDL launch starts while its predecessor's blocks leave the SMs one by
    one: a kernel small enough for two blocks an SM would otherwise stack its blocks on the first
    SMs freed and run them half as fast, and its whole grid ends later (docs/plans.md, "One block
    an SM").

    On a GPU it passes ``max_registers`` = what a block of that size may hold per thread
    (``REGISTERS_PER_SM // threads``, at most 255), so the compiler spills rather than build a
    kernel that fails at launch with CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES (the FP8
    dispatch_async needed 134 registers and did, at 512 threads, before this). A cap, not a
    target: kernels under it compile as before. (``launch_bounds`` was tried: with it ptxas
    chose 64 registers and spilled dispatch_async, which needs 116.) The simulator refuses
    these options: there it is plain ``cuda.jit``.

    ``shmem_in_device_functions``: the kernel's NVSHMEM calls are all in device functions it
    calls, none in its own body. Nothing changes on numba-cuda. WAR: numba-cuda-mlir 0.6.0 links
    nvshmem4py's shim only into a kernel whose own body lowers an NVSHMEM call (a device
    function's link items stay with the device function), so such a kernel fails to link
    ("Undefined reference to '_Z13nvshmem_my_pe_nbst'",
    docs/upstream/numba-cuda-mlir-device-function-shim.md); there the kernel links the shim
    itself (``link=``, with the module set-up that initializes NVSHMEM in the loaded module, as
    an NVSHMEM call in the body would). Drop it once numba-cuda-mlir links a device function's
    link items into its kernel; the compile gate fails to link a kernel that needs it.
    """
    if SIMULATED:
        return _cuda.jit
    if MLIR and shmem_in_device_functions:
        from nvshmem.bindings.device.numba_cuda_mlir import _numbast

        link = {"link": [_numbast.shim_obj]}
    else:
        link = {}
    if one_block_per_sm:
        return _cuda.jit(max_registers=max_registers_for(threads), shared_memory_carveout="MaxL1", **link)
    return _cuda.jit(max_registers=max_registers_for(threads), **link)


def inlined(func):
    """``@cuda.jit(device=True)`` for a stage of a kernel moved into a device function of its own
    so the kernel reads as its stages: inlined into its caller at the NVVM IR level
    (``forceinline``), so the kernel compiles to the code it had with the stage written inline.
    The simulator refuses the option: there it is a plain device function."""
    if SIMULATED:
        return _sim_device_function(func)
    return _cuda.jit(device=True, forceinline=True)(func)


def dispatcher_class():
    """The class of what ``cuda.jit`` returns for a kernel or device function (numba-cuda's
    ``CUDADispatcher``, numba-cuda-mlir's ``MLIRDispatcher``): ``py_func`` and ``targetoptions``
    on both."""
    if MLIR:
        from numba_cuda_mlir.descriptor import MLIRDispatcher

        return MLIRDispatcher
    from numba.cuda.dispatcher import CUDADispatcher

    return CUDADispatcher


#: Registers of one SM (sm_70 to sm_100): a block's threads share them.
REGISTERS_PER_SM = 65536


def max_registers_for(threads: int) -> int:
    """Registers per thread a block of ``threads`` threads may use and still launch."""
    return min(255, REGISTERS_PER_SM // int(threads))


__all__ = ["cuda", "COMPILER", "MLIR", "SIMULATED", "shared_atomic", "inlined", "kernel_jit", "max_registers_for",
           "dispatcher_class",
           "types", "from_dtype", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float32"]
