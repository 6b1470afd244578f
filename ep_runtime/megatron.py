"""The public path of :mod:`ep_runtime.integrations.megatron`: importing it gives that module."""
import importlib
import sys

sys.modules[__name__] = importlib.import_module("ep_runtime.integrations.megatron")
