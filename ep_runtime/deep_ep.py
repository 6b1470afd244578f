"""The public path of :mod:`ep_runtime.integrations.deep_ep`: importing it gives that package."""
import sys

from ep_runtime.integrations import deep_ep as _module

sys.modules[__name__] = _module
