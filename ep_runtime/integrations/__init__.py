"""What MoE stacks call: PyTorch autograd functions and async calls on torch tensors
(:mod:`~ep_runtime.integrations.torch`, ``torch_compact``, ``torch_async``) and Megatron-core's
``fused_a2a`` names (:mod:`~ep_runtime.integrations.megatron`). Each imports its framework when
imported; the public paths are ``ep_runtime.torch``, ``ep_runtime.torch_compact``,
``ep_runtime.torch_async`` and ``ep_runtime.megatron``.
"""
