"""The public path of :mod:`ep_runtime.integrations.megatron`: importing it gives that module."""
import sys

from ep_runtime.integrations import megatron as _module

sys.modules[__name__] = _module
