"""ep_runtime: expert-parallel MoE dispatch/combine on NVSHMEM symmetric heaps.

Importing the package needs only NumPy and ml_dtypes; GPU packages are imported when a
session or runtime is built. Public names::

    EPConfig, BufferLayout, EPRuntime, open_session, reference, errors
"""

from ._version import __version__
from .config import EPConfig
from .errors import (EPCapacityError, EPConfigError, EPError, EPInputError, EPStateError, EPTimeoutError)
from .layout import BufferLayout


def __getattr__(name):
    # EPRuntime and open_session import Numba lazily: `import ep_runtime` stays light.
    if name == "EPRuntime":
        from .runtime import EPRuntime

        return EPRuntime
    if name == "open_session":
        from .shmem import open_session

        return open_session
    raise AttributeError(f"module 'ep_runtime' has no attribute {name!r}")


__all__ = ["__version__", "EPConfig", "BufferLayout", "EPRuntime", "open_session", "EPError", "EPConfigError",
           "EPInputError", "EPStateError", "EPTimeoutError", "EPCapacityError"]
