"""The DSpark training loss (DeepSpec recipe, spec section 7).

For a block at anchor a, slot k predicts token a+k+1. Three terms, each weighted per
position by `w_k = exp(-k / decay)` on the valid (contiguous) prefix and normalised by the
sum of weights over the batch, so long blocks do not dominate and early slots, which decide
the acceptance length, matter most:

- 0.1 x cross-entropy of the label under the Markov-corrected draft distribution;
- 0.9 x `||p_draft - p_target||_1` (twice the total-variation distance, as DeepSpec writes
  it): acceptance of a draft under rejection sampling is `1 - TV`, so this term trains for
  acceptance directly, not just for the argmax;
- 1.0 x BCE of the confidence logit against `1 - TV` (stop-gradient), the analytic
  acceptance probability, so the confidence head learns calibrated survival.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class LossWeights:
    ce: float = 0.1
    tv: float = 0.9
    bce: float = 1.0
    decay: float = 4.0


def dspark_loss(
    draft_logits: jax.Array,
    target_logits: jax.Array,
    labels: jax.Array,
    valid: jax.Array,
    confidence_logits: jax.Array | None = None,
    weights: LossWeights = LossWeights(),
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Scalar loss and metrics.

    Args:
      draft_logits: `[N, g, V]` corrected draft logits (Markov bias from teacher-forced
        predecessors).
      target_logits: `[N, g, V]` target logits for the same positions (frozen head).
      labels: `int32[N, g]` tokens a+1 .. a+g.
      valid: `bool[N, g]` contiguous-prefix mask (padding anchors are all False).
      confidence_logits: `[N, g]` or None (no confidence head).
    Returns:
      `(loss, {"ce", "tv", "bce", "acceptance", "weight"})`; "acceptance" is the weighted
      mean of `1 - TV`, the expected per-position acceptance at T = 1.
    """
    g = draft_logits.shape[1]
    w = jnp.exp(-jnp.arange(g, dtype=jnp.float32) / weights.decay)[None, :] * valid.astype(jnp.float32)
    total = jnp.maximum(jnp.sum(w), 1e-6)
    logp_d = jax.nn.log_softmax(draft_logits.astype(jnp.float32), axis=-1)
    p_d = jnp.exp(logp_d)
    p_t = jax.nn.softmax(target_logits.astype(jnp.float32), axis=-1)
    ce = -jnp.take_along_axis(logp_d, labels[..., None].astype(jnp.int32), axis=-1)[..., 0]
    l1 = jnp.sum(jnp.abs(p_d - p_t), axis=-1)
    accept = jax.lax.stop_gradient(1.0 - 0.5 * l1)
    metrics = {
        "ce": jnp.sum(w * ce) / total,
        "tv": jnp.sum(w * l1) / total,
        "acceptance": jnp.sum(w * accept) / total,
        "weight": total,
    }
    loss = weights.ce * metrics["ce"] + weights.tv * metrics["tv"]
    if confidence_logits is not None:
        c = confidence_logits.astype(jnp.float32)
        bce = jnp.maximum(c, 0) - c * accept + jnp.log1p(jnp.exp(-jnp.abs(c)))
        metrics["bce"] = jnp.sum(w * bce) / total
        loss = loss + weights.bce * metrics["bce"]
    return loss, metrics
