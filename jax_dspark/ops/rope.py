"""Interleaved-pair rotary embedding on the last `rope_dim` dims, from a precomputed table.

DeepSeek-V4 and DSpark rotate only the last 64 of 512 dims, pairing adjacent dims
(2i, 2i+1) as one complex number (not the GPT-NeoX half split). The table holds (cos, sin)
per position so kernels and the reference read the same numbers, and the inverse rotation
(used on the attention output, whose values carry RoPE'd channels) is the same table with
the sine negated.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from jax_dspark.ops import _checks


@dataclasses.dataclass(frozen=True, kw_only=True)
class YarnScaling:
    """YaRN frequency interpolation (DeepSeek's variant, no attention-scale change here).

    Frequencies whose wavelength is long relative to `original_max_positions` are divided by
    `factor`; short ones are kept; a linear ramp between `beta_fast` and `beta_slow`
    rotations blends the two. V4's compressed layers use factor 16 from 65536, beta 32/1.
    """

    factor: float
    original_max_positions: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0


def _yarn_frequencies(freqs: np.ndarray, rope_dim: int, theta: float, yarn: YarnScaling) -> np.ndarray:
    def correction_dim(rotations: float) -> float:
        return rope_dim * math.log(yarn.original_max_positions / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(yarn.beta_fast)), 0)
    high = min(math.ceil(correction_dim(yarn.beta_slow)), rope_dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(rope_dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    keep = 1.0 - ramp  # 1 -> keep the original frequency, 0 -> fully interpolated
    return freqs / yarn.factor * (1.0 - keep) + freqs * keep


def rope_table(
    max_positions: int, rope_dim: int, *, theta: float, yarn: YarnScaling | None = None
) -> jax.Array:
    """(cos, sin) for positions `0..max_positions-1`.

    Returns:
      `f32[max_positions, rope_dim // 2, 2]`; `[..., 0]` is cos, `[..., 1]` is sin of
      `position * theta^(-2i / rope_dim)` (YaRN-adjusted when `yarn` is given). Computed in
      float64 on the host so long positions keep full precision before the f32 cast.
    """
    if not (isinstance(rope_dim, int) and rope_dim > 0 and rope_dim % 2 == 0):
        _checks.fail("rope_dim", "must be a positive even int", rope_dim)
    if not (isinstance(max_positions, int) and max_positions > 0):
        _checks.fail("max_positions", "must be a positive int", max_positions)
    if not theta > 1:
        _checks.fail("theta", "must be > 1", theta)
    freqs = 1.0 / (theta ** (np.arange(0, rope_dim, 2, dtype=np.float64) / rope_dim))
    if yarn is not None:
        if not yarn.factor >= 1:
            _checks.fail("yarn.factor", "must be >= 1", yarn.factor)
        freqs = _yarn_frequencies(freqs, rope_dim, theta, yarn)
    angles = np.arange(max_positions, dtype=np.float64)[:, None] * freqs[None, :]
    return jnp.asarray(np.stack([np.cos(angles), np.sin(angles)], axis=-1), dtype=jnp.float32)


def apply_rope(x: jax.Array, freqs: jax.Array, *, inverse: bool = False) -> jax.Array:
    """Rotate the last `R = 2 * freqs.shape[-2]` dims of `x` by interleaved pairs.

    Args:
      x: `[..., D]` with `D >= R`; the first `D - R` dims pass through unchanged.
      freqs: `[..., R/2, 2]` (cos, sin), e.g. `rope_table(...)[positions]`; its leading dims
        broadcast against `x.shape[:-1]`.
      inverse: rotate by the negative angle, so `apply_rope(apply_rope(x, f), f,
        inverse=True) == x` up to rounding.
    Returns:
      `[..., D]` in `x.dtype` (float32 arithmetic).
    """
    _checks.check_floating("x", x)
    fshape = _checks.shape_of(freqs)
    if len(fshape) < 2 or fshape[-1] != 2:
        _checks.fail("freqs", "expected shape [..., rope_dim/2, 2]", fshape)
    xshape = _checks.shape_of(x)
    rope_dim = 2 * fshape[-2]
    if not xshape or rope_dim > xshape[-1]:
        _checks.fail("freqs", f"rope_dim {rope_dim} exceeds x's last dim {xshape[-1:]}", fshape)
    try:
        ok = np.broadcast_shapes(fshape[:-2], xshape[:-1]) == tuple(xshape[:-1])
    except ValueError:
        ok = False
    if not ok:
        _checks.fail("freqs", f"leading dims do not broadcast with x's {xshape[:-1]}", fshape)
    d = xshape[-1]
    xf = x.astype(jnp.float32)
    pairs = xf[..., d - rope_dim :].reshape(*xshape[:-1], rope_dim // 2, 2)
    a, b = pairs[..., 0], pairs[..., 1]
    cos = freqs[..., 0].astype(jnp.float32)
    sin = freqs[..., 1].astype(jnp.float32)
    if inverse:
        sin = -sin
    rotated = jnp.stack([a * cos - b * sin, a * sin + b * cos], axis=-1).reshape(*xshape[:-1], rope_dim)
    return jnp.concatenate([xf[..., : d - rope_dim], rotated], axis=-1).astype(x.dtype)
