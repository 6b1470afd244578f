"""ep_runtime: expert-parallel MoE dispatch/combine on NVSHMEM symmetric heaps.

Importing the package needs only NumPy and ml_dtypes; GPU packages are imported when a
session or runtime is built. Public names::

    EPConfig, BufferLayout, EPRuntime, open_session, reference, errors
"""

from ep_runtime._version import __version__
from ep_runtime.core.config import EPConfig
from ep_runtime.core.errors import (EPCapacityError, EPConfigError, EPError, EPInputError, EPStateError, EPTimeoutError)
from ep_runtime.core import reference
from ep_runtime.core.layout import BufferLayout


def __getattr__(name):
    # EPRuntime and open_session import Numba lazily: `import ep_runtime` stays light.
    if name == "EPRuntime":
        from ep_runtime.core.runtime import EPRuntime

        return EPRuntime
    if name == "open_session":
        from ep_runtime.shmem import open_session

        return open_session
    raise AttributeError(f"module 'ep_runtime' has no attribute {name!r}")


__all__ = ["__version__", "EPConfig", "BufferLayout", "EPRuntime", "open_session", "reference", "EPError",
           "EPConfigError", "EPInputError", "EPStateError", "EPTimeoutError", "EPCapacityError"]
