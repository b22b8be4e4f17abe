"""FP8 e4m3 block quantisation with power-of-two (UE8M0) scales rounded up.

DeepSeek's recipe stores one exponent byte per block: scale `s = 2^ceil(log2(amax / 448))`
with amax floored at 1e-4, so `x / s` always fits e4m3's +-448 and the scale multiplies
exactly (no rounding of the scale itself). Activations use 1x128 row blocks (1x64 for the
V4 KV "nope" dims), weights 128x128 blocks. The byte is `127 + log2(s)` (UE8M0 bias 127).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_dspark.ops import _checks

E4M3_MAX = 448.0
AMAX_FLOOR = 1e-4
WEIGHT_BLOCK = 128


def _ceil_log2(r: jax.Array) -> jax.Array:
    """Exact ceil(log2(r)) for positive finite f32 r (frexp avoids log2 rounding at 2^k)."""
    mantissa, exponent = jnp.frexp(r)  # r = mantissa * 2^exponent, mantissa in [0.5, 1)
    return jnp.where(mantissa == 0.5, exponent - 1, exponent).astype(jnp.int32)


def _scale_exponent(amax: jax.Array) -> jax.Array:
    return _ceil_log2(jnp.maximum(amax, AMAX_FLOOR) / E4M3_MAX)


def _quantize_blocks(xb: jax.Array, axes: tuple[int, ...]):
    amax = jnp.max(jnp.abs(xb), axis=axes, keepdims=True)
    exponent = _scale_exponent(amax)
    scaled = xb * jnp.ldexp(jnp.float32(1.0), -exponent)
    values = jnp.clip(scaled, -E4M3_MAX, E4M3_MAX).astype(jnp.float8_e4m3fn)
    return values, (exponent + 127).astype(jnp.uint8)


def e4m3_to_f32(values: jax.Array) -> jax.Array:
    """`float8_e4m3fn` -> f32, decoded from the bits (exact; NaN for the NaN codes).

    Why not `values.astype(f32)`: inside one jit, XLA on GPU may drop a convert pair
    f32 -> e4m3 -> f32 (it allows excess precision by default), so a reference that
    quantises and dequantises in one computation would silently skip the rounding the FP8
    kernels do. No convert pair survives a bitcast to bytes, so this decode keeps it.
    """
    bits = jax.lax.bitcast_convert_type(values, jnp.uint8).astype(jnp.int32)
    exponent, mantissa = (bits >> 3) & 15, (bits & 7).astype(jnp.float32)
    normal = jnp.ldexp(1.0 + mantissa / 8.0, exponent - 7)
    magnitude = jnp.where(exponent == 0, jnp.ldexp(mantissa / 8.0, -6), normal)
    magnitude = jnp.where((exponent == 15) & (bits & 7 == 7), jnp.nan, magnitude)
    return jnp.where(bits >= 128, -magnitude, magnitude)


def round_to_bf16(x: jax.Array) -> jax.Array:
    """f32 rounded to bf16 precision (nearest even) and kept in f32, in a way XLA keeps.

    `x.astype(bf16).astype(f32)` is such a convert pair (see `e4m3_to_f32`); references that
    mirror a kernel writing bf16 intermediates use this instead.
    """
    return jax.lax.reduce_precision(x.astype(jnp.float32), exponent_bits=8, mantissa_bits=7)


def _check_block(block: int) -> None:
    if block not in (32, 64, 128):
        _checks.fail("block", "must be 32, 64 or 128", block)


def quantize_fp8(x: jax.Array, block: int = 128) -> tuple[jax.Array, jax.Array]:
    """Quantise per `1 x block` row block.

    Args:
      x: `[..., D]` floating, `D % block == 0`.
      block: 128 (linear inputs) or 64 (V4 KV nope dims); 32 allowed for MX-style use.
    Returns:
      `values float8_e4m3fn[..., D]`, `exps uint8[..., D // block]` with
      `x ~= values * 2^(exps - 127)` blockwise.
    """
    _checks.check_floating("x", x)
    _check_block(block)
    shape = _checks.shape_of(x)
    if not shape or shape[-1] % block:
        _checks.fail("x", f"last dim must be a multiple of block={block}", shape)
    xb = x.astype(jnp.float32).reshape(*shape[:-1], shape[-1] // block, block)
    values, exps = _quantize_blocks(xb, (-1,))
    return values.reshape(shape), exps[..., 0]


def dequantize_fp8(values: jax.Array, exps: jax.Array, block: int = 128, dtype=jnp.bfloat16) -> jax.Array:
    """Inverse of `quantize_fp8`: `values * 2^(exps - 127)` per `1 x block` block."""
    _check_block(block)
    shape = _checks.shape_of(values)
    if not shape or shape[-1] % block or _checks.shape_of(exps) != (*shape[:-1], shape[-1] // block):
        _checks.fail("exps", f"shape must be {(*shape[:-1], shape[-1] // block) if shape else '?'}", _checks.shape_of(exps))
    _checks.check_dtype("exps", exps, (np.uint8,))
    vb = e4m3_to_f32(values).reshape(*shape[:-1], shape[-1] // block, block)
    scale = jnp.ldexp(jnp.float32(1.0), exps.astype(jnp.int32) - 127)[..., None]
    return (vb * scale).reshape(shape).astype(dtype)


def fp8_round_trip(x: jax.Array, block: int = 128) -> jax.Array:
    """Quantise then dequantise (the reference emulation of FP8 linear inputs), in x.dtype."""
    values, exps = quantize_fp8(x, block)
    return dequantize_fp8(values, exps, block, dtype=x.dtype)


def quantize_fp8_weight(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Quantise per 128x128 block of the last two dims.

    Args:
      w: `[..., N, K]` with N and K multiples of 128.
    Returns:
      `values float8_e4m3fn[..., N, K]`, `exps uint8[..., N // 128, K // 128]`.
    """
    _checks.check_floating("w", w)
    shape = _checks.shape_of(w)
    if len(shape) < 2 or shape[-1] % WEIGHT_BLOCK or shape[-2] % WEIGHT_BLOCK:
        _checks.fail("w", "last two dims must be multiples of 128", shape)
    n, k = shape[-2] // WEIGHT_BLOCK, shape[-1] // WEIGHT_BLOCK
    wb = w.astype(jnp.float32).reshape(*shape[:-2], n, WEIGHT_BLOCK, k, WEIGHT_BLOCK)
    values, exps = _quantize_blocks(wb, (-3, -1))
    return values.reshape(shape), exps[..., 0, :, 0]


def dequantize_fp8_weight(values: jax.Array, exps: jax.Array, dtype=jnp.bfloat16) -> jax.Array:
    """Inverse of `quantize_fp8_weight`."""
    shape = _checks.shape_of(values)
    if len(shape) < 2 or shape[-1] % WEIGHT_BLOCK or shape[-2] % WEIGHT_BLOCK:
        _checks.fail("values", "last two dims must be multiples of 128", shape)
    n, k = shape[-2] // WEIGHT_BLOCK, shape[-1] // WEIGHT_BLOCK
    if _checks.shape_of(exps) != (*shape[:-2], n, k):
        _checks.fail("exps", f"shape must be {(*shape[:-2], n, k)}", _checks.shape_of(exps))
    _checks.check_dtype("exps", exps, (np.uint8,))
    vb = e4m3_to_f32(values).reshape(*shape[:-2], n, WEIGHT_BLOCK, k, WEIGHT_BLOCK)
    scale = jnp.ldexp(jnp.float32(1.0), exps.astype(jnp.int32) - 127)[..., :, None, :, None]
    return (vb * scale).reshape(shape).astype(dtype)
