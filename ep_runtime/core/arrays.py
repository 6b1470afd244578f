"""Array interop and argument validation at the API boundary.

On the ``nvshmem`` backend the runtime takes CuPy arrays, any object with
``__cuda_array_interface__``, or DLPack producers (PyTorch tensors), without copying; on the
``sim`` backend it takes NumPy arrays. bfloat16 data may come as bfloat16 (ml_dtypes,
torch.bfloat16) or as its uint16 bit pattern; the kernels see uint16. Validation happens
here, before any launch, and never adjusts an input silently. FP8 E4M3 data
(``ml_dtypes.float8_e4m3fn``, ``torch.float8_e4m3fn``) is viewed as its uint8 codes.
"""

from __future__ import annotations

import numpy as np

from ep_runtime.core.errors import EPInputError

_BF16_NAMES = ("bfloat16",)
_FP8_NAMES = ("float8_e4m3fn",)


def _package(t: type) -> str:
    """The top-level package that defines type ``t`` (``"torch"``, ``"cupy"``, ``"numpy"``...)."""
    return t.__module__.split(".")[0]


def _is_torch(x) -> bool:
    return _package(type(x)) == "torch"


def to_backend(x, backend: str, call: str, name: str):
    """``x`` as the backend's array type (NumPy on sim, CuPy on nvshmem), sharing memory.

    bfloat16 arrays are viewed as uint16 (their bit pattern).
    """
    if backend == "sim":
        if not isinstance(x, np.ndarray):
            raise EPInputError(f"{call}: {name} must be a NumPy array on the 'sim' backend; got "
                               f"{type(x).__name__}. Pass numpy arrays (or use the 'nvshmem' backend).")
        if x.dtype.name in _BF16_NAMES:
            return x.view(np.uint16)
        return x.view(np.uint8) if x.dtype.name in _FP8_NAMES else x
    import cupy

    arr = _as_cupy(x, call, name)
    if arr.device.id != cupy.cuda.Device().id:
        raise EPInputError(f"{call}: {name} is on GPU {arr.device.id} but this rank's runtime uses GPU "
                           f"{cupy.cuda.Device().id}; create it on this rank's device (cupy.cuda.Device(i).use(), "
                           f"tensor.to(device)).")
    return arr


def _as_cupy(x, call: str, name: str):
    """``x`` as a CuPy array sharing its memory (bfloat16 viewed as uint16)."""
    import cupy

    if _is_torch(x):
        import torch

        if not x.is_cuda:
            raise EPInputError(f"{call}: {name} is a CPU tensor; move it to this rank's GPU first "
                               f"(tensor.cuda()).")
        if x.dtype == torch.bfloat16:
            x = x.view(torch.int16)
        elif str(x.dtype) == "torch.float8_e4m3fn":
            x = x.view(torch.uint8)
        arr = cupy.from_dlpack(x)
        return arr.view(cupy.uint16) if arr.dtype == cupy.int16 else arr
    if isinstance(x, cupy.ndarray):
        return x
    if hasattr(x, "__cuda_array_interface__"):
        return cupy.asarray(x)
    if hasattr(x, "__dlpack__"):
        return cupy.from_dlpack(x)
    raise EPInputError(f"{call}: {name} must be a device array (CuPy, __cuda_array_interface__ or DLPack, "
                       f"e.g. a CUDA torch tensor); got {type(x).__name__}. Host NumPy arrays must be "
                       f"copied to the GPU first (cupy.asarray(x)).")


def check_array(x, call: str, name: str, dtype, shape: tuple, fix: str) -> None:
    """Require dtype, shape (``None`` entries match any size) and C-contiguity."""
    dt = np.dtype(dtype)
    if np.dtype(x.dtype) != dt:
        want = "bfloat16 (or its uint16 bit pattern)" if dt == np.uint16 else dt.name
        raise EPInputError(f"{call}: {name} must have dtype {want}; got {x.dtype}. {fix}")
    if len(x.shape) != len(shape) or any(w is not None and w != s for w, s in zip(shape, x.shape)):
        want = "[" + ", ".join("*" if w is None else str(w) for w in shape) + "]"
        raise EPInputError(f"{call}: {name} must have shape {want}; got {list(x.shape)}. {fix}")
    contiguous = x.flags.c_contiguous if hasattr(x, "flags") else True
    if not contiguous:
        raise EPInputError(f"{call}: {name} must be C-contiguous; pass a contiguous copy "
                           f"(ascontiguousarray).")


def word_view(x, word: np.dtype, call: str, name: str):
    """The C-contiguous bf16 (uint16) array ``x`` viewed in the kernels' token word
    (:func:`ep_runtime.core.layout.token_word`), sharing memory. Its data must be aligned to the
    word: a misaligned start (e.g. a view beginning at an odd element) is refused."""
    word = np.dtype(word)
    ptr = x.data.ptr if hasattr(x.data, "ptr") else x.__array_interface__["data"][0]
    if ptr % word.itemsize:
        raise EPInputError(f"{call}: {name} starts at address {ptr:#x}, not {word.itemsize}-byte aligned; "
                           f"the kernels move rows as {word.name} words. Pass an array whose data starts "
                           f"on a {word.itemsize}-byte boundary (e.g. a fresh allocation or a copy).")
    return x.view(word)


def fingerprint(x):
    """What :func:`to_backend`, :func:`check_array` and :func:`word_view` conclude about
    ``x`` depends on: its type, data address, shape, strides and dtype (``None`` for None).
    Two calls that pass the same object with the same fingerprint get the same conclusions,
    so the runtime reuses a call's validated, converted arguments (:mod:`ep_runtime.core.call_memo`).
    A NumPy array's address is left out: it cannot change while the memo holds a reference
    (``data`` is read-only and ``resize`` refuses a referenced array). Objects of other types
    than CuPy, NumPy and PyTorch arrays get a fresh token each time (never reused). Cheap for
    a NumPy or CuPy array (the type's extractor is looked up once per type)."""
    if x is None:
        return None
    t = type(x)
    extract = _FINGERPRINTS.get(t)
    if extract is None:
        extract = _FINGERPRINTS[t] = _fingerprint_of_type(t)
    return extract(x)


def _fingerprint_of_type(t):
    """The fingerprint function for arrays of type ``t`` (see :func:`fingerprint`)."""
    if _package(t) == "cupy":
        return lambda x: (t, x.data.ptr, x.shape, x.strides, x.dtype)
    if t is np.ndarray:
        return lambda x: (t, x.shape, x.strides, x.dtype)
    if _package(t) == "torch":
        return lambda x: (t, x.data_ptr(), x.shape, x.stride(), x.dtype)
    return lambda x: object()


_FINGERPRINTS: dict = {}
