"""Temperature / top-k / top-p transforms and sampling with explicit keys.

Speculative decoding is lossless only if the draft distribution q and the target
distribution p are built by the same transform, so there is exactly one
`process_logits` and every sampler in the project (target, drafter, verifier) calls it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jax_dspark.ops import _checks

GREEDY_TEMPERATURE = 1e-5


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How logits become a distribution. Static (hashable) so jit specialises on it.

    Attributes:
      temperature: 0 (or below 1e-5) means greedy: the distribution is one-hot at argmax.
      top_k: keep the k largest logits (0 = all). Ties at the k-th value are all kept.
      top_p: keep the smallest prefix of the sorted distribution whose mass reaches p
        (1.0 = all); the most likely token is always kept.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if not (np.isfinite(self.temperature) and self.temperature >= 0):
            _checks.fail("temperature", "must be finite and >= 0", self.temperature)
        if not (isinstance(self.top_k, int) and self.top_k >= 0):
            _checks.fail("top_k", "must be an int >= 0", self.top_k)
        if not (0 < self.top_p <= 1):
            _checks.fail("top_p", "must be in (0, 1]", self.top_p)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE


def process_logits(logits: jax.Array, params: SamplingParams) -> jax.Array:
    """`f32[..., V]` logits after temperature, top-k then top-p; removed entries are -inf.

    Greedy params return the logits unchanged (as f32): the argmax is all that matters.
    """
    _checks.check_floating("logits", logits)
    l = logits.astype(jnp.float32)
    if params.greedy:
        return l
    l = l / params.temperature
    v = l.shape[-1]
    if 0 < params.top_k < v:
        kth = jax.lax.top_k(l, params.top_k)[0][..., -1:]
        l = jnp.where(l < kth, -jnp.inf, l)
    if params.top_p < 1.0:
        sorted_l = -jnp.sort(-l, axis=-1)
        probs = jax.nn.softmax(sorted_l, axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        keep = mass_before < params.top_p
        threshold = jnp.min(jnp.where(keep, sorted_l, jnp.inf), axis=-1, keepdims=True)
        l = jnp.where(l < threshold, -jnp.inf, l)
    return l


def probabilities(logits: jax.Array, params: SamplingParams) -> jax.Array:
    """`f32[..., V]` distribution the sampler draws from (one-hot argmax when greedy)."""
    return draw_from_processed(None, process_logits(logits, params), params)[1]


def gumbel_sample(key: jax.Array, logits: jax.Array) -> jax.Array:
    """`int32[...]` draw from softmax(logits) by the Gumbel-max trick (-inf never drawn)."""
    g = jax.random.gumbel(key, logits.shape, jnp.float32)
    return jnp.argmax(logits.astype(jnp.float32) + g, axis=-1).astype(jnp.int32)


def sample(key: jax.Array, logits: jax.Array, params: SamplingParams) -> jax.Array:
    """`int32[...]` token per row: argmax when greedy, else a Gumbel draw from the processed logits."""
    return draw_from_processed(key, process_logits(logits, params), params)[0]


def draw_from_processed(
    key: jax.Array | None, processed: jax.Array, params: SamplingParams
) -> tuple[jax.Array, jax.Array]:
    """`(token int32[...], q f32[..., V])` from logits already through `process_logits`.

    The token is a draw from q exactly; callers that need both (the drafter's Markov chain)
    process once instead of sorting twice for top-p. `key` may be None when only q is
    used (the token is then the argmax, which is the draw only for greedy params).
    """
    if params.greedy:
        token = jnp.argmax(processed, axis=-1).astype(jnp.int32)
        return token, jax.nn.one_hot(token, processed.shape[-1], dtype=jnp.float32)
    q = jax.nn.softmax(processed, axis=-1)
    if key is None:
        return jnp.argmax(processed, axis=-1).astype(jnp.int32), q
    return gumbel_sample(key, processed), q
