"""Lossless verification of one block of drafts (strict rejection sampling).

Spec section 5.1. Row `k` of the target's verify forward (over `[anchor, d_1 .. d_g]`)
gives `p_k`, the target distribution of draft `k` (0-based); row `g` is the bonus row.
For each draft `x_k ~ q_k`: accept with probability `min(1, p_k(x_k) / q_k(x_k))` (q clamped
to >= 1e-8); the accepted count `n` is the length of the all-accepted prefix. The next token
comes from `norm(max(0, p_n - q_n))` after a rejection (from `p_n` when that residual has
mass <= 1e-8, which happens only when `p_n` and `q_n` agree to within rounding), or from the
bonus row `p_n` when every verified draft was accepted. This keeps every emitted token
distributed exactly as the target's, whatever `q` is.

Greedy decoding is the special case `p`, `q` one-hot; it is computed directly as exact
match (accept while `x_k == argmax p_k`) so no draft distributions are needed.

Per-request verify lengths (from the scheduler) cut the block: drafts at positions
`>= lengths[b]` are ignored, and with all `lengths[b]` drafts accepted the next token is
drawn from row `lengths[b]`, the target distribution right after the last verified draft.
Shapes are static; the lengths are data.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jax_dspark.ops import _checks
from jax_dspark.ops.sampling import SamplingParams, gumbel_sample, probabilities

#: Floor for q(x) in the acceptance ratio (a token drawn from q always has q(x) > 0; the
#: clamp only guards rounding).
Q_FLOOR = 1e-8
#: Residual mass below which the next token falls back to the target distribution.
RESIDUAL_EPS = 1e-8
#: Value of the emitted-token slots beyond the n + 1 valid ones.
PAD_TOKEN = -1


class Verification(NamedTuple):
    """Outcome of verifying one block per request.

    Attributes:
      num_accepted: `i32[B]` accepted drafts `n` (0 .. lengths[b]); the round emits n + 1.
      next_token: `i32[B]` the token after the accepted drafts (residual or bonus sample);
        the next round's anchor.
      tokens: `i32[B, g + 1]` emitted tokens: drafts `0 .. n-1`, then `next_token` at
        column `n`, then `PAD_TOKEN`.
      valid: `bool[B, g + 1]` `column <= n`.
      accepted: `bool[B, g]` per-position acceptance of the prefix: `k < n` (the
        prefix-accept labels that acceptance statistics and STS calibration record).
    """

    num_accepted: jax.Array
    next_token: jax.Array
    tokens: jax.Array
    valid: jax.Array
    accepted: jax.Array


def verify(
    key: jax.Array,
    target_logits: jax.Array,
    draft_tokens: jax.Array,
    draft_probs: jax.Array | None,
    params: SamplingParams,
    lengths: jax.Array | None = None,
) -> Verification:
    """Verify a block of drafts against the target.

    Args:
      key: PRNG key (unused when greedy).
      target_logits: `[B, g + 1, V]` raw target logits of the verify rows (row `k` predicts
        draft `k`; row `g` is the bonus row). Processed here with `params`.
      draft_tokens: `i32[B, g]` drafts.
      draft_probs: `f32[B, g, V]` the distributions the drafts were drawn from
        (`Proposal.probs`); may be None when greedy.
      params: sampling parameters (static), the same the drafter used.
      lengths: `i32[B]` drafts to verify per request, `0 .. g` (values outside are
        clipped under jit, rejected when concrete); None verifies all `g`.
    Returns:
      `Verification`.
    """
    b, g1, v = _checks.check_rank("target_logits", target_logits, 3, "[B, g + 1, V]")
    _checks.check_floating("target_logits", target_logits)
    g = g1 - 1
    if _checks.shape_of(draft_tokens) != (b, g):
        _checks.fail("draft_tokens", f"shape must be ({b}, {g}) to match target_logits", _checks.shape_of(draft_tokens))
    greedy = params.greedy
    if not greedy:
        if draft_probs is None:
            _checks.fail("draft_probs", "required when sampling (temperature > 0)", None)
        if _checks.shape_of(draft_probs) != (b, g, v):
            _checks.fail("draft_probs", f"shape must be ({b}, {g}, {v})", _checks.shape_of(draft_probs))
    if lengths is None:
        lengths = jnp.full((b,), g, jnp.int32)
    else:
        if _checks.shape_of(lengths) != (b,):
            _checks.fail("lengths", f"shape must be ({b},)", _checks.shape_of(lengths))
        known = _checks.concrete(lengths)
        if known is not None and known.size and (known.min() < 0 or known.max() > g):
            _checks.fail("lengths", f"values must lie in [0, {g}]", known.tolist())
        lengths = jnp.clip(jnp.asarray(lengths, jnp.int32), 0, g)

    drafts = jnp.clip(draft_tokens.astype(jnp.int32), 0, v - 1)
    positions = jnp.arange(g, dtype=jnp.int32)
    in_window = positions[None, :] < lengths[:, None]
    rows = jnp.arange(b)

    if greedy:
        target_argmax = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)  # [B, g+1]
        ok = (draft_tokens.astype(jnp.int32) == target_argmax[:, :g]) & in_window
        n = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)
        next_token = target_argmax[rows, n]
    else:
        key_u, key_s = jax.random.split(key)
        p = probabilities(target_logits, params)  # [B, g+1, V] f32
        q = draft_probs.astype(jnp.float32)
        p_x = jnp.take_along_axis(p[:, :g], drafts[..., None], axis=-1)[..., 0]
        q_x = jnp.maximum(jnp.take_along_axis(q, drafts[..., None], axis=-1)[..., 0], Q_FLOOR)
        u = jax.random.uniform(key_u, (b, g), jnp.float32)
        ok = (u < p_x / q_x) & in_window
        n = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)
        p_n = p[rows, n]  # [B, V]
        q_n = q[rows, jnp.minimum(n, g - 1)] if g > 0 else jnp.zeros_like(p_n)
        residual = jnp.maximum(p_n - q_n, 0.0)
        mass = jnp.sum(residual, axis=-1, keepdims=True)
        rejected = (n < lengths)[:, None]
        use_residual = rejected & (mass > RESIDUAL_EPS)
        dist = jnp.where(use_residual, residual / jnp.where(use_residual, mass, 1.0), p_n)
        next_token = gumbel_sample(key_s, jnp.log(dist)).astype(jnp.int32)

    columns = jnp.arange(g + 1, dtype=jnp.int32)[None, :]
    padded_drafts = jnp.concatenate([draft_tokens.astype(jnp.int32), jnp.zeros((b, 1), jnp.int32)], axis=1)
    tokens = jnp.where(columns < n[:, None], padded_drafts,
                       jnp.where(columns == n[:, None], next_token[:, None], PAD_TOKEN))
    return Verification(
        num_accepted=n,
        next_token=next_token,
        tokens=tokens.astype(jnp.int32),
        valid=columns <= n[:, None],
        accepted=positions[None, :] < n[:, None],
    )
