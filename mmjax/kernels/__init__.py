"""Hand-written kernels registered with XLA (see each module: cpu_gemv for CPU decode matmuls)."""
