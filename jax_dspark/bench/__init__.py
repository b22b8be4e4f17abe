"""Kernel benchmarks (`jax-dspark bench attention|prep`): the GPU's own ceilings (copy
bandwidth, bf16 GEMM rate), the XLA reference and the CUDA kernel, measured in one run and
written as JSON + a markdown table under docs/benchmarks/."""
