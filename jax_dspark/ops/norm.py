"""RMSNorm with an optional weight, computed in float32.

V4 uses RMSNorm both with a learned weight (q LoRA, kv, layer norms) and without one (the
per-head query norm), so the weight is optional rather than a separate op.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_dspark.ops import _checks


def rms_norm(x: jax.Array, weight: jax.Array | None = None, *, eps: float = 1e-6) -> jax.Array:
    """`x / sqrt(mean(x^2) + eps) * weight` over the last axis.

    Args:
      x: `[..., D]` floating array.
      weight: `[D]` or None (no scaling).
      eps: added to the mean square; must be > 0 so a zero row stays finite.
    Returns:
      `[..., D]` in `x.dtype`; the arithmetic is float32 whatever the input dtype.
    """
    _checks.check_floating("x", x)
    if len(_checks.shape_of(x)) < 1:
        _checks.fail("x", "needs at least one axis", _checks.shape_of(x))
    d = _checks.shape_of(x)[-1]
    if weight is not None and _checks.shape_of(weight) != (d,):
        _checks.fail("weight", f"shape must be ({d},) to match x's last dim", _checks.shape_of(weight))
    if not eps > 0:
        _checks.fail("eps", "must be > 0", eps)
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    if weight is not None:
        y = y * weight.astype(jnp.float32)
    return y.astype(x.dtype)
