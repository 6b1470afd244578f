"""The error hierarchy of ep_runtime.

Every error a user can meet derives from :class:`EPError`. Messages name what was wrong
(the argument, field, rank, kernel, counter), what was expected, what was observed, and
how to fix it. User input is validated once, at the boundary, before anything is launched.
A missing optional dependency names the pip extra of pyproject.toml that installs it
(``sim``: the simulator; ``gpu``: the GPU stack; ``torch``: PyTorch; ``test``: the test suite).
"""

from __future__ import annotations


class EPError(Exception):
    """Base class of every ep_runtime error."""


class EPConfigError(EPError, ValueError):
    """An :class:`~ep_runtime.core.config.EPConfig` field is invalid (raised at construction)."""


class EPInputError(EPError, ValueError):
    """An argument of a runtime call is invalid (shape, dtype, device, contiguity, range).

    Raised before any kernel is launched, so the runtime stays usable.
    """


class EPStateError(EPError, RuntimeError):
    """A call is not valid in the runtime's current state: a handle used twice, out of
    order or on another runtime, a closed runtime, or a runtime that failed earlier."""


class EPTimeoutError(EPError, TimeoutError):
    """A device-side wait ran past ``EPConfig.wait_timeout_s``.

    The message is built from the device error record: the kernel, the waiting rank, the
    peer rank or expert it waited for, the counter, the expected and observed values, and
    the call number, followed by the usual causes.
    """


class EPCapacityError(EPError, RuntimeError):
    """More expert rows arrived than ``EPConfig.max_recv_rows`` allows (nothing is dropped
    silently: the call reports the count it needed)."""


class MissingDependencyError(EPError, ImportError):
    """An optional dependency is not installed; the message names the pip extra that
    installs it (for example ``pip install -e ".[sim]"``)."""


class ShmemError(EPError, RuntimeError):
    """Base class of errors raised by the SHMEM layer (sessions, heaps, the simulator)."""


class SymmetricAddressError(ShmemError, ValueError):
    """An array passed as a symmetric destination does not lie on the symmetric heap."""


class ShmemTimeoutError(ShmemError, TimeoutError):
    """A simulated signal wait or barrier ran past its timeout (the simulator never hangs)."""


class PEFailure(ShmemError):
    """A processing element (rank) of a launched job failed, hung or exited early."""


class GPUUnavailableError(ShmemError):
    """The ``nvshmem`` backend found no usable CUDA driver or GPU on this machine; the
    simulator (``open_session("sim")``, ``python -m ep_runtime demo --backend sim``) runs on
    a CPU."""
