"""The host core: the configuration, the plan that decides how rows move, the buffer layout, the
kernels' argument lists, the typed handles and :class:`~ep_runtime.core.runtime.EPRuntime`, which
owns the symmetric regions and sequences the kernels. Nothing here imports torch or Megatron; the
GPU packages are imported when a runtime is built.
"""
