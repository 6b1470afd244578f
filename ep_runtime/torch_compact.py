"""The public path of :mod:`ep_runtime.integrations.torch_compact`: importing it gives that module."""
import sys

from ep_runtime.integrations import torch_compact as _module

sys.modules[__name__] = _module
