"""Fused attention-input preparation: RMSNorm -> interleaved RoPE -> optional FP8.

V4 and DSpark prepare every query head and every KV row the same way before attention:
normalise (with or without a weight), rotate the last `rope_dim` dims, and for FP8 caches
quantise with UE8M0 scales. One op lets the GPU do it in one pass over the row; the
reference is literally the composition of the three ops, with the same intermediate
roundings, so the kernel can be checked against it exactly.
"""

from __future__ import annotations

import jax

from jax_dspark import _ffi
from jax_dspark.ops.fp8 import quantize_fp8
from jax_dspark.ops.norm import rms_norm
from jax_dspark.ops.rope import apply_rope


def rms_norm_rope_reference(x, weight=None, freqs=None, *, eps=1e-6, inverse=False, fp8_block=None):
    """`quantize_fp8(apply_rope(rms_norm(x, weight), freqs, inverse), fp8_block)`, each step optional."""
    y = rms_norm(x, weight, eps=eps)
    if freqs is not None:
        y = apply_rope(y, freqs, inverse=inverse)
    return y if fp8_block is None else quantize_fp8(y, fp8_block)


def rms_norm_rope(
    x: jax.Array,
    weight: jax.Array | None = None,
    freqs: jax.Array | None = None,
    *,
    eps: float = 1e-6,
    inverse: bool = False,
    fp8_block: int | None = None,
):
    """RMSNorm (optional weight), RoPE on the last R dims (optional), FP8 output (optional).

    Args:
      x: `[..., D]` floating.
      weight: `[D]` or None.
      freqs: `[..., R/2, 2]` (cos, sin) broadcasting against `x.shape[:-1]` (for
        `x [B, S, H, D]` a per-position table is `[B, S, 1, R/2, 2]`), or None.
      eps: RMSNorm epsilon (> 0).
      inverse: rotate by the negative angle.
      fp8_block: None (output in x.dtype), 64 or 128.
    Returns:
      `y [..., D]` in x.dtype, or `(values f8e4m3fn[..., D], exps uint8[..., D/block])`.
    """
    from jax_dspark.ops import _kernels

    _kernels._check_prep(x, weight, freqs, eps, fp8_block)
    if _ffi.use_kernel("rms_norm_rope"):
        return _kernels.rms_norm_rope(x, weight, freqs, eps=eps, inverse=inverse, fp8_block=fp8_block)
    return rms_norm_rope_reference(x, weight, freqs, eps=eps, inverse=inverse, fp8_block=fp8_block)
