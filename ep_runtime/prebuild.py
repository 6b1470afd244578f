"""The public path of :mod:`ep_runtime.tools.prebuild` (``python -m ep_runtime.prebuild``)."""
import importlib
import sys

_module = importlib.import_module("ep_runtime.tools.prebuild")
if __name__ == "__main__":
    sys.exit(_module.main())
sys.modules[__name__] = _module
