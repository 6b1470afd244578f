"""The benchmark tool: ``mpirun -np N python -m ep_runtime.tools.bench --help``.

- :mod:`~ep_runtime.tools.bench.traffic`: bytes each rank moves per call (pure NumPy);
- :mod:`~ep_runtime.tools.bench.measure`: timing (eager and CUDA-graph replay), ceilings and baselines;
- :mod:`~ep_runtime.tools.bench.stats`: medians, percentiles, GB/s.
"""
