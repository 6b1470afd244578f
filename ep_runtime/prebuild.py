"""The public path of :mod:`ep_runtime.tools.prebuild` (``python -m ep_runtime.prebuild``)."""
import sys

from ep_runtime.tools import prebuild as _module

if __name__ == "__main__":
    sys.exit(_module.main())
sys.modules[__name__] = _module
