"""The public path of :mod:`ep_runtime.integrations.torch_async`: importing it gives that module."""
import sys

from ep_runtime.integrations import torch_async as _module

sys.modules[__name__] = _module
