"""Ops with a pure-JAX reference each, dispatched to CUDA kernels where registered.

Every public function validates its inputs (ValueError naming the argument and value)
before anything runs. On a GPU backend with the kernel library loaded, ops that have a
kernel call it; elsewhere the reference runs. `force("reference")` / `force("kernel")`
override the choice (for tests and benchmarks); `force` also works as a context manager.
"""

from __future__ import annotations

import contextlib

from jax_dspark import _ffi
from jax_dspark.ops.attention import merge_partials, sparse_sink_attention, sparse_sink_attention_reference
from jax_dspark.ops.fp8 import (
    dequantize_fp8,
    dequantize_fp8_weight,
    fp8_round_trip,
    quantize_fp8,
    quantize_fp8_weight,
)
from jax_dspark.ops.kv_fp8 import Fp8Rows, dequantize_kv_rows, quantize_kv_rows
from jax_dspark.ops.moe import (
    expert_parallel,
    hash_route,
    mlp_swiglu,
    moe_experts,
    moe_experts_reference,
    router_scores,
    swiglu,
    topk_route,
)
from jax_dspark.ops.moe_fp8 import Fp8Weight, moe_experts_fp8, moe_experts_fp8_reference, quantize_expert_weights
from jax_dspark.ops.norm import rms_norm
from jax_dspark.ops.prep import rms_norm_rope, rms_norm_rope_reference
from jax_dspark.ops.rope import YarnScaling, apply_rope, rope_table
from jax_dspark.ops.sampling import SamplingParams, gumbel_sample, probabilities, process_logits, sample


@contextlib.contextmanager
def _restoring(previous: str):
    try:
        yield
    finally:
        _ffi.set_force_mode(previous)


def force(mode: str):
    """Choose kernels or references for every op: "auto", "reference" or "kernel".

    Takes effect at trace time (already-jitted functions keep what they traced with).
    Returns a context manager that restores the previous mode on exit, so both
    `ops.force("reference")` and `with ops.force("reference"): ...` work.
    """
    previous = _ffi.force_mode()
    _ffi.set_force_mode(mode)
    return _restoring(previous)


__all__ = [
    "Fp8Rows",
    "Fp8Weight",
    "YarnScaling",
    "SamplingParams",
    "apply_rope",
    "dequantize_fp8",
    "dequantize_fp8_weight",
    "dequantize_kv_rows",
    "expert_parallel",
    "force",
    "fp8_round_trip",
    "gumbel_sample",
    "hash_route",
    "merge_partials",
    "mlp_swiglu",
    "moe_experts",
    "moe_experts_fp8",
    "moe_experts_fp8_reference",
    "moe_experts_reference",
    "probabilities",
    "process_logits",
    "quantize_expert_weights",
    "quantize_fp8",
    "quantize_fp8_weight",
    "quantize_kv_rows",
    "rms_norm",
    "rms_norm_rope",
    "rms_norm_rope_reference",
    "rope_table",
    "router_scores",
    "sample",
    "sparse_sink_attention",
    "sparse_sink_attention_reference",
    "swiglu",
    "topk_route",
]
