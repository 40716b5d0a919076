"""Hand-written kernels registered with XLA (see each module: cpu_gemv for CPU decode matmuls,
cpu_attention for CPU decode attention; cpu_library builds and registers them)."""
