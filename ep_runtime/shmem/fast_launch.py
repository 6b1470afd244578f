"""Launching a compiled Numba kernel without Numba's per-call dispatch (the ``nvshmem`` session).

One eager ``kernel[grid, block, stream](*args)`` costs more host time than a whole runtime call
may spend (measured: docs/plans.md):
the dispatcher types every argument, picks the overload, converts each array through
``_to_strided_memory_view`` and packs every field into a fresh parameter holder. The runtime
launches the same few kernels with mostly the same arrays, so a :class:`FastLauncher` keeps one
parameter buffer per compiled signature, rewrites only the arguments whose object changed since
the previous launch, and calls the driver directly (``cuLaunchKernel``, or
``cuLaunchCooperativeKernel`` when numba-cuda would launch cooperatively: ``_Kernel.cooperative``,
set for kernels that call an NVSHMEM wait, barrier or collective; ``cuLaunchKernelEx`` with
programmatic stream serialization for the kernels ``ep_runtime.kernels.pdl`` marks).

Parameter layout: exactly numba-cuda 0.30.4's ``_Kernel._prepare_args``, one kernel parameter per
field, each in an 8-byte slot of :class:`ParamBuffer` (the driver copies each parameter's own size
from its slot, low bytes first on little-endian hosts):

=====================  =====================================================================
argument type          parameters
=====================  =====================================================================
Array(dtype, ndim)     meminfo (0), parent (0), nitems, itemsize, data pointer,
                       shape[0..ndim), strides in bytes[0..ndim)
Integer                the value, truncated to its width (``ctypes.c_<type>``)
float32 / float64      the IEEE bits
boolean                0 or 1 (one byte)
=====================  =====================================================================

An argument is accepted only if Numba would type it exactly as the compiled signature (a Numba
device array, or a CuPy array, of that dtype, ndim and layout; a scalar of that exact type; ``int`` for int64,
``float`` for float64, ``bool`` for boolean); anything else makes :meth:`FastLauncher.launch`
return False and the caller takes Numba's path. Kernels Numba launches with extra machinery
(debug kernels, argument extensions, launch-config-sensitive kernels) get no fast launcher.

Identity caching: a slot is rewritten only when ``args[i] is not`` the previous call's object, so
the launcher keeps a reference to the last object of each argument (Numba device arrays are not
mutated in place; NumPy scalars are immutable). :meth:`FastLauncher.forget_args` drops them.
"""

from __future__ import annotations

import ctypes
import struct

import numpy as np

from ep_runtime.core.errors import ShmemError

_2_64 = 1 << 64
_I64_MAX = (1 << 63) - 1


class Unsupported(Exception):
    """The kernel or one of its argument types is not handled by the fast path (message: why)."""


def _numba_layout(a) -> str:
    """The layout Numba types a device array with (``DeviceNDArrayBase._numba_type_``)."""
    flags = a.flags
    broadcast = 0 in a.strides and a.size != 0
    if flags["C_CONTIGUOUS"] and not broadcast:
        return "C"
    if flags["F_CONTIGUOUS"] and not broadcast:
        return "F"
    return "A"


class ParamBuffer:
    """The kernel parameters of one compiled signature, in 8-byte slots, and the ``void*[]``
    array pointing at them that ``cuLaunchKernel`` takes as ``kernelParams``.

    Parameters
    ----------
    argtypes : the compiled signature's Numba argument types (``_Kernel.argument_types``).

    Raises :class:`Unsupported` for argument types outside the table in the module docstring.
    """

    def __init__(self, argtypes):
        from numba.cuda import types
        from numba.cuda.np import numpy_support

        self.argtypes = tuple(argtypes)
        plan, offsets, n = [], [], 0
        for i, ty in enumerate(self.argtypes):
            offsets.append(n)
            if isinstance(ty, types.Array):
                if types.Array(ty.dtype, ty.ndim, ty.layout) != ty:
                    raise Unsupported(f"argument {i}: {ty!r} (read-only or unaligned arrays)")
                plan.append((_array_writer, n, numpy_support.as_dtype(ty.dtype), ty.ndim, ty.layout))
                n += 5 + 2 * ty.ndim
            elif isinstance(ty, types.Integer):
                accepted = {np.dtype(str(ty)).type} | ({int} if ty == types.int64 else set())
                plan.append((_int_writer, n, accepted, (1 << ty.bitwidth) - 1))
                n += 1
            elif ty == types.float32:
                plan.append((_float_writer, n, {np.float32}, "<f", "<I"))
                n += 1
            elif ty == types.float64:
                plan.append((_float_writer, n, {float, np.float64}, "<d", "<q"))
                n += 1
            elif ty == types.boolean:
                plan.append((_bool_writer, n))
                n += 1
            else:
                raise Unsupported(f"argument {i}: type {ty!r} is not handled by the fast launch path")
        self.n_params = n
        self.offsets = tuple(offsets)
        self.slots = (ctypes.c_int64 * max(n, 1))()
        base = ctypes.addressof(self.slots)
        self.pointers = (ctypes.c_void_p * max(n, 1))(*[base + 8 * k for k in range(max(n, 1))])
        #: what ``cuLaunchKernel`` takes as ``kernelParams`` (the address of ``pointers``)
        self.address = ctypes.addressof(self.pointers)
        #: whether every parameter is 8 bytes (arrays, 64-bit scalars), so the slots are the kernel's
        #: parameter block as the ABI lays it out (each parameter at its 8-byte-aligned offset)
        self.abi_block = all(_param_bytes(ty) == 8 for ty in self.argtypes)
        self._block_size = ctypes.c_size_t(8 * n)
        #: what ``cuLaunchKernel`` takes as ``extra`` to copy the slots as one block
        #: (CU_LAUNCH_PARAM_BUFFER_POINTER = 1, CU_LAUNCH_PARAM_BUFFER_SIZE = 2, CU_LAUNCH_PARAM_END = 0),
        #: or None when :attr:`abi_block` is False
        self.extra = None
        if self.abi_block and n:
            self._extra = (ctypes.c_void_p * 5)(1, base, 2, ctypes.addressof(self._block_size), 0)
            self.extra = ctypes.addressof(self._extra)
        self._writers = [make(self.slots, *spec) for make, *spec in plan]
        self._last = [_UNSET] * len(self._writers)
        self._last_args = None  # the last tuple packed whole (the runtime's prepared calls repeat theirs)

    # -- packing --------------------------------------------------------------------------------
    def pack(self, args) -> bool:
        """Write ``args`` into the slots, skipping arguments that are the previous call's objects.
        Returns False (the buffer then holds a mix, see :meth:`forget_args`) if an argument is
        not of the compiled type. The same tuple object as the last one packed whole is not
        looked at again (a tuple cannot change; its elements are checked by identity anyway)."""
        if args is self._last_args:
            return True
        last, writers = self._last, self._writers
        if len(args) != len(writers):
            return False
        self._last_args = None
        for i, a in enumerate(args):
            if a is not last[i]:
                if not writers[i](a):
                    return False
                last[i] = a
        if type(args) is tuple:
            self._last_args = args
        return True

    def forget_args(self) -> None:
        """Drop the references to the last arguments (the next :meth:`pack` rewrites every slot)."""
        self._last = [_UNSET] * len(self._writers)
        self._last_args = None

    def slot_bytes(self, k: int) -> bytes:
        """The 8 bytes of parameter ``k``'s slot (the driver copies the parameter's size from
        their start)."""
        return ctypes.string_at(self.pointers[k], 8)


_UNSET = object()


def _param_bytes(ty) -> int:
    """Bytes of each kernel parameter of Numba type ``ty`` (every field of an array is 8)."""
    from numba.cuda import types

    if isinstance(ty, types.Array):
        return 8
    if isinstance(ty, types.Integer):
        return ty.bitwidth // 8
    if ty == types.float64:
        return 8
    return 4 if ty == types.float32 else 1


# Slot writers: ``make(slots, offset, ...)`` returns ``write(value) -> bool``; False means the
# value is not of the compiled type and nothing was written.


def _array_writer(s, off, dtype, ndim, layout):
    from numba.cuda.cudadrv.devicearray import DeviceNDArrayBase

    itemsize = dtype.itemsize
    lo, hi = off + 2, off + 5 + 2 * ndim  # meminfo and parent (off, off + 1) stay 0

    def write(a):
        if isinstance(a, DeviceNDArrayBase):
            if a.ndim != ndim:
                return False
            dt = a.dtype
            if (dt is not dtype and dt != dtype) or _numba_layout(a) != layout:
                return False
            ptr = a.device_ctypes_pointer.value or 0
        elif _is_cupy(a):  # the runtime's caller arrays: no (costly) Numba wrapper per call
            if a.ndim != ndim or a.dtype != dtype or _cupy_layout(a) != layout:
                return False
            ptr = a.data.ptr
        else:
            return False
        # nitems, itemsize, data, shape..., strides (bytes)...
        s[lo:hi] = (a.size, itemsize, ptr if ptr <= _I64_MAX else ptr - _2_64) + a.shape + a.strides
        return True

    return write


def _is_cupy(a) -> bool:
    return type(a).__module__.startswith("cupy")


def _cupy_layout(a) -> str:
    """The layout Numba would type a CuPy array with (as :func:`_numba_layout`)."""
    broadcast = 0 in a.strides and a.size != 0
    if a.flags.c_contiguous and not broadcast:
        return "C"
    if a.flags.f_contiguous and not broadcast:
        return "F"
    return "A"


def _int_writer(s, off, accepted, mask):
    def write(v):
        if type(v) not in accepted:
            return False
        x = int(v) & mask  # ctypes.c_<type>(v) truncation
        s[off] = x - _2_64 if x > _I64_MAX else x
        return True

    return write


def _float_writer(s, off, accepted, ffmt, ifmt):
    def write(v):
        if type(v) not in accepted:
            return False
        s[off] = struct.unpack(ifmt, struct.pack(ffmt, v))[0]
        return True

    return write


def _bool_writer(s, off):
    def write(v):
        if type(v) not in (bool, np.bool_):
            return False
        s[off] = 1 if v else 0
        return True

    return write


def _dims(grid, block):
    from numba.cuda.errors import normalize_kernel_dimensions

    g, b = normalize_kernel_dimensions(grid, block)
    return tuple(int(x) for x in g) + tuple(int(x) for x in b)


class FastLauncher:
    """Launches one compiled signature of a kernel on one stream through the driver.

    Parameters
    ----------
    kernel : numba-cuda ``_Kernel`` (``dispatcher.compile(argtypes)``'s result), bound to the
        current context.
    stream_handle : int, the ``CUstream`` to launch on.
    programmatic : launch with programmatic stream serialization (``cuLaunchKernelEx`` with
        ``CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION``: the kernel may start while its
        predecessor on the stream finishes; it must wait for it on the device,
        :mod:`ep_runtime.kernels.pdl`). Ignored for cooperative kernels.

    The parameters go to the driver as one block (``extra`` with
    ``CU_LAUNCH_PARAM_BUFFER_POINTER``: one copy) where every parameter is 8 bytes
    (:attr:`ParamBuffer.abi_block`) and the launch is not cooperative
    (``cuLaunchCooperativeKernel`` takes no ``extra``); otherwise as a pointer per parameter
    (``kernelParams``: the driver copies each of them, about 200 for dispatch_async).

    Raises :class:`Unsupported` if Numba would launch this kernel with more than the parameters
    (debug error reporting, argument extensions, launch-config-dependent overloads).
    """

    def __init__(self, kernel, stream_handle: int, programmatic: bool = False):
        from cuda.bindings import driver

        if kernel.debug:
            raise Unsupported("debug kernels report device exceptions through Numba's launch")
        if kernel.extensions:
            raise Unsupported("argument extensions are applied by Numba's launch")
        if getattr(kernel, "launch_config_sensitive", False):
            raise Unsupported("launch-config-sensitive kernels are specialized per launch config")
        self.kernel = kernel
        self.name = kernel.entry_name
        self.cooperative = bool(kernel.cooperative)
        self.params = ParamBuffer(kernel.argument_types)
        self.param_block = self.params.extra is not None and not self.cooperative
        # (kernelParams, extra) of every launch: the pointer array, or the block
        self._param_args = (0, self.params.extra) if self.param_block else (self.params.address, 0)
        handle = kernel.library.get_cufunc().handle
        if isinstance(handle, driver.CUfunction):
            self._func = handle
        else:  # cuda.core loads kernels as CUkernel (library API): get this context's function
            err, func = driver.cuKernelGetFunction(driver.CUkernel(int(handle)))
            if err != driver.CUresult.CUDA_SUCCESS:
                raise Unsupported(f"cuKernelGetFunction failed: {err!r}")
            self._func = func
        self._stream = driver.CUstream(int(stream_handle))
        self._launch = driver.cuLaunchCooperativeKernel if self.cooperative else driver.cuLaunchKernel
        self.programmatic = bool(programmatic) and not self.cooperative
        self._config = None
        if self.programmatic:  # one launch configuration, its dimensions set when they change
            attr = driver.CUlaunchAttribute()
            attr.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
            attr.value.programmaticStreamSerializationAllowed = 1
            self._config = driver.CUlaunchConfig()
            self._config.hStream = self._stream
            self._config.sharedMemBytes = 0
            self._config.attrs = [attr]
            self._config.numAttrs = 1
            self._config_dims = None
            self._launch_ex = driver.cuLaunchKernelEx
        self._ok = driver.CUresult.CUDA_SUCCESS
        self._dim_cache: dict = {}
        self._last_grid = self._last_block = self._last_dims = None

    def launch(self, grid, block, args) -> bool:
        """Enqueue the kernel on the stream; False (nothing launched) if ``args`` do not match the
        compiled signature or the dimensions are not plain integers/tuples (take Numba's path)."""
        if grid is self._last_grid and block is self._last_block:  # the runtime passes the same objects
            dims = self._last_dims
        else:
            try:
                dims = self._dim_cache.get((grid, block))
            except TypeError:  # unhashable dimensions (lists): let Numba normalize them
                return False
            if dims is None:
                dims = self._dim_cache[(grid, block)] = _dims(grid, block)
            self._last_grid, self._last_block, self._last_dims = grid, block, dims
        if not self.params.pack(args):
            return False
        gx, gy, gz, bx, by, bz = dims
        if self.programmatic:
            config = self._config
            if dims is not self._config_dims:
                config.gridDimX, config.gridDimY, config.gridDimZ = gx, gy, gz
                config.blockDimX, config.blockDimY, config.blockDimZ = bx, by, bz
                self._config_dims = dims
            result = self._launch_ex(config, self._func, *self._param_args)
        elif self.cooperative:
            result = self._launch(self._func, gx, gy, gz, bx, by, bz, 0, self._stream, self.params.address)
        else:
            result = self._launch(self._func, gx, gy, gz, bx, by, bz, 0, self._stream, *self._param_args)
        err = result[0] if type(result) is tuple else result  # cuda.bindings returns (CUresult,)
        if err != self._ok:
            raise ShmemError(f"{'cooperative ' if self.cooperative else ''}launch of {self.name[:80]} "
                             f"(grid {dims[:3]}, block {dims[3:]}) failed: {err!r}"
                             + (" (a cooperative grid must fit co-resident on the GPU: "
                                "max_cooperative_grid_blocks)" if self.cooperative else ""))
        return True

    def forget_args(self) -> None:
        """Release the argument objects kept for identity caching."""
        self.params.forget_args()
