"""What MoE stacks call: PyTorch autograd functions and async calls on torch tensors
(:mod:`~ep_runtime.integrations.torch`, ``torch_compact``, ``torch_async``), DeepEP's Python API
(:mod:`~ep_runtime.integrations.deep_ep`: what ``import deep_ep`` gives after the install step)
and Megatron-core's own ``fused_a2a`` on it (:mod:`~ep_runtime.integrations.megatron`). Each
imports its framework when imported; the public paths are ``ep_runtime.torch``,
``ep_runtime.torch_compact``, ``ep_runtime.torch_async``, ``ep_runtime.deep_ep`` and
``ep_runtime.megatron``.
"""
