"""Tools around the runtime: the benchmark (``python -m ep_runtime.tools.bench``), the kernel
prebuild (``python -m ep_runtime.prebuild``), the compile-and-link gate
(``python -m ep_runtime.tools.compile_gate``), the demo and the command line's helpers.
"""
